"""The extraction's HTTP client against a real local HTTP server (stdlib, in a thread).

The server answers from a script of (status, JSON body) per request and records what it got,
so retries, refusals and headers are seen on the wire.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from eagle3_pipeline.server_client import EngineClient, EngineError, ServerTimeout, ServerUnreachable, engine_facts

OK = {"text": "", "output_ids": [7], "meta_info": {"prompt_tokens": 3, "cached_tokens": 0}}


class ScriptedServer:
    """A real HTTP/1.1 server on 127.0.0.1 answering each request with the next scripted reply."""

    def __init__(self, replies, delay_s: float = 0.0):
        self.replies = list(replies)
        self.delay_s = delay_s  # before each answer: a server far slower than the client's timeout
        self.requests = []  # (method, path, headers, parsed body)
        self.peers = []  # the client's (host, port) of each request: one per connection
        owner = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive, as SGLang's uvicorn

            def log_message(self, *args):
                pass

            def _reply(self):
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length) if length else b""
                owner.requests.append((self.command, self.path, dict(self.headers), json.loads(raw) if raw else None))
                owner.peers.append(self.client_address)
                time.sleep(owner.delay_s)
                status, body = owner.replies.pop(0) if owner.replies else (200, OK)
                data = json.dumps(body).encode() if not isinstance(body, bytes) else body
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = _reply  # noqa: N815 - http.server's naming

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(5)


@pytest.fixture
def serve():
    started = []

    def start(*replies, delay_s: float = 0.0):
        server = ScriptedServer(replies, delay_s)
        started.append(server)
        return server

    yield start
    for server in started:
        server.close()


def free_port() -> int:
    """A port nothing listens on (bound, then released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_transient_503s_are_retried_with_backoff_until_the_answer(serve):
    server = serve((503, {"error": {"message": "overloaded"}}), (503, {"error": {"message": "overloaded"}}), (200, OK))
    client = EngineClient(server.url, retries=3, backoff_s=0.05)

    started = time.monotonic()
    answer = client.generate([1, 2, 3], "rid-1", 0)

    assert answer == OK
    assert client.retried == 2
    assert len(server.requests) == 3
    assert time.monotonic() - started >= 0.05 + 0.1, "backoff doubles: 0.05 s, then 0.1 s"
    assert all(request[3]["rid"] == "rid-1" for request in server.requests), "the same request, resent"


def test_a_server_that_stays_overloaded_is_unreachable_after_the_retries_with_the_last_error(serve):
    server = serve(*[(503, {"error": {"message": "overloaded"}})] * 3)
    client = EngineClient(server.url, retries=2, backoff_s=0.01)

    with pytest.raises(ServerUnreachable) as caught:
        client.call("GET", "/server_info")

    message = str(caught.value)
    assert f"{server.url}/server_info: no answer after 3 attempts" in message
    assert "last: HTTP 503: overloaded" in message
    assert "samples already stored are kept" in message
    assert client.retried == 2


def test_a_request_without_an_answer_in_time_is_not_sent_again_and_stops_the_run(serve):
    """On a slow CPU host the regeneration's requests timed out and were resent with the same request id: the
    server, still working on them, refused each as a duplicate and 159 of 197 conversations were skipped. A
    request that went out whole and got no answer is now a fatal, named timeout; it is never sent twice."""
    server = serve(delay_s=1.0)
    client = EngineClient(server.url, timeout_s=0.3, retries=3, backoff_s=0.01)

    with pytest.raises(ServerTimeout) as caught:
        client.generate([1, 2, 3], "rid-slow", 0)

    message = str(caught.value)
    assert f"{server.url}/generate: no answer within 0.3 s" in message
    assert "not sent again" in message and "raise the request timeout or lower the concurrency" in message
    assert isinstance(caught.value, ServerUnreachable)  # the jobs stop on it and keep what is done
    time.sleep(1.2)  # whatever the server still had in hand has arrived by now
    assert [request[3]["rid"] for request in server.requests] == ["rid-slow"]
    assert client.retried == 0
    # A GET asks nothing of the engine: asked again, then unreachable after the retries.
    with pytest.raises(ServerUnreachable, match="no answer after 4 attempts .*no answer within 0.3 s"):
        client.call("GET", "/server_info")


def test_401_stops_at_once_naming_the_api_key(serve):
    server = serve((401, {"error": "Unauthorized"}))
    client = EngineClient(server.url, api_key="wrong", retries=5, backoff_s=5.0)

    started = time.monotonic()
    with pytest.raises(ServerUnreachable) as caught:
        client.server_info()

    assert time.monotonic() - started < client.backoff_s, "no retries for a refused key (a retry first sleeps 5 s)"
    assert len(server.requests) == 1
    message = str(caught.value)
    assert "401 Unauthorized" in message and "API key" in message
    assert "sglang_server_api_key" in message and "--api-key-env" in message
    assert "wrong" not in message, "the key itself is never printed"


def test_400_is_the_requests_own_fault_with_the_servers_message(serve):
    server = serve((400, {"error": {"message": "input_ids[3] = 9999 is out of the vocabulary [0, 4096)"}}))
    client = EngineClient(server.url, retries=5, backoff_s=5.0)

    with pytest.raises(EngineError) as caught:
        client.generate([1, 2, 3, 9999], "rid-2", 0)

    assert caught.value.status == 400
    assert str(caught.value) == "HTTP 400: input_ids[3] = 9999 is out of the vocabulary [0, 4096)"
    assert len(server.requests) == 1, "not retried"


def test_an_error_body_without_a_message_is_shown_as_it_came(serve):
    server = serve((422, {"detail": [{"loc": ["body"], "msg": "field required"}]}), (404, b"no such route"))
    client = EngineClient(server.url, retries=0)

    with pytest.raises(EngineError, match="field required") as caught:
        client.call("POST", "/generate", {})
    assert caught.value.status == 422
    with pytest.raises(EngineError, match="HTTP 404: no such route"):
        client.call("GET", "/nowhere")


def test_nothing_listening_is_unreachable_quickly_naming_the_url():
    port = free_port()
    # A refused connection fails at once: three attempts and 0.03 s of backoff, far within the timeout a
    # client waiting on a silent server would spend on the first attempt alone.
    client = EngineClient(f"http://127.0.0.1:{port}", retries=2, backoff_s=0.01, timeout_s=30.0)

    started = time.monotonic()
    with pytest.raises(ServerUnreachable) as caught:
        client.server_info()

    assert time.monotonic() - started < client.timeout_s
    message = str(caught.value)
    assert f"http://127.0.0.1:{port}/server_info: no answer after 3 attempts" in message
    assert "ConnectionRefusedError" in message
    assert "check that the server runs" in message
    assert client.retried == 2


def test_the_api_key_goes_in_a_bearer_header_on_every_request(serve):
    server = serve()
    client = EngineClient(server.url, api_key="sekrit-7", retries=0)

    client.server_info()
    client.generate([1, 2, 3], "rid-3", 1)

    assert [request[2].get("Authorization") for request in server.requests] == ["Bearer sekrit-7"] * 2
    anonymous = EngineClient(server.url, retries=0)
    anonymous.server_info()
    assert "Authorization" not in server.requests[-1][2]


def test_generate_asks_for_one_greedy_token_and_the_input_top1_from_the_start(serve):
    server = serve()
    client = EngineClient(server.url.removeprefix("http://"), retries=0)  # HOST:PORT alone is fine

    client.generate([4, 5, 6], "e3x-0-abc-0", 2)

    method, path, headers, body = server.requests[0]
    assert (method, path) == ("POST", "/generate")
    assert headers["Content-Type"] == "application/json"
    assert body == {
        "input_ids": [4, 5, 6], "rid": "e3x-0-abc-0",
        "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
        "return_logprob": True, "logprob_start_len": 2, "top_logprobs_num": 1,
    }


def test_a_generate_answer_without_meta_info_is_an_engine_error(serve):
    server = serve((200, {"text": "hi"}))
    with pytest.raises(EngineError, match="unexpected /generate answer"):
        EngineClient(server.url, retries=0).generate([1], "rid-4", 0)


def test_server_info_falls_back_to_the_deprecated_route(serve):
    server = serve((404, {"detail": "Not Found"}), (200, {"engine": "reference"}))

    assert EngineClient(server.url, retries=0).server_info() == {"engine": "reference"}
    assert [request[1] for request in server.requests] == ["/server_info", "/get_server_info"]


def test_one_connection_is_kept_alive_per_thread(serve):
    server = serve()
    client = EngineClient(server.url, retries=0)

    for _ in range(3):
        client.server_info()
    other = threading.Thread(target=client.server_info)
    other.start()
    other.join()
    client.server_info()

    first, *_ = server.peers
    assert server.peers[:3] == [first] * 3
    assert server.peers[3] != first, "another thread, another connection"
    assert server.peers[4] == first
    assert client.retried == 0


def test_a_bad_url_is_refused():
    with pytest.raises(ValueError, match="expected http://HOST:PORT"):
        EngineClient("ftp://host:1")


def test_engine_facts_of_the_reference_engine_and_of_sglang_with_the_capture_hook():
    reference = engine_facts({
        "engine": "reference", "version": "0.1.0", "model_path": "/m", "aux_layers": [0, 1, 2],
        "capture_dir": "/dev/shm/c", "dtype": "float32",
    })
    assert (reference.engine, reference.aux_layers, reference.capture_dir, reference.engine_layer_ids) == (
        "reference", [0, 1, 2], "/dev/shm/c", None)
    with pytest.raises(ValueError, match="without --capture-dir"):
        engine_facts({"engine": "reference", "model_path": "/m", "aux_layers": [0], "capture_dir": None})

    sglang = engine_facts({
        "version": "0.5.23", "model_path": "/kimi", "enable_return_aux_hidden_states": True,
        "return_aux_hidden_state_layer_ids": [2, 30, 57], "dtype": "bfloat16",
        "forward_hooks": [{"name": "other", "config": {}},
                          {"name": "capture", "config": {"capture_dir": "/dev/shm/k", "aux_layer_ids": [2, 30, 57]}}],
    })
    assert (sglang.engine, sglang.version, sglang.aux_layers, sglang.engine_layer_ids, sglang.capture_dir) == (
        "sglang", "0.5.23", [2, 30, 57], [2, 30, 57], "/dev/shm/k")
    with pytest.raises(ValueError, match="capture hook"):
        engine_facts({"model_path": "/kimi", "enable_return_aux_hidden_states": True, "forward_hooks": []})
