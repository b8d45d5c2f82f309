"""Fake but well-formed pipeline output directories, as the stages leave them, for the status tests.

The documents carry the fields the writers write (gpu_reset's report, the extraction's manifest
and progress files, the trainer's progress.json and training.json, evaluation.json), with small
numbers, so that each test can state exactly what ``eagle3-pipeline status`` must print.
"""

from __future__ import annotations

import json
import time
from pathlib import Path


def write_json(path: Path, document: dict) -> Path:
    """Write ``document`` to ``path`` (parents created)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document, indent=1) + "\n")
    return path


def gpu_reset_report(host: str = "gpu-a", stopped: int = 2, left: int = 0, health: list | None = None) -> dict:
    """The gpu_reset role's per-host report."""
    return {
        "host": host, "check_mode": False, "nvml_available": True, "nvml_reason": None, "driver_version": "570.1",
        "device_paths": ["/dev/nvidia0"], "gpus_before": [{"index": i} for i in range(8)],
        "gpus_after": [{"index": i} for i in range(8)],
        "stopped": [{"pid": 100 + i, "cmdline": "python serve.py"} for i in range(stopped)], "would_stop": [],
        "left": [{"pid": 200 + i} for i in range(left)], "units": [], "first_signal_at": 1.0, "stop_seconds": 1.5,
        "wait_seconds": 0.5, "seconds_to_free": 2.25, "health_problems": health or [],
    }  # fmt: skip


def manifest(samples: int = 10, tokens: int = 1234) -> dict:
    """The extraction's merged manifest (data_config.json), the fields status reads."""
    return {
        "format": "eagle3-pipeline/hidden-states", "format_version": 1, "engine": "reference", "hidden_size": 256,
        "aux_layers": [0, 1, 2], "num_samples": samples, "num_records": samples + 1, "num_tokens": tokens,
        "num_loss_tokens": tokens // 2, "bytes": 3 * 2**30, "parts": 2, "shards": {},
        "skipped": [{"id": "s1", "reason": "too long"}], "failed": [],
    }  # fmt: skip


def part_progress(part: str, state: str, done: int, total: int, message: str = "",
                  updated: float | None = None) -> dict:
    """One extraction part's progress file."""
    return {"state": state, "part": part, "pid": 0, "total": total, "done": done, "skipped": 0, "failed": 0,
            "tokens": done * 100, "tokens_per_s": 1500.0, "eta_s": 90.0 if state == "running" else 0.0,
            "started": 0.0, "updated": time.time() if updated is None else updated, "message": message}


def training_progress(state: str, step: int, total: int, message: str = "") -> dict:
    """The trainer's progress.json."""
    return {"state": state, "step": step, "total_steps": total, "limit_steps": total, "epoch": 1, "loss": 3.25,
            "acc_k": [0.5, 0.4, 0.3], "acceptance_length": 1.75, "tokens_per_s": 900.0, "elapsed_s": 12.0,
            "eta_s": 60.0 if state == "running" else None, "message": message, "pid": 0, "updated": time.time()}


def training_record(drafter_dir: Path) -> dict:
    """The trainer's training.json, the fields status reads."""
    return {"steps": 45, "total_steps": 45, "last": {"loss": 3.1, "acceptance_length": 1.7},
            "eval": {"loss": 3.3, "acc_k": [0.61, 0.52, 0.44], "acceptance_length": 2.05},
            "drafter_dir": str(drafter_dir), "draft_vocab_size": 1024, "world": 1, "device": "cpu"}


def finished_run(out: Path, training_subdir: str = "training") -> Path:
    """An output directory where every stage is done."""
    write_json(out / "gpu_reset" / "gpu-a.json", gpu_reset_report())
    write_json(out / "data" / "data_config.json", manifest())
    for index in range(2):
        write_json(out / "data" / "parts" / f"part-{index}-of-2.progress.json",
                   part_progress(f"{index}/2", "done", 5, 5))
    training = out / training_subdir
    write_json(training / "progress.json", training_progress("done", 45, 45))
    write_json(training / "training.json", training_record(training / "drafter"))
    write_json(out / "evaluation" / "evaluation.json",
               {"tau": 2.4, "simulated_acceptance_length": 2.05, "prompts": 12, "accepted_per_position": [0.6, 0.5]})
    (out / "report").mkdir(parents=True)
    (out / "report" / "index.html").write_text("<html></html>\n")
    return out
