"""bench/replicas.py on the CPU at a tiny size: the benchmark runs as documented and reports what it measured."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from tiny_target import built_tiny_model

from eagle3_pipeline.data.demo_dataset import demo_conversations, write_jsonl

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tiny_model_dir():
    return built_tiny_model()  # the real tiny model (its tokenizer and chat template): the regeneration renders


def test_one_process_against_two_replicas_side_by_side(tiny_model_dir, tmp_path):
    train, _ = demo_conversations(12, 0.0, 0)
    # A line separator inside a question: the regenerated lines keep it as it is, and the benchmark's
    # comparison of answers must still read one record a line (str.splitlines would split it).
    train[0]["conversations"][0]["value"] += " \u2028 Answer briefly."
    dataset = tmp_path / "demo.jsonl"
    write_jsonl(dataset, train)
    result = tmp_path / "result.json"
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "replicas.py"), "--model-path", str(tiny_model_dir), "--dataset",
         str(dataset), "--work", str(tmp_path / "work"), "--device", "cpu", "--conversations", "12", "--layouts",
         "1x1,1x2", "--max-new-tokens", "6", "--batch", "8", "--regeneration-concurrency", "8",
         "--extraction-concurrency", "4", "--capture-batches", "0,2", "--json", str(result)],
        capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = json.loads(result.read_text())["rows"]
    assert [row["layout"] for row in rows] == ["1x1", "1x2"]
    for row in rows:
        assert row["regenerate"]["conversations"] == 12 and row["regenerate"]["tokens"] > 0
        assert row["regenerate"]["compared"] == 12
        assert row["regenerate"]["mean_decode_batch"] >= 1 and 0 < row["regenerate"]["decode_share"] < 1
        # Every request of the 12 conversations' turns was prefilled once: at least one per conversation.
        regen = row["regenerate"]
        assert regen["prefills"] >= 1 and regen["mean_prefill_batch"] * regen["prefills"] >= 12 - 1e-6, regen
        assert regen["client_cpu"] > 0 and regen["server_cpu"] > 0, regen
        # A decode step's time and its parts (no replayed steps on a CPU: none waited for).
        assert 0 < regen["decode_cpu_ms"] <= regen["decode_step_ms"] + 0.01, regen
        assert 0 <= regen["answer_ms"] <= regen["decode_step_ms"] + 0.01, regen
        assert regen["decode_gpu_wait_ms"] in (None, 0.0), regen
        assert regen["slot_waits"] >= 0 and "waited for a free slot" in done.stdout
        assert len(row["regenerate"]["workers"]) == row["gpus"] * row["replicas_per_gpu"]
        # Every regenerated conversation extracted: the same stored tokens whichever server answered.
        assert row["extract"]["samples"] == 12 and row["extract"]["tokens"] == rows[0]["extract"]["tokens"]
    # The extraction once per capture batch, side by side: the engine's default (8 on its own; per replica, the
    # front's), then 2 a batch, split over the replicas; every prefill within its batch, the same stored tokens.
    for row in rows:
        default, two = row["extract_batches"]
        assert row["extract"] == default and default["capture_batch"] is None and two["capture_batch"] == 2
        per = row["replicas_per_gpu"]
        for ext in (default, two):
            assert ext["tokens"] == rows[0]["extract"]["tokens"] and ext["samples"] == 12, ext
            # (the mean rounded to a tenth)
            assert ext["prefills"] >= 1 and (ext["mean_prefill_batch"] + 0.05) * ext["prefills"] >= 12, ext
            assert 0 < ext["prefill_share"] < 1 and 0 <= ext["idle_share"] < 1 and ext["prefill_ms"] > 0, ext
        assert two["mean_prefill_batch"] <= 2 // per + 1e-6, two
    assert rows[0]["extract_batches"][0]["max_batch_size"] == 8
    assert rows[0]["extract_batches"][1]["max_batch_size"] == 2
    assert "| 1x2 | 1 |" in done.stdout and "capture batch 2" in done.stdout
    assert rows[0]["regenerate"]["same_as_first"] == 12
    assert "| 1x2 | 2 |" in done.stdout
