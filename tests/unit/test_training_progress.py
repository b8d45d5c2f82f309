"""job_progress for a training, its own parts: the progress line, rank 0 under torchrun, the nodes, the metrics.

The jobs are real processes started by the real supervisor (tests/unit/supervised_jobs.py),
standing in for ``eagle3-pipeline train``: each writes ``<output_dir>/progress.json`` as the
contract says, prints a line to its log, then sleeps or exits with a given code. One stands in
for a torchrun launch: its rank 0 (a child process, another PID) writes the progress. The module
itself runs in-process through ansible-core's test helper. What it shares with
the extraction (finished / failed / stopped / dead told apart, the wait, the timeout) is
tested for every stage in test_job_progress.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import job_progress as module
import pytest
from ansible.module_utils.training_progress import (
    EXIT_GRACE_S,
    acc_text,
    assess,
    last_records,
    progress_line,
    progress_path,
)
from module_runs import POLL_S, WAIT_S, run_module
from supervised_jobs import JOB, Jobs

RUNNING = {
    "state": "running", "step": 40, "total_steps": 200, "epoch": 1, "loss": 3.2149,
    "acc_k": [0.412, 0.3, 0.2249, 0.1, 0.05], "acceptance_length": 1.93, "tokens_per_s": 1234.4,
    "elapsed_s": 31.0, "eta_s": 130.0, "message": "", "pid": 1, "updated": 0.0,
}  # fmt: skip
WRITTEN = {key: value for key, value in RUNNING.items() if key not in ("pid", "updated")}
LINE = "step 40/200 (epoch 1), loss 3.21, acc 0.41/0.30/0.22\u2026, accept len 1.9, 1,234 tok/s"


def said(state: str) -> dict:
    """The document a stand-in job writes, in ``state``."""
    return {**WRITTEN, "state": state}


@pytest.fixture
def jobs(tmp_path):
    out = tmp_path / "drafter-run"
    started = Jobs(tmp_path, out, Path(progress_path(str(out))), {"stage": "training"})
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
    record = jobs.start(said("running"), "sleep")

    code, result = run_module(module, jobs.args(), capsys)

    assert code == 0 and result["changed"] is False
    assert result["state"] == "running" and result["finished"] is False
    assert result["msg"] == LINE + ", about 0:02:10 left"
    assert (result["step"], result["total_steps"], result["epoch"]) == (40, 200, 1)
    assert result["acc_k"] == RUNNING["acc_k"] and result["job"]["pid"] == record["pid"]
    assert result["last_train"] is None, "metrics are read only once the training is done"


def test_rank_0_under_torchrun_writes_with_another_pid_and_still_counts(jobs, capsys):
    record = jobs.start(said("running"), "sleep", writer="child")
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
    jobs.start(said("done"), "0")
    jobs.wait_ended()

    code, result = run_module(module, jobs.args(wait_s=WAIT_S, poll_s=POLL_S), capsys)

    assert code == 0 and result["finished"] is True and result["state"] == "done"
    assert result["seconds"] < POLL_S, "a finished training returns at its first look"
    assert result["msg"].endswith(": done in 0:00:31")
    assert result["last_train"]["step"] == 40 and result["last_eval"]["samples"] == 4


def test_a_job_that_crashed_while_running_is_dead_at_once_with_its_log(jobs, capsys):
    jobs.start(said("running"), "1")
    assert jobs.wait_ended()["exit_code"] == 1

    code, result = run_module(module, jobs.args(wait_s=WAIT_S, poll_s=POLL_S), capsys)

    assert code == 1 and result["state"] == "dead"
    assert result["seconds"] < POLL_S, "a dead job must fail at its first look, not after a poll or wait_s"
    assert "the training job job exited with code 1 (it crashed)" in result["msg"]
    assert "last progress: step 40/200 (epoch 1)" in result["msg"]
    assert "job: wrote running" in result["msg"] and "supervisor: " in result["msg"]
    assert result["job"]["exit_code"] == 1


def test_on_a_node_of_rank_above_0_exit_0_is_done_and_messages_name_the_node(jobs, capsys):
    jobs.run("node1", sys.executable, "-c", "pass")
    jobs.wait_ended("node1")

    code, result = run_module(module, jobs.args("node1", node_rank=1, nnodes=2), capsys)
    assert code == 0 and result["finished"] is True, result
    assert result["msg"] == "node 1/2: share done (rank 0 reports the progress)"

    jobs.run("crashed", sys.executable, "-c", "import sys; sys.exit(2)")
    jobs.wait_ended("crashed")
    code, result = run_module(module, jobs.args("crashed", node_rank=1, nnodes=2), capsys)
    assert code == 1 and result["state"] == "dead"
    assert result["msg"].startswith("node 1/2: the training job crashed of node 1/2 exited with code 2 (bad input")


def test_a_job_that_exits_0_finding_the_export_done_is_done_on_the_previous_runs_progress(jobs, capsys):
    jobs.output_dir.mkdir()
    jobs.progress_file.write_text(json.dumps({**RUNNING, "state": "done", "pid": 1, "updated": time.time() - 60}))
    jobs.run("job", sys.executable, "-c", "print('already done')")
    jobs.wait_ended()

    code, result = run_module(module, jobs.args(), capsys)

    assert code == 0 and result["finished"] is True and result["step"] == 40, result


def test_a_job_that_exits_0_without_any_done_progress_is_dead_asking_for_the_version(jobs, capsys):
    jobs.run("job", sys.executable, "-c", "pass")
    jobs.wait_ended()

    code, result = run_module(module, jobs.args(), capsys)

    assert code == 1 and result["state"] == "dead"
    assert "exited with code 0 but its progress file does not say done (no progress of this job)" in result["msg"]


def test_a_done_progress_is_done_once_the_process_ended_or_on_node_0_after_the_grace():
    job = {"pid": os.getpid(), "pid_start_time": None, "exit_code": None, "started_at": 0.0}
    done = {**RUNNING, "state": "done", "updated": 1000.0}

    assert assess(done, job, node_rank=0, now=1000.0 + EXIT_GRACE_S - 1)[0] == "running"
    assert assess(done, job, node_rank=0, now=1000.0 + EXIT_GRACE_S + 1)[0] == "done", "a hung teardown"
    assert assess(done, job, node_rank=1, now=1000.0 + EXIT_GRACE_S + 1)[0] == "running", "a node's own process"
    gone = {**job, "pid": 0, "exit_code": 0}
    assert assess(done, gone, node_rank=0, now=1000.0)[0] == assess(done, gone, node_rank=1, now=1000.0)[0] == "done"


# Reports done, then exits with the given code once a gate file exists: the teardown after the report.
LINGERS = JOB.replace(
    "if then == 'sleep':\n",
    "gate, _, then = then.partition('=')\nwhile not os.path.exists(gate):\n    time.sleep(0.05)\nif then == 'sleep':\n",
)


def test_the_wait_after_done_lasts_until_the_job_exits(jobs, capsys, tmp_path):
    gate = tmp_path / "exit"
    record = jobs.start(said("done"), f"{gate}=0", script=LINGERS)

    code, result = run_module(module, jobs.args(), capsys)
    assert code == 0 and result["state"] == "running" and result["finished"] is False, result
    assert result["msg"] == "step 40/200 (epoch 1), loss 3.21, acc 0.41/0.30/0.22\u2026, accept len 1.9, " \
        "1,234 tok/s: done in 0:00:31; waiting for the job to exit"

    threading.Timer(0.5, gate.touch).start()
    code, result = run_module(module, jobs.args(wait_s=WAIT_S, poll_s=0.05), capsys)
    assert code == 0 and result["state"] == "done" and result["finished"] is True, result
    assert result["seconds"] < WAIT_S, "returned on the exit, not at wait_s"
    assert result["job"]["pid"] == record["pid"] and result["job"]["exit_code"] == 0
    assert result["msg"].endswith(": done in 0:00:31") and not result.get("warnings")


def test_a_job_that_fails_after_reporting_done_is_done_with_a_warning(jobs, capsys, tmp_path):
    gate = tmp_path / "exit"
    gate.touch()
    jobs.start(said("done"), f"{gate}=1", script=LINGERS)
    jobs.wait_ended()

    code, result = run_module(module, jobs.args(), capsys)
    assert code == 0 and result["state"] == "done" and result["job"]["exit_code"] == 1, result
    # ansible-core 2.19 returns each warning as a summary object, earlier releases as a string.
    assert [w if isinstance(w, str) else w["event"]["msg"] for w in result["warnings"]] == [
        "the training job job exited with code 1 (it crashed) after it reported done (its drafter was exported and "
        f"stands); the log says why: {jobs.state_dir / 'job.log'}"
    ]


def test_a_read_only_look_without_a_supervisor_reads_a_finished_training(tmp_path, capsys):
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    (tmp_path / "progress.json").write_text(json.dumps({**RUNNING, "state": "done", "pid": gone.pid}))

    code, result = run_module(module, {"stage": "training", "output_dir": str(tmp_path), "wait_s": 0}, capsys,
                              check_mode=True)

    assert code == 0 and result["finished"] is True and result["job"] is None
    assert result["last_train"] is None and result["last_eval"] is None, "no metrics.jsonl: no records"


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
        ({"part_count": 2}, "part_count is not an option of stage training: it is one of extraction and regeneration"),
    ],
)
def test_bad_node_options_fail_naming_the_option(tmp_path, capsys, args, message):
    code, result = run_module(module, {"stage": "training", "output_dir": str(tmp_path), **args}, capsys)

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
