"""Checks every captured sample must pass before it counts as data.

A capture is only as good as its alignment with the tokens it claims to describe. The peers'
failure modes were silent: a radix cache that served a prefix from memory (fewer rows), a
split prefill, a request id mixed up with another, NaNs stored as data. So each sample is
held to four facts, each cheap to test:

1. the engine computed every token: ``meta_info.prompt_tokens`` equals the sent length and
   ``cached_tokens`` is 0;
2. the capture has exactly T rows, the expected widths (n_aux x H and H) and one float dtype;
3. every value is finite;
4. the target's own ``lm_head`` applied to the captured ``last_hidden_states`` predicts, at the
   checked positions, the token the engine itself ranked first there (its input top-1
   logprobs). Row p predicts token p + 1: the engine's ``input_top_logprobs[p + 1 - s]`` (the
   list starts at ``logprob_start_len`` s), and the last row its first output token. A
   position also agrees when the engine's token scores within ``tolerance`` (in logits, i.e.
   log-probability) of our best, or within twice the dtype's rounding step of that logit
   (bf16: 2^-7 of it): an engine computing logits in bf16 cannot tell such tokens apart.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from eagle3_pipeline.models.config import read_text_config

# Twice the relative rounding step of the dtypes an engine may compute logits in.
_ROUNDING = {torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}


class SampleRejected(ValueError):
    """A sample failed a check: ``reason`` (short code) and ``detail`` (a sentence)."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


def check_meta(meta: dict, sent_tokens: int) -> None:
    """Fact 1: the whole prompt was computed, none of it served from a cache."""
    prompt = meta.get("prompt_tokens")
    if prompt != sent_tokens:
        raise SampleRejected("prompt_tokens", f"the engine counted {prompt} prompt tokens, {sent_tokens} were sent")
    cached = meta.get("cached_tokens", 0)
    if cached:
        raise SampleRejected(
            "cached_tokens",
            f"{cached} of {sent_tokens} tokens came from the prefix cache, so their hidden states were not "
            "computed; start the server with the radix cache off (the sglang_server role does)",
        )


def check_capture(aux: torch.Tensor, last: torch.Tensor, tokens: int, n_aux: int, hidden: int) -> None:
    """Facts 2 and 3: shapes, dtype, finiteness."""
    if tuple(last.shape) != (tokens, hidden) or tuple(aux.shape) != (tokens, n_aux * hidden):
        raise SampleRejected(
            "capture_shape",
            f"capture is aux {tuple(aux.shape)} and last {tuple(last.shape)}, expected ({tokens}, {n_aux} x {hidden}) "
            f"and ({tokens}, {hidden})",
        )
    if aux.dtype != last.dtype or not aux.dtype.is_floating_point:
        raise SampleRejected("capture_dtype", f"capture dtypes are {aux.dtype} and {last.dtype}")
    check_finite("aux_hidden_states", aux)
    check_finite("last_hidden_states", last)


def check_finite(name: str, tensor: torch.Tensor) -> None:
    """Fact 3 for one tensor: no NaN, no infinity."""
    finite = torch.isfinite(tensor)
    if not bool(finite.all()):
        bad = (~finite).nonzero()[0].tolist()
        raise SampleRejected("non_finite", f"{name} has {int((~finite).sum())} NaN/inf values, first at {bad}")


def engine_top1(meta: dict, tokens: int, start: int) -> list[int]:
    """The engine's top-1 token for rows ``start .. tokens - 1`` (see the module docstring)."""
    inputs = meta.get("input_top_logprobs") or []
    outputs = meta.get("output_top_logprobs") or []
    if len(inputs) != tokens - start or not outputs or not outputs[0]:
        raise SampleRejected(
            "logprobs",
            f"the engine returned {len(inputs)} input top-logprob entries (expected {tokens - start}) and "
            f"{len(outputs)} output ones (expected 1)",
        )
    top = []
    for j in range(1, tokens - start):
        entry = inputs[j]
        if not entry:
            raise SampleRejected("logprobs", f"no input top logprob for token {start + j}")
        top.append(int(entry[0][1]))
    top.append(int(outputs[0][0][1]))
    return top


@dataclass
class Agreement:
    """How the captured states' predictions compare with the engine's."""

    checked: int
    exact: int
    near_ties: int


def check_top1(
    last: torch.Tensor, lm_head: torch.Tensor, start: int, expected: list[int], tolerance: float
) -> Agreement:
    """Fact 4 on rows ``start..``; raises ``SampleRejected`` at the first disagreeing position."""
    if expected and max(expected) >= lm_head.shape[0]:
        raise SampleRejected(
            "logprobs", f"the engine ranked token {max(expected)} first, beyond lm_head's {lm_head.shape[0]} rows: "
            "the server runs another model than the one given (--model-path)")
    target = torch.tensor(expected, device=lm_head.device)
    # In chunks: the logits of 8k positions over a 160k vocabulary would take 5 GB at once.
    chunk = max(1, (1 << 28) // (4 * lm_head.shape[0]))
    ours_parts, margin_parts, scale_parts = [], [], []
    with torch.inference_mode():
        for lo in range(start, last.shape[0], chunk):
            rows = last[lo : lo + chunk].to(device=lm_head.device, dtype=lm_head.dtype)
            logits = (rows @ lm_head.T).float()
            want = target[lo - start : lo - start + rows.shape[0]]
            best = logits.max(-1)
            ours_parts.append(best.indices)
            margin_parts.append(best.values - logits.gather(1, want.unsqueeze(1)).squeeze(1))
            scale_parts.append(best.values.abs())
    ours, margin = torch.cat(ours_parts), torch.cat(margin_parts)
    # An engine computing logits in the captured dtype rounds them: two logits within one unit in
    # the last place of that dtype can swap, so the allowed margin grows with the logit's size.
    allowed = torch.clamp(torch.cat(scale_parts) * _ROUNDING.get(last.dtype, 0.0), min=tolerance)
    exact = ours == target
    agree = exact | (margin <= allowed)
    if not bool(agree.all()):
        bad = (~agree).nonzero()[0].item()
        raise SampleRejected(
            "top1_mismatch",
            f"{int((~agree).sum())} of {len(expected)} checked positions disagree with the engine; first at "
            f"position {start + bad}: lm_head(last_hidden_states) ranks token {int(ours[bad])} first, the engine "
            f"token {expected[bad]} ({float(margin[bad]):.3g} below ours): the capture does not belong to these "
            "tokens (wrong rows, layers or request)",
        )
    return Agreement(len(expected), int(exact.sum()), int((~exact).sum()))


def load_lm_head(model_path: str | Path, device: str = "cpu") -> torch.Tensor:
    """The target's output embedding [V, H], read alone from its safetensors (tied: the input one).

    float32 on the CPU (exact), the stored dtype on a GPU (bf16 tensor cores).
    """
    from eagle3_pipeline.models.weights import read_tensor, weight_map  # noqa: PLC0415

    model_path = Path(model_path)
    config = read_text_config(model_path)
    try:
        names = weight_map(model_path)
    except FileNotFoundError as exc:
        raise FileNotFoundError(f"{exc}: cannot read lm_head to verify") from None
    found = [name for name in names if name.endswith("lm_head.weight")]
    if not found and config.get("tie_word_embeddings", False):
        found = [name for name in names if name.endswith("embed_tokens.weight")]
    if len(found) != 1:
        raise ValueError(f"{model_path}: expected one lm_head weight among the tensors, found {found or 'none'}")
    weight = read_tensor(model_path, names, found[0])
    if device == "cpu":
        return weight.float()
    return weight.to(device)
