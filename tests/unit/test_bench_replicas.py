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
         "--extraction-concurrency", "4", "--json", str(result)],
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
    assert rows[0]["regenerate"]["same_as_first"] == 12
    assert "| 1x2 | 2 |" in done.stdout
