"""The TTT attention and the fused step's kernels, beside the drafter (``train/model.py``).

Attention at step k, row t: the step-0 keys of rows j <= t of the same packed sample (the
causal prefix, its own row included: when serving, the draft extend has cached exactly those)
and the keys of row t of steps 1..k (the draft tokens of its own chain). Nothing else: a row
never sees another row's later steps. ``ttt_attention_mask`` builds this as a boolean
[B, 1, T, (k+1)T] mask over the keys of all steps concatenated, one SDPA call per step.
Memory: the mask is B*T*(k+1)*T bytes and SDPA's masked kernels may materialise scores of
B*heads*T*(k+1)*T elements; at T = 2048, 32 heads, k = 6 that is 3.7 GB in fp32 per step, kept for
the backward. Fine for correctness and the tiny model; a flex-attention or split
(causal block + diagonal dot products) kernel is the way to cut it.

The fused path (``attention="fused"``) computes the same function on flattened rows without the
mask: flash attention over each sample's causal prefix merged through the log-sum-exp with each
row's own draft-step keys (``ttt_attention``), the SwiGLU MLP with its gradient kept small
(``_SwiGLUMLP``), and the pointwise pieces of a step, optionally compiled (``FusedKernels``; when compiled
on CUDA the soft cross-entropy is the Triton kernel of ``train/soft_ce_triton.py`` instead, unless
``EAGLE3_TRITON_SOFT_CE=0``). The RMSNorm and RoPE math shared with the drafter's modules is here too.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from eagle3_pipeline.train.model import DrafterConfig


def rope_cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [B, 1, T, head_dim] for integer positions [B, T] (neox layout: halves repeated)."""
    angles = positions.to(torch.float32)[..., None] * inv_freq.to(positions.device)  # [B, T, hd/2]
    angles = torch.cat([angles, angles], dim=-1)[:, None]  # [B, 1, T, hd]
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [B, heads, T, hd] (neox style, as SGLang's Llama: rotate the two halves)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    wide = torch.promote_types(x.dtype, torch.float32)  # bf16 rotates in float32, float64 stays float64
    return (x.to(wide) * cos.to(wide) + rotated.to(wide) * sin.to(wide)).to(x.dtype)


class RMSNorm(nn.Module):
    """Root-mean-square norm, computed in float32 (or wider), with a learned scale ``weight``."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalise the last dimension of x."""
        return rms_norm(x, self.weight, self.eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of x's last dimension in float32 (or wider), scaled by ``weight``, returned in x's dtype."""
    wide = x.to(torch.promote_types(x.dtype, torch.float32))
    wide = wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.to(wide.dtype) * wide).to(x.dtype)


def default_doc_ids(input_ids: torch.Tensor) -> torch.Tensor:
    """One packed sample per row: zeros [B, T] int64."""
    return torch.zeros(input_ids.shape, dtype=torch.int64, device=input_ids.device)


def positions_from_doc_ids(doc_ids: torch.Tensor) -> torch.Tensor:
    """Position ids [B, T] restarting at 0 where a packed sample starts (doc id changes)."""
    index = torch.arange(doc_ids.shape[1], device=doc_ids.device).expand_as(doc_ids)
    starts = torch.ones_like(doc_ids, dtype=torch.bool)
    starts[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    start_index = torch.where(starts, index, torch.zeros_like(index)).cummax(dim=1).values
    return index - start_index


def shift_left(x: torch.Tensor, n: int, fill: int | float | bool = 0) -> torch.Tensor:
    """x [B, T, ...] moved n rows to the left along dim 1 (row t gets row t + n), ``fill`` past the end."""
    if n == 0:
        return x
    out = torch.full_like(x, fill)
    if n < x.shape[1]:
        out[:, : x.shape[1] - n] = x[:, n:]
    return out


def ttt_attention_mask(doc_ids: torch.Tensor, steps: int) -> torch.Tensor:
    """The keys each row may attend to at step ``steps - 1``: bool [B, 1, T, steps*T], True = attend.

    Keys are the steps' keys concatenated (step 0's T rows first). Block 0: the causal prefix of
    the row within its packed sample, its own row included. Block i >= 1: the row's own key of
    step i only. Slicing the last dimension to (k+1)*T gives the mask of step k.
    """
    length = doc_ids.shape[1]
    device = doc_ids.device
    causal = torch.ones(length, length, dtype=torch.bool, device=device).tril()
    same_doc = doc_ids[:, :, None] == doc_ids[:, None, :]  # [B, T, T]
    eye = torch.eye(length, dtype=torch.bool, device=device).expand(doc_ids.shape[0], length, length)
    blocks = [causal & same_doc] + [eye] * (steps - 1)
    return torch.cat(blocks, dim=-1)[:, None]


# ---------------------------------------------------------------------------------------------
# The fused TTT path (``attention="fused"``): the same function as the masked-SDPA path, computed
# on flattened rows [N = B*T, ...] without the [T, K*T] mask, with the weights cast once per
# forward to the compute dtype and the activations each step keeps for the backward cut down.


@dataclass
class PackedLayout:
    """Where the packed samples of a batch start, over its flattened rows (b * T + t)."""

    cu_seqlens: torch.Tensor  # [S + 1] int32 on the rows' device: first row of each sample, then N
    max_seqlen: int  # rows of the longest sample
    segment: torch.Tensor  # [N] int64: which sample each row belongs to (0..S-1)


def packed_layout(doc_ids: torch.Tensor, device: torch.device | None = None) -> PackedLayout:
    """The layout of ``doc_ids`` [B, T]: a sample ends where the doc id changes or the batch row ends.

    Its tensors on ``device`` (default: the ids'). The number of samples decides the shape of ``cu_seqlens``,
    so ids on the GPU cost a host synchronisation (the host waits for every kernel queued before); ids still on
    the host (a batch before its copy to the GPU) cost none: the layout is copied over from pinned memory.
    """
    device = doc_ids.device if device is None else torch.device(device)
    host = doc_ids.device.type == "cpu"
    batch, length = doc_ids.shape
    flat = doc_ids.reshape(-1)
    starts = torch.ones_like(flat, dtype=torch.bool)
    starts[1:] = flat[1:] != flat[:-1]
    starts[::length] = True
    first = starts.nonzero().flatten().cpu()
    bounds = torch.cat([first, torch.tensor([flat.numel()])])
    segment = starts.long().cumsum(0) - 1
    cu_seqlens = bounds.to(torch.int32)
    if host and device.type == "cuda":
        cu_seqlens, segment = cu_seqlens.pin_memory(), segment.pin_memory()
    return PackedLayout(
        cu_seqlens=cu_seqlens.to(device, non_blocking=True),
        max_seqlen=int((bounds[1:] - bounds[:-1]).max()),
        segment=segment.to(device, non_blocking=True),
    )


def wide(x: torch.Tensor) -> torch.Tensor:
    """x in float32, or kept as is when wider (float64 in the tests)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def _use_flash(q: torch.Tensor) -> bool:
    return q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] <= 256


def _prefix_forward(q, k, v, layout: PackedLayout, scale: float):
    """Attention of each row over the step-0 keys of its sample's rows j <= t: (out [N, heads, hd], lse [N, heads]
    float32, kernel state for the backward). Flash attention (varlen, causal) on CUDA, dense math elsewhere."""
    if _use_flash(q):
        out, lse, rng, unused, _ = torch.ops.aten._flash_attention_forward(
            q, k, v, layout.cu_seqlens, layout.cu_seqlens, layout.max_seqlen, layout.max_seqlen, 0.0, True, False,
            scale=scale)
        return out, lse.t(), (rng, unused)  # the varlen kernel's lse is [heads, N]
    group = q.shape[1] // k.shape[1]
    scores = torch.einsum("nhd,mhd->hnm", q, k.repeat_interleave(group, dim=1)) * scale  # [heads, N, N]
    scores = scores.masked_fill(~_prefix_allowed(layout, q.device), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [heads, N]
    out = torch.einsum("hnm,mhd->nhd", torch.exp(scores - lse[..., None]), v.repeat_interleave(group, dim=1))
    return out, wide(lse.t()), None


def _prefix_allowed(layout: PackedLayout, device: torch.device) -> torch.Tensor:
    rows = layout.segment.numel()
    causal = torch.ones(rows, rows, dtype=torch.bool, device=device).tril()
    return causal & (layout.segment[:, None] == layout.segment[None, :])


def _prefix_backward(dout, q, k, v, out, lse, layout: PackedLayout, scale: float, state):
    """dq, dk, dv of the prefix block, given the *merged* out and lse of all the row's keys: with those, the
    kernel's probabilities are the merged softmax's and D = rowsum(dout * out) is the merged one, so these are
    exactly the prefix keys' share of the merged attention's gradient."""
    if state is not None:
        rng, unused = state
        return torch.ops.aten._flash_attention_backward(
            dout, q, k, v, out, lse.t().contiguous(), layout.cu_seqlens, layout.cu_seqlens, layout.max_seqlen,
            layout.max_seqlen, 0.0, True, rng, unused, scale=scale)
    kv_heads, group = k.shape[1], q.shape[1] // k.shape[1]
    wide_k, wide_v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.einsum("nhd,mhd->hnm", q, wide_k) * scale
    scores = scores.masked_fill(~_prefix_allowed(layout, q.device), float("-inf"))
    probs = torch.exp(scores - lse.t().to(scores.dtype)[..., None])  # [heads, N, N]
    rowsum = (dout * out).sum(-1).t()  # [heads, N]
    dscores = probs * (torch.einsum("nhd,mhd->hnm", dout, wide_v) - rowsum[..., None])
    dq = torch.einsum("hnm,mhd->nhd", dscores, wide_k) * scale
    dk = torch.einsum("hnm,nhd->mhd", dscores, q) * scale
    dv = torch.einsum("hnm,nhd->mhd", probs, dout)
    rows = q.shape[0]
    return (dq, dk.view(rows, kv_heads, group, -1).sum(2), dv.view(rows, kv_heads, group, -1).sum(2))


def diagonal_merge(q, out, lse, keys, values, scale: float):
    """Merge the prefix attention (out [N, heads, hd], lse [N, heads]) with each row's own keys and values of
    steps 1..k (keys, values [N, kv, k, hd]): the attention over all of them, and its log-sum-exp."""
    rows, kv_heads, steps, head_dim = keys.shape
    grouped = wide(q).view(rows, kv_heads, -1, 1, head_dim)  # [N, kv, group, 1, hd]
    scores = (grouped * wide(keys)[:, :, None]).sum(-1).view(rows, -1, steps) * scale  # [N, heads, k]
    merged = torch.logsumexp(torch.cat([wide(lse)[..., None], scores], dim=-1), dim=-1)  # [N, heads]
    probs = torch.exp(scores - merged[..., None]).view(rows, kv_heads, -1, steps, 1)
    own = (probs * wide(values)[:, :, None]).sum(-2).view(q.shape)  # [N, heads, hd]
    return (torch.exp(wide(lse) - merged)[..., None] * wide(out) + own).to(q.dtype), merged


def diagonal_backward(q, out, lse, dout, keys, values, scale: float):
    """The step keys' share of the merged attention's gradient: (dq to add, dkeys, dvalues [N, kv, k, hd])."""
    rows, kv_heads, steps, head_dim = keys.shape
    grouped = wide(q).view(rows, kv_heads, -1, 1, head_dim)
    scores = (grouped * wide(keys)[:, :, None]).sum(-1) * scale  # [N, kv, group, k]
    probs = torch.exp(scores - wide(lse).view(rows, kv_heads, -1, 1))
    grad_out = wide(dout).view(rows, kv_heads, -1, 1, head_dim)
    rowsum = (wide(dout) * wide(out)).sum(-1).view(rows, kv_heads, -1, 1)  # D = rowsum(dout * out)
    dscores = probs * ((grad_out * wide(values)[:, :, None]).sum(-1) - rowsum)  # [N, kv, group, k]
    dq = (dscores[..., None] * wide(keys)[:, :, None]).sum(-2).view(q.shape) * scale
    dkeys = (dscores[..., None] * grouped).sum(2) * scale  # [N, kv, k, hd]
    dvalues = (probs[..., None] * grad_out).sum(2)
    return dq, dkeys, dvalues


class _TTTAttention(torch.autograd.Function):
    """Step k's attention: the causal prefix of step-0 keys (flash) merged exactly, through the log-sum-exp,
    with the row's own keys of steps 1..k (k dot products per row). Inputs (layout, scale, kernels, q, k0, v0,
    k1, v1, ..) with q [N, heads, hd], k_i and v_i [N, kv, hd]; output [N, heads, hd]."""

    @staticmethod
    def forward(ctx, layout, scale, kernels, q, *kv):
        out, lse, state = _prefix_forward(q, kv[0], kv[1], layout, scale)
        if len(kv) > 2:
            keys, values = torch.stack(kv[2::2], dim=2), torch.stack(kv[3::2], dim=2)  # [N, kv, k, hd]
            out, lse = kernels.diagonal_merge(q, out, lse, keys, values, scale)
        ctx.layout, ctx.scale, ctx.state, ctx.kernels = layout, scale, state, kernels
        ctx.save_for_backward(q, out, lse, *kv)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, out, lse, *kv = ctx.saved_tensors
        dout = dout.contiguous()
        dq, dk0, dv0 = _prefix_backward(dout, q, kv[0], kv[1], out, lse, ctx.layout, ctx.scale, ctx.state)
        grads = [dk0, dv0]
        if len(kv) > 2:
            keys, values = torch.stack(kv[2::2], dim=2), torch.stack(kv[3::2], dim=2)
            dq_own, dkeys, dvalues = ctx.kernels.diagonal_backward(q, out, lse, dout, keys, values, ctx.scale)
            dq = (wide(dq) + dq_own).to(q.dtype)
            for step in range(keys.shape[2]):
                grads += [dkeys[:, :, step].to(q.dtype), dvalues[:, :, step].to(q.dtype)]
        return (None, None, None, dq, *grads)


def ttt_attention(q: torch.Tensor, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor],
                  layout: PackedLayout, scale: float, kernels: FusedKernels | None = None) -> torch.Tensor:
    """The TTT attention of one step on flattened rows (see ``ttt_attention_mask`` for the pattern).

    ``q`` [N, heads, hd] of step k, ``keys``/``values`` the k+1 steps' [N, kv, hd] so far. Memory is
    O(N) beyond the inputs (flash kernel for the prefix), not the masked path's O(heads * N * (k+1)N).
    """
    pairs = [t for pair in zip(keys, values) for t in pair]
    return _TTTAttention.apply(layout, scale, kernels or EAGER_KERNELS, q, *pairs)


def swiglu_act(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of [gate | up] [N, 2I], in float32, rounded once to the input's dtype."""
    gate, up = wide(gate_up).chunk(2, dim=-1)
    return (F.silu(gate) * up).to(gate_up.dtype)


def swiglu_act_backward(gate_up: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """d[gate | up] of ``swiglu_act`` given the gradient of its output [N, I]."""
    gate, up = wide(gate_up).chunk(2, dim=-1)
    sig = torch.sigmoid(gate)
    grad = wide(grad)
    return torch.cat([grad * up * sig * (1 + gate * (1 - sig)), grad * gate * sig], dim=-1).to(gate_up.dtype)


class MLPGradients:
    """The MLP weight gradients of one forward's steps, summed by the backward matmuls themselves (C += A @ B
    in the epilogue, no separate add of two [2I, H] tensors per step) and handed to autograd by the last of
    the steps' backwards (step 0's: it needs every later step's gradient first)."""

    def __init__(self, users: int):
        self.pending = users
        self.sums: dict[str, torch.Tensor] = {}

    def add(self, name: str, a: torch.Tensor, b: torch.Tensor) -> None:
        total = self.sums.get(name)
        self.sums[name] = torch.mm(a, b) if total is None else total.addmm_(a, b)

    def release(self) -> tuple[torch.Tensor, torch.Tensor] | tuple[None, None]:
        self.pending -= 1
        if self.pending:
            return None, None
        sums, self.sums = self.sums, {}
        return sums["gate_up"], sums["down"]


class _SwiGLUMLP(torch.autograd.Function):
    """down(silu(gate(h)) * up(h)) with [gate; up] stacked; keeps h and, unless ``recompute``, the [N, 2I]
    gate/up output for the backward (with ``recompute`` the backward redoes that one matmul instead).
    The weight gradients go through ``gradients`` (an ``MLPGradients`` shared by the steps)."""

    @staticmethod
    def forward(ctx, h, w_gate_up, w_down, recompute, kernels, gradients):
        gate_up = F.linear(h, w_gate_up)  # [N, 2I]
        y = F.linear(kernels.act(gate_up), w_down)  # [N, H]
        ctx.kernels, ctx.gradients = kernels, gradients
        ctx.save_for_backward(h, w_gate_up, w_down, *(() if recompute else (gate_up,)))
        return y

    @staticmethod
    def backward(ctx, dy):
        h, w_gate_up, w_down, *kept = ctx.saved_tensors
        gate_up = kept[0] if kept else F.linear(h, w_gate_up)
        act = ctx.kernels.act(gate_up)
        ctx.gradients.add("down", dy.t(), act)  # [H, I]
        del act
        dgate_up = ctx.kernels.act_backward(gate_up, dy @ w_down)  # [N, 2I]
        del gate_up
        ctx.gradients.add("gate_up", dgate_up.t(), h)  # [2I, H]
        d_gate_up, d_down = ctx.gradients.release()
        return dgate_up @ w_gate_up, d_gate_up, d_down, None, None, None


def soft_ce_rows(logits: torch.Tensor, teacher_logits: torch.Tensor, row_weight: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row of logits [n, D] against the teacher's logits [n, D]: soft CE [n] float32, its gradient scaled
    by ``row_weight`` [n] in the logits' dtype, and the argmax [n]."""
    scores = wide(logits)
    log_p = scores - torch.logsumexp(scores, dim=-1, keepdim=True)
    target = torch.softmax(wide(teacher_logits), dim=-1)
    ce = -(target * log_p).sum(-1)
    grad = ((torch.exp(log_p) - target) * row_weight[:, None]).to(logits.dtype)
    return ce, grad, scores.argmax(-1)


class FusedKernels:
    """The pointwise pieces of a fused step for one drafter shape, optionally ``torch.compile``d (then a step's
    norms, RoPE and residuals are a few kernels, and the compiled backward recomputes the cheap ones)."""

    def __init__(self, config: DrafterConfig, compile: bool = False):
        heads, kv_heads, head_dim, eps = (config.num_attention_heads, config.num_key_value_heads, config.head_dim,
                                          config.rms_norm_eps)
        sizes = [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim]

        def pre(embeds, hidden, w_input_norm, w_hidden_norm, w_qkv, positions, inv_freq):
            # [N, H] x2 -> q [N, heads, hd], k and v [N, kv, hd] of step k, RoPE at ``positions``
            x = torch.cat([rms_norm(embeds, w_input_norm, eps), rms_norm(hidden, w_hidden_norm, eps)], dim=-1)
            q, k, v = F.linear(x, w_qkv).split(sizes, dim=-1)
            cos, sin = rope_cos_sin(inv_freq, positions)  # [N, 1, hd]
            rows = x.shape[0]
            return (apply_rope(q.reshape(rows, heads, head_dim), cos, sin),
                    apply_rope(k.reshape(rows, kv_heads, head_dim), cos, sin),
                    v.reshape(rows, kv_heads, head_dim).contiguous())

        def mid(attn, hidden, w_o, w_post_norm):
            residual = hidden + F.linear(attn, w_o)  # [N, H]
            return residual, rms_norm(residual, w_post_norm, eps)

        def post(residual, mlp_out, w_norm):
            out = residual + mlp_out  # the next step's hidden state
            return out, rms_norm(out, w_norm, eps)  # what the lm_head reads

        wrap = torch.compile if compile else (lambda fn, **_: fn)
        self.pre, self.mid, self.post = wrap(pre), wrap(mid), wrap(post)
        self.act, self.act_backward = wrap(swiglu_act), wrap(swiglu_act_backward)
        self.diagonal_merge, self.diagonal_backward = wrap(diagonal_merge), wrap(diagonal_backward)
        compiled_soft_ce, triton_soft_ce = wrap(soft_ce_rows), triton_soft_ce_rows() if compile else None
        self.soft_ce = compiled_soft_ce if triton_soft_ce is None else CheckedSoftCE(triton_soft_ce, compiled_soft_ce)
        self.compiled = compile


class CheckedSoftCE:
    """A faster soft CE (``candidate``) where the logits are on CUDA, checked once against ``reference`` (same
    signature and results as ``soft_ce_rows``): its first call computes both and compares them (the CE, the argmax,
    the gradient within the logits' rounding); a difference or an error there warns, names it, and leaves the
    reference in its place for good. On other devices than ``devices``, and after a failed check, the reference."""

    def __init__(self, candidate, reference, devices: tuple[str, ...] = ("cuda",)):
        self.candidate, self.reference, self.devices = candidate, reference, devices
        self.checked = False
        self.failure: str | None = None

    def __call__(self, logits, teacher_logits, row_weight):
        if self.failure is not None or logits.device.type not in self.devices:
            return self.reference(logits, teacher_logits, row_weight)
        if self.checked:
            return self.candidate(logits, teacher_logits, row_weight)
        self.checked = True
        want = self.reference(logits, teacher_logits, row_weight)
        try:
            got = self.candidate(logits, teacher_logits, row_weight)
            self.failure = soft_ce_difference(got, want, logits)
        except Exception as exc:  # noqa: BLE001 - any failure of the candidate means: use the reference
            self.failure = f"{type(exc).__name__}: {exc}"
        if self.failure is None:
            return got
        warnings.warn(f"the faster soft cross-entropy kernel is off, the compiled one trains instead: {self.failure}",
                      RuntimeWarning, stacklevel=2)
        return want


CHECK_ROWS = 1024  # rows of the gradients compared at a time by soft_ce_difference


def soft_ce_difference(got, want, logits: torch.Tensor) -> str | None:
    """How two ``soft_ce_rows`` results (ce, grad, argmax) of ``logits`` differ beyond rounding, or None (two argmaxes
    of equal logits are the same answer)."""
    (ce, grad, top), (want_ce, want_grad, want_top) = got, want
    if ce.shape != want_ce.shape or grad.shape != want_grad.shape or grad.dtype != want_grad.dtype:
        return f"shapes or dtypes differ: {tuple(ce.shape)}/{tuple(grad.shape)} {grad.dtype} against " \
               f"{tuple(want_ce.shape)}/{tuple(want_grad.shape)} {want_grad.dtype}"
    ce_error = ((ce - want_ce).abs() / want_ce.abs().clamp_min(1.0)).max().item() if ce.numel() else 0.0
    grad_error = 0.0
    if grad.numel():
        # Row blocks: float32 copies of whole [T, V] gradients would raise the first step's peak memory by GBs.
        scale, largest = want_grad.new_zeros((), dtype=torch.float32), want_grad.new_zeros((), dtype=torch.float32)
        for start in range(0, grad.shape[0], CHECK_ROWS):
            block, want_block = grad[start:start + CHECK_ROWS].float(), want_grad[start:start + CHECK_ROWS].float()
            scale = torch.maximum(scale, want_block.abs().max())
            largest = torch.maximum(largest, (block - want_block).abs().max())
        grad_error = (largest / scale.clamp_min(1e-12)).item()
    rows = torch.arange(logits.shape[0], device=logits.device)
    mismatched = int(((top != want_top) & (logits[rows, top] != logits[rows, want_top])).sum())
    grad_allowed = 1e-5 if logits.dtype == torch.float32 else 2**-6
    if not (ce_error <= 1e-4 and grad_error <= grad_allowed and mismatched == 0):
        return (f"CE differs by {ce_error:.3g} (allowed 1e-4), the gradient by {grad_error:.3g} of its largest value "
                f"(allowed {grad_allowed:.3g}), the argmax in {mismatched} rows")
    return None


_KERNELS: dict[tuple, FusedKernels] = {}
# "0" turns the Triton soft CE off (the compiled ``soft_ce_rows`` instead): for side-by-side measurements.
TRITON_SOFT_CE_ENV = "EAGLE3_TRITON_SOFT_CE"


def triton_soft_ce_rows():
    """``soft_ce_rows`` as one Triton kernel (``train/soft_ce_triton.py``), or None where Triton cannot be imported
    or ``EAGLE3_TRITON_SOFT_CE`` is 0."""
    if os.environ.get(TRITON_SOFT_CE_ENV, "1") == "0":
        return None
    try:
        from eagle3_pipeline.train.soft_ce_triton import soft_ce_rows as kernel  # noqa: PLC0415
    except ImportError:
        return None
    return kernel


class _EagerKernels:
    """The shape-free pieces, uncompiled (what ``ttt_attention`` uses when given no kernels)."""

    diagonal_merge = staticmethod(diagonal_merge)
    diagonal_backward = staticmethod(diagonal_backward)


EAGER_KERNELS = _EagerKernels()


def fused_kernels(config: DrafterConfig, compile: bool = False) -> FusedKernels:
    """The (cached) ``FusedKernels`` of a drafter shape."""
    key = (config.num_attention_heads, config.num_key_value_heads, config.head_dim, config.rms_norm_eps, compile)
    if key not in _KERNELS:
        _KERNELS[key] = FusedKernels(config, compile)
    return _KERNELS[key]
