"""playbooks/gpu_reset.yml through ansible-runner, against real processes holding a stand-in device file."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

CLI = [sys.executable, "-m", "eagle3_pipeline.cli"]


def read_report(report_dir: Path, check: bool = False) -> dict:
    """The JSON report the role wrote for localhost (a check run's: localhost.check.json)."""
    return json.loads((report_dir / f"localhost{'.check' if check else ''}.json").read_text())


def is_number(value) -> bool:
    """A JSON number (not a bool, not a string that looks like one)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def test_check_mode_names_the_holder_and_signals_nothing(tmp_path, device_file, start_holder, run_gpu_reset):
    holder = start_holder("checked", device_file)
    report_dir = tmp_path / "report"

    run = run_gpu_reset(
        {"gpu_reset_device_paths": [str(device_file)], "gpu_reset_report_dir": str(report_dir)}, check=True
    )

    assert run.status == "successful", run.stdout
    stop = run.result("gpu_processes")
    assert stop["device_paths"] == [str(device_file.resolve())]
    assert [p["pid"] for p in stop["would_stop"]] == [holder.pid]
    assert stop["stopped"] == []
    assert holder.alive()
    assert not holder.got_sigterm(), "check mode sent SIGTERM"
    assert f"would stop PID {holder.pid} (" in "\n".join(run.summary())
    assert not (report_dir / "localhost.json").exists(), "a check run must not replace a real run's record"
    report = read_report(report_dir, check=True)
    assert report["check_mode"] is True
    assert [p["pid"] for p in report["would_stop"]] == [holder.pid]
    assert report["stopped"] == []


def test_run_stops_the_holder_reports_it_and_a_second_run_changes_nothing(
    tmp_path, device_file, start_holder, run_gpu_reset
):
    holder = start_holder("stopped", device_file)
    report_dir = tmp_path / "report"
    extravars = {
        "gpu_reset_device_paths": [str(device_file)],
        "gpu_reset_report_dir": str(report_dir),
        "gpu_reset_grace_s": 5,
    }

    first = run_gpu_reset(extravars)

    assert first.status == "successful", first.stdout
    assert first.result("gpu_processes")["changed"] is True
    assert holder.exit_status() == 0, "the holder did not exit through its SIGTERM handler"
    assert holder.got_sigterm()
    report = read_report(report_dir)
    assert report["check_mode"] is False
    assert report["left"] == []
    assert [p["pid"] for p in report["stopped"]] == [holder.pid]
    stopped = report["stopped"][0]
    assert "--tag stopped " in stopped["cmdline"]
    assert stopped["signal"] == "SIGTERM"
    assert is_number(stopped["seconds"]) and 0 <= stopped["seconds"] < 5
    assert is_number(report["stop_seconds"]) and report["stop_seconds"] >= stopped["seconds"]
    assert is_number(report["first_signal_at"])
    assert f"stopped PID {holder.pid} (" in "\n".join(first.summary())

    second = run_gpu_reset(extravars)

    assert second.status == "successful", second.stdout
    assert second.changed() == 0, second.changed_tasks()
    assert second.result("gpu_processes")["holders"] == []
    assert read_report(report_dir)["stopped"] == []


def test_a_whole_group_is_stopped_and_sigkill_follows_the_grace(device_file, start_holder, run_gpu_reset):
    # The launcher holds the file; its child holds nothing and ignores SIGTERM, as a server's
    # worker that outlives a kill of its parent would.
    holder = start_holder("launcher", device_file, child=True)
    # Long enough for both SIGTERM handlers to run on a loaded machine before SIGKILL comes.
    grace_s = 3

    run = run_gpu_reset({"gpu_reset_device_paths": [str(device_file)], "gpu_reset_grace_s": grace_s})

    assert run.status == "successful", run.stdout
    stop = run.result("gpu_processes")
    assert stop["units"] == [{"kind": "group", "id": holder.pid, "pids": sorted([holder.pid, holder.child_pid])}]
    ended = {p["pid"]: p for p in stop["stopped"]}
    assert {pid: p["signal"] for pid, p in ended.items()} == {holder.pid: "SIGTERM", holder.child_pid: "SIGKILL"}
    assert ended[holder.child_pid]["seconds"] >= grace_s
    assert holder.child_term_marker.exists(), "SIGTERM did not reach the child through its group"
    assert not holder.child_alive()
    assert holder.exit_status() == 0


def test_match_stops_only_the_matching_holder(tmp_path, device_file, start_holder, run_gpu_reset):
    kept = start_holder("keep-me", device_file)
    target = start_holder("stop-me", device_file)
    report_dir = tmp_path / "report"

    run = run_gpu_reset(
        {
            "gpu_reset_device_paths": [str(device_file)],
            "gpu_reset_report_dir": str(report_dir),
            "gpu_reset_match": ["--tag stop-me( |$)"],
            "gpu_reset_grace_s": 5,
        }
    )

    assert run.status == "successful", run.stdout
    assert target.exit_status() == 0
    assert kept.alive()
    assert not kept.got_sigterm()
    report = read_report(report_dir)
    assert [p["pid"] for p in report["stopped"]] == [target.pid]
    assert [p["pid"] for p in report["left"]] == [kept.pid]
    assert "not matched" in report["left"][0]["reason"]
    assert f"left PID {kept.pid} (" in "\n".join(run.summary())


@pytest.mark.parametrize(
    ("name", "value"),
    [("gpu_reset_grace_s", "soon"), ("gpu_reset_required", "maybe"), ("gpu_reset_device_paths", {"a": 1})],
)
def test_a_wrong_variable_fails_at_the_first_task_naming_it(name, value, device_file, start_holder, run_gpu_reset):
    holder = start_holder("bystander", device_file)
    extravars = {"gpu_reset_device_paths": [str(device_file)], name: value}

    run = run_gpu_reset(extravars)

    assert run.status == "failed", run.stdout
    failed = run.failed()
    assert len(failed) == 1, run.stdout
    assert failed[0]["task_action"] in ("ansible.builtin.validate_argument_spec", "validate_argument_spec")
    first_task = next(e["event_data"] for e in run.events if e["event"] == "playbook_on_task_start")
    assert first_task["task_uuid"] == failed[0]["task_uuid"], "the validation was not the first task"
    assert run.task_results(("runner_on_ok",)) == [], "tasks ran after a failed validation"
    message = failed[0]["res"]["msg"]
    assert f"'{name}'" in message
    assert not [other for other in extravars if other != name and other in message]
    assert holder.alive()
    assert not holder.got_sigterm()


@pytest.mark.parametrize(("variable", "option"), [("gpu_reset_match", "match"), ("gpu_reset_protect_extra", "protect")])
def test_a_bad_regex_fails_naming_the_option_and_pattern(variable, option, device_file, start_holder, run_gpu_reset):
    holder = start_holder("bystander", device_file)

    run = run_gpu_reset({"gpu_reset_device_paths": [str(device_file)], variable: ["sglang", "(unclosed"]})

    assert run.status == "failed", run.stdout
    failed = run.failed()
    assert [f["task_action"] for f in failed] == ["gpu_processes"], run.stdout
    message = failed[0]["res"]["msg"]
    assert re.match(rf"{option}\b", message), message
    assert "'(unclosed'" in message
    assert "not a valid regular expression" in message
    assert holder.alive()
    assert not holder.got_sigterm()


@pytest.fixture
def extraction_job(tmp_path):
    """A real extraction under the supervisor, as the extraction role starts it, left running.

    Its server listens (here, in the test) and never answers: the job waits on it for as long as the
    test needs. Yields (name, state dir, the state file's record); the job is stopped at the end.
    """
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    dataset = tmp_path / "dataset.jsonl"
    conversation = [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]
    dataset.write_text(json.dumps({"conversations": conversation}) + "\n")
    name, state_dir = "eagle3-extract-part-0-of-1", tmp_path / "jobs"
    supervise = [*CLI, "supervise", "--name", name, "--state-dir", str(state_dir)]
    job = [*CLI, "extract", "--dataset", str(dataset), "--output-dir", str(tmp_path / "run-a" / "data"),
           "--server-url", "http://127.0.0.1:%d" % server.getsockname()[1], "--request-timeout-s", "300",
           "--retries", "0", "--no-merge"]  # fmt: skip
    started = subprocess.run([*supervise, "--log-file", str(state_dir / f"{name}.log"), "start", "--", *job],
                             capture_output=True, text=True, timeout=60, check=True)  # fmt: skip
    record = json.loads(started.stdout)
    deadline = time.monotonic() + 30
    while Path(f"/proc/{record['pid']}/cmdline").read_bytes().split(b"\0")[:-1] != [a.encode() for a in job]:
        assert time.monotonic() < deadline, "the job did not execute its command"
        time.sleep(0.01)
    try:
        yield name, state_dir, record
    finally:
        subprocess.run([*supervise, "--grace-s", "2", "stop"], capture_output=True, timeout=60, check=False)
        server.close()


def test_a_running_job_of_another_run_is_never_signalled_and_the_summary_says_so(
    tmp_path, extraction_job, run_gpu_reset
):
    name, state_dir, job = extraction_job
    log = Path(job["log_file"])
    report_dir = tmp_path / "report"
    # This run's output directories are elsewhere: the job is another run's. Its log is the "device file":
    # the job and its supervisor hold it open, and with the default gpu_reset_match any holder goes.
    run = run_gpu_reset({
        "gpu_reset_device_paths": [str(log)],
        "gpu_reset_report_dir": str(report_dir),
        "gpu_reset_pipeline_output_dirs": [str(tmp_path / "run-b" / "data")],
        "gpu_reset_grace_s": 2,
    })  # fmt: skip

    assert run.status == "successful", run.stdout
    status = subprocess.run([*CLI, "supervise", "--name", name, "--state-dir", str(state_dir), "status"],
                            capture_output=True, text=True, timeout=60, check=True)  # fmt: skip
    now = json.loads(status.stdout)
    assert now["running"] is True and (now["pid"], now["pid_start_time"]) == (job["pid"], job["pid_start_time"]), (
        "the reset stopped the pipeline's running extraction"
    )
    stop = run.result("gpu_processes")
    assert stop["stopped"] == [] and stop["changed"] is False
    reason = (
        f"this pipeline's running extraction {name} (pid {job['pid']}) of another run (output directory "
        f"{tmp_path / 'run-a' / 'data'}, not this run's): never stopped by the reset "
        "(gpu_reset_spare_pipeline_jobs); it keeps its GPUs"
    )
    assert {(r["pid"], r["reason"]) for r in stop["left"]} == {(job["pid"], reason), (job["supervisor_pid"], reason)}
    summary = "\n".join(run.summary())
    assert (
        f"spared this pipeline's running extraction {name} (pid {job['pid']}) of another run (output directory "
        f"{tmp_path / 'run-a' / 'data'}, not this run's): never signalled, it keeps what it holds"
    ) in summary, summary
    (reported,) = [j for j in read_report(report_dir)["pipeline_jobs"] if j["pid"] == job["pid"]]
    assert reported["this_run"] is False and reported["name"] == name
    assert reported["holder_pids"] == sorted([job["pid"], job["supervisor_pid"]])
