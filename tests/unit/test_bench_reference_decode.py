"""bench/reference_decode.py on the CPU at a tiny size: the decode loop and the prefill alone, as documented."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tiny_target import built_tiny_model

ROOT = Path(__file__).resolve().parents[2]


def test_decode_rates_and_prefill_times_are_reported(tmp_path):
    result = tmp_path / "result.json"
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "reference_decode.py"), "--model-path", str(built_tiny_model()),
         "--threads", "1", "--batches", "2", "--workloads", "same", "--decode", "slots", "--new-tokens", "4",
         "--rounds", "1", "--prefill", "1,3", "--prefill-graphs", "both", "--json", str(result)],
        capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    measured = json.loads(result.read_text())
    assert measured["batches"]["2-same-slots"]["tokens_per_s"] > 0
    one, three = measured["prefill"]["1"], measured["prefill"]["3"]
    assert three["tokens"] > one["tokens"] > 0
    for timing in (one, three):
        assert 0 < timing["host_ms"] <= timing["ms"] + 0.01, timing  # issuing it is part of its whole time
    assert "prefill of   3 prompts" in done.stdout
    assert measured["prefill_eager"]["3"]["tokens"] == three["tokens"]  # the same prompts, side by side
