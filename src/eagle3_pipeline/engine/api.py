"""The SGLang HTTP API subset of the reference engine: request checking and response shapes.

Plain functions from JSON values to values (no HTTP, no model), so they are tested directly.
The names, defaults and shapes follow SGLang 0.5.23 (see ``reference_server``'s docstring for
the files and functions relied on). A bad request raises ``RequestError`` with the HTTP
status, a message naming the field, and the field; the server answers it as SGLang's
``_create_error_response`` does: ``{"error": {"message": ...}}`` (plus ``param`` here).
"""

from __future__ import annotations

import math
import uuid
from dataclasses import dataclass

from eagle3_pipeline.engine.batcher import GenerateJob, GenerateOutcome, SamplingConfig

# SGLang's sglang.api.v1.SamplingParams fields and their defaults (unknown keys are rejected there
# too). The ones the reference engine implements are in _IMPLEMENTED; the rest are accepted only
# at their default value, so a request never silently means something else here.
SGLANG_SAMPLING_DEFAULTS = {
    "max_new_tokens": 128, "stop": None, "stop_token_ids": None, "stop_regex": None, "temperature": 1.0,
    "top_p": 1.0, "top_k": 1 << 30, "min_p": 0.0, "frequency_penalty": 0.0, "presence_penalty": 0.0,
    "repetition_penalty": 1.0, "min_new_tokens": 0, "n": 1, "json_schema": None, "regex": None, "ebnf": None,
    "structural_tag": None, "ignore_eos": False, "skip_special_tokens": True, "spaces_between_special_tokens": True,
    "no_stop_trim": False, "stream_interval": None, "logit_bias": {}, "sampling_seed": None, "custom_params": None,
    "beam_width": None, "watermark": None, "choice": [],
}
_IMPLEMENTED = {
    "max_new_tokens", "temperature", "top_p", "top_k", "min_new_tokens", "ignore_eos", "stop_token_ids",
    "sampling_seed", "skip_special_tokens",
}
# Top-level GenerateReqInput fields that ask for something this engine does not do.
_UNSUPPORTED_TOP_LEVEL = (
    "input_embeds", "image_data", "video_data", "audio_data", "token_ids_logprob", "lora_path",
    "session_params", "return_routed_experts", "return_flat_raw_top_logprobs",
    "return_flat_raw_output_top_logprobs", "positional_embed_overrides",
)


class RequestError(ValueError):
    """A request the server refuses: HTTP status, message (naming the field), field."""

    def __init__(self, message: str, param: str | None = None, status: int = 400):
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status

    def body(self) -> dict:
        """The JSON error body (SGLang's ``{"error": {"message": ...}}``)."""
        return {"error": {"message": self.message, "param": self.param, "code": self.status}}


@dataclass
class ModelLimits:
    """What a request is checked against."""

    vocab_size: int
    context_length: int
    tokenizer: object | None = None  # a transformers tokenizer, or None (input_ids only)


@dataclass
class GenerateRequest:
    """A checked /generate request, ready to become a ``GenerateJob``."""

    rid: str
    input_ids: list[int]
    sampling: SamplingConfig
    return_logprob: bool
    logprob_start_len: int
    top_logprobs_num: int
    return_text_in_logprobs: bool

    def job(self, capture: bool = True) -> GenerateJob:
        """The model worker's job for this request."""
        return GenerateJob(
            rid=self.rid, input_ids=self.input_ids, sampling=self.sampling, return_logprob=self.return_logprob,
            logprob_start_len=self.logprob_start_len if self.return_logprob else -1,
            top_logprobs_num=self.top_logprobs_num if self.return_logprob else 0, capture=capture,
        )


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _int(body: dict, key: str, default, minimum=None, maximum=None, prefix: str = "") -> int:
    value = body.get(key, default)
    if value is None:
        value = default
    name = prefix + key
    if not _is_int(value):
        raise RequestError(f"{name} must be an integer, got {value!r}", name)
    if minimum is not None and value < minimum:
        raise RequestError(f"{name} must be at least {minimum}, got {value}", name)
    if maximum is not None and value > maximum:
        raise RequestError(f"{name} must be at most {maximum}, got {value}", name)
    return value


def _bool(body: dict, key: str, default: bool, prefix: str = "") -> bool:
    value = body.get(key, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise RequestError(f"{prefix}{key} must be true or false, got {value!r}", prefix + key)
    return value


def _float(body: dict, key: str, default: float, prefix: str = "") -> float:
    value = body.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise RequestError(f"{prefix}{key} must be a finite number, got {value!r}", prefix + key)
    return float(value)


def parse_sampling_params(raw, prompt_tokens: int, limits: ModelLimits) -> SamplingConfig:
    """Check ``sampling_params`` (SGLang's names and defaults) and return what the engine runs."""
    p = "sampling_params."
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise RequestError(f"sampling_params must be a JSON object, got {type(raw).__name__}", "sampling_params")
    for key, value in raw.items():
        if key not in SGLANG_SAMPLING_DEFAULTS:
            listed = ", ".join(f"`{name}`" for name in SGLANG_SAMPLING_DEFAULTS)
            raise RequestError(f"sampling_params: unknown field `{key}`, expected one of {listed}", p + key)
        default = SGLANG_SAMPLING_DEFAULTS[key]
        if key not in _IMPLEMENTED and value is not None and value != default and value not in ([], "", {}):
            raise RequestError(
                f"{p}{key}={value!r} is not supported by the reference engine (only its default {default!r} is)",
                p + key,
            )
    room = limits.context_length - prompt_tokens
    # SGLang checks prompt + max_new_tokens against the context only when the request sets
    # max_new_tokens (tokenizer_manager._validate_one_request); otherwise the scheduler caps the
    # default 128 (or "no limit", None) at the room left (scheduler.init_req_max_new_tokens).
    if "max_new_tokens" not in raw:
        max_new_tokens = min(128, room)
    else:
        max_new_tokens = raw["max_new_tokens"]
        if max_new_tokens is None:
            max_new_tokens = room
    max_new_tokens = _int({"max_new_tokens": max_new_tokens}, "max_new_tokens", 128, minimum=0, prefix=p)
    if max_new_tokens > room:
        raise RequestError(
            f"Requested token count exceeds the model's maximum context length of {limits.context_length} tokens: "
            f"{prompt_tokens} prompt tokens + {p}max_new_tokens {max_new_tokens}; lower max_new_tokens",
            p + "max_new_tokens",
        )
    temperature = _float(raw, "temperature", 1.0, p)
    if temperature < 0:
        raise RequestError(f"{p}temperature must be a non-negative finite number, got {temperature}", p + "temperature")
    top_p = _float(raw, "top_p", 1.0, p)
    if not 0 < top_p <= 1:
        raise RequestError(f"{p}top_p must be in (0, 1], got {top_p}", p + "top_p")
    top_k = _int(raw, "top_k", 1 << 30, prefix=p)
    if top_k == 0 or top_k < -1:
        raise RequestError(f"{p}top_k must be -1 (all) or at least 1, got {top_k}", p + "top_k")
    min_new_tokens = _int(raw, "min_new_tokens", 0, minimum=0, maximum=max_new_tokens, prefix=p)
    stop_token_ids = raw.get("stop_token_ids") or []
    if not isinstance(stop_token_ids, list) or not all(_is_int(t) for t in stop_token_ids):
        raise RequestError(
            f"{p}stop_token_ids must be a list of integers, got {stop_token_ids!r}", p + "stop_token_ids"
        )
    seed = raw.get("sampling_seed")
    if seed is not None and not _is_int(seed):
        raise RequestError(f"{p}sampling_seed must be an integer, got {seed!r}", p + "sampling_seed")
    return SamplingConfig(
        max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
        top_k=-1 if top_k >= limits.vocab_size else top_k, min_new_tokens=min_new_tokens,
        ignore_eos=_bool(raw, "ignore_eos", False, p), stop_token_ids=tuple(stop_token_ids),
        sampling_seed=seed, skip_special_tokens=_bool(raw, "skip_special_tokens", True, p),
    )


def _input_ids(body: dict, limits: ModelLimits) -> list[int]:
    text, ids = body.get("text"), body.get("input_ids")
    if text is None and ids is None:
        raise RequestError("Either text or input_ids should be provided.", "input_ids")
    if text is not None and ids is not None:
        raise RequestError("give either text or input_ids, not both", "input_ids")
    if text is not None:
        if isinstance(text, list):
            raise RequestError("text: batch requests (a list) are not supported by the reference engine; "
                               "send one prompt per request", "text")
        if not isinstance(text, str):
            raise RequestError(f"text must be a string, got {type(text).__name__}", "text")
        if limits.tokenizer is None:
            raise RequestError("text: the model directory has no tokenizer; send input_ids", "text")
        ids = list(limits.tokenizer(text)["input_ids"])
        field = "text"
    else:
        field = "input_ids"
        if not isinstance(ids, list):
            raise RequestError(f"input_ids must be a list of integers, got {type(ids).__name__}", field)
        if ids and isinstance(ids[0], list):
            raise RequestError("input_ids: batch requests (a list of lists) are not supported by the reference "
                               "engine; send one prompt per request", field)
        bad = next((i for i, t in enumerate(ids) if not _is_int(t)), None)
        if bad is not None:
            raise RequestError(f"input_ids[{bad}] must be an integer token id, got {ids[bad]!r}", field)
        bad = next((i for i, t in enumerate(ids) if not 0 <= t < limits.vocab_size), None)
        if bad is not None:
            raise RequestError(
                f"input_ids[{bad}] = {ids[bad]} is out of the vocabulary [0, {limits.vocab_size})", field
            )
    if not ids:
        raise RequestError(f"{field}: the prompt has no tokens", field)
    if len(ids) >= limits.context_length:
        raise RequestError(
            f"{field}: the input ({len(ids)} tokens) is longer than the model's context length "
            f"({limits.context_length} tokens).", field
        )
    return ids


def parse_generate_request(body, limits: ModelLimits) -> GenerateRequest:
    """Check a parsed /generate JSON body; raise ``RequestError`` naming the bad field."""
    if not isinstance(body, dict):
        raise RequestError(f"the request body must be a JSON object, got {type(body).__name__}", None)
    if body.get("stream"):
        raise RequestError("stream=true is not supported by the reference engine", "stream")
    if body.get("return_hidden_states"):
        raise RequestError(
            "return_hidden_states is not supported: hidden states are captured to files (--capture-dir)",
            "return_hidden_states",
        )
    for key in _UNSUPPORTED_TOP_LEVEL:
        if body.get(key) not in (None, False, [], {}):
            raise RequestError(f"{key} is not supported by the reference engine", key)
    rid = body.get("rid")
    if rid is None:
        rid = uuid.uuid4().hex
    elif not isinstance(rid, str):
        raise RequestError(f"rid must be a string (batch requests are not supported), got {rid!r}", "rid")
    else:
        from eagle3_pipeline.capture.writer import CaptureError, check_rid  # noqa: PLC0415 - imports torch

        try:
            check_rid(rid)  # the rid names the capture file: refused up front, with or without capture
        except CaptureError as exc:
            raise RequestError(f"rid: {exc}", "rid") from None
    ids = _input_ids(body, limits)
    sampling = parse_sampling_params(body.get("sampling_params"), len(ids), limits)
    return_logprob = _bool(body, "return_logprob", False)
    start = _int(body, "logprob_start_len", -1, minimum=-1)
    if return_logprob and start > len(ids):
        raise RequestError(
            f"logprob_start_len={start} is higher than the number of input tokens {len(ids)}. "
            "Please use a smaller logprob_start_len.", "logprob_start_len"
        )
    top = _int(body, "top_logprobs_num", 0, minimum=0)
    return GenerateRequest(
        rid=rid, input_ids=ids, sampling=sampling, return_logprob=return_logprob,
        logprob_start_len=len(ids) if start == -1 else start, top_logprobs_num=top,
        return_text_in_logprobs=_bool(body, "return_text_in_logprobs", False),
    )


def _decode_one(tokenizer, token_id: int, as_text: bool):
    if not as_text or tokenizer is None:
        return None
    return tokenizer.decode([token_id])


def _triples(pairs, tokenizer, as_text: bool) -> list:
    return [[value, token, _decode_one(tokenizer, token, as_text)] for value, token in pairs]


def build_generate_response(request: GenerateRequest, outcome: GenerateOutcome, tokenizer, latency_s: float) -> dict:
    """SGLang's /generate body: ``text``, ``output_ids``, ``meta_info`` (tokenizer_manager._handle_batch_output)."""
    text = ""
    if tokenizer is not None and outcome.output_ids:
        text = tokenizer.decode(outcome.output_ids, skip_special_tokens=request.sampling.skip_special_tokens)
    meta = {
        "id": request.rid,
        "finish_reason": outcome.finish_reason,
        "prompt_tokens": len(request.input_ids),
        "weight_version": "default",
        "num_retractions": 0,
        "reasoning_tokens": 0,
        "completion_tokens": len(outcome.output_ids),
        "cached_tokens": 0,  # no radix cache: every prompt token is computed, so captured
        "e2e_latency": latency_s,
    }
    if request.return_logprob:
        as_text = request.return_text_in_logprobs
        meta["input_token_logprobs"] = _triples(outcome.input_token_logprobs or [], tokenizer, as_text)
        meta["output_token_logprobs"] = _triples(outcome.output_token_logprobs or [], tokenizer, as_text)
        meta["output_token_logprobs_length"] = len(meta["output_token_logprobs"])
        if request.top_logprobs_num > 0:
            meta["input_top_logprobs"] = [
                None if row is None else _triples(row, tokenizer, as_text) for row in outcome.input_top_logprobs or []
            ]
            meta["output_top_logprobs"] = [
                _triples(row, tokenizer, as_text) for row in outcome.output_top_logprobs or []
            ]
    return {"text": text, "output_ids": list(outcome.output_ids), "meta_info": meta}
