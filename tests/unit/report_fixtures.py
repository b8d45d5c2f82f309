"""A small run's outputs on disk, as the stages write them, for the report's tests.

Tiny JSON files in the real shapes (gpu_reset report, data_config.json, a part's progress,
training.json, metrics.jsonl, evaluation.json, the drafter's config) and real 2x2 PNGs made
with the standard library, so that a browser decodes them. ``hostile=True`` puts markup into
every string a stage could have taken from outside (command lines, dataset ids, reasons, host
names, settings), to prove the report escapes it.
"""

from __future__ import annotations

import json
import struct
import zlib
from pathlib import Path

HOSTILE = "<script>window.__pwned = true</script>"
HOSTILE_ATTR = '"><img src=x onerror="window.__pwned = true">'
SECRET = "s3cr3t-value-never-shown"


def tiny_png(path: Path, rgb: tuple[int, int, int] = (31, 111, 235)) -> Path:
    """A valid 2x2 RGB PNG."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    rows = b"".join(b"\0" + bytes(rgb) * 2 for _ in range(2))
    data = (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", 2, 2, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(rows)) + chunk(b"IEND", b""))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def _write(path: Path, document) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document, indent=1) + "\n")
    return path


def gpu_reset_record(host: str, cmdline: str) -> dict:
    """A gpu_reset report that stopped one process on GPU 0."""
    return {
        "check_mode": False, "device_paths": ["/dev/nvidia0"], "driver_version": "570.86.15",
        "first_signal_at": 1795989000.0, "host": host, "nvml_available": True, "nvml_reason": None,
        "gpus_before": [{"index": 0, "name": "NVIDIA H200", "memory_used_mib": 70000},
                        {"index": 1, "name": "NVIDIA H200", "memory_used_mib": 0}],
        "gpus_after": [{"index": 0, "memory_used_mib": 0, "free": True},
                       {"index": 1, "memory_used_mib": 0, "free": True}],
        "stopped": [{"pid": 4242, "pgid": 4240, "cmdline": cmdline, "unit": "group 4240", "signal": "SIGTERM",
                     "seconds": 0.41, "gpus": [0]}],
        "would_stop": [], "units": [{"kind": "group", "id": 4240, "pids": [4240, 4242]}],
        "left": [{"pid": 77, "cmdline": "/usr/bin/nv-hostengine", "reason": "protected"}],
        "stop_seconds": 0.41, "wait_seconds": 0.8, "seconds_to_free": 1.21, "health_problems": [],
    }


def metrics_lines(steps: int = 6, positions: int = 3) -> str:
    """train records every step and an eval record at the end, as the trainer writes them."""
    lines = []
    for step in range(1, steps + 1):
        acc = [round(0.2 + 0.05 * step - 0.03 * k, 4) for k in range(positions)]
        lines.append({"kind": "train", "step": step, "epoch": 0, "loss": 10.0 / step, "loss_k": [3.0] * positions,
                      "acc_k": acc, "cond_acc_k": acc, "acceptance_length": sum(acc), "tokens": 500,
                      "tokens_per_s": 800.0, "lr": 1e-3})
    lines.append({"kind": "eval", "step": steps, "loss": 2.0, "loss_k": [0.7] * positions,
                  "acc_k": [0.6, 0.5, 0.4][:positions], "cond_acc_k": [0.6, 0.5, 0.4][:positions],
                  "acceptance_length": 0.6 + 0.3 + 0.12, "samples": 5,
                  "opening": {"tokens": 128, "acc_k": [0.45, 0.35, 0.25][:positions],
                              "cond_acc_k": [0.45, 0.55, 0.65][:positions], "acceptance_length": 0.8762, "rows": 345,
                              "rounds": {"1": {"tau": 1.3712}, "10": {"tau": 1.7031}, "3": {"tau": 1.5521}}}})
    return "".join(json.dumps(line) + "\n" for line in lines) + '{"kind": "train", "step": 7, "lo'  # torn tail


def make_run(out: Path, training: bool = True, evaluation: bool = True, hostile: bool = False) -> Path:
    """Write a run's outputs under ``out`` (gpu_reset/, data/, drafter-run/, evaluation/, settings.json)."""
    bad = HOSTILE if hostile else "bad"
    cmdline = f"python -m sglang.launch_server --model-path /models/x {HOSTILE if hostile else ''}".strip()
    _write(out / "gpu_reset" / "localhost.json", gpu_reset_record("localhost", cmdline))
    _write(out / "gpu_reset" / "gpu-node-2.json", gpu_reset_record(HOSTILE_ATTR if hostile else "gpu-node-2",
                                                                   "python train.py"))
    files = [{"file": f"rows_0-2000/s{i}.safetensors", "id": f"s{i}", "line": i + 1, "tokens": 100,
              "loss_tokens": 40, "bytes": 4000, "sha256": "0" * 64} for i in range(3)]
    _write(out / "data" / "data_config.json", {
        "format": "eagle3-pipeline/hidden-states", "format_version": 1, "engine": "reference",
        "engine_version": "0.1.0", "target_model_path": "/models/target/../target", "aux_layers": [0, 1, 2],
        "hidden_size": 64, "num_hidden_layers": 4, "vocab_size": 256, "dtype": "bfloat16", "max_length": 2048,
        "overflow": "truncate", "dataset": {"name": "train.jsonl", "sha256": "a" * 64, "num_samples_limit": None},
        "num_records": 5, "num_samples": 3, "num_tokens": 300, "num_loss_tokens": 120, "bytes": 12000,
        "shards": {"rows_0-2000": {"num_samples": 3, "num_tokens": 300, "files": files}},
        "skipped": [{"line": 4, "id": f"x{bad}", "reason": "no_assistant_turn", "detail": f"turns: {bad}"}],
        "failed": [{"line": 5, "id": "s4", "reason": f"top1_mismatch {bad}", "detail": "position 3"}],
    })
    _write(out / "data" / "parts" / "part-0-of-1.progress.json", {
        "done": 3, "failed": 1, "part": "0/1", "skipped": 1, "started": 1795989977.0, "state": "done",
        "tokens": 300, "tokens_per_s": 150.0, "total": 5, "updated": 1795989979.0})
    if training:
        run = out / "drafter-run"
        (run / "metrics.jsonl").parent.mkdir(parents=True, exist_ok=True)
        (run / "metrics.jsonl").write_text(metrics_lines())
        for i, name in enumerate(("loss.png", "acc_per_position.png", "acceptance_length.png")):
            tiny_png(run / "charts" / name, (30 * i, 100, 200))
        _write(run / "drafter" / "config.json", {
            "architectures": ["LlamaForCausalLMEagle3"], "draft_vocab_size": 128, "target_hidden_size": 64,
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 1, 2]}})
        (run / "drafter" / "model.safetensors").write_bytes(b"\0" * 1024)
        _write(run / "training.json", {
            "steps": 6, "total_steps": 6, "device": "cpu", "world": 1, "dtype": "float32", "draft_vocab_size": 128,
            "draft_vocab_coverage": 0.9, "drafter_dir": str(run / "drafter")})
    if evaluation:
        # The fields eagle3-pipeline evaluate writes (evaluate/command.py), with made-up values.
        _write(out / "evaluation" / "evaluation.json", {
            "format": "eagle3-pipeline/evaluation", "engine": f"reference {bad}", "tau": 1.9,
            "sglang_accept_length": 1.95, "mean_accepted": 0.9, "accepted_per_position": [0.5, 0.28, 0.12],
            "conditional_acceptance_per_position": [0.5, 0.56, 0.43], "target_forwards": 100,
            "tokens_from_verify": 190, "tokens_generated": 198, "requests": 8, "draft_tokens": 3, "prompts": 8,
            "outputs_match_target": True, "output_mismatches": [], "simulated_acceptance_length": 1.02,
            "simulated_from": "training's held-out eval split", "simulated_tau": 2.02,
            "note": f"tau = tokens per verify forward {bad}", "tokens_per_s": 120.5,
            "runs": [{"draft_tokens": 3, "tau": 1.9, "predicted_tau": 2.02, "tokens_per_s": 120.5,
                      "replayed": {"tau": 1.92, "mean_accepted": 0.92},
                      "conditional_acceptance_per_position": [0.5, 0.56, 0.43],
                      "predicted_conditional_acceptance": [0.6, 0.5, 0.4]},
                     {"draft_tokens": 7, "tau": 2.1, "predicted_tau": None, "tokens_per_s": 90.0,
                      "conditional_acceptance_per_position": [0.5, 0.5, 0.4, 0.4, 0.3, 0.3, 0.2],
                      "predicted_conditional_acceptance": [0.6, 0.5, 0.4]}],
            "excluded_prompts": [{"id": f"held-{bad}", "line": 7, "reason": "same prompt tokens as a training sample",
                                  "other": "t-3"}],
            "reference_check": {"checked": True, "method": "full forwards", "near_ties": 1, "faults": 0,
                                "mismatches": [{"id": "h-2", "draft_tokens": 7, "first_difference": 12,
                                                "near_tie": True, "logit_gap": 0.0625}]},
            "overlap_check": {"checked_prompts": 9, "usable_prompts": 8, "excluded": 1, "training_samples": 3,
                              "method": "sample ids, and SHA-256 of the prompt tokens before the first assistant "
                                        "token"},
            "verdict": {"passed": True, "judged": True, "min_ratio": 0.5, "min_rounds": 30,
                        "predicted_from": "the training's held-out split",
                        "positions": [{"draft_tokens": 3, "position": 1, "measured": 0.5, "rounds": 100,
                                       "upper_99": 0.62, "predicted": 0.6, "judged": True, "ok": True},
                                      {"draft_tokens": 3, "position": 2, "measured": 0.56, "rounds": 50,
                                       "upper_99": 0.72, "predicted": 0.5, "judged": True, "ok": True},
                                      {"draft_tokens": 3, "position": 3, "measured": 0.43, "rounds": 28,
                                       "upper_99": 0.68, "predicted": 0.4, "judged": False, "ok": True}],
                        "diagnosis": "chain of 3: tau measured 1.900, replayed from full forwards 1.920, predicted "
                                     "by the training's held-out split 2.020: serving does what the drafter can do, "
                                     "as its training predicts",
                        "problems": [], "likely_causes": []}})
    _write(out / "settings.json", {
        "sglang_server_engine": "reference", "sglang_server_api_key": SECRET, "sglang_server_tp_size": 2,
        "eagle_training_batch_tokens": 512, "extraction_dataset": f"/data/{bad}.jsonl",
        "eagle_training_environment": {"HF_TOKEN": SECRET, "NCCL_SOCKET_IFNAME": "eth0"},
    })
    return out
