"""bench/trainer_feed.py at a tiny size on the CPU: the trainer really trains on the synthetic extraction it writes
(a dataset the trainer's own checks accept), its figures come from the trainer's metrics, the bare step runs over
the trainer's own first batches, a second run reuses the dataset, and each feed of --feeds trains on its own."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run(tmp_path: Path, steps: int, feeds: str = "thread") -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(ROOT / "bench" / "trainer_feed.py"), "--shape", "tiny", "--device", "cpu",
         "--samples", "20", "--min-tokens", "40", "--max-tokens", "120", "--batch-tokens", "512",
         "--steps", str(steps), "--warmup", "1", "--dir", str(tmp_path), "--json", str(tmp_path / "feed.json"),
         "--feeds", feeds],
        capture_output=True, text=True, timeout=300, check=False)


def test_trainer_and_bare_step_measured_on_the_same_stored_batches(tmp_path):
    done = run(tmp_path, 3)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads((tmp_path / "feed.json").read_text())
    trainer, bare = result["trainer"], result["bare_step"]
    # The trainer ran its warm-up and timed steps, and the timed ones are exactly what its metrics logged after it.
    assert trainer["trained_steps"] == 4 and trainer["steps"] == 3
    metrics = [json.loads(line) for line in (tmp_path / "training-thread" / "metrics.jsonl").read_text().splitlines()]
    timed = [m for m in metrics if m.get("kind") == "train" and m["step"] > 1]
    seconds = sum(m["tokens"] / m["tokens_per_s"] for m in timed)
    assert abs(trainer["tokens_per_s"] - sum(m["tokens"] for m in timed) / seconds) < 1e-6 * trainer["tokens_per_s"]
    assert 0 < trainer["tokens_per_step"] <= 512
    assert bare["steps"] == 3 and bare["tokens_per_s"] > 0
    assert abs(result["trainer_over_bare"] - trainer["tokens_per_s"] / bare["tokens_per_s"]) < 1e-9
    assert result["read_ms_per_batch"] > 0
    # What the trainer trained on is a float8 extraction of 20 samples of 40..120 tokens, a third of each prompt.
    config = json.loads((tmp_path / "data" / "data_config.json").read_text())
    assert config["num_samples"] == 20 and config.get("storage_dtype") == "float8_e4m3"
    # Again on the same dataset, the trainer once per feed, each into its own output (each really trains).
    again = run(tmp_path, 1, "inline,thread-switch-0.5ms")
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert "reusing the dataset" in again.stdout
    result = json.loads((tmp_path / "feed.json").read_text())
    assert [one["feed"] for one in result["trainers"]] == ["inline", "thread-switch-0.5ms"]
    assert all(one["trained_steps"] == 2 and one["steps"] == 1 for one in result["trainers"])
    assert (tmp_path / "training-inline" / "metrics.jsonl").is_file()
    bad = run(tmp_path, 1, "thread,sideways")
    assert bad.returncode == 2 and "sideways" in bad.stderr
