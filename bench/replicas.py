"""Benchmark: regeneration and extraction tokens/s of one reference-engine process against replicas of it.

Layouts ``NxK``: N GPUs with K replicas on each (``sglang_server_dp_size`` N*K, ``--replicas-per-device K``);
``1x1`` is one engine process, the baseline. Every layout runs, side by side in one run, the same two stages as
site.yml runs them, over the same conversations:

- ``regenerate``: the serving server (``serve/plan.py``'s argv for ``purpose: serve``, ``--max-batch-size``
  per GPU split over its K replicas) and ``eagle3-pipeline regenerate`` with ``--concurrency`` per GPU times
  N; generated tokens (``regeneration.json``) over the command's wall time;
- ``extract``: the capture server (``purpose: capture``) and ``eagle3-pipeline extract`` over the first
  layout's regenerated conversations (the same token ids for every layout), every sample verified as the role
  does; stored tokens (``data_config.json``) over the command's wall time. The data is deleted after each
  layout (disk). ``--capture-batches 8,32`` runs it once per capture-server batch (``--max-batch-size``; the
  first is the baseline, ``0`` the engine's own default), side by side over the same conversations, each with the
  capture server's own account of its time (prefills, requests a prefill, seconds prefilling and idle).

Both times are the client's whole command, tokenizer load and merge included, so they are what an operator
waits for. Printed: one line per stage and layout, the ratio to ``1x1``, and how many conversations each
layout regenerated exactly as ``1x1`` did (greedy in bf16: a batch of another size may break a near-tie
differently, so this is a count, not a check); then the result as JSON.

    python3 bench/replicas.py --gguf SmolLM2-135M-Instruct.Q4_1.gguf --dataset ShareGPT.json --work /var/tmp/rep \\
        --conversations 1000 --layouts 1x1,1x2,1x4          # one GPU
    python3 bench/replicas.py ... --layouts 1x1,8x1            # eight GPUs: at least 0.9 x linear is the target
    .venv/bin/python bench/replicas.py --model-path .cache/models/tiny-llama --dataset demo.jsonl \\
        --work /tmp/rep --device cpu --conversations 16 --layouts 1x1,1x2 --max-new-tokens 8   # the CPU, a smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

sys.path.insert(0, str(ROOT / "bench"))

from extraction import _env as env  # noqa: E402  (bench/extraction.py: src on PYTHONPATH)
from extraction import free_port, stop_server  # noqa: E402

from eagle3_pipeline.serve.plan import server_plan  # noqa: E402
from eagle3_pipeline.server_client import EngineClient  # noqa: E402


def say(message: str) -> None:
    print(f"[replicas] {message}", flush=True)


def parse_layout(text: str) -> tuple[int, int]:
    gpus, sep, per = text.partition("x")
    if not sep or not gpus.isdigit() or not per.isdigit() or int(gpus) < 1 or int(per) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: a layout is GPUSxREPLICAS, e.g. 1x4 or 8x1")
    return int(gpus), int(per)


class Server:
    """A server started from its plan in its own session; stopped with SIGTERM to the session."""

    def __init__(self, plan: dict, port: int, log: Path, timeout_s: float = 900.0):
        self.log = log
        with open(log, "w") as handle:
            self.proc = subprocess.Popen(plan["argv"], stdout=handle, stderr=subprocess.STDOUT, env=env(),  # noqa: S603
                                         start_new_session=True)
        self.url = f"http://127.0.0.1:{port}"
        client = EngineClient(self.url, timeout_s=5, retries=0)
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode}: {log.read_text()[-3000:]}")
            try:
                self.info = client.call("GET", "/server_info")
                break
            except Exception:  # noqa: BLE001 - not up yet
                if time.monotonic() > deadline:
                    self.stop()
                    raise TimeoutError(f"no server within {timeout_s:.0f} s: {log.read_text()[-3000:]}") from None
                time.sleep(0.5)
        wrong = {key: (self.info.get(key), want) for key, want in plan["expected_server_info"].items()
                 if self.info.get(key) != want}
        if wrong:
            self.stop()
            raise RuntimeError(f"the server's live settings differ from its plan (got, wanted): {wrong}")

    def cpu_seconds(self) -> float:
        """CPU seconds (user and system) the server's processes used so far: the front and its replicas."""
        import psutil  # noqa: PLC0415 - the GPU machine and the dev venv have it

        root = psutil.Process(self.proc.pid)
        total = 0.0
        for proc in [root, *root.children(recursive=True)]:
            try:
                times = proc.cpu_times()
            except psutil.Error:
                continue
            total += times.user + times.system
        return total

    def stop(self) -> None:
        stop_server(self.proc)


def timed(argv: list[str], log: Path) -> tuple[float, float]:
    """Run a client command; its wall seconds and the CPU seconds it used (user and system, its threads
    together: a client near one second a second is bound by its own Python thread)."""
    started, before = time.perf_counter(), resource.getrusage(resource.RUSAGE_CHILDREN)
    with open(log, "w") as handle:
        rc = subprocess.run(argv, stdout=handle, stderr=subprocess.STDOUT, env=env(), check=False).returncode
    if rc != 0:
        raise RuntimeError(f"{' '.join(argv[3:5])} exited with {rc}: {log.read_text()[-3000:]}")
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.perf_counter() - started, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def layout_plan(args, purpose: str, gpus: int, per: int, port: int, capture_dir: Path, capture_batch: int = 0) -> dict:
    extra = ["--replicas-per-device", str(per)] if gpus * per > 1 else []
    if purpose == "serve":
        extra = ["--max-batch-size", str(max(1, args.batch // per)), *args.serve_arg] + extra
    elif capture_batch > 0:
        extra = ["--max-batch-size", str(max(1, capture_batch // per))] + extra
    # As the regeneration role plans its serving server: slots sized to the longest request.
    return server_plan("reference", sys.executable, str(args.model_path), "127.0.0.1", port, str(capture_dir),
                       device=args.device, extra_args=extra, purpose=purpose, dp_size=gpus * per,
                       request_tokens=args.max_length + args.max_new_tokens if purpose == "serve" else 0)


def weighted_mean(workers: list[dict], mean: str, count: str) -> float:
    """The processes' means together: each weighted by how many it averaged (a replica of few steps counts less)."""
    total = sum(w[count] for w in workers)
    return sum(w[mean] * w[count] for w in workers) / total if total else 0.0


def regenerate(args, name: str, gpus: int, per: int) -> dict:
    out = args.work / f"regenerated-{name}"
    shutil.rmtree(out, ignore_errors=True)
    port = free_port()
    server = Server(layout_plan(args, "serve", gpus, per, port, args.work / "capture"), port,
                    args.work / f"serve-{name}.log")
    cpu_at_start = server.cpu_seconds()
    try:
        seconds, cpu = timed([sys.executable, "-m", "eagle3_pipeline.cli", "regenerate", "--dataset",
                              str(args.dataset), "--output-dir", str(out), "--server-url", server.url, "--num-samples",
                              str(args.conversations), "--concurrency", str(args.regeneration_concurrency * gpus),
                              "--max-new-tokens", str(args.max_new_tokens), "--max-length", str(args.max_length),
                              "--model-path", str(args.model_path), "--quiet"], args.work / f"regenerate-{name}.log")
        info = EngineClient(server.url, timeout_s=60, retries=0).call("GET", "/server_info")
        server_cpu = server.cpu_seconds() - cpu_at_start
    finally:
        server.stop()
    # Each process's model thread: the rows a decode step carried, and the share of its time spent decoding.
    workers = [r["worker"] for r in info["replicas"]] if "replicas" in info else [info["worker"]]
    summary = json.loads((out / "regeneration.json").read_text())
    tokens = int(summary["generated_tokens"])
    return {"seconds": seconds, "tokens": tokens, "tokens_per_s": tokens / seconds,
            "client_cpu": cpu / seconds, "server_cpu": server_cpu / seconds,
            "conversations": summary["num_conversations"], "output": out, "workers": workers,
            "mean_decode_batch": weighted_mean(workers, "mean_decode_batch", "decode_steps"),
            "prefills": sum(w["prefills"] for w in workers),
            "slot_waits": sum(w.get("slot_waits", 0) for w in workers),
            "mean_prefill_batch": weighted_mean(workers, "mean_prefill_batch", "prefills"),
            "decode_share": sum(w["decode_s"] / w["wall_s"] for w in workers) / len(workers),
            "prefill_share": sum(w["prefill_s"] / w["wall_s"] for w in workers) / len(workers),
            # A decode step's milliseconds, and where they went: the model thread on a CPU (Python, launches, a
            # spinning wait), waiting for the replayed steps on the GPU, answering the finished rows.
            "decode_step_ms": step_ms(workers, "decode_s"), "decode_cpu_ms": step_ms(workers, "decode_cpu_s"),
            "decode_gpu_wait_ms": step_ms(workers, "decode_gpu_wait_s"), "answer_ms": step_ms(workers, "answer_s")}


def step_ms(workers: list[dict], key: str) -> float | None:
    """``key``'s seconds over all processes' decode steps, in milliseconds a step (None where not reported)."""
    steps = sum(w["decode_steps"] for w in workers)
    if not steps or any(w.get(key) is None for w in workers):
        return None
    return 1000 * sum(w[key] for w in workers) / steps


def extract(args, name: str, gpus: int, per: int, dataset: Path, capture_batch: int = 0) -> dict:
    """The extraction of ``dataset`` through a fresh capture server of ``capture_batch`` requests a batch (0: the
    engine's default): the client's tokens/s, and the server's own account of its time."""
    name = f"{name}-b{capture_batch}" if capture_batch else name
    out = args.work / f"data-{name}"
    capture = Path(args.capture_root) / f"e3p-replicas-{os.getpid()}-{name}"
    for path in (out, capture):
        shutil.rmtree(path, ignore_errors=True)
    capture.mkdir(parents=True)
    port = free_port()
    server = Server(layout_plan(args, "capture", gpus, per, port, capture, capture_batch), port,
                    args.work / f"capture-{name}.log")
    try:
        seconds, cpu = timed([sys.executable, "-m", "eagle3_pipeline.cli", "extract", "--dataset", str(dataset),
                              "--output-dir", str(out), "--server-url", server.url, "--capture-dir", str(capture),
                              "--max-length", str(args.max_length), "--concurrency",
                              str(args.extraction_concurrency * gpus), "--model-path", str(args.model_path),
                              "--max-skip-ratio", "0.2", "--quiet"], args.work / f"extract-{name}.log")
        info = EngineClient(server.url, timeout_s=60, retries=0).call("GET", "/server_info")
    finally:
        server.stop()
        shutil.rmtree(capture, ignore_errors=True)
    manifest = json.loads((out / "data_config.json").read_text())
    shutil.rmtree(out, ignore_errors=True)
    tokens = int(manifest["num_tokens"])
    workers = [r["worker"] for r in info["replicas"]] if "replicas" in info else [info["worker"]]
    prefills = sum(w["prefills"] for w in workers)
    prefill_s = sum(w["prefill_s"] for w in workers)
    return {"seconds": seconds, "tokens": tokens, "tokens_per_s": tokens / seconds, "client_cpu": cpu / seconds,
            "samples": manifest["num_samples"], "capture_batch": capture_batch or None,
            "max_batch_size": info.get("max_batch_size"), "prefills": prefills,
            "mean_prefill_batch": weighted_mean(workers, "mean_prefill_batch", "prefills"),
            "prefill_ms": 1000 * prefill_s / prefills if prefills else None,
            "prefill_share": sum(w["prefill_s"] / w["wall_s"] for w in workers) / len(workers),
            "idle_share": sum(w["idle_s"] / w["wall_s"] for w in workers) / len(workers)}


def describe_extraction(name: str, ext: dict) -> str:
    """One line: an extraction and where its capture servers' time went."""
    batch = f"capture batch {ext['max_batch_size']}" if ext.get("max_batch_size") else "capture batch -"
    return (f"{name} extract ({batch}): {ext['tokens']:,} tokens in {ext['seconds']:.1f} s, "
            f"{ext['tokens_per_s']:,.0f} tokens/s; {ext['prefills']:,} prefills of {ext['mean_prefill_batch']:.1f} "
            f"requests, {ms(ext['prefill_ms'])} ms each; each server prefilling {ext['prefill_share']:.0%} and idle "
            f"{ext['idle_share']:.0%} of the time; the client used {ext['client_cpu']:.2f} CPU s a second")


def same_answers(first: Path, other: Path) -> tuple[int, int]:
    def read(path: Path) -> dict:
        rows = {}
        # Lines split at b"\n" only: str.splitlines would also split at U+2028 inside an answer's text.
        for line in (path / "regenerated.jsonl").read_bytes().split(b"\n"):
            if not line.strip():
                continue
            record = json.loads(line)
            rows[record.get("id")] = json.dumps(record, sort_keys=True)
        return rows

    mine, theirs = read(first), read(other)
    return sum(1 for key, value in mine.items() if theirs.get(key) == value), len(mine)


def ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def describe_regeneration(name: str, regen: dict) -> str:
    """One line: the layout's regeneration and where its processes' time went."""
    return (f"{name} regenerate: {regen['tokens']:,} tokens in {regen['seconds']:.1f} s, "
            f"{regen['tokens_per_s']:,.0f} tokens/s; a decode step carried {regen['mean_decode_batch']:.0f} requests "
            f"on average, a prefill {regen['mean_prefill_batch']:.1f} ({regen['prefills']:,} prefills; "
            f"{regen['slot_waits']:,} requests waited for a free slot); each process "
            f"decoding {regen['decode_share']:.0%} and prefilling {regen['prefill_share']:.0%} of the time; a decode "
            f"step {ms(regen['decode_step_ms'])} ms ({ms(regen['decode_cpu_ms'])} on the model thread's CPU, "
            f"{ms(regen['decode_gpu_wait_ms'])} waiting for the GPU, {ms(regen['answer_ms'])} answering); CPU "
            f"seconds a second: the client {regen['client_cpu']:.2f}, the server {regen['server_cpu']:.2f}; "
            f"{regen['same_as_first']} of {regen['compared']} conversations as the first layout")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--model-path", type=Path, help="the target, a Hugging Face model directory")
    where.add_argument("--gguf", type=Path, help="the target as a GGUF file (imported once under --work)")
    parser.add_argument("--dataset", type=Path, required=True, help="conversations (ShareGPT, JSON Lines, ...)")
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--conversations", type=int, default=1000)
    parser.add_argument("--layouts", type=lambda text: [parse_layout(t) for t in text.split(",")],
                        default=[(1, 1), (1, 2), (1, 4)], help="GPUSxREPLICAS,... (the first is the baseline)")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--max-length", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=512, help="the serving server's batch per GPU")
    parser.add_argument("--serve-arg", action="append", default=[], metavar="ARG",
                        help="one more argument of the serving server (repeat it: --serve-arg=--admit-wait-ms "
                        "--serve-arg=100)")
    parser.add_argument("--regeneration-concurrency", type=int, default=512, help="conversations in flight per GPU")
    parser.add_argument("--extraction-concurrency", type=int, default=32, help="samples in flight per GPU")
    parser.add_argument("--capture-root", default="/dev/shm" if Path("/dev/shm").is_dir() else "/tmp")
    parser.add_argument("--skip-extract", action="store_true")
    parser.add_argument("--capture-batches", type=lambda text: [int(t) for t in text.split(",")], default=[0],
                        help="the extraction once per capture-server batch (its --max-batch-size per GPU; 0: the "
                        "engine's default), side by side; the first is the baseline")
    parser.add_argument("--json", type=Path, help="also write the result here")
    args = parser.parse_args(argv)
    args.work = args.work.resolve()
    args.work.mkdir(parents=True, exist_ok=True)
    if args.gguf is not None:
        args.model_path = args.work / "model"
        if not (args.model_path / "config.json").is_file():
            timed([sys.executable, "-m", "eagle3_pipeline.cli", "import-gguf", "--gguf", str(args.gguf.resolve()),
                   "--output", str(args.model_path)], args.work / "import-gguf.log")
    args.model_path = args.model_path.resolve()
    rows = []
    first = None
    for gpus, per in args.layouts:
        name = f"{gpus}x{per}"
        row = {"layout": name, "gpus": gpus, "replicas_per_gpu": per}
        row["regenerate"] = regenerate(args, name, gpus, per)
        output = row["regenerate"].pop("output")
        first = first or output
        row["regenerate"]["same_as_first"], row["regenerate"]["compared"] = same_answers(first, output)
        say(describe_regeneration(name, row["regenerate"]))
        if not args.skip_extract:
            runs = [extract(args, name, gpus, per, first / "regenerated.jsonl", b) for b in args.capture_batches]
            for ext in runs:
                say(describe_extraction(name, ext))
            row["extract"], row["extract_batches"] = runs[0], runs
        rows.append(row)
    base = rows[0]
    print(f"\n| layout | processes | regenerate tokens/s | x {base['layout']} | mean decode batch | decoding | "
          f"same answers | extract tokens/s | x {base['layout']} |")
    print("|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        regen, ext = row["regenerate"], row.get("extract")
        print(f"| {row['layout']} | {row['gpus'] * row['replicas_per_gpu']} | {regen['tokens_per_s']:,.0f} | "
              f"{regen['tokens_per_s'] / base['regenerate']['tokens_per_s']:.2f} | {regen['mean_decode_batch']:.0f} | "
              f"{regen['decode_share']:.0%} | {regen['same_as_first']}/"
              f"{regen['compared']} | " + (f"{ext['tokens_per_s']:,.0f} | "
                                           f"{ext['tokens_per_s'] / base['extract']['tokens_per_s']:.2f} |"
                                           if ext else "- | - |"))
    result = {"rows": rows, "settings": {key: str(value) if isinstance(value, Path) else value
                                         for key, value in vars(args).items() if key != "layouts"}}
    if len(args.capture_batches) > 1 and not args.skip_extract:
        print("\n| layout | capture batch | extract tokens/s | x the first batch | prefills | requests a prefill | "
              "ms a prefill | prefilling | idle |")
        print("|---|---|---|---|---|---|---|---|---|")
        for row in rows:
            for ext in row["extract_batches"]:
                print(f"| {row['layout']} | {ext['max_batch_size'] or '-'} | {ext['tokens_per_s']:,.0f} | "
                      f"{ext['tokens_per_s'] / row['extract_batches'][0]['tokens_per_s']:.2f} | {ext['prefills']:,} | "
                      f"{ext['mean_prefill_batch']:.1f} | {ms(ext['prefill_ms'])} | {ext['prefill_share']:.0%} | "
                      f"{ext['idle_share']:.0%} |")
    print(json.dumps(result, indent=1))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
