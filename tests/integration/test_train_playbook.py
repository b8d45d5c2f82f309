"""playbooks/train.yml through ansible-runner, on a real extraction of the embedded tiny model.

The data is made as the pipeline makes it: a reference server on the tiny model (CPU), the demo
conversations, ``eagle3-pipeline extract``; once, kept in .cache/test-data under a key of what it
depends on, and shared with test_evaluate_playbook. Each test then runs the
playbook (gpu_reset, then eagle_training) on localhost (inventory/local.yml, no GPU needed)
with small settings, so that a training takes seconds; the training jobs run under the
project's supervisor and are stopped when the test ends, whatever happened.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from urllib.request import urlopen

import ansible_runner
import pytest
import yaml
from runner_runs import ROOT, run_project_playbook
from safetensors import safe_open
from tiny_target import built_tiny_model

from eagle3_pipeline.cli import runner_path

PLAYBOOK = ROOT / "playbooks" / "train.yml"
INVENTORY = ROOT / "inventory" / "local.yml"
CLI = [sys.executable, "-m", "eagle3_pipeline.cli"]
SERVER_READY_S = 120.0
NUM_SAMPLES = 40
DRAFT_VOCAB = 512


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="module")
def tiny_model() -> Path:
    """The embedded tiny model (built once, about 2 min on 2 cores; cached in .cache/)."""
    return built_tiny_model()


def extraction_key(tiny_model: Path) -> str:
    """What the extraction below depends on: the tiny model's build stamp, this package's code, the settings."""
    digest = hashlib.sha256(f"{NUM_SAMPLES} --aux-layers 0,1,2 --device cpu\n".encode())
    digest.update((tiny_model / ".build.json").read_bytes())
    package = ROOT / "src" / "eagle3_pipeline"
    for path in sorted(package.rglob("*.py")):
        digest.update(str(path.relative_to(package)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


@pytest.fixture(scope="module")
def data_dir(tiny_model, tmp_path_factory) -> Path:
    """40 demo conversations extracted through a reference server on the tiny model (read-only for the tests).

    Made once and kept in .cache/test-data under a key of everything it depends on (extraction_key):
    this module and test_evaluate_playbook (which runs in another worker) share it, and a later run of
    the same code finds it; test processes that need it at once take turns (a lock).
    """
    cache = ROOT / ".cache" / "test-data"
    cache.mkdir(parents=True, exist_ok=True)
    done = cache / f"train-extraction-{extraction_key(tiny_model)}"
    with open(cache / ".lock", "wb") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (done / "data").is_dir():
            work = Path(tempfile.mkdtemp(prefix=f".{done.name}.building-", dir=cache))
            try:
                extract_demo_conversations(tiny_model, work)
                os.replace(work, done)
            finally:
                shutil.rmtree(work, ignore_errors=True)
    return done / "data"


def extract_demo_conversations(tiny_model: Path, work: Path) -> None:
    """Serve the tiny model, extract NUM_SAMPLES demo conversations into ``work``/data, stop the server."""
    port = free_port()
    log = open(work / "server.log", "wb")  # noqa: SIM115 - closed with the process
    server = subprocess.Popen(
        [*CLI, "serve-reference", "--model-path", str(tiny_model), "--host", "127.0.0.1", "--port", str(port),
         "--capture-dir", str(work / "capture"), "--aux-layers", "0,1,2", "--device", "cpu"],
        stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True,
    )  # fmt: skip
    log.close()
    try:
        deadline = time.monotonic() + SERVER_READY_S
        while True:
            assert server.poll() is None, (work / "server.log").read_text()
            try:
                with urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as answer:
                    if answer.status == 200:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, f"server not ready within {SERVER_READY_S} s"
            time.sleep(0.2)
        dataset = work / "train.jsonl"
        subprocess.run([*CLI, "demo-dataset", "--output", str(dataset)], check=True, capture_output=True, timeout=120)
        extracted = subprocess.run(
            [*CLI, "extract", "--dataset", str(dataset), "--output-dir", str(work / "data"),
             "--server-url", f"http://127.0.0.1:{port}", "--num-samples", str(NUM_SAMPLES), "--quiet"],
            capture_output=True, text=True, timeout=600, check=False,
        )  # fmt: skip
        assert extracted.returncode == 0, extracted.stderr
    finally:
        os.killpg(server.pid, signal.SIGKILL)  # not reaped yet: the PID (its group) cannot be reused
        server.wait(timeout=30)


@pytest.fixture
def workdir(tmp_path):
    """Output and state directories; jobs left running in the state directory are stopped."""
    yield tmp_path
    for record in (tmp_path / "jobs").glob("*.json"):
        subprocess.run([*CLI, "supervise", "--name", record.stem, "--state-dir", str(record.parent),
                        "--grace-s", "5", "stop"], capture_output=True, timeout=60, check=False)


def training_vars(data_dir: Path, workdir: Path, **overrides) -> dict:
    """Small settings: a 3-step TTT on 256-token batches, 20 % held out, a checkpoint every 2 steps."""
    return {
        "eagle_training_data_dir": str(data_dir),
        "eagle_training_output_dir": str(workdir / "drafter-run"),
        "eagle_training_drafter_dir": "",  # inventory/local.yml exports the demo's elsewhere: <out>/drafter here
        "eagle_training_state_dir": str(workdir / "jobs"),
        "eagle_training_device": "cpu",
        "eagle_training_draft_vocab_size": DRAFT_VOCAB,
        "eagle_training_ttt_length": 3,
        "eagle_training_batch_tokens": 256,
        "eagle_training_eval_ratio": 0.2,
        "eagle_training_checkpoint_every": 2,
        "eagle_training_max_steps": 6,
        "eagle_training_lr": 1e-3,
        "eagle_training_poll_interval": 1,
        "eagle_training_timeout": 600,
        **overrides,
    }


class Run:
    """One ansible-runner run of the playbook: status, stats, events, stdout."""

    def __init__(self, runner):
        self.status = runner.status
        self.stats = runner.stats or {}
        self.events = list(runner.events)
        self.stdout = runner.stdout.read()

    def changed(self, host: str = "localhost") -> int:
        return self.stats.get("changed", {}).get(host, 0)

    def changed_tasks(self) -> list[str]:
        return [e["event_data"]["task"] for e in self.events
                if e.get("event") == "runner_on_ok" and e["event_data"]["res"].get("changed")]

    def failures(self) -> list[dict]:
        return [e["event_data"] for e in self.events if e.get("event") == "runner_on_failed"]

    def summary(self) -> str:
        shown = [e["event_data"]["res"]["msg"] for e in self.events
                 if e.get("event") == "runner_on_ok" and e["event_data"]["task"] == "Show the training"]
        assert len(shown) == 1, self.stdout
        return "\n".join(shown[0])


def run_playbook(tmp_path_factory, extravars: dict, check: bool = False) -> Run:
    return Run(run_project_playbook(tmp_path_factory.mktemp("runner"), PLAYBOOK, INVENTORY, extravars, check))


def snapshot(*directories: Path) -> dict[str, int]:
    """{path: mtime in ns} of every file below the directories."""
    return {str(p): p.stat().st_mtime_ns for d in directories for p in sorted(d.rglob("*")) if p.is_file()}


def exited(state_file: Path, timeout: float = 120.0) -> dict:
    """The job's supervisor record once it holds the exit code. The wait reports "done" when progress.json says
    so; the job then prints its summary into its log and exits, and its supervisor records the exit code."""
    deadline = time.monotonic() + timeout
    while (job := json.loads(state_file.read_text()))["exit_code"] is None:
        assert time.monotonic() < deadline, f"the job did not exit within {timeout} s of the play's end: {job}"
        time.sleep(0.1)
    return job


def metric_records(out: Path, kind: str) -> list[dict]:
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [record for record in map(json.loads, lines) if record["kind"] == kind]


def test_check_mode_starts_nothing_then_a_run_trains_the_drafter_and_a_rerun_changes_nothing(
    data_dir, workdir, tmp_path_factory, tiny_model
):
    extravars = training_vars(data_dir, workdir)
    out = workdir / "drafter-run"

    checked = run_playbook(tmp_path_factory, extravars, check=True)

    assert checked.status == "successful", checked.stdout
    assert re.search(r"localhost: would start the training: 6 steps of a \d+-step schedule, from the start",
                     checked.summary()), checked.summary()
    assert not out.exists() and not (workdir / "jobs").exists(), "check mode wrote something"

    first = run_playbook(tmp_path_factory, extravars)

    assert first.status == "successful", first.stdout
    assert "[localhost] step 6/6 (epoch " in first.stdout and ": done in " in first.stdout, "no final progress line"
    config = json.loads((out / "drafter" / "config.json").read_text())
    target_vocab = json.loads((tiny_model / "config.json").read_text())["vocab_size"]
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert config["draft_vocab_size"] == DRAFT_VOCAB < target_vocab
    with safe_open(str(out / "drafter" / "model.safetensors"), "pt") as weights:
        assert weights.get_slice("d2t").get_shape() == [DRAFT_VOCAB]
        assert weights.get_slice("t2d").get_shape() == [target_vocab]
        assert int(weights.get_tensor("t2d").sum()) == DRAFT_VOCAB, "t2d must mark exactly the draft tokens"
    train = metric_records(out, "train")
    assert [record["step"] for record in train] == [1, 2, 3, 4, 5, 6]
    assert all(len(record["acc_k"]) == 3 and record["loss"] > 0 for record in train)
    assert [record["step"] for record in metric_records(out, "eval")] == [2, 4, 6]
    assert json.loads((out / "progress.json").read_text())["state"] == "done"
    assert (out / "training.json").is_file() and list((out / "charts").glob("*.png"))
    assert (out / "drafter-speculators" / "config.json").is_file(), "no speculators copy beside the drafter"
    summary = first.summary()
    assert f"drafter: {out}/drafter (LlamaForCausalLMEagle3, draft vocabulary {DRAFT_VOCAB} of {target_vocab}" \
        in summary
    assert "steps: 6 of 6 (eagle_training_max_steps stopped a " in summary
    assert re.search(r"held-out \(step 6, \d+ samples\): loss [0-9.]+, acc per position [0-9.]+/[0-9.]+/[0-9.]+, "
                     r"acceptance length [0-9.]+", summary), summary
    # The held-out first answers walked as serving drafts them, for each chain length up to the 3 TTT steps.
    assert re.search(r"held-out first answers walked round by round as serving drafts them: tau [0-9.]+ at 1, "
                     r"[0-9.]+ at 2, [0-9.]+ at 3 drafts per verify\n", summary), summary
    assert "training (step 6): loss " in summary
    assert f"charts: {out}/charts/" in summary
    (state_file,) = (workdir / "jobs").glob("*.json")
    assert exited(state_file)["exit_code"] == 0
    before = snapshot(out, workdir / "jobs")

    second = run_playbook(tmp_path_factory, extravars)

    assert second.status == "successful", second.stdout
    assert second.changed() == 0, second.changed_tasks()
    assert "already complete for this data and these settings: nothing was started" in second.summary()
    assert snapshot(out, workdir / "jobs") == before, "a rerun over a finished training touched files"


def test_a_draft_vocabulary_larger_than_the_targets_fails_with_the_commands_message(
    data_dir, workdir, tmp_path_factory
):
    run = run_playbook(tmp_path_factory, training_vars(data_dir, workdir, eagle_training_draft_vocab_size=5000))

    assert run.status == "failed", run.stdout
    failed = run.failures()
    assert [f["task"] for f in failed] == ["Fail when the training cannot run as set"], run.stdout
    assert ("localhost: eagle3-pipeline train --check refused: eagle_training_draft_vocab_size=5000 is larger than "
            "the target's vocabulary (4096 tokens)") in failed[0]["res"]["msg"]
    assert not (workdir / "jobs").exists() and not (workdir / "drafter-run").exists(), "something was started"


def test_the_eagle3_1_variant_is_trained_and_exported_with_sglangs_flags(data_dir, workdir, tmp_path_factory):
    refused = run_playbook(tmp_path_factory, training_vars(data_dir, workdir, eagle_training_variant="eagle4"))
    assert refused.status == "failed"
    assert any("eagle_training_variant" in f["res"].get("msg", "") and "eagle3.1" in f["res"].get("msg", "")
               for f in refused.failures()), refused.stdout

    run = run_playbook(tmp_path_factory, training_vars(data_dir, workdir, eagle_training_variant="eagle3.1",
                                                       eagle_training_norm_before_fc=True,
                                                       eagle_training_step_decay=0.65,
                                                       eagle_training_max_steps=2))

    assert run.status == "successful", run.stdout
    training = json.loads((workdir / "drafter-run" / "training.json").read_text())
    assert training["config"]["step_decay"] == 0.65  # the role's variable reached the loss's weighing
    config = json.loads((workdir / "drafter-run" / "drafter" / "config.json").read_text())
    assert (config["fc_norm"], config["norm_output"], config["norm_before_fc"]) == (True, True, True)
    assert config["eagle3_pipeline"]["variant"] == "eagle3.1"
    assert not (workdir / "drafter-run" / "drafter-speculators").exists()  # vLLM's form has no EAGLE 3.1


def test_a_killed_job_fails_the_play_at_once_and_a_rerun_resumes_from_its_checkpoint(
    data_dir, workdir, tmp_path_factory
):
    out = workdir / "drafter-run"
    # The kill comes within checkpoint_within_s of the start, so it falls early in a poll of poll_s (twice
    # that): a poll that returns on the death ends long before its interval would, however slowly this
    # machine reached the checkpoint.
    checkpoint_within_s, poll_s = 300, 600
    # 32 training samples in 256-token batches make about 10 steps an epoch: two epochs hold 12 steps.
    extravars = training_vars(data_dir, workdir, eagle_training_epochs=2, eagle_training_max_steps=12,
                              eagle_training_poll_interval=poll_s)
    thread, runner = ansible_runner.run_async(
        private_data_dir=str(tmp_path_factory.mktemp("runner")), playbook=str(PLAYBOOK), inventory=str(INVENTORY),
        extravars=extravars, quiet=True,
        envvars={"ANSIBLE_CONFIG": str(ROOT / "ansible.cfg"), "PATH": runner_path(), "ANSIBLE_NOCOLOR": "1"},
    )  # fmt: skip
    try:
        deadline = time.monotonic() + checkpoint_within_s
        # Any checkpoint: the trainer keeps only the newest two, so a given one may be gone when a busy poller looks.
        while not any((out / "checkpoints").glob("step-*")):
            assert thread.is_alive(), runner.stdout.read()
            assert time.monotonic() < deadline, f"no checkpoint within {checkpoint_within_s} s"
            time.sleep(0.1)
        (record,) = [json.loads(p.read_text()) for p in (workdir / "jobs").glob("*.json")]
        assert record["exit_code"] is None, f"the training ended before the kill: {record}"
        os.kill(record["pid"], signal.SIGKILL)
        killed_at = time.monotonic()
    finally:
        thread.join(timeout=600)
    killed = Run(runner)

    assert killed.status == "failed", killed.stdout
    (failure,) = killed.failures()
    assert failure["task"] == "Wait for the training, showing its progress every eagle_training_poll_interval seconds"
    message = failure["res"]["msg"]
    assert f"the training job {record['name']} was killed by SIGKILL" in message
    assert "the training resumes from its last checkpoint" in message
    assert f"Last lines of {record['log_file']}:" in message and "supervisor: " in message
    assert failure["res"]["seconds"] < poll_s, "a dead job must fail the poll at once, not after the poll interval"
    # A poll that waited out its interval would end at least poll_s - checkpoint_within_s after the kill.
    assert time.monotonic() - killed_at < poll_s - checkpoint_within_s
    stopped_at = max(int(p.name.split("-")[1]) for p in (out / "checkpoints").glob("step-*"))

    resumed = run_playbook(tmp_path_factory, {**extravars, "eagle_training_poll_interval": 1})

    assert resumed.status == "successful", resumed.stdout
    assert f"trained, resumed at step {stopped_at}: step 12/12" in resumed.summary()
    assert [record["step"] for record in metric_records(out, "train")] == list(range(1, 13)), (
        "metrics.jsonl must hold each step once after the resume"
    )


def _pause_the_job_when(task_prefix: str, state_dir: Path, paused: list[int]):
    """An ansible-runner event handler: SIGSTOP the training job (by its state file) when the ok result of
    a task whose name starts with ``task_prefix`` arrives; the paused PIDs go into ``paused``."""

    def handler(event: dict) -> bool:
        data = event.get("event_data") or {}
        if event.get("event") == "runner_on_ok" and data.get("task", "").startswith(task_prefix) and not paused:
            for record in state_dir.glob("*.json"):
                pid = json.loads(record.read_text())["pid"]
                os.kill(pid, signal.SIGSTOP)
                paused.append(pid)
        return True

    return handler


def _resume_when(task_prefix: str, paused: list[int]):
    """An ansible-runner event handler: SIGCONT the paused PIDs when the ok result of a task whose name starts
    with ``task_prefix`` arrives."""

    def handler(event: dict) -> bool:
        data = event.get("event_data") or {}
        if event.get("event") == "runner_on_ok" and data.get("task", "").startswith(task_prefix):
            _resume(paused)
        return True

    return handler


def _resume(paused: list[int]) -> None:
    while paused:
        try:
            os.kill(paused.pop(), signal.SIGCONT)
        except ProcessLookupError:
            pass


def test_a_rerun_while_the_training_runs_leaves_it_to_the_reset_and_waits_on_it(data_dir, workdir, tmp_path_factory):
    out = workdir / "drafter-run"
    unheld = workdir / "nvidia-unheld"
    unheld.write_bytes(b"")
    # The training must still run when the rerun's reset looks for holders and when its start task looks for
    # the job, however slowly this machine runs the rerun: the test holds the job (SIGSTOP, which the job never
    # sees: no handler runs) from the moment the first run has started it until the rerun's start task has
    # reported (after the reset), then lets it go on (SIGCONT). So a short training (about 10 steps an epoch:
    # 32 training samples in 256-token batches) outlasts the rerun's start as surely as a long one did (it was
    # 200 steps, minutes of CPU on a busy machine, for that margin alone).
    steps = 12
    extravars = training_vars(data_dir, workdir, eagle_training_epochs=25, eagle_training_max_steps=steps,
                              eagle_training_checkpoint_every=100, gpu_reset_device_paths=[str(unheld)],
                              eagle_training_timeout=1)  # fmt: skip
    paused: list[int] = []

    # The first run gives up waiting at once; its training goes on, detached, as after a lost connection.
    try:
        first = Run(run_project_playbook(
            tmp_path_factory.mktemp("runner"), PLAYBOOK, INVENTORY, extravars,
            event_handler=_pause_the_job_when("Start the training, detached", workdir / "jobs", paused)))
    except BaseException:
        _resume(paused)
        raise

    assert paused, "the job was not held after its start"
    assert first.status == "failed", first.stdout
    (state_file,) = (workdir / "jobs").glob("*.json")
    job = json.loads(state_file.read_text())
    assert (f"the training was not done within the wait's timeout (1 s); the job (PID {job['pid']}) keeps running"
            in first.failures()[0]["res"]["msg"]), first.stdout  # fmt: skip
    assert job["exit_code"] is None
    log = Path(job["log_file"])

    # The rerun's reset looks for the holders of the job's log file (its stdout and stderr): the job and its
    # supervisor hold it, as a training holds /dev/nvidia*; with the default gpu_reset_match any holder goes.
    try:
        rerun = Run(run_project_playbook(
            tmp_path_factory.mktemp("runner"), PLAYBOOK, INVENTORY,
            {**extravars, "eagle_training_timeout": 1200, "gpu_reset_device_paths": [str(log)],
             "gpu_reset_grace_s": 2},
            event_handler=_resume_when("Start the training, detached", paused)))
    finally:
        _resume(paused)

    assert rerun.status == "successful", rerun.stdout
    (stop,) = [e["event_data"]["res"] for e in rerun.events
               if e.get("event") == "runner_on_ok" and e["event_data"].get("task_action") == "gpu_processes"]
    assert {h["pid"] for h in stop["holders"]} == {job["pid"], job["supervisor_pid"]}, (
        "the training was not running when the reset looked: it must outlast the rerun's start"
    )
    after = exited(state_file)
    assert (after["pid"], after["pid_start_time"]) == (job["pid"], job["pid_start_time"]), (
        f"the job was stopped and another started (its log: {log.read_text()[-2000:]})"
    )
    assert after["exit_code"] == 0
    assert "SIGTERM" not in log.read_text(), "the training got SIGTERM"
    assert stop["stopped"] == [] and stop["changed"] is False
    reason = (f"this pipeline's running training {job['name']} (pid {job['pid']}): its stage waits on it "
              "(gpu_reset_spare_pipeline_jobs)")  # fmt: skip
    assert {(r["pid"], r["reason"]) for r in stop["left"]} == {(job["pid"], reason), (job["supervisor_pid"], reason)}
    (found,) = [j for j in stop["pipeline_jobs"] if j["pid"] == job["pid"]]
    assert found["this_run"] is True and found["output_dir"] == str(out)
    shown = [e["event_data"]["res"]["msg"] for e in rerun.events
             if e.get("event") == "runner_on_ok" and e["event_data"]["task"] == "Show the report"]  # fmt: skip
    assert (f"spared this pipeline's running training {job['name']} (pid {job['pid']}, output {out}): never "
            "signalled; its stage waits on it") in "\n".join(shown[0])  # fmt: skip
    (started,) = [e["event_data"]["res"] for e in rerun.events if e.get("event") == "runner_on_ok"
                  and e["event_data"]["task"].startswith("Start the training, detached")]  # fmt: skip
    assert started["changed"] is False, "the rerun did not attach to the running job"
    assert [record["step"] for record in metric_records(out, "train")] == list(range(1, steps + 1))
    assert json.loads((out / "progress.json").read_text())["state"] == "done"
    assert f"step {steps}/{steps}" in rerun.summary()


def two_node_inventory(workdir: Path, data_dir: Path, **host_vars) -> Path:
    """Two host aliases of this machine (node-a, node-b), each running its own job: two torchrun nodes."""
    inventory = workdir / "inventory.yml"
    hosts = {name: {"ansible_host": "127.0.0.1", **host_vars.get(name, {})} for name in ("node-a", "node-b")}
    inventory.write_text(yaml.safe_dump({"all": {"children": {"gpu_hosts": {
        "hosts": hosts,
        "vars": {"ansible_connection": "local", "ansible_python_interpreter": sys.executable,
                 "gpu_reset_required": False, "sglang_server_venv": str(Path(sys.executable).parents[1]),
                 # Two processes share each epoch's batches: three epochs hold the 6 steps.
                 **training_vars(data_dir, workdir, eagle_training_master_port=free_port(), eagle_training_epochs=3)},
    }}}}))
    return inventory


def test_nodes_that_do_not_share_the_output_directory_fail_before_training(data_dir, workdir, tmp_path_factory):
    # Two directories stand in for two hosts' local disks.
    inventory = two_node_inventory(workdir, data_dir, **{
        name: {"eagle_training_output_dir": str(workdir / f"local-{name}")} for name in ("node-a", "node-b")
    })

    run = Run(run_project_playbook(tmp_path_factory.mktemp("runner"), PLAYBOOK, inventory, {}))

    assert run.status == "failed", run.stdout
    failed = run.failures()
    assert [(f["host"], f["task"]) for f in failed] == [
        ("node-b", "Fail when a node does not share the output directory")
    ], run.stdout
    message = failed[0]["res"]["msg"]
    assert f"eagle_training_output_dir {workdir / 'local-node-b'} is not the directory that node-a" in message
    assert "is missing here" in message and "shared filesystem" in message
    assert not (workdir / "jobs").exists(), "a job was started"
    assert not (workdir / "local-node-a" / ".eagle3-shared-check").exists(), "the marker was left behind"
