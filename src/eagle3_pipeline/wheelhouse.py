"""What a host installs, and the wheelhouse that carries it to hosts without a package registry.

A host gets this package with the extras of its engine (``reference``: torch and transformers;
``sglang``: SGLang, which brings its own torch), ``train`` (charts, TensorBoard) and ``gpu``
(nvidia-ml-py, which the GPU modules of gpu_reset use from this venv), plus ``gguf`` when its model
comes as a GGUF file. The lists live once, as the package's extras in pyproject.toml;
the role ``eagle3`` installs ``<this wheel>[extras]`` and pip resolves the rest.

``eagle3-pipeline wheelhouse --engine reference DIR`` downloads every distribution those extras need
into DIR, for the hosts' Python and platform (``--python-version``, ``--platform``: pip's own options;
default: this machine's), so that an air-gapped host installs with ``--no-index`` from a copy of DIR
(``eagle3_wheelhouse: DIR``). ``--constraint FILE`` pins versions (pip's constraints file), e.g. the
releases a site has tested. The package's own wheel is not kept in DIR: the role builds it from the
checkout on every run, so that a host always gets the code the controller has.

Project wheels are built reproducibly (zip timestamps from ``SOURCE_DATE_EPOCH``), so that the same
sources give the same bytes and a rerun copies nothing.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ENGINES = ("reference", "sglang")
# 1980-01-01, the earliest time a zip entry can hold: any fixed value makes builds repeatable.
SOURCE_DATE_EPOCH = "315532800"
MANIFEST = "wheelhouse.json"
WHEEL_NAME = re.compile(r"^eagle3_pipeline-[^-]+-py3-none-any\.whl$")


def host_extras(engine: str, gguf: bool = False, parquet: bool = False) -> list[str]:
    """The package's extras a host with ``engine`` installs (``gpu``: nvidia-ml-py for the GPU modules)."""
    if engine not in ENGINES:
        raise ValueError(f"unknown engine {engine!r}: expected one of {', '.join(ENGINES)}")
    return [engine, "train", "gpu"] + (["gguf"] if gguf else []) + (["parquet"] if parquet else [])


# What goes into the wheel: the package, its metadata and the readme pyproject.toml names.
WHEEL_SOURCES = ("pyproject.toml", "README.md", "src")


def source_files(source: Path) -> list[Path]:
    """The files of ``source`` that the wheel is built from, sorted (caches and bytecode left out)."""
    files = []
    for top in WHEEL_SOURCES:
        path = source / top
        if path.is_file():
            files.append(path)
        elif path.is_dir():
            files += [p for p in path.rglob("*") if p.is_file() and "__pycache__" not in p.parts
                      and not any(part.endswith(".egg-info") for part in p.parts) and p.suffix != ".pyc"]
    return sorted(files)


def source_hash(source: Path) -> str:
    """A hash of the wheel's sources (names and contents): the same hash, the same wheel."""
    digest = hashlib.sha256()
    for path in source_files(source):
        digest.update(str(path.relative_to(source)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:20]


def build_project_wheel(source: Path, dest_dir: Path, python: str = sys.executable) -> Path:
    """Build this project's wheel from ``source`` into ``dest_dir``; returns its path.

    Repeatable: the same sources give the same bytes, so a copy to a host changes it only when the
    code changed. The wheel appears whole (built elsewhere, then moved).
    """
    dest_dir.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, SOURCE_DATE_EPOCH=SOURCE_DATE_EPOCH, PIP_DISABLE_PIP_VERSION_CHECK="1")
    with tempfile.TemporaryDirectory(prefix="eagle3-wheel-") as tmp:
        # setuptools writes build/ and *.egg-info into the tree it builds, and packs stale files left
        # in build/ by earlier builds: build from a fresh copy of the sources, so that the checkout is
        # never written (it may belong to another user) and the wheel holds exactly these files.
        copy = Path(tmp) / "src"
        for path in source_files(source):
            target = copy / path.relative_to(source)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, target)
        out = Path(tmp) / "out"
        result = subprocess.run(
            [python, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(out), str(copy)],
            capture_output=True, text=True, env=env, check=False,
        )
        if result.returncode != 0:
            raise RuntimeError(f"building the wheel of {source} failed: {result.stderr.strip()[-2000:]}")
        (built,) = out.glob("eagle3_pipeline-*.whl")
        target = dest_dir / built.name
        tmp_target = dest_dir / f".{built.name}.partial"
        shutil.copyfile(built, tmp_target)
        os.replace(tmp_target, target)
    return target


def cached_project_wheel(source: Path, cache_dir: Path, python: str = sys.executable) -> Path:
    """The project's wheel for the current sources, built only when ``cache_dir`` has none for them."""
    slot = cache_dir / source_hash(source)
    found = sorted(p for p in slot.glob("eagle3_pipeline-*.whl") if WHEEL_NAME.match(p.name)) if slot.is_dir() else []
    if found:
        return found[0]
    wheel = build_project_wheel(source, slot, python)
    # Older builds are of no use: keep the cache to the current one.
    for old in cache_dir.iterdir():
        if old.is_dir() and old != slot:
            shutil.rmtree(old, ignore_errors=True)
    return wheel


def sha256(path: Path) -> str:
    """The file's SHA-256, hex."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def download_argv(wheel: Path, dest: Path, extras: list[str], python_versions: str | None,
                  platforms: list[str], constraints: list[Path], pip_args: list[str],
                  python: str = sys.executable) -> list[str]:
    """pip's command that downloads ``wheel[extras]`` and everything it needs into ``dest``."""
    argv = [python, "-m", "pip", "download", "--dest", str(dest), f"{wheel}[{','.join(extras)}]"]
    if python_versions or platforms:
        # Another Python or platform than this one: pip can only take wheels, never build sdists.
        argv += ["--only-binary=:all:"]
        if python_versions:
            argv += ["--python-version", python_versions]
        for platform in platforms:
            argv += ["--platform", platform]
    for constraint in constraints:
        argv += ["--constraint", str(constraint)]
    return argv + pip_args


def build_wheelhouse(source: Path, dest: Path, engine: str, gguf: bool = False, python_version: str | None = None,
                     platforms: list[str] | None = None, constraints: list[Path] | None = None,
                     pip_args: list[str] | None = None, parquet: bool = False) -> dict:
    """Download what a host with ``engine`` installs into ``dest``; returns the manifest written there."""
    extras = host_extras(engine, gguf, parquet)
    dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="eagle3-wheelhouse-") as tmp:
        wheel = build_project_wheel(source, Path(tmp))
        argv = download_argv(wheel, dest, extras, python_version, platforms or [], constraints or [], pip_args or [])
        result = subprocess.run(argv, capture_output=True, text=True, check=False,
                                env=dict(os.environ, PIP_DISABLE_PIP_VERSION_CHECK="1"))
        if result.returncode != 0:
            raise RuntimeError(
                f"pip could not download what a {engine} host needs ({' '.join(argv[3:])}): "
                f"{result.stderr.strip()[-3000:]}"
            )
    for stale in dest.iterdir():
        if WHEEL_NAME.match(stale.name):  # the role copies a fresh build of the package every run
            stale.unlink()
    files = sorted(p for p in dest.iterdir() if p.is_file() and p.name != MANIFEST)
    manifest = {
        "engine": engine, "extras": extras, "python_version": python_version or "%d.%d" % sys.version_info[:2],
        "platforms": platforms or ["this machine's"], "constraints": [str(c) for c in constraints or []],
        "files": {p.name: {"bytes": p.stat().st_size, "sha256": sha256(p)} for p in files},
    }
    (dest / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    return manifest


def path_arg(text: str) -> Path:
    """A path option's value, '' refused, as eagle3_pipeline.cli_args.path_arg does (this file also runs as a
    plain script with the standard library only, on the controller: it imports nothing of the package)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("an empty path (the variable behind it was left empty?): give a file or "
                                         "directory; an empty one would mean the working directory")
    return Path(text)


def configure_parser(parser: argparse.ArgumentParser) -> None:
    """Options of ``eagle3-pipeline wheelhouse``."""
    parser.add_argument("dest", type=path_arg, help="directory to download into (created; existing files are reused)")
    parser.add_argument("--engine", choices=ENGINES, default="reference", help="the hosts' engine (default: reference)")
    parser.add_argument("--gguf", action="store_true", help="also what import-gguf needs (gguf, accelerate)")
    parser.add_argument("--parquet", action="store_true",
                        help="also pyarrow, for Parquet and Arrow datasets (the hosts' eagle3_parquet)")
    parser.add_argument("--python-version", help="the hosts' Python, e.g. 3.11 (default: this one's)")
    parser.add_argument("--platform", action="append", default=[],
                        help="the hosts' platform tag, e.g. manylinux_2_28_x86_64 (repeatable; default: this one's)")
    parser.add_argument("--constraint", action="append", default=[], type=path_arg,
                        help="a pip constraints file pinning versions (repeatable)")
    parser.add_argument("--pip-arg", action="append", default=[],
                        help="one more argument for pip download, e.g. --index-url=URL (repeatable)")
    parser.add_argument("--source", type=path_arg, default=None, help="the project checkout (default: this one)")


def run(args: argparse.Namespace) -> int:
    """Download the wheelhouse and print what it holds."""
    from eagle3_pipeline import project_root  # noqa: PLC0415

    for constraint in args.constraint:
        if not constraint.is_file():
            print(f"error: the constraints file {constraint} does not exist", file=sys.stderr)
            return 2
    try:
        manifest = build_wheelhouse(args.source or project_root(), args.dest, args.engine, args.gguf,
                                    args.python_version, args.platform, args.constraint, args.pip_arg, args.parquet)
    except (RuntimeError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    total = sum(f["bytes"] for f in manifest["files"].values())
    print(f"{args.dest}: {len(manifest['files'])} distributions, {total / 1e6:,.0f} MB, for the {args.engine} engine "
          f"(extras {','.join(manifest['extras'])}); on the hosts: eagle3_wheelhouse: {args.dest.resolve()}")
    return 0


def pack(wheelhouse: Path, output: Path) -> Path:
    """One uncompressed tar of the wheelhouse's files (wheels are compressed already), written whole.

    One file crosses to a host in one transfer; copying the directory would cost two module runs per
    file on every run, a minute and more over SSH for a wheelhouse of torch and its fifty companions.
    """
    import tarfile  # noqa: PLC0415

    manifest = json.loads((wheelhouse / MANIFEST).read_text())
    output.parent.mkdir(parents=True, exist_ok=True)
    partial = output.with_name(f".{output.name}.partial-{os.getpid()}")
    with tarfile.open(partial, "w") as tar:
        for name in sorted(manifest["files"]) + [MANIFEST]:
            tar.add(wheelhouse / name, arcname=name)
    os.replace(partial, output)
    return output


def main(argv: list[str] | None = None) -> int:
    """The controller's side of the role ``eagle3``, printing JSON.

    ``project-wheel --source DIR --cache DIR`` builds (or finds) the project's wheel for the current
    sources; ``pack --wheelhouse DIR --output FILE`` packs a wheelhouse for the copy to the hosts. The
    role runs this file with the controller's Python, which need not have this package installed: it
    uses the standard library only.
    """
    parser = argparse.ArgumentParser(description="the controller's side of the install: the wheel, the wheelhouse")
    parser.add_argument("action", choices=["project-wheel", "pack"])
    parser.add_argument("--source", type=path_arg)
    parser.add_argument("--cache", type=path_arg)
    parser.add_argument("--wheelhouse", type=path_arg)
    parser.add_argument("--output", type=path_arg)
    args = parser.parse_args(argv)
    try:
        if args.action == "pack":
            packed = pack(args.wheelhouse, args.output)
            print(json.dumps({"path": str(packed), "bytes": packed.stat().st_size}))
            return 0
        wheel = cached_project_wheel(args.source.resolve(), args.cache)
    except (RuntimeError, OSError, ValueError, KeyError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(json.dumps({"path": str(wheel), "name": wheel.name, "sha1": hashlib.sha1(wheel.read_bytes()).hexdigest()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
