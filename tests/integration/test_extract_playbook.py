"""playbooks/extract.yml through ansible-runner, against real reference servers on the tiny model.

Each test starts its own reference engine(s) (``eagle3-pipeline serve-reference`` on a free
port, CPU) and runs the playbook on localhost: one host, then two host aliases (both
``ansible_connection: local``, each with its own server) sharing one output directory. The
demo dataset is built by the role; the extraction jobs run under the project's supervisor and
are stopped when the test ends, whatever happened.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from urllib.request import urlopen

import pytest
import yaml
from runner_runs import run_project_playbook
from tiny_target import built_tiny_model

ROOT = Path(__file__).resolve().parents[2]
PLAYBOOK = ROOT / "playbooks" / "extract.yml"
LOCAL_INVENTORY = ROOT / "inventory" / "local.yml"
CLI = [sys.executable, "-m", "eagle3_pipeline.cli"]
SERVER_READY_S = 120.0
AUX_LAYERS = [0, 1, 2]


@pytest.fixture(scope="module")
def tiny_model() -> Path:
    """The embedded tiny model (built once, about 2 min on 2 cores; cached in .cache/)."""
    return built_tiny_model()


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture
def start_server(tiny_model, tmp_path):
    """Start reference servers (own session each); every one is killed, with its group, at the end."""
    started: list[subprocess.Popen] = []

    def start(name: str) -> int:
        port = free_port()
        log = open(tmp_path / f"server-{name}.log", "wb")  # noqa: SIM115 - closed with the process
        command = [
            *CLI, "serve-reference", "--model-path", str(tiny_model), "--host", "127.0.0.1", "--port", str(port),
            "--capture-dir", str(tmp_path / f"capture-{name}"), "--aux-layers", ",".join(map(str, AUX_LAYERS)),
            "--device", "cpu",
        ]  # fmt: skip
        popen = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True)
        log.close()
        started.append(popen)
        deadline = time.monotonic() + SERVER_READY_S
        while True:
            if popen.poll() is not None:
                output = (tmp_path / f"server-{name}.log").read_text()
                pytest.fail(f"server {name} exited with {popen.returncode}: {output}")
            try:
                with urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as answer:
                    if answer.status == 200:
                        return port
            except OSError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"server {name} not ready within {SERVER_READY_S} s")
            time.sleep(0.2)

    yield start
    for popen in started:
        if popen.poll() is None:
            # Not reaped yet, so its PID (also its process group id) cannot have been reused.
            os.killpg(popen.pid, signal.SIGKILL)
        popen.wait(timeout=30)


@pytest.fixture
def workdir(tmp_path):
    """Dataset, output and state directories; jobs left running in the state directory are stopped."""
    yield tmp_path
    for record in (tmp_path / "jobs").glob("*.json"):
        subprocess.run([*CLI, "supervise", "--name", record.stem, "--state-dir", str(record.parent),
                        "--grace-s", "5", "stop"], capture_output=True, timeout=60, check=False)


def extraction_vars(workdir: Path, num_samples: int) -> dict:
    return {
        "extraction_dataset": str(workdir / "dataset" / "train.jsonl"),
        "extraction_build_demo_dataset": True,
        "extraction_output_dir": str(workdir / "data"),
        "extraction_state_dir": str(workdir / "jobs"),
        "extraction_num_samples": num_samples,
        "extraction_concurrency": 4,
        "extraction_poll_s": 1,
        "extraction_command_poll_s": 1,
        "extraction_timeout_s": 600,
    }


class Run:
    """One ansible-runner run of the playbook: status, stats, events, stdout."""

    def __init__(self, runner):
        self.status = runner.status
        self.stats = runner.stats or {}
        self.events = list(runner.events)
        self.stdout = runner.stdout.read()

    def changed(self, host: str) -> int:
        return self.stats.get("changed", {}).get(host, 0)

    def changed_tasks(self) -> list[str]:
        return [e["event_data"]["task"] for e in self.events
                if e.get("event") == "runner_on_ok" and e["event_data"]["res"].get("changed")]

    def failures(self) -> list[dict]:
        return [e["event_data"] for e in self.events if e.get("event") == "runner_on_failed"]

    def summary(self) -> list[str]:
        shown = [e["event_data"]["res"]["msg"] for e in self.events
                 if e.get("event") == "runner_on_ok" and e["event_data"]["task"] == "Show the extraction"]
        assert len(shown) == 1, self.stdout
        return shown[0]


def run_playbook(tmp_path_factory, inventory: Path, extravars: dict, check: bool = False) -> Run:
    runner = run_project_playbook(tmp_path_factory.mktemp("runner"), PLAYBOOK, inventory, extravars, check)
    return Run(runner)


def snapshot(directory: Path) -> dict[str, int]:
    """{relative path: mtime in ns} of every file below ``directory``."""
    return {str(p.relative_to(directory)): p.stat().st_mtime_ns for p in sorted(directory.rglob("*")) if p.is_file()}


def sample_files(data: Path) -> list[Path]:
    return sorted(data.glob("rows_*/*.safetensors"))


def test_check_mode_starts_nothing_then_a_run_extracts_and_a_rerun_changes_nothing(
    workdir, start_server, tmp_path_factory, tiny_model
):
    port = start_server("one")
    extravars = {**extraction_vars(workdir, 24), "sglang_server_port": port}
    data = workdir / "data"

    checked = run_playbook(tmp_path_factory, LOCAL_INVENTORY, extravars, check=True)

    assert checked.status == "successful", checked.stdout
    assert "localhost: part 0/1: would build the demo dataset" in "\n".join(checked.summary())
    assert not (workdir / "dataset").exists() and not data.exists() and not (workdir / "jobs").exists()

    first = run_playbook(tmp_path_factory, LOCAL_INVENTORY, extravars)

    assert first.status == "successful", first.stdout
    assert "[localhost] part 0/1: 24/24 samples, 0 skipped, 0 failed" in first.stdout, "no progress line"
    assert "FAILED - RETRYING" not in first.stdout, "the wait is one task, not retries"
    # The merge and the (deep) verify ran asynchronously: the controller polled them, no SSH call stayed open.
    polled = {e["event_data"]["task"] for e in first.events if e.get("event") == "runner_on_async_ok"}
    assert {"Merge the parts' manifests into data_config.json (unchanged parts rewrite nothing)",
            "Verify every file against the manifest"} <= polled, polled
    manifest = json.loads((data / "data_config.json").read_text())
    config = json.loads((tiny_model / "config.json").read_text())
    assert manifest["num_samples"] == 24 and manifest["parts"] == 1
    assert manifest["aux_layers"] == AUX_LAYERS and manifest["hidden_size"] == config["hidden_size"]
    files = [entry for shard in manifest["shards"].values() for entry in shard["files"]]
    assert sorted(data / entry["file"] for entry in files) == sample_files(data)
    assert manifest["num_tokens"] == sum(entry["tokens"] for entry in files) > 0
    assert manifest["bytes"] == sum((data / entry["file"]).stat().st_size for entry in files)
    assert (data / "parts" / "part-0-of-1.json").is_file()
    assert json.loads((data / "parts" / "part-0-of-1.progress.json").read_text())["state"] == "done"
    assert not (data / ".eagle3-shared-check").exists()
    summary = "\n".join(first.summary())
    assert f"24 samples, {manifest['num_tokens']:,} tokens" in summary
    assert "verified: 24 files against the manifest (checksums, shapes, dtypes and values): all good" in summary
    before = {**snapshot(data), **{"dataset/" + k: v for k, v in snapshot(workdir / "dataset").items()}}

    second = run_playbook(tmp_path_factory, LOCAL_INVENTORY, extravars)

    assert second.status == "successful", second.stdout
    assert second.changed("localhost") == 0, second.changed_tasks()
    assert "localhost: part 0/1: already complete (24 samples), nothing sent" in "\n".join(second.summary())
    after = {**snapshot(data), **{"dataset/" + k: v for k, v in snapshot(workdir / "dataset").items()}}
    assert after == before, "a rerun over a complete dataset touched files"


def test_hosts_that_do_not_share_the_output_directory_fail_before_extracting(workdir, tmp_path_factory):
    inventory = workdir / "inventory.yml"
    hosts = {}
    for name in ("node-a", "node-b"):
        hosts[name] = {"ansible_connection": "local", "ansible_python_interpreter": sys.executable,
                       "sglang_server_venv": str(Path(sys.executable).parents[1]),
                       # Two directories stand in for two hosts' local disks.
                       "extraction_output_dir": str(workdir / f"local-{name}")}
    inventory.write_text(yaml.safe_dump({"all": {"children": {"gpu_hosts": {
        "hosts": hosts,
        "vars": {k: v for k, v in extraction_vars(workdir, 24).items() if k != "extraction_output_dir"},
    }}}}))

    run = run_playbook(tmp_path_factory, inventory, {"sglang_server_port": free_port()})

    assert run.status == "failed", run.stdout
    failed = run.failures()
    assert [(f["host"], f["task"]) for f in failed] == [
        ("node-b", "Fail when a host does not share the output directory")
    ], run.stdout
    message = failed[0]["res"]["msg"]
    assert f"extraction_output_dir {workdir / 'local-node-b'} is not the directory that node-a writes into" in message
    assert "is missing here" in message and "shared filesystem" in message
    assert not list((workdir / "jobs").glob("*.json")), "a job was started"
    assert not (workdir / "local-node-a" / ".eagle3-shared-check").exists(), "the marker was left behind"


def test_an_unreachable_server_fails_naming_it(workdir, tmp_path_factory):
    port = free_port()
    extravars = {**extraction_vars(workdir, 4), "sglang_server_port": port, "extraction_retries": 0}

    run = run_playbook(tmp_path_factory, LOCAL_INVENTORY, extravars)

    assert run.status == "failed", run.stdout
    failed = run.failures()
    assert [f["task"] for f in failed] == ["Fail when the extraction cannot run as set"], run.stdout
    assert f"the capture server at http://127.0.0.1:{port} does not answer" in failed[0]["res"]["msg"]
    assert not list((workdir / "jobs").glob("*.json")), "a job was started"


def test_float8_storage_is_one_variable_and_a_rerun_with_the_other_fails_naming_the_conversion(
    workdir, start_server, tmp_path_factory
):
    port = start_server("fp8")
    extravars = {**extraction_vars(workdir, 6), "sglang_server_port": port, "extraction_storage_dtype": "float8_e4m3"}
    data = workdir / "data"

    run = run_playbook(tmp_path_factory, LOCAL_INVENTORY, extravars)

    assert run.status == "successful", run.stdout
    manifest = json.loads((data / "data_config.json").read_text())
    assert (manifest["storage_dtype"], manifest["storage"]["quantized"]) == ("float8_e4m3", True)
    summary = "\n".join(run.summary())
    assert "1 shard(s), hidden states stored as float8_e4m3)" in summary
    assert "verified: 6 files against the manifest (checksums, shapes, dtypes and values): all good" in summary
    before = snapshot(data)

    other = run_playbook(tmp_path_factory, LOCAL_INVENTORY, {**extravars, "extraction_storage_dtype": "bfloat16"})

    assert other.status == "failed", other.stdout
    failed = other.failures()
    assert [f["task"] for f in failed] == ["Fail when the extraction cannot run as set"], other.stdout
    message = failed[0]["res"]["msg"]
    assert "storage_dtype: recorded 'float8_e4m3', now None" in message
    assert f"eagle3-pipeline convert-storage {data} --to float8_e4m3" in message
    assert snapshot(data) == before, "a refused run wrote nothing"
