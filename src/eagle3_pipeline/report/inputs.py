"""What the report reads: the records each stage of a run leaves, read forgivingly.

Every reader returns a record, never raises for a missing or unreadable input: the record then
carries ``reason``, one sentence saying what is missing and why, which the report shows in place
of the figures ("not measured: ..."). Only the run's settings, which the caller passes on
purpose, fail loudly when they do not parse.

Inputs, under the defaults of ``eagle3-pipeline report --output-dir OUT``:

    OUT/gpu_reset/**/<host>.json       the gpu_reset role's report per host (gpu_reset_report_dir);
                                       subdirectories, when a run keeps one per reset, label them
    OUT/data/data_config.json          the extraction's manifest (docs/extraction.md)
    OUT/data/parts/*.progress.json     each part's last progress: tokens/s and elapsed time
    OUT/drafter-run/training.json      the finished training (docs/training.md)
    OUT/drafter-run/metrics.jsonl      per-step metrics, read with train.charts.read_metrics
    OUT/drafter-run/charts/*.png       the training charts
    OUT/evaluation/evaluation.json     measured acceptance (tau, accepted_per_position, ...)
    <drafter>/config.json              the exported drafter (training.json's drafter_dir)
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from eagle3_pipeline.train.charts import (
    ACCEPTANCE_CHART,
    ACCURACY_CHART,
    CHARTS_DIR,
    LOSS_CHART,
    METRICS_FILE,
    RunMetrics,
    read_metrics,
)

# File names the stages write (the writers' modules import torch, so the names are repeated here).
MANIFEST_FILE = "data_config.json"  # extract/store.py MANIFEST_FILE
PARTS_DIR = "parts"  # extract/store.py PARTS_DIR
CONVERSION_JOURNAL = "storage-conversion.journal.jsonl"  # extract/storage.py CONVERSION_JOURNAL
PROGRESS_SUFFIX = ".progress.json"
TRAINING_FILE = "training.json"  # train/trainer.py TRAINING_FILE
DRAFTER_DIR = "drafter"  # train/trainer.py DRAFTER_DIR
EVALUATION_FILE = "evaluation.json"
TRAINING_CHARTS = (LOSS_CHART, ACCURACY_CHART, ACCEPTANCE_CHART)

# Key names whose values are secrets: dropped from the settings, at any depth. Matched as a whole
# part of the name ("hf_token", "sglang_server_api_key"), so "batch_tokens" stays.
SECRET_KEY = re.compile(r"(^|[_.-])(api[_-]?key|apikey|token|password|passwd|secret|credentials?)([_.-]|$)",
                        re.IGNORECASE)


class SettingsError(ValueError):
    """The settings JSON given to the report does not parse or is not an object."""


def _read_json(path: Path) -> tuple[object | None, str | None]:
    """(document, None) or (None, why it could not be read)."""
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except FileNotFoundError:
        return None, f"{path} does not exist"
    except OSError as exc:
        return None, f"{path} cannot be read ({exc.strerror or exc})"
    try:
        return json.loads(text), None
    except ValueError as exc:
        return None, f"{path} is not valid JSON ({exc})"


def _number(value: object) -> float | None:
    """A finite int or float (not a bool), else None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


# -- settings -----------------------------------------------------------------------------
def drop_secrets(value: object, prefix: str = "") -> tuple[object, list[str]]:
    """``value`` without the dict entries whose key names a secret, at any depth, and their names."""
    withheld: list[str] = []
    if isinstance(value, dict):
        kept = {}
        for key, item in value.items():
            name = f"{prefix}{key}"
            if SECRET_KEY.search(str(key)):
                withheld.append(name)
                continue
            kept[key], inner = drop_secrets(item, f"{name}.")
            withheld += inner
        return kept, withheld
    if isinstance(value, list):
        items = []
        for index, item in enumerate(value):
            kept_item, inner = drop_secrets(item, f"{prefix}{index}.")
            items.append(kept_item)
            withheld += inner
        return items, withheld
    return value, withheld


@dataclass
class Settings:
    """The run's variables as given (secrets dropped), or the reason there are none."""

    values: dict | None
    withheld: list[str] = field(default_factory=list)
    source: str | None = None
    reason: str | None = None


def read_settings(source: str | None) -> Settings:
    """The settings JSON object from a file, or from stdin when ``source`` is ``-``.

    Raises ``SettingsError`` naming the source when it cannot be read or is not a JSON object.
    """
    if source is None:
        return Settings(None, reason="not given: build the report with --settings-json FILE "
                        "(the report role passes the run's variables)")
    try:
        text = sys.stdin.read() if source == "-" else Path(source).read_text(encoding="utf-8")
    except OSError as exc:
        raise SettingsError(f"--settings-json {source}: cannot be read ({exc.strerror or exc})") from None
    try:
        document = json.loads(text)
    except ValueError as exc:
        raise SettingsError(f"--settings-json {source}: not valid JSON ({exc})") from None
    if not isinstance(document, dict):
        raise SettingsError(f"--settings-json {source}: expected a JSON object of variables, got "
                            f"{type(document).__name__}")
    values, withheld = drop_secrets(document)
    return Settings(values, withheld, source="stdin" if source == "-" else source)


# -- GPU reset ----------------------------------------------------------------------------
@dataclass
class GpuResetLog:
    """One gpu_reset report: the host, where it was found, and the role's record."""

    host: str
    label: str  # the file's path under the log directory, without .json
    path: Path
    record: dict
    written_at: float
    error: str | None = None


def read_gpu_reset_logs(directory: Path) -> tuple[list[GpuResetLog], str | None]:
    """Every ``*.json`` under ``directory`` (hidden files skipped), and why there are none."""
    if not directory.is_dir():
        return [], (f"no GPU reset log: {directory} does not exist (the gpu_reset role writes one JSON per "
                    "host into gpu_reset_report_dir when it is set)")
    logs = []
    for path in sorted(directory.rglob("*.json")):
        relative = path.relative_to(directory)
        if any(part.startswith(".") for part in relative.parts) or path.name.endswith(".check.json"):
            continue  # hidden, or a check run's record (<host>.check.json)
        document, error = _read_json(path)
        if error is None and not isinstance(document, dict):
            error = f"{path} holds {type(document).__name__}, not the gpu_reset role's report object"
        record = document if isinstance(document, dict) else {}
        try:
            written_at = path.stat().st_mtime
        except OSError:
            written_at = math.nan
        logs.append(GpuResetLog(str(record.get("host") or path.stem), relative.with_suffix("").as_posix(),
                                path, record, written_at, error))
    if not logs:
        return [], f"no GPU reset log: {directory} holds no *.json report"
    return logs, None


# -- extraction ---------------------------------------------------------------------------
@dataclass
class PartThroughput:
    """One extraction part's last progress record."""

    part: str
    state: str
    done: int | None
    tokens: int | None
    tokens_per_s: float | None
    elapsed_s: float | None


@dataclass
class ExtractionStats:
    """The extraction's manifest and throughput, or the reason there are none."""

    data_dir: Path
    manifest: dict | None
    reason: str | None = None
    throughput: list[PartThroughput] = field(default_factory=list)
    inputs: list[Path] = field(default_factory=list)

    def reasons(self, kind: str) -> list[tuple[str, int]]:
        """(reason, count) of the ``skipped`` or ``failed`` records, most frequent first."""
        records = self.manifest.get(kind) if self.manifest else None
        if not isinstance(records, list):
            return []
        counts = Counter(str(r.get("reason", "unknown")) if isinstance(r, dict) else "unknown" for r in records)
        return counts.most_common()


def read_extraction(data_dir: Path) -> ExtractionStats:
    """``data_config.json`` and ``parts/*.progress.json`` of an extraction's output directory."""
    manifest_path = data_dir / MANIFEST_FILE
    if (data_dir / CONVERSION_JOURNAL).exists():  # the manifest describes only the files not yet converted
        return ExtractionStats(data_dir, None, reason=(
            f"not measured: a storage conversion is unfinished in {data_dir} (its files mix storage dtypes); "
            f"finish it with `eagle3-pipeline convert-storage {data_dir} --to float8_e4m3`"))
    document, error = _read_json(manifest_path)
    if error is None and not isinstance(document, dict):
        error = f"{manifest_path} holds {type(document).__name__}, not a manifest object"
    if error:
        return ExtractionStats(data_dir, None, reason=f"not measured: {error} (has the extraction run to the end?)")
    stats = ExtractionStats(data_dir, document, inputs=[manifest_path])
    parts_dir = data_dir / PARTS_DIR
    for path in sorted(parts_dir.glob(f"*{PROGRESS_SUFFIX}")) if parts_dir.is_dir() else []:
        progress, _ = _read_json(path)
        if not isinstance(progress, dict):
            continue
        started, updated = _number(progress.get("started")), _number(progress.get("updated"))
        stats.throughput.append(PartThroughput(
            part=str(progress.get("part") or path.name.removesuffix(PROGRESS_SUFFIX)),
            state=str(progress.get("state", "unknown")),
            done=_int_or_none(progress.get("done")),
            tokens=_int_or_none(progress.get("tokens")),
            tokens_per_s=_number(progress.get("tokens_per_s")),
            elapsed_s=updated - started if started is not None and updated is not None else None,
        ))
        stats.inputs.append(path)
    return stats


def _int_or_none(value: object) -> int | None:
    number = _number(value)
    return int(number) if number is not None else None


# -- training -----------------------------------------------------------------------------
@dataclass
class TrainingSummary:
    """A training output directory: its record, its metrics and charts, or why they are missing."""

    directory: Path
    record: dict | None
    metrics: RunMetrics | None
    charts: list[Path]
    reason: str | None = None
    inputs: list[Path] = field(default_factory=list)

    def last(self, kind: str) -> dict | None:
        """The newest ``train`` or ``eval`` record of metrics.jsonl."""
        records = getattr(self.metrics, kind, None) if self.metrics else None
        return records[-1] if records else None


def read_training(directory: Path) -> TrainingSummary:
    """``training.json``, ``metrics.jsonl`` (through train.charts.read_metrics) and ``charts/*.png``."""
    record_path = directory / TRAINING_FILE
    record, _ = _read_json(record_path)
    record = record if isinstance(record, dict) else None
    metrics_path = directory / METRICS_FILE
    metrics, reason = None, None
    try:
        metrics = read_metrics(metrics_path)
    except FileNotFoundError:
        reason = f"not measured: {metrics_path} does not exist (has the training run?)"
    except OSError as exc:
        reason = f"not measured: {metrics_path} cannot be read ({exc.strerror or exc})"
    if metrics is not None and not metrics.train and not metrics.eval:
        reason = f"not measured: {metrics_path} holds no train or eval record yet"
        metrics = None
    charts = [directory / CHARTS_DIR / name for name in TRAINING_CHARTS if (directory / CHARTS_DIR / name).is_file()]
    inputs = [p for p in (record_path, metrics_path) if p.is_file()] + charts
    return TrainingSummary(directory, record, metrics, charts, reason, inputs)


# -- drafter ------------------------------------------------------------------------------
@dataclass
class Drafter:
    """The exported drafter: its directory, config and weights' size, or why it is missing."""

    directory: Path
    config: dict | None
    weights_bytes: int | None
    reason: str | None = None


def drafter_dir(training: TrainingSummary, given: Path | None) -> Path:
    """The drafter's directory: as given, else as training.json records it, else <training>/drafter."""
    if given is not None:
        return given
    recorded = training.record.get("drafter_dir") if training.record else None
    if isinstance(recorded, str) and recorded:
        return Path(os.path.normpath(recorded))
    return training.directory / DRAFTER_DIR


def read_drafter(directory: Path) -> Drafter:
    """``config.json`` and the size of ``model.safetensors`` of an exported drafter."""
    config, error = _read_json(directory / "config.json")
    try:
        weights = (directory / "model.safetensors").stat().st_size
    except OSError:
        weights = None
    if error or not isinstance(config, dict):
        return Drafter(directory, None, weights, reason=f"no drafter: {error or 'config.json is not an object'}")
    return Drafter(directory, config, weights)


# -- evaluation ---------------------------------------------------------------------------
@dataclass
class Evaluation:
    """``evaluation.json`` as the evaluation stage wrote it, or why there is none."""

    path: Path
    record: dict | None
    reason: str | None = None


def read_evaluation(directory: Path) -> Evaluation:
    """The evaluation stage's record (tau, accepted_per_position, draft_tokens, prompts, ...)."""
    path = directory / EVALUATION_FILE
    document, error = _read_json(path)
    if error is None and not isinstance(document, dict):
        error = f"{path} holds {type(document).__name__}, not an object"
    if error:
        return Evaluation(path, None, reason=f"not measured: {error} (has the evaluation stage run?)")
    return Evaluation(path, document)


@dataclass
class AcceptanceComparison:
    """Measured acceptance (real speculative decoding) beside the training's simulated one.

    Rates are the probability that draft position k is accepted: tau = 1 + the sum of the rates
    (each target forward yields the accepted drafts plus one token of its own).
    """

    measured_tau: float | None
    measured_rates: list[float] | None
    simulated_rates: list[float] | None
    simulated_tau: float | None  # 1 + the sum of the simulated rates over the measured draft length
    simulated_source: str | None
    recorded_simulated: float | None  # evaluation.json's simulated_acceptance_length, as written
    reason: str | None  # why nothing was measured
    note: str | None = None  # how the measured list was read, when it needed interpreting


def measured_rates(accepted: object, forwards: object = None, tau: float | None = None
                   ) -> tuple[list[float] | None, str | None]:
    """Per-position acceptance rates from ``accepted_per_position``, and a note when it needed reading.

    The evaluation writes rates (the share of verify forwards whose draft k was accepted), all
    in [0, 1]. A list with a value above 1 is taken as counts: divided by ``target_forwards``
    when recorded, else scaled so that their sum is tau - 1.
    """
    if not isinstance(accepted, list) or not accepted:
        return None, None
    values = [_number(v) for v in accepted]
    if any(v is None or v < 0 for v in values):
        return None, "accepted_per_position holds values that are not non-negative numbers; not shown"
    if all(v <= 1 for v in values):
        return values, None
    rounds = _number(forwards)
    if rounds:
        return [v / rounds for v in values], "accepted_per_position read as counts, divided by target_forwards"
    total = sum(values)
    if tau is not None and tau > 1 and total > 0:
        return ([v * (tau - 1) / total for v in values],
                "accepted_per_position read as counts, scaled so that their sum is tau - 1")
    return None, "accepted_per_position holds counts, and neither target_forwards nor tau turns them into rates"


def simulated_rates(training: TrainingSummary) -> tuple[list[float] | None, str | None]:
    """P(draft position k accepted) from the training: the running product of ``cond_acc_k``.

    From the newest held-out evaluation when there is one, else the newest training step.
    """
    for kind, label in (("eval", "held-out evaluation"), ("train", "training step")):
        record = training.last(kind)
        cond = record.get("cond_acc_k") if record else None
        if isinstance(cond, list) and cond and all(_number(c) is not None for c in cond):
            rates, product = [], 1.0
            for value in cond:
                product *= float(value)
                rates.append(product)
            return rates, f"{label} at step {record['step']}"
    return None, None


def compare_acceptance(evaluation: Evaluation, training: TrainingSummary) -> AcceptanceComparison:
    """Measured tau and per-position rates beside the training's simulated ones."""
    sim_rates, sim_source = simulated_rates(training)
    record = evaluation.record or {}
    tau = _number(record.get("tau"))
    recorded_simulated = _number(record.get("simulated_acceptance_length"))
    reason = evaluation.reason
    if reason is None and tau is None:
        reason = f"not measured: {evaluation.path} has no numeric tau"
    rates, note = measured_rates(record.get("accepted_per_position"), record.get("target_forwards"), tau)
    draft_tokens = _int_or_none(record.get("draft_tokens"))
    length = draft_tokens or (len(rates) if rates else None)
    simulated_tau = 1 + sum(sim_rates[:length]) if sim_rates and length else None
    return AcceptanceComparison(tau, rates, sim_rates, simulated_tau, sim_source, recorded_simulated, reason, note)


# -- all of them --------------------------------------------------------------------------
@dataclass
class ReportInputs:
    """Everything the report shows, read from the run's directories."""

    output_dir: Path
    settings: Settings
    gpu_reset_dir: Path
    gpu_reset: list[GpuResetLog]
    gpu_reset_reason: str | None
    extraction: ExtractionStats
    training: TrainingSummary
    drafter: Drafter
    evaluation: Evaluation
    acceptance: AcceptanceComparison
    target_model_path: str | None

    def result_files(self) -> list[Path]:
        """The files whose content the report shows, but for the GPU reset logs."""
        files = [*self.extraction.inputs, *self.training.inputs]
        if self.evaluation.record is not None:
            files.append(self.evaluation.path)
        config = self.drafter.directory / "config.json"
        if self.drafter.config is not None:
            files.append(config)
        return files


def read_inputs(
    output_dir: Path,
    settings: Settings,
    gpu_reset_dir: Path,
    data_dir: Path,
    training_dir: Path,
    evaluation_dir: Path,
    drafter: Path | None = None,
    target_model_path: str | None = None,
) -> ReportInputs:
    """Read every input of the report; missing ones carry their reason."""
    logs, logs_reason = read_gpu_reset_logs(gpu_reset_dir)
    extraction = read_extraction(data_dir)
    training = read_training(training_dir)
    evaluation = read_evaluation(evaluation_dir)
    if not target_model_path and extraction.manifest:
        recorded = extraction.manifest.get("target_model_path")
        target_model_path = os.path.normpath(recorded) if isinstance(recorded, str) and recorded else None
    return ReportInputs(
        output_dir=output_dir,
        settings=settings,
        gpu_reset_dir=gpu_reset_dir,
        gpu_reset=logs,
        gpu_reset_reason=logs_reason,
        extraction=extraction,
        training=training,
        drafter=read_drafter(drafter_dir(training, drafter)),
        evaluation=evaluation,
        acceptance=compare_acceptance(evaluation, training),
        target_model_path=target_model_path or None,
    )
