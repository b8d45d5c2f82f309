"""bench/verify.py at a small size: both checks verify the same float8 dataset, and the figures it prints are its
own timings."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_both_ways_verify_the_dataset_and_the_ratio_is_of_their_medians(tmp_path):
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "verify.py"), "--hidden", "16", "--tokens", "24", "--samples", "6",
         "--rounds", "3", "--threads", "2", "--dir", str(tmp_path)],
        capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(done.stdout)
    assert result["shape"] == {"hidden": 16, "aux": 3, "tokens": 24, "samples": 6, "threads": 2,
                               "torch_threads": result["shape"]["torch_threads"]}
    for way in ("bits", "conversion"):
        seconds = sorted(result[way]["seconds"])
        assert len(seconds) == 3 and seconds[0] > 0
        assert abs(result[way]["tokens_per_s"] - 6 * 24 / seconds[1]) < 1e-6 * result[way]["tokens_per_s"]
    ratio = result["bits"]["tokens_per_s"] / result["conversion"]["tokens_per_s"]
    assert abs(result["bits_over_conversion_tokens_per_s"] - ratio) < 1e-9
    assert (tmp_path / "float8" / "data_config.json").is_file()
