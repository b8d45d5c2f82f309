"""The report's PNG figures: the training's charts, copied, and the acceptance chart, drawn.

The training charts are the trainer's own (``train.charts``); when a run has metrics but no
charts (drawn with ``charts: false``, or matplotlib was missing then), they are drawn here from
its ``metrics.jsonl`` by the same code. The acceptance chart puts the measured probability that
each draft position is accepted beside the one the training simulates, with matplotlib's Agg
backend and no pyplot state.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

from eagle3_pipeline.report.inputs import AcceptanceComparison, TrainingSummary
from eagle3_pipeline.train.charts import (
    ACCEPTANCE_CHART,
    ACCURACY_CHART,
    LOSS_CHART,
    METRICS_FILE,
    figure_class,
    save_figure,
    write_charts,
)

MEASURED_CHART = "acceptance_measured_vs_simulated.png"
CAPTIONS = {
    LOSS_CHART: "Training loss per step (raw and running mean), held-out loss as markers.",
    ACCURACY_CHART: "Top-1 agreement with the target per draft position over the steps: alone (top) and "
                    "given the earlier positions right (bottom).",
    ACCEPTANCE_CHART: "Simulated acceptance length over the steps (from the conditional accuracies).",
    MEASURED_CHART: "Probability that draft position k is accepted: measured by speculative decoding "
                    "beside the training's simulation (running product of the conditional accuracies).",
}


@dataclass
class Figure:
    """A PNG in the report directory, with its caption, or the reason it is missing."""

    name: str
    caption: str
    reason: str | None = None


def training_figures(training: TrainingSummary, out_dir: Path) -> list[Figure]:
    """Copy the training's charts into ``out_dir`` (drawing them when the run has none)."""
    if training.metrics is None:
        return []
    if not training.charts:
        try:
            drawn = write_charts(training.directory / METRICS_FILE, out_dir)
        except (ImportError, ValueError, OSError) as exc:
            return [Figure(LOSS_CHART, CAPTIONS[LOSS_CHART], reason=f"training charts not drawn: {exc}")]
        return [Figure(path.name, CAPTIONS[path.name]) for path in drawn]
    figures = []
    for chart in training.charts:
        shutil.copyfile(chart, out_dir / chart.name)
        figures.append(Figure(chart.name, CAPTIONS.get(chart.name, chart.name)))
    return figures


def acceptance_figure(acceptance: AcceptanceComparison, out_dir: Path) -> Figure | None:
    """Draw measured vs simulated acceptance per draft position; None when nothing was measured."""
    if acceptance.measured_rates is None:
        return None
    try:
        make_figure = figure_class()
    except ImportError as exc:
        return Figure(MEASURED_CHART, CAPTIONS[MEASURED_CHART], reason=f"chart not drawn: {exc}")
    measured = acceptance.measured_rates
    simulated = (acceptance.simulated_rates or [])[: len(measured)]
    figure = make_figure(figsize=(9, 5), layout="constrained")
    axes = figure.add_subplot()
    width = 0.4 if simulated else 0.6
    positions = range(len(measured))
    axes.bar([k - width / 2 if simulated else k for k in positions], measured, width,
             color="tab:blue", label=f"measured (tau {acceptance.measured_tau:.2f})")
    if simulated:
        label = "simulated"
        if acceptance.simulated_tau is not None:
            label += f" (tau {acceptance.simulated_tau:.2f}"
            label += f", {acceptance.simulated_source})" if acceptance.simulated_source else ")"
        axes.bar([k + width / 2 for k in range(len(simulated))], simulated, width, color="tab:orange", label=label)
    axes.set_xticks(list(positions), [f"k={k}" for k in positions])
    axes.set_xlabel("draft position")
    axes.set_ylabel("P(accepted)")
    axes.set_ylim(0, 1.05)
    axes.set_title("Acceptance per draft position: measured vs simulated")
    axes.grid(True, axis="y", alpha=0.3)
    axes.legend(loc="upper right", fontsize="small")
    save_figure(figure, out_dir / MEASURED_CHART)
    return Figure(MEASURED_CHART, CAPTIONS[MEASURED_CHART])
