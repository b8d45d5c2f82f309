"""Benchmark: what capturing hidden states costs the reference engine, on a GPU.

The same requests go to the reference engine (a ~1.1B Llama built locally, random weights,
bf16 on CUDA) started twice with identical settings but for the capture: once writing every
request's aux and last hidden states to a capture directory in /dev/shm, once with none.
Rounds alternate (off, on, off, on, ...) so drift hits both alike. Printed: prompt tokens per
second for each, and their ratio (target: capture on / capture off >= 0.9).

Run on the GPU machine: python3 bench/capture_overhead.py --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "gpu"))

from harness import ROOT, build_random_llama  # noqa: E402


def start_server(model: Path, port: int, capture_dir: Path | None, log: Path) -> subprocess.Popen:
    """Start the reference engine and wait for /health."""
    cmd = [sys.executable, "-m", "eagle3_pipeline.cli", "serve-reference", "--model-path", str(model),
           "--port", str(port), "--device", "cuda", "--max-batch-size", "16"]
    if capture_dir is not None:
        cmd += ["--capture-dir", str(capture_dir)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env, start_new_session=True)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited: {log.read_text()[-2000:]}")
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
            return proc
        except OSError:
            time.sleep(0.2)
    raise TimeoutError("server not ready")


def stop_server(proc: subprocess.Popen) -> None:
    """SIGTERM the server's session and wait."""
    os.killpg(proc.pid, signal.SIGTERM)
    proc.wait(timeout=60)


def send(port: int, ids: list[int], rid: str) -> int:
    """One extraction-style request; returns the prompt tokens the server reports."""
    body = json.dumps({"input_ids": ids, "rid": rid, "sampling_params": {"max_new_tokens": 1}}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/generate", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as response:
        return json.loads(response.read())["meta_info"]["prompt_tokens"]


def run_load(port: int, prompts: list[list[int]], concurrency: int, tag: str) -> float:
    """Send every prompt with ``concurrency`` in flight; return prompt tokens per second."""
    start = time.monotonic()
    with ThreadPoolExecutor(concurrency) as pool:
        tokens = sum(pool.map(lambda item: send(port, item[1], f"{tag}-{item[0]}"), enumerate(prompts)))
    return tokens / (time.monotonic() - start)


def main() -> None:
    """Build the model, alternate capture off/on, print the table and the ratio."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=128)
    parser.add_argument("--prompt-tokens", type=int, default=1024)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="e3p-capbench-"))
    shm = Path(tempfile.mkdtemp(prefix="e3p-capbench-", dir="/dev/shm"))
    try:
        model = build_random_llama(work / "llama-1b")
        rng = random.Random(0)
        prompts = [[rng.randrange(100, 31000) for _ in range(args.prompt_tokens)] for _ in range(args.requests)]
        rows = []
        for mode in ["off", "on"] * args.rounds:
            capture = shm / "capture" if mode == "on" else None
            proc = start_server(model, 30311, capture, work / f"server-{mode}.log")
            try:
                run_load(30311, prompts[:16], args.concurrency, f"warm-{mode}-{len(rows)}")
                rate = run_load(30311, prompts, args.concurrency, f"{mode}-{len(rows)}")
            finally:
                stop_server(proc)
            files = sorted(capture.glob("*.safetensors")) if capture else []
            captured = sum(f.stat().st_size for f in files)
            rows.append({"capture": mode, "tokens_per_s": round(rate, 1), "files": len(files),
                         "captured_gb": round(captured / 1e9, 2)})
            print(json.dumps(rows[-1]), flush=True)
            if capture:
                shutil.rmtree(capture)
        off = [r["tokens_per_s"] for r in rows if r["capture"] == "off"]
        on = [r["tokens_per_s"] for r in rows if r["capture"] == "on"]
        ratio = statistics.median(on) / statistics.median(off)
        print(f"\nprompt tokens/s, capture off: median {statistics.median(off):.0f} ({', '.join(map(str, off))})")
        print(f"prompt tokens/s, capture on:  median {statistics.median(on):.0f} ({', '.join(map(str, on))})")
        print(f"ratio capture on / off: {ratio:.3f} (target >= 0.9); {args.requests} requests of "
              f"{args.prompt_tokens} tokens, concurrency {args.concurrency}, per round")
        if args.json:
            args.json.write_text(json.dumps({"rows": rows, "ratio": ratio}, indent=2))
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)


if __name__ == "__main__":
    main()
