"""bench/extract_plan.py on the CPU at a small size: the plan in one process and in two, side by side, the same."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tiny_target import built_tiny_model

from eagle3_pipeline.data.demo_dataset import write_demo_dataset

ROOT = Path(__file__).resolve().parents[2]


def test_the_plan_in_one_process_and_in_two_keys_the_same_samples(tmp_path):
    dataset = tmp_path / "demo.jsonl"
    write_demo_dataset(dataset, num_samples=300, held_out_fraction=0.0)
    result = tmp_path / "result.json"
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "extract_plan.py"), "--model-path", str(built_tiny_model()),
         "--dataset", str(dataset), "--num-samples", "300", "--processes", "2", "--rounds", "1", "--json",
         str(result)],
        capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    measured = json.loads(result.read_text())
    assert measured["same"] is True and measured["records"] == 300 and measured["samples"] > 0
    assert [row["processes"] for row in measured["rows"]] == [1, 2]
    assert all(row["median_s"] > 0 for row in measured["rows"]) and measured["rows"][0]["ratio"] == 1.0
    assert "| 2 |" in done.stdout and "in the same order: yes" in done.stdout
