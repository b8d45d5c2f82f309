"""What every progress module does (module_utils/job_progress.py), on real jobs, for each stage.

job_progress follows an extraction part, a regeneration part and a training with the same
wait, their reading of the supervisor's record and their failures: each test here runs for the
three stages. The jobs are real processes under the real supervisor (tests/unit/supervised_jobs.py);
the modules run in-process through ansible-core's test helper. What only one stage does is in
test_extraction_progress.py and test_training_progress.py (module_utils' two stages).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from types import ModuleType

import job_progress as progress_module
import pytest
from ansible.module_utils import job_progress
from ansible.module_utils.job_progress import wait_for_change
from module_runs import POLL_S, WAIT_S, run_module
from process_checks import state as process_state
from process_checks import wait_for
from supervised_jobs import JOB, Jobs

PART = {
    "state": "running", "part": "0/1", "total": 1000, "done": 412, "skipped": 3, "failed": 0, "tokens": 81234,
    "tokens_per_s": 5210.4, "eta_s": 192.0, "message": "",
}  # fmt: skip
TRAINING = {
    "state": "running", "step": 40, "total_steps": 200, "epoch": 1, "loss": 3.2149,
    "acc_k": [0.412, 0.3, 0.2249, 0.1, 0.05], "acceptance_length": 1.93, "tokens_per_s": 1234.4,
    "elapsed_s": 31.0, "eta_s": 130.0, "message": "",
}  # fmt: skip


@dataclass
class StageCase:
    """One stage: its module, where its job writes, what it writes, and the words of its messages."""

    module: ModuleType
    progress_file: str  # relative to the output directory
    document: dict
    line: str  # msg of the running job
    starting: str  # msg before the job's first report
    failed: str  # in the failure of a job that said it failed with ``failed_reason``
    stopped: str  # ... that said it was stopped
    rerun: str  # ... what a rerun of a stopped job does
    exited: str  # in the failure of a job that exited with code 3 while running
    last: str  # the last progress, in that failure
    killed: str  # ... killed by SIGKILL
    timeout_variable: str
    at: str  # where the job is, in a timeout's message
    module_args: dict = field(default_factory=dict)
    failed_reason: str = "the server went away"


STAGES = {
    "extraction": StageCase(
        module=progress_module,
        module_args={"stage": "extraction"},
        progress_file="parts/part-0-of-1.progress.json",
        document=PART,
        line="part 0/1: 412/1000 samples, 3 skipped, 0 failed, 5,210 tokens/s, about 0:03:12 left",
        starting="part 0/1: waiting for the job's first progress report",
        failed="extraction part 0/1 failed: the server went away (job job)",
        stopped="extraction part 0/1 was stopped before it was done: SIGTERM",
        rerun="run the playbook again to continue where it stopped",
        exited="the extraction job job of part 0/1 exited with code 3",
        last="last progress: 412/1000 samples",
        killed="the extraction job job of part 0/1 was killed by SIGKILL",
        timeout_variable="extraction_timeout_s",
        at="at 412/1000 samples",
    ),
    "regeneration": StageCase(
        module=progress_module,
        module_args={"stage": "regeneration"},
        progress_file="parts/part-0-of-1.progress.json",
        document={**PART, "unit": "conversations", "turns": 655},
        line="part 0/1: 412/1000 conversations, 3 skipped, 0 failed, 655 turns, 5,210 tokens/s, about 0:03:12 left",
        starting="part 0/1: waiting for the job's first progress report",
        failed="regeneration part 0/1 failed: the server went away (job job)",
        stopped="regeneration part 0/1 was stopped before it was done: SIGTERM",
        rerun="run the playbook again to continue where it stopped",
        exited="the regeneration job job of part 0/1 exited with code 3",
        last="last progress: 412/1000 conversations",
        killed="the regeneration job job of part 0/1 was killed by SIGKILL",
        timeout_variable="regeneration_timeout_s",
        at="at 412/1000 conversations",
    ),
    "training": StageCase(
        module=progress_module,
        module_args={"stage": "training"},
        progress_file="progress.json",
        document=TRAINING,
        line="step 40/200 (epoch 1), loss 3.21, acc 0.41/0.30/0.22\u2026, accept len 1.9, 1,234 tok/s, "
             "about 0:02:10 left",
        starting="waiting for the job's first progress report",
        failed="the training failed at step 40/200: the server went away (job job)",
        stopped="the training was stopped before it was done at step 40/200: SIGTERM",
        rerun="run the playbook again to resume from its last checkpoint",
        exited="the training job job exited with code 3",
        last="last progress: step 40/200 (epoch 1)",
        killed="the training job job was killed by SIGKILL",
        timeout_variable="eagle_training_timeout",
        at="at step 40/200",
    ),
}


@pytest.fixture(params=sorted(STAGES))
def stage(request) -> StageCase:
    return STAGES[request.param]


@pytest.fixture
def jobs(tmp_path, stage):
    output_dir = tmp_path / "out"
    started = Jobs(tmp_path, output_dir, output_dir / stage.progress_file, stage.module_args)
    yield started
    started.stop_all()


def said(stage: StageCase, state: str) -> dict:
    reasons = {"failed": stage.failed_reason, "stopped": "SIGTERM: checkpoint at step 40"}
    return {**stage.document, "state": state, "message": reasons.get(state, "")}


def test_a_running_job_is_running_and_not_finished(stage, jobs, capsys):
    record = jobs.start(said(stage, "running"), "sleep")

    code, result = run_module(stage.module, jobs.args(), capsys)

    assert code == 0 and result["changed"] is False
    assert result["state"] == "running" and result["finished"] is False
    assert result["msg"] == stage.line
    assert result["job"]["pid"] == record["pid"] == result["progress"]["pid"]
    assert "skipped" not in result and "failed" not in result, "Ansible would read them as the task's status"


def test_a_done_job_returns_at_its_first_look_finished(stage, jobs, capsys):
    jobs.start(said(stage, "done"), "0")
    jobs.wait_ended()

    code, result = run_module(stage.module, jobs.args(wait_s=WAIT_S, poll_s=POLL_S), capsys)

    assert code == 0 and result["finished"] is True and result["state"] == "done"
    assert result["seconds"] < POLL_S, "a finished job returns at its first look"


def test_a_job_that_reported_failed_is_failed_with_its_message_and_log(stage, jobs, capsys):
    jobs.start(said(stage, "failed"), "1")
    jobs.wait_ended()

    code, result = run_module(stage.module, jobs.args(), capsys)

    assert code == 1 and result["failed"] is True
    assert result["state"] == "failed" and result["finished"] is False
    assert stage.failed in result["msg"]
    assert "job: wrote failed" in result["msg"], "the log's last lines are missing"


def test_a_job_stopped_on_request_fails_saying_what_a_rerun_does(stage, jobs, capsys):
    jobs.start(said(stage, "stopped"), "4")
    jobs.wait_ended()

    code, result = run_module(stage.module, jobs.args(), capsys)

    assert code == 1 and result["state"] == "stopped" and result["finished"] is False
    assert stage.stopped in result["msg"] and stage.rerun in result["msg"]


def test_a_job_that_exited_non_zero_while_running_is_dead_at_once_with_its_log(stage, jobs, capsys):
    jobs.start(said(stage, "running"), "3")
    assert jobs.wait_ended()["exit_code"] == 3

    code, result = run_module(stage.module, jobs.args(wait_s=WAIT_S, poll_s=POLL_S), capsys)

    assert code == 1 and result["state"] == "dead"
    assert result["seconds"] < POLL_S, "a dead job must fail at its first look, not after a poll or wait_s"
    assert stage.exited in result["msg"] and stage.last in result["msg"]
    assert "job: wrote running" in result["msg"]
    assert "supervisor: " in result["msg"], "the supervisor's exit line is part of the log tail"
    assert result["job"]["exit_code"] == 3


def test_a_job_killed_alone_is_dead_naming_the_signal(stage, jobs, capsys):
    record = jobs.start(said(stage, "running"), "sleep")

    os.kill(record["pid"], signal.SIGKILL)
    assert jobs.wait_ended()["exit_code"] == -9

    code, result = run_module(stage.module, jobs.args(), capsys)
    assert code == 1 and result["state"] == "dead"
    assert stage.killed in result["msg"]


def test_an_exit_recorded_between_the_looks_two_reads_is_named(stage, jobs, capsys, monkeypatch):
    # The look reads the supervisor's record, then whether its processes run. Here the record it read
    # first says no exit yet, and by the time it looks, the supervisor has recorded the kill and ended.
    record = jobs.start(said(stage, "running"), "sleep")
    os.kill(record["pid"], signal.SIGKILL)
    ended = jobs.wait_ended()
    wait_for(lambda: process_state(ended["supervisor_pid"]) is None, 20, "the supervisor to end")
    read_json, job_file, reads = job_progress.read_json, str(jobs.state_dir / "job.json"), []

    def first_read_before_the_exit(path):
        found = read_json(path)
        if path == job_file:
            reads.append(path)
            if len(reads) == 1:
                return {**found, "exit_code": None}
        return found

    monkeypatch.setattr(job_progress, "read_json", first_read_before_the_exit)
    code, result = run_module(stage.module, jobs.args(), capsys)
    assert len(reads) == 2, "the record was read again"
    assert code == 1 and result["state"] == "dead"
    assert stage.killed in result["msg"] and "recorded no exit code" not in result["msg"], result["msg"]


def test_a_job_killed_with_its_supervisor_is_dead_although_no_exit_was_recorded(stage, jobs, capsys):
    record = jobs.start(said(stage, "running"), "sleep")

    os.killpg(record["pgid"], signal.SIGKILL)

    def judged_dead():
        return run_module(stage.module, jobs.args(), capsys)[1]["state"] == "dead"

    wait_for(judged_dead, 20, "the kill")
    code, result = run_module(stage.module, jobs.args(), capsys)
    assert jobs.record()["exit_code"] is None
    assert code == 1 and result["state"] == "dead"
    assert "no longer runs and its supervisor recorded no exit code" in result["msg"]


def test_a_previous_runs_progress_is_not_taken_for_the_new_jobs(stage, jobs, capsys):
    jobs.progress_file.parent.mkdir(parents=True)
    jobs.progress_file.write_text(json.dumps({**said(stage, "done"), "pid": 1, "updated": time.time() - 60}))
    # A job that has not written its own progress yet: the supervisor runs it, it sleeps.
    record = jobs.run("job", sys.executable, "-c", "import time; time.sleep(300)")

    code, result = run_module(stage.module, jobs.args(wait_s=0.3), capsys)

    assert code == 0, result
    assert result["finished"] is False and result["state"] == "starting"
    assert result["progress"] is None and result["job"]["pid"] == record["pid"]
    assert result["msg"] == stage.starting


def test_the_wait_returns_when_the_job_first_reports(stage, jobs, capsys, monkeypatch, tmp_path):
    # The job makes its first report only once the wait has looked: "running" can only be seen after it.
    gate = tmp_path / "looked"
    script = f"import os, time\nwhile not os.path.exists({str(gate)!r}): time.sleep(0.01)\n" + JOB
    jobs.run("job", sys.executable, "-c", script, str(jobs.progress_file), json.dumps(said(stage, "running")),
             "sleep", "self")
    read_status = job_progress.Stage.read_status

    def look_then_open_the_gate(self, job_file=None):
        found = read_status(self, job_file)
        gate.touch()
        return found

    monkeypatch.setattr(job_progress.Stage, "read_status", look_then_open_the_gate)

    code, result = run_module(stage.module, jobs.args(wait_s=WAIT_S, poll_s=0.05), capsys)

    assert code == 0, result
    assert result["state"] == "running" and result["finished"] is False
    assert result["seconds"] < WAIT_S, "returned on the report, not at wait_s"
    assert result["msg"] == stage.line


def test_a_running_job_is_waited_for_wait_s_then_reported_in_check_mode(stage, jobs, capsys):
    jobs.start(said(stage, "running"), "sleep")

    code, result = run_module(stage.module, jobs.args(wait_s=0.6, poll_s=POLL_S), capsys, check_mode=True)

    assert code == 0 and result["changed"] is False
    # No sleep runs past wait_s: the wait ends at its first look from then, well within one more poll.
    assert result["state"] == "running" and 0.6 <= result["seconds"] < 0.6 + POLL_S
    assert result["waited_s"] == result["seconds"]


def test_the_timeout_ends_the_wait_and_says_the_job_keeps_running(stage, jobs, capsys):
    record = jobs.start(said(stage, "running"), "sleep")

    code, result = run_module(stage.module, jobs.args(wait_s=WAIT_S, timeout_s=0.3), capsys)

    assert code == 1 and result["seconds"] < WAIT_S, "the timeout, not wait_s, ended the wait"
    assert f"the job (PID {record['pid']}) keeps running, {stage.at}" in result["msg"]
    assert stage.timeout_variable in result["msg"]


def test_the_time_earlier_calls_waited_counts_towards_the_timeout(stage, jobs, capsys):
    jobs.start(said(stage, "running"), "sleep")

    code, result = run_module(stage.module, jobs.args(wait_s=WAIT_S, poll_s=POLL_S, timeout_s=600, waited_s=600),
                              capsys)

    assert code == 1 and result["seconds"] < POLL_S, "no time was left: the first look is the last"
    assert result["waited_s"] >= 600 and "keeps running" in result["msg"]


def test_a_job_that_was_never_started_fails_naming_the_record_and_the_role(request, stage, jobs, capsys):
    code, result = run_module(stage.module, jobs.args("never"), capsys)

    assert code == 1
    assert "the %s job was never started" % request.node.callspec.params["stage"] in result["msg"]
    assert "no supervisor record %s" % (jobs.state_dir / "never.json") in result["msg"]
    assert "role does) before waiting for it" in result["msg"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ({"wait_s": -1}, "wait_s must be between 0 and 3600"),
        ({"wait_s": 3601}, "wait_s must be between 0 and 3600"),
        ({"timeout_s": -1}, "timeout_s must be >= 0"),
        ({"waited_s": -1}, "waited_s must be >= 0"),
        ({"poll_s": 0}, "poll_s must be > 0"),
        ({"log_lines": 0}, "log_lines must be between 1 and 1000"),
        ({"state_dir": "/tmp"}, "parameters are required together: state_dir, name"),
    ],
)
def test_bad_options_fail_naming_the_option(stage, tmp_path, capsys, args, message):
    code, result = run_module(stage.module, {"output_dir": str(tmp_path), **stage.module_args, **args}, capsys)

    assert code == 1 and message in result["msg"]


def test_wait_for_change_looks_every_poll_until_wait_s():
    now = [1000.0]
    looks = []

    def look():
        looks.append(now[0])
        return None, None, "running", None

    _seen, seconds = wait_for_change(look, 2.5, 1.0, clock=lambda: now[0],
                                     sleep=lambda s: now.__setitem__(0, now[0] + s))

    assert seconds == 2.5 and looks == [1000.0, 1001.0, 1002.0, 1002.5]


def test_wait_for_change_returns_at_a_change_of_state_not_of_counts():
    now = [0.0]
    states = iter(["starting", "starting", "running", "running"])

    def look():
        return None, None, next(states), None

    seen, seconds = wait_for_change(look, 30, 1.0, clock=lambda: now[0], sleep=lambda s: now.__setitem__(0, now[0] + s))

    assert seen[2] == "running" and seconds == 2.0

