"""The process supervisor, with real processes: start, no-op restart, config change, stop, exit codes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

CLI = [sys.executable, "-m", "eagle3_pipeline.cli", "supervise"]

# A server that starts a child of its own (as SGLang's launcher does) and prints an env var.
SERVER = (
    "import os, subprocess, sys, time\n"
    "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
    "open(sys.argv[1], 'w').write(str(child.pid))\n"
    "print('key=' + os.environ.get('E3P_TEST_KEY', '-'), flush=True)\n"
    "time.sleep(120)\n"
)


def supervise(state_dir: Path, *args: str) -> dict:
    done = subprocess.run([*CLI, "--name", "srv", "--state-dir", str(state_dir), *args],
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False


def wait_for(predicate, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError("condition not reached in time")


@pytest.fixture
def state_dir(tmp_path):
    path = tmp_path / "state"
    yield path
    state = path / "srv.json"
    if state.exists():
        subprocess.run([*CLI, "--name", "srv", "--state-dir", str(path), "--grace-s", "1", "stop"],
                       capture_output=True, timeout=60, check=False)


def test_start_is_idempotent_and_stop_takes_the_whole_group(state_dir, tmp_path):
    child_file = tmp_path / "child.pid"
    argv = ["start", "--", sys.executable, "-c", SERVER, str(child_file)]
    first = supervise(state_dir, *argv)
    assert first["changed"] is True and first["running"] is True
    wait_for(lambda: child_file.exists() and child_file.read_text().strip())  # written when closed
    child = int(child_file.read_text())
    second = supervise(state_dir, *argv)
    assert second["changed"] is False
    assert second["pid"] == first["pid"]

    stopped = supervise(state_dir, "--grace-s", "5", "stop")
    assert stopped["changed"] is True and stopped["signal"] == "SIGTERM"
    assert not running(first["pid"])
    assert not running(child), "the server's child outlived the stop"
    assert not running(first["supervisor_pid"])
    status = supervise(state_dir, "status")
    assert status["running"] is False and status["exit_code"] == -15
    assert supervise(state_dir, "stop")["changed"] is False


def test_a_changed_configuration_replaces_the_server(state_dir, tmp_path):
    first = supervise(state_dir, "start", "--", sys.executable, "-c", "import time; time.sleep(120)")
    second = supervise(state_dir, "start", "--", sys.executable, "-c", "import time; time.sleep(121)")
    assert second["changed"] is True
    assert second["pid"] != first["pid"]
    assert not running(first["pid"])
    assert running(second["pid"])


def test_env_file_reaches_the_server_and_must_be_private(state_dir, tmp_path):
    env = tmp_path / "server.env"
    env.write_text("# comment\nE3P_TEST_KEY=s3cret\n")
    os.chmod(env, 0o644)
    child_file = tmp_path / "child.pid"
    done = subprocess.run([*CLI, "--name", "srv", "--state-dir", str(state_dir), "--env-file", str(env), "start", "--",
                           sys.executable, "-c", SERVER, str(child_file)], capture_output=True, text=True, check=False)
    assert done.returncode != 0 and "chmod 600" in done.stderr
    os.chmod(env, 0o600)
    result = supervise(state_dir, "--env-file", str(env), "start", "--", sys.executable, "-c", SERVER, str(child_file))
    assert result["env_keys"] == ["E3P_TEST_KEY"]
    assert "s3cret" not in json.dumps(result)
    log = Path(result["log_file"])
    wait_for(lambda: "key=s3cret" in log.read_text())


def test_exit_code_is_recorded_in_the_log_and_state(state_dir):
    result = supervise(state_dir, "start", "--", sys.executable, "-c", "import sys; print('boom'); sys.exit(3)")
    wait_for(lambda: supervise(state_dir, "status")["exit_code"] == 3)
    log = Path(result["log_file"]).read_text()
    assert "boom" in log and "exited with 3" in log


def test_a_missing_program_is_reported(state_dir):
    supervise(state_dir, "start", "--", "/nonexistent/e3p-server")
    wait_for(lambda: supervise(state_dir, "status")["exit_code"] == 127)
    assert "cannot execute /nonexistent/e3p-server" in (state_dir / "srv.log").read_text()


def test_dry_run_reports_what_start_would_do_and_starts_nothing(state_dir):
    argv = ["start", "--", sys.executable, "-c", "import time; time.sleep(120)"]
    would = supervise(state_dir, "--dry-run", *argv)
    assert would["changed"] is True and would["would"] == "start" and would["running"] is False
    assert not (state_dir / "srv.json").exists()
    started = supervise(state_dir, *argv)
    assert supervise(state_dir, "--dry-run", *argv)["changed"] is False
    changed = supervise(state_dir, "--dry-run", "start", "--", sys.executable, "-c", "import time; time.sleep(9)")
    assert changed["would"] == "restart"
    assert supervise(state_dir, "status")["pid"] == started["pid"]
