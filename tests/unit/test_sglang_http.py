"""module_utils/sglang_http and the sglang_server_info module over real HTTP: readiness, live settings, probe.

The server here is a small stdlib HTTP server whose behaviour each test sets (a healthy
engine, one still loading, one that forgot the capture, one that served from cache); the
reference engine itself is exercised through the role in the Molecule scenario. The module runs
in-process, one call at a time, as its action plugin calls it (the loop itself: tests/integration).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import sglang_server_info as module
import torch
from ansible.module_utils.sglang_http import (
    ServerError,
    last_log_line,
    probe,
    safetensors_shapes,
    server_info_mismatches,
    unit_stopped,
    wait_health,
    wait_ready,
)
from module_runs import POLL_S, run_module

from eagle3_pipeline.capture.writer import write_capture, write_incomplete

HIDDEN, AUX = 8, [0, 1]


class Engine:
    """What the test server does: capture (good, none, incomplete) and cached tokens."""

    def __init__(self, capture_dir):
        self.capture_dir = capture_dir
        self.mode = "good"
        self.cached = 0
        self.healthy = True


@pytest.fixture
def server(tmp_path):
    engine = Engine(tmp_path / "capture")

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def reply(self, status, body):
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            if self.path == "/health":
                self.reply(200, {}) if engine.healthy else self.reply(503, {"error": "loading"})
            elif self.path == "/server_info":
                self.reply(200, {"disable_radix_cache": True, "chunked_prefill_size": 8192})
            else:
                self.reply(404, {"error": "no such path"})

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            ids, rid = body["input_ids"], body["rid"]
            t = len(ids)
            if engine.mode == "good":
                aux, last = torch.zeros(t, len(AUX) * HIDDEN), torch.zeros(t, HIDDEN)
                write_capture(engine.capture_dir, rid, aux, last, AUX, "t")
            elif engine.mode == "incomplete":
                write_incomplete(engine.capture_dir, rid, "prefix of 4 tokens came from the cache")
            self.reply(200, {"text": "x", "meta_info": {"id": rid, "prompt_tokens": t, "cached_tokens": engine.cached}})

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield engine, "http://127.0.0.1:%d" % httpd.server_address[1]
    httpd.shutdown()
    httpd.server_close()


def test_probe_checks_tokens_and_capture_shapes_then_removes_the_file(server):
    engine, url = server
    report = probe(url, str(engine.capture_dir), len(AUX), HIDDEN, list(range(5)))
    assert report["tokens"] == 5
    assert report["capture_shapes"] == {"aux_hidden_states": [5, 16], "last_hidden_states": [5, 8]}
    assert list(engine.capture_dir.iterdir()) == []


def test_probe_fails_on_cached_tokens_missing_or_incomplete_capture(server):
    engine, url = server
    engine.cached = 4
    with pytest.raises(ServerError, match="cached_tokens is 4"):
        probe(url, str(engine.capture_dir), len(AUX), HIDDEN, list(range(5)))
    engine.cached, engine.mode = 0, "incomplete"
    with pytest.raises(ServerError, match="recorded as incomplete: .*came from the cache"):
        probe(url, str(engine.capture_dir), len(AUX), HIDDEN, list(range(5)))
    engine.mode = "none"
    (engine.capture_dir).mkdir(exist_ok=True)
    with pytest.raises(ServerError, match="is the capture hook loaded"):
        probe(url, str(engine.capture_dir), len(AUX), HIDDEN, list(range(5)))


def test_probe_fails_on_wrong_widths(server):
    engine, url = server
    with pytest.raises(ServerError, match=r"aux_hidden_states has shape \[5, 16\], expected \[5, 24\]"):
        probe(url, str(engine.capture_dir), 3, HIDDEN, list(range(5)))


def test_server_info_mismatches_name_field_wanted_and_found():
    live = {"disable_radix_cache": True, "chunked_prefill_size": 8192}
    wanted = {"disable_radix_cache": True, "chunked_prefill_size": -1, "enable_return_aux_hidden_states": True}
    assert server_info_mismatches(wanted, live) == [
        ("chunked_prefill_size", -1, 8192),
        ("enable_return_aux_hidden_states", True, "absent"),
    ]


def test_wait_ready_returns_when_healthy(server):
    _, url = server
    assert wait_ready(url, 5) < 5


def test_wait_ready_fails_at_once_when_the_process_died_with_the_log_tail(tmp_path):
    log = tmp_path / "server.log"
    log.write_text("loading\nRuntimeError: CUDA out of memory\n")
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    with pytest.raises(ServerError, match="exited before it was ready(.|\n)*CUDA out of memory"):
        wait_ready("http://127.0.0.1:9", 60, pid=dead.pid, log_file=str(log))


# What `systemctl show` says of a unit (systemd 252, Debian bookworm): running, its main process
# SIGKILLed, exited with status 2, and restarted under another main process.
UNIT = "eagle3-reference-30090.service"
RUNNING = {"ActiveState": "active", "SubState": "running", "Result": "success", "MainPID": "4242",
           "ExecMainPID": "4242", "ExecMainCode": "0", "ExecMainStatus": "0"}


@pytest.mark.parametrize(
    ("state", "expected"),
    [
        (RUNNING, ""),
        ({**RUNNING, "ActiveState": "failed", "SubState": "failed", "Result": "signal", "MainPID": "0",
          "ExecMainCode": "2", "ExecMainStatus": "9"},
         f"the unit {UNIT} stopped: its main process 4242 was killed by signal 9 (SIGKILL) "
         "(ActiveState=failed, SubState=failed, Result=signal)"),
        ({**RUNNING, "ActiveState": "failed", "SubState": "failed", "Result": "exit-code", "MainPID": "0",
          "ExecMainCode": "1", "ExecMainStatus": "2"},
         f"the unit {UNIT} stopped: its main process 4242 exited with status 2 "
         "(ActiveState=failed, SubState=failed, Result=exit-code)"),
        ({**RUNNING, "MainPID": "5151", "ExecMainPID": "5151"},
         f"the unit {UNIT} runs another main process, 5151, not the server 4242 it started: it was restarted "
         "(ActiveState=active, SubState=running, Result=success)"),
        ({"ActiveState": "inactive", "SubState": "dead", "Result": "success", "MainPID": "0"},
         f"the unit {UNIT} stopped: its main process 4242 is not running (ActiveState=inactive, SubState=dead, "
         "Result=success)"),
    ],
    ids=["running", "killed", "exited", "restarted", "stopped"],
)
def test_the_units_state_says_whether_it_runs_the_server_and_how_its_process_ended(state, expected):
    assert unit_stopped(UNIT, state, pid=4242) == expected


def test_a_unit_that_runs_nothing_fails_the_wait_at_once_naming_it():
    # Under systemd the unit does not exist (inactive); elsewhere systemctl cannot say (this machine's PID 1
    # is not systemd; the hosts of molecule/remote, where the role's wait is shown on a killed server, are).
    started = time.monotonic()
    with pytest.raises(ServerError, match=re.escape(UNIT)):
        wait_health("http://127.0.0.1:9", 30, unit=UNIT)
    assert time.monotonic() - started < 10


def test_wait_ready_times_out_naming_the_variable(tmp_path):
    with pytest.raises(ServerError, match="sglang_server_ready_timeout_s"):
        wait_ready("http://127.0.0.1:9", 0.3, poll_s=0.05)


def test_safetensors_shapes_reads_the_header_only(tmp_path):
    path = write_capture(tmp_path, "r1", torch.ones(3, 16), torch.ones(3, 8), AUX, "t")
    assert safetensors_shapes(path) == {"aux_hidden_states": [3, 16], "last_hidden_states": [3, 8]}


def test_wait_health_returns_not_ready_after_wait_s_with_the_last_answer(server):
    engine, url = server
    engine.healthy = False

    ready, seconds, last = wait_health(url, 0.3, poll_s=0.05)

    assert ready is False and 0.3 <= seconds < 0.3 + POLL_S
    assert last.startswith("HTTP 503")
    engine.healthy = True
    assert wait_health(url, 30)[0] is True


def test_last_log_line_is_the_last_line_written_cut_to_its_width(tmp_path):
    log = tmp_path / "server.log"
    log.write_text("start\nLoading safetensors checkpoint shards:  50% | 1/2\rLoading safetensors checkpoint "
                   "shards: 100% | 2/2\n\n" + "")
    assert last_log_line(str(log)) == "Loading safetensors checkpoint shards: 100% | 2/2"
    log.write_text("x" * 500 + "\n")
    assert len(last_log_line(str(log))) == 160
    assert last_log_line(str(tmp_path / "none.log")) == "" and last_log_line(None) == ""


def test_the_module_reports_a_loading_server_as_not_finished_with_the_logs_last_line(server, tmp_path, capsys):
    engine, url = server
    engine.healthy = False
    log = tmp_path / "server.log"
    log.write_text("Loading weights\nLoading safetensors checkpoint shards: 3/64\n")

    code, result = run_module(module, {"url": url, "wait_s": 0.3, "poll_s": 0.05, "waited_s": 40,
                                       "log_file": str(log), "ready_timeout_s": 1800}, capsys)

    assert code == 0, result
    assert result["finished"] is False and result["ready"] is False
    assert 40.3 <= result["waited_s"] < 40.3 + POLL_S
    assert result["msg"] == ("waiting for the server at %s, 40 s of at most 1800 (last answer HTTP 503: "
                             "{'error': 'loading'}); log: Loading safetensors checkpoint shards: 3/64" % url)


def test_the_module_verifies_a_ready_server_counting_the_earlier_calls_wait(server, capsys):
    _, url = server

    code, result = run_module(module, {"url": url + "/", "waited_s": 12.5, "expect": {"disable_radix_cache": True}},
                              capsys)

    assert code == 0, result
    assert result["finished"] is True and result["ready"] is True
    assert 12.5 <= result["seconds_to_ready"] < 12.5 + POLL_S
    assert result["server_info"]["chunked_prefill_size"] == 8192
    assert result["msg"].startswith("the server at %s answered after 12.5" % url)
    assert result["msg"].endswith("; live settings verified: disable_radix_cache")


def test_the_module_fails_on_live_settings_that_differ(server, capsys):
    _, url = server

    code, result = run_module(module, {"url": url, "expect": {"chunked_prefill_size": -1}}, capsys)

    assert code == 1 and "chunked_prefill_size: wanted -1, found 8192" in result["msg"]
    assert result["ready"] is True and result["finished"] is False


def test_the_module_fails_once_the_earlier_calls_used_up_the_ready_timeout(server, tmp_path, capsys):
    engine, url = server
    engine.healthy = False
    log = tmp_path / "server.log"
    log.write_text("Loading weights\n")

    code, result = run_module(module, {"url": url, "wait_s": 30, "waited_s": 600, "ready_timeout_s": 600,
                                       "log_file": str(log)}, capsys)

    assert code == 1 and result["waited_s"] < 600 + POLL_S, "no time was left: the first look is the last"
    assert "/health did not answer 200 within 600 s (last: HTTP 503" in result["msg"]
    assert "sglang_server_ready_timeout_s" in result["msg"] and "Loading weights" in result["msg"]


def test_the_module_fails_at_once_when_the_server_process_died(tmp_path, capsys):
    log = tmp_path / "server.log"
    log.write_text("loading\nRuntimeError: CUDA out of memory\n")
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()

    code, result = run_module(module, {"url": "http://127.0.0.1:9", "wait_s": 30, "pid": dead.pid,
                                       "log_file": str(log)}, capsys)

    assert code == 1 and result["waited_s"] < POLL_S
    assert "exited before it was ready" in result["msg"] and "CUDA out of memory" in result["msg"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ({"wait_s": -1}, "wait_s must be between 0 and 3600"),
        ({"poll_s": 0}, "poll_s must be > 0"),
        ({"waited_s": -1}, "waited_s must be >= 0"),
        ({"ready_timeout_s": -1}, "ready_timeout_s must be >= 0"),
        ({"probe_input_ids": [1, 2], "num_aux": 3}, "probe_input_ids needs capture_dir, hidden_size"),
    ],
)
def test_the_module_refuses_bad_options_naming_them(capsys, args, message):
    code, result = run_module(module, {"url": "http://127.0.0.1:9", **args}, capsys)

    assert code == 1 and message in result["msg"]
