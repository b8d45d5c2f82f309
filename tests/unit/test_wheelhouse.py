"""What a host installs: the project's wheel (repeatable, rebuilt only for changed sources), the
wheelhouse's pip command for other platforms, and the one-file pack that crosses to the hosts."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

from eagle3_pipeline import wheelhouse

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def checkout(tmp_path_factory) -> Path:
    """A copy of the sources a wheel is built from, free to change."""
    copy = tmp_path_factory.mktemp("checkout")
    for name in wheelhouse.WHEEL_SOURCES:
        source = ROOT / name
        if source.is_dir():
            shutil.copytree(source, copy / name, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
        else:
            shutil.copyfile(source, copy / name)
    return copy


def test_the_same_sources_give_the_same_wheel_and_a_change_gives_another(checkout, tmp_path):
    first = wheelhouse.build_project_wheel(checkout, tmp_path / "a")
    second = wheelhouse.build_project_wheel(checkout, tmp_path / "b")
    assert first.name == second.name and first.read_bytes() == second.read_bytes()
    with zipfile.ZipFile(first) as wheel:
        names = wheel.namelist()
    assert "eagle3_pipeline/wheelhouse.py" in names and not any("__pycache__" in n for n in names)
    assert not (checkout / "build").exists(), "the build wrote into the checkout"

    init = checkout / "src" / "eagle3_pipeline" / "__init__.py"
    original = init.read_text()
    init.write_text(original + "\nCHANGED = True\n")
    try:
        changed = wheelhouse.build_project_wheel(checkout, tmp_path / "c")
    finally:
        init.write_text(original)
    assert changed.read_bytes() != first.read_bytes()
    with zipfile.ZipFile(changed) as wheel:
        assert b"CHANGED = True" in wheel.read("eagle3_pipeline/__init__.py")


def test_a_removed_module_leaves_the_wheel(checkout, tmp_path):
    extra = checkout / "src" / "eagle3_pipeline" / "leftover_module.py"
    extra.write_text("X = 1\n")
    with_extra = wheelhouse.build_project_wheel(checkout, tmp_path / "a")
    extra.unlink()
    without = wheelhouse.build_project_wheel(checkout, tmp_path / "b")
    assert "eagle3_pipeline/leftover_module.py" in zipfile.ZipFile(with_extra).namelist()
    assert "eagle3_pipeline/leftover_module.py" not in zipfile.ZipFile(without).namelist()


def test_the_cache_builds_once_per_version_of_the_sources(checkout, tmp_path):
    cache = tmp_path / "cache"
    first = wheelhouse.cached_project_wheel(checkout, cache)
    mtime = first.stat().st_mtime_ns
    again = wheelhouse.cached_project_wheel(checkout, cache)
    assert again == first and again.stat().st_mtime_ns == mtime, "unchanged sources were built again"
    readme = checkout / "README.md"
    original = readme.read_text()
    readme.write_text(original + "\nmore\n")
    try:
        other = wheelhouse.cached_project_wheel(checkout, cache)
    finally:
        readme.write_text(original)
    assert other.parent != first.parent and not first.parent.exists(), "the stale build was kept"


def test_the_controller_side_runs_as_a_plain_script_with_the_standard_library(checkout, tmp_path):
    # The role runs the file with the controller's Python, which need not have this package installed:
    # -S leaves every installed package out of this process (pip runs in a child of its own).
    result = subprocess.run(
        [sys.executable, "-I", "-S", str(ROOT / "src" / "eagle3_pipeline" / "wheelhouse.py"), "project-wheel",
         "--source", str(checkout), "--cache", str(tmp_path)],
        capture_output=True, text=True, check=False,
    )
    assert result.returncode == 0, result.stderr
    built = json.loads(result.stdout)
    assert Path(built["path"]).is_file() and built["name"].startswith("eagle3_pipeline-")
    assert len(built["sha1"]) == 40


def test_the_download_is_for_the_hosts_python_and_platform(tmp_path):
    argv = wheelhouse.download_argv(tmp_path / "w.whl", tmp_path / "d", ["reference", "train"], "3.12",
                                    ["manylinux_2_28_x86_64"], [tmp_path / "pins.txt"], ["--index-url=https://x/simple"])
    assert argv[3:6] == ["download", "--dest", str(tmp_path / "d")]
    assert f"{tmp_path / 'w.whl'}[reference,train]" in argv
    assert ["--only-binary=:all:", "--python-version", "3.12", "--platform", "manylinux_2_28_x86_64"] == argv[7:12]
    assert argv[-3:] == ["--constraint", str(tmp_path / "pins.txt"), "--index-url=https://x/simple"]
    same_machine = wheelhouse.download_argv(tmp_path / "w.whl", tmp_path / "d", ["sglang", "train"], None, [], [], [])
    assert "--only-binary=:all:" not in same_machine


def test_the_extras_name_the_engine_and_refuse_an_unknown_one():
    assert wheelhouse.host_extras("reference") == ["reference", "train", "gpu"]
    assert wheelhouse.host_extras("sglang", gguf=True) == ["sglang", "train", "gpu", "gguf"]
    with pytest.raises(ValueError, match="unknown engine 'vllm': expected one of reference, sglang"):
        wheelhouse.host_extras("vllm")


def test_the_pack_holds_every_listed_file_and_the_manifest(tmp_path):
    house = tmp_path / "house"
    house.mkdir()
    (house / "a-1.0-py3-none-any.whl").write_bytes(b"a" * 10)
    (house / "b-2.0-py3-none-any.whl").write_bytes(b"b" * 20)
    (house / wheelhouse.MANIFEST).write_text(json.dumps({"files": {"a-1.0-py3-none-any.whl": {},
                                                                   "b-2.0-py3-none-any.whl": {}}}))
    packed = wheelhouse.pack(house, tmp_path / "out" / "house.tar")
    with tarfile.open(packed) as tar:
        names = ["a-1.0-py3-none-any.whl", "b-2.0-py3-none-any.whl", wheelhouse.MANIFEST]
        assert sorted(tar.getnames()) == sorted(names)
        assert tar.extractfile("b-2.0-py3-none-any.whl").read() == b"b" * 20
    assert not list((tmp_path / "out").glob(".*partial*"))


def test_the_command_refuses_a_missing_constraints_file(tmp_path, capsys):
    from eagle3_pipeline.cli import main

    assert main(["wheelhouse", str(tmp_path / "house"), "--constraint", str(tmp_path / "nope.txt")]) == 2
    assert f"the constraints file {tmp_path / 'nope.txt'} does not exist" in capsys.readouterr().err
