"""training_progress: the progress line, and running / done / failed / stopped / dead told apart on real jobs.

The jobs are real processes started by the real supervisor (``eagle3-pipeline supervise``),
standing in for ``eagle3-pipeline train``: each writes ``<output_dir>/progress.json`` as the
contract says, prints a line to its log, then sleeps or exits with a given code. One stands in
for a torchrun launch: its rank 0 (a child process, another PID) writes the progress. The module
itself runs in-process through ansible-core's test helper.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import training_progress as module
from ansible.module_utils.training_progress import (
    ProgressError,
    acc_text,
    assess,
    last_records,
    progress_line,
    progress_path,
    read_status,
)
from module_runs import POLL_S, WAIT_S, run_module
from process_checks import wait_for

SUPERVISE = [sys.executable, "-m", "eagle3_pipeline.cli", "supervise"]

# A stand-in for the training job: progress file (written by itself, or by a child as torchrun's
# rank 0 would), a log line, then sleep or exit.
JOB = (
    "import json, os, subprocess, sys, time\n"
    "path, state, then, writer = sys.argv[1:5]\n"
    "WRITE = '''\n"
    "import json, os, sys, time\n"
    "path, state = sys.argv[1], sys.argv[2]\n"
    "progress = {'state': state, 'step': 40, 'total_steps': 200, 'epoch': 1, 'loss': 3.2149,\n"
    "            'acc_k': [0.412, 0.3, 0.2249, 0.1, 0.05], 'acceptance_length': 1.93, 'tokens_per_s': 1234.4,\n"
    "            'elapsed_s': 31.0, 'eta_s': 130.0, 'pid': os.getpid(), 'updated': time.time(),\n"
    "            'message': {'failed': 'loss is NaN at step 40',\n"
    "                        'stopped': 'SIGTERM: checkpoint at step 40'}.get(state, '')}\n"
    "os.makedirs(os.path.dirname(path), exist_ok=True)\n"
    "with open(path + '.tmp', 'w') as handle:\n"
    "    json.dump(progress, handle)\n"
    "os.replace(path + '.tmp', path)\n"
    "'''\n"
    "if writer == 'self':\n"
    "    sys.argv = [sys.argv[0], path, state]\n"
    "    exec(WRITE)\n"
    "else:\n"
    "    subprocess.run([sys.executable, '-c', WRITE, path, state], check=True)\n"
    "print('job: wrote ' + state, flush=True)\n"
    "if then == 'sleep':\n"
    "    time.sleep(300)\n"
    "sys.exit(int(then))\n"
)

RUNNING = {
    "state": "running", "step": 40, "total_steps": 200, "epoch": 1, "loss": 3.2149,
    "acc_k": [0.412, 0.3, 0.2249, 0.1, 0.05], "acceptance_length": 1.93, "tokens_per_s": 1234.4,
    "elapsed_s": 31.0, "eta_s": 130.0, "message": "", "pid": 1, "updated": 0.0,
}  # fmt: skip
LINE = "step 40/200 (epoch 1), loss 3.21, acc 0.41/0.30/0.22\u2026, accept len 1.9, 1,234 tok/s"


class Jobs:
    """Jobs started under the real supervisor in one state directory; all stopped at the end."""

    def __init__(self, root: Path):
        self.root = root
        self.state_dir = root / "state"
        self.output_dir = root / "drafter-run"
        self.names: list[str] = []

    def supervise(self, name: str, *args: str) -> dict:
        done = subprocess.run(
            [*SUPERVISE, "--name", name, "--state-dir", str(self.state_dir), *args],
            capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout)

    def start(self, state: str, then: str, name: str = "job", writer: str = "self") -> dict:
        """Start a stand-in job; return once its progress file is written (after the job started)."""
        self.names.append(name)
        record = self.supervise(
            name, "--log-file", str(self.log(name)), "start", "--",
            sys.executable, "-c", JOB, str(self.progress_file), state, then, writer,
        )  # fmt: skip

        def written():
            if not self.progress_file.exists():
                return False
            progress = json.loads(self.progress_file.read_text())
            return progress["pid"] == record["pid"] or progress["updated"] >= self.record(name)["started_at"]

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
        return Path(progress_path(str(self.output_dir)))

    def args(self, name: str = "job", **extra) -> dict:
        return {"output_dir": str(self.output_dir), "state_dir": str(self.state_dir), "name": name, "wait_s": 0,
                **extra}

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
    assert progress_line(RUNNING) == LINE + ", about 0:02:10 left"
    assert progress_line({**RUNNING, "eta_s": None, "loss": None, "acc_k": [], "acceptance_length": None}) == (
        "step 40/200 (epoch 1), 1,234 tok/s, time left not known yet"
    )
    assert progress_line({**RUNNING, "state": "done", "step": 200, "eta_s": 0.0, "elapsed_s": 3725.2}) == (
        "step 200/200 (epoch 1), loss 3.21, acc 0.41/0.30/0.22\u2026, accept len 1.9, 1,234 tok/s: done in 1:02:05"
    )
    assert progress_line({**RUNNING, "state": "failed", "message": "loss is NaN"}) == LINE + ": failed: loss is NaN"
    assert progress_line(None) == "waiting for the job's first progress report"
    # eagle_training_max_steps stops the run before the schedule's end: the line counts to the stop.
    assert progress_line({**RUNNING, "limit_steps": 100}).startswith("step 40/100 (epoch 1)")
    assert acc_text([0.5, 0.25]) == "0.50/0.25" and acc_text([]) == "" and acc_text(None) == ""


def test_a_running_job_is_running_and_not_finished(jobs, capsys):
    record = jobs.start("running", "sleep")

    code, result = run_module(module, jobs.args(), capsys)

    assert code == 0 and result["changed"] is False
    assert result["state"] == "running" and result["finished"] is False
    assert result["msg"] == LINE + ", about 0:02:10 left"
    assert (result["step"], result["total_steps"], result["epoch"]) == (40, 200, 1)
    assert result["acc_k"] == RUNNING["acc_k"] and result["job"]["pid"] == record["pid"]
    assert result["last_train"] is None, "metrics are read only once the training is done"


def test_rank_0_under_torchrun_writes_with_another_pid_and_still_counts(jobs, capsys):
    record = jobs.start("running", "sleep", writer="child")
    assert json.loads(jobs.progress_file.read_text())["pid"] != record["pid"]

    code, result = run_module(module, jobs.args(), capsys)

    assert code == 0 and result["state"] == "running", result
    assert result["step"] == 40


def test_a_job_that_reported_done_and_exited_0_is_done_with_its_last_metrics(jobs, capsys):
    jobs.output_dir.mkdir()
    records = [{"kind": "train", "step": s, "loss": 4.0 - s / 100, "acc_k": [0.1 * s / 40]} for s in range(1, 41)]
    records.append({"kind": "eval", "step": 40, "loss": 3.9, "acc_k": [0.3, 0.2], "acceptance_length": 1.4,
                    "samples": 4})
    (jobs.output_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    jobs.start("done", "0")
    jobs.wait_ended()

    code, result = run_module(module, jobs.args(wait_s=WAIT_S, poll_s=POLL_S), capsys)

    assert code == 0 and result["finished"] is True and result["state"] == "done"
    assert result["seconds"] < POLL_S, "a finished training returns at its first look"
    assert result["msg"].endswith(": done in 0:00:31")
    assert result["last_train"]["step"] == 40 and result["last_eval"]["samples"] == 4


def test_a_job_that_reported_failed_is_failed_with_its_message_and_log(jobs, capsys):
    jobs.start("failed", "1")
    jobs.wait_ended()

    code, result = run_module(module, jobs.args(), capsys)

    assert code == 1 and result["failed"] is True and result["state"] == "failed"
    assert "the training failed at step 40/200: loss is NaN at step 40 (job job)" in result["msg"]
    assert "job: wrote failed" in result["msg"], "the log's last lines are missing"


def test_a_job_stopped_on_request_fails_saying_a_rerun_resumes(jobs, capsys):
    jobs.start("stopped", "4")
    jobs.wait_ended()

    code, result = run_module(module, jobs.args(), capsys)

    assert code == 1 and result["state"] == "stopped" and result["finished"] is False
    assert "the training was stopped before it was done at step 40/200: SIGTERM: checkpoint at step 40" in result["msg"]
    assert "run the playbook again to resume from its last checkpoint" in result["msg"]


def test_a_job_that_crashed_while_running_is_dead_at_once_with_its_log(jobs, capsys):
    jobs.start("running", "1")
    assert jobs.wait_ended()["exit_code"] == 1

    code, result = run_module(module, jobs.args(wait_s=WAIT_S, poll_s=POLL_S), capsys)

    assert code == 1 and result["state"] == "dead"
    assert result["seconds"] < POLL_S, "a dead job must fail at its first look, not after a poll or wait_s"
    assert "the training job job exited with code 1 (it crashed)" in result["msg"]
    assert "last progress: step 40/200 (epoch 1)" in result["msg"]
    assert "job: wrote running" in result["msg"] and "supervisor: " in result["msg"]
    assert result["job"]["exit_code"] == 1


def test_a_job_killed_alone_is_dead_naming_the_signal(jobs, capsys):
    record = jobs.start("running", "sleep")

    os.kill(record["pid"], signal.SIGKILL)
    assert jobs.wait_ended()["exit_code"] == -9

    code, result = run_module(module, jobs.args(), capsys)
    assert code == 1 and result["state"] == "dead"
    assert "the training job job was killed by SIGKILL" in result["msg"]


def test_a_job_killed_with_its_supervisor_is_dead_although_no_exit_was_recorded(jobs, capsys):
    record = jobs.start("running", "sleep")

    os.killpg(record["pgid"], signal.SIGKILL)
    wait_for(lambda: read_status(str(jobs.progress_file), str(jobs.state_dir / "job.json"))[2] == "dead", 20,
             "the kill")

    code, result = run_module(module, jobs.args(), capsys)
    assert jobs.record()["exit_code"] is None
    assert code == 1 and result["state"] == "dead"
    assert "no longer runs and its supervisor recorded no exit code" in result["msg"]


def test_a_previous_runs_progress_is_not_taken_for_the_new_jobs(jobs, capsys):
    jobs.output_dir.mkdir()
    jobs.progress_file.write_text(json.dumps({**RUNNING, "state": "done", "pid": 1, "updated": time.time() - 60}))
    jobs.names.append("job")
    record = jobs.supervise("job", "--log-file", str(jobs.log()), "start", "--", sys.executable, "-c",
                            "import time; time.sleep(300)")

    code, result = run_module(module, jobs.args(wait_s=0.3), capsys)

    assert code == 0, result
    assert result["finished"] is False and result["state"] == "starting"
    assert result["progress"] is None and result["job"]["pid"] == record["pid"]
    assert result["msg"] == "waiting for the job's first progress report"


def test_on_a_node_of_rank_above_0_exit_0_is_done_and_messages_name_the_node(jobs, capsys):
    jobs.names.append("node1")
    jobs.supervise("node1", "--log-file", str(jobs.log("node1")), "start", "--", sys.executable, "-c", "pass")
    jobs.wait_ended("node1")

    code, result = run_module(module, jobs.args("node1", node_rank=1, nnodes=2), capsys)
    assert code == 0 and result["finished"] is True, result
    assert result["msg"] == "node 1/2: share done (rank 0 reports the progress)"

    jobs.names.append("crashed")
    jobs.supervise("crashed", "--log-file", str(jobs.log("crashed")), "start", "--", sys.executable, "-c",
                   "import sys; sys.exit(2)")
    jobs.wait_ended("crashed")
    code, result = run_module(module, jobs.args("crashed", node_rank=1, nnodes=2), capsys)
    assert code == 1 and result["state"] == "dead"
    assert result["msg"].startswith("node 1/2: the training job crashed of node 1/2 exited with code 2 (bad input")


def test_a_job_that_exits_0_finding_the_export_done_is_done_on_the_previous_runs_progress(jobs, capsys):
    jobs.output_dir.mkdir()
    jobs.progress_file.write_text(json.dumps({**RUNNING, "state": "done", "pid": 1, "updated": time.time() - 60}))
    jobs.names.append("job")
    jobs.supervise("job", "--log-file", str(jobs.log()), "start", "--", sys.executable, "-c", "print('already done')")
    jobs.wait_ended()

    code, result = run_module(module, jobs.args(), capsys)

    assert code == 0 and result["finished"] is True and result["step"] == 40, result


def test_a_job_that_exits_0_without_any_done_progress_is_dead_asking_for_the_version(jobs, capsys):
    jobs.names.append("job")
    jobs.supervise("job", "--log-file", str(jobs.log()), "start", "--", sys.executable, "-c", "pass")
    jobs.wait_ended()

    code, result = run_module(module, jobs.args(), capsys)

    assert code == 1 and result["state"] == "dead"
    assert "exited with code 0 but its progress file does not say done (no progress of this job)" in result["msg"]


def test_a_done_progress_on_node_0_wins_over_a_still_running_process():
    job = {"pid": os.getpid(), "pid_start_time": None, "exit_code": None, "started_at": 0.0}
    done = {**RUNNING, "state": "done", "updated": time.time()}

    assert assess(done, job, node_rank=0)[0] == "done"
    assert assess(done, job, node_rank=1)[0] == "running", "a node's own process must end first"


def test_the_deadline_fails_the_wait_and_says_the_job_keeps_running(jobs, capsys):
    record = jobs.start("running", "sleep")

    code, result = run_module(module, jobs.args(wait_s=WAIT_S, deadline=time.time() + 0.3), capsys)

    assert code == 1 and result["seconds"] < WAIT_S, "the deadline, not wait_s, ended the wait"
    assert f"the job (PID {record['pid']}) keeps running, at step 40/200" in result["msg"]
    assert "eagle_training_timeout" in result["msg"]


def test_a_read_only_look_without_a_supervisor_reads_a_finished_training(tmp_path, capsys):
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    (tmp_path / "progress.json").write_text(json.dumps({**RUNNING, "state": "done", "pid": gone.pid}))

    code, result = run_module(module, {"output_dir": str(tmp_path), "wait_s": 0}, capsys, check_mode=True)

    assert code == 0 and result["finished"] is True and result["job"] is None
    assert result["last_train"] is None and result["last_eval"] is None, "no metrics.jsonl: no records"


def test_waiting_for_a_job_that_was_never_started_fails_naming_the_record(tmp_path):
    with pytest.raises(ProgressError, match=r"no supervisor record .*never\.json.*the training job"):
        read_status(str(tmp_path / "progress.json"), str(tmp_path / "never.json"))


def test_last_records_reads_only_the_tail_and_skips_a_cut_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    lines = [json.dumps({"kind": "eval", "step": 0, "pad": "x" * 200})]
    lines += [json.dumps({"kind": "train", "step": s, "pad": "x" * 200}) for s in range(1, 2001)]
    path.write_text("\n".join(lines) + "\n" + '{"kind": "train", "step": 20')  # a line cut by a crash

    found = last_records(str(path), tail_bytes=16 * 1024)

    assert found["train"]["step"] == 2000
    assert found["eval"] is None, "the eval line lies before the tail read"
    assert last_records(str(tmp_path / "none.jsonl")) == {"train": None, "eval": None}


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ({"node_rank": 2, "nnodes": 2}, "node_rank must be in 0..1"),
        ({"nnodes": 0}, "nnodes must be >= 1"),
        ({"wait_s": -1}, "wait_s must be between 0 and 3600"),
        ({"poll_s": 0}, "poll_s must be > 0"),
        ({"state_dir": "/tmp"}, "parameters are required together: state_dir, name"),
    ],
)
def test_bad_options_fail_naming_the_option(tmp_path, capsys, args, message):
    code, result = run_module(module, {"output_dir": str(tmp_path), **args}, capsys)

    assert code == 1 and message in result["msg"]


def test_a_job_that_just_ended_is_not_judged_before_its_supervisor_records_the_exit():
    """Killed with SIGKILL, the job is a zombie until its supervisor reaps it and writes the exit code: while the
    supervisor runs, the job is not final yet (it was once reported as killed with its supervisor)."""
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    job = {"pid": gone.pid, "pid_start_time": 1, "exit_code": None, "supervisor_pid": os.getpid()}
    progress = {"pid": gone.pid, "state": "running"}
    assert assess(progress, job)[0] == "running"
    assert assess(progress, {**job, "supervisor_pid": gone.pid})[0] == "dead"  # the supervisor gone too
    assert assess(progress, {**job, "exit_code": -9})[0] == "dead"
