"""The ``eagle3-pipeline`` command: runs the pipeline's stages (``run``, ``status``) and its steps' commands."""

from __future__ import annotations

import argparse
import json
import sys

from eagle3_pipeline import __version__, project_root
from eagle3_pipeline.cli_args import path_arg
from eagle3_pipeline.runner import STAGES, runner_path  # noqa: F401 - runner_path: the tests' runs import it here


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


def add_run_options(parser: argparse.ArgumentParser) -> None:
    """The options of ``run`` (and of its alias ``gpu-reset``): Ansible's, as ansible-playbook spells them."""
    parser.add_argument("-i", "--inventory", type=path_arg, default=project_root() / "inventory" / "local.yml",
                        help="inventory file (default: the embedded inventory/local.yml)")
    parser.add_argument("-e", "--extra-var", action="append", default=[], metavar="KEY=VALUE",
                        help="an extra variable; VALUE is read as JSON when it parses (repeatable)")
    parser.add_argument("--check", action="store_true", help="Ansible's check mode: report what would change")
    parser.add_argument("-t", "--tags", help="run only the tasks with these tags (comma-separated)")
    parser.add_argument("--skip-tags", help="skip the tasks with these tags (comma-separated)")
    parser.add_argument("-l", "--limit", help="run on these hosts only (an Ansible pattern)")
    parser.add_argument("-v", "--verbose", action="store_true", help="also show skipped tasks and retries")


def run_stage(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """Run one stage through the Python API with a live progress display; 0 on success."""
    from eagle3_pipeline.run_display import ProgressDisplay  # noqa: PLC0415
    from eagle3_pipeline.runner import PipelineError, run  # noqa: PLC0415

    if not args.inventory.exists():
        parser.error(f"inventory {args.inventory} does not exist")
    extravars = parse_extravars(args.extra_var)
    display = ProgressDisplay(sys.stdout, tty=sys.stdout.isatty(), verbose=args.verbose)
    try:
        result = run(args.stage, inventory=args.inventory, extravars=extravars, on_event=display, check=args.check,
                     tags=args.tags, skip_tags=args.skip_tags, limit=args.limit)
    except PipelineError as exc:
        display.close()
        if exc.result is not None:
            display.finish(args.stage, exc.result.status, args.check, exc.result.paths)
        print(f"error: {exc}", file=sys.stderr)
        return (exc.result.rc if exc.result is not None else 0) or 1
    except (FileNotFoundError, ValueError) as exc:
        display.close()
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        display.close()
        print(f"error: stage {args.stage} interrupted; run it again to resume", file=sys.stderr)
        return 130
    display.finish(args.stage, result.status, args.check, result.paths)
    return 0


def show_status(args: argparse.Namespace) -> int:
    """Print each stage's state read from an output directory: 0, or 1 when a stage failed, 2 with no directory."""
    from eagle3_pipeline.status import FAILED, format_status, pipeline_status, status_document  # noqa: PLC0415

    try:
        stages = pipeline_status(args.output_dir)
    except FileNotFoundError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(status_document(args.output_dir), indent=1, sort_keys=True))
    else:
        print(format_status(stages))
    return 1 if any(stage.state == FAILED for stage in stages) else 0


# Commands implemented in their own modules, imported only when used (some need torch).
# Each module defines configure_parser(parser) and run(args) -> int, or, with a third item
# SUFFIX, configure_SUFFIX(parser) and run_SUFFIX(args).
MODULE_COMMANDS = {
    "extract": ("eagle3_pipeline.extract.job", "extract verified hidden states of a dataset through the server"),
    "extract-merge": ("eagle3_pipeline.extract.commands", "merge the parts' manifests into data_config.json",
                      "merge"),
    "verify": ("eagle3_pipeline.extract.commands", "re-check an extracted dataset against its manifest", "verify"),
    "progress": ("eagle3_pipeline.extract.commands", "show an extraction's progress", "progress"),
    "convert-storage": ("eagle3_pipeline.extract.convert",
                        "store an extracted dataset's hidden states as float8 (half the bytes), in place or in a copy"),
    "regenerate": ("eagle3_pipeline.regenerate.job",
                   "answer every assistant turn of a dataset again with the target itself, through its server"),
    "regenerate-merge": ("eagle3_pipeline.regenerate.job",
                         "merge the regeneration's parts into regenerated.jsonl and regeneration.json", "merge"),
    "train": ("eagle3_pipeline.train.command", "train the EAGLE-3 drafter on extracted hidden states"),
    "train-charts": ("eagle3_pipeline.train.charts", "draw a training run's charts from its metrics.jsonl"),
    "evaluate": ("eagle3_pipeline.evaluate.command", "measure the drafter by real speculative decoding"),
    "report": ("eagle3_pipeline.report.command", "write the run's self-contained HTML report"),
    "tiny-model": ("eagle3_pipeline.models.tiny", "build the embedded tiny target model (cached)"),
    "import-gguf": ("eagle3_pipeline.models.gguf_import",
                    "convert a GGUF model file into a checked Hugging Face checkpoint directory"),
    "demo-dataset": ("eagle3_pipeline.data.demo_dataset", "write the demo conversations (ShareGPT JSONL)"),
    "serve-reference": ("eagle3_pipeline.engine.reference_server", "run the reference engine's HTTP server"),
    "supervise": ("eagle3_pipeline.serve.supervisor", "start, stop or inspect a supervised server process"),
    "wheelhouse": ("eagle3_pipeline.wheelhouse",
                   "download what the hosts install into a directory, for hosts without a package registry"),
}


def main(argv: list[str] | None = None) -> int:
    """Entry point of the console script."""
    import importlib  # noqa: PLC0415

    parser = argparse.ArgumentParser(prog="eagle3-pipeline", description=__doc__)
    parser.add_argument("--version", action="version", version=f"eagle3-pipeline {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    run_parser = sub.add_parser("run", help="run a stage of the pipeline (default: site, the whole pipeline)",
                                description="Run a stage of the pipeline through ansible-runner, showing its progress.")
    run_parser.add_argument("stage", nargs="?", default="site", choices=list(STAGES),
                            help="site (everything) or one stage's playbook (default: site)")
    add_run_options(run_parser)
    reset = sub.add_parser("gpu-reset", help="free the GPUs of the inventory's gpu_hosts (the same as run gpu-reset)")
    add_run_options(reset)
    reset.set_defaults(stage="gpu-reset")
    status = sub.add_parser("status", help="show where a pipeline run stands, from its output directory")
    status.add_argument("output_dir", type=path_arg, help="the pipeline's output directory, e.g. output/demo")
    status.add_argument("--json", action="store_true", help="print the status as JSON")
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
    if args.command == "status":
        return show_status(args)
    return run_stage(parser, args)


if __name__ == "__main__":
    sys.exit(main())
