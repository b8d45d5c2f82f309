"""The extraction's HTTP client for an SGLang-compatible engine (SGLang or the reference engine).

One keep-alive connection per thread (``http.client``, no dependencies). Transient failures
(connection refused or reset, timeouts, HTTP 429/5xx) are retried with exponential backoff;
when the server stays unreachable through every retry, ``ServerUnreachable`` stops the whole
job with the URL and what to check. A 4xx answer is the request's own fault: ``EngineError``
with the server's message, which fails that sample only.

``engine_facts`` reads what the extraction needs from ``/server_info``: which engine and
version, the model path, the captured layers and the capture directory (the reference engine
reports them directly; SGLang through this project's capture hook in ``forward_hooks``).
"""

from __future__ import annotations

import http.client
import json
import threading
import time
from dataclasses import dataclass
from urllib.parse import urlsplit

TRANSIENT_STATUS = {408, 429, 500, 502, 503, 504}


class ServerUnreachable(RuntimeError):
    """The server did not answer through every retry; the message says where and what to check."""


class ServerTimeout(ServerUnreachable):
    """A request was sent and no answer came within the timeout: the server may still be working on it, so it
    is not sent again (the same request id would be refused as a duplicate, a new one would double the load)."""


class _AnswerTimeout(Exception):
    """The request went out whole; the answer did not come in time."""


class EngineError(RuntimeError):
    """The server refused one request (4xx); the message is the server's."""

    def __init__(self, status: int, message: str):
        super().__init__(f"HTTP {status}: {message}")
        self.status = status


@dataclass(frozen=True)
class EngineFacts:
    """What the running server says about itself that shapes the data."""

    engine: str  # "reference" or "sglang"
    version: str
    model_path: str
    aux_layers: list[int]  # this project's convention: output of decoder layer i (HF hidden_states[i + 1])
    engine_layer_ids: list[int] | None  # the engine's own numbering, when it differs
    capture_dir: str | None
    dtype: str | None


def _error_message(body) -> str:
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict):
            return str(error.get("message", error))
        if error is not None:
            return str(error)
        return json.dumps(body)[:500]
    return str(body)[:500]


class EngineClient:
    """Blocking JSON calls to one server, safe to share between threads."""

    def __init__(self, url: str, api_key: str | None = None, timeout_s: float = 600.0, retries: int = 5,
                 backoff_s: float = 1.0, max_backoff_s: float = 30.0):
        parts = urlsplit(url if "://" in url else f"http://{url}")
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"server URL {url!r}: expected http://HOST:PORT")
        self.url = f"{parts.scheme}://{parts.hostname}:{parts.port or (443 if parts.scheme == 'https' else 80)}"
        self._scheme, self._host = parts.scheme, parts.hostname
        self._port = parts.port or (443 if parts.scheme == "https" else 80)
        self.api_key = api_key
        self.timeout_s = timeout_s
        self.retries = retries
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self._local = threading.local()
        self._count_lock = threading.Lock()
        self.retried = 0  # transient failures retried, over all threads (for the report)

    def _connection(self) -> http.client.HTTPConnection:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            factory = http.client.HTTPSConnection if self._scheme == "https" else http.client.HTTPConnection
            conn = factory(self._host, self._port, timeout=self.timeout_s)
            self._local.conn = conn
        return conn

    def _drop_connection(self) -> None:
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            conn.close()
            self._local.conn = None
        self._local.used = False

    def _once(self, method: str, path: str, body: dict | None) -> tuple[int, object]:
        headers = {"Content-Type": "application/json", "Accept": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        data = None if body is None else json.dumps(body, separators=(",", ":")).encode()
        conn = self._connection()
        try:
            conn.request(method, path, body=data, headers=headers)
            try:
                response = conn.getresponse()
                raw = response.read()
            except TimeoutError as exc:
                raise _AnswerTimeout from exc
        except BaseException:
            self._drop_connection()
            raise
        if response.getheader("Connection", "").lower() == "close":
            self._drop_connection()
        try:
            return response.status, json.loads(raw) if raw else None
        except ValueError:
            return response.status, raw.decode("utf-8", "replace")

    def call(self, method: str, path: str, body: dict | None = None) -> object:
        """One JSON call with retries; the parsed answer of a 2xx."""
        last = ""
        attempt = 0
        while attempt <= self.retries:
            if attempt:
                with self._count_lock:
                    self.retried += 1
                time.sleep(min(self.max_backoff_s, self.backoff_s * 2 ** (attempt - 1)))
            reused = getattr(self._local, "conn", None) is not None and getattr(self._local, "used", False)
            try:
                status, answer = self._once(method, path, body)
            except _AnswerTimeout:
                if method == "GET":  # asks nothing of the server's engine: asking again costs nothing
                    last, attempt = f"no answer within {self.timeout_s:g} s", attempt + 1
                    continue
                raise ServerTimeout(
                    f"{self.url}{path}: no answer within {self.timeout_s:g} s; the server may still be working on "
                    "the request, so it is not sent again: the server is overloaded, stuck or far slower than "
                    "expected. Check its log and load, then raise the request timeout or lower the concurrency, and "
                    "rerun: what is done is kept") from None
            except (TimeoutError, http.client.HTTPException, OSError) as exc:
                last = f"{type(exc).__name__}: {exc}"
                # A kept-alive connection the server has since closed: reconnect at once, no backoff.
                if not (reused and isinstance(exc, (http.client.RemoteDisconnected, BrokenPipeError,
                                                    ConnectionResetError))):
                    attempt += 1
                continue
            self._local.used = True
            attempt += 1
            if 200 <= status < 300:
                return answer
            if status in TRANSIENT_STATUS:
                last = f"HTTP {status}: {_error_message(answer)}"
                continue
            if status == 401:
                raise ServerUnreachable(
                    f"{self.url}{path}: 401 Unauthorized: the server wants an API key; give the one it was "
                    "started with (sglang_server_api_key, or --api-key-env NAME)"
                )
            raise EngineError(status, _error_message(answer))
        raise ServerUnreachable(
            f"{self.url}{path}: no answer after {self.retries + 1} attempts over the backoff (last: {last}); "
            "check that the server runs (its log), that host and port are right, and rerun: "
            "samples already stored are kept"
        )

    def server_info(self) -> dict:
        """``/server_info`` (or the deprecated ``/get_server_info``)."""
        try:
            return self.call("GET", "/server_info")
        except EngineError as exc:
            if exc.status != 404:
                raise
            return self.call("GET", "/get_server_info")

    def generate(self, input_ids: list[int], rid: str, logprob_start_len: int) -> dict:
        """Prefill ``input_ids`` with one greedy output token and top-1 logprobs from ``logprob_start_len``."""
        body = {
            "input_ids": input_ids,
            "rid": rid,
            "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
            "return_logprob": True,
            "logprob_start_len": logprob_start_len,
            "top_logprobs_num": 1,
        }
        answer = self.call("POST", "/generate", body)
        if not isinstance(answer, dict) or not isinstance(answer.get("meta_info"), dict):
            raise EngineError(200, f"unexpected /generate answer: {str(answer)[:300]}")
        return answer


def engine_facts(info: dict) -> EngineFacts:
    """What ``/server_info`` says about the capture; a clear error when the server does not capture."""
    if info.get("engine") == "reference":
        if not info.get("capture_dir"):
            raise ValueError("the reference server runs without --capture-dir: it captures nothing; "
                             "restart it with a capture directory (sglang_server_capture_dir)")
        return EngineFacts("reference", str(info.get("version", "?")), str(info["model_path"]),
                           [int(i) for i in info["aux_layers"]], None, str(info["capture_dir"]), info.get("dtype"))
    hooks = [hook for hook in info.get("forward_hooks") or [] if isinstance(hook, dict)]
    ours = next((hook for hook in hooks if "capture_dir" in (hook.get("config") or {})), None)
    if ours is None or not info.get("enable_return_aux_hidden_states"):
        raise ValueError(
            "the server was not started with this project's capture hook (no forward_hooks entry with a "
            "capture_dir, or enable_return_aux_hidden_states off): start it with the sglang_server role"
        )
    config = ours["config"]
    return EngineFacts(
        "sglang", str(info.get("version", "?")), str(info.get("model_path")),
        [int(i) for i in config["aux_layer_ids"]],
        [int(i) for i in config.get("sglang_layer_ids") or info.get("return_aux_hidden_state_layer_ids") or []],
        str(config["capture_dir"]), info.get("dtype"),
    )
