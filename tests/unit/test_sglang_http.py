"""module_utils/sglang_http over real HTTP: readiness, live-settings comparison, probe checks.

The server here is a small stdlib HTTP server whose behaviour each test sets (a healthy
engine, one that forgot the capture, one that served from cache); the reference engine itself
is exercised through the role in the Molecule scenario.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch
from ansible.module_utils.sglang_http import (
    ServerError,
    probe,
    safetensors_shapes,
    server_info_mismatches,
    wait_ready,
)

from eagle3_pipeline.capture.writer import write_capture, write_incomplete

HIDDEN, AUX = 8, [0, 1]


class Engine:
    """What the test server does: capture (good, none, incomplete) and cached tokens."""

    def __init__(self, capture_dir):
        self.capture_dir = capture_dir
        self.mode = "good"
        self.cached = 0


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
                self.reply(200, {})
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


def test_wait_ready_times_out_naming_the_variable(tmp_path):
    with pytest.raises(ServerError, match="sglang_server_ready_timeout_s"):
        wait_ready("http://127.0.0.1:9", 0.3, poll_s=0.05)


def test_safetensors_shapes_reads_the_header_only(tmp_path):
    path = write_capture(tmp_path, "r1", torch.ones(3, 16), torch.ones(3, 8), AUX, "t")
    assert safetensors_shapes(path) == {"aux_hidden_states": [3, 16], "last_hidden_states": [3, 8]}
