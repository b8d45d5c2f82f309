"""extraction_progress: progress lines, and finished / failed / dead told apart on real jobs.

The jobs are real processes started by the real supervisor (``eagle3-pipeline supervise``),
standing in for ``eagle3-pipeline extract``: each writes a progress file as the contract says
(with its own PID), prints a line to its log, then sleeps or exits with a given code. The
module itself runs in-process through ansible-core's test helper.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import extraction_progress as module
import pytest
from ansible.module_utils.extraction_progress import (
    ProgressError,
    format_duration,
    progress_line,
    progress_path,
    read_status,
    wait_for_change,
)
from module_runs import POLL_S, WAIT_S, run_module
from process_checks import wait_for

SUPERVISE = [sys.executable, "-m", "eagle3_pipeline.cli", "supervise"]

# A stand-in for the extraction job: progress file, a log line, then sleep or exit.
JOB = (
    "import json, os, sys, time\n"
    "path, state, then = sys.argv[1], sys.argv[2], sys.argv[3]\n"
    "progress = {'state': state, 'part': '0/1', 'pid': os.getpid(), 'total': 1000, 'done': 412,\n"
    "            'skipped': 3, 'failed': 0, 'tokens': 81234, 'tokens_per_s': 5210.4, 'eta_s': 192.0,\n"
    "            'started': time.time(), 'updated': time.time(),\n"
    "            'message': 'server answered HTTP 500 for demo-00007' if state == 'failed' else ''}\n"
    "os.makedirs(os.path.dirname(path), exist_ok=True)\n"
    "with open(path + '.tmp', 'w') as handle:\n"
    "    json.dump(progress, handle)\n"
    "os.replace(path + '.tmp', path)\n"
    "print('job: wrote ' + state, flush=True)\n"
    "if then == 'sleep':\n"
    "    time.sleep(300)\n"
    "sys.exit(int(then))\n"
)

RUNNING = {
    "state": "running", "part": "0/1", "pid": 1, "total": 1000, "done": 412, "skipped": 3, "failed": 0,
    "tokens": 81234, "tokens_per_s": 5210.4, "eta_s": 192.0, "started": 0.0, "updated": 0.0, "message": "",
}  # fmt: skip


class Jobs:
    """Jobs started under the real supervisor in one state directory; all stopped at the end."""

    def __init__(self, root: Path):
        self.root = root
        self.state_dir = root / "state"
        self.output_dir = root / "data"
        self.names: list[str] = []

    def supervise(self, name: str, *args: str) -> dict:
        done = subprocess.run(
            [*SUPERVISE, "--name", name, "--state-dir", str(self.state_dir), *args],
            capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout)

    def start(self, state: str, then: str, name: str = "job") -> dict:
        """Start a stand-in job; return once its progress file is written."""
        self.names.append(name)
        record = self.supervise(
            name, "--log-file", str(self.log(name)), "start", "--",
            sys.executable, "-c", JOB, str(self.progress_file), state, then,
        )  # fmt: skip
        def written():
            return self.progress_file.exists() and json.loads(self.progress_file.read_text())["pid"] == record["pid"]

        wait_for(written, 20, "the job's progress file")
        return record

    def record(self, name: str = "job") -> dict:
        return json.loads((self.state_dir / f"{name}.json").read_text())

    def wait_ended(self, name: str = "job") -> dict:
        """Wait until the supervisor recorded the job's exit; return the record."""
        wait_for(lambda: self.record(name).get("exit_code") is not None, 20, "the supervisor to record the exit")
        return self.record(name)

    def log(self, name: str = "job") -> Path:
        return self.state_dir / f"{name}.log"

    @property
    def progress_file(self) -> Path:
        return Path(progress_path(str(self.output_dir), 0, 1))

    def look(self, name: str = "job"):
        return read_status(str(self.progress_file), str(self.state_dir / f"{name}.json"))

    def stop_all(self) -> None:
        for name in self.names:
            subprocess.run([*SUPERVISE, "--name", name, "--state-dir", str(self.state_dir), "--grace-s", "1", "stop"],
                           capture_output=True, timeout=60, check=False)


@pytest.fixture
def jobs(tmp_path):
    started = Jobs(tmp_path)
    yield started
    started.stop_all()


def test_the_progress_line_reads_as_the_operator_needs_it():
    assert progress_line(RUNNING) == "412/1000 samples, 3 skipped, 0 failed, 5,210 tokens/s, about 0:03:12 left"
    assert progress_line({**RUNNING, "eta_s": None, "tokens_per_s": 0.0}) == (
        "412/1000 samples, 3 skipped, 0 failed, 0 tokens/s, time left not known yet"
    )
    done = {**RUNNING, "state": "done", "done": 997, "eta_s": 0.0}
    assert progress_line(done) == "997/1000 samples, 3 skipped, 0 failed, 81,234 tokens: done"
    failed = {**RUNNING, "state": "failed", "message": "disk full"}
    assert progress_line(failed) == "412/1000 samples, 3 skipped, 0 failed: failed: disk full"
    assert progress_line(None) == "waiting for the job's first progress report"
    assert format_duration(3 * 3600 + 62.4) == "3:01:02"


def test_a_running_job_is_running_and_not_finished(jobs):
    record = jobs.start("running", "sleep")

    progress, job, state, mine = jobs.look()

    assert state == "running"
    assert mine == progress and mine["pid"] == record["pid"] == job["pid"]


def test_a_job_that_reported_done_and_exited_0_is_done(jobs):
    jobs.start("done", "0")
    assert jobs.wait_ended()["exit_code"] == 0

    assert jobs.look()[2] == "done"


def test_a_job_that_reported_failed_is_failed_with_its_message(jobs, capsys):
    jobs.start("failed", "1")
    jobs.wait_ended()

    code, result = run_module(module,
        {"output_dir": str(jobs.output_dir), "state_dir": str(jobs.state_dir), "name": "job", "wait_s": 0}, capsys
    )

    assert code == 1 and result["failed"] is True
    assert result["state"] == "failed" and result["finished"] is False
    assert "extraction part 0/1 failed: server answered HTTP 500 for demo-00007" in result["msg"]
    assert "job: wrote failed" in result["msg"], "the log's last lines are missing"


def test_a_job_stopped_on_request_fails_saying_a_rerun_continues(jobs, capsys):
    jobs.start("stopped", "4")
    jobs.wait_ended()

    code, result = run_module(module,
        {"output_dir": str(jobs.output_dir), "state_dir": str(jobs.state_dir), "name": "job", "wait_s": 0}, capsys
    )

    assert code == 1 and result["state"] == "stopped" and result["finished"] is False
    assert "extraction part 0/1 was stopped before it was done" in result["msg"]
    assert "run the playbook again to continue" in result["msg"]


def test_a_job_that_exited_non_zero_while_running_is_dead_with_its_log(jobs, capsys):
    jobs.start("running", "3")
    assert jobs.wait_ended()["exit_code"] == 3

    code, result = run_module(module,
        {"output_dir": str(jobs.output_dir), "state_dir": str(jobs.state_dir), "name": "job", "wait_s": WAIT_S,
         "poll_s": POLL_S}, capsys
    )

    assert code == 1 and result["state"] == "dead"
    assert result["seconds"] < POLL_S, "a dead job must fail at its first look, not after a poll or wait_s"
    assert "the extraction job job of part 0/1 exited with code 3" in result["msg"]
    assert "last progress: 412/1000 samples" in result["msg"]
    assert "job: wrote running" in result["msg"]
    assert "supervisor: " in result["msg"], "the supervisor's exit line is part of the log tail"
    assert result["job"]["exit_code"] == 3


def test_a_job_killed_alone_is_dead_naming_the_signal(jobs, capsys):
    record = jobs.start("running", "sleep")

    os.kill(record["pid"], signal.SIGKILL)
    assert jobs.wait_ended()["exit_code"] == -9

    code, result = run_module(module,
        {"output_dir": str(jobs.output_dir), "state_dir": str(jobs.state_dir), "name": "job", "wait_s": 0}, capsys
    )
    assert code == 1 and result["state"] == "dead"
    assert "the extraction job job of part 0/1 was killed by SIGKILL" in result["msg"]


def test_a_job_killed_with_its_supervisor_is_dead_although_no_exit_was_recorded(jobs, capsys):
    record = jobs.start("running", "sleep")

    os.killpg(record["pgid"], signal.SIGKILL)
    wait_for(lambda: not Path(f"/proc/{record['pid']}").exists() or jobs.look()[2] == "dead", 20, "the kill")

    code, result = run_module(module,
        {"output_dir": str(jobs.output_dir), "state_dir": str(jobs.state_dir), "name": "job", "wait_s": 0}, capsys
    )
    assert jobs.record()["exit_code"] is None
    assert code == 1 and result["state"] == "dead"
    assert "no longer runs and its supervisor recorded no exit code" in result["msg"]


def test_a_previous_runs_progress_is_not_taken_for_the_new_jobs(jobs, capsys):
    jobs.output_dir.mkdir()
    jobs.progress_file.parent.mkdir()
    jobs.progress_file.write_text(json.dumps({**RUNNING, "state": "done", "pid": 1}))
    # A job that has not written its own progress yet: the supervisor runs it, it sleeps.
    jobs.names.append("job")
    record = jobs.supervise("job", "--log-file", str(jobs.log()), "start", "--", sys.executable, "-c",
                            "import time; time.sleep(300)")

    code, result = run_module(module,
        {"output_dir": str(jobs.output_dir), "state_dir": str(jobs.state_dir), "name": "job", "wait_s": 0.3}, capsys
    )

    assert code == 0, result
    assert result["finished"] is False and result["state"] == "starting"
    assert result["progress"] is None and result["job"]["pid"] == record["pid"]
    assert result["msg"] == "part 0/1: waiting for the job's first progress report"


def test_the_wait_returns_when_the_job_first_reports(jobs, capsys):
    jobs.names.append("job")
    script = JOB.replace("path, state, then", "time.sleep(1.0); path, state, then")
    jobs.supervise("job", "--log-file", str(jobs.log()), "start", "--", sys.executable, "-c", script,
                   str(jobs.progress_file), "running", "sleep")

    code, result = run_module(module,
        {"output_dir": str(jobs.output_dir), "state_dir": str(jobs.state_dir), "name": "job", "wait_s": WAIT_S,
         "poll_s": 0.05},
        capsys,
    )

    assert code == 0, result
    # "running" can only have been seen after the job's one-second sleep, so the wait did wait for it.
    assert result["state"] == "running" and result["finished"] is False
    assert result["seconds"] < WAIT_S, "returned on the report, not at wait_s"
    assert result["msg"] == "part 0/1: 412/1000 samples, 3 skipped, 0 failed, 5,210 tokens/s, about 0:03:12 left"
    assert (result["samples_total"], result["samples_done"], result["samples_skipped"]) == (1000, 412, 3)
    assert "skipped" not in result and "failed" not in result


def test_a_running_job_is_waited_for_wait_s_then_reported(jobs, capsys):
    jobs.start("running", "sleep")

    code, result = run_module(module,
        {"output_dir": str(jobs.output_dir), "state_dir": str(jobs.state_dir), "name": "job", "wait_s": 0.6,
         "poll_s": POLL_S},
        capsys,
        check_mode=True,
    )

    assert code == 0 and result["changed"] is False
    # No sleep runs past wait_s: the wait ends at its first look from then, well within one more poll.
    assert result["state"] == "running" and 0.6 <= result["seconds"] < 0.6 + POLL_S


def test_a_done_part_returns_at_once_and_finished(jobs, capsys):
    jobs.start("done", "0")
    jobs.wait_ended()

    code, result = run_module(module,
        {"output_dir": str(jobs.output_dir), "state_dir": str(jobs.state_dir), "name": "job", "wait_s": WAIT_S,
         "poll_s": POLL_S}, capsys
    )

    assert code == 0 and result["finished"] is True and result["state"] == "done"
    assert result["seconds"] < POLL_S, "a finished part returns at its first look"
    assert result["tokens"] == 81234


def test_the_deadline_fails_the_wait_and_says_the_job_keeps_running(jobs, capsys):
    record = jobs.start("running", "sleep")

    code, result = run_module(module,
        {"output_dir": str(jobs.output_dir), "state_dir": str(jobs.state_dir), "name": "job", "wait_s": WAIT_S,
         "deadline": time.time() + 0.3},
        capsys,
    )

    assert code == 1 and result["seconds"] < WAIT_S, "the deadline, not wait_s, ended the wait"
    assert f"the job (PID {record['pid']}) keeps running, at 412/1000 samples" in result["msg"]
    assert "extraction_timeout_s" in result["msg"]


def test_waiting_for_a_job_that_was_never_started_fails_naming_the_record(tmp_path):
    with pytest.raises(ProgressError, match=r"no supervisor record .*never\.json"):
        read_status(str(tmp_path / "progress.json"), str(tmp_path / "never.json"))


def test_without_a_supervisor_the_progress_pid_decides(tmp_path):
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    path = tmp_path / "progress.json"

    path.write_text(json.dumps({**RUNNING, "pid": gone.pid}))
    assert read_status(str(path))[2] == "dead"
    path.write_text(json.dumps({**RUNNING, "pid": os.getpid()}))
    assert read_status(str(path))[2] == "running"
    path.write_text(json.dumps({**RUNNING, "state": "done", "pid": gone.pid}))
    assert read_status(str(path))[2] == "done"


def test_a_progress_file_that_is_not_json_is_named(tmp_path):
    path = tmp_path / "part-0-of-1.progress.json"
    path.write_text("{not json")
    with pytest.raises(ProgressError, match="part-0-of-1.progress.json is not valid JSON"):
        read_status(str(path))


def test_wait_for_change_stops_at_the_deadline_before_wait_s():
    now = [1000.0]
    looks = []

    def look():
        looks.append(now[0])
        return None, None, "running", None

    _seen, seconds = wait_for_change(look, 30, 1.0, deadline=1002.5, clock=lambda: now[0],
                                     sleep=lambda s: now.__setitem__(0, now[0] + s))

    assert seconds == 2.5 and looks == [1000.0, 1001.0, 1002.0, 1002.5]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ({"part_index": 2, "part_count": 2}, "part_index must be in 0..1"),
        ({"part_count": 0}, "part_count must be >= 1"),
        ({"wait_s": -1}, "wait_s must be between 0 and 3600"),
        ({"poll_s": 0}, "poll_s must be > 0"),
        ({"state_dir": "/tmp"}, "parameters are required together: state_dir, name"),
    ],
)
def test_bad_options_fail_naming_the_option(tmp_path, capsys, args, message):
    code, result = run_module(module, {"output_dir": str(tmp_path), **args}, capsys)

    assert code == 1 and message in result["msg"]
