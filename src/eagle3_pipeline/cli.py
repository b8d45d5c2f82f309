"""The ``eagle3-pipeline`` command: runs the project's playbooks through ansible-runner."""

from __future__ import annotations

import argparse
import json
import os
import sys
import sysconfig
import tempfile
from pathlib import Path

from eagle3_pipeline import __version__, project_root

PLAYBOOKS = {"gpu-reset": "gpu_reset.yml"}


def parse_extravars(pairs: list[str]) -> dict:
    """KEY=VALUE pairs to a dict; VALUE is read as JSON when it parses (numbers, lists, booleans)."""
    extravars = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise SystemExit(f"error: -e expects KEY=VALUE, got {pair!r}")
        try:
            extravars[key] = json.loads(value)
        except json.JSONDecodeError as exc:
            # A list or dict with a typo would otherwise reach Ansible as a plain string.
            if value.lstrip().startswith(("[", "{")):
                raise SystemExit(
                    f"error: -e {key}: {value!r} looks like a JSON list or object but does not parse ({exc}); "
                    f'write it as JSON, e.g. -e \'{key}=["a", "b"]\''
                ) from None
            extravars[key] = value
    return extravars


def runner_path() -> str:
    """PATH for the playbook run, led by this Python's scripts directory.

    ansible-runner looks ``ansible-playbook`` up on PATH; a venv's console script run without
    activating the venv would otherwise find none (or another installation's).
    """
    scripts = sysconfig.get_path("scripts")
    return os.pathsep.join([scripts, os.environ.get("PATH", os.defpath)])


def run_playbook(name: str, inventory: Path, extravars: dict, check: bool) -> int:
    """Run one playbook of the project with ansible-runner, streaming Ansible's output; return its rc."""
    try:
        import ansible_runner  # noqa: PLC0415 - only needed for this command
    except ImportError:
        raise SystemExit(
            "error: ansible-runner is not installed; run `make venv` and use .venv/bin/eagle3-pipeline"
        ) from None
    root = project_root()
    envvars = {"ANSIBLE_CONFIG": str(root / "ansible.cfg"), "PATH": runner_path()}
    if not sys.stdout.isatty():
        # ansible-runner gives ansible-playbook a pseudo-terminal: colours would land in logs.
        envvars["ANSIBLE_NOCOLOR"] = "1"
    with tempfile.TemporaryDirectory(prefix="eagle3-runner-") as private:
        result = ansible_runner.run(
            private_data_dir=private,
            project_dir=str(root),
            playbook=str(root / "playbooks" / PLAYBOOKS[name]),
            inventory=str(inventory.resolve()),
            extravars=extravars,
            cmdline="--check" if check else None,
            envvars=envvars,
            quiet=False,
        )
    return 0 if result.status == "successful" else (result.rc or 1)


# Commands implemented in their own modules, imported only when used (some need torch).
# Each module defines configure_parser(parser) and run(args) -> int, or, with a third item
# SUFFIX, configure_SUFFIX(parser) and run_SUFFIX(args).
MODULE_COMMANDS = {
    "extract": ("eagle3_pipeline.extract.job", "extract verified hidden states of a dataset through the server"),
    "extract-merge": ("eagle3_pipeline.extract.commands", "merge the parts' manifests into data_config.json",
                      "merge"),
    "verify": ("eagle3_pipeline.extract.commands", "re-check an extracted dataset against its manifest", "verify"),
    "progress": ("eagle3_pipeline.extract.commands", "show an extraction's progress", "progress"),
    "train": ("eagle3_pipeline.train.command", "train the EAGLE-3 drafter on extracted hidden states"),
    "train-charts": ("eagle3_pipeline.train.charts", "draw a training run's charts from its metrics.jsonl"),
    "tiny-model": ("eagle3_pipeline.models.tiny", "build the embedded tiny target model (cached)"),
    "demo-dataset": ("eagle3_pipeline.data.demo_dataset", "write the demo conversations (ShareGPT JSONL)"),
    "serve-reference": ("eagle3_pipeline.engine.reference_server", "run the reference engine's HTTP server"),
    "supervise": ("eagle3_pipeline.serve.supervisor", "start, stop or inspect a supervised server process"),
}


def main(argv: list[str] | None = None) -> int:
    """Entry point of the console script."""
    import importlib  # noqa: PLC0415

    parser = argparse.ArgumentParser(prog="eagle3-pipeline", description=__doc__)
    parser.add_argument("--version", action="version", version=f"eagle3-pipeline {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    reset = sub.add_parser("gpu-reset", help="free the GPUs of the inventory's gpu_hosts (playbooks/gpu_reset.yml)")
    reset.add_argument("-i", "--inventory", type=Path, default=project_root() / "inventory" / "local.yml")
    reset.add_argument("-e", "--extra-var", action="append", default=[], metavar="KEY=VALUE")
    reset.add_argument("--check", action="store_true", help="report what would be stopped, signal nothing")
    # Only the chosen command's module is imported: the others may need torch, and --help stays fast.
    given = sys.argv[1:] if argv is None else argv
    chosen = next((arg for arg in given if not arg.startswith("-")), None)
    modules = {}
    for name, (module_name, help_text, *suffix) in MODULE_COMMANDS.items():
        command_parser = sub.add_parser(name, help=help_text, description=help_text)
        if name == chosen:
            module = importlib.import_module(module_name)
            tail = f"_{suffix[0]}" if suffix else "_parser"
            getattr(module, f"configure{tail}")(command_parser)
            modules[name] = getattr(module, f"run_{suffix[0]}" if suffix else "run")
    args = parser.parse_args(argv)
    if args.command in modules:
        return modules[args.command](args)
    if not args.inventory.exists():
        parser.error(f"inventory {args.inventory} does not exist")
    return run_playbook(args.command, args.inventory, parse_extravars(args.extra_var), args.check)


if __name__ == "__main__":
    sys.exit(main())
