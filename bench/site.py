"""The whole pipeline (playbooks/site.yml) on one GPU machine: wall time and throughput per stage.

Runs ``eagle3_pipeline.run("site", ...)`` (ansible-runner, this checkout's playbooks) on
localhost with the reference engine on a locally built Llama of about 1.0 B parameters (random
bf16 weights, the tiny model's tokenizer: ``bench/extraction.py``'s ``prepare_model``): GPU
reset, the capture server on the GPU, the extraction of ``--samples`` demo conversations, the
server stopped, GPU reset, the training on the GPU (bf16), the evaluation by speculative
decoding on held-out prompts, the report. Then it checks that no process of this run holds a
GPU (NVML), and prints per stage: wall time (from the first to the last task of its role in
the play's events, in order: a stage lasts until the next one's first task) and the stage's
own throughput figure (extraction: stored tokens/s from its
progress file; training: mean tokens/s of the steps; evaluation: tokens/s with and without the
drafter). The drafter of a random-weight target learns little: tau is reported, not judged.

On the GPU machine (no registry): carry [".whl", ".cache/models/tiny-llama"], install the
ansible wheels (``../shared/tools/device-wheels`` prints how), then

    PYTHONPATH=src python3 bench/site.py --json $OUT/site.json

It makes a venv with the system's packages (torch, transformers) plus this checkout's ``src``
for the roles' commands (``--venv``). Here, on a CPU, a quick test: ``--device cpu --small``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "bench"), str(ROOT / "tests" / "gpu"), str(ROOT / "src")]

STAGE_ROLES = {"gpu_reset": "reset", "sglang_server": "serve", "extraction": "extract", "eagle_training": "train",
               "evaluation": "evaluate", "report": "report"}


def make_venv(path: Path) -> Path:
    """A venv that sees this interpreter's packages, this checkout's src and PYTHONPATH's extra dirs."""
    python = path / "bin" / "python"
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(path)],
                       check=True)
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                               check=True, capture_output=True, text=True).stdout.strip())
    # This checkout's src, PYTHONPATH's dirs (the ansible wheels there) and this interpreter's own
    # site-packages (when it is itself a venv, --system-site-packages would skip them).
    extra = [str(ROOT / "src"), *[p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p],
             sysconfig.get_path("purelib"), sysconfig.get_path("platlib")]
    (site / "eagle3_pipeline_bench.pth").write_text("\n".join(dict.fromkeys(extra)) + "\n")
    return path


def inventory(work: Path, model: Path, venv: Path, args) -> Path:
    out = work / "output"
    python = str(venv / "bin" / "python")
    variables = {
        "ansible_connection": "local", "ansible_python_interpreter": python,
        "gpu_reset_required": args.device == "cuda", "gpu_reset_report_dir": str(out / "gpu_reset"),
        # Stop only what this benchmark started (the machine is shared).
        "gpu_reset_match": ["eagle3_pipeline"],
        "sglang_server_engine": "reference", "sglang_server_model_path": str(model),
        "sglang_server_venv": str(venv), "sglang_server_install": False, "sglang_server_supervisor": "process",
        "sglang_server_state_dir": str(work / "servers"), "sglang_server_capture_dir": "/dev/shm/e3p-site-capture",
        "sglang_server_port": 30190, "sglang_server_device": args.device,
        "extraction_dataset": str(out / "dataset" / "train.jsonl"), "extraction_build_demo_dataset": True,
        "extraction_output_dir": str(out / "data"), "extraction_state_dir": str(work / "jobs"),
        "extraction_num_samples": args.samples, "extraction_concurrency": 16, "extraction_poll_s": 2,
        "extraction_venv": str(venv),
        "eagle_training_output_dir": str(out / "training"), "eagle_training_drafter_dir": str(out / "drafter"),
        "eagle_training_state_dir": str(work / "jobs"), "eagle_training_device": args.device,
        "eagle_training_epochs": args.epochs, "eagle_training_lr": 1.0e-3, "eagle_training_eval_ratio": 0.05,
        "eagle_training_draft_vocab_size": 2048, "eagle_training_poll_interval": 2, "eagle_training_venv": str(venv),
        "evaluation_prompts": str(out / "dataset" / "train.heldout.jsonl"),
        "evaluation_drafter_dir": str(out / "drafter"), "evaluation_output_dir": str(out / "evaluation"),
        "evaluation_num_prompts": args.prompts, "evaluation_max_new_tokens": args.max_new_tokens,
        "evaluation_device": args.device, "evaluation_venv": str(venv), "report_venv": str(venv),
    }
    path = work / "inventory.json"
    path.write_text(json.dumps({"all": {"children": {"gpu_hosts": {"hosts": {"localhost": variables}}}}}, indent=1))
    return path


class StageClock:
    """The run as consecutive segments of one role's tasks: [stage, first event, last event]."""

    def __init__(self):
        self.segments: list[list] = []
        self.lines: list[str] = []

    def __call__(self, event: dict) -> None:
        now = time.monotonic()
        stage = STAGE_ROLES.get(event.get("role") or "")
        if stage:
            if self.segments and self.segments[-1][0] == stage:
                self.segments[-1][2] = now
            else:
                if self.segments:  # a stage lasts until the next one starts
                    self.segments[-1][2] = now
                self.segments.append([stage, now, now])
        if event["kind"] in ("progress", "failed"):
            line = f"[{event['kind']}] {event.get('host', '')}: {event.get('message', '')}"
            self.lines.append(line)
            print(line, flush=True)


def gpu_holders() -> list[str]:
    try:
        import pynvml  # noqa: PLC0415
    except ImportError:
        return ["pynvml missing: not checked"]
    pynvml.nvmlInit()
    try:
        mine = []
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
                try:
                    cmdline = Path(f"/proc/{proc.pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
                except OSError:
                    continue
                if "eagle3_pipeline" in cmdline:
                    mine.append(f"GPU {index}: PID {proc.pid} {cmdline[:120]}")
        return mine
    finally:
        pynvml.nvmlShutdown()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--work", type=Path, default=Path("/var/tmp/e3p-site"))
    parser.add_argument("--model-cache", type=Path, default=Path("/var/tmp/e3p-models"))
    parser.add_argument("--venv", type=Path, help="a venv whose python runs this package (default: made in --work)")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--samples", type=int, default=300)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--small", action="store_true", help="the tiny model, 24 samples, 4 prompts (CPU test)")
    parser.add_argument("--hidden", type=int, default=2048, help="the built model's hidden size")
    parser.add_argument("--layers", type=int, default=22, help="the built model's decoder layers")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if args.small:
        args.samples, args.prompts, args.max_new_tokens, args.epochs = 24, 4, 16, 1

    from extraction import prepare_model  # noqa: PLC0415

    import eagle3_pipeline  # noqa: PLC0415

    args.work.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    if args.small:
        from eagle3_pipeline.models.tiny import build_tiny_model  # noqa: PLC0415

        model = build_tiny_model(ROOT / ".cache" / "models" / "tiny-llama")
    else:
        model = prepare_model(args.model_cache, hidden=args.hidden, layers=args.layers,
                              heads=max(1, args.hidden // 64), kv_heads=max(1, args.hidden // 256),
                              intermediate=args.hidden * 11 // 4)
    venv = args.venv or make_venv(args.work / "venv")
    print(f"model {model} ready in {time.monotonic() - started:.0f} s; venv {venv}", flush=True)
    clock = StageClock()
    os.environ["PATH"] = os.pathsep.join([sysconfig.get_path("scripts"), os.environ.get("PATH", "")])
    began = time.monotonic()
    error = None
    try:
        result = eagle3_pipeline.run("site", inventory=inventory(args.work, model, venv, args), on_event=clock,
                                     private_data_dir=str(args.work / "runner"))
        status = result.status
    except eagle3_pipeline.PipelineError as exc:
        status, error = "failed", str(exc)
    total = time.monotonic() - began
    out = args.work / "output"

    def read(path: Path) -> dict:
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError):
            return {}

    data = read(out / "data" / "data_config.json")
    progress = [read(p) for p in sorted((out / "data" / "parts").glob("*.progress.json"))]
    training = read(out / "training" / "training.json")
    steps = [json.loads(line) for line in (out / "training" / "metrics.jsonl").read_text().splitlines()
             if line.strip()] if (out / "training" / "metrics.jsonl").is_file() else []
    train_rates = [r["tokens_per_s"] for r in steps if r.get("kind") == "train"]
    evaluation = read(out / "evaluation" / "evaluation.json")
    figures = {
        "extract": {"samples": data.get("num_samples"), "tokens": data.get("num_tokens"),
                    "tokens_per_s": [p.get("tokens_per_s") for p in progress]},
        "train": {"steps": training.get("steps"), "mean_tokens_per_s": (sum(train_rates[1:]) / len(train_rates[1:])
                                                                          if len(train_rates) > 1 else None),
                  "device": training.get("device"), "dtype": training.get("dtype")},
        "evaluate": {key: evaluation.get(key) for key in ("tau", "simulated_tau", "prompts", "tokens_per_s",
                                                          "outputs_match_target", "verdict")},
    }
    holders = gpu_holders() if args.device == "cuda" else []
    summary = {"status": status, "error": error, "total_s": round(total, 1),
               "stages_s": [[stage, round(end - start, 1)] for stage, start, end in clock.segments],
               "figures": figures,
               "gpu_holders_after": holders, "report": str(out / "report" / "index.html"),
               "model": str(model)}
    print(json.dumps(summary, indent=1))
    if args.json:
        args.json.write_text(json.dumps(summary, indent=1) + "\n")
    return 0 if status == "successful" and not holders else 1


if __name__ == "__main__":
    sys.exit(main())
