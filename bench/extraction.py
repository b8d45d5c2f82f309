"""Benchmark: the full extraction's stored tokens/s against the same server's forward-only throughput.

One reference server (``serve-reference``, capture directory in /dev/shm) serves every round.
Rounds alternate, side by side in one run, over the same samples:

- ``forward``: the extraction's own token ids (``load_renderer`` + ``fit_length``, exactly what
  ``eagle3-pipeline extract`` sends) posted with ``max_new_tokens: 1``, ``temperature: 0`` and no
  logprobs, at the same concurrency, through the extraction's HTTP client. The server still
  writes a capture file per request (it cannot be told not to); this benchmark deletes each
  file as it appears.
- ``logprobs`` (diagnostic; ``--no-diagnostic`` drops it): the same requests asking for the
  input top-1 logprobs at every position (what ``--verify-positions 0`` asks of every sample;
  the default asks it of one record in 32 and the last 32 positions of the others), captures
  deleted as they appear, nothing verified or stored: the server's cost of a full check.
- ``extract``: ``python -m eagle3_pipeline.cli extract`` into a fresh output directory on the
  machine's disk (never tmpfs), every check on (top-1 at all positions), then the output is
  measured (bytes per token) and deleted.
- ``extract-float8`` (``--float8``): the same command with ``--storage-dtype float8_e4m3`` (the states
  quantized per token and layer after the checks): its tokens/s against ``extract``'s, round by round.

Timing, the same for every mode: from the moment the round's first capture file appears in the
capture directory (a watcher polls it every millisecond) to the last answer (forward, logprobs)
or to the last sample file written (extract: the newest sample file's mtime). So the sending
phase of the extraction is timed, without its start-up (imports, rendering the dataset, loading
lm_head) and without its end (manifest, merge). The progress file's own ``tokens_per_s``, which
includes the lm_head load and the merge, and the command's whole wall time are printed beside it.

Printed: a table of rounds, the medians, the ratio extract / forward (target >= 0.85), and the
bytes on disk per stored token against the exact (n_aux + 1) x H x dtype bytes + 5 (int32 ids
and uint8 mask); then the whole result as JSON.

The model: a Llama of about 1.0 B parameters (hidden 2048, 22 layers, vocab 4096) with random
bf16 weights, built locally on the CPU (tests/gpu/harness.py's ``build_random_llama``), with the
tiny model's tokenizer and chat template copied in (``--tokenizer-from DIR``; by default
``.cache/models/tiny-llama`` when present, else that tokenizer is trained here from this
Python's standard library in about 10 s). It is cached in ``--model-cache`` (/var/tmp/e3p-models),
which tests/gpu/test_extraction_gpu.py shares. The dataset: synthetic multi-turn conversations
about the standard library whose rendered lengths are uniform in [--min-tokens, --max-tokens]
(500-2000 by default); ``--dataset demo`` takes the short demo conversations instead.

Defaults: 3 rounds of 384 samples (about 470,000 prompt tokens), 32 requests in flight against
a server batch of at most 16 (so that the next batch is always queued), every mode alike.

On the GPU machine (Python with torch (CUDA), transformers and pytest; no registry, no
ansible), from the repository root, in one call (about 7 min; the test first, since it builds
the model that the benchmark then reuses from /var/tmp/e3p-models):

    export PYTHONPATH=src
    python3 -m pytest --noconftest -p no:cacheprovider tests/gpu/test_extraction_gpu.py -v -s 2>&1 | tee $OUT/test.txt
    python3 bench/extraction.py --json $OUT/extraction.json 2>&1 | tee $OUT/bench.txt

(``--noconftest``: tests/conftest.py imports ansible, which that machine lacks; the test skips
itself without CUDA. ``python3 tests/gpu/test_extraction_gpu.py`` runs the same test without
pytest. The JSON file is rewritten after every round, so a timeout keeps what was measured.)

Here, on a CPU machine, a quick test of this script with the tiny model (about a minute):

    PYTHONPATH=src .venv/bin/python bench/extraction.py --device cpu --small
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "tests" / "gpu"))

from eagle3_pipeline.extract.job import RID_PREFIX  # noqa: E402
from eagle3_pipeline.server_client import EngineClient  # noqa: E402

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
TINY_MODEL = ROOT / ".cache" / "models" / "tiny-llama"
DEFAULT_MODEL_CACHE = Path("/var/tmp/e3p-models")
TARGET_RATIO = 0.85
SYSTEM_PROMPT = "You are a helpful assistant who explains the Python standard library in detail."
QUESTIONS = ("Explain {name}.", "What does {name} do?", "Tell me about {name}.", "How is {name} used?")


def _log(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


def _env() -> dict:
    return dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in [str(ROOT / "src"), os.environ.get("PYTHONPATH")]
                                                        if p))


# -- model and tokenizer ---------------------------------------------------------------------
def tokenizer_dir(source: Path | None, cache: Path) -> Path:
    """A directory holding the tiny model's tokenizer files (and chat template).

    ``source`` (or the tiny model of this checkout) when it has them; else the tokenizer is
    trained here with the tiny model's own recipe (byte-level BPE, 4096 tokens, ~10 s).
    """
    for candidate in (source, TINY_MODEL):
        if candidate is not None and all((Path(candidate) / name).is_file() for name in TOKENIZER_FILES):
            return Path(candidate)
    if source is not None:
        raise FileNotFoundError(f"--tokenizer-from {source}: no {', '.join(TOKENIZER_FILES)} there")
    out = cache / "tiny-tokenizer"
    if all((out / name).is_file() for name in TOKENIZER_FILES):
        return out
    from eagle3_pipeline.data.stdlib_corpus import extract_entries  # noqa: PLC0415
    from eagle3_pipeline.models.tiny import TinyRecipe, _train_tokenizer, entry_text  # noqa: PLC0415

    _log(f"no tiny model here: training its tokenizer into {out} (about 10 s)")
    tmp = Path(tempfile.mkdtemp(prefix=".tiny-tokenizer-", dir=cache))
    _train_tokenizer([entry_text(entry) for entry in extract_entries()], TinyRecipe(), tmp)
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    return out


def prepare_model(cache: Path, tokenizer_from: Path | None = None, hidden: int = 2048, layers: int = 22,
                  heads: int = 32, kv_heads: int = 8, intermediate: int = 5632) -> Path:
    """A random-weight bf16 Llama whose vocabulary is the tiny tokenizer's, with that tokenizer; cached."""
    from harness import build_random_llama  # noqa: PLC0415
    from transformers import AutoTokenizer  # noqa: PLC0415

    cache.mkdir(parents=True, exist_ok=True)
    tokenizer_source = tokenizer_dir(tokenizer_from, cache)
    vocab = len(AutoTokenizer.from_pretrained(str(tokenizer_source), local_files_only=True))
    path = cache / f"llama-h{hidden}-l{layers}-i{intermediate}-v{vocab}"
    if not (path / "config.json").exists():
        _log(f"building {path.name} with random weights on the CPU (about 30 s)")
    build_random_llama(path, hidden=hidden, layers=layers, heads=heads, kv_heads=kv_heads,
                       intermediate=intermediate, vocab=vocab)
    for name in TOKENIZER_FILES:
        source, target = tokenizer_source / name, path / name
        if not target.is_file() or target.read_bytes() != source.read_bytes():
            shutil.copyfile(source, target.with_name(name + ".tmp"))
            os.replace(target.with_name(name + ".tmp"), target)
    return path


def parameter_count(model: Path) -> int:
    from safetensors import safe_open  # noqa: PLC0415

    total = 0
    for file in sorted(model.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 - not a dict
                count = 1
                for size in handle.get_slice(name).get_shape():
                    count *= size
                total += count
    return total


# -- dataset ---------------------------------------------------------------------------------
def write_long_dataset(path: Path, tokenizer, num_samples: int, min_tokens: int, max_tokens: int,
                       seed: int = 0) -> Path:
    """ShareGPT conversations about stdlib objects, each rendered to about U[min, max] tokens.

    Turns are added (question, the object's whole docstring as the answer) until the target is
    reached; the last answer is cut to fit. A third get a system prompt.
    """
    from eagle3_pipeline.data.demo_dataset import write_jsonl  # noqa: PLC0415
    from eagle3_pipeline.data.stdlib_corpus import extract_entries  # noqa: PLC0415
    from eagle3_pipeline.models.tiny import entry_text  # noqa: PLC0415

    rng = random.Random(seed)
    entries = [entry for entry in extract_entries() if len(entry.docstring) >= 40]
    rng.shuffle(entries)
    token_cache: dict[str, list[int]] = {}

    def ids_of(text: str) -> list[int]:
        if text not in token_cache:
            token_cache[text] = tokenizer(text, add_special_tokens=False)["input_ids"]
        return token_cache[text]

    records, cursor = [], 0
    for i in range(num_samples):
        target = rng.randint(min_tokens, max_tokens)
        turns, used = [], 1  # <s>
        if rng.random() < 0.3:
            turns.append({"from": "system", "value": SYSTEM_PROMPT})
            used += len(ids_of(SYSTEM_PROMPT)) + 4
        while used < target:
            entry = entries[cursor % len(entries)]
            cursor += 1
            question = rng.choice(QUESTIONS).format(name=entry.name)
            answer = entry_text(entry).strip()
            used += len(ids_of(question)) + 8  # two role headers, two ends, newlines
            answer_ids = ids_of(answer)
            room = max(8, target - used)
            if len(answer_ids) > room:
                answer = tokenizer.decode(answer_ids[:room], skip_special_tokens=True).strip() or answer[:40]
            turns += [{"from": "human", "value": question}, {"from": "gpt", "value": answer}]
            used += min(len(answer_ids), room)
        records.append({"id": f"bench-{i:05d}", "conversations": turns})
    write_jsonl(path, records)
    return path


def write_demo_dataset(path: Path, num_samples: int, seed: int = 0) -> Path:
    from eagle3_pipeline.data.demo_dataset import demo_conversations, write_jsonl  # noqa: PLC0415

    train, _ = demo_conversations(num_samples, 0.0, seed)
    write_jsonl(path, train)
    return path


def prepare_requests(dataset: Path, model: Path, max_length: int, num_samples: int) -> list[tuple[str, list[int]]]:
    """(sample id, token ids) of each sample, exactly as the extraction renders, masks and cuts it."""
    from eagle3_pipeline.conversations.dataset import Skip, read_dataset  # noqa: PLC0415
    from eagle3_pipeline.conversations.template import SampleError, fit_length, load_renderer  # noqa: PLC0415

    renderer = load_renderer(model)
    requests, skipped = [], 0
    for item in read_dataset(dataset, num_samples):
        if isinstance(item, Skip):
            skipped += 1
            continue
        try:
            ids, mask = renderer.render(list(item.messages))
            ids, mask, _ = fit_length(ids, mask, max_length, "truncate")
        except SampleError:
            skipped += 1
            continue
        requests.append((item.sample_id, ids))
    if skipped:
        _log(f"{skipped} records of the dataset are skipped by the renderer (the extraction skips them too)")
    return requests


# -- server ----------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(model: Path, port: int, device: str, capture_dir: Path, max_batch_size: int, log: Path,
                 timeout_s: float = 600) -> subprocess.Popen:
    """Start the reference engine in its own session and wait for /health."""
    cmd = [sys.executable, "-m", "eagle3_pipeline.cli", "serve-reference", "--model-path", str(model),
           "--port", str(port), "--device", device, "--capture-dir", str(capture_dir),
           "--max-batch-size", str(max_batch_size)]
    with open(log, "w") as handle:
        proc = subprocess.Popen(cmd, stdout=handle, stderr=subprocess.STDOUT, env=_env(), start_new_session=True)
    client = EngineClient(f"http://127.0.0.1:{port}", timeout_s=5, retries=0)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}: {log.read_text()[-3000:]}")
        try:
            client.call("GET", "/health")
            return proc
        except Exception:  # noqa: BLE001 - not up yet
            time.sleep(0.2)
    stop_server(proc)
    raise TimeoutError(f"the server was not ready within {timeout_s:.0f} s: {log.read_text()[-3000:]}")


def stop_server(proc: subprocess.Popen) -> None:
    """SIGTERM the server's session; SIGKILL it if it does not stop within a minute."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)
    except ProcessLookupError:
        pass
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)


# -- measuring -------------------------------------------------------------------------------
class CaptureWatcher(threading.Thread):
    """Polls the capture directory every millisecond: when the first capture of ``prefix`` appears
    (wall clock), and, with ``delete``, removes each capture file as it appears."""

    def __init__(self, capture_dir: Path, prefix: str, delete: bool):
        super().__init__(daemon=True, name="capture-watcher")
        self.capture_dir, self.prefix, self.delete = str(capture_dir), prefix, delete
        self.first: float | None = None
        self.deleted = 0
        self.deleted_bytes = 0
        self._halt = threading.Event()

    def _scan(self) -> None:
        with os.scandir(self.capture_dir) as entries:
            for entry in entries:
                if not (entry.name.startswith(self.prefix) and entry.name.endswith(".safetensors")):
                    continue
                if self.first is None:
                    self.first = time.time()
                if self.delete:
                    try:
                        size = entry.stat().st_size
                        os.unlink(entry.path)
                    except FileNotFoundError:
                        continue
                    self.deleted += 1
                    self.deleted_bytes += size

    def run(self) -> None:
        while not self._halt.is_set():
            self._scan()
            if self.first is not None and not self.delete:
                return
            time.sleep(0.001)

    def finish(self) -> None:
        self._halt.set()
        self.join()
        if self.delete:
            self._scan()  # the last files


def send_round(url: str, requests: list[tuple[str, list[int]]], concurrency: int, tag: str, capture_dir: Path,
               logprobs: bool) -> dict:
    """All requests, ``concurrency`` in flight, through the extraction's client; captures deleted."""
    client = EngineClient(url, timeout_s=600, retries=2)
    watcher = CaptureWatcher(capture_dir, f"{tag}-", delete=True)
    watcher.start()

    def one(item: tuple[int, tuple[str, list[int]]]) -> int:
        index, (_, ids) = item
        rid = f"{tag}-{index:05d}"
        if logprobs:  # the extraction's request body, checking every position (--verify-positions 0)
            answer = client.generate(ids, rid, 0)
        else:
            answer = client.call("POST", "/generate", {
                "input_ids": ids, "rid": rid, "sampling_params": {"max_new_tokens": 1, "temperature": 0.0}})
        got = answer["meta_info"]["prompt_tokens"]
        if got != len(ids):
            raise RuntimeError(f"{rid}: the server counted {got} prompt tokens, {len(ids)} were sent")
        return got

    started = time.time()
    try:
        with ThreadPoolExecutor(concurrency) as pool:
            tokens = sum(pool.map(one, enumerate(requests)))
    finally:
        ended = time.time()
        watcher.finish()
    first = watcher.first or started
    return {"samples": len(requests), "tokens": tokens, "seconds": ended - first,
            "seconds_from_first_send": ended - started, "tokens_per_s": tokens / (ended - first),
            "captures_deleted": watcher.deleted, "captured_bytes": watcher.deleted_bytes}


def fs_type(path: Path) -> str:
    """The filesystem type of the mount holding ``path`` (from /proc/mounts)."""
    best, kind = "", "?"
    real = str(path.resolve())
    try:
        with open("/proc/mounts") as handle:
            for line in handle:
                fields = line.split()
                mount = fields[1]
                if (real == mount or real.startswith(mount.rstrip("/") + "/")) and len(mount) >= len(best):
                    best, kind = mount, fields[2]
    except OSError:
        pass
    return kind


def extract_round(url: str, dataset: Path, out: Path, capture_dir: Path, settings: dict,
                  requests: list[tuple[str, list[int]]], log: Path, storage_dtype: str = "bfloat16",
                  env: dict | None = None) -> dict:
    """One ``eagle3-pipeline extract`` into a fresh ``out``; timed, checked, measured, then deleted."""
    from safetensors import safe_open  # noqa: PLC0415

    from eagle3_pipeline.extract.storage import Layout  # noqa: PLC0415

    shutil.rmtree(out, ignore_errors=True)
    cmd = [sys.executable, "-m", "eagle3_pipeline.cli", "extract", "--dataset", str(dataset), "--output-dir", str(out),
           "--server-url", url, "--num-samples", str(settings["samples"]), "--max-length", str(settings["max_length"]),
           "--concurrency", str(settings["concurrency"]), "--storage-dtype", storage_dtype,
           *settings.get("extract_args", [])]
    watcher = CaptureWatcher(capture_dir, f"{RID_PREFIX}-", delete=False)
    watcher.start()
    started = time.time()
    with open(log, "w") as handle:
        rc = subprocess.run(cmd, stdout=handle, stderr=subprocess.STDOUT, env={**_env(), **(env or {})}, check=False,
                            timeout=900).returncode
    exited = time.time()
    watcher.finish()
    if rc != 0:
        raise RuntimeError(f"extract exited with {rc}: {log.read_text()[-3000:]}")
    manifest = json.loads((out / "data_config.json").read_text())
    progress = json.loads((out / "parts" / "part-0-of-1.progress.json").read_text())
    entries = [entry for shard in manifest["shards"].values() for entry in shard["files"]]
    if manifest["failed"] or manifest["skipped"] or manifest["num_samples"] != len(requests):
        raise RuntimeError(f"extract stored {manifest['num_samples']} of {len(requests)} samples; failed "
                           f"{manifest['failed'][:3]}, skipped {manifest['skipped'][:3]}")
    # The same token ids as the forward rounds sent, sample by sample.
    sent = dict(requests)
    last_written, file_bytes, allocated, data_bytes = 0.0, 0, 0, 0
    for entry in entries:
        path = out / entry["file"]
        stat = path.stat()
        last_written = max(last_written, stat.st_mtime)
        file_bytes += stat.st_size
        allocated += stat.st_blocks * 512
        with open(path, "rb") as handle:
            data_bytes += stat.st_size - 8 - int.from_bytes(handle.read(8), "little")
        with safe_open(str(path), framework="pt") as handle:
            if handle.get_tensor("input_ids").tolist() != sent[entry["id"]]:
                raise RuntimeError(f"{entry['file']}: stored input_ids differ from the forward rounds' request")
    all_files = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    sync_started = time.monotonic()
    os.sync()  # the files were written to the page cache: how long the disk needs to take them
    sync_s = time.monotonic() - sync_started
    near_ties = checked = 0
    journal = out / "parts" / "part-0-of-1.journal.jsonl"
    for line in journal.read_text().splitlines():
        record = json.loads(line)
        near_ties += record.get("near_ties", 0)
        checked += record.get("checked_positions", 0)
    tokens = manifest["num_tokens"]
    first = watcher.first or started
    seconds = max(last_written - first, 1e-9)
    n_aux, hidden = len(manifest["aux_layers"]), manifest["hidden_size"]
    layout = Layout.of(manifest)
    exact = layout.bytes_per_token()
    shutil.rmtree(out, ignore_errors=True)
    return {
        "samples": manifest["num_samples"], "tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds,
        "command_wall_s": exited - started, "progress_tokens_per_s": progress["tokens_per_s"],
        "sync_after_s": sync_s, "disk_bound_tokens_per_s": tokens / (seconds + sync_s),
        "positions_checked": checked, "near_ties": near_ties,
        "bytes": {"exact_per_token": exact, "formula": layout.formula(), "n_aux": n_aux, "hidden": hidden,
                  "dtype": layout.storage,
                  "data_per_token": data_bytes / tokens, "sample_files_per_token": file_bytes / tokens,
                  "allocated_per_token": allocated / tokens, "all_output_files_per_token": all_files / tokens,
                  "sample_files": file_bytes, "headers_per_file": (file_bytes - data_bytes) / len(entries)},
    }


# -- the run ---------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--small", action="store_true",
                        help="the tiny model, 48 short samples, concurrency 8, 2 rounds: a quick test of the script")
    parser.add_argument("--rounds", type=int)
    parser.add_argument("--samples", type=int, help="samples per round (default 384; --small 48)")
    parser.add_argument("--dataset", choices=["long", "demo"], default="long")
    parser.add_argument("--min-tokens", type=int, help="shortest rendered conversation (default 500; --small 100)")
    parser.add_argument("--max-tokens", type=int, help="longest, and --max-length (default 2000; --small 400)")
    parser.add_argument("--concurrency", type=int,
                        help="requests in flight, every mode (default 32: twice the batch, so that the server always "
                             "has the next batch queued; --small 8)")
    parser.add_argument("--max-batch-size", type=int, help="the server's (default 16; --small 4)")
    parser.add_argument("--model-path", type=Path, help="serve this model directory (with tokenizer) instead")
    parser.add_argument("--tokenizer-from", type=Path,
                        help="a model directory whose tokenizer files to copy (default: .cache/models/tiny-llama)")
    parser.add_argument("--model-cache", type=Path, default=DEFAULT_MODEL_CACHE)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=22)
    parser.add_argument("--intermediate", type=int, default=5632)
    parser.add_argument("--work-dir", type=Path, help="the extraction's output goes here (default: a new dir in "
                                                      "/var/tmp); must not be tmpfs")
    parser.add_argument("--no-diagnostic", action="store_true", help="skip the logprobs-only rounds")
    parser.add_argument("--float8-env", action="append", default=[], metavar="NAME=VALUE[,NAME=VALUE]",
                        help="also a float8 extract round with these environment variables; each use one more "
                        "round, e.g. OMP_NUM_THREADS=1 (the quantization in 66 worker threads without torch's own "
                        "thread teams) or GOMP_SPINCOUNT=1000 (idle OpenMP threads that do not spin)")
    parser.add_argument("--float8", action="store_true",
                        help="also an extract round storing float8_e4m3 (--storage-dtype) after each bf16 one: "
                        "the same requests, its tokens/s beside bf16's")
    parser.add_argument("--extract-arg", action="append", default=[], metavar="ARG",
                        help="one more argument for extract (repeat), e.g. --extract-arg=--verify-device=cpu")
    parser.add_argument("--keep", action="store_true", help="keep the work directory (dataset, logs)")
    parser.add_argument("--json", type=Path, help="also write the result here")
    args = parser.parse_args(argv)
    small = {"rounds": 2, "samples": 48, "min_tokens": 100, "max_tokens": 400, "concurrency": 8,
             "max_batch_size": 4}
    full = {"rounds": 3, "samples": 384, "min_tokens": 500, "max_tokens": 2000, "concurrency": 32,
            "max_batch_size": 16}
    for key, value in (small if args.small else full).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.small and args.model_path is None:
        args.model_path = TINY_MODEL
    return args


def gpu_name() -> str:
    try:
        done = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=30, check=False)
        return done.stdout.strip().splitlines()[0] if done.returncode == 0 and done.stdout.strip() else "?"
    except (OSError, subprocess.TimeoutExpired):
        return "?"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from transformers import AutoTokenizer  # noqa: PLC0415

    if args.model_path is not None:
        model = args.model_path.resolve()
        if not (model / "config.json").is_file():
            if model == TINY_MODEL.resolve():
                raise SystemExit(f"{model} is not built: run `PYTHONPATH=src python -m eagle3_pipeline.cli tiny-model "
                                 f"--output {model}` (about 12 min on 2 cores) or `make demo`")
            raise SystemExit(f"--model-path {model}: no config.json")
    else:
        model = prepare_model(args.model_cache, args.tokenizer_from, args.hidden, args.layers,
                              intermediate=args.intermediate)
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="e3p-extract-bench-", dir=work_parent()))
    work.mkdir(parents=True, exist_ok=True)
    if fs_type(work) in ("tmpfs", "ramfs"):
        raise SystemExit(f"--work-dir {work} is on {fs_type(work)}: the extraction must write to a disk")
    shm = Path(tempfile.mkdtemp(prefix="e3p-extract-bench-", dir="/dev/shm"))
    capture_dir = shm / "capture"
    server = None
    try:
        config = json.loads((model / "config.json").read_text())
        dataset = work / "dataset.jsonl"
        if args.dataset == "demo":
            write_demo_dataset(dataset, args.samples)
        else:
            tokenizer = AutoTokenizer.from_pretrained(str(model), local_files_only=True)
            write_long_dataset(dataset, tokenizer, args.samples, args.min_tokens, args.max_tokens)
        requests = prepare_requests(dataset, model, args.max_tokens, args.samples)
        lengths = [len(ids) for _, ids in requests]
        settings = {"samples": args.samples, "max_length": args.max_tokens, "concurrency": args.concurrency,
                    "max_batch_size": args.max_batch_size, "rounds": args.rounds, "dataset": args.dataset,
                    "min_tokens": args.min_tokens, "max_tokens": args.max_tokens, "extract_args": args.extract_arg,
                    "float8_env": args.float8_env}
        info = {
            "device": args.device, "gpu": gpu_name() if args.device == "cuda" else None,
            "model": {"path": str(model), "parameters": parameter_count(model), "hidden_size": config["hidden_size"],
                      "layers": config["num_hidden_layers"], "vocab_size": config["vocab_size"]},
            "prompt_tokens": {"samples": len(requests), "total": sum(lengths), "min": min(lengths),
                              "median": statistics.median(lengths), "max": max(lengths)},
            "work_dir": str(work), "work_fs": fs_type(work), "capture_dir": str(capture_dir),
        }
        _log(f"model {model.name}: {_params(info['model']['parameters'])}; {len(requests)} samples, "
             f"{sum(lengths):,} prompt tokens (min {min(lengths)}, median {statistics.median(lengths):.0f}, max "
             f"{max(lengths)}); output on {info['work_fs']} ({work})")
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        started = time.monotonic()
        server = start_server(model, port, args.device, capture_dir, args.max_batch_size, work / "server.log")
        _log(f"server ready after {time.monotonic() - started:.1f} s ({url}, max batch {args.max_batch_size})")
        warm = requests[: 2 * args.max_batch_size]
        send_round(url, warm, args.concurrency, "warm-fwd", capture_dir, logprobs=False)
        send_round(url, warm, args.concurrency, "warm-lp", capture_dir, logprobs=True)
        modes = (["forward"] + ([] if args.no_diagnostic else ["logprobs"]) + ["extract"]
                 + (["extract-float8"] if args.float8 else [])
                 + [f"extract-float8-env{number}" for number in range(len(args.float8_env))])
        float8_envs = {f"extract-float8-env{number}": dict(pair.split("=", 1) for pair in item.split(","))
                       for number, item in enumerate(args.float8_env)}
        rows = []
        for number in range(1, args.rounds + 1):
            for mode in modes:
                if mode.startswith("extract"):
                    row = extract_round(url, dataset, work / "out", capture_dir, settings, requests,
                                        work / f"{mode}-{number}.log",
                                        "bfloat16" if mode == "extract" else "float8_e4m3",
                                        float8_envs.get(mode))
                else:
                    row = send_round(url, requests, args.concurrency, f"{mode[:3]}{number}", capture_dir,
                                     logprobs=mode == "logprobs")
                row = {"round": number, "mode": mode, **row}
                rows.append(row)
                if args.json:  # what is measured so far survives a timeout
                    _write_json(args.json, {**info, "settings": settings, "partial": True, "rounds": rows})
                _log(f"round {number} {mode}: {row['tokens']:,} tokens in {row['seconds']:.2f} s = "
                     f"{row['tokens_per_s']:,.0f} tokens/s")
        result = summarize(info, settings, rows)
        print_report(result)
        text = json.dumps(result, indent=2)
        print(text)
        if args.json:
            _write_json(args.json, result)
        return 0
    finally:
        if server is not None:
            stop_server(server)
        shutil.rmtree(shm, ignore_errors=True)
        if not args.keep and args.work_dir is None:
            shutil.rmtree(work, ignore_errors=True)


def _params(count: int) -> str:
    return f"{count / 1e9:.2f} B parameters" if count >= 1e8 else f"{count / 1e6:.1f} M parameters"


def _write_json(path: Path, document: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document, indent=2) + "\n")


def work_parent() -> Path:
    """Where the extraction writes by default: /var/tmp, or the repository's output/ when that is tmpfs."""
    for candidate in (Path("/var/tmp"), ROOT / "output"):
        candidate.mkdir(parents=True, exist_ok=True)
        if fs_type(candidate) not in ("tmpfs", "ramfs"):
            return candidate
    raise SystemExit("neither /var/tmp nor output/ is on a disk: give --work-dir on one")


def summarize(info: dict, settings: dict, rows: list[dict]) -> dict:
    medians = {mode: statistics.median(r["tokens_per_s"] for r in rows if r["mode"] == mode)
               for mode in dict.fromkeys(r["mode"] for r in rows)}
    by_round: dict[int, dict] = {}
    for row in rows:
        by_round.setdefault(row["round"], {})[row["mode"]] = row["tokens_per_s"]
    extract_rows = [r for r in rows if r["mode"] == "extract"]
    return {
        **info, "settings": settings, "rounds": rows, "median_tokens_per_s": medians,
        "ratio": medians["extract"] / medians["forward"], "target": TARGET_RATIO,
        "ratio_per_round": [round(r["extract"] / r["forward"], 3) for r in by_round.values()],
        "logprobs_ratio": medians["logprobs"] / medians["forward"] if "logprobs" in medians else None,
        "float8_ratio": medians["extract-float8"] / medians["extract"] if "extract-float8" in medians else None,
        "float8_ratio_per_round": [round(r["extract-float8"] / r["extract"], 3) for r in by_round.values()
                                   if "extract-float8" in r],
        "float8_env_ratios": {item: medians[f"extract-float8-env{number}"] / medians["extract"]
                              for number, item in enumerate(settings["float8_env"])},
        "bytes": extract_rows[0]["bytes"],
        "float8_bytes": next((r["bytes"] for r in rows if r["mode"] == "extract-float8"), None),
        "near_ties": sum(r["near_ties"] for r in extract_rows),
        "positions_checked": sum(r["positions_checked"] for r in extract_rows),
        "timing": "from the round's first capture file appearing to the last answer (forward, logprobs) or the "
                  "newest stored sample file's mtime (extract); progress_tokens_per_s is the extraction's own "
                  "figure (includes loading lm_head and the merge)",
    }


def print_report(result: dict) -> None:
    s = result["settings"]
    p = result["prompt_tokens"]
    m = result["model"]
    print(f"\nModel: {_params(m['parameters'])} (hidden {m['hidden_size']}, {m['layers']} layers, vocab "
          f"{m['vocab_size']}), {result['device']}{' (' + result['gpu'] + ')' if result.get('gpu') else ''}")
    print(f"Samples per round: {p['samples']}, {p['total']:,} prompt tokens (min {p['min']}, median {p['median']:.0f}, "
          f"max {p['max']}); concurrency {s['concurrency']}, server max batch {s['max_batch_size']}; extraction "
          f"output on {result['work_fs']}")
    print("\n| round | mode | tokens | seconds | tokens/s | notes |")
    print("|---|---|---|---|---|---|")
    for r in result["rounds"]:
        if r["mode"].startswith("extract"):
            note = (f"command {r['command_wall_s']:.1f} s; progress file {r['progress_tokens_per_s']:,.0f} tokens/s; "
                    f"os.sync() after {r['sync_after_s']:.1f} s "
                    f"({r['disk_bound_tokens_per_s']:,.0f} tokens/s with it); "
                    f"{r['near_ties']} near-ties of {r['positions_checked']:,}")
        else:
            note = (f"{r['captures_deleted']} capture files ({r['captured_bytes'] / 1e9:.2f} GB) written by the "
                    f"server and deleted; {r['seconds_from_first_send']:.2f} s from the first send")
        print(f"| {r['round']} | {r['mode']} | {r['tokens']:,} | {r['seconds']:.2f} | {r['tokens_per_s']:,.0f} | "
              f"{note} |")
    med = result["median_tokens_per_s"]
    print("\nMedians (tokens/s): " + ", ".join(f"{k} {v:,.0f}" for k, v in med.items()))
    verdict = "meets" if result["ratio"] >= result["target"] else "MISSES"
    print(f"Ratio extract / forward (medians): {result['ratio']:.3f}: {verdict} the target (>= {result['target']}); "
          f"per round: {', '.join(map(str, result['ratio_per_round']))}")
    if result["logprobs_ratio"] is not None:
        print(f"Diagnostic: forward with input top-1 logprobs at every position (what --verify-positions 0 asks "
              f"of every sample) / forward: {result['logprobs_ratio']:.3f}")
    if result["float8_ratio"] is not None:
        print(f"Ratio extract float8 / extract bfloat16 (medians; target >= 1, no slower): "
              f"{result['float8_ratio']:.3f}; per round: {', '.join(map(str, result['float8_ratio_per_round']))}")
    for item, ratio in result["float8_env_ratios"].items():
        print(f"Ratio extract float8 with {item} / extract bfloat16 (medians): {ratio:.3f}")
    for b in filter(None, (result["bytes"], result["float8_bytes"])):
        print(f"Bytes per stored token, {b['dtype']}: exact {b['formula']} = {b['exact_per_token']}; tensor data "
              f"{b['data_per_token']:.2f}; sample files {b['sample_files_per_token']:.2f} "
              f"({b['headers_per_file']:.0f} header bytes per file); all output files "
              f"{b['all_output_files_per_token']:.2f}; allocated on disk {b['allocated_per_token']:.2f}")
    print(f"Timing: {result['timing']}\n")


if __name__ == "__main__":
    sys.exit(main())
