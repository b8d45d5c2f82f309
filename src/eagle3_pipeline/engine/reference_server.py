"""The reference engine: an HTTP server on transformers speaking the subset of SGLang's API we use.

``eagle3-pipeline serve-reference --model-path DIR [--capture-dir DIR] [--aux-layers 1,3,5]``
serves ``/health``, ``/health_generate``, ``/ready``, ``/model_info``, ``/server_info`` (and
the deprecated ``/get_model_info``, ``/get_server_info``) and ``/generate`` (POST or PUT), and
writes each request's prefill hidden states with ``capture.writer.write_capture`` to
``<capture_dir>/<rid>.safetensors`` before the HTTP response is sent: a client that has the
response can read the file. The model runs in one worker thread that prefills concurrent
requests as one right-padded batch and decodes them together, admitting requests that arrive
meanwhile into the running decode (``engine/batcher.py``); requests that need no capture and no
logprobs (serving, the regeneration) prefill and decode over a KV cache of fixed slots with CUDA
graphs (``engine/slots.py``, ``--decode slots``, the default) when the model reproduces its full
forwards there, checked at start; request checking and response shapes are in ``engine/api.py``.
Without ``--capture-dir`` it captures nothing: a server for serving (regeneration), not for
extraction.

Conventions of this engine:

- ``aux_layers`` are 0-based decoder layers whose OUTPUT is captured (HF ``hidden_states[i+1]``);
  default ``[1, L//2 - 1, L - 4]`` (the outputs of the layers SGLang's EAGLE-3 default captures
  before: ``[2, L//2, L - 3]``; for shallow models, three distinct layers within ``[0, L - 2]``).
  For Llama-class models SGLang's ``return_aux_hidden_state_layer_ids`` are the same numbers,
  which ``/server_info`` reports.
- ``last_hidden_states`` is the decoder's post-norm output (what lm_head reads).
- ``cached_tokens`` is always 0 (no prefix cache), ``chunked_prefill_size`` -1 (whole prompts).
- Greedy (temperature 0) is exact; temperature > 0 samples with ``sampling_seed`` when given.
  Logprobs are ``log_softmax`` of the raw logits (SGLang's values for greedy requests).
- Not supported (4xx naming the field): streaming, batch (list) requests, input_embeds and
  multimodal data, return_hidden_states, token_ids_logprob, sampling parameters other than
  max_new_tokens, temperature, top_p, top_k, min_new_tokens, ignore_eos, stop_token_ids,
  sampling_seed, skip_special_tokens away from their defaults.

SGLang 0.5.23 facts relied on (python/sglang/srt/...):

- ``entrypoints/http_server.py``: routes ``health_generate`` (``/health`` and
  ``/health_generate``; ``/health`` answers 200 with an empty body without generating, unless
  SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION; 503 while shutting down; ``/health_generate`` runs a
  1-token request ``input_ids=[0]``, ``max_new_tokens 1``, ``temperature 0``, rid
  ``HEALTH_CHECK_<uuid hex>``), ``model_info`` (``model_path``, ``served_model_name``,
  ``tokenizer_path``, ``is_generation``, ``preferred_sampling_params``, ``weight_version``,
  ``model_type``, ``architectures``...), ``server_info`` (``build_server_info`` in
  ``utils/common.py``: the resolved server args flattened, plus ``version``),
  ``generate_request`` (POST and PUT) and ``_create_error_response``
  (``{"error": {"message": str(e)}}``, status 400 for a ValueError).
- ``utils/auth.py``: ``decide_request_auth``: with ``--api-key`` every route needs
  ``Authorization: Bearer <key>`` (scheme case-insensitive, constant-time compare) except paths
  starting ``/health``, ``/ready``, ``/metrics``; refusal is 401 ``{"error": "Unauthorized"}``.
- ``managers/io_struct.py``: ``GenerateReqInput`` field names (``text``, ``input_ids``, ``rid``,
  ``sampling_params``, ``return_logprob``, ``logprob_start_len`` default -1 = output logprobs
  only, ``top_logprobs_num``, ``return_text_in_logprobs``, ``stream``, ``return_hidden_states``);
  ``_validate_inputs`` (neither text nor input_ids: "Either text, input_ids or input_embeds
  should be provided."); ``regenerate_rid`` (uuid4 hex when no rid).
- ``api/v1/api_types.py``: ``GenerateRequest`` ignores unknown top-level keys;
  ``SamplingParams`` rejects unknown keys (``unknown field `x`, expected one of ...``) and has
  the defaults max_new_tokens 128, temperature 1.0, top_p 1.0, top_k 1<<30, ...
- ``managers/tokenizer_manager.py``: ``_handle_batch_output`` (response ``text``,
  ``output_ids``, ``meta_info`` with ``id``, ``finish_reason``, ``prompt_tokens``,
  ``weight_version``, ``num_retractions``, ``reasoning_tokens``, ``completion_tokens``,
  ``cached_tokens``, ``e2e_latency``); ``add_logprob_to_meta_info`` /
  ``detokenize_logprob_tokens`` / ``detokenize_top_logprobs_tokens`` (entries
  ``[logprob, token_id, text-or-None]``, a position without top logprobs is ``None``,
  ``output_token_logprobs_length``); ``_validate_one_request`` (an input of >= context length
  tokens is refused, and input + max_new_tokens > context length); ``_send_one_request``
  ("Duplicate request ID detected: <rid>" for a rid already in flight).
- ``managers/scheduler.py`` (``handle_generate_request``): logprob_start_len -1 with
  return_logprob means len(prompt) (no input logprobs); larger than the prompt is refused.
- ``managers/scheduler_components/logprob_result_processor.py``
  (``_process_input_token_logprobs``, ``_process_input_top_logprobs``): input logprob lists have
  ``T - logprob_start_len`` entries, entry ``j`` is for token ``start + j``; entry 0 is
  ``None`` (``[None, id, None]``, top ``None``) and the last prompt position's logits go to the
  first output token. So, for a capture row ``p``, the engine's top-1 is
  ``input_top_logprobs[p + 1]`` for ``p < T - 1`` and ``output_top_logprobs[0]`` for ``T - 1``.
- ``managers/schedule_batch.py``: ``FINISH_LENGTH.to_json`` ``{"type": "length", "length": n}``,
  ``FINISH_MATCHED_TOKEN.to_json`` ``{"type": "stop", "matched": id}``; ``is_prefill_only``
  (max_new_tokens 0 is allowed: no output token).
- ``models/llama.py``: ``set_eagle3_layers_to_capture`` (default ``[2, L//2, L-3]`` captured
  before those layers; given ids get ``+1``, i.e. the outputs of the given layers).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import secrets
import signal
import sys
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from eagle3_pipeline import __version__
from eagle3_pipeline.atomic import atomic_write_text
from eagle3_pipeline.capture.layers import AUX_LAYER_CONVENTION
from eagle3_pipeline.cli_args import options_argv, path_str, positive_int
from eagle3_pipeline.engine.api import ModelLimits, RequestError, build_generate_response, parse_generate_request
from eagle3_pipeline.engine.batcher import ADMIT_WAIT_MS, LOG, GenerateJob, SamplingConfig, ServiceUnavailable

MAX_BODY_BYTES = 64 << 20
HEALTH_CHECK_TIMEOUT_S = 20.0
_AUTH_FREE_PREFIXES = ("/health", "/ready", "/metrics")  # as SGLang's decide_request_auth
_ROUTES = {
    "/health": ("GET",), "/health_generate": ("GET",), "/ready": ("GET",),
    "/model_info": ("GET",), "/get_model_info": ("GET",),
    "/server_info": ("GET",), "/get_server_info": ("GET",),
    "/generate": ("POST", "PUT"),
}


class EndpointState:
    """What every HTTP front of this engine keeps: the key, draining, the requests being handled, the rids in
    flight (``ReferenceEngine`` over one model, ``replicas.ReplicaFront`` over several replica processes)."""

    def __init__(self, api_key: str | None):
        self.api_key = api_key
        self.draining = threading.Event()
        self._lock = threading.Lock()
        self._inflight: set[str] = set()
        self._active = 0  # requests being handled (for the shutdown wait)
        self._idle = threading.Condition(self._lock)

    def enter(self) -> None:
        """A request handler started."""
        with self._lock:
            self._active += 1

    def leave(self) -> None:
        """A request handler finished (its response written)."""
        with self._lock:
            self._active -= 1
            self._idle.notify_all()

    def wait_idle(self, timeout_s: float) -> bool:
        """Wait until no request is being handled; False when ``timeout_s`` ran out first."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while self._active > 0:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._idle.wait(remaining)
        return True

    def authorized(self, path: str, header: str | None) -> bool:
        """SGLang's rule: with a key, every path but health/ready/metrics needs ``Bearer <key>``."""
        if self.api_key is None or path.startswith(_AUTH_FREE_PREFIXES):
            return True
        scheme, _, token = (header or "").partition(" ")
        return scheme.lower() == "bearer" and secrets.compare_digest(token.encode(), self.api_key.encode())

    def claim(self, rid: str) -> None:
        """Mark ``rid`` in flight; a rid already in flight is refused as SGLang refuses it."""
        with self._lock:
            if rid in self._inflight:
                raise RequestError(f"Duplicate request ID detected: {rid}", "rid")
            self._inflight.add(rid)

    def release(self, rid: str) -> None:
        with self._lock:
            self._inflight.discard(rid)


class ReferenceEngine(EndpointState):
    """The server's state: the model worker, the settings, the rids in flight."""

    def __init__(self, runner, worker, host: str, port: int, api_key: str | None, settings: dict):
        super().__init__(api_key)
        self.runner = runner
        self.worker = worker
        self.host = host
        self.port = port
        self.settings = settings
        self.limits = ModelLimits(runner.vocab_size, runner.context_length, runner.tokenizer)

    # -- endpoints -------------------------------------------------------------------------
    def generate(self, raw: bytes) -> tuple[int, dict]:
        """Handle one /generate body; (status, JSON body)."""
        started = time.monotonic()
        try:
            body = json.loads(raw.decode("utf-8")) if raw.strip() else None
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise RequestError(f"malformed JSON body: {exc}", None) from None
        if body is None:
            raise RequestError("the request body is empty: send a JSON object with input_ids or text", None)
        request = parse_generate_request(body, self.limits)
        self.claim(request.rid)
        try:
            future = self.worker.submit(request.job(capture=True))
            outcome = future.result()
            return 200, build_generate_response(request, outcome, self.runner.tokenizer, time.monotonic() - started)
        finally:
            self.release(request.rid)

    def health_generate(self) -> int:
        """Run a 1-token request through the model worker (SGLang's health_generate); 200 or 503."""
        if self.draining.is_set():
            return 503
        job = GenerateJob(
            rid=f"HEALTH_CHECK_{uuid.uuid4().hex}", input_ids=[0],
            sampling=SamplingConfig(max_new_tokens=1, temperature=0.0), capture=False,
        )
        try:
            self.worker.submit(job).result(timeout=HEALTH_CHECK_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - any failure means unhealthy
            LOG.error("health check failed: %s", exc)
            return 503
        return 200

    def model_info(self) -> dict:
        """SGLang's /model_info fields."""
        config = self.runner.model.config
        return {
            "model_path": self.runner.model_path,
            "served_model_name": self.runner.model_path,
            "tokenizer_path": self.runner.model_path if self.runner.tokenizer is not None else None,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": "default",
            "load_format": "auto",
            "reasoning_parser": None,
            "tool_call_parser": None,
            "disaggregation_mode": "null",
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "model_type": getattr(config, "model_type", None),
            "architectures": getattr(config, "architectures", None),
        }

    def server_info(self) -> dict:
        """The server's settings flattened as SGLang's /server_info does, true for this engine."""
        runner = self.runner
        capturing = runner.capture_dir is not None
        return {
            "model_path": runner.model_path,
            "tokenizer_path": runner.model_path if runner.tokenizer is not None else None,
            "served_model_name": runner.model_path,
            "skip_tokenizer_init": runner.tokenizer is None,
            "host": self.host,
            "port": self.port,
            "device": runner.device.type,
            "dtype": runner.dtype_name,
            "context_length": runner.context_length,
            "tp_size": 1,
            "dp_size": 1,
            "pp_size": 1,
            "disable_radix_cache": True,
            "chunked_prefill_size": -1,
            # CUDA graphs replay slot decoding only: a capture's prefill never runs in one.
            "disable_cuda_graph": not (runner.slot_decoder is not None and runner.slot_decoder.graphs_on),
            "decode": runner.decode_path,
            "speculative_algorithm": None,
            "enable_return_aux_hidden_states": capturing,
            "return_aux_hidden_state_layer_ids": list(runner.aux_layers) if capturing else None,
            "weight_version": "default",
            "version": __version__,
            "engine": "reference",
            "aux_layers": list(runner.aux_layers),
            "aux_layer_convention": AUX_LAYER_CONVENTION,
            "capture_dir": str(runner.capture_dir) if capturing else None,
            "num_hidden_layers": runner.num_layers,
            "hidden_size": runner.hidden_size,
            "vocab_size": runner.vocab_size,
            "max_batch_size": self.worker.max_batch_size,
            "continuous_batching": True,
            "batch_wait_ms": self.settings.get("batch_wait_ms"),
            "admit_wait_ms": self.settings.get("admit_wait_ms"),
            "api_key_required": self.api_key is not None,
            "requests_answered": self.worker.requests,
            "worker": self.worker.stats(),
        }


class ReferenceHandler(BaseHTTPRequestHandler):
    """HTTP/1.0, one request per connection; JSON in and out."""

    server_version = "eagle3-reference/" + __version__
    timeout = 60  # a client that connects and sends nothing does not hold a thread forever
    engine: ReferenceEngine  # set on the subclass made by make_server

    def log_message(self, format, *args):  # noqa: A002 - BaseHTTPRequestHandler's signature
        LOG.debug("%s %s", self.address_string(), format % args)

    def _send(self, status: int, body: dict | None = None) -> None:
        data = b"" if body is None else json.dumps(body).encode()
        self.send_response(status)
        if body is not None:
            self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if data:
            self.wfile.write(data)

    def _error(self, status: int, message: str, param: str | None = None) -> None:
        self._send(status, RequestError(message, param, status).body())

    def _route(self, method: str) -> None:
        engine = self.engine
        engine.enter()
        try:
            path = self.path.split("?", 1)[0]
            if not engine.authorized(path, self.headers.get("Authorization")):  # before routing, as SGLang
                self._send(401, {"error": "Unauthorized"})
                return
            if path not in _ROUTES:
                self._send(404, {"detail": "Not Found"})
                return
            if method not in _ROUTES[path]:
                self._send(405, {"detail": "Method Not Allowed"})
                return
            self._dispatch(path)
        except (BrokenPipeError, ConnectionResetError):
            LOG.info("client %s went away before its response", self.address_string())
        finally:
            engine.leave()

    def _dispatch(self, path: str) -> None:
        engine = self.engine
        if path in ("/health", "/ready"):
            self._send(503 if engine.draining.is_set() else 200)
        elif path == "/health_generate":
            self._send(engine.health_generate())
        elif path in ("/model_info", "/get_model_info"):
            self._send(200, engine.model_info())
        elif path in ("/server_info", "/get_server_info"):
            self._send(200, engine.server_info())
        else:
            self._generate()

    def _generate(self) -> None:
        try:
            length = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            self._error(400, f"Content-Length {self.headers.get('Content-Length')!r} is not a number")
            return
        if length > MAX_BODY_BYTES:
            self._error(413, f"the request body ({length} bytes) is over {MAX_BODY_BYTES} bytes")
            return
        raw = self.rfile.read(length) if length > 0 else b""
        try:
            status, body = self.engine.generate(raw)
        except RequestError as exc:
            LOG.info("refused /generate from %s: %s", self.address_string(), exc.message)
            self._send(exc.status, exc.body())
            return
        except ServiceUnavailable as exc:
            self._error(503, str(exc))
            return
        except Exception as exc:  # noqa: BLE001 - the server stays up; the client learns why
            LOG.exception("/generate failed: %s", exc)
            self._error(500, f"{type(exc).__name__}: {exc}")
            return
        self._send(status, body)

    def do_GET(self):  # noqa: N802 - http.server's naming
        """GET routes."""
        self._route("GET")

    def do_POST(self):  # noqa: N802
        """POST routes."""
        self._route("POST")

    def do_PUT(self):  # noqa: N802
        """PUT routes."""
        self._route("PUT")


class _Server(ThreadingHTTPServer):
    # The stdlib's backlog of 5 resets connections when an extraction client opens dozens at once.
    request_queue_size = 1024


def make_server(engine: ReferenceEngine, host: str, port: int) -> ThreadingHTTPServer:
    """A threading HTTP server bound to (host, port) whose handlers use ``engine``."""
    handler = type("BoundReferenceHandler", (ReferenceHandler,), {"engine": engine})
    server = _Server((host, port), handler)
    server.daemon_threads = True  # shutdown waits for handlers through engine.wait_idle instead
    engine.port = server.server_address[1]
    return server


# -- command line ------------------------------------------------------------------------------
def _layer_list(text: str) -> list[int]:
    try:
        layers = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a comma-separated list of layer indices, e.g. 1,3,5"
        ) from None
    if not layers:
        raise argparse.ArgumentTypeError("give at least one layer index, e.g. 1,3,5")
    return layers


def configure_parser(parser: argparse.ArgumentParser) -> None:
    """Options of ``eagle3-pipeline serve-reference``."""
    parser.add_argument("--model-path", type=path_str,
        required=True, help="local HF-format model directory (no downloads)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000, help="0 picks a free port (logged at start)")
    parser.add_argument("--capture-dir", type=path_str,
        default=None, help="write <rid>.safetensors captures here (none when absent)")
    parser.add_argument(
        "--aux-layers", type=_layer_list, default=None, metavar="I,J,K",
        help="0-based decoder layers whose output is captured (HF hidden_states[i+1]); "
        "default [1, L//2-1, L-4], EAGLE-3's usual choice (three distinct layers within [0, L-2] for shallow models)",
    )
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    parser.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto",
                        help="auto: bfloat16 on CUDA, float32 on CPU")
    parser.add_argument("--max-batch-size", type=int, default=8,
                        help="most requests decoding together (requests that arrive while a batch decodes join it "
                        "up to this size); the serving mode of the sglang_server role sets 64")
    parser.add_argument("--batch-wait-ms", type=float, default=5.0,
                        help="how long the worker waits for more requests to join a batch")
    parser.add_argument("--admit-wait-ms", type=float, default=ADMIT_WAIT_MS,
                        help="the longest a request that arrives while a batch decodes waits before it is prefilled "
                        "into it; sooner when its queue would fill the batch, or when the queue's waiting has cost "
                        "as much decode as the prefill will pause (a prefill pauses every decoding row)")
    parser.add_argument("--decode", choices=["slots", "transformers"], default="slots",
                        help="slots: requests that need no capture and no logprobs decode over a KV cache of fixed "
                        "slots (CUDA graphs, flash attention), when the model passes the start-up check against its "
                        "full forwards; transformers: every request on transformers' own cache")
    parser.add_argument("--slot-tokens", type=int, default=4096,
                        help="prompt + new tokens one slot holds (capped at the context length); longer requests "
                        "decode on the transformers path")
    parser.add_argument("--kv-cache-gib", type=float, default=0.0,
                        help="GiB for the slot cache (0: half the GPU memory free after loading, 2 on the CPU); "
                        "fewer slots than --max-batch-size when they do not fit")
    parser.add_argument("--no-cuda-graphs", dest="cuda_graphs", action="store_false",
                        help="replay no CUDA graphs in slot decoding")
    parser.add_argument("--no-prefill-graphs", dest="prefill_graphs", action="store_false",
                        help="prefill every prompt eagerly (by default a small model's prefills of up to a few "
                        "thousand tokens replay CUDA graphs too, padded to a power of two)")
    parser.add_argument("--api-key-env", default=None, metavar="NAME",
                        help="require 'Authorization: Bearer <key>', the key read from this environment variable")
    parser.add_argument("--log-file", type=path_str, default=None, help="also write the log to this file")
    parser.add_argument("--log-level", choices=["debug", "info", "warning", "error"], default="info",
                        help="as SGLang's: debug adds a line for each request and each batch's prefill")
    parser.add_argument("--shutdown-grace-s", type=float, default=30.0,
                        help="on SIGTERM, how long running requests may take to finish")
    parser.add_argument("--dp-size", type=positive_int, default=1,
                        help="replicas of the model, one process per GPU (replica i sees the i-th device of "
                        "CUDA_VISIBLE_DEVICES, or GPU i), behind this one address; each /generate goes to the replica "
                        "with the fewest requests in flight (SGLang's --dp-size; engine/replicas.py)")
    parser.add_argument("--replicas-per-device", type=positive_int, default=1, metavar="K",
                        help="with --dp-size N, K replicas share each GPU (replica i on the (i // K)-th device; N/K "
                        "devices), each with 1/K of the default slot cache: the CPU work of one server (capture checks "
                        "and writes) spread over K processes")
    # Set by the front for each replica it starts, never by hand.
    parser.add_argument("--replica", type=_replica_label, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--ready-file", type=path_str, default=None, help=argparse.SUPPRESS)


def _replica_label(text: str) -> tuple[int, int]:
    index, sep, count = text.partition("/")
    if not sep or not index.isdigit() or not count.isdigit() or int(index) >= int(count):
        raise argparse.ArgumentTypeError(f"{text!r}: expected INDEX/COUNT, e.g. 0/8")
    return int(index), int(count)


def _setup_logging(log_file: str | None, level: str = "info", replica: tuple[int, int] | None = None) -> None:
    handlers: list[logging.Handler] = [logging.StreamHandler(sys.stderr)]
    if log_file:
        Path(log_file).parent.mkdir(parents=True, exist_ok=True)
        handlers.append(logging.FileHandler(log_file))
    where = f" [replica {replica[0]}/{replica[1]}]" if replica else ""
    formatter = logging.Formatter(f"%(asctime)s %(levelname)s %(name)s{where}: %(message)s")
    for handler in handlers:
        handler.setFormatter(formatter)
        LOG.addHandler(handler)
    LOG.setLevel(getattr(logging, level.upper()))
    LOG.propagate = False


def _setting_error(args: argparse.Namespace) -> str | None:
    if args.max_batch_size < 1:
        return f"--max-batch-size must be at least 1, got {args.max_batch_size}"
    if args.replica is None and args.replicas_per_device > args.dp_size:
        return (f"--replicas-per-device {args.replicas_per_device}: more than the {args.dp_size} replica(s) of "
                f"--dp-size (sglang_server_dp_size); set --dp-size to the GPUs times {args.replicas_per_device}")
    return None


def run(args: argparse.Namespace) -> int:
    """Serve until SIGTERM or SIGINT; 0 on a clean stop, 2 on a bad setting."""
    _setup_logging(args.log_file, args.log_level, args.replica)
    api_key = None
    if args.api_key_env:
        api_key = os.environ.get(args.api_key_env) or None
        if api_key is None:
            LOG.error("--api-key-env %s: that environment variable is unset or empty; export the key in it",
                      args.api_key_env)
            return 2
    error = _setting_error(args)
    if error:
        LOG.error("%s", error)
        return 2
    if args.dp_size > 1:
        from eagle3_pipeline.engine import replicas  # noqa: PLC0415

        parser = argparse.ArgumentParser()
        configure_parser(parser)
        return replicas.run(args, options_argv(args, parser._actions, replicas.FRONT_ONLY), api_key)  # noqa: SLF001
    from transformers.utils import logging as hf_logging  # noqa: PLC0415 - heavy, only when serving

    from eagle3_pipeline.engine.batcher import BatchWorker, ModelRunner  # noqa: PLC0415

    hf_logging.disable_progress_bar()
    try:
        runner = ModelRunner(args.model_path, args.device, args.dtype, args.aux_layers, args.capture_dir)
    except (OSError, ValueError) as exc:
        LOG.error("cannot start: %s", exc)
        return 2
    if args.decode == "slots":
        from eagle3_pipeline.engine.slots import plan_slots  # noqa: PLC0415

        slots, slot_tokens = plan_slots(runner.model, args.max_batch_size, args.slot_tokens, args.kv_cache_gib,
                                        args.replicas_per_device if args.replica else 1)
        runner.enable_slots(slots, slot_tokens, args.cuda_graphs, args.prefill_graphs)
    else:
        runner.decode_path = "transformers (--decode transformers)"
    if runner.capture_dir is not None:
        from eagle3_pipeline.capture.writer import ensure_capture_dir  # noqa: PLC0415

        ensure_capture_dir(runner.capture_dir)
    worker = BatchWorker(runner, args.max_batch_size, args.batch_wait_ms, args.admit_wait_ms).start()
    engine = ReferenceEngine(runner, worker, args.host, args.port, api_key,
                             {"batch_wait_ms": args.batch_wait_ms, "admit_wait_ms": args.admit_wait_ms})
    try:
        server = make_server(engine, args.host, args.port)
    except OSError as exc:
        LOG.error("cannot listen on %s:%s: %s", args.host, args.port, exc)
        return 2
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    serving = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.2}, name="http", daemon=True)
    serving.start()
    if args.ready_file:  # a replica: its front waits for this file, then sends it requests on this port
        atomic_write_text(Path(args.ready_file), json.dumps({"port": engine.port, "pid": os.getpid()}))
    what = "replica ready on" if args.replica else "reference engine serving"  # the front's line says "serving"
    LOG.info(
        "%s http://%s:%d model=%s device=%s dtype=%s aux_layers=%s capture_dir=%s max_batch_size=%d decode=%s "
        "api_key=%s", what, args.host, engine.port, runner.model_path, runner.device.type,
        runner.dtype_name, runner.aux_layers, runner.capture_dir, worker.max_batch_size, runner.decode_path,
        "required" if api_key else "none",
    )
    while not stop.wait(0.5):
        pass
    LOG.info("stopping: finishing requests in flight (up to %.0f s)", args.shutdown_grace_s)
    engine.draining.set()
    server.shutdown()  # no new connections
    failed = worker.stop(args.shutdown_grace_s)
    engine.wait_idle(5.0)  # handlers write their responses (or errors)
    server.server_close()
    LOG.info("stopped: %d request(s) served in %d batch(es), %d of them joined a running decode; %d failed at "
             "shutdown; %s", worker.requests, worker.batches, worker.admitted, failed, worker.describe_stats())
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m eagle3_pipeline.engine.reference_server``: the same as ``eagle3-pipeline serve-reference``."""
    parser = argparse.ArgumentParser(prog="serve-reference", description=__doc__.split("\n", 1)[0])
    configure_parser(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
