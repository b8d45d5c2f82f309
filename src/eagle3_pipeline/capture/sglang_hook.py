"""The capture hook SGLang 0.5.23 attaches to the target's ``logits_processor`` (``--forward-hooks``).

It writes one capture per request id with this package's writer (``capture.writer``), on TP
rank 0 only. Facts relied on, read in the SGLang 0.5.23 wheel (paths under ``sglang/srt/``):

- model_executor/hook_manager.py ``register_forward_hooks``: for each spec it resolves
  ``hook_factory`` ("module:callable" or dotted) with importlib, calls ``factory(config)`` once
  with the spec's ``config`` dict, and registers the returned callable with
  ``module.register_forward_hook(hook)`` on every module whose ``named_modules()`` name matches a
  ``target_modules`` fnmatch pattern. So the hook is a plain PyTorch forward hook:
  ``hook(module, args, output)`` with the POSITIONAL args only; returning None keeps the output.
- model_executor/model_runner_components/cuda_graph_setup.py ``finalize_cuda_graph_capture``:
  hooks are registered after graph capture and never run inside a replay; the launch command
  turns graphs off so every forward is eager.
- models/llama.py ``LlamaForCausalLM.forward`` and models/deepseek_v2.py
  ``DeepseekV2ForCausalLM.forward`` call ``self.logits_processor(input_ids, hidden_states,
  self.lm_head, forward_batch, aux_hidden_states)`` positionally: args[3] is the ForwardBatch
  (layers/logits_processor.py ``LogitsProcessor.forward`` converts it to LogitsMetadata only
  inside forward, after the hook's args are taken), and args[1] is the output of the final norm
  (``residual_batch.final_norm(hidden_states, forward_batch, self.norm)`` in
  ``LlamaModel.forward`` / ``DeepseekV2Model.forward``): post-norm, [N, H], N = tokens in the batch.
- aux_hidden_states (args[4]): a list of [N, H] tensors for llama (layers/aux_hidden_states.py
  ``AuxHiddenStateList``) or one packed [N, K*H] tensor for deepseek_v2 (``AuxHiddenStatePacker``),
  in layer order; ``pack_aux_hidden_states`` concatenates a list on the last dim, as we do.
- model_executor/forward_batch_info.py ``ForwardBatch``: ``forward_mode`` (``ForwardMode``; only
  ``EXTEND`` is a plain prefill; ``MIXED``/``SPLIT_PREFILL``/``DLLM_EXTEND`` also extend),
  ``rids`` (request ids, in batch order; ``init_new``: ``[req.rid for req in batch.reqs]``),
  ``extend_seq_lens_cpu`` / ``extend_prefix_lens_cpu`` (host lists; tokens computed in this pass
  and tokens reused from cache), ``orig_seq_lens`` (managers/schedule_batch.py
  ``prepare_for_extend``: ``max(req.extend_end, len(req.origin_input_ids))``, so
  ``orig_seq_lens[i] > prefix + extend`` means this pass is the first part of a split prefill),
  ``attn_tp_sequence_sharded`` (hidden states sharded across attention-TP ranks).
- TP rank: runtime_context.py ``get_parallel().tp_rank`` (distributed/parallel_state.py
  ``get_tensor_model_parallel_rank`` is deprecated in 0.5.23 and warns; it reads the same thing).
  With TP the logits processor's input is replicated on every rank (all-gather happens in the
  LM head), so rank 0 holds every request.

Where DESIGN.md differs from the source: the hook receives the ForwardBatch positionally, not a
LogitsMetadata, as DESIGN.md says; but ``extend_prefix_lens`` alone cannot tell the FIRST part of
a split prefill (prefix 0) from a whole prompt, so the hook also reads ``orig_seq_lens``. And for
Kimi-K2.5 the module is ``language_model.logits_processor`` (models/kimi_k25.py), which the
launch command's spec also names.

Per request: a non-zero prefix (a cached prefix or a later part of a split prefill) or a split
first part gets ``write_incomplete`` (and any capture file of that rid is removed), never a
capture. A batch the hook cannot read whole (row counts disagree, no aux states, sharded states)
gets an incomplete record for every request in it. The hook never raises into SGLang's forward
for a per-request problem; it raises only when called outside SGLang's calling convention.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from eagle3_pipeline.capture.writer import CaptureError, capture_path, write_capture, write_incomplete

logger = logging.getLogger(__name__)

# ForwardMode names that carry no prompt tokens to capture.
_NO_PREFILL_MODES = frozenset({"DECODE", "IDLE", "TARGET_VERIFY", "DRAFT_EXTEND_V2", "PREBUILT"})


class HookContractError(RuntimeError):
    """The hook was called with arguments SGLang 0.5.23's logits_processor call does not pass."""


def _tp_rank() -> int:
    from sglang.srt.runtime_context import get_parallel  # noqa: PLC0415 (sglang exists only in its server)

    return int(get_parallel().tp_rank)


@dataclass
class SGLangCaptureHook:
    """Forward hook on ``logits_processor``: writes ``<capture_dir>/<rid>.safetensors`` per request."""

    capture_dir: str
    aux_layer_ids: list[int]
    engine: str = "sglang"

    def __call__(self, module: torch.nn.Module, args: tuple, output: object) -> None:
        if len(args) < 4:
            raise HookContractError(
                f"capture hook on {type(module).__name__}: expected positional (input_ids, hidden_states, lm_head, "
                f"forward_batch, aux_hidden_states), got {len(args)} positional args"
            )
        hidden_states, batch = args[1], args[3]
        aux = args[4] if len(args) > 4 else None
        for name in ("forward_mode", "rids", "extend_seq_lens_cpu", "extend_prefix_lens_cpu"):
            if not hasattr(batch, name):
                raise HookContractError(
                    f"capture hook: args[3] is a {type(batch).__name__} without {name!r}; the model must pass the "
                    "ForwardBatch (SGLang 0.5.23 llama.py / deepseek_v2.py do)"
                )
        mode = getattr(batch.forward_mode, "name", str(batch.forward_mode))
        if mode in _NO_PREFILL_MODES or _tp_rank() != 0:
            return
        self.capture_batch(batch, mode, hidden_states, aux)

    def capture_batch(self, batch, mode: str, hidden_states: torch.Tensor, aux) -> None:
        """Split one extend batch per request and write captures or incomplete records."""
        rids = list(batch.rids or [])
        seq_lens = [int(n) for n in batch.extend_seq_lens_cpu or []]
        prefix_lens = [int(p) for p in batch.extend_prefix_lens_cpu or []]
        if mode != "EXTEND":
            # MIXED rows with a prefix may be decode rows of finished prefills: leave those alone.
            for rid, prefix in zip(rids, prefix_lens):
                if prefix == 0:
                    self._incomplete(rid, f"forward_mode_{mode.lower()}", prefix_len=0)
            return
        problem = self._batch_problem(batch, rids, seq_lens, prefix_lens, hidden_states, aux)
        if problem:
            reason, details = problem
            for rid in rids:
                self._incomplete(rid, reason, **details)
            return
        packed = aux if isinstance(aux, torch.Tensor) else torch.cat(list(aux), dim=-1)
        orig = batch.orig_seq_lens.tolist() if getattr(batch, "orig_seq_lens", None) is not None else None
        start = 0
        for i, (rid, n, prefix) in enumerate(zip(rids, seq_lens, prefix_lens)):
            rows = slice(start, start + n)
            start += n
            if prefix > 0:
                self._incomplete(rid, "prefix_not_computed", prefix_len=prefix, extend_len=n)
            elif orig is not None and int(orig[i]) > prefix + n:
                self._incomplete(rid, "split_prefill", prompt_len=int(orig[i]), extend_len=n)
            else:
                try:
                    write_capture(
                        self.capture_dir, rid, packed[rows], hidden_states[rows], self.aux_layer_ids, self.engine
                    )
                except CaptureError as exc:
                    logger.error("capture of request %s not written: %s", rid, exc)

    def _batch_problem(self, batch, rids, seq_lens, prefix_lens, hidden_states, aux) -> tuple[str, dict] | None:
        if not (len(rids) == len(seq_lens) == len(prefix_lens)):
            return "batch_metadata_mismatch", {"rids": len(rids), "extend_lens": len(seq_lens)}
        if getattr(batch, "attn_tp_sequence_sharded", False):
            return "sequence_sharded_hidden_states", {}
        if aux is None or (not isinstance(aux, torch.Tensor) and len(aux) == 0):
            return "no_aux_hidden_states", {"hint": "launch with --enable-return-aux-hidden-states"}
        rows, hidden = int(hidden_states.shape[0]), int(hidden_states.shape[-1])
        aux_width = int(aux.shape[-1]) if isinstance(aux, torch.Tensor) else sum(int(a.shape[-1]) for a in aux)
        aux_rows = int(aux.shape[0]) if isinstance(aux, torch.Tensor) else min(int(a.shape[0]) for a in aux)
        if rows != sum(seq_lens) or aux_rows != rows:
            return "row_count_mismatch", {"hidden_rows": rows, "aux_rows": aux_rows, "extend_tokens": sum(seq_lens)}
        if aux_width != len(self.aux_layer_ids) * hidden:
            return "aux_width_mismatch", {"aux_width": aux_width, "expected": len(self.aux_layer_ids) * hidden}
        return None

    def _incomplete(self, rid: str, reason: str, **details) -> None:
        try:
            write_incomplete(self.capture_dir, rid, reason, engine=self.engine, **details)
            stale = capture_path(self.capture_dir, rid)
            if stale.exists():  # an earlier pass of this rid (e.g. the first part of a split prefill)
                stale.unlink()
        except CaptureError as exc:
            logger.error("incomplete record of request %s not written: %s", rid, exc)
            return
        logger.warning("request %s not captured whole: %s %s", rid, reason, details)


def make_capture_hook(config: dict) -> SGLangCaptureHook:
    """Hook factory named in ``--forward-hooks``; SGLang calls it once with the spec's config."""
    missing = {"capture_dir", "aux_layer_ids"} - set(config or {})
    if missing:
        raise ValueError(f"capture hook config lacks {sorted(missing)}; build the spec with sglang_command.hook_spec")
    aux: Sequence[int] = config["aux_layer_ids"]
    return SGLangCaptureHook(
        capture_dir=str(config["capture_dir"]),
        aux_layer_ids=[int(a) for a in aux],
        engine=str(config.get("engine", "sglang")),
    )
