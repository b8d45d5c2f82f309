"""``eagle3-pipeline regenerate`` end to end: a real reference server, real HTTP, real files, real kills.

The servers are ``eagle3-pipeline serve-reference`` subprocesses serving the tiny model on the
CPU in float32 with no capture directory (a serving server), with ``--max-batch-size 1`` so
that every answer is computed alone and two runs give the same bytes (a run killed and resumed
must end identical to one that was not). The command runs as the operator runs it, in a
subprocess, where a test kills it (SIGKILL, SIGTERM); elsewhere through the CLI's ``main`` in
this process, which spares each run the seconds of importing torch and transformers. The
dataset: 12 demo conversations, each given a second question so that every one is
multi-turn, and a broken line.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch  # noqa: F401 - imported before ansible (tests/conftest.py explains why)
from tiny_target import built_tiny_model

from eagle3_pipeline.cli import main as cli_main
from eagle3_pipeline.conversations.template import load_renderer
from eagle3_pipeline.data.demo_dataset import write_demo_dataset
from eagle3_pipeline.server_client import EngineClient

CLI = [sys.executable, "-m", "eagle3_pipeline.cli"]
NUM_CONVERSATIONS = 12
MAX_NEW_TOKENS = 16
START_TIMEOUT_S = 120.0
RUN_TIMEOUT_S = 300.0


class Server:
    """A serving reference server subprocess; its port is read from its log."""

    def __init__(self, model: Path, workdir: Path, name: str):
        self.log_file = workdir / f"server-{name}.log"
        command = [*CLI, "serve-reference", "--model-path", str(model), "--port", "0", "--device", "cpu",
                   "--dtype", "float32", "--max-batch-size", "1", "--log-file", str(self.log_file)]
        self.proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.STDOUT)
        deadline = time.monotonic() + START_TIMEOUT_S
        self.url = None
        while self.url is None:
            assert self.proc.poll() is None, f"server {name} exited: {self.log()}"
            assert time.monotonic() < deadline, f"server {name} did not start: {self.log()}"
            match = re.search(r"serving (http://[\d.]+:\d+)", self.log())
            self.url = match.group(1) if match else time.sleep(0.1)

    def log(self) -> str:
        return self.log_file.read_text() if self.log_file.exists() else "(no log yet)"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=30)


@pytest.fixture(scope="module")
def tiny_model() -> Path:
    return built_tiny_model()


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    started = Server(tiny_model, tmp_path_factory.mktemp("server"), "main")
    yield started
    started.stop()


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    """12 multi-turn ShareGPT conversations and, last, one broken line."""
    folder = tmp_path_factory.mktemp("dataset")
    demo = folder / "demo.jsonl"
    write_demo_dataset(demo, num_samples=NUM_CONVERSATIONS)
    lines = []
    for text in demo.read_text().splitlines()[:NUM_CONVERSATIONS]:
        record = json.loads(text)
        if sum(1 for turn in record["conversations"] if turn["from"] == "gpt") == 1:
            record["conversations"] += [{"from": "human", "value": "Tell me more about it."},
                                        {"from": "gpt", "value": "An answer the target never wrote."}]
        lines.append(json.dumps(record))
    path = folder / "conversations.jsonl"
    path.write_text("\n".join(lines) + "\n{not json\n")
    return path


def arguments(dataset: Path, out: Path, url: str, *extra: str) -> list[str]:
    return ["regenerate", "--dataset", str(dataset), "--output-dir", str(out), "--server-url", url,
            "--max-new-tokens", str(MAX_NEW_TOKENS), "--concurrency", "3", "--retries", "1", *extra]


def regenerate(dataset: Path, out: Path, url: str, *extra: str) -> subprocess.CompletedProcess:
    """A run through the CLI's main in this process: its exit code and what it printed."""
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        code = cli_main(arguments(dataset, out, url, *extra))
    return subprocess.CompletedProcess(["regenerate"], code, stdout.getvalue(), stderr.getvalue())


def start(dataset: Path, out: Path, url: str, *extra: str) -> subprocess.Popen:
    """A run in a process of its own, to be killed."""
    return subprocess.Popen([*CLI, *arguments(dataset, out, url, *extra)], stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def journal(out: Path, part: str = "part-0-of-1") -> list[dict]:
    path = out / "parts" / f"{part}.journal.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")] if path.exists() else []


def wait_for_journal(out: Path, lines: int, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while len(journal(out)) < lines:
        assert proc.poll() is None, f"the run ended before {lines} conversations: {proc.communicate()}"
        assert time.monotonic() < deadline, "no progress"
        time.sleep(0.05)


def snapshot(directory: Path) -> dict[str, int]:
    return {str(p.relative_to(directory)): p.stat().st_mtime_ns for p in sorted(directory.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def reference_run(dataset, server, tmp_path_factory) -> Path:
    """One uninterrupted run: the yardstick of every other."""
    out = tmp_path_factory.mktemp("reference") / "out"
    done = regenerate(dataset, out, server.url)
    assert done.returncode == 0, done.stderr
    return out


def test_each_turn_is_the_servers_own_answer_to_the_regenerated_history(reference_run, dataset, server, tiny_model):
    summary = json.loads((reference_run / "regeneration.json").read_text())
    conversations = [json.loads(line) for line in (reference_run / "regenerated.jsonl").read_text().splitlines()]
    assert [c["id"] for c in conversations] == [f"demo-{i:05d}" for i in range(NUM_CONVERSATIONS)]
    assert summary["num_records"] == NUM_CONVERSATIONS + 1 and summary["num_conversations"] == NUM_CONVERSATIONS
    assert summary["skipped_reasons"] == {"malformed_json": 1} and summary["skipped"][0]["line"] == 13
    assert summary["turns"] == sum(1 for c in conversations for m in c["messages"] if m["role"] == "assistant")
    assert summary["turns"] >= 2 * NUM_CONVERSATIONS and sum(summary["finish_reasons"].values()) == summary["turns"]
    renderer = load_renderer(tiny_model)
    client = EngineClient(server.url)
    originals = {json.loads(line)["id"]: json.loads(line) for line in dataset.read_text().splitlines()[:-1]}
    for conversation in conversations:
        messages = conversation["messages"]
        original = originals[conversation["id"]]["conversations"]
        assert [m["content"] for m in messages if m["role"] != "assistant"] == \
            [t["value"] for t in original if t["from"] != "gpt"]
        for k, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            answer = client.call("POST", "/generate", {
                "input_ids": renderer.generation_prompt_ids(messages[:k]),
                "sampling_params": {"max_new_tokens": MAX_NEW_TOKENS, "temperature": 0}})
            assert message["content"] == renderer.tokenizer.decode(answer["output_ids"], skip_special_tokens=True)
            assert message["content"] != original[k]["value"]


def test_a_finished_run_changes_nothing_and_other_settings_are_refused(reference_run, dataset, server, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(reference_run, out)
    before = snapshot(out)

    again = regenerate(dataset, out, server.url)

    assert again.returncode == 0 and "nothing to do" in again.stderr, again.stderr
    assert snapshot(out) == before

    changed = regenerate(dataset, out, server.url, "--on-length", "cut")

    assert changed.returncode == 2
    assert "on_length: recorded 'keep', now 'cut'" in changed.stderr, changed.stderr
    assert snapshot(out) == before


def test_sigterm_kill_9_and_a_dead_server_lose_nothing_and_the_end_equals_an_uninterrupted_run(
    reference_run, dataset, server, tiny_model, tmp_path
):
    out = tmp_path / "out"
    proc = start(dataset, out, server.url)
    wait_for_journal(out, 2, proc)
    proc.send_signal(signal.SIGTERM)  # the supervisor's stop: requests in flight finish, the rest waits
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 4, stderr
    stopped = journal(out)
    progress = json.loads((out / "parts" / "part-0-of-1.progress.json").read_text())
    assert progress["state"] == "stopped" and progress["done"] == len(stopped) < NUM_CONVERSATIONS

    proc = start(dataset, out, server.url)
    wait_for_journal(out, len(stopped) + 2, proc)
    proc.kill()  # kill -9: only the conversations in flight are lost
    proc.communicate(timeout=30)
    killed = journal(out)
    assert len(stopped) + 2 <= len(killed) < NUM_CONVERSATIONS and not (out / "regenerated.jsonl").exists()

    doomed = Server(tiny_model, tmp_path, "doomed")
    try:
        proc = start(dataset, out, doomed.url)
        wait_for_journal(out, len(killed) + 1, proc)
        doomed.proc.kill()  # the server dies under the run
        _, stderr = proc.communicate(timeout=120)
    finally:
        doomed.stop()
    assert proc.returncode == 3, stderr
    assert "no answer after 2 attempts" in stderr and "check that the server runs" in stderr
    survived = journal(out)
    assert len(survived) > len(killed)

    resumed = regenerate(dataset, out, server.url)

    assert resumed.returncode == 0, resumed.stderr
    assert f"{len(survived)} already done, {NUM_CONVERSATIONS - len(survived)} to regenerate" in resumed.stderr
    keys = [record["key"] for record in journal(out)]
    assert len(keys) == len(set(keys)) == NUM_CONVERSATIONS  # nothing lost, nothing twice
    assert (out / "regenerated.jsonl").read_bytes() == (reference_run / "regenerated.jsonl").read_bytes()
    assert (out / "regeneration.json").read_text() == (reference_run / "regeneration.json").read_text()


def test_two_parts_in_one_directory_merge_into_the_single_runs_file(reference_run, dataset, server, tmp_path):
    out = tmp_path / "out"
    for part in ("1/2", "0/2"):
        done = regenerate(dataset, out, server.url, "--part", part)
        assert done.returncode == 0, done.stderr
        assert not (out / "regenerated.jsonl").exists()  # a part of several does not merge by itself
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        merged = subprocess.CompletedProcess(["regenerate-merge"], cli_main(["regenerate-merge", str(out)]),
                                             stdout.getvalue(), "")
    assert merged.returncode == 0 and json.loads(merged.stdout)["changed"] is True, merged.stderr
    assert (out / "regenerated.jsonl").read_bytes() == (reference_run / "regenerated.jsonl").read_bytes()
    summary = json.loads((out / "regeneration.json").read_text())
    assert summary["parts"] == 2 and summary["num_conversations"] == NUM_CONVERSATIONS
    wrong = regenerate(dataset, out, server.url, "--part", "0/3")
    assert wrong.returncode == 2 and "split over 2 host(s)" in wrong.stderr


def test_answers_at_the_token_limit_cut_the_conversation_or_drop_it(reference_run, dataset, server, tmp_path,
                                                                   tiny_model):
    kept = {r["id"]: r for r in journal(reference_run)}
    truncated = {i for i, r in kept.items() if r["finish"].get("length")}
    assert truncated and len(truncated) < NUM_CONVERSATIONS, "the dataset should have both kinds at this limit"
    check = regenerate(dataset, tmp_path / "drop", "http://127.0.0.1:9", "--model-path", str(tiny_model), "--check",
                       "--on-length", "drop")
    assert check.returncode == 0, check.stderr  # no server needed to say what would happen
    status = json.loads(check.stdout)
    assert (status["todo"], status["skipped"], status["complete"]) == (NUM_CONVERSATIONS, 1, False)
    assert regenerate(dataset, tmp_path / "drop", server.url, "--on-length", "drop").returncode == 0
    assert regenerate(dataset, tmp_path / "cut", server.url, "--on-length", "cut").returncode == 0

    dropped = json.loads((tmp_path / "drop" / "regeneration.json").read_text())
    written = [json.loads(line)["id"] for line in (tmp_path / "drop" / "regenerated.jsonl").read_text().splitlines()]
    assert set(written) == set(kept) - truncated
    assert {s["id"] for s in dropped["skipped"] if s["reason"] == "answer_truncated"} == truncated

    full = {c["id"]: c["messages"] for c in map(json.loads, (reference_run / "regenerated.jsonl").open())}
    cut = {c["id"]: c["messages"] for c in map(json.loads, (tmp_path / "cut" / "regenerated.jsonl").open())}
    assert set(cut) == set(full)
    shorter = [i for i in cut if len(cut[i]) < len(full[i])]
    assert shorter and set(shorter) <= truncated
    for i, messages in cut.items():
        assert messages == full[i][: len(messages)] and messages[-1]["role"] == "assistant"
    summary = json.loads((tmp_path / "cut" / "regeneration.json").read_text())
    assert summary["cut"] == len(shorter)


def test_a_folder_of_parquet_shards_killed_midway_resumes_to_the_jsonl_runs_conversations(
    reference_run, dataset, server, tmp_path
):
    """The same conversations as Parquet shards (how dataset hubs publish them): a kill -9 in the middle
    of the folder loses only what was in flight, and the resumed run writes the JSON Lines run's file."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    records = [json.loads(line) for line in dataset.read_text().splitlines()[:NUM_CONVERSATIONS]]
    shards = tmp_path / "sharegpt"
    shards.mkdir()
    for k in range(3):
        part = pa.Table.from_struct_array(pa.array(records[k * 4:(k + 1) * 4]))
        pq.write_table(part, shards / f"train-{k:05d}-of-00003.parquet", row_group_size=2)
    out = tmp_path / "out"
    proc = start(shards, out, server.url)
    wait_for_journal(out, 5, proc)  # into the second shard
    proc.kill()
    proc.communicate(timeout=30)
    killed = journal(out)
    assert 5 <= len(killed) < NUM_CONVERSATIONS

    resumed = regenerate(shards, out, server.url)

    assert resumed.returncode == 0, resumed.stderr
    assert f"{len(killed)} already done, {NUM_CONVERSATIONS - len(killed)} to regenerate" in resumed.stderr
    assert (out / "regenerated.jsonl").read_bytes() == (reference_run / "regenerated.jsonl").read_bytes()
    summary = json.loads((out / "regeneration.json").read_text())
    assert [f["name"] for f in summary["dataset"]["files"]] == [f"train-{k:05d}-of-00003.parquet" for k in range(3)]


def test_a_mixture_of_two_sources_takes_their_counts_and_records_each_conversations_source(
    reference_run, dataset, server, tmp_path
):
    """ShareGPT-style JSON Lines and a Parquet source in one run, as the inventory's list names them."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    records = [json.loads(line) for line in dataset.read_text().splitlines()[:NUM_CONVERSATIONS]]
    traffic = tmp_path / "traffic.parquet"
    pq.write_table(pa.Table.from_struct_array(pa.array(records[:3])), traffic)
    sources = [{"path": str(dataset), "name": "sharegpt", "count": 4}, {"path": str(traffic)}]
    out = tmp_path / "out"

    done = regenerate(Path(json.dumps(sources)), out, server.url)

    assert done.returncode == 0, done.stderr
    lines = [json.loads(line) for line in (out / "regenerated.jsonl").read_text().splitlines()]
    reference = {r["id"]: r for r in map(json.loads, (reference_run / "regenerated.jsonl").read_text().splitlines())}
    assert [r["id"] for r in lines] == [f"sharegpt.{r['id']}" for r in records[:4]] + \
        [f"traffic.{r['id']}" for r in records[:3]]
    # Greedy answers of the same conversations: the same turns whichever source they came from.
    assert all(r["messages"] == reference[r["id"].split(".", 1)[1]]["messages"] for r in lines)
    summary = json.loads((out / "regeneration.json").read_text())
    assert summary["sources"] == {"sharegpt": 4, "traffic": 3}
    assert [s["source"] for s in summary["dataset"]["sources"]] == ["sharegpt", "traffic"]
