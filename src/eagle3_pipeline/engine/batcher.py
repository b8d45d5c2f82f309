"""The reference engine's model side: batched prefill with capture, then greedy (or seeded) decoding.

``ModelRunner`` holds a transformers causal LM and turns a list of ``GenerateJob`` into
``GenerateOutcome``: one right-padded prefill for the whole batch (attention mask over the
padding; each request's rows sliced out without padding), the request's capture written with
the project's writer right after the prefill, then decoding of every request of the batch
together with the KV cache, each row at its own positions: one forward, one argmax over the
batch and one host copy per step (``DecodeBatch``). A row leaves the batch as soon as it ends,
its cache row with it. ``BatchWorker`` is the one thread that owns the model: it takes jobs from
a queue, groups what is queued and, under concurrent load, what arrives within
``batch_wait_ms`` (up to ``max_batch_size``), and between two decode steps admits what has
queued since into the running batch (continuous batching: a prefill of the newcomers, whose
cache rows then join the others'); it resolves each job's future as soon as that job ends and
its capture is on disk.

Hidden-state conventions (checked against transformers 5.24's ``LlamaModel`` and
``utils/output_capturing.capture_outputs``):

- ``aux_hidden_states`` = concat over the aux layers ``i`` (0-based decoder layers) of HF
  ``hidden_states[i + 1]``, the residual stream after layer ``i``. They are taken by forward
  hooks on the decoder layers themselves, not through ``output_hidden_states=[...]``: what a
  list selects there changed between transformers releases (5.17 returns the states shifted by
  one layer, 5.24 the full tuple), which silently captured the wrong layer. At start the hooks'
  states are compared with ``output_hidden_states=True``'s ``hidden_states[i + 1]``, and a
  mismatch refuses to serve.
- ``last_hidden_states`` = ``last_hidden_state`` of the decoder, i.e. after the final norm: what
  ``lm_head`` reads. (``capture_outputs`` also overwrites ``hidden_states[-1]`` with it, so
  ``hidden_states[L]`` is post-norm and NOT the raw output of layer ``L - 1``; that is why
  layer ``L - 1`` is refused as an aux layer: SGLang's EAGLE-3 capture, which takes the state
  before layer ``id + 1``, cannot capture it either.)
"""

from __future__ import annotations

import inspect
import logging
import queue
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

from eagle3_pipeline.capture.layers import check_aux_layers, default_aux_layers

LOG = logging.getLogger("eagle3_pipeline.engine")

CAPTURE_ENGINE = "reference"
CAPTURE_WRITERS = 4
# The longest a request waits behind a running batch before it is prefilled into it (--admit-wait-ms).
ADMIT_WAIT_MS = 500.0
PREFILL_EMA = 0.2  # the weight of the latest prefill in the running estimate of a prefill's time


class ServiceUnavailable(RuntimeError):
    """The worker is shutting down (or gone): the job was not run."""


def _transformers_version() -> str:
    import transformers  # noqa: PLC0415

    return transformers.__version__


# Largest difference allowed between a cached and a full forward, relative to the largest value of
# the full one: far above what kernel order changes (fp32 ~1e-6, bf16 ~1e-2), far below a forward
# that lost its cache (order 1).
CACHED_FORWARD_TOLERANCE = {"float32": 1e-3, "bfloat16": 5e-2, "float16": 5e-2}

@dataclass
class SamplingConfig:
    """The sampling parameters the reference engine implements (SGLang's names and defaults)."""

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: whole vocabulary
    min_new_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()
    sampling_seed: int | None = None
    skip_special_tokens: bool = True

    @property
    def greedy(self) -> bool:
        """SGLang treats temperature ~0 (and top_k 1) as greedy argmax."""
        return self.temperature < 1e-6 or self.top_k == 1


@dataclass
class GenerateJob:
    """One request for the model worker: token ids in, a future resolved with a ``GenerateOutcome``."""

    rid: str
    input_ids: list[int]
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    return_logprob: bool = False
    logprob_start_len: int = -1  # resolved by the caller: -1 or T = no input logprobs
    top_logprobs_num: int = 0
    capture: bool = True  # False for health checks
    future: Future = field(default_factory=Future)
    waited_for_slot: bool = False  # it could decode in a slot but found none free, and waited for one


@dataclass
class GenerateOutcome:
    """What the model produced for one job; logprobs as (value, token id) pairs, SGLang's layout."""

    output_ids: list[int]
    finish_reason: dict
    input_token_logprobs: list[tuple[float | None, int]] | None = None
    input_top_logprobs: list[list[tuple[float, int]] | None] | None = None
    output_token_logprobs: list[tuple[float, int]] | None = None
    output_top_logprobs: list[list[tuple[float, int]]] | None = None
    capture_path: Path | None = None
    capture_write: Future | None = None  # the capture file being written, off the model thread
    error: Exception | None = None  # the capture could not be written: this request fails alone


@dataclass
class PrefillRow:
    """One request's prefill, padding removed: aux [T, n_aux*H], last [T, H], and logits rows."""

    aux_hidden_states: object  # torch.Tensor
    last_hidden_states: object  # torch.Tensor
    logits: object  # torch.Tensor [n, V] float32 for positions logits_start..T-1
    logits_start: int


@dataclass(eq=False)
class DecodeRow:
    """One request while it decodes: what it feeds next (``token`` at ``position``) and its outcome."""

    job: GenerateJob
    outcome: GenerateOutcome
    generator: object | None  # torch.Generator of a sampled request; None for greedy
    position: int  # position id of the next token fed to the model
    token: int = 0  # the token chosen last, fed at the next step
    slot: int | None = None  # its slot of the slot cache (``engine/slots.py``); None on the transformers path


@dataclass(eq=False)
class DecodeBatch:
    """Requests decoding together: their rows, the KV cache, and the attention mask over its columns.

    On the transformers path row ``b`` of the cache and mask belongs to ``rows[b]``. A column is 1
    in a row's mask where that row has a key there; the zeros are the right padding of a prefill and
    the columns a row that joined mid-decode never had. Each row goes on at its own ``position``.
    A ``slotted`` batch has neither: each row's keys and values are in its own slot of the runner's
    slot cache.
    """

    rows: list[DecodeRow]
    cache: object  # transformers DynamicCache, [B, heads, columns, head_dim] per layer; None once empty
    mask: object  # torch.Tensor [B, columns]
    slotted: bool = False


def _answer(job, outcome: GenerateOutcome, write: Future | None = None) -> None:
    """Resolve a job's future once its capture (if any) is written; a failed write fails it alone."""
    if write is not None:
        try:
            outcome.capture_path = write.result()
        except (OSError, ValueError) as exc:  # disk full, bad rid
            outcome.error = exc
    if outcome.error is not None:
        job.future.set_exception(outcome.error)
    else:
        job.future.set_result(outcome)


class ModelRunner:
    """A causal LM loaded from local HF files, run as batched prefill + batched decode."""

    def __init__(self, model_path: str, device: str = "auto", dtype: str = "auto", aux_layers=None, capture_dir=None):
        import torch  # noqa: PLC0415 - torch is only needed when serving
        from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: PLC0415

        self.torch = torch
        self.model_path = str(model_path)
        # Capture files are written by these threads while the model thread runs the next
        # batch; a request is answered only once its file is in place.
        self.capture_writer = ThreadPoolExecutor(max_workers=CAPTURE_WRITERS, thread_name_prefix="capture-writer")
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if device == "cuda" and not torch.cuda.is_available():
            raise ValueError("--device cuda was asked for, but torch sees no CUDA device; use --device cpu")
        self.device = torch.device(device)
        if dtype == "auto":
            dtype = "bfloat16" if self.device.type == "cuda" else "float32"
        self.dtype_name = dtype
        self.dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
        if not (Path(self.model_path) / "config.json").is_file():
            raise ValueError(
                f"--model-path {self.model_path}: no config.json there (a local HF-format directory is needed)"
            )
        self.model = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=self.dtype, local_files_only=True)
        self.model.to(self.device).eval()
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(self.model_path, local_files_only=True)
        except (OSError, ValueError) as exc:
            LOG.warning("no tokenizer loaded from %s (%s): requests must send input_ids; text comes back empty",
                        self.model_path, exc)
            self.tokenizer = None
        config = self.model.config
        self.num_layers = int(config.num_hidden_layers)
        self.hidden_size = int(config.hidden_size)
        self.vocab_size = int(self.model.get_input_embeddings().num_embeddings)
        self.context_length = int(getattr(config, "max_position_embeddings", 0) or 0) or 1 << 30
        self.aux_layers = check_aux_layers(
            list(aux_layers) if aux_layers is not None else default_aux_layers(self.num_layers), self.num_layers
        )
        self.capture_dir = Path(capture_dir) if capture_dir is not None else None
        self.decoder = self.model.get_decoder()
        self.lm_head = self.model.get_output_embeddings()
        self.eos_token_ids = self._eos_token_ids()
        self._layers = self._decoder_layers()
        self._cache_kw = self._cache_keyword()
        self._captured: dict[int, object] | None = None
        self.slot_decoder = None  # engine/slots.py's SlotDecoder, once enable_slots found it faithful
        self.decode_path = "transformers"
        for index in sorted(set(self.aux_layers)):
            self._layers[index].register_forward_hook(partial(self._keep_layer_output, index))
        self._check_logits_from_last_hidden_state()
        self._check_aux_capture()
        self._check_cached_forward()

    def _eos_token_ids(self) -> set[int]:
        ids: set[int] = set()
        sources = [getattr(self.model.config, "eos_token_id", None)]
        generation_config = getattr(self.model, "generation_config", None)
        if generation_config is not None:
            sources.append(generation_config.eos_token_id)
        if self.tokenizer is not None:
            sources.append(self.tokenizer.eos_token_id)
        for value in sources:
            if isinstance(value, int):
                ids.add(value)
            elif isinstance(value, (list, tuple)):
                ids.update(int(v) for v in value)
        return ids

    def _decoder_layers(self):
        layers = getattr(self.decoder, "layers", None)
        if layers is None or len(layers) != self.num_layers:
            raise ValueError(f"{self.model_path}: the decoder has no list of {self.num_layers} layers (`.layers`); "
                             "the reference engine cannot hook its aux layers")
        return layers

    def _keep_layer_output(self, index: int, _module, _inputs, output) -> None:
        if self._captured is not None:
            self._captured[index] = output[0] if isinstance(output, (tuple, list)) else output

    def _cache_keyword(self) -> str:
        """The name under which this transformers version's decoder takes its KV cache.

        transformers 5.24 calls it ``cache`` (``past_key_values`` is a deprecated alias there);
        5.17 and earlier call it ``past_key_values`` and swallow an unknown ``cache=`` into
        ``**kwargs``: the forward then runs WITHOUT the cache, every token after the prefill sees
        no context, and nothing fails. So the name comes from the signature, never from a guess.
        """
        parameters = inspect.signature(self.decoder.forward).parameters
        for name in ("cache", "past_key_values"):
            if name in parameters:
                return name
        raise ValueError(f"{self.model_path}: the decoder's forward takes its KV cache neither as `cache` nor as "
                         f"`past_key_values` (transformers {_transformers_version()}); the reference engine cannot "
                         "decode with it")

    def _run_decoder(self, cache=None, **kwargs):
        """The decoder's forward (with ``cache`` under this version's keyword), returning
        (output, {aux layer: its output [B, T, H]})."""
        if cache is not None:
            kwargs[self._cache_kw] = cache
            kwargs["use_cache"] = True
        self._captured = {}
        try:
            out = self.decoder(**kwargs)
            return out, self._captured
        finally:
            self._captured = None

    def _check_aux_capture(self) -> None:
        """Refuse to serve when the hooked layer outputs are not HF's ``hidden_states[i + 1]``."""
        torch = self.torch
        ids = torch.arange(min(8, self.vocab_size, self.context_length - 1), device=self.device).unsqueeze(0)
        with torch.inference_mode():
            out, captured = self._run_decoder(input_ids=ids, output_hidden_states=True)
        for index in set(self.aux_layers):
            if not torch.equal(captured[index], out.hidden_states[index + 1]):
                raise ValueError(
                    f"{self.model_path}: the output of decoder layer {index} taken by its forward hook differs from "
                    f"hidden_states[{index + 1}]; this transformers version changed what a layer returns, and the "
                    "reference engine would capture the wrong states"
                )

    def _check_cached_forward(self) -> None:
        with self.torch.inference_mode():
            self._compare_cached_and_full_forwards()

    def _compare_cached_and_full_forwards(self) -> None:
        """Refuse to serve when a forward with the KV cache differs from a full forward.

        Both ways the engine reads tokens after a prefill are checked against one full forward per
        sequence: a request that goes on at explicit positions (the evaluation's verify forwards),
        and the batched decode step (right-padded rows, attention mask, each row at its own
        position). The aux states and the logits must agree within ``CACHED_FORWARD_TOLERANCE``.
        """
        torch = self.torch
        length = min(12, self.context_length - 1)
        if length < 4:
            return
        tokens = self._check_tokens(length)
        short = length - 3  # the second row of the batch, right-padded
        full = self._full_forward

        def compare(what, aux, logits, want_aux, want_logits):
            for name, ours, full_one in (("aux hidden states", aux, want_aux), ("logits", logits, want_logits)):
                error = self._relative_error(ours, full_one)
                if not error <= CACHED_FORWARD_TOLERANCE[self.dtype_name]:
                    raise ValueError(
                        f"{self.model_path}: {what} with the KV cache gives {name} that differ from a full forward "
                        f"of the same tokens (largest difference {error:.3g} of the largest value; allowed "
                        f"{CACHED_FORWARD_TOLERANCE[self.dtype_name]}) under transformers {_transformers_version()}: "
                        "this version takes the cache differently, and every token after a prefill would be read "
                        "without its context; install a transformers release this project supports")

        # 1. one request: prefill, then the rest at explicit positions (the evaluation's forwards)
        split = length - 4
        want_aux, want_logits = full(tokens)
        cache = self._new_cache()
        self._run_decoder(input_ids=torch.tensor([tokens[:split]], device=self.device), cache=cache)
        positions = torch.arange(split, length, device=self.device)[None]
        out, captured = self._run_decoder(input_ids=torch.tensor([tokens[split:]], device=self.device),
                                          position_ids=positions, cache=cache)
        aux = torch.cat([captured[i][0] for i in self.aux_layers], dim=-1)
        compare("a forward at positions after a prefill", aux, self.lm_head(out.last_hidden_state[0]),
                want_aux[split:], want_logits[split:])
        # 2. the batched decode step: two right-padded rows, each going on at its own position
        rows = [tokens[: length - 1], tokens[:short]]
        ids = torch.zeros((2, length - 1), dtype=torch.long, device=self.device)
        mask = torch.zeros((2, length - 1), dtype=torch.long, device=self.device)
        for b, row in enumerate(rows):
            ids[b, : len(row)] = torch.tensor(row, device=self.device)
            mask[b, : len(row)] = 1
        nxt = [tokens[length - 1], tokens[short]]
        cache = self._new_cache()
        self._run_decoder(input_ids=ids, attention_mask=mask, cache=cache)
        mask = torch.cat([mask, torch.ones((2, 1), dtype=mask.dtype, device=self.device)], dim=1)
        out, captured = self._run_decoder(
            input_ids=torch.tensor([[t] for t in nxt], device=self.device), attention_mask=mask,
            position_ids=torch.tensor([[len(row)] for row in rows], device=self.device), cache=cache)
        for b, row in enumerate(rows):
            want_aux, want_logits = full(row + [nxt[b]])
            aux = torch.cat([captured[i][b] for i in self.aux_layers], dim=-1)
            compare("a batched decode step", aux, self.lm_head(out.last_hidden_state[b]), want_aux[-1:],
                    want_logits[-1:])

    def _check_tokens(self, length: int) -> list[int]:
        """The token ids the start-up checks read (deterministic, spread over the vocabulary)."""
        return [(7 + 131 * i) % self.vocab_size for i in range(length)]

    def _full_forward(self, ids: list[int]):
        """(aux states [T, n_aux*H], logits [T, V] float32) of one sequence by a forward without a cache."""
        torch = self.torch
        with torch.inference_mode():
            out, captured = self._run_decoder(input_ids=torch.tensor([ids], device=self.device))
        aux = torch.cat([captured[i][0] for i in self.aux_layers], dim=-1)
        return aux, self.lm_head(out.last_hidden_state[0]).float()

    @staticmethod
    def _relative_error(got, want) -> float:
        """Largest difference of two tensors relative to the largest magnitude of ``want``."""
        got, want = got.float(), want.float()
        return ((got - want).abs().max() / want.abs().max().clamp_min(1e-6)).item()

    # -- the slot cache ------------------------------------------------------------------------
    def enable_slots(self, slots: int, slot_tokens: int, graphs: bool = True, prefill_graphs: bool = True) -> bool:
        """Decode the requests that need no capture and no logprobs over a slot cache of ``slots`` x
        ``slot_tokens`` (``engine/slots.py``), if this model decodes there as its full forwards say;
        otherwise keep the transformers path for everything. ``graphs``: replay decode steps as CUDA graphs,
        and small prefills too unless ``prefill_graphs`` is off. Whether it is on, and why not, is in
        ``decode_path``."""
        from eagle3_pipeline.engine import slots as slot_cache  # noqa: PLC0415

        slot_tokens = min(int(slot_tokens), self.context_length)
        reason = slot_cache.unsupported(self.model)
        if reason is None and (slots < 1 or slot_tokens < 16):
            reason = f"no room for a slot cache ({slots} slots of {slot_tokens} tokens)"
        decoder = None
        failures = []
        # With CUDA graphs for decode steps and prefills first; a failure there (a kernel that cannot be captured, a
        # replay that differs) leaves the prefills' graphs off, then every graph.
        replayable = reason is None and graphs and slot_cache.flash_possible(self.model)
        attempts = ([(True, True)] if replayable and prefill_graphs
                    and slot_cache.prefill_graph_tokens(self.model.get_decoder().layers) else [])
        attempts += [(True, False)] if replayable else []
        for replay, replay_prefill in [*attempts, (False, False)] if reason is None else []:
            try:
                decoder = slot_cache.SlotDecoder(self.model, slots, slot_tokens, replay, replay_prefill)
                with self.torch.inference_mode():
                    reason = self._compare_slot_decode(decoder)
            except (RuntimeError, ValueError) as exc:  # a kernel this device or build lacks
                LOG.warning("slot decoding (CUDA graphs %s, prefill graphs %s) failed", replay, replay_prefill,
                            exc_info=True)
                reason = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            if reason is None:
                break
            if replay:
                failures.append(f"{'prefill graphs' if replay_prefill else 'CUDA graphs'} off: {reason}")
            decoder = None
        if reason is not None:
            self.slot_decoder = None
            self.decode_path = f"transformers (slot decoding off: {reason})"
            LOG.warning("%s: slot decoding off, the transformers path decodes everything: %s", self.model_path,
                        reason)
            return False
        self.slot_decoder = decoder
        self.decode_path = "; ".join([decoder.describe(), *failures])
        return True

    def _compare_slot_decode(self, decoder) -> str | None:
        """Why slot decoding does not reproduce this model's full forwards (None when it does): two
        prompts of different lengths in slots apart (their aux states too; and prefilled as a CUDA graph
        replays it, padded, where prefills replay graphs), each then decoding three tokens together, then
        reading four more at once over a rejected one (the evaluation's verify)."""
        torch = self.torch
        length = min(12, decoder.slot_tokens - 8)
        tokens = self._check_tokens(length + 7)
        prompts = [tokens[:length], tokens[: length - 3]]
        taken = decoder.take(decoder.free_slots)
        slots = [taken[0], taken[-1]] if len(taken) > 1 else taken  # the first and the last slot
        prompts = prompts[: len(slots)]
        tolerance = CACHED_FORWARD_TOLERANCE[self.dtype_name]
        try:
            # Without aux layers first (a graph replays that prefill where graphs are on), then with them (eager):
            # the second writes the same keys and values again.
            replayed = decoder.prefill(slots, prompts)[0] if decoder.prefill_graph_tokens else None
            first, aux = decoder.prefill(slots, prompts, self.aux_layers)
            got = [first]
            for step in range(3):
                got.append(decoder.decode(slots, [tokens[len(p) + step] for p in prompts],
                                          [len(p) + step for p in prompts]))
            # A verify-like read of 4 tokens from position len + 2: it overwrites the third decoded token's keys.
            at = torch.tensor([[len(p) + 2 + i for i in range(4)] for p in prompts], device=self.device)
            more, more_aux = decoder.extend(slots, torch.tensor([tokens[len(p) + 2: len(p) + 6] for p in prompts],
                                                                device=self.device), at, self.aux_layers)
        finally:
            decoder.release(taken)
        start = 0
        for b, prompt in enumerate(prompts):
            want_aux, want = self._full_forward(tokens[: len(prompt) + 6])
            pairs = [(f"logits at decode step {step}", got[step][b], want[len(prompt) - 1 + step]) for step in range(4)]
            pairs += [("aux states of the prompt", aux[start:start + len(prompt)], want_aux[: len(prompt)]),
                      ("logits of a 4-token read", more[b], want[len(prompt) + 2: len(prompt) + 6]),
                      ("aux states of a 4-token read", more_aux[b], want_aux[len(prompt) + 2: len(prompt) + 6])]
            if replayed is not None:
                pairs.append(("logits of a prefill replayed as a CUDA graph", replayed[b], want[len(prompt) - 1]))
            start += len(prompt)
            for what, ours, full in pairs:
                error = self._relative_error(ours, full)
                if not error <= tolerance:
                    return (f"its {what} of a {len(prompt)}-token prompt differ from a full forward by {error:.3g} "
                            f"of the largest value (allowed {tolerance})")
        return None

    def _check_logits_from_last_hidden_state(self) -> None:
        """Refuse models whose logits are not ``lm_head(last_hidden_state)`` (softcapping, scaling...).

        The capture's ``last_hidden_states`` must reproduce the engine's own top-1 through lm_head.
        """
        torch = self.torch
        ids = torch.arange(min(8, self.vocab_size, self.context_length - 1), device=self.device).unsqueeze(0)
        with torch.inference_mode():
            full = self.model(input_ids=ids).logits.float()
            ours = self.lm_head(self.decoder(input_ids=ids).last_hidden_state).float()
        if not torch.allclose(full, ours, rtol=1e-3, atol=1e-3):
            raise ValueError(
                f"{self.model_path}: the model's logits are not lm_head(final hidden state) "
                f"(max difference {(full - ours).abs().max().item():.3g}); "
                "the reference engine cannot capture it faithfully"
            )

    # -- prefill -------------------------------------------------------------------------
    def prefill(self, jobs: list[GenerateJob]):
        """One right-padded forward over all jobs; returns (rows, cache, lengths)."""
        torch = self.torch
        lengths = [len(job.input_ids) for job in jobs]
        width = max(lengths)
        ids = torch.zeros((len(jobs), width), dtype=torch.long)
        mask = torch.zeros((len(jobs), width), dtype=torch.long)
        for b, job in enumerate(jobs):
            ids[b, : lengths[b]] = torch.tensor(job.input_ids, dtype=torch.long)
            mask[b, : lengths[b]] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        cache = self._new_cache()
        out, captured = self._run_decoder(input_ids=ids, attention_mask=mask, cache=cache)
        rows = []
        for b, job in enumerate(jobs):
            length = lengths[b]
            aux = torch.cat([captured[i][b, :length] for i in self.aux_layers], dim=-1)  # [T, n_aux*H]
            last = out.last_hidden_state[b, :length]  # [T, H], post-norm
            # Logits for the input logprobs (from logprob_start_len) and for the first output token.
            start = length - 1
            if job.return_logprob and 0 <= job.logprob_start_len < length:
                start = job.logprob_start_len
            logits = self.lm_head(last[start:]).float()  # [T - start, V]
            rows.append(PrefillRow(aux, last, logits, start))
        return rows, cache, mask, lengths

    def _new_cache(self):
        from transformers import DynamicCache  # noqa: PLC0415

        return DynamicCache(config=self.model.config)

    # -- the whole batch -----------------------------------------------------------------
    def run_batch(self, jobs: list[GenerateJob]) -> list[GenerateOutcome]:
        """Prefill (capturing each request), then decode every job to its stop; outcomes in job order."""
        batch, finished = self.start(jobs)
        outcomes = {id(row.job): row.outcome for row in (*batch.rows, *finished)}
        while batch.rows:
            self.step(batch)
        return [outcomes[id(job)] for job in jobs]

    def slot_ready(self, job: GenerateJob) -> bool:
        """Whether ``job`` can decode over the slot cache: it needs no capture and no logprobs (those
        come from the transformers prefill), and its prompt and budget fit a slot."""
        decoder = self.slot_decoder
        return (decoder is not None and not (job.capture and self.capture_dir is not None)
                and not job.return_logprob and job.sampling.max_new_tokens > 0
                and len(job.input_ids) + job.sampling.max_new_tokens <= decoder.slot_tokens)

    def groups(self, jobs: list[GenerateJob]) -> tuple[list[list[GenerateJob]], list[GenerateJob]]:
        """``jobs`` split into (the batches ``start`` takes now: those for free slots, and those the slot cache cannot
        take; the jobs that could decode in a slot but find none free). Those wait for a slot: on the transformers
        path they would decode many times slower, and slow every step of the loop that runs both."""
        free = self.free_slots()
        slotted, others, waiting = [], [], []
        for job in jobs:
            if not self.slot_ready(job):
                others.append(job)
            else:
                (slotted if len(slotted) < free else waiting).append(job)
        return [group for group in (slotted, others) if group], waiting

    def free_slots(self) -> int:
        """Slots free now (0 without a slot cache)."""
        return self.slot_decoder.free_slots if self.slot_decoder is not None else 0

    def start(self, jobs: list[GenerateJob]) -> tuple[DecodeBatch, list[DecodeRow]]:
        """Prefill ``jobs`` as one batch (captures written off this thread), choose each one's first
        token; return (the batch of those still decoding, the rows already finished). Jobs that all
        fit the free slots of the slot cache (``groups``) decode there."""
        torch = self.torch
        decoder = self.slot_decoder
        if decoder is not None and len(jobs) <= decoder.free_slots and all(self.slot_ready(j) for j in jobs):
            return self._start_slotted(jobs)
        with torch.inference_mode():
            prefilled, cache, mask, lengths = self.prefill(jobs)
            rows = []
            for job, row, length in zip(jobs, prefilled, lengths):
                outcome = GenerateOutcome(output_ids=[], finish_reason={"type": "length", "length": 0})
                if job.capture and self.capture_dir is not None:
                    from eagle3_pipeline.capture.writer import write_capture  # noqa: PLC0415

                    # The writer thread copies the rows off the GPU too, so the model thread goes
                    # straight on to the next batch (the copy queues behind it on the stream).
                    outcome.capture_write = self.capture_writer.submit(
                        write_capture, self.capture_dir, job.rid, row.aux_hidden_states,
                        row.last_hidden_states, self.aux_layers, engine=CAPTURE_ENGINE,
                    )
                if job.return_logprob:
                    self._input_logprobs(job, row, outcome)
                    outcome.output_token_logprobs = []
                    if job.top_logprobs_num > 0:
                        outcome.output_top_logprobs = []
                rows.append(DecodeRow(job, outcome, self._generator(job.sampling), length))
            batch = DecodeBatch(rows, cache, mask)
            wanting = [b for b, row in enumerate(rows) if row.job.sampling.max_new_tokens > 0]
            if len(wanting) < len(rows):  # max_new_tokens 0: prefill only, no output token
                batch.rows = [rows[b] for b in wanting]
                self._keep_rows(batch, wanting)
            finished = [row for row in rows if row.job.sampling.max_new_tokens <= 0]
            if batch.rows:
                # The logits of each prompt's last position choose its first output token.
                logits = torch.stack([prefilled[b].logits[-1] for b in wanting])
                finished += self._advance(batch, logits)
        return batch, finished

    def _start_slotted(self, jobs: list[GenerateJob]) -> tuple[DecodeBatch, list[DecodeRow]]:
        """``start`` over the slot cache: each job takes a slot, its prompt is prefilled there."""
        decoder = self.slot_decoder
        slots = decoder.take(len(jobs))
        try:
            with self.torch.inference_mode():
                logits, _ = decoder.prefill(slots, [job.input_ids for job in jobs])
                rows = [DecodeRow(job, GenerateOutcome(output_ids=[], finish_reason={"type": "length", "length": 0}),
                                  self._generator(job.sampling), len(job.input_ids), slot=slot)
                        for job, slot in zip(jobs, slots)]
                batch = DecodeBatch(rows, None, None, slotted=True)
                return batch, self._advance(batch, logits)
        except Exception:
            decoder.release(slots)
            raise

    def abandon(self, batch: DecodeBatch) -> None:
        """Free what a batch that will not go on holds (its slots; the transformers cache is garbage)."""
        if batch.slotted:
            self.slot_decoder.release(row.slot for row in batch.rows)
        batch.rows = []
        batch.cache = None

    def step(self, batch: DecodeBatch) -> list[DecodeRow]:
        """One decode forward for every row of ``batch`` (each at its own position), then one token
        each; finished rows leave the batch (and their cache rows with them). Returns those rows."""
        torch = self.torch
        if batch.slotted:
            with torch.inference_mode():
                rows = batch.rows
                logits = self.slot_decoder.decode([row.slot for row in rows], [row.token for row in rows],
                                                  [row.position for row in rows])
                for row in rows:
                    row.position += 1
                return self._advance(batch, logits)
        with torch.inference_mode():
            size = len(batch.rows)
            batch.mask = torch.cat([batch.mask, torch.ones((size, 1), dtype=batch.mask.dtype, device=self.device)], 1)
            out, _ = self._run_decoder(
                input_ids=torch.tensor([[row.token] for row in batch.rows], device=self.device),
                attention_mask=batch.mask,
                position_ids=torch.tensor([[row.position] for row in batch.rows], device=self.device),
                cache=batch.cache,
            )
            for row in batch.rows:
                row.position += 1
            logits = self.lm_head(out.last_hidden_state[:, -1]).float()  # [B, V]
            return self._advance(batch, logits)

    def can_merge(self, batch: DecodeBatch, other: DecodeBatch | None = None) -> bool:
        """Whether another batch's rows (``other``'s, when given) can join ``batch`` mid-decode: both
        slotted, or both with plain growing key/value tensors per layer (sliding-window or static
        layers keep positions of their own)."""
        from transformers.cache_utils import DynamicLayer  # noqa: PLC0415

        if other is not None and other.slotted != batch.slotted:
            return False
        if batch.slotted:
            return True
        layers = getattr(batch.cache, "layers", None)
        return bool(layers) and all(type(layer) is DynamicLayer and layer.is_initialized for layer in layers)

    def merge(self, batch: DecodeBatch, other: DecodeBatch) -> DecodeBatch:
        """``other``'s rows join ``batch`` (both ``can_merge``): caches and masks padded to the same
        number of columns with masked-out zeros, then stacked. Positions stay per row, and a
        decode step attends only to unmasked columns, so a row's output does not change."""
        torch = self.torch
        if not other.rows:
            return batch
        if not batch.rows:
            return other
        if batch.slotted:  # each row's keys stay in its slot
            batch.rows = batch.rows + other.rows
            return batch
        with torch.inference_mode():
            width = max(batch.mask.shape[1], other.mask.shape[1])

            def widen(tensor, dim):
                missing = width - tensor.shape[dim]
                if missing == 0:
                    return tensor
                shape = list(tensor.shape)
                shape[dim] = missing
                return torch.cat([tensor, tensor.new_zeros(shape)], dim=dim)

            for mine, theirs in zip(batch.cache.layers, other.cache.layers):
                mine.keys = torch.cat([widen(mine.keys, 2), widen(theirs.keys, 2)])
                mine.values = torch.cat([widen(mine.values, 2), widen(theirs.values, 2)])
            batch.mask = torch.cat([widen(batch.mask, 1), widen(other.mask, 1)])
            batch.rows = batch.rows + other.rows
        return batch

    def _generator(self, sampling: SamplingConfig):
        if sampling.greedy:
            return None
        generator = self.torch.Generator()
        generator.manual_seed(sampling.sampling_seed if sampling.sampling_seed is not None else self.torch.seed())
        return generator

    def _advance(self, batch: DecodeBatch, logits) -> list[DecodeRow]:
        """Choose each row's next token from its logits [B, V] and record it; drop and return the rows
        that finished with it."""
        tokens = self._choose_tokens(logits, batch.rows)
        self._record_tokens(logits, batch.rows, tokens)
        keep, finished = [], []
        for b, (row, token) in enumerate(zip(batch.rows, tokens)):
            row.token = token
            if self._finished(row.job, row.outcome, token):
                finished.append(row)
            else:
                keep.append(b)
        if finished:
            batch.rows = [batch.rows[b] for b in keep]
            if batch.slotted:
                self.slot_decoder.release(row.slot for row in finished)
            else:
                self._keep_rows(batch, keep)
        return finished

    def _keep_rows(self, batch: DecodeBatch, keep: list[int]) -> None:
        """Keep only rows ``keep`` of the cache and mask; drop the columns no row attends to any more."""
        torch = self.torch
        if not keep:
            batch.mask = batch.mask[:0]
            batch.cache = None  # nothing decodes: the memory goes now
            return
        index = torch.tensor(keep, device=self.device)
        batch.mask = batch.mask.index_select(0, index)
        batch.cache.batch_select_indices(index)
        if self.can_merge(batch):
            used = batch.mask.any(0)
            if not bool(used.all()):
                columns = used.nonzero().squeeze(1)
                batch.mask = batch.mask.index_select(1, columns)
                for layer in batch.cache.layers:
                    layer.keys = layer.keys.index_select(2, columns)
                    layer.values = layer.values.index_select(2, columns)

    def _input_logprobs(self, job: GenerateJob, row: PrefillRow, outcome: GenerateOutcome) -> None:
        """SGLang's input logprob layout (logprob_result_processor): entry j is for token s + j,

        scored by the logits at position s + j - 1; entry 0 has no score (None), and the logits of
        the last prompt position belong to the first output token instead.
        """
        length = len(job.input_ids)
        start = job.logprob_start_len
        if not 0 <= start < length:
            outcome.input_token_logprobs = []
            outcome.input_top_logprobs = [] if job.top_logprobs_num > 0 else None
            return
        logprobs = row.logits[: length - 1 - start].log_softmax(-1)  # positions s..T-2
        targets = job.input_ids[start + 1 :]
        values = logprobs.gather(1, self.torch.tensor(targets, device=logprobs.device).unsqueeze(1)).squeeze(1)
        outcome.input_token_logprobs = [(None, job.input_ids[start])] + list(zip(values.tolist(), targets))
        if job.top_logprobs_num > 0:
            k = min(job.top_logprobs_num, self.vocab_size)
            # One topk and two host copies for all positions (not a GPU sync per position).
            values, indices = logprobs.topk(k, dim=-1)
            outcome.input_top_logprobs = [None] + [
                list(zip(v, i)) for v, i in zip(values.tolist(), indices.tolist())
            ]

    # -- decode --------------------------------------------------------------------------
    def _choose(self, logits_row, sampling: SamplingConfig, generator) -> int:
        torch = self.torch
        if sampling.greedy:
            return int(logits_row.argmax())
        scores = logits_row / sampling.temperature
        if 0 < sampling.top_k < scores.numel():
            kth = scores.topk(sampling.top_k).values[-1]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        if sampling.top_p < 1.0:
            ordered, order = scores.sort(descending=True)
            probs = ordered.softmax(-1)
            drop = probs.cumsum(-1) - probs > sampling.top_p  # keep the smallest prefix reaching top_p
            scores = scores.scatter(0, order, ordered.masked_fill(drop, float("-inf")))
        probs = scores.softmax(-1).cpu()
        return int(torch.multinomial(probs, 1, generator=generator))

    def _choose_tokens(self, logits, rows: list[DecodeRow]) -> list[int]:
        """Each row's next token: one argmax over the batch and one host copy for the greedy rows
        (a sync per row per step would stall the device); sampled rows draw with their own generator."""
        tokens = logits.argmax(-1).tolist()
        for b, row in enumerate(rows):
            if not row.job.sampling.greedy:
                tokens[b] = self._choose(logits[b], row.job.sampling, row.generator)
        return tokens

    def _record_tokens(self, logits, rows: list[DecodeRow], tokens: list[int]) -> None:
        """Append each row's token, with its logprob (and top logprobs) where the request asked."""
        torch = self.torch
        wanting = [b for b, row in enumerate(rows) if row.job.return_logprob]
        values: list[float] = []
        tops: list[list[tuple[float, int]]] = []
        if wanting:
            logprobs = logits[torch.tensor(wanting, device=logits.device)].log_softmax(-1)  # [W, V]
            chosen = torch.tensor([tokens[b] for b in wanting], device=logits.device)
            values = logprobs.gather(1, chosen.unsqueeze(1)).squeeze(1).tolist()
            k = min(max(rows[b].job.top_logprobs_num for b in wanting), self.vocab_size)
            if k > 0:
                top_values, top_ids = logprobs.topk(k, dim=-1)
                tops = [list(zip(v, i)) for v, i in zip(top_values.tolist(), top_ids.tolist())]
        at = {b: i for i, b in enumerate(wanting)}
        for b, row in enumerate(rows):
            row.outcome.output_ids.append(tokens[b])
            if b in at:
                row.outcome.output_token_logprobs.append((values[at[b]], tokens[b]))
                if row.job.top_logprobs_num > 0:
                    row.outcome.output_top_logprobs.append(tops[at[b]][: min(row.job.top_logprobs_num,
                                                                                 self.vocab_size)])

    def _finished(self, job: GenerateJob, outcome: GenerateOutcome, token: int) -> bool:
        """SGLang's finish reasons: a stop token is FINISH_MATCHED_TOKEN, the budget FINISH_LENGTH."""
        sampling = job.sampling
        produced = len(outcome.output_ids)
        if produced >= sampling.min_new_tokens:
            if token in sampling.stop_token_ids or (not sampling.ignore_eos and token in self.eos_token_ids):
                outcome.finish_reason = {"type": "stop", "matched": token}
                return True
        if produced >= sampling.max_new_tokens:
            outcome.finish_reason = {"type": "length", "length": sampling.max_new_tokens}
            return True
        return False


class BatchWorker:
    """The single thread that owns the model: queue in, batches of up to ``max_batch_size`` run."""

    def __init__(self, runner: ModelRunner, max_batch_size: int = 8, batch_wait_ms: float = 5.0,
                 admit_wait_ms: float = ADMIT_WAIT_MS):
        self.runner = runner
        self.max_batch_size = max(1, int(max_batch_size))
        self.batch_wait_s = max(0.0, float(batch_wait_ms)) / 1000.0
        self.admit_wait_s = max(0.0, float(admit_wait_ms)) / 1000.0
        self._queue: queue.Queue[GenerateJob] = queue.Queue()
        # Requests that could decode in a slot but found none free, in arrival order: admitted first once slots free.
        self._held: deque[GenerateJob] = deque()
        self.slot_waits = 0  # requests that waited for a free slot
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="model-worker", daemon=True)
        self._last_batch_size = 0
        self.batches = 0  # prefills run
        self.prefill_rows = 0  # requests those prefills started
        self.requests = 0  # requests answered
        self.admitted = 0  # requests that joined a batch already decoding
        self._queued_since: float | None = None  # when a job first queued behind a running batch
        self._prefill_estimate_s = 0.0  # recent prefills' time (moving average): what one costs the decoding rows
        # Where the model thread's time goes (``stats``): decode steps and the rows they carried, seconds
        # decoding, prefilling and waiting with nothing to run.
        self.decode_steps = 0
        self.decode_rows = 0
        self.decode_s = 0.0
        self.decode_cpu_s = 0.0  # of decode_s, the model thread's own CPU time (the rest: the GPU or the GIL)
        self.answer_s = 0.0  # of decode_s, answering the rows that finished
        self.prefill_s = 0.0
        self.idle_s = 0.0
        self._started_at = time.monotonic()

    def start(self) -> BatchWorker:
        """Start the worker thread."""
        self._thread.start()
        return self

    def stats(self) -> dict:
        """The model thread's account since start: decode steps, the mean rows a step decoded, and the
        seconds spent decoding, prefilling and idle (no request at all); the rest is the thread's own
        bookkeeping between them."""
        wall = max(time.monotonic() - self._started_at, 1e-9)
        decoder = getattr(self.runner, "slot_decoder", None)
        return {"decode_steps": self.decode_steps,
                "mean_decode_batch": round(self.decode_rows / self.decode_steps, 1) if self.decode_steps else 0.0,
                "prefills": self.batches,
                "slot_waits": self.slot_waits, "waiting_for_slot": len(self._held),
                "mean_prefill_batch": round(self.prefill_rows / self.batches, 1) if self.batches else 0.0,
                # To the millisecond: rounded to tenths, three parts of a short run could add up past its wall time.
                "decode_s": round(self.decode_s, 3), "prefill_s": round(self.prefill_s, 3),
                # Of decode_s: the model thread on a CPU, waiting for replayed steps on the GPU, answering.
                "decode_cpu_s": round(self.decode_cpu_s, 3),
                "decode_gpu_wait_s": round(decoder.replay_wait_s, 3) if decoder is not None else None,
                "answer_s": round(self.answer_s, 3),
                "idle_s": round(self.idle_s, 3), "wall_s": round(wall, 3)}

    def describe_stats(self) -> str:
        """``stats`` as a sentence for the log."""
        stats = self.stats()
        return (f"{stats['decode_steps']} decode step(s) of {stats['mean_decode_batch']} request(s) on average, "
                f"{stats['prefills']} prefill(s) of {stats['mean_prefill_batch']}, "
                f"{stats['slot_waits']} request(s) waited for a free slot, "
                f"{stats['decode_s']} s decoding ({stats['decode_cpu_s']} s of it on a CPU, "
                f"{stats['decode_gpu_wait_s']} s waiting for the GPU's replays, {stats['answer_s']} s answering), "
                f"{stats['prefill_s']} s prefilling, {stats['idle_s']} s idle of {stats['wall_s']} s")

    def submit(self, job: GenerateJob) -> Future:
        """Queue a job; its future gets a ``GenerateOutcome`` or an exception."""
        if self._stopping.is_set():
            raise ServiceUnavailable("the server is shutting down")
        self._queue.put(job)
        return job.future

    def _next_batch(self) -> list[GenerateJob] | None:
        if self._held:  # nothing decodes: every slot is free for them
            return self._waiting(self.max_batch_size)
        try:
            batch = [self._queue.get(timeout=0.1)]
        except queue.Empty:
            return None
        # Wait for companions only under concurrent load (the last batch had several requests):
        # a lone client would otherwise pay batch_wait_ms on every request.
        wait = self.batch_wait_s if self._last_batch_size > 1 else 0.0
        deadline = time.monotonic() + wait
        while len(batch) < self.max_batch_size:
            try:
                batch.append(self._queue.get_nowait())
                continue
            except queue.Empty:
                pass
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                batch.append(self._queue.get(timeout=remaining))
            except queue.Empty:
                break
        self._last_batch_size = len(batch)
        return batch

    def _waiting(self, room: int) -> list[GenerateJob]:
        """Up to ``room`` jobs queued now, those waiting for a slot first (no waiting: the running batch must not
        stall)."""
        jobs: list[GenerateJob] = []
        while self._held and len(jobs) < room:
            jobs.append(self._held.popleft())
        while len(jobs) < room:
            try:
                jobs.append(self._queue.get_nowait())
            except queue.Empty:
                break
        return jobs

    def _finish(self, rows: list[DecodeRow]) -> None:
        for row in rows:
            if row.outcome.capture_write is None:
                _answer(row.job, row.outcome)
            else:
                row.outcome.capture_write.add_done_callback(partial(_answer, row.job, row.outcome))
        self.requests += len(rows)

    def _start(self, jobs: list[GenerateJob]) -> DecodeBatch | None:
        """Prefill ``jobs``; answer those that end there; the batch of the others (None on failure)."""
        started = time.monotonic()
        try:
            batch, finished = self.runner.start(jobs)
        except Exception as exc:  # noqa: BLE001 - one failed batch must not stop the server
            LOG.exception("prefill of %d request(s) failed: %s", len(jobs), exc)
            for job in jobs:
                job.future.set_exception(exc)
            return None
        finally:
            took = time.monotonic() - started
            self.prefill_s += took
            self._prefill_estimate_s += PREFILL_EMA * (took - self._prefill_estimate_s)
        self.batches += 1
        self.prefill_rows += len(jobs)
        self._finish(finished)
        LOG.debug("prefill of %d request(s), %d prompt tokens, in %.1f ms", len(jobs),
                  sum(len(job.input_ids) for job in jobs), 1000 * (time.monotonic() - started))
        return batch

    def _admit(self, running: list[DecodeBatch], jobs: list[GenerateJob]) -> list[DecodeBatch]:
        """Prefill ``jobs`` (the slot cache's and the others apart) and add their rows to a running
        batch of their kind, or as a batch of their own."""
        batches, waiting = self.runner.groups(jobs)
        if waiting and not batches and not running:  # no slot free with nothing decoding: none ever would be
            LOG.warning("%d request(s) fit a slot, none is free and nothing decodes: the transformers path takes them",
                        len(waiting))
            batches, waiting = [waiting], []
        for job in waiting:
            if not job.waited_for_slot:
                job.waited_for_slot = True
                self.slot_waits += 1
        self._held.extendleft(reversed(waiting))  # at the front again, in their order
        for group in batches:
            joining = self._start(group)
            if joining is None or not joining.rows:
                continue
            into = next((b for b in running if self.runner.can_merge(b, joining)), None)
            if into is None:
                running.append(joining)
            else:
                self.admitted += len(joining.rows)
                self.runner.merge(into, joining)
        return running

    def _admit_now(self, decoding: int) -> bool:
        """Whether to prefill what queued since the last admission, now. A prefill pauses every decoding
        row for its forward: ``decoding`` rows times a prefill's time (the recent ones' average) of decode
        lost. Waiting costs too: the queued requests (as many as there is room for) decode nothing for as
        long as they wait. So the queue is admitted once its waiting has cost as much as the pause will,
        once it would fill the batch, or once its first request has waited ``admit_wait_ms``. A lone
        request in an idle batch goes at once; behind a large batch, requests gather into fewer, larger
        prefills (one a decode step would halve a small model's decode rate). While requests wait for a slot
        (the slot cache, not the batch size, is full), the room is the free slots, and only the balance and
        ``admit_wait_ms`` admit: more slots free up while the queue waits, so waiting gathers a larger prefill."""
        queued = self._queue.qsize() + len(self._held)
        room = self.max_batch_size - decoding
        slot_bound = bool(self._held)
        if slot_bound:
            room = min(room, self.runner.free_slots())
        if not queued or room <= 0:
            self._queued_since = None
            return False
        now = time.monotonic()
        if self._queued_since is None:
            self._queued_since = now
        waited = now - self._queued_since
        return ((queued >= room and not slot_bound) or waited >= self.admit_wait_s
                or min(queued, room) * waited >= decoding * self._prefill_estimate_s)

    def _loop(self) -> None:
        running: list[DecodeBatch] = []
        while True:
            decoding = sum(len(batch.rows) for batch in running)
            if not running:
                waited = time.monotonic()
                jobs = self._next_batch()
                self.idle_s += time.monotonic() - waited
                if jobs is None:
                    if self._stopping.is_set():
                        return
                    continue
                running = self._admit(running, jobs)
            elif self._admit_now(decoding):
                self._queued_since = None
                running = self._admit(running, self._waiting(self.max_batch_size - decoding))
            for batch in running:
                stepped, cpu = time.monotonic(), time.thread_time()
                self.decode_steps += 1
                self.decode_rows += len(batch.rows)
                try:
                    finished = self.runner.step(batch)
                    answering = time.monotonic()
                    self._finish(finished)
                    self.answer_s += time.monotonic() - answering
                except Exception as exc:  # noqa: BLE001 - the server stays up; these requests fail
                    LOG.exception("decode step of %d request(s) failed: %s", len(batch.rows), exc)
                    for row in batch.rows:
                        row.job.future.set_exception(exc)
                    self.runner.abandon(batch)
                self.decode_s += time.monotonic() - stepped
                self.decode_cpu_s += time.thread_time() - cpu
            running = [batch for batch in running if batch.rows]

    def stop(self, grace_s: float = 30.0) -> int:
        """Finish queued and running jobs within ``grace_s``; fail what is left; return how many failed."""
        self._stopping.set()
        self._thread.join(timeout=grace_s)
        self.runner.capture_writer.shutdown(wait=True)  # every capture file started is finished
        failed = 0
        while True:
            try:
                job = self._held.popleft() if self._held else self._queue.get_nowait()
            except queue.Empty:
                break
            job.future.set_exception(ServiceUnavailable("the server shut down before running this request"))
            failed += 1
        return failed
