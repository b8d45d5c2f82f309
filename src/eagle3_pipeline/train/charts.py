"""PNG charts of a training run, drawn from its ``metrics.jsonl`` with matplotlib's Agg backend.

``write_charts(metrics_path, out_dir)`` writes three files into ``out_dir``:

    loss.png                train loss (raw, faint, and its running mean) with eval loss markers
    acc_per_position.png    top-1 agreement per TTT position over steps (top) and the same given
                            the earlier positions right (bottom); train lines, eval markers
    acceptance_length.png   the simulated acceptance length, train and eval

Reading is forgiving of how runs end: a line that does not parse (the torn last line of a killed
run) is skipped, and a train step that goes back (a resumed run whose metrics were not cut back)
drops every record at that step and past it, so the newest run's records win, as in TensorBoard.

Each PNG is written to a temp file beside it and renamed into place. matplotlib is an optional
package (the ``train`` extra) imported only when charts are drawn, so the CLI starts fast.
Command: ``eagle3-pipeline train-charts --output-dir OUT`` (reads OUT/metrics.jsonl, writes
OUT/charts/*.png and prints their paths).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

from eagle3_pipeline.atomic import atomic_write
from eagle3_pipeline.cli_args import path_arg

METRICS_FILE = "metrics.jsonl"
CHARTS_DIR = "charts"
LOSS_CHART = "loss.png"
ACCURACY_CHART = "acc_per_position.png"
ACCEPTANCE_CHART = "acceptance_length.png"
INSTALL_HINT = "pip install matplotlib (or pip install -e '.[train]')"
DPI = 100
# The running mean spans about this fraction of the run's train steps, within these bounds.
SMOOTHING_FRACTION = 0.02
SMOOTHING_MIN, SMOOTHING_MAX = 1, 200
# Loss on a log axis once it spans this factor (early TTT losses are often 10-100x the final ones).
LOG_SCALE_RATIO = 20.0


class ChartsUnavailable(ImportError):
    """matplotlib is missing; the message names the fix."""


@dataclass
class RunMetrics:
    """The records of one ``metrics.jsonl``, by kind, ordered by step, one per step."""

    path: Path
    train: list[dict] = field(default_factory=list)
    eval: list[dict] = field(default_factory=list)
    skipped_lines: int = 0  # lines that did not parse or were no train/eval record


def read_metrics(metrics_path: str | os.PathLike) -> RunMetrics:
    """Read ``metrics.jsonl``; skip lines that do not parse; the last record of a step wins.

    A train record whose step is not past the last train step seen starts over from that step:
    the train and eval records at that step and later are dropped before it is added.
    """
    path = Path(metrics_path)
    records: dict[str, dict[int, dict]] = {"train": {}, "eval": {}}
    skipped = 0
    last_train_step = None
    with path.open(encoding="utf-8", errors="replace") as lines:
        for line in lines:
            record = _parse(line)
            if record is None:
                skipped += line.strip() != ""
                continue
            kind, step = record["kind"], record["step"]
            if kind == "train" and last_train_step is not None and step <= last_train_step:
                for by_step in records.values():
                    for stale in [s for s in by_step if s >= step]:
                        del by_step[stale]
            if kind == "train":
                last_train_step = step
            records[kind][step] = record
    return RunMetrics(
        path=path,
        train=[records["train"][s] for s in sorted(records["train"])],
        eval=[records["eval"][s] for s in sorted(records["eval"])],
        skipped_lines=skipped,
    )


def _parse(line: str) -> dict | None:
    """One train or eval record, or None for a line that is torn, blank or of another kind."""
    try:
        record = json.loads(line)
    except ValueError:
        return None
    if not isinstance(record, dict) or record.get("kind") not in ("train", "eval"):
        return None
    step = record.get("step")
    if isinstance(step, bool) or not isinstance(step, int):
        return None
    return record


def running_mean(values: list[float], window: int) -> list[float]:
    """Trailing mean over the last ``window`` values, ignoring NaN and inf (NaN where all are)."""
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    out = []
    total, count = 0.0, 0
    for i, value in enumerate(values):
        if math.isfinite(value):
            total += value
            count += 1
        if i >= window:
            old = values[i - window]
            if math.isfinite(old):
                total -= old
                count -= 1
        out.append(total / count if count else math.nan)
    return out


def smoothing_window(num_steps: int) -> int:
    """The running mean's window for a run of ``num_steps`` train records."""
    return max(SMOOTHING_MIN, min(SMOOTHING_MAX, round(num_steps * SMOOTHING_FRACTION)))


def write_charts(metrics_path: str | os.PathLike, out_dir: str | os.PathLike) -> list[Path]:
    """Draw the run's charts into ``out_dir`` and return their paths (loss, accuracy, acceptance).

    Raises ``ValueError`` naming the file when it holds no train or eval record, and
    ``ChartsUnavailable`` when matplotlib is missing.
    """
    metrics = read_metrics(metrics_path)
    if not metrics.train and not metrics.eval:
        raise ValueError(
            f"{metrics.path}: no train or eval record to chart "
            f"({metrics.skipped_lines} line(s) that did not parse); has the trainer run a step yet?"
        )
    make_figure = figure_class()
    out = Path(out_dir)
    charts = [
        (LOSS_CHART, _draw_loss),
        (ACCURACY_CHART, _draw_accuracy),
        (ACCEPTANCE_CHART, _draw_acceptance),
    ]
    paths = []
    for name, draw in charts:
        figure = draw(make_figure, metrics)
        paths.append(save_figure(figure, out / name))
    return paths


def figure_class():
    """matplotlib's ``Figure`` bound to the Agg canvas (no display, no pyplot state); the report draws with it too."""
    try:
        import matplotlib  # noqa: F401, PLC0415 - the package first, so a missing one fails here
        from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: PLC0415
        from matplotlib.figure import Figure  # noqa: PLC0415
    except ImportError as exc:
        raise ChartsUnavailable(f"training charts need matplotlib ({exc}); fix: {INSTALL_HINT}") from exc

    def agg_figure(**kwargs):
        figure = Figure(**kwargs)
        FigureCanvasAgg(figure)
        return figure

    return agg_figure


def save_figure(figure, target: Path) -> Path:
    """Write ``figure`` as a PNG at ``target``, atomically (the report saves its chart with it too)."""
    # The temp file's name ends in .tmp, so the format is given, not guessed from the name.
    return atomic_write(target, lambda tmp: figure.savefig(tmp, format="png", dpi=DPI))


def _series(records: list[dict], name: str, k: int | None = None) -> tuple[list[int], list[float]]:
    """Steps and values of one field (position ``k`` of a per-position field) where records have it."""
    steps, values = [], []
    for record in records:
        value = record.get(name)
        if k is not None:
            value = value[k] if isinstance(value, list) and k < len(value) else None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        steps.append(record["step"])
        values.append(float(value))
    return steps, values


def _positions(metrics: RunMetrics, name: str) -> int:
    """How many TTT positions the run's records have for a per-position field."""
    lengths = [len(r[name]) for r in metrics.train + metrics.eval if isinstance(r.get(name), list)]
    return max(lengths, default=0)


def _draw_train_and_eval(axes, metrics: RunMetrics, name: str, label: str, color: str) -> list[float]:
    """Raw train values (faint), their running mean, eval markers; returns the values drawn."""
    steps, values = _series(metrics.train, name)
    if steps:
        window = smoothing_window(len(values))
        axes.plot(steps, values, color=color, alpha=0.25, linewidth=0.8, label=f"train {label} (raw)")
        axes.plot(steps, running_mean(values, window), color=color, linewidth=1.8,
                  label=f"train {label} (mean of {window} steps)")
    eval_steps, eval_values = _series(metrics.eval, name)
    if eval_steps:
        axes.plot(eval_steps, eval_values, linestyle="--", marker="o", color="tab:red", markersize=5,
                  linewidth=1.0, label=f"eval {label} (held out)")
    return values + eval_values


def _draw_loss(figure_class, metrics: RunMetrics):
    figure = figure_class(figsize=(10, 5.5), layout="constrained")
    axes = figure.add_subplot()
    values = [v for v in _draw_train_and_eval(axes, metrics, "loss", "loss", "tab:blue") if math.isfinite(v)]
    if values and min(values) > 0 and max(values) / min(values) >= LOG_SCALE_RATIO:
        axes.set_yscale("log")
    axes.set_title(f"EAGLE-3 drafter loss: {_run_name(metrics)}")
    axes.set_xlabel("step")
    axes.set_ylabel("loss (log scale)" if axes.get_yscale() == "log" else "loss")
    axes.grid(True, which="both", alpha=0.3)
    _legend(axes)
    return figure


def _draw_accuracy(figure_class, metrics: RunMetrics):
    figure = figure_class(figsize=(11, 9), layout="constrained")
    top, bottom = figure.subplots(2, 1, sharex=True)
    panels = [
        (top, "acc_k", "top-1 agreement with the target at TTT position k"),
        (bottom, "cond_acc_k", "top-1 agreement at position k given positions 0..k-1 right"),
    ]
    window = smoothing_window(len(metrics.train))
    for axes, name, title in panels:
        positions = _positions(metrics, name)
        colors = [_position_color(k, positions) for k in range(positions)]
        for k in range(positions):
            steps, values = _series(metrics.train, name, k)
            if steps:
                axes.plot(steps, running_mean(values, window), color=colors[k], linewidth=1.4, label=f"k={k}")
            eval_steps, eval_values = _series(metrics.eval, name, k)
            if eval_steps:
                axes.plot(eval_steps, eval_values, linestyle="none", marker="o", markersize=5, color=colors[k],
                          markeredgecolor="black", markeredgewidth=0.6, label=None if steps else f"k={k}")
        if metrics.eval:
            # One legend entry for all eval markers, rather than one per position.
            axes.plot([], [], linestyle="none", marker="o", color="grey", markeredgecolor="black",
                      label="eval (held out), markers")
        axes.set_title(title)
        axes.set_ylabel(name)
        axes.set_ylim(-0.02, 1.02)
        axes.grid(True, alpha=0.3)
        _legend(axes, ncols=2)
    bottom.set_xlabel("step")
    figure.suptitle(f"EAGLE-3 drafter accuracy per position: {_run_name(metrics)}\n"
                    f"train: lines, mean of {window} steps; eval: markers")
    return figure


def _draw_acceptance(figure_class, metrics: RunMetrics):
    figure = figure_class(figsize=(10, 5.5), layout="constrained")
    axes = figure.add_subplot()
    _draw_train_and_eval(axes, metrics, "acceptance_length", "acceptance length", "tab:green")
    axes.set_title(f"Simulated acceptance length (sum over k of prod cond_acc up to k): {_run_name(metrics)}")
    axes.set_xlabel("step")
    axes.set_ylabel("acceptance length (draft tokens)")
    axes.set_ylim(bottom=0)
    axes.grid(True, alpha=0.3)
    _legend(axes)
    return figure


def _run_name(metrics: RunMetrics) -> str:
    """The run's name in titles: its output dir's name (the full path can be too long to show)."""
    return metrics.path.resolve().parent.name or str(metrics.path)


def _position_color(k: int, positions: int):
    import matplotlib  # noqa: PLC0415 - loaded already by figure_class

    return matplotlib.colormaps["viridis"](k / max(1, positions - 1) * 0.9)


def _legend(axes, **kwargs) -> None:
    if axes.get_legend_handles_labels()[0]:
        axes.legend(loc="best", fontsize="small", **kwargs)


def configure_parser(parser: argparse.ArgumentParser) -> None:
    """Options of ``eagle3-pipeline train-charts``."""
    parser.add_argument("--output-dir", type=path_arg, required=True, metavar="OUT",
                        help=f"the training output dir: reads OUT/{METRICS_FILE}, writes OUT/{CHARTS_DIR}/*.png")


def run(args: argparse.Namespace) -> int:
    """Write the charts of ``args.output_dir`` and print their paths."""
    metrics_path = args.output_dir / METRICS_FILE
    try:
        paths = write_charts(metrics_path, args.output_dir / CHARTS_DIR)
    except FileNotFoundError:
        print(f"error: {metrics_path} does not exist; is --output-dir the trainer's output dir?", file=sys.stderr)
        return 2
    except (ValueError, ImportError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for path in paths:
        print(path)
    return 0
