"""``eagle3-pipeline report``: write the run's self-contained HTML report.

``--output-dir OUT`` is the run's output directory (``output/demo`` for ``make demo``): the
report goes to ``OUT/report/index.html`` with its PNGs beside it, and every input defaults to its
place under OUT (``gpu_reset/``, ``data/``, ``drafter-run/``, ``evaluation/``); each can be
pointed elsewhere. Missing inputs are not errors: their section says "not measured" and why.

Exit codes: 0 written or already up to date, 2 bad options or settings (nothing written),
1 the report could not be written (the message names the file).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from eagle3_pipeline.cli_args import path_arg
from eagle3_pipeline.report.build import INDEX_FILE, REPORT_DIR, build_report, result_json
from eagle3_pipeline.report.inputs import SettingsError, read_inputs, read_settings

EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT = 0, 1, 2
DEFAULT_DIRS = {"gpu_reset_dir": "gpu_reset", "data_dir": "data", "training_dir": "drafter-run",
                "evaluation_dir": "evaluation"}


def configure_parser(parser: argparse.ArgumentParser) -> None:
    """The command's options; the report role passes each from its ``report_*`` variable."""
    add = parser.add_argument
    add("--output-dir", type=path_arg, required=True, metavar="OUT",
        help=f"the run's output directory: the report is written to OUT/{REPORT_DIR}/{INDEX_FILE}")
    add("--gpu-reset-dir", type=path_arg, metavar="DIR",
        help="the gpu_reset role's JSON reports, one per host, in subdirectories or not (default: OUT/gpu_reset)")
    add("--data-dir", type=path_arg,
        metavar="DIR", help="the extraction's output, data_config.json (default: OUT/data)")
    add("--training-dir", type=path_arg, metavar="DIR",
        help="the training's output: training.json, metrics.jsonl, charts/ (default: OUT/drafter-run)")
    add("--evaluation-dir", type=path_arg, metavar="DIR",
        help="the evaluation's output, evaluation.json (default: OUT/evaluation)")
    add("--drafter-dir", type=path_arg, metavar="DIR",
        help="the exported drafter (default: the drafter_dir training.json records, else TRAINING_DIR/drafter)")
    add("--target-model-path", metavar="PATH",
        help="the target model for the serving command (default: the one data_config.json names)")
    add("--settings-json", metavar="FILE",
        help="the run's variables as a JSON object, '-' for stdin; keys naming secrets (api_key, token, "
             "password, secret) are dropped at any depth")
    add("--check", action="store_true", help="say whether the report would change; write nothing")
    add("--force", action="store_true", help="write the report even when its inputs are unchanged")
    add("--json", action="store_true", help="print one JSON line (for the role) instead of a sentence")


def _absolute(path: Path) -> Path:
    """An absolute path with ``..`` folded (the roles pass paths like ``playbooks/../output``)."""
    return Path(os.path.abspath(path))


def run(args: argparse.Namespace) -> int:
    """Read the inputs, write the report when they changed, print where it is."""
    out = _absolute(args.output_dir)
    dirs = {key: _absolute(getattr(args, key) or out / name) for key, name in DEFAULT_DIRS.items()}
    try:
        settings = read_settings(args.settings_json)
    except SettingsError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    inputs = read_inputs(out, settings, dirs["gpu_reset_dir"], dirs["data_dir"], dirs["training_dir"],
                         dirs["evaluation_dir"], args.drafter_dir and _absolute(args.drafter_dir),
                         args.target_model_path and os.path.normpath(args.target_model_path))
    try:
        result = build_report(inputs, out / REPORT_DIR, check=args.check, force=args.force)
    except OSError as exc:
        print(f"error: cannot write the report into {out / REPORT_DIR}: {exc}", file=sys.stderr)
        return EXIT_FAILED
    if args.json:
        print(result_json(result, inputs))
    elif args.check:
        print(f"report: {result.index} would be {'rewritten' if result.written else 'left as it is'}")
    else:
        print(f"report: {result.index} ({'written' if result.written else 'unchanged'})")
    return EXIT_OK
