"""The trainer's metrics outputs: PNG charts drawn from a real metrics.jsonl (torn last line,
duplicated and restarted steps) and TensorBoard events read back with TensorBoard's own reader."""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time

import pytest

from eagle3_pipeline.train import charts
from eagle3_pipeline.train import tensorboard as tb

K = 7
TRAIN_STEPS = 300
EVAL_EVERY = 50
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def train_record(step: int, scale: float = 1.0) -> dict:
    """A train line as the trainer writes it: loss falling, accuracy rising, later positions lower."""
    progress = step / TRAIN_STEPS
    cond = [min(0.95, (0.3 + 0.6 * progress) * (1 - 0.06 * k) + 0.02 * math.sin(step + k)) for k in range(K)]
    acc = [math.prod(cond[: k + 1]) for k in range(K)]
    return {
        "kind": "train", "step": step, "epoch": step // 100,
        "loss": scale * (12.0 * math.exp(-5 * progress) + 0.5 + 0.1 * math.sin(step)),
        "loss_k": [scale * (1.0 + 0.2 * k) * (1.5 - progress) for k in range(K)],
        "acc_k": acc, "cond_acc_k": cond,
        "acceptance_length": sum(math.prod(cond[: k + 1]) for k in range(K)),
        "tokens": 4096, "tokens_per_s": 20000.0 + step, "lr": 1e-4 * (1 - progress),
    }


def eval_record(step: int, scale: float = 1.0) -> dict:
    record = train_record(step, scale)
    for key in ("epoch", "tokens", "tokens_per_s", "lr"):
        del record[key]
    return {**record, "kind": "eval", "loss": record["loss"] * 1.1, "samples": 64}


def write_metrics(path, scale: float = 1.0, duplicate_step: int | None = 120, torn: bool = True):
    """A few hundred train lines, an eval every EVAL_EVERY steps, a duplicated step, a torn last line."""
    lines = []
    for step in range(1, TRAIN_STEPS + 1):
        lines.append(json.dumps(train_record(step, scale)))
        if step == duplicate_step:  # written twice, the second time with other values
            lines.append(json.dumps({**train_record(step, scale), "loss": 99.0}))
        if step % EVAL_EVERY == 0:
            lines.append(json.dumps(eval_record(step, scale)))
    text = "\n".join(lines) + "\n"
    if torn:
        text += json.dumps(train_record(TRAIN_STEPS + 1, scale))[:37]  # killed mid-line
    path.write_text(text, encoding="utf-8")
    return path


def read_png(path):
    from matplotlib import image

    assert path.read_bytes()[:8] == PNG_SIGNATURE, f"{path} is not a PNG"
    return image.imread(path, format="png")


# --- reading metrics.jsonl --------------------------------------------------------------------


def test_read_metrics_skips_torn_line_and_keeps_last_record_of_a_step(tmp_path):
    metrics = charts.read_metrics(write_metrics(tmp_path / "metrics.jsonl"))
    assert [r["step"] for r in metrics.train] == list(range(1, TRAIN_STEPS + 1))
    assert [r["step"] for r in metrics.eval] == list(range(EVAL_EVERY, TRAIN_STEPS + 1, EVAL_EVERY))
    assert metrics.train[119]["loss"] == 99.0  # step 120's second line won
    assert metrics.skipped_lines == 1


def test_read_metrics_drops_records_past_a_restarted_step(tmp_path):
    path = tmp_path / "metrics.jsonl"
    old = [train_record(s) for s in range(1, 11)] + [eval_record(8)]
    new = [{**train_record(s), "loss": 50.0 + s} for s in range(6, 9)]
    path.write_text("".join(json.dumps(r) + "\n" for r in old + new), encoding="utf-8")
    metrics = charts.read_metrics(path)
    assert [r["step"] for r in metrics.train] == list(range(1, 9))
    assert [r["loss"] for r in metrics.train[5:]] == [56.0, 57.0, 58.0]
    assert metrics.eval == []  # the eval at step 8 belonged to the run that was cut off


def test_running_mean_ignores_non_finite_values():
    assert charts.running_mean([1.0, 3.0, math.nan, 5.0], 2) == [1.0, 2.0, 3.0, 5.0]
    assert math.isnan(charts.running_mean([math.inf], 3)[0])
    with pytest.raises(ValueError, match="window"):
        charts.running_mean([1.0], 0)


# --- charts -------------------------------------------------------------------------------------


def test_write_charts_writes_three_pngs(tmp_path):
    out = tmp_path / "charts"
    paths = charts.write_charts(write_metrics(tmp_path / "metrics.jsonl"), out)
    assert [p.name for p in paths] == [charts.LOSS_CHART, charts.ACCURACY_CHART, charts.ACCEPTANCE_CHART]
    sizes = {p.name: read_png(p).shape for p in paths}
    assert sizes[charts.LOSS_CHART] == (550, 1000, 4)
    assert sizes[charts.ACCURACY_CHART] == (900, 1100, 4)
    assert sizes[charts.ACCEPTANCE_CHART] == (550, 1000, 4)
    assert sorted(p.name for p in out.iterdir()) == sorted(sizes)  # no temp file left behind


def test_charts_change_when_the_data_changes(tmp_path):
    metrics_path = tmp_path / "metrics.jsonl"

    def draw(**kwargs):
        write_metrics(metrics_path, **kwargs)
        return [read_png(p) for p in charts.write_charts(metrics_path, tmp_path / "charts")]

    loss, accuracy, acceptance = draw()
    again = draw()
    assert all((a == b).all() for a, b in zip((loss, accuracy, acceptance), again))  # same data, same pixels
    scaled = draw(scale=3.0)  # losses x3, accuracies as they were
    assert not (scaled[0] == loss).all()
    assert (scaled[1] == accuracy).all()
    assert (scaled[2] == acceptance).all()
    metrics_path.write_text(metrics_path.read_text().replace('"cond_acc_k": [0.', '"cond_acc_k": [0.9'))
    changed = [read_png(p) for p in charts.write_charts(metrics_path, tmp_path / "charts")]
    assert not (changed[1] == accuracy).all()


def test_write_charts_names_the_file_when_it_holds_no_record(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"kind": "train", "step": 1, "lo', encoding="utf-8")  # only a torn line
    with pytest.raises(ValueError, match=str(path)):
        charts.write_charts(path, tmp_path / "charts")
    path.write_text("", encoding="utf-8")
    with pytest.raises(ValueError, match="no train or eval record"):
        charts.write_charts(path, tmp_path / "charts")
    assert not (tmp_path / "charts").exists()


def test_write_charts_without_matplotlib_names_the_fix(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    with pytest.raises(charts.ChartsUnavailable, match="pip install matplotlib"):
        charts.write_charts(write_metrics(tmp_path / "metrics.jsonl"), tmp_path / "charts")


def test_train_charts_command_prints_the_paths(tmp_path, capsys):
    write_metrics(tmp_path / "metrics.jsonl")
    parser = argparse.ArgumentParser()
    charts.configure_parser(parser)
    assert charts.run(parser.parse_args(["--output-dir", str(tmp_path)])) == 0
    printed = capsys.readouterr().out.split()
    assert printed == [str(tmp_path / "charts" / name)
                       for name in (charts.LOSS_CHART, charts.ACCURACY_CHART, charts.ACCEPTANCE_CHART)]
    assert charts.run(parser.parse_args(["--output-dir", str(tmp_path / "missing")])) == 2
    assert "metrics.jsonl does not exist" in capsys.readouterr().err


def test_importing_the_modules_loads_neither_matplotlib_nor_tensorboard():
    code = ("import sys, eagle3_pipeline.train.charts, eagle3_pipeline.train.tensorboard; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('matplotlib', 'tensorboard')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


# --- TensorBoard ----------------------------------------------------------------------------------


def read_scalars(log_dir) -> dict[str, list[tuple[int, float]]]:
    """Every scalar in log_dir as TensorBoard shows it: {tag: [(step, value)]}, purges applied."""
    from tensorboard.backend.event_processing import event_accumulator as ea

    events = ea.EventAccumulator(str(log_dir), size_guidance={ea.SCALARS: 0})
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def test_tensorboard_log_writes_every_scalar_at_its_step(tmp_path):
    assert tb.TensorBoardLog.available()  # requirements/dev.txt pins tensorboard: no skip
    records = [train_record(1), train_record(2), eval_record(2), {"kind": "note", "step": 3, "loss": 1.0}]
    with tb.TensorBoardLog(tmp_path / "tb") as log:
        for record in records:
            log.write(record)
    scalars = read_scalars(tmp_path / "tb")
    per_position = [f"{name}/{k}" for name in ("loss_k", "acc_k", "cond_acc_k") for k in range(K)]
    train_tags = {f"train/{n}" for n in ["loss", "acceptance_length", "tokens_per_s", "lr", *per_position]}
    eval_tags = {f"eval/{n}" for n in ["loss", "acceptance_length", *per_position]}
    assert set(scalars) == train_tags | eval_tags
    assert scalars["train/loss"] == [(1, pytest.approx(records[0]["loss"], rel=1e-6)),
                                     (2, pytest.approx(records[1]["loss"], rel=1e-6))]
    assert scalars["train/lr"] == [(1, pytest.approx(records[0]["lr"], rel=1e-6)),
                                   (2, pytest.approx(records[1]["lr"], rel=1e-6))]
    assert scalars["train/cond_acc_k/6"][1] == (2, pytest.approx(records[1]["cond_acc_k"][6], rel=1e-6))
    assert scalars["eval/acc_k/3"] == [(2, pytest.approx(records[2]["acc_k"][3], rel=1e-6))]
    assert scalars["eval/acceptance_length"] == [(2, pytest.approx(records[2]["acceptance_length"], rel=1e-6))]


def test_tensorboard_resume_with_purge_step_replaces_the_old_runs_steps(tmp_path):
    log_dir = tmp_path / "tb"
    with tb.TensorBoardLog(log_dir) as log:
        for step in range(1, 11):
            log.write({"kind": "train", "step": step, "loss": float(step)})
            if step in (5, 9):
                log.write({"kind": "eval", "step": step, "loss": 10.0 * step})
    # A resumed run starts in a later second; its event file's name (time first) sorts after the old one.
    second = int(time.time())
    while int(time.time()) == second:
        time.sleep(0.05)
    with tb.TensorBoardLog(log_dir, purge_step=6) as log:
        for step in range(6, 9):
            log.write({"kind": "train", "step": step, "loss": 100.0 + step})
    scalars = read_scalars(log_dir)
    assert scalars["train/loss"] == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 4.0), (5, 5.0),
                                     (6, 106.0), (7, 107.0), (8, 108.0)]
    # A tag the new run has not written again yet: only the START event at purge_step drops its step 9.
    assert scalars["eval/loss"] == [(5, 50.0)]


def test_tensorboard_log_rejects_a_record_it_cannot_log(tmp_path):
    with tb.TensorBoardLog(tmp_path / "tb") as log:
        with pytest.raises(ValueError, match="acc_k\\[1\\] must be a number"):
            log.write({"kind": "eval", "step": 4, "acc_k": [0.5, "high"]})
        with pytest.raises(ValueError, match="step must be an integer"):
            log.write({"kind": "train", "step": "4", "loss": 1.0})
    with pytest.raises(ValueError, match="purge_step"):
        tb.TensorBoardLog(tmp_path / "tb", purge_step=-1)


def test_tensorboard_missing_is_reported_with_the_fix(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorboard", None)
    assert tb.TensorBoardLog.available() is False
    with pytest.raises(tb.TensorBoardUnavailable, match="pip install tensorboard"):
        tb.TensorBoardLog(tmp_path / "tb")
    assert not (tmp_path / "tb").exists()
