"""The GPU reset leaves the pipeline's own running jobs alone: real jobs under the real supervisor.

Each job here is started as the roles start it, ``eagle3_pipeline.cli supervise ... start -- ARGV``,
in a session of its own. The extraction is the real ``eagle3_pipeline.cli extract``, waiting on a
server that listens and never answers (tests/device_holder.py --listen): it runs as long as the
test needs. The files the reset looks for are real files that the processes hold open, such as
the job's log file, which the supervisor gives the job as stdout and stderr: what fuser would see.
NVML is the stand-in from fake_nvml (the only fake), for the wait on GPU memory.

Other runs on this machine may have jobs of their own: every assertion on ``pipeline_jobs``
picks this test's jobs by PID, and only this test's files are looked for.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import gpu_processes
import gpu_wait_free
import pytest
from ansible.module_utils.gpu_holders import ancestors, read_proc, snapshot
from ansible.module_utils.pipeline_jobs import (
    cli_command,
    find_jobs,
    is_local_host,
    job_kind,
    option_value,
    supervised_argv,
)
from fake_nvml import FakeGpu, FakeNvml
from module_runs import run_module
from process_checks import running, wait_for
from process_checks import state as process_state

CLI = [sys.executable, "-m", "eagle3_pipeline.cli"]
HOLDER_SCRIPT = Path(__file__).resolve().parents[1] / "device_holder.py"
EXTRACTION = "eagle3-extract-part-0-of-1"
START_S = 30.0


@dataclass
class Started:
    """A command started under the supervisor: its name, state file record and log file."""

    name: str
    state: dict
    log: Path

    @property
    def pid(self) -> int:
        return self.state["pid"]

    @property
    def supervisor_pid(self) -> int:
        return self.state["supervisor_pid"]

    @property
    def key(self) -> tuple:
        return (self.state["pid"], self.state["pid_start_time"])

    def job_reason(self, kind: str = "extraction") -> str:
        return (
            f"this pipeline's running {kind} {self.name} (pid {self.pid}): its stage waits on it "
            "(gpu_reset_spare_pipeline_jobs)"
        )


class Supervisor:
    """Starts commands under the project's supervisor (state dir <tmp>/jobs); stops them all at the end."""

    def __init__(self, workdir: Path):
        self.workdir = workdir
        self.state_dir = workdir / "jobs"
        self.names: list[str] = []

    def supervise(self, name: str, *verb: str) -> dict:
        command = [*CLI, "supervise", "--name", name, "--state-dir", str(self.state_dir), *verb]
        run = subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)
        assert run.returncode == 0, run.stderr
        return json.loads(run.stdout)

    def start(self, name: str, argv: list) -> Started:
        """Start argv as the roles do; return once the job has executed it (its command line is argv)."""
        argv = [str(arg) for arg in argv]
        log = self.state_dir / f"{name}.log"
        self.names.append(name)
        state = self.supervise(name, "--log-file", str(log), "start", "--", *argv)
        assert state["changed"] is True and state["running"] is True, state

        def executed():
            proc = read_proc(state["pid"])
            return proc is not None and proc.argv == argv

        wait_for(executed, START_S, f"{name} to execute its command")
        return Started(name, state, log)

    def status(self, name: str) -> dict:
        return self.supervise(name, "status")

    def stop_all(self) -> None:
        for name in self.names:
            self.supervise(name, "--grace-s", "2", "stop")


@pytest.fixture
def supervisor(tmp_path):
    started = Supervisor(tmp_path)
    yield started
    started.stop_all()


@pytest.fixture
def silent_server(spawn):
    """A server that listens on a port of 127.0.0.1 and never answers (not under the supervisor)."""
    return spawn("--listen", "--lifetime", 300)


def extraction_argv(workdir: Path, port: int, output: str = "out") -> list:
    """The real extraction command, as the extraction role builds it, against the server on ``port``."""
    dataset = workdir / "dataset.jsonl"
    conversation = [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]
    dataset.write_text(json.dumps({"conversations": conversation}) + "\n")
    return [*CLI, "extract", "--dataset", dataset, "--output-dir", workdir / output,
            "--server-url", f"http://127.0.0.1:{port}", "--request-timeout-s", "300", "--retries", "0",
            "--no-merge"]  # fmt: skip


def server_argv(workdir: Path, tag: str, hold: Path, *, listen: bool = False) -> tuple[list, Path, Path]:
    """A stand-in server (tests/device_holder.py) holding ``hold``: (argv, ready file, SIGTERM marker)."""
    ready, marker = workdir / f"{tag}.ready", workdir / f"{tag}.sigterm"
    argv = [sys.executable, HOLDER_SCRIPT, "--ready", ready, "--hold", hold, "--term-marker", marker,
            "--tag", tag, "--lifetime", "300"] + (["--listen"] if listen else [])  # fmt: skip
    return argv, ready, marker


def ready_info(ready: Path) -> dict:
    wait_for(ready.exists, START_S, f"{ready.name} to be written")
    return json.loads(ready.read_text())


def mine(result: dict, *started: Started) -> list[dict]:
    """This test's jobs among the pipeline_jobs found, by PID, in PID order."""
    pids = {s.pid for s in started}
    return [job for job in result["pipeline_jobs"] if job["pid"] in pids]


def absent(*paths, **extra) -> dict:
    args = {"state": "absent", "device_paths": [str(p) for p in paths], "use_nvml": "never", "grace_s": 5}
    args.update(extra)
    return args


# -- what a command line says -----------------------------------------------------------------


def test_the_cli_command_is_read_from_each_way_the_cli_runs():
    assert cli_command(["/v/bin/python", "-m", "eagle3_pipeline.cli", "train", "--x"]) == ("train", 4)
    assert cli_command(["/v/bin/python", "-u", "-m", "eagle3_pipeline.cli", "extract"]) == ("extract", 5)
    assert cli_command(["/v/bin/eagle3-pipeline", "regenerate", "--y"]) == ("regenerate", 2)
    torchrun_worker = ["/v/bin/python", "-m", "torch.distributed.run", "--nproc-per-node=8", "-m",
                       "eagle3_pipeline.cli", "train", "--output-dir", "/o"]  # fmt: skip
    assert job_kind(torchrun_worker) == "training"
    assert cli_command(["/v/bin/python", "-m", "sglang.launch_server", "--port", "30000"]) == (None, None)
    assert job_kind(["/v/bin/python", "-m", "eagle3_pipeline.cli", "serve-reference"]) is None
    assert cli_command([]) == (None, None)


def test_what_a_supervise_start_starts_is_read_in_both_option_forms():
    job = ["/v/bin/python", "-m", "eagle3_pipeline.cli", "train", "--output-dir", "/runs/a"]
    assert supervised_argv(["/v/bin/python", "-m", "eagle3_pipeline.cli", "supervise", "--name", "eagle3-train-a",
                            "--state-dir", "/jobs", "--log-file", "/jobs/a.log", "start", "--", *job]) == {
        "name": "eagle3-train-a", "state_dir": "/jobs", "log_file": "/jobs/a.log", "argv": job,
    }  # fmt: skip
    assert supervised_argv(["/v/bin/eagle3-pipeline", "supervise", "--name=x", "--state-dir=/j", "start", *job])[
        "name"
    ] == "x"
    assert supervised_argv(["/v/bin/eagle3-pipeline", "supervise", "--name", "x", "--state-dir", "/j", "stop"]) is None
    dry = ["/v/bin/eagle3-pipeline", "supervise", "--name", "x", "--state-dir", "/j", "--dry-run", "start", "--", *job]
    assert supervised_argv(dry) is None
    assert option_value(job, "--output-dir") == "/runs/a"
    assert option_value(["--server-url=http://h:1", "--", "--server-url", "no"], "--server-url") == "http://h:1"


def test_loopback_is_local_and_a_documentation_address_is_not():
    assert is_local_host("127.0.0.1") and is_local_host("localhost") and is_local_host("")
    assert not is_local_host("192.0.2.7")  # TEST-NET-1: never an address of this host


# -- gpu_processes: the job is left, a leftover server is stopped ----------------------------


@pytest.mark.parametrize("match", [[], ["sglang"]], ids=["default-match", "match-sglang"])
def test_a_running_extraction_is_left_and_reported_and_a_leftover_server_is_stopped(
    match, supervisor, silent_server, tmp_path, capsys
):
    job = supervisor.start(EXTRACTION, extraction_argv(tmp_path, silent_server.ready["port"]))
    # A leftover server under the supervisor that holds the same file (the job's log) and that no job uses.
    argv, ready, marker = server_argv(tmp_path, "sglang-leftover", job.log)
    leftover = supervisor.start("eagle3-sglang-30999", argv)
    ready_info(ready)

    rc, result = run_module(gpu_processes, absent(job.log, match=match), capsys)

    assert rc == 0, result.get("msg")
    assert running(job.key), "the reset stopped the pipeline's running extraction"
    assert supervisor.status(EXTRACTION)["running"] is True
    (found,) = mine(result, job)
    assert found["name"] == EXTRACTION and found["kind"] == "extraction"
    assert found["supervisor_pid"] == job.supervisor_pid and found["found_by"] == "supervisor"
    assert {job.pid, job.supervisor_pid} <= set(found["pids"])
    assert found["holder_pids"] == sorted([job.pid, job.supervisor_pid])  # both have the log open
    assert found["devices"] == [str(job.log)]
    assert found["output_dir"] == str(tmp_path / "out") and found["this_run"] is None
    left = {record["pid"]: record for record in result["left"]}
    for pid in (job.pid, job.supervisor_pid):
        assert left[pid]["reason"] == job.job_reason()
        assert left[pid]["pipeline_job"] == EXTRACTION
    # The leftover server and its supervisor: one process group, stopped as a whole.
    assert result["changed"] is True
    assert {record["pid"]: record["signal"] for record in result["stopped"]} == {
        leftover.pid: "SIGTERM", leftover.supervisor_pid: "SIGTERM"
    }
    assert marker.exists(), "the leftover server did not get SIGTERM"
    ended = supervisor.status("eagle3-sglang-30999")
    assert ended["running"] is False and ended["exit_code"] == 0


def test_the_server_a_running_job_uses_is_left_and_another_server_is_stopped(supervisor, tmp_path, capsys):
    device = tmp_path / "nvidia0"
    device.write_bytes(b"")
    argv, ready, in_use_marker = server_argv(tmp_path, "capture-server", device, listen=True)
    server = supervisor.start("eagle3-reference-1", argv)
    port = ready_info(ready)["port"]
    job = supervisor.start(EXTRACTION, extraction_argv(tmp_path, port))
    argv, ready, leftover_marker = server_argv(tmp_path, "leftover-server", device, listen=True)
    leftover = supervisor.start("eagle3-reference-2", argv)
    ready_info(ready)

    rc, result = run_module(gpu_processes, absent(device), capsys)

    assert rc == 0, result.get("msg")
    assert running(server.key) and running(job.key)
    assert not in_use_marker.exists(), "the server the extraction waits on got SIGTERM"
    (found,) = mine(result, job)
    assert found["server_url"] == f"http://127.0.0.1:{port}"
    assert found["server_pids"] == sorted([server.pid, server.supervisor_pid])
    assert found["holder_pids"] == [server.pid] and found["devices"] == [str(device)]
    (left,) = result["left"]
    assert left["pid"] == server.pid and left["pipeline_job"] == EXTRACTION
    assert left["reason"] == (
        f"the server on port {port} that this pipeline's running extraction {EXTRACTION} (pid {job.pid}) uses: "
        "left running while the job needs it (gpu_reset_spare_pipeline_jobs)"
    )
    assert {record["pid"] for record in result["stopped"]} == {leftover.pid, leftover.supervisor_pid}
    assert leftover_marker.exists()


def test_a_job_of_another_run_is_left_and_said_to_be_another_runs(supervisor, silent_server, tmp_path, capsys):
    job = supervisor.start(EXTRACTION, extraction_argv(tmp_path, silent_server.ready["port"], output="run-a"))
    this_run = [str(tmp_path / "run-b" / "data"), str(tmp_path / "run-b" / "drafter-run")]

    rc, result = run_module(gpu_processes, absent(job.log, pipeline_output_dirs=this_run), capsys)

    assert rc == 0, result.get("msg")
    assert running(job.key)
    (found,) = mine(result, job)
    assert found["this_run"] is False
    reason = (
        f"this pipeline's running extraction {EXTRACTION} (pid {job.pid}) of another run (output directory "
        f"{tmp_path / 'run-a'}, not this run's): never stopped by the reset (gpu_reset_spare_pipeline_jobs); "
        "it keeps its GPUs"
    )
    assert found["reason"] == reason
    assert {record["pid"]: record["reason"] for record in result["left"]} == {
        job.pid: reason, job.supervisor_pid: reason
    }
    assert result["stopped"] == [] and result["changed"] is False

    rc, result = run_module(gpu_processes, absent(job.log, state="present", pipeline_output_dirs=[
        str(tmp_path / "run-a/")]), capsys)  # fmt: skip
    assert mine(result, job)[0]["this_run"] is True


def test_spare_pipeline_jobs_false_stops_the_job_like_any_holder(supervisor, silent_server, tmp_path, capsys):
    job = supervisor.start(EXTRACTION, extraction_argv(tmp_path, silent_server.ready["port"]))

    rc, result = run_module(gpu_processes, absent(job.log, spare_pipeline_jobs=False), capsys)

    assert rc == 0, result.get("msg")
    assert result["pipeline_jobs"] == []
    assert {record["pid"] for record in result["stopped"]} == {job.pid, job.supervisor_pid}
    assert not running(job.key)
    assert supervisor.status(EXTRACTION)["running"] is False


LAUNCHER = (
    "import subprocess, sys; "
    "subprocess.Popen([sys.executable] + sys.argv[sys.argv.index('--worker') + 1:], start_new_session=True).wait()"
)


def test_a_trainings_workers_in_a_session_of_their_own_are_left_with_it(supervisor, tmp_path, capsys):
    # As torchrun does: the training starts its launcher in a new session; the worker holds the GPU.
    device = tmp_path / "nvidia0"
    device.write_bytes(b"")
    worker_ready, worker_marker = tmp_path / "worker.ready", tmp_path / "worker.sigterm"
    name = "eagle3-train-run-0123456789"
    argv = [sys.executable, "-c", LAUNCHER, "-m", "eagle3_pipeline.cli", "train", "--output-dir", tmp_path / "run",
            "--worker", HOLDER_SCRIPT, "--ready", worker_ready, "--hold", device, "--term-marker", worker_marker,
            "--die-with-parent", "--lifetime", "300"]  # fmt: skip
    job = supervisor.start(name, argv)
    worker_pid = ready_info(worker_ready)["pid"]
    worker = read_proc(worker_pid)
    assert worker.sid == worker_pid != read_proc(job.pid).sid, "the worker is not in a session of its own"

    rc, result = run_module(gpu_processes, absent(device), capsys)

    assert rc == 0, result.get("msg")
    assert running(worker.key()) and not worker_marker.exists()
    (found,) = mine(result, job)
    assert found["kind"] == "training" and worker_pid in found["pids"]
    assert found["holder_pids"] == [worker_pid]
    assert [(r["pid"], r["reason"]) for r in result["left"]] == [(worker_pid, job.job_reason("training"))]
    assert result["stopped"] == []


def test_a_job_whose_supervisor_was_killed_is_known_by_its_state_file(
    supervisor, silent_server, tmp_path, capsys
):
    job = supervisor.start(EXTRACTION, extraction_argv(tmp_path, silent_server.ready["port"]))
    os.kill(job.supervisor_pid, signal.SIGKILL)
    wait_for(lambda: process_state(job.supervisor_pid) in (None, "Z"), 10, "the supervisor to die")
    assert supervisor.status(EXTRACTION)["running"] is True  # what the stage waits on

    rc, result = run_module(
        gpu_processes, absent(job.log, pipeline_state_dirs=[str(supervisor.state_dir)]), capsys
    )

    assert rc == 0, result.get("msg")
    assert running(job.key)
    (found,) = mine(result, job)
    assert found["found_by"] == "state file" and found["supervisor_pid"] is None
    assert [(r["pid"], r["reason"]) for r in result["left"]] == [(job.pid, job.job_reason())]


def test_find_jobs_never_counts_the_callers_own_processes(supervisor, silent_server, tmp_path):
    job = supervisor.start(EXTRACTION, extraction_argv(tmp_path, silent_server.ready["port"]))
    procs = snapshot()
    assert job.pid in [j.job.pid for j in find_jobs(procs, ancestors(os.getpid(), procs))]
    shielded = {job.pid, job.supervisor_pid}
    assert job.pid not in [j.job.pid for j in find_jobs(procs, shielded)]


# -- gpu_wait_free: a GPU held only by the job does not fail ---------------------------------


@pytest.fixture
def install_nvml(monkeypatch):
    def install(gpus):
        fake = FakeNvml(gpus)
        monkeypatch.setitem(sys.modules, "pynvml", fake)
        return fake

    return install


def test_a_gpu_held_only_by_a_running_job_is_reported_not_waited_on(
    supervisor, silent_server, tmp_path, install_nvml, capsys
):
    job = supervisor.start(EXTRACTION, extraction_argv(tmp_path, silent_server.ready["port"]))
    install_nvml([FakeGpu(used_mib=9000, compute=[(job.pid, 9000)]), FakeGpu()])
    started = time.monotonic()

    rc, result = run_module(gpu_wait_free, {"timeout_s": 30, "poll_s": 0.05, "match": ["sglang"]}, capsys)

    assert rc == 0, result.get("msg")
    assert time.monotonic() - started < 30, "it waited out the timeout"
    label = f"extraction {EXTRACTION} (pid {job.pid})"
    assert result["held_by_pipeline_jobs"] == [{"index": 0, "memory_used_mib": 9000, "jobs": [label]}]
    assert [(g["free"], g["held_by_pipeline_jobs"]) for g in result["gpus"]] == [(False, True), (True, False)]
    assert isinstance(result["freed_at"], float)
    assert running(job.key)


def test_a_gpu_the_job_shares_with_a_leftover_still_fails_naming_both(
    supervisor, silent_server, spawn, tmp_path, install_nvml, capsys
):
    job = supervisor.start(EXTRACTION, extraction_argv(tmp_path, silent_server.ready["port"]))
    leftover = spawn("--tag", "leftover")
    install_nvml([FakeGpu(used_mib=2000, compute=[(job.pid, 1000), (leftover.pid, 1000)])])

    rc, result = run_module(gpu_wait_free, {"timeout_s": 0.2, "poll_s": 0.05}, capsys)

    assert rc == 1
    assert f"PID {job.pid} ({' '.join(job.state['argv'])}, 1000 MiB): {job.job_reason()}" in result["msg"]
    assert f"PID {leftover.pid} (" in result["msg"] and "selectable, but still running" in result["msg"]
    assert result["held_by_pipeline_jobs"] == []


def test_without_sparing_a_gpu_held_by_the_job_fails_the_wait(
    supervisor, silent_server, tmp_path, install_nvml, capsys
):
    job = supervisor.start(EXTRACTION, extraction_argv(tmp_path, silent_server.ready["port"]))
    install_nvml([FakeGpu(used_mib=9000, compute=[(job.pid, 9000)])])

    rc, result = run_module(gpu_wait_free, {"timeout_s": 0.2, "poll_s": 0.05, "spare_pipeline_jobs": False}, capsys)

    assert rc == 1
    assert result["msg"].startswith("GPUs not free after 0.2 s: GPU 0 holds 9000 MiB (limit 0 MiB), held by ")
    assert "selectable, but still running" in result["msg"]
