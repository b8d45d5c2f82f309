"""The long waits as the controller sees them: many short calls, a progress line after each, no FAILED - RETRYING.

Each test runs a playbook through ansible-runner (as the project's Python API does), in the
background, and watches its events as they come: the roles' own wait tasks on a real job under
the real supervisor (a stand-in for the extraction and the training, which the test lets finish or
die only once the controller has printed several progress lines: proof that it heard from the host
during the wait, with no timing assumed), ``sglang_server_info`` against a real HTTP server that
the test makes ready (or kills) only after the controller printed its waiting lines, and the
evaluation's measurement run asynchronously (``ASYNC POLL``/``ASYNC OK`` events), failing with
the command's own error line or, past its timeout, saying so.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import ansible_runner
import pytest

from eagle3_pipeline.cli import runner_path
from eagle3_pipeline.runner import simplify_event

ROOT = Path(__file__).resolve().parents[2]
CLI = [sys.executable, "-m", "eagle3_pipeline.cli"]
# Generous bounds on waits that end by an event, not by a clock: only a hung run reaches them.
RUN_TIMEOUT_S = 300.0
PROGRESS_LINES = 3

# A stand-in job: rewrites its progress file (state running, ``done`` counting up) every 0.1 s
# until a trigger file appears in its directory: "finish" (it reports done and exits 0) or "die"
# (a last word to its log, exit 3 without a report).
JOB = r"""
import json, os, sys, time
path, document = sys.argv[1], json.loads(sys.argv[2])
triggers = os.path.dirname(os.path.abspath(sys.argv[3]))
count_key = document.pop("_count")

def write(**changes):
    document.update(changes, pid=os.getpid(), updated=time.time())
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".tmp", "w") as handle:
        json.dump(document, handle)
    os.replace(path + ".tmp", path)

document["started"] = time.time()
print("job: started", flush=True)
while True:
    if os.path.exists(os.path.join(triggers, "finish")):  # holds the exit code after done ("" for 0)
        write(state="done", **{count_key: document[count_key] + 1})
        print("job: done", flush=True)
        sys.exit(int(open(os.path.join(triggers, "finish")).read() or 0))
    if os.path.exists(os.path.join(triggers, "die")):
        print("fatal: the disk is full", file=sys.stderr, flush=True)
        sys.exit(3)
    write(state="running", **{count_key: min(document[count_key] + 1, 399)})
    time.sleep(0.1)
"""

PART = {"state": "running", "part": "0/1", "total": 400, "done": 0, "skipped": 0, "failed": 0, "tokens": 0,
        "tokens_per_s": 100.0, "eta_s": 60.0, "message": "", "_count": "done"}
TRAINING = {"state": "running", "step": 0, "total_steps": 400, "epoch": 0, "loss": 3.5, "acc_k": [0.1, 0.05],
            "acceptance_length": 1.1, "tokens_per_s": 100.0, "elapsed_s": 1.0, "eta_s": 60.0, "message": "",
            "_count": "step"}


class BackgroundRun:
    """One playbook run through ansible-runner in a thread; its events as they come, and the end."""

    def __init__(self, private_dir: Path, playbook: str, inventory: Path, extravars: dict | None = None):
        (private_dir / "project").mkdir(parents=True, exist_ok=True)
        path = private_dir / "project" / "play.yml"
        path.write_text(playbook)
        self.events: list[dict] = []
        self.lock = threading.Lock()
        self.thread, self.runner = ansible_runner.run_async(
            private_data_dir=str(private_dir), playbook=str(path), inventory=str(inventory),
            extravars=extravars or {}, quiet=True, event_handler=self._keep,
            envvars={"ANSIBLE_CONFIG": str(ROOT / "ansible.cfg"), "PATH": runner_path(), "ANSIBLE_NOCOLOR": "1"},
        )  # fmt: skip

    def _keep(self, event: dict) -> bool:
        with self.lock:
            self.events.append(event)
        return True

    def seen(self) -> list[dict]:
        with self.lock:
            return list(self.events)

    def lines(self, prefix: str) -> list[str]:
        """The progress lines printed so far that start with ``prefix`` (after the host)."""
        found = []
        for event in self.seen():
            stdout = (event.get("stdout") or "").strip()
            if event.get("event") == "verbose" and stdout.startswith("[localhost] " + prefix):
                found.append(stdout)
        return found

    def wait_for_lines(self, prefix: str, count: int) -> list[str]:
        """Block until ``count`` progress lines were printed (the run still going), or fail naming what came."""
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while len(self.lines(prefix)) < count:
            if not self.thread.is_alive():
                pytest.fail(f"the run ended before {count} lines {prefix!r}:\n{self.stdout()}")
            if time.monotonic() > deadline:
                pytest.fail(f"no {count} lines {prefix!r} within {RUN_TIMEOUT_S} s:\n{self.stdout_so_far()}")
            time.sleep(0.05)
        return self.lines(prefix)

    def finish(self) -> str:
        """Wait for the end of the run; return its status."""
        self.thread.join(RUN_TIMEOUT_S)
        assert not self.thread.is_alive(), "the playbook did not end"
        return self.runner.status

    def stdout_so_far(self) -> str:
        return "\n".join((event.get("stdout") or "") for event in self.seen())

    def stdout(self) -> str:
        return self.runner.stdout.read()

    def results(self, task: str, kinds=("runner_on_ok", "runner_on_failed")) -> list[dict]:
        return [e["event_data"] for e in self.seen() if e.get("event") in kinds and e["event_data"].get("task") == task]


@pytest.fixture
def inventory(tmp_path) -> Path:
    path = tmp_path / "inventory.yml"
    path.write_text(json.dumps({"all": {"hosts": {"localhost": {
        "ansible_connection": "local", "ansible_python_interpreter": sys.executable}}}}))
    return path


@pytest.fixture
def state_dir(tmp_path):
    """The supervisor's state directory; every job left in it is stopped at the end."""
    path = tmp_path / "jobs"
    yield path
    for record in path.glob("*.json"):
        subprocess.run([*CLI, "supervise", "--name", record.stem, "--state-dir", str(path), "--grace-s", "1", "stop"],
                       capture_output=True, timeout=60, check=False)


def role_wait_playbook(stage: str, tmp_path: Path, state_dir: Path) -> tuple[str, str]:
    """A play running the role's own start-and-wait tasks on the stand-in job; (playbook, the lines' prefix)."""
    out = tmp_path / "out"
    triggers = tmp_path / "triggers"
    triggers.mkdir()
    if stage == "extraction":
        progress, document, prefix = out / "parts" / "part-0-of-1.progress.json", PART, "part 0/1: "
        role, tasks, variables = "extraction", "extract", {
            "extraction_output_dir": str(out), "extraction_state_dir": str(state_dir), "extraction_poll_s": 1,
            "extraction_timeout_s": 600, "__extraction_python": sys.executable, "__extraction_name": "part",
            "__extraction_log": str(state_dir / "part.log"), "__extraction_env_file": str(state_dir / "part.env"),
            "__extraction_use_key": False, "__extraction_part_index": 0, "__extraction_part_count": 1,
            "__extraction_argv": [sys.executable, "-c", JOB, str(progress), json.dumps(document),
                                  str(triggers / "any")],
        }  # fmt: skip
    else:
        progress, document, prefix = out / "progress.json", TRAINING, "step "
        role, tasks, variables = "eagle_training", "train", {
            "eagle_training_output_dir": str(out), "eagle_training_state_dir": str(state_dir),
            "eagle_training_poll_interval": 1, "eagle_training_timeout": 600, "eagle_training_environment": {},
            "__eagle_training_python": sys.executable, "__eagle_training_name": "training",
            "__eagle_training_log": str(state_dir / "training.log"),
            "__eagle_training_env_file": str(state_dir / "training.env"),
            "__eagle_training_status": {"complete": False}, "__eagle_training_node_rank": 0,
            "__eagle_training_nnodes": 1,
            "__eagle_training_argv": [sys.executable, "-c", JOB, str(progress), json.dumps(document),
                                      str(triggers / "any")],
        }  # fmt: skip
    play = [{"name": "Wait on a job with the role's own tasks", "hosts": "localhost", "gather_facts": False,
             "tasks": [{"name": "Start the job and wait for it",
                        "ansible.builtin.include_role": {"name": role, "tasks_from": tasks},
                        "vars": variables}]}]  # fmt: skip
    return json.dumps(play), prefix


@pytest.mark.parametrize("stage", ["extraction", "training"])
def test_a_roles_wait_prints_a_line_per_poll_and_no_retries_then_ends_with_the_job(stage, tmp_path, state_dir,
                                                                                    inventory):
    playbook, prefix = role_wait_playbook(stage, tmp_path, state_dir)
    run = BackgroundRun(tmp_path / "runner", playbook, inventory)

    lines = run.wait_for_lines(prefix, PROGRESS_LINES)
    # The controller printed these while the job still runs: it heard from the host during the wait.
    assert run.thread.is_alive()
    (tmp_path / "triggers" / "finish").write_text("")
    status = run.finish()

    stdout = run.stdout()
    assert status == "successful", stdout
    assert "FAILED - RETRYING" not in stdout and "FAILED" not in stdout
    assert not [e for e in run.seen() if e.get("event") == "runner_retry"]
    assert all(line in stdout for line in lines)
    (waited,) = [data for data in run.results("Wait for the part, showing its progress every extraction_poll_s seconds")
                 + run.results("Wait for the training, showing its progress every eagle_training_poll_interval "
                               "seconds")]  # fmt: skip
    assert waited["res"]["finished"] is True and waited["res"]["polls"] >= PROGRESS_LINES
    assert waited["res"]["msg"].endswith("done") or ": done in " in waited["res"]["msg"]


def test_a_training_that_exits_non_zero_after_reporting_done_is_done_with_a_warning(tmp_path, state_dir, inventory):
    playbook, prefix = role_wait_playbook("training", tmp_path, state_dir)
    run = BackgroundRun(tmp_path / "runner", playbook, inventory)

    run.wait_for_lines(prefix, 2)
    (tmp_path / "triggers" / "finish").write_text("1")
    status = run.finish()

    stdout = run.stdout()
    assert status == "successful", stdout
    (waited,) = run.results("Wait for the training, showing its progress every eagle_training_poll_interval seconds")
    assert waited["res"]["finished"] is True and waited["res"]["job"]["exit_code"] == 1
    assert "[WARNING]: the training job training exited with code 1 (it crashed) after it reported done" in stdout


@pytest.mark.parametrize("stage", ["extraction", "training"])
def test_a_job_that_dies_during_the_wait_fails_the_task_with_its_reason(stage, tmp_path, state_dir, inventory):
    playbook, prefix = role_wait_playbook(stage, tmp_path, state_dir)
    run = BackgroundRun(tmp_path / "runner", playbook, inventory)

    run.wait_for_lines(prefix, 2)
    # The extraction's wait prints a line before the job's first report too: the job dies after one.
    progress = tmp_path / "out" / ("parts/part-0-of-1.progress.json" if stage == "extraction" else "progress.json")
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while not progress.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    (tmp_path / "triggers" / "die").write_text("")
    status = run.finish()

    stdout = run.stdout()
    assert status == "failed", stdout
    assert "FAILED - RETRYING" not in stdout
    failed = [e["event_data"] for e in run.seen() if e.get("event") == "runner_on_failed"]
    assert len(failed) == 1, stdout
    message = failed[0]["res"]["msg"]
    assert "exited with code 3" in message and "fatal: the disk is full" in message, message
    assert "last progress: " in message


def test_follow_false_makes_one_call_that_reports_a_running_job(tmp_path, state_dir, inventory):
    out = tmp_path / "out"
    job = subprocess.run([*CLI, "supervise", "--name", "training", "--state-dir", str(state_dir), "--log-file",
                          str(state_dir / "training.log"), "start", "--", sys.executable, "-c", JOB,
                          str(out / "progress.json"), json.dumps(TRAINING), str(tmp_path / "any")],
                         capture_output=True, text=True, timeout=60, check=True)  # fmt: skip
    playbook = json.dumps([{"name": "One look", "hosts": "localhost", "gather_facts": False, "tasks": [
        {"name": "Look at the training", "job_progress": {
            "stage": "training",
            "output_dir": str(out), "state_dir": str(state_dir), "name": "training", "wait_s": 1, "follow": False}}]}])

    run = BackgroundRun(tmp_path / "runner", playbook, inventory)
    status = run.finish()

    assert status == "successful", run.stdout()
    (result,) = run.results("Look at the training")
    res = result["res"]
    assert res["polls"] == 1 and res["finished"] is False and res["job"]["pid"] == json.loads(job.stdout)["pid"]
    assert res["state"] in ("starting", "running")
    assert len(run.lines("")) == 1, run.stdout()


# A small HTTP server standing in for a loading SGLang: /health answers 503 ("loading") until the
# file "ready" appears beside its log, then 200; it logs a line while it loads, and on the file
# "die" it logs an error and exits 1.
SERVER = r"""
import json, os, sys, threading, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
port, directory = int(sys.argv[1]), sys.argv[2]

class Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def do_GET(self):
        ready = os.path.exists(os.path.join(directory, "ready"))
        if self.path == "/health":
            status, body = (200, {}) if ready else (503, {"error": "loading"})
        elif self.path == "/server_info" and ready:
            status, body = 200, {"disable_radix_cache": True, "chunked_prefill_size": -1}
        else:
            status, body = 404, {"error": "no such path"}
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
threading.Thread(target=server.serve_forever, daemon=True).start()
shard = 0
while not os.path.exists(os.path.join(directory, "ready")):
    if os.path.exists(os.path.join(directory, "die")):
        print("RuntimeError: CUDA out of memory while loading shard %d" % shard, flush=True)
        os._exit(1)
    shard += 1
    print("Loading safetensors checkpoint shard %d/64" % min(shard, 64), flush=True)
    time.sleep(0.2)
print("The server is fired up and ready to roll!", flush=True)
while True:
    time.sleep(1)
"""


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture
def loading_server(tmp_path):
    """A loading server process (own session); (its Popen, URL, directory, log). Killed at the end."""
    directory = tmp_path / "server"
    directory.mkdir()
    log = directory / "server.log"
    port = free_port()
    with open(log, "wb") as handle:
        popen = subprocess.Popen([sys.executable, "-c", SERVER, str(port), str(directory)], stdout=handle,
                                 stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + RUN_TIMEOUT_S  # it listens before its first line: every answer is then its own
    while not log.read_text() and popen.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    yield popen, f"http://127.0.0.1:{port}", directory, log
    if popen.poll() is None:
        os.killpg(popen.pid, signal.SIGKILL)  # not reaped yet: the group is still this server's
    popen.wait(timeout=30)


def server_wait_playbook(url: str, pid: int, log: Path) -> str:
    task = {"name": "Wait for the server", "sglang_server_info": {
        "url": url, "pid": pid, "log_file": str(log), "ready_timeout_s": 600, "wait_s": 1, "poll_s": 0.1,
        "expect": {"disable_radix_cache": True}}}  # fmt: skip
    return json.dumps([{"name": "Wait for a loading server", "hosts": "localhost", "gather_facts": False,
                        "tasks": [task]}])


def test_the_server_wait_prints_its_progress_until_the_server_is_ready(tmp_path, loading_server, inventory):
    popen, url, directory, log = loading_server
    run = BackgroundRun(tmp_path / "runner", server_wait_playbook(url, popen.pid, log), inventory)

    lines = run.wait_for_lines("waiting for the server at " + url, PROGRESS_LINES)
    assert run.thread.is_alive()
    (directory / "ready").write_text("")
    status = run.finish()

    stdout = run.stdout()
    assert status == "successful", stdout
    assert "FAILED - RETRYING" not in stdout
    assert all("(last answer HTTP 503: {'error': 'loading'})" in line for line in lines), lines
    assert any("; log: Loading safetensors checkpoint shard " in line for line in lines), lines
    (result,) = run.results("Wait for the server")
    res = result["res"]
    assert res["finished"] is True and res["ready"] is True and res["polls"] >= PROGRESS_LINES + 1
    assert res["server_info"]["disable_radix_cache"] is True
    assert res["seconds_to_ready"] > 0 and res["seconds_to_ready"] <= res["waited_s"]
    assert run.lines("the server at " + url + " answered after "), "the last call prints the verified server"


def test_a_server_that_dies_during_the_wait_fails_with_its_logs_last_lines(tmp_path, loading_server, inventory):
    popen, url, directory, log = loading_server
    run = BackgroundRun(tmp_path / "runner", server_wait_playbook(url, popen.pid, log), inventory)

    run.wait_for_lines("waiting for the server at " + url, 2)
    (directory / "die").write_text("")
    status = run.finish()

    stdout = run.stdout()
    assert status == "failed", stdout
    (result,) = run.results("Wait for the server")
    message = result["res"]["msg"]
    assert f"the server process {popen.pid} exited before it was ready" in message
    assert "RuntimeError: CUDA out of memory while loading shard" in message


def reference_measurement_playbook(argv: list[str], timeout_s: int, tmp_path: Path) -> str:
    """The evaluation role's reference measurement (reference.yml) with ``argv`` standing in for the command."""
    variables = {"__evaluation_argv": argv, "evaluation_timeout_s": timeout_s, "evaluation_poll_s": 1,
                 "evaluation_environment": {}}
    return json.dumps([{"name": "Measure", "hosts": "localhost", "gather_facts": False, "tasks": [
        {"name": "Run the measurement", "ansible.builtin.include_role": {"name": "evaluation",
                                                                         "tasks_from": "reference"},
         "vars": variables}]}])  # fmt: skip


MEASURE_TASK = "Decode the held-out prompts with the drafter and the target (the reference engine, in this host's venv)"


def test_the_measurement_runs_asynchronously_and_the_controller_polls_it(tmp_path, inventory):
    # Ends when the test says so, after the controller polled it at least twice.
    flag = tmp_path / "measured"
    argv = [sys.executable, "-c", "import os, sys, time\nwhile not os.path.exists(sys.argv[1]): time.sleep(0.1)\n"
            "print('{}')", str(flag)]
    run = BackgroundRun(tmp_path / "runner", reference_measurement_playbook(argv, 600, tmp_path), inventory)

    deadline = time.monotonic() + RUN_TIMEOUT_S
    while len([e for e in run.seen() if e.get("event") == "runner_on_async_poll"]) < 2:
        assert run.thread.is_alive(), run.stdout()
        assert time.monotonic() < deadline, run.stdout_so_far()
        time.sleep(0.05)
    flag.write_text("")
    status = run.finish()

    stdout = run.stdout()
    assert status == "successful", stdout
    assert [e for e in run.seen() if e.get("event") == "runner_on_async_ok"], "no ASYNC OK for the measurement"
    (result,) = run.results(MEASURE_TASK)
    assert result["res"]["ansible_job_id"] and result["res"]["rc"] == 0
    assert "ASYNC POLL on localhost" in stdout
    # The Python API turns each check into a progress event of the task.
    polls = [simple for event in run.seen() if event.get("event") == "runner_on_async_poll"
             and (simple := simplify_event(event))]
    assert len(polls) >= 2 and all(p["kind"] == "progress" and p["host"] == "localhost" and p["role"] == "evaluation"
                                   for p in polls), polls
    assert polls[0]["message"] == "still running on the host (asynchronous job %s)" % result["res"]["ansible_job_id"]


def test_a_measurement_that_fails_names_its_own_error(tmp_path, inventory):
    argv = [sys.executable, "-c", "import sys; print('loading', file=sys.stderr); "
            "print('evaluate: error: 3 prompts remain, evaluation_min_prompts is 4', file=sys.stderr); sys.exit(2)"]
    run = BackgroundRun(tmp_path / "runner", reference_measurement_playbook(argv, 600, tmp_path), inventory)

    assert run.finish() == "failed", run.stdout()
    failed = [e["event_data"] for e in run.seen() if e.get("event") == "runner_on_failed"]
    assert [data["task"] for data in failed] == ["Fail with the measurement's reason"]
    assert failed[0]["res"]["msg"] == (
        "localhost: eagle3-pipeline evaluate failed (exit 2): 3 prompts remain, evaluation_min_prompts is 4")


def test_a_measurement_past_its_timeout_is_stopped_and_says_so(tmp_path, inventory):
    started = tmp_path / "started"
    argv = [sys.executable, "-c", "import sys, time; open(sys.argv[1], 'w').close(); time.sleep(300)", str(started)]
    # 10 s: the host's async wrapper kills the job at the timeout, and the command must have started by then.
    run = BackgroundRun(tmp_path / "runner", reference_measurement_playbook(argv, 10, tmp_path), inventory)

    assert run.finish() == "failed", run.stdout()
    failed = [e["event_data"] for e in run.seen() if e.get("event") == "runner_on_failed"]
    assert len(failed) == 1, run.stdout()
    # The host's async wrapper ("Timeout exceeded") or the controller ("async task did not complete ...")
    # notices first; either way there is no exit code to name.
    assert failed[0]["res"]["msg"].startswith(
        "localhost: eagle3-pipeline evaluate did not finish within evaluation_timeout_s (10 s) and was stopped: "
    ), failed[0]["res"]["msg"]
    assert "exit" not in failed[0]["res"]["msg"]
    assert started.exists(), "the command did start"


def test_a_lost_connection_is_tried_again_over_ssh_with_keepalives_then_the_host_is_unreachable(tmp_path):
    # A host reached over SSH whose port takes no connection: every call of the wait fails to connect.
    # The polling plugin resets the connection and tries again (each try a line), then gives up;
    # Ansible's own ssh command line shows the keepalives and multiplexing of ansible.cfg.
    # The port stays bound, never listening, for the whole test: refused, and no other process can take it.
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    inventory = tmp_path / "inventory.yml"
    inventory.write_text(json.dumps({"all": {"hosts": {"gone": {
        "ansible_connection": "ssh", "ansible_host": "127.0.0.1", "ansible_port": closed.getsockname()[1],
        "ansible_user": "nobody", "ansible_python_interpreter": sys.executable}}}}))  # fmt: skip
    playbook = json.dumps([{"name": "Wait on a host that went away", "hosts": "gone", "gather_facts": False,
                            "tasks": [{"name": "Wait for the part", "job_progress": {
                                "stage": "extraction",
                                "output_dir": str(tmp_path / "out"), "wait_s": 1}}]}])  # fmt: skip
    (tmp_path / "runner" / "project").mkdir(parents=True)
    (tmp_path / "runner" / "project" / "play.yml").write_text(playbook)

    runner = ansible_runner.run(
        private_data_dir=str(tmp_path / "runner"), playbook="play.yml", inventory=str(inventory), quiet=True,
        verbosity=3,
        envvars={"ANSIBLE_CONFIG": str(ROOT / "ansible.cfg"), "PATH": runner_path(), "ANSIBLE_NOCOLOR": "1"},
    )  # fmt: skip
    closed.close()
    stdout = runner.stdout.read()

    assert runner.status == "failed", stdout
    assert [e["event"] for e in runner.events if e["event"].startswith("runner_on_")] == ["runner_on_start",
                                                                                       "runner_on_unreachable"]
    retries = [line for line in stdout.splitlines() if line.startswith("[gone] lost the connection (")]
    assert [line.rsplit("(", 1)[1] for line in retries] == ["retry 1 of 3)", "retry 2 of 3)", "retry 3 of 3)"]
    # Each line names Ansible's reason. ssh itself says "Connection refused"; but when ssh has quit before
    # Ansible writes the pipelined module to its stdin, Ansible waits 1 ms for it to exit, and on a loaded
    # machine it has not: then Ansible reports the failed write, without ssh's message (seen in CI).
    reasons = ("Connection refused", "Data could not be sent to remote host '127.0.0.1'. Make sure this host can be")
    assert all(any(reason in line for reason in reasons) and "; looking again in 1 s " in line for line in retries), (
        "\n".join(retries))
    commands = [line for line in stdout.splitlines() if "SSH: EXEC ssh " in line]
    assert len(commands) >= 4, stdout  # the first try and the three again
    for option in ("-C", "-o ControlMaster=auto", "-o ControlPersist=60s", "-o ServerAliveInterval=30",
                   "-o ServerAliveCountMax=4"):
        assert all(option in line for line in commands), (option, commands[0])


def test_molecule_gives_the_hosts_the_same_ssh_settings_as_ansible_cfg():
    import configparser

    import yaml

    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "ansible.cfg")
    molecule = yaml.safe_load((ROOT / ".config" / "molecule" / "config.yml").read_text())["ansible"]["cfg"]
    assert molecule["ssh_connection"]["ssh_args"] == cfg["ssh_connection"]["ssh_args"]
    assert molecule["ssh_connection"]["pipelining"] is cfg["ssh_connection"].getboolean("pipelining")
    assert molecule["defaults"]["doc_fragment_plugins"].endswith("/" + cfg["defaults"]["doc_fragment_plugins"])
