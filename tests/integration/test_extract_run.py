"""``eagle3-pipeline extract`` end to end: real reference servers, real HTTP, real files, real kills.

Servers are ``eagle3-pipeline serve-reference`` subprocesses on free ports serving the tiny
model, with ``--max-batch-size 1`` so that every request is computed alone and the stored bytes
are deterministic (a run killed and resumed must end bit-identical to one that was not). Their
capture directories are in shared memory, as in production. The extraction runs as the
operator runs it: ``python -m eagle3_pipeline.cli extract ...`` in a subprocess, killed with
SIGKILL or SIGTERM where the test says so. One uninterrupted run (``reference_run``) is the
yardstick the crash, stop, restart and two-host runs must equal, file for file.
"""

from __future__ import annotations

import errno
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_target import built_tiny_model

from eagle3_pipeline.data.demo_dataset import sharegpt_to_messages, write_demo_dataset
from eagle3_pipeline.extract.store import Journal, file_sha256, shard_dir_name, verify_dataset
from eagle3_pipeline.models.tiny import ASSISTANT_TOKEN, END_TOKEN, assistant_token_spans

CLI = [sys.executable, "-m", "eagle3_pipeline.cli"]
AUX_LAYERS = [0, 1, 2]
NUM_SAMPLES = 48
SHARD_SIZE = 16
SHARDS = ["rows_0-16", "rows_16-32", "rows_32-48"]
HIDDEN = 256
START_TIMEOUT_S = 120.0
RUN_TIMEOUT_S = 300.0
SHM = Path("/dev/shm") if os.access("/dev/shm", os.W_OK) else None


# -- servers -----------------------------------------------------------------------------------
class ReferenceServer:
    """An ``eagle3-pipeline serve-reference`` subprocess; ``wait_ready`` learns its port from its log."""

    def __init__(self, name: str, model_dir: Path, workdir: Path, aux_layers=AUX_LAYERS, capture_dir=None,
                 cli: list[str] = CLI):
        self.name = name
        self.capture_dir = Path(capture_dir or tempfile.mkdtemp(prefix=f"e3x-test-{name}-", dir=SHM))
        self.log_file = workdir / f"server-{name}.log"
        self.stderr = open(workdir / f"server-{name}.stderr", "w")  # noqa: SIM115 - closed in stop()
        command = [
            *cli, "serve-reference", "--model-path", str(model_dir), "--port", "0",
            "--capture-dir", str(self.capture_dir), "--aux-layers", ",".join(map(str, aux_layers)),
            "--max-batch-size", "1", "--log-file", str(self.log_file),
        ]  # fmt: skip
        self.proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=self.stderr, stderr=subprocess.STDOUT)
        self.url = None

    def wait_ready(self) -> ReferenceServer:
        deadline = time.monotonic() + START_TIMEOUT_S
        while self.url is None:
            if self.proc.poll() is not None:
                raise AssertionError(f"server {self.name} exited with {self.proc.returncode}: {self.log()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"server {self.name} not serving after {START_TIMEOUT_S} s: {self.log()}")
            match = re.search(r"serving (http://[\d.]+:\d+)", self.log())
            if match:
                self.url = match.group(1)
            else:
                time.sleep(0.05)
        return self

    def log(self) -> str:
        return self.log_file.read_text() if self.log_file.exists() else "(no log yet)"

    def our_captures(self) -> list[str]:
        """Capture files (or their temp files) of extraction requests left in the capture directory."""
        return sorted(p.name for p in self.capture_dir.iterdir() if "e3x-" in p.name)

    def kill(self) -> None:
        """SIGKILL, as a crashed or OOM-killed server."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)

    def terminate(self) -> None:
        """SIGTERM: the server finishes what it runs and exits (``stop`` waits for it)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def stop(self, remove_captures: bool = True) -> None:
        if self.proc.poll() is None:
            self.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=30)
        self.stderr.close()
        if remove_captures:
            shutil.rmtree(self.capture_dir, ignore_errors=True)


@pytest.fixture(scope="module")
def tiny_model() -> Path:
    """The real tiny model in the checkout's cache (built once per checkout)."""
    return built_tiny_model()


@pytest.fixture(scope="module")
def servers(tiny_model, tmp_path_factory):
    """Three servers started side by side: ``main`` and ``second`` (same settings), ``other_layers``."""
    workdir = tmp_path_factory.mktemp("servers")
    started = {
        "main": ReferenceServer("main", tiny_model, workdir),
        "second": ReferenceServer("second", tiny_model, workdir),
        "other_layers": ReferenceServer("other-layers", tiny_model, workdir, aux_layers=[0, 2]),
    }
    try:
        for server in started.values():
            server.wait_ready()
        yield started
    finally:
        for server in started.values():
            server.terminate()  # all at once: each takes a moment to drain
        for server in started.values():
            server.stop()


@pytest.fixture
def start_server(tiny_model, tmp_path):
    """Factory for a server of this test only (stopped, or found killed, at the end)."""
    started = []

    def start(name: str, capture_dir=None, wait: bool = True) -> ReferenceServer:
        server = ReferenceServer(name, tiny_model, tmp_path, capture_dir=capture_dir)
        started.append(server)
        return server.wait_ready() if wait else server

    yield start
    for server in started:
        server.terminate()
    for server in started:
        server.stop()


# -- the dataset and the runs ------------------------------------------------------------------
@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("data") / "demo.jsonl"
    write_demo_dataset(path, num_samples=NUM_SAMPLES + 12, held_out_fraction=0.0)
    return path


def extract_command(dataset: Path, out: Path, url: str, *extra: str, num_samples: int = NUM_SAMPLES) -> list[str]:
    """The extraction every run of this file shares (later options win: argparse keeps the last)."""
    return [
        *CLI, "extract", "--dataset", str(dataset), "--output-dir", str(out), "--server-url", url,
        "--num-samples", str(num_samples), "--shard-size", str(SHARD_SIZE), "--concurrency", "4", *extra,
    ]  # fmt: skip


def run_cli(command: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(command, capture_output=True, text=True, timeout=RUN_TIMEOUT_S, check=False,
                          stdin=subprocess.DEVNULL)


class Background:
    """A CLI run in the background, its output in a file (a pipe could fill and block it)."""

    def __init__(self, command: list[str], log: Path):
        self.log_path = log
        self._log = open(log, "w")  # noqa: SIM115 - closed in wait()
        self.proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT)

    def running(self) -> bool:
        return self.proc.poll() is None

    def signal(self, signum: int) -> None:
        if self.running():
            self.proc.send_signal(signum)

    def wait(self, timeout_s: float = RUN_TIMEOUT_S) -> int:
        try:
            return self.proc.wait(timeout=timeout_s)
        finally:
            self._log.close()

    def output(self) -> str:
        return self.log_path.read_text()


@pytest.fixture
def background(tmp_path):
    """Factory of background CLI runs; whatever still runs at the end is killed."""
    runs: list[Background] = []

    def start(command: list[str], name: str = "run") -> Background:
        run = Background(command, tmp_path / f"{name}-{len(runs)}.log")
        runs.append(run)
        return run

    yield start
    for run in runs:
        if run.running():
            run.proc.kill()
        run.wait(30)


def wait_until(condition, what: str, timeout_s: float = 120.0, poll_s: float = 0.005) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(poll_s)


def stored_files(out: Path) -> list[Path]:
    """Sample files in place (temp files, named .<name>.<random>.tmp, excluded)."""
    return sorted(p for p in out.glob("rows_*/*.safetensors") if not p.name.startswith("."))


def temp_files(out: Path) -> list[Path]:
    return sorted(out.glob("rows_*/.*.tmp"))


def snapshot(out: Path, progress: bool = False) -> dict[str, tuple[int, int, int]]:
    """(mtime, size, inode) of every data and manifest file: unchanged means not rewritten.

    Progress files (unless asked) and the run's lock (it holds the running PID) are status, not data.
    """
    return {
        str(p.relative_to(out)): (p.stat().st_mtime_ns, p.stat().st_size, p.stat().st_ino)
        for p in sorted(out.rglob("*"))
        if p.is_file() and (progress or not p.name.endswith(".progress.json")) and p.suffix != ".lock"
    }


def manifest(out: Path) -> dict:
    return json.loads((out / "data_config.json").read_text())


def progress(out: Path, part: str = "part-0-of-1") -> dict:
    return json.loads((out / "parts" / f"{part}.progress.json").read_text())


def journal_records(out: Path, part: str = "part-0-of-1") -> list[dict]:
    """The journal's whole records (a line torn by kill -9 or a full disk is none), as the job reads it."""
    path = out / "parts" / f"{part}.journal.jsonl"
    return list(Journal(path).load(repair=False).values())


def assert_journal_counts_only_whole_files(out: Path) -> int:
    """Every sample the journal calls stored is in place, byte for byte; returns how many."""
    stored = [r for r in journal_records(out) if r["status"] == "ok"]
    for record in stored:
        path = out / record["file"]
        assert path.stat().st_size == record["bytes"], record
        assert file_sha256(path) == record["sha256"], f"{record['file']} is not what the journal recorded"
    return len(stored)


def assert_same_samples(out: Path, reference: Path) -> None:
    """Every file of the reference run's manifest is also in ``out``'s, with equal tensors."""
    ours, theirs = manifest(out), manifest(reference)
    assert ours["shards"] == theirs["shards"]
    for shard in theirs["shards"].values():
        for entry in shard["files"]:
            got, want = load_file(str(out / entry["file"])), load_file(str(reference / entry["file"]))
            assert got.keys() == want.keys()
            for name in want:
                assert torch.equal(got[name], want[name]), f"{entry['file']}: {name} differs"
    assert (out / "token_counts.safetensors").read_bytes() == (reference / "token_counts.safetensors").read_bytes()


@pytest.fixture(scope="module")
def reference_run(servers, dataset, tmp_path_factory) -> Path:
    """One uninterrupted extraction of the first NUM_SAMPLES conversations."""
    out = tmp_path_factory.mktemp("reference") / "data"
    result = run_cli(extract_command(dataset, out, servers["main"].url))
    assert result.returncode == 0, result.stderr
    return out


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# -- (a) a run, checked against transformers ---------------------------------------------------
def test_a_run_stores_what_transformers_computes_for_each_conversation(reference_run, dataset, tiny_model, servers):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32, local_files_only=True).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_model, local_files_only=True)
    assistant_id, end_id = tokenizer.convert_tokens_to_ids([ASSISTANT_TOKEN, END_TOKEN])
    records = [json.loads(line) for line in dataset.read_text().splitlines()][:NUM_SAMPLES]
    data = manifest(reference_run)
    entries = {entry["id"]: entry for shard in data["shards"].values() for entry in shard["files"]}

    assert (data["num_samples"], data["num_records"], data["skipped"], data["failed"]) == (NUM_SAMPLES,) * 2 + ([],) * 2
    assert (data["aux_layers"], data["hidden_size"], data["dtype"], data["engine"]) == (
        AUX_LAYERS, HIDDEN, "float32", "reference")
    assert list(data["shards"]) == SHARDS
    assert sorted(entries) == sorted(record["id"] for record in records)
    total_tokens = 0
    for ordinal, record in enumerate(records):
        entry = entries[record["id"]]
        assert entry["file"] == f"{shard_dir_name(ordinal, SHARD_SIZE)}/{record['id']}.safetensors"
        stored = load_file(str(reference_run / entry["file"]))
        ids = tokenizer.apply_chat_template(sharegpt_to_messages(record), tokenize=True)["input_ids"]
        mask = [0] * len(ids)
        for start, stop in assistant_token_spans(ids, assistant_id, end_id):
            mask[start:stop] = [1] * (stop - start)
        with torch.inference_mode():
            hidden = model(torch.tensor([ids]), output_hidden_states=True).hidden_states
        aux = torch.cat([hidden[i + 1][0] for i in AUX_LAYERS], dim=-1)

        assert stored["input_ids"].tolist() == ids and stored["input_ids"].dtype == torch.int32
        assert stored["loss_mask"].tolist() == mask and stored["loss_mask"].dtype == torch.uint8
        assert torch.equal(stored["aux_hidden_states"], aux), record["id"]
        assert torch.equal(stored["last_hidden_states"], hidden[-1][0]), record["id"]
        assert (entry["tokens"], entry["loss_tokens"]) == (len(ids), sum(mask))
        total_tokens += len(ids)
    assert data["num_tokens"] == total_tokens
    assert servers["main"].our_captures() == [], "stored captures are removed from shared memory"
    done = progress(reference_run)
    assert (done["state"], done["done"], done["total"], done["tokens"]) == ("done", NUM_SAMPLES, NUM_SAMPLES,
                                                                           total_tokens)


def test_verify_passes_and_a_rerun_changes_nothing_and_check_says_complete(reference_run, dataset, servers):
    verified = run_cli([*CLI, "verify", str(reference_run)])
    assert verified.returncode == 0, verified.stdout + verified.stderr
    assert f"{NUM_SAMPLES} files checked (checksums, shapes, dtypes, finite values): all good" in verified.stdout

    before = snapshot(reference_run)
    command = extract_command(dataset, reference_run, servers["main"].url)
    rerun = run_cli(command)

    assert rerun.returncode == 0, rerun.stderr
    assert f"{NUM_SAMPLES} already stored, 0 to extract (0 tokens)" in rerun.stderr
    assert snapshot(reference_run) == before, "a rerun over a complete dataset rewrites nothing"
    check = run_cli([*command, "--check"])
    assert check.returncode == 0, check.stderr
    assert json.loads(check.stdout) == {
        "part": "0/1", "records": NUM_SAMPLES, "samples": NUM_SAMPLES, "skipped": 0, "stored": NUM_SAMPLES,
        "todo": 0, "todo_tokens": 0, "estimated_bytes": 0, "storage_dtype": "float32", "complete": True,
        "offline": False,
    }
    assert snapshot(reference_run) == before


def test_the_offline_check_judges_completeness_without_a_server(reference_run, dataset, tiny_model, tmp_path):
    """site.yml asks this before starting a server: complete for the same model, engine and aux layers only."""
    dead = f"http://127.0.0.1:{free_port()}"
    base = [*extract_command(dataset, reference_run, dead), "--check", "--offline", "--engine", "reference",
            "--model-path", str(tiny_model)]
    complete = run_cli([*base, "--aux-layers", ",".join(map(str, AUX_LAYERS))])
    assert complete.returncode == 0, complete.stderr
    assert json.loads(complete.stdout)["complete"] is True
    other_layers = json.loads(run_cli([*base, "--aux-layers", "0,1"]).stdout)
    assert other_layers["complete"] is False and "aux layers [0, 1, 2] -> [0, 1]" in other_layers["reason"]
    other_engine = json.loads(run_cli([*base[:-4], "--engine", "sglang", "--model-path", str(tiny_model)]).stdout)
    assert other_engine["complete"] is False and "engine reference -> sglang" in other_engine["reason"]
    nothing = run_cli([*extract_command(dataset, tmp_path / "none", dead), "--check", "--offline"])
    assert nothing.returncode == 0 and json.loads(nothing.stdout)["reason"] == "nothing extracted yet"


# -- (b) kill -9 at random moments -------------------------------------------------------------
def test_sigkill_at_random_moments_loses_nothing_and_ends_identical_to_an_uninterrupted_run(
    reference_run, dataset, servers, background, tmp_path
):
    out = tmp_path / "crashed"
    command = extract_command(dataset, out, servers["main"].url)
    rng = random.Random(4)
    kills = []
    def recorded() -> int:
        return sum(1 for record in journal_records(out) if record["status"] == "ok")

    while len(kills) < 3:
        # A new sample recorded (its file is in place before its journal line), then the kill a moment later.
        already = recorded()
        run = background(command, "killed")
        wait_until(lambda: recorded() > already or not run.running(), "a new sample recorded")  # noqa: B023
        time.sleep(rng.uniform(0.0, 0.25))
        assert run.running(), f"the run ended before kill {len(kills) + 1}: {run.output()}"
        run.signal(signal.SIGKILL)
        assert run.wait() == -signal.SIGKILL
        kills.append(assert_journal_counts_only_whole_files(out))
    assert 0 < kills[0] <= kills[-1] < NUM_SAMPLES, kills

    final = run_cli(command)

    assert final.returncode == 0, final.stderr
    assert f"{kills[-1]} already stored" in final.stderr
    assert_same_samples(out, reference_run)
    assert manifest(out) == manifest(reference_run)
    report = verify_dataset(out)
    assert report["ok"] and report["extra_files"] == [], report
    assert temp_files(out) == []
    assert servers["main"].our_captures() == []


# -- (c) SIGTERM -------------------------------------------------------------------------------
def test_sigterm_stops_cleanly_with_exit_4_and_a_rerun_completes(reference_run, dataset, servers, background,
                                                                 tmp_path):
    out = tmp_path / "stopped"
    command = extract_command(dataset, out, servers["main"].url, "--concurrency", "1")
    run = background(command, "terminated")
    wait_until(lambda: stored_files(out) or not run.running(), "the first sample file")

    run.signal(signal.SIGTERM)

    assert run.wait() == 4, run.output()
    state = progress(out)
    assert state["state"] == "stopped"
    assert 0 < state["done"] < NUM_SAMPLES
    assert state["done"] == len(stored_files(out)) == assert_journal_counts_only_whole_files(out)
    assert "stopped on request" in run.output() and "rerun to continue" in state["message"]
    assert not (out / "parts" / "part-0-of-1.json").exists()
    assert not (out / "data_config.json").exists()
    # --check beside a live run (the role's status step) must not cut the line it is appending.
    journal = out / "parts" / "part-0-of-1.journal.jsonl"
    with open(journal, "ab") as handle:
        handle.write(b'{"bytes":1234,"file":"rows_0-16/demo-0')
    torn = journal.read_bytes()
    check = run_cli([*command, "--check"])
    assert check.returncode == 0, check.stderr
    status = json.loads(check.stdout)
    assert (status["stored"], status["todo"], status["complete"]) == (state["done"], NUM_SAMPLES - state["done"],
                                                                     False)
    assert journal.read_bytes() == torn

    rerun = run_cli(command)

    assert rerun.returncode == 0, rerun.stderr
    assert f"{state['done']} already stored, {NUM_SAMPLES - state['done']} to extract" in rerun.stderr
    assert progress(out)["state"] == "done"
    assert_same_samples(out, reference_run)


# -- (d) the server unreachable, or gone mid-run -----------------------------------------------
def test_no_server_exits_3_naming_the_url_and_writes_nothing(dataset, tmp_path):
    url = f"http://127.0.0.1:{free_port()}"
    out = tmp_path / "out"

    result = run_cli(extract_command(dataset, out, url, "--retries", "1"))

    assert result.returncode == 3, result.stderr
    assert f"{url}/server_info: no answer after 2 attempts" in result.stderr
    assert "Traceback" not in result.stderr
    assert not out.exists()


def test_a_second_run_of_the_same_part_is_refused_while_the_first_holds_it(reference_run, dataset, servers):
    import fcntl  # noqa: PLC0415

    lock = reference_run / "parts" / "part-0-of-1.lock"
    with open(lock, "a+") as held:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        held.seek(0)
        held.truncate()
        held.write("424242\n")
        held.flush()
        before = snapshot(reference_run)
        result = run_cli(extract_command(dataset, reference_run, servers["main"].url))
    assert result.returncode == 2, result.stderr
    assert "another extraction of part 0/1 runs on" in result.stderr and "(pid 424242)" in result.stderr
    assert snapshot(reference_run) == before


def test_a_directory_of_another_host_split_is_refused_naming_it(reference_run, dataset, servers):
    before = snapshot(reference_run)
    result = run_cli(extract_command(dataset, reference_run, servers["main"].url, "--part", "1/2"))
    assert result.returncode == 2, result.stderr
    assert "holds parts of a split over 1 host(s), this run is part 1/2" in result.stderr
    assert snapshot(reference_run) == before


def test_a_server_killed_mid_run_exits_3_keeping_what_was_stored_for_the_rerun(
    reference_run, dataset, start_server, background, tmp_path
):
    server = start_server("doomed")
    out = tmp_path / "server-died"
    run = background(extract_command(dataset, out, server.url, "--concurrency", "1", "--retries", "1"), "orphaned")
    wait_until(lambda: len(stored_files(out)) >= 2 or not run.running(), "two sample files")

    server.kill()
    restarted = start_server("restarted", capture_dir=server.capture_dir, wait=False)  # loads meanwhile

    assert run.wait() == 3, run.output()
    assert f"{server.url}/generate: no answer after 2 attempts" in run.output()
    assert "Traceback" not in run.output()
    state = progress(out)
    assert state["state"] == "failed" and server.url in state["message"]
    kept = assert_journal_counts_only_whole_files(out)
    assert kept == state["done"] == len(stored_files(out)) >= 2
    assert not (out / "data_config.json").exists()

    rerun = run_cli(extract_command(dataset, out, restarted.wait_ready().url))

    assert rerun.returncode == 0, rerun.stderr
    assert f"{kept} already stored, {NUM_SAMPLES - kept} to extract" in rerun.stderr
    assert_same_samples(out, reference_run)
    assert restarted.our_captures() == [], "the killed server's last capture is cleaned up by the rerun"


# -- (e) other settings, same directory --------------------------------------------------------
def test_a_server_capturing_other_layers_is_refused_on_the_same_directory(reference_run, dataset, servers):
    before = snapshot(reference_run, progress=True)

    result = run_cli(extract_command(dataset, reference_run, servers["other_layers"].url))

    assert result.returncode == 2, result.stderr
    assert "aux_layers: recorded [0, 1, 2], now [0, 2]" in result.stderr
    assert "use another output directory" in result.stderr
    assert "hidden_size" not in result.stderr
    assert snapshot(reference_run, progress=True) == before, "nothing written"
    assert servers["other_layers"].our_captures() == []


# -- (f) bad input -----------------------------------------------------------------------------
def bad_corpus(dataset: Path, path: Path) -> tuple[list[dict], list[tuple[int, str]]]:
    """Good demo conversations with one of each kind of bad record between them.

    Returns the good records and the expected (line, reason) of each skip.
    """
    good = [json.loads(line) for line in dataset.read_text().splitlines()][:10]
    long_answer = " ".join(["word"] * 3000)
    lines = [
        json.dumps(good[0]).encode(),
        b'{"id": "broken", "conversations": [{"from": "human", "value": "Hi"}',
        json.dumps(good[1]).encode(),
        json.dumps({"id": "asks-only", "conversations": [{"from": "human", "value": "Anyone there?"}]}).encode(),
        json.dumps(good[2]).encode(),
        json.dumps({**good[3], "id": good[0]["id"]}).encode(),
        b'{"id": "latin-1", "conversations": [{"from": "human", "value": "caf\xe9?"}, '
        b'{"from": "gpt", "value": "Oui."}]}',
        json.dumps(good[3]).encode(),
        json.dumps({"id": "rambling", "conversations": [{"from": "human", "value": "Say it all."},
                                                        {"from": "gpt", "value": long_answer}]}).encode(),
        *(json.dumps(record).encode() for record in good[4:]),
    ]
    path.write_bytes(b"\n".join(lines) + b"\n")
    skips = [(2, "malformed_json"), (4, "no_assistant_turn"), (6, "duplicate_id"), (7, "undecodable_bytes"),
             (9, "too_long")]
    return good, skips


def test_bad_records_are_skipped_with_reason_and_line_and_the_rest_stored(reference_run, dataset, servers, tmp_path):
    good, skips = bad_corpus(dataset, tmp_path / "mixed.jsonl")
    out = tmp_path / "mixed"

    result = run_cli(extract_command(tmp_path / "mixed.jsonl", out, servers["main"].url, "--max-length", "512",
                                     "--overflow", "skip", "--max-skip-ratio", "0.5", num_samples=100))

    assert result.returncode == 0, result.stderr
    data = manifest(out)
    assert [(s["line"], s["reason"]) for s in data["skipped"]] == skips
    assert all(s["detail"] for s in data["skipped"])
    duplicate = next(s for s in data["skipped"] if s["reason"] == "duplicate_id")
    assert duplicate["id"] == good[0]["id"] and "line 1" in duplicate["detail"]
    assert (data["num_records"], data["num_samples"], data["failed"]) == (15, 10, [])
    stored = {entry["id"]: entry for shard in data["shards"].values() for entry in shard["files"]}
    assert sorted(stored) == sorted(record["id"] for record in good)
    assert "5 skipped" in result.stderr
    reference = {e["id"]: e for shard in manifest(reference_run)["shards"].values() for e in shard["files"]}
    for sample_id, entry in stored.items():
        got, want = load_file(str(out / entry["file"])), load_file(str(reference_run / reference[sample_id]["file"]))
        assert all(torch.equal(got[name], want[name]) for name in want), sample_id


def test_a_plan_rendered_in_several_processes_stores_the_same_samples_and_skips_as_one(dataset, servers, tmp_path):
    # The conversations rendered and tokenized in three forked processes (what a dataset of 512 records or more
    # gets by itself on a host with the CPUs): the same skips, in the same order, and the same files, byte for byte.
    bad_corpus(dataset, tmp_path / "mixed.jsonl")
    runs = {}
    for processes in ("1", "3"):
        out = tmp_path / f"processes-{processes}"
        result = run_cli(extract_command(tmp_path / "mixed.jsonl", out, servers["main"].url, "--max-length", "512",
                                         "--overflow", "skip", "--max-skip-ratio", "0.5", "--render-processes",
                                         processes, num_samples=100))
        assert result.returncode == 0, result.stderr
        # (the journal lists the samples as their requests finished, in any order)
        runs[processes] = (manifest(out), {name: data for name, data in data_files(out).items()
                                           if not name.endswith(".journal.jsonl")})
    (one, one_files), (three, three_files) = runs["1"], runs["3"]
    assert three["skipped"] == one["skipped"] and len(one["skipped"]) == 5
    assert three["shards"] == one["shards"] and three["num_samples"] == one["num_samples"] == 10
    assert three_files == one_files and len(one_files) >= 10


def test_a_negative_render_processes_is_refused_naming_the_option(dataset, tmp_path):
    result = run_cli(extract_command(dataset, tmp_path / "out", "http://127.0.0.1:9", "--render-processes", "-1"))
    assert result.returncode == 2 and "--render-processes must not be negative" in result.stderr
    assert not (tmp_path / "out").exists()


def test_a_json_array_cut_off_in_its_last_record_stores_what_the_jsonl_run_stores(reference_run, dataset, servers,
                                                                                   tmp_path):
    # ShareGPT's shape: one pretty-printed array, cut off by a size limit inside its last record.
    records = [json.loads(line) for line in dataset.read_text().splitlines()][: NUM_SAMPLES + 1]
    data = json.dumps(records, indent=2).encode()
    cut = data.rindex(b'"value": "') + 12
    start = data.rindex(b"\n  {", 0, cut) + 3  # the last top-level element (nested ones are indented deeper)
    path = tmp_path / "conversations.json"
    path.write_bytes(data[:cut])
    out = tmp_path / "from-array"

    result = run_cli(extract_command(path, out, servers["main"].url, num_samples=NUM_SAMPLES + 1))

    assert result.returncode == 0, result.stderr
    ours, theirs = manifest(out), manifest(reference_run)
    [skip] = ours["skipped"]
    assert (skip["line"], skip["id"], skip["reason"]) == (data[:start].count(b"\n") + 1, None, "truncated")
    assert f"the record that starts at byte {start}" in skip["detail"]
    assert (ours["num_records"], ours["num_samples"], ours["failed"]) == (NUM_SAMPLES + 1, NUM_SAMPLES, [])
    assert "1 skipped" in result.stderr
    # The same samples in the same shards (ordinals count records alike); only the lines differ.
    assert list(ours["shards"]) == list(theirs["shards"]) == SHARDS
    for shard, entries in theirs["shards"].items():
        got = [(e["file"], e["id"], e["tokens"], e["loss_tokens"]) for e in ours["shards"][shard]["files"]]
        assert got == [(e["file"], e["id"], e["tokens"], e["loss_tokens"]) for e in entries["files"]]
        for entry in entries["files"]:
            stored, want = load_file(str(out / entry["file"])), load_file(str(reference_run / entry["file"]))
            assert all(torch.equal(stored[name], want[name]) for name in want), entry["file"]
    assert (out / "token_counts.safetensors").read_bytes() == (reference_run / "token_counts.safetensors").read_bytes()


def test_too_many_bad_records_exit_2_before_anything_is_sent(dataset, servers, tmp_path):
    bad_corpus(dataset, tmp_path / "mixed.jsonl")
    out = tmp_path / "refused"

    result = run_cli(extract_command(tmp_path / "mixed.jsonl", out, servers["main"].url, "--max-length", "512",
                                     "--overflow", "skip", "--max-skip-ratio", "0.01", num_samples=100))

    assert result.returncode == 2, result.stderr
    assert "5 of 15 records are unusable, more than the allowed 1% (extraction_max_skip_ratio)" in result.stderr
    assert "line 2: malformed_json" in result.stderr
    assert not list(out.glob("rows_*")) and not (out / "parts").exists()
    assert not (out / "extraction.json").exists(), "a refused run must not lock the directory's settings"
    assert servers["main"].our_captures() == []


# -- (g) captures that do not match the target's lm_head ---------------------------------------
@pytest.fixture(scope="module")
def permuted_model(tiny_model, tmp_path_factory) -> Path:
    """A copy of the tiny model whose lm_head rows are shuffled: its top-1 is another token."""
    copy = tmp_path_factory.mktemp("permuted") / "tiny-llama"
    copy.mkdir()
    for path in tiny_model.iterdir():
        if path.is_file() and path.name not in ("model.safetensors", ".build.json"):
            shutil.copy(path, copy / path.name)
    tensors = load_file(str(tiny_model / "model.safetensors"))
    order = torch.randperm(tensors["lm_head.weight"].shape[0], generator=torch.Generator().manual_seed(0))
    tensors["lm_head.weight"] = tensors["lm_head.weight"][order].contiguous()
    save_file(tensors, str(copy / "model.safetensors"), metadata={"format": "pt"})
    return copy


def test_captures_failing_the_top1_check_are_recorded_failed_and_never_stored(permuted_model, dataset, servers,
                                                                              tmp_path):
    out = tmp_path / "mismatch"

    result = run_cli(extract_command(dataset, out, servers["main"].url, "--model-path", str(permuted_model),
                                     num_samples=6))

    assert result.returncode == 1, result.stderr
    assert "6 samples failed verification" in result.stderr
    part = json.loads((out / "parts" / "part-0-of-1.json").read_text())
    assert part["samples"] == []
    assert [(f["line"], f["reason"]) for f in part["failed"]] == [(line, "top1_mismatch") for line in range(1, 7)]
    assert all("lm_head(last_hidden_states) ranks token" in f["detail"] for f in part["failed"])
    assert stored_files(out) == [] and temp_files(out) == []
    assert not (out / "data_config.json").exists()
    assert progress(out)["state"] == "failed"
    assert servers["main"].our_captures() == []


# -- (h) the disk fills ------------------------------------------------------------------------
@pytest.fixture
def small_disk(tmp_path):
    """Factory: a tmpfs of the given size mounted under tmp_path (skips where mounting is not allowed)."""
    mounted = []

    def mount(size_bytes: int) -> Path:
        if shutil.which("mount") is None or os.geteuid() != 0:
            pytest.skip("the disk-full tests mount a small tmpfs, which needs root (and mount(8))")
        target = tmp_path / f"disk-{len(mounted)}"
        target.mkdir()
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_bytes}", "tmpfs", str(target)],
                              capture_output=True, text=True, check=False)
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here ({done.stderr.strip()}): the disk-full tests need that")
        mounted.append(target)
        return target

    yield mount
    for target in mounted:
        if subprocess.run(["umount", str(target)], capture_output=True, check=False).returncode != 0:
            subprocess.run(["umount", "-l", str(target)], capture_output=True, check=False)


def estimated_bytes(reference_run: Path) -> int:
    """What the preflight estimates for the whole run: tokens x (n_aux + 1) x H x 4 + ids, plus headers."""
    data = manifest(reference_run)
    return data["num_tokens"] * ((len(AUX_LAYERS) + 1) * HIDDEN * 4 + 5) + 400 * data["num_samples"]


def test_preflight_refuses_a_disk_too_small_with_the_numbers(reference_run, dataset, servers, small_disk):
    disk = small_disk(estimated_bytes(reference_run) // 2)
    out = disk / "data"

    result = run_cli(extract_command(dataset, out, servers["main"].url))

    assert result.returncode == 2, result.stderr
    tokens = manifest(reference_run)["num_tokens"]
    assert f"not enough disk: {NUM_SAMPLES} samples to store ({tokens:,} tokens x {4 * HIDDEN * 4 + 5:,} bytes as " \
           f"float32: (3 aux + 1) x {HIDDEN} x 4 + 5 (ids, mask))" in result.stderr
    assert re.search(rf"need [\d.]+ GiB, {out} has [\d.]+ GiB free", result.stderr), result.stderr
    assert "Nothing was sent." in result.stderr
    assert not list(out.glob("rows_*")) and not (out / "parts").exists()
    assert not (out / "extraction.json").exists(), "a refused run must not lock the directory's settings"
    assert servers["main"].our_captures() == []


def fill(directory: Path) -> Path:
    """Write a ballast file until the filesystem is full."""
    ballast = directory / "ballast"
    block = b"\0" * (64 << 10)
    with open(ballast, "wb", buffering=0) as handle:
        try:
            while True:
                handle.write(block)
        except OSError as exc:
            assert exc.errno == errno.ENOSPC, exc
    while True:  # the last partial page too
        try:
            with open(ballast, "ab", buffering=0) as handle:
                handle.write(b"\0" * 512)
        except OSError:
            return ballast


def test_a_disk_filling_mid_run_stops_cleanly_and_the_rerun_completes(reference_run, dataset, servers, small_disk,
                                                                      background):
    disk = small_disk(estimated_bytes(reference_run) * 2)
    out = disk / "data"
    command = extract_command(dataset, out, servers["main"].url, "--concurrency", "1")
    run = background(command, "disk-full")
    wait_until(lambda: len(journal_records(out)) >= 2 or not run.running(), "two samples journaled")
    ballast = fill(disk)

    assert run.wait() == 1, run.output()
    assert "No space left on device" in run.output()
    assert "free" in run.output() and "rerun to continue" in run.output()
    assert "Traceback" not in run.output()
    kept = assert_journal_counts_only_whole_files(out)
    # A sample stored just before the disk filled may have found no room for its journal line:
    # its file is there but does not count, and the rerun redoes it.
    assert 2 <= kept <= len(stored_files(out)) < NUM_SAMPLES
    assert temp_files(out) == []
    assert servers["main"].our_captures() == []

    ballast.unlink()
    rerun = run_cli(command)

    assert rerun.returncode == 0, rerun.stderr
    assert f"{kept} already stored" in rerun.stderr
    assert verify_dataset(out)["ok"]
    assert_same_samples(out, reference_run)


# -- (i) two hosts -----------------------------------------------------------------------------
def test_two_parts_on_two_servers_merge_into_the_one_part_dataset(reference_run, dataset, servers, background,
                                                                  tmp_path):
    out = tmp_path / "shared"
    first = background(extract_command(dataset, out, servers["main"].url, "--part", "0/2"), "part0")
    second = background(extract_command(dataset, out, servers["second"].url, "--part", "1/2", "--no-merge"), "part1")

    assert first.wait() == 0, first.output()
    assert second.wait() == 0, second.output()
    assert not (out / "data_config.json").exists(), "a part of two never merges alone"
    for index in (0, 1):
        part = json.loads((out / "parts" / f"part-{index}-of-2.json").read_text())
        assert [s["ordinal"] for s in part["samples"]] == list(range(index, NUM_SAMPLES, 2))

    merged = run_cli([*CLI, "extract-merge", str(out)])

    assert merged.returncode == 0, merged.stderr
    summary = json.loads(merged.stdout)
    assert (summary["num_samples"], summary["parts"], summary["changed"]) == (NUM_SAMPLES, 2, True)
    ours, theirs = manifest(out), manifest(reference_run)
    ids = [entry["id"] for shard in ours["shards"].values() for entry in shard["files"]]
    assert len(ids) == len(set(ids)) == NUM_SAMPLES
    assert {k: v for k, v in ours.items() if k != "parts"} == {k: v for k, v in theirs.items() if k != "parts"}
    assert_same_samples(out, reference_run)
    again = run_cli([*CLI, "extract-merge", str(out)])
    assert again.returncode == 0 and json.loads(again.stdout)["changed"] is False


# -- (j) float8 storage ------------------------------------------------------------------------
FLOAT8 = "float8_e4m3"


def data_files(out: Path) -> dict[str, bytes]:
    """The dataset's data and manifests, byte for byte (locks, progress and logs are status)."""
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*"))
            if p.is_file() and p.suffix not in (".lock", ".log") and not p.name.endswith(".progress.json")}


# The command line of a server whose capture writer ignores the float8 request ids, as one of a
# release before the writer quantized.
OLDER_WRITER_CLI = [sys.executable, "-c", "import sys; import eagle3_pipeline.capture.writer as writer; "
                    "writer.wants_float8 = lambda rid: False; from eagle3_pipeline.cli import main; "
                    "sys.exit(main(sys.argv[1:]))"]


def test_float8_extraction_verifies_first_and_stores_what_convert_storage_makes_of_the_unquantized_run(
    reference_run, dataset, servers, tiny_model, tmp_path
):
    from eagle3_pipeline.extract.storage import compare_datasets  # noqa: PLC0415

    out, converted = tmp_path / "fp8", tmp_path / "converted"
    command = extract_command(dataset, out, servers["main"].url, "--storage-dtype", FLOAT8)

    result = run_cli(command)

    assert result.returncode == 0, result.stderr
    data = manifest(out)
    assert (data["storage_dtype"], data["dtype"], data["storage"]["read_as"]) == (FLOAT8, "float32", "float32")
    assert data["storage"]["bytes_per_token"] == (len(AUX_LAYERS) + 1) * (HIDDEN + 4) + 5
    assert verify_dataset(out)["ok"]
    # The engine's capture writer quantized every sample (its requests asked so); the client none.
    assert f"float8: {NUM_SAMPLES} samples quantized by the engine's capture writer, 0 here" in result.stderr
    stored = load_file(str(out / data["shards"][SHARDS[0]]["files"][0]["file"]))
    assert stored["aux_hidden_states"].dtype == torch.float8_e4m3fn and stored["aux_hidden_scales"].shape[1] == 3
    # The top-1 check ran on the captured (float32) states: every sample checked as in the unquantized run.
    checks = {r["key"]: (r["checked_positions"], r["near_ties"]) for r in journal_records(out)}
    assert checks == {r["key"]: (r["checked_positions"], r["near_ties"]) for r in journal_records(reference_run)}

    converting = run_cli([*CLI, "convert-storage", str(reference_run), "--to", FLOAT8, "--copy-to", str(converted)])

    assert converting.returncode == 0, converting.stderr
    assert json.loads(converting.stdout)["converted"] == NUM_SAMPLES
    ours, theirs = data_files(out), data_files(converted)
    data_names = ["data_config.json", "extraction.json", "token_counts.safetensors", "parts/part-0-of-1.json",
                  *(entry["file"] for shard in data["shards"].values() for entry in shard["files"])]
    for name in data_names:
        assert ours[name] == theirs[name], f"{name}: the conversion differs from the float8 extraction"
    # An engine running a release whose capture writer predates quantizing (it ignores the ".f8" of
    # the ids and sends the states as captured): the client quantizes them, to the same bytes.
    older = ReferenceServer("older-writer", tiny_model, tmp_path, cli=OLDER_WRITER_CLI)
    try:
        older.wait_ready()
        from_older = run_cli(extract_command(dataset, tmp_path / "fp8-older", older.url, "--storage-dtype", FLOAT8))
    finally:
        older.stop()
    assert from_older.returncode == 0, from_older.stderr
    assert f"float8: 0 samples quantized by the engine's capture writer, {NUM_SAMPLES} here on the CPU (slower" \
        in from_older.stderr
    older_files = data_files(tmp_path / "fp8-older")
    for name in data_names:  # the journal's lines come in the order the samples were done
        assert older_files[name] == ours[name], f"{name}: the client's quantization differs from the engine's"
    compared = compare_datasets(reference_run, out)
    assert compared["quantized"]["formula_bytes_per_token"] == 1045
    assert compared["reference"]["formula_bytes_per_token"] == 4101
    assert compared["bytes_ratio"] < 0.3
    for layer in ("aux 0", "aux 1", "aux 2", "last"):
        assert compared["layers"][layer]["err_over_absmax_worst"] <= 1 / 28 * (1 + 2.0**-20)
        assert compared["layers"][layer]["rel_l2_mean"] < 2.0**-4
    before = snapshot(out)

    rerun = run_cli(command)

    assert rerun.returncode == 0, rerun.stderr
    assert f"{NUM_SAMPLES} already stored" in rerun.stderr
    assert snapshot(out) == before
    # The default (auto) keeps a float32 target's states as captured for a new dataset, but a rerun
    # into this one continues it as it is stored: float8, complete.
    check = json.loads(run_cli([*extract_command(dataset, out, servers["main"].url), "--check"]).stdout)
    assert (check["storage_dtype"], check["complete"], check["stored"]) == (FLOAT8, True, NUM_SAMPLES)


def test_convert_storage_killed_at_random_moments_then_rerun_ends_identical_to_an_uninterrupted_one(
    reference_run, dataset, servers, background, tmp_path, tiny_model
):
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    shutil.copytree(reference_run, whole)
    shutil.copytree(reference_run, killed)
    convert_command = [*CLI, "convert-storage", "--to", FLOAT8, "--threads", "1"]
    assert run_cli([*convert_command, str(whole)]).returncode == 0
    journal = killed / "storage-conversion.journal.jsonl"

    def converted() -> int:
        records = Journal(journal).load(repair=False).values() if journal.exists() else []
        return sum(1 for r in records if r.get("status") == "ok")

    rng = random.Random(13)
    kills = []
    while len(kills) < 3:
        already = converted()
        run = background([*convert_command, str(killed), "--max-read-mib-s", "12"], "convert")
        wait_until(lambda: converted() > already or not run.running(), "a file converted")  # noqa: B023
        time.sleep(rng.uniform(0.0, 0.2))
        assert run.running(), f"the conversion ended before kill {len(kills) + 1}: {run.output()}"
        run.signal(signal.SIGKILL)
        assert run.wait() == -signal.SIGKILL
        kills.append(converted())
        if len(kills) > 1:
            continue
        # Half float32, half float8: refused by every reader, naming the command that finishes it (the same
        # state after every kill; checked once).
        finish = f"eagle3-pipeline convert-storage {killed} --to {FLOAT8}"
        train = run_cli([*CLI, "train", "--data-dir", str(killed), "--output-dir", str(tmp_path / "run"), "--check"])
        verify = run_cli([*CLI, "verify", str(killed)])
        extract = run_cli(extract_command(dataset, killed, servers["main"].url))
        for refused in (train, verify, extract):
            assert refused.returncode == 2 and "a storage conversion is unfinished there" in refused.stderr, refused
            assert finish in refused.stderr
    assert 0 < kills[0] <= kills[-1] < NUM_SAMPLES, kills

    final = run_cli([*convert_command, str(killed)])

    assert final.returncode == 0, final.stderr
    # The journal's "ok" lines the kill left, plus the one file in flight (--threads 1) when the kill landed
    # after its rename and before its "ok" line: its "written" line and its size say it is converted.
    resumed = int(re.search(r"(\d+) converted already", final.stderr).group(1))
    assert kills[-1] <= resumed <= kills[-1] + 1, (kills, final.stderr)
    assert data_files(killed) == data_files(whole)
    assert verify_dataset(killed)["ok"] and not journal.exists()
    assert list(killed.glob("rows_*/.*.tmp")) == []
    # Converted in place, the dataset is as the float8 extraction keeps it: a rerun finds every sample stored.
    before = snapshot(killed)
    rerun = run_cli(extract_command(dataset, killed, servers["main"].url, "--storage-dtype", FLOAT8))
    assert rerun.returncode == 0 and f"{NUM_SAMPLES} already stored" in rerun.stderr, rerun.stderr
    assert snapshot(killed) == before
    trained = run_cli([*CLI, "train", "--data-dir", str(killed), "--output-dir", str(tmp_path / "run"),
                       "--max-steps", "2", "--ttt-length", "2", "--draft-vocab-size", "64", "--no-charts",
                       "--no-tensorboard"])
    assert trained.returncode == 0, trained.stderr
