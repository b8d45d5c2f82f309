"""The EAGLE-3 drafter, its training-time-test (TTT) forward, the teacher, the loss and the metrics.

The module names are SGLang's checkpoint names for ``LlamaForCausalLMEagle3`` (sglang 0.5.23,
``srt/models/llama_eagle3.py``), so ``state_dict()`` minus ``embed_tokens.weight`` is what the
exporter writes:

    embed_tokens.weight                         [V, H]    the target's, frozen (SGLang replaces it with
                                                          the target's own at load, so it is not exported)
    fc.weight                                   [H, n_aux*H_t]
    midlayer.input_layernorm.weight             [H]       RMSNorm of the token embeddings
    midlayer.hidden_norm.weight                 [H]       RMSNorm of the hidden state
    midlayer.self_attn.{q,k,v}_proj.weight      [heads*hd | kv*hd, 2H]  input [norm(emb); norm(hidden)]
    midlayer.self_attn.o_proj.weight            [H, heads*hd]
    midlayer.post_attention_layernorm.weight    [H]
    midlayer.mlp.{gate,up}_proj.weight          [I, H]
    midlayer.mlp.down_proj.weight               [H, I]
    norm.weight                                 [H]
    lm_head.weight                              [D, H]
    d2t [D] int64, t2d [V] bool                 buffers (see ``train/vocab.py``)

SGLang renames ``midlayer`` to ``layers.0`` and stacks q/k/v and gate/up itself; no projection
has a bias. One step of the layer, as SGLang's forward runs it (pre-norm, two residuals)::

    x   = cat[input_layernorm(emb), hidden_norm(h)]        # [.., 2H], embeddings first
    r   = h + o_proj(attention(x))
    out = r + mlp(post_attention_layernorm(r))             # the hidden state the next step gets
    logits = lm_head(norm(out))                            # [.., D]

Alignment. A sample has tokens x_0..x_{T-1}; a_t are the target's aux hidden states after
reading x_0..x_t; l_t its last hidden state, whose lm_head gives q_t, the target's distribution
of x_{t+1}; m_t is the loss mask (1 when x_t is an assistant token). At TTT step k (0-based) the
row t of every tensor is one draft chain anchored at t:

    step k, row t  hidden in               token in   RoPE pos  predicts   teacher    mask
    k = 0          fc(a_t)                 x_{t+1}    p_t       x_{t+2}    q_{t+1}    m_{t+2} & in_draft(t+1)
    k >= 1         out of step k-1, row t  x_{t+1+k}  p_t + k   x_{t+2+k}  q_{t+1+k}  m_{t+2+k} & in_draft(t+1+k)

which is what SGLang does when serving: after the target verified x_{t+1} (its own top-1 at t),
the draft extend pairs a_t with x_{t+1} at position t, and each draft step adds one to the
position and feeds the previous step's ``out`` with the token just proposed (here the data's
token, the teacher-forced form SpecForge uses). Reasons for the choices:

- the mask uses m at the predicted token (t+2+k): the drafter is scored on tokens the target
  generates when serving; in_draft(s) says the target's top-1 at s is in the draft vocabulary
  (the drafter cannot propose anything else, so there is nothing to learn there);
- rows whose predicted token lies past the end of the sample (t + 2 + k >= T) or in another
  packed sample have no teacher and are masked; their inputs (shifted past the end) are id 0;
- positions advance by ``position_step`` (1) per step, as SGLang's draft decode and
  speculators do; SpecForge keeps them fixed (``position_step=0`` reproduces that). RoPE only
  sees differences, so the query of step k at row t is k + (t - j) from the step-0 key of row j.

Attention at step k, row t: the step-0 keys of rows j <= t of the same packed sample (the
causal prefix, its own row included: when serving, the draft extend has cached exactly those)
and the keys of row t of steps 1..k (the draft tokens of its own chain). Nothing else: a row
never sees another row's later steps. ``ttt_attention_mask`` builds this as a boolean
[B, 1, T, (k+1)T] mask over the keys of all steps concatenated, one SDPA call per step.
Memory: the mask is B*T*(k+1)*T bytes and SDPA's masked kernels may materialise scores of
B*heads*T*(k+1)*T elements; at T = 2048, 32 heads, k = 6 that is 3.7 GB in fp32 per step, kept for
the backward. Fine for correctness and the tiny model; a flex-attention or split
(causal block + diagonal dot products) kernel is the way to cut it.

Loss: sum_k 0.8^k * CE_k, CE_k the soft cross-entropy -sum_d q(d) log softmax(logits)(d) averaged
over the rows whose step-k mask is set (``denominators`` lets DDP divide by the global count).
Metrics per step: acc_k = top-1 agreement over the masked rows; conditional acc_k = agreement at
step k among rows whose chain was right at steps 0..k-1 (rows where the target's top-1 is out of
the draft vocabulary count as misses, as when serving); simulated acceptance length
sum_k prod_{i<=k} cond_acc_i, the expected number of draft tokens accepted per verify (SGLang's
reported accept length adds the target's own token: 1 + this).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import torch
import torch.nn.functional as F
from torch import nn

from eagle3_pipeline.train.vocab import check_mapping, resolve_draft_vocab_size

DEFAULT_TTT_LENGTH = 7
TEACHER_CHUNK_BYTES = 128 << 20
STEP_DECAY = 0.8
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
SUPPORTED_ACTIVATIONS = {"silu": F.silu}
ATTENTION_IMPLS = ("sdpa", "fused")


class DrafterConfigError(ValueError):
    """A drafter configuration that cannot be built; the message names the field."""


@dataclass
class DrafterConfig:
    """The drafter's shape; ``from_target`` derives it from the target's ``config.json``."""

    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    target_hidden_size: int
    num_aux_hidden_states: int
    vocab_size: int
    draft_vocab_size: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 8192
    hidden_act: str = "silu"

    def __post_init__(self) -> None:
        for name in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size",
                     "target_hidden_size", "num_aux_hidden_states", "vocab_size", "draft_vocab_size",
                     "max_position_embeddings"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise DrafterConfigError(f"drafter config: {name} must be a positive integer, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise DrafterConfigError(
                f"drafter config: num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim % 2:
            raise DrafterConfigError(f"drafter config: head_dim must be even for RoPE, got {self.head_dim}")
        resolve_draft_vocab_size(self.vocab_size, self.draft_vocab_size)
        if self.hidden_act not in SUPPORTED_ACTIVATIONS:
            raise DrafterConfigError(
                f"drafter config: hidden_act {self.hidden_act!r} is not supported "
                f"(only {', '.join(SUPPORTED_ACTIVATIONS)})"
            )
        rope_type = rope_type_of(self.rope_scaling)
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise DrafterConfigError(
                f"drafter config: rope type {rope_type!r} is not supported (only {', '.join(SUPPORTED_ROPE_TYPES)})"
            )

    @classmethod
    def from_target(
        cls,
        target_config: dict,
        n_aux: int = 3,
        draft_vocab_size: int | None = None,
        *,
        hidden_size: int | None = None,
        num_attention_heads: int | None = None,
        num_key_value_heads: int | None = None,
        head_dim: int | None = None,
        intermediate_size: int | None = None,
    ) -> DrafterConfig:
        """The drafter for a target (its ``config.json`` as a dict), with optional overrides.

        Hidden size, heads, KV heads, MLP width, RoPE, RMS eps, activation and maximum positions
        come from the target (a multimodal target's ``text_config`` when the top level has no
        ``hidden_size``). ``head_dim`` is the target's only when neither the hidden size nor the
        heads are overridden, else hidden_size // heads.
        """
        config = target_config
        if "hidden_size" not in config and isinstance(config.get("text_config"), dict):
            config = config["text_config"]
        for key in ("hidden_size", "num_attention_heads", "vocab_size"):
            if key not in config:
                raise DrafterConfigError(f"target config has no {key!r}; is it a decoder-only language model's?")
        target_hidden = config["hidden_size"]
        heads = num_attention_heads or config["num_attention_heads"]
        # An overridden head count keeps the target's KV heads; __post_init__ refuses a pair that does not divide.
        kv_heads = num_key_value_heads or config.get("num_key_value_heads") or config["num_attention_heads"]
        hidden = hidden_size or target_hidden
        if head_dim is None:
            reshaped = hidden_size is not None or num_attention_heads is not None
            head_dim = hidden // heads if reshaped or not config.get("head_dim") else config["head_dim"]
        if intermediate_size is None:
            intermediate_size = config.get("intermediate_size") or 4 * hidden
        rope_theta, rope_scaling = _rope_from_target(config)
        vocab_size = config["vocab_size"]
        return cls(
            hidden_size=hidden,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            intermediate_size=intermediate_size,
            target_hidden_size=target_hidden,
            num_aux_hidden_states=n_aux,
            vocab_size=vocab_size,
            draft_vocab_size=resolve_draft_vocab_size(vocab_size, draft_vocab_size),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-5)),
            rope_theta=float(rope_theta),
            rope_scaling=rope_scaling,
            max_position_embeddings=int(config.get("max_position_embeddings", 8192)),
            hidden_act=config.get("hidden_act", "silu"),
        )


def _rope_from_target(config: dict) -> tuple[float, dict | None]:
    """(theta, scaling) from either transformers 5's ``rope_parameters`` or ``rope_theta``/``rope_scaling``."""
    params = config.get("rope_parameters")
    if isinstance(params, dict):
        theta = params.get("rope_theta", config.get("rope_theta", 10000.0))
        scaling = None if rope_type_of(params) == "default" else dict(params)
        return theta, scaling
    scaling = config.get("rope_scaling")
    return config.get("rope_theta", 10000.0), dict(scaling) if scaling else None


def rope_type_of(scaling: dict | None) -> str:
    """The RoPE type a scaling dict names (``rope_type``, or the older ``type``); none is 'default'."""
    if not scaling:
        return "default"
    return str(scaling.get("rope_type", scaling.get("type", "default")))


def rope_inv_freq(config: DrafterConfig) -> torch.Tensor:
    """The RoPE inverse frequencies [head_dim / 2], float32, with the config's scaling applied."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    scaling = config.rope_scaling or {}
    rope_type = rope_type_of(scaling)
    if rope_type == "linear":
        inv_freq = inv_freq / float(scaling["factor"])
    elif rope_type == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_context = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        # Long wavelengths are slowed by the factor, short ones kept, the band between blended.
        smooth = (old_context / wavelen - low) / (high - low)
        blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        inv_freq = torch.where(wavelen > old_context / low, inv_freq / factor,
                               torch.where(wavelen < old_context / high, inv_freq, blended))
    return inv_freq.to(torch.float32)


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


class Eagle3Attention(nn.Module):
    """The midlayer's attention: q/k/v read 2H ([norm(emb); norm(hidden)]), o_proj writes H."""

    def __init__(self, config: DrafterConfig):
        super().__init__()
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        width = 2 * config.hidden_size
        self.q_proj = nn.Linear(width, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(width, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(width, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, config.hidden_size, bias=False)

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [B, heads, T, hd], k and v [B, kv_heads, T, hd] of x [B, T, 2H], RoPE applied to q and k."""
        batch, length, _ = x.shape
        q = self.q_proj(x).view(batch, length, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(batch, length, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(batch, length, self.kv_heads, self.head_dim).transpose(1, 2)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


class Eagle3MLP(nn.Module):
    """The Llama MLP: down(act(gate(x)) * up(x))."""

    def __init__(self, config: DrafterConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.act = SUPPORTED_ACTIVATIONS[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The MLP of x [.., H]."""
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class Eagle3MidLayer(nn.Module):
    """The drafter's one decoder layer, under SGLang's names (``midlayer.*``)."""

    def __init__(self, config: DrafterConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Eagle3Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = Eagle3MLP(config)

    def attention_input(self, embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """[input_layernorm(embeds); hidden_norm(hidden)], [B, T, 2H], embeddings first as in SGLang."""
        return torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)

    def finish(self, hidden: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """The layer's output from its input hidden [B, T, H] and the attention's [B, T, heads*hd]."""
        residual = hidden + self.self_attn.o_proj(attn)
        return residual + self.mlp(self.post_attention_layernorm(residual))


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


def packed_layout(doc_ids: torch.Tensor) -> PackedLayout:
    """The layout of ``doc_ids`` [B, T]: a sample ends where the doc id changes or the batch row ends.

    One host synchronisation (the number of samples decides the shape of ``cu_seqlens``).
    """
    batch, length = doc_ids.shape
    flat = doc_ids.reshape(-1)
    starts = torch.ones_like(flat, dtype=torch.bool)
    starts[1:] = flat[1:] != flat[:-1]
    starts[::length] = True
    first = starts.nonzero().flatten().cpu()
    bounds = torch.cat([first, torch.tensor([flat.numel()])])
    return PackedLayout(
        cu_seqlens=bounds.to(torch.int32).to(doc_ids.device, non_blocking=True),
        max_seqlen=int((bounds[1:] - bounds[:-1]).max()),
        segment=starts.long().cumsum(0) - 1,
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
        self.soft_ce = wrap(soft_ce_rows)
        self.compiled = compile


_KERNELS: dict[tuple, FusedKernels] = {}


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


class Eagle3Drafter(nn.Module):
    """The EAGLE-3 drafter (SGLang's ``LlamaForCausalLMEagle3`` weights) with its TTT forward."""

    def __init__(self, config: DrafterConfig, d2t: torch.Tensor | None = None, t2d: torch.Tensor | None = None):
        super().__init__()
        self.config = config
        if (d2t is None) != (t2d is None):
            raise DrafterConfigError("give both d2t and t2d, or neither (the first draft_vocab_size target ids)")
        if d2t is None:
            d2t = torch.zeros(config.draft_vocab_size, dtype=torch.int64)
            t2d = torch.zeros(config.vocab_size, dtype=torch.bool)
            t2d[: config.draft_vocab_size] = True
        check_mapping(d2t, t2d, config.vocab_size)
        if d2t.numel() != config.draft_vocab_size:
            raise DrafterConfigError(f"d2t has {d2t.numel()} entries, the config's draft_vocab_size is "
                                     f"{config.draft_vocab_size}")
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)
        self.fc = nn.Linear(config.num_aux_hidden_states * config.target_hidden_size, config.hidden_size, bias=False)
        self.midlayer = Eagle3MidLayer(config)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.draft_vocab_size, bias=False)
        self.register_buffer("d2t", d2t.clone())
        self.register_buffer("t2d", t2d.clone())
        self.register_buffer("inv_freq", rope_inv_freq(config), persistent=False)

    @torch.no_grad()
    def load_target_embeddings(self, weight: torch.Tensor) -> None:
        """Copy the target's input embeddings [V, H] into the frozen ``embed_tokens``."""
        if tuple(weight.shape) != tuple(self.embed_tokens.weight.shape):
            raise DrafterConfigError(f"target embeddings have shape {tuple(weight.shape)}, the drafter expects "
                                     f"{tuple(self.embed_tokens.weight.shape)} (vocab_size, hidden_size)")
        self.embed_tokens.weight.copy_(weight)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits [.., D] of a step's output hidden state [.., H]."""
        return self.lm_head(self.norm(hidden))

    def forward(self, *args, **kwargs) -> list[torch.Tensor]:
        """``forward_ttt`` (what DDP/FSDP wrappers call)."""
        return self.forward_ttt(*args, **kwargs)

    @torch.no_grad()
    def keep_embeddings_on_host(self, dtype: torch.dtype = torch.bfloat16) -> None:
        """Move the frozen ``embed_tokens`` to pinned host memory in ``dtype``; ``token_embeddings`` gathers the
        batch's rows there. Saves V*H*4 bytes of GPU memory (2.1 GB for Llama-3.1-8B's 128256 x 4096); with the
        target's bf16 embeddings and a bf16 forward (which rounds the rows to bf16 anyway) nothing changes."""
        weight = self.embed_tokens.weight
        if weight.requires_grad:
            raise DrafterConfigError("embed_tokens is trained (the drafter's hidden size differs from the target's): "
                                     "it stays on the device")
        host = weight.detach().to("cpu", dtype)
        weight.data = host.pin_memory() if torch.cuda.is_available() else host
        # DDP would broadcast it and check that every parameter sits on one device type.
        self._ddp_params_and_buffers_to_ignore = ["embed_tokens.weight"]

    def token_embeddings(self, input_ids: torch.Tensor, ttt_length: int, device: torch.device | None = None,
                         dtype: torch.dtype | None = None) -> torch.Tensor:
        """[B, T + ttt_length, H]: the embeddings of ``input_ids`` [B, T], then ``ttt_length`` rows of id 0's (what
        rows shifted past the end read), on ``device`` (default: the ids'), gathered where the table lives."""
        weight = self.embed_tokens.weight
        device = torch.device(device) if device is not None else input_ids.device
        ids = torch.cat([input_ids, input_ids.new_zeros(input_ids.shape[0], ttt_length)], dim=1)
        rows = F.embedding(ids.to(weight.device), weight)
        if rows.device != device:
            if rows.device.type == "cpu" and device.type == "cuda":
                rows = rows.pin_memory()
            rows = rows.to(device, non_blocking=True)
        return rows if dtype is None else rows.to(dtype)

    def forward_ttt(
        self,
        input_ids: torch.Tensor,
        aux_hidden: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        ttt_length: int = DEFAULT_TTT_LENGTH,
        doc_ids: torch.Tensor | None = None,
        position_step: int = 1,
        *,
        attention: str = "sdpa",
        compute_dtype: torch.dtype | None = None,
        token_embeds: torch.Tensor | None = None,
        mlp_recompute_steps: int = 0,
        compile: bool = False,
        head: bool = True,
    ) -> list[torch.Tensor]:
        """Unroll ``ttt_length`` draft steps; the logits [B, T, D] of each (see the module docstring).

        ``input_ids`` [B, T] are the stored target token ids (unshifted: row t holds x_t),
        ``aux_hidden`` [B, T, n_aux*H_t] the stored aux states, ``position_ids`` [B, T] the
        target's positions (default: restarting at each packed sample), ``doc_ids`` [B, T] which
        packed sample each row belongs to (non-negative, contiguous runs; default one per row).

        ``attention``: ``"sdpa"`` (the reference: one masked SDPA per step over all steps' keys) or
        ``"fused"`` (``forward_fused``: the same function, fast and O(T) in memory; then
        ``compute_dtype`` (default: the autocast dtype if autocast is on, else the weights'),
        ``token_embeds`` (``token_embeddings``' output, default computed here), ``mlp_recompute_steps``
        (the first that many steps redo the MLP's gate/up matmul in the backward instead of keeping
        its [T, 2I] output), ``compile`` (``torch.compile`` the pointwise parts) and ``head`` (False:
        return each step's normed hidden state [B, T, H], what the lm_head reads, for ``fused_ttt_loss``)).
        """
        if ttt_length < 1:
            raise ValueError(f"ttt_length must be at least 1, got {ttt_length}")
        if input_ids.dim() != 2 or aux_hidden.shape[:2] != input_ids.shape:
            raise ValueError(f"input_ids {tuple(input_ids.shape)} and aux_hidden {tuple(aux_hidden.shape)} "
                             "must be [B, T] and [B, T, n_aux*H]")
        if attention not in ATTENTION_IMPLS:
            raise ValueError(f"attention must be one of {ATTENTION_IMPLS}, got {attention!r}")
        if doc_ids is None:
            doc_ids = default_doc_ids(input_ids)
        if position_ids is None:
            position_ids = positions_from_doc_ids(doc_ids)
        if attention == "fused":
            return self.forward_fused(input_ids, aux_hidden, position_ids, ttt_length, doc_ids, position_step,
                                      compute_dtype=compute_dtype, token_embeds=token_embeds,
                                      mlp_recompute_steps=mlp_recompute_steps, compile=compile, head=head)
        if not head:
            raise ValueError("head=False (normed hidden states instead of logits) needs attention='fused'")
        mask = ttt_attention_mask(doc_ids, ttt_length)  # [B, 1, T, K*T]
        length = input_ids.shape[1]
        attn = self.midlayer.self_attn
        hidden = self.fc(aux_hidden.to(self.fc.weight.dtype))  # [B, T, H]
        keys: list[torch.Tensor] = []
        values: list[torch.Tensor] = []
        step_logits = []
        for step in range(ttt_length):
            embeds = self.embed_tokens(shift_left(input_ids, 1 + step)).to(hidden.dtype)  # [B, T, H]: x_{t+1+k}
            cos, sin = rope_cos_sin(self.inv_freq, position_ids + step * position_step)
            q, k, v = attn.project(self.midlayer.attention_input(embeds, hidden), cos, sin)
            keys.append(k)
            values.append(v)
            out = F.scaled_dot_product_attention(
                q, torch.cat(keys, dim=2), torch.cat(values, dim=2),
                attn_mask=mask[..., : (step + 1) * length],
                enable_gqa=attn.kv_heads != attn.heads,
            )  # [B, heads, T, hd]
            out = out.transpose(1, 2).reshape(input_ids.shape[0], length, attn.heads * attn.head_dim)
            hidden = self.midlayer.finish(hidden, out)  # [B, T, H], the next step's hidden state
            step_logits.append(self.logits(hidden))
        return step_logits

    def forward_fused(
        self,
        input_ids: torch.Tensor,
        aux_hidden: torch.Tensor,
        position_ids: torch.Tensor,
        ttt_length: int,
        doc_ids: torch.Tensor,
        position_step: int = 1,
        *,
        compute_dtype: torch.dtype | None = None,
        token_embeds: torch.Tensor | None = None,
        mlp_recompute_steps: int = 0,
        compile: bool = False,
        head: bool = True,
    ) -> list[torch.Tensor]:
        """``forward_ttt`` on flattened rows [N = B*T], the weights cast once to ``compute_dtype``.

        Per step: norms + [q;k;v] matmul + RoPE (``FusedKernels.pre``), ``ttt_attention`` (flash over the
        step-0 prefix merged with the row's own step keys), o_proj + residual + norm, the SwiGLU MLP with
        [gate; up] stacked (``_SwiGLUMLP``), residual + final norm. Runs outside autocast: the weights are
        cast here, as autocast would, and the activations stay in ``compute_dtype``.
        """
        if compute_dtype is None:
            device_type = input_ids.device.type
            compute_dtype = (torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type)
                             else self.fc.weight.dtype)
        batch, length = input_ids.shape
        rows = batch * length
        layer, attn = self.midlayer, self.midlayer.self_attn
        kernels = fused_kernels(self.config, compile)

        def cast(weight: torch.Tensor) -> torch.Tensor:
            return weight if weight.dtype == compute_dtype else weight.to(compute_dtype)

        with torch.autocast(input_ids.device.type, enabled=False):
            layout = packed_layout(doc_ids)
            if token_embeds is None:
                token_embeds = self.token_embeddings(input_ids, ttt_length)
            token_embeds = token_embeds.to(device=input_ids.device, dtype=compute_dtype)  # [B, T + K, H]
            # One cast per forward, shared by the steps (autocast's weight cache does the same).
            w_qkv = torch.cat([cast(attn.q_proj.weight), cast(attn.k_proj.weight), cast(attn.v_proj.weight)])
            w_o = cast(attn.o_proj.weight)
            w_gate_up = torch.cat([cast(layer.mlp.gate_proj.weight), cast(layer.mlp.up_proj.weight)])
            w_down = cast(layer.mlp.down_proj.weight)
            hidden = F.linear(aux_hidden.reshape(rows, -1).to(compute_dtype), cast(self.fc.weight))  # [N, H]
            positions = position_ids.reshape(rows)
            scale = 1.0 / math.sqrt(attn.head_dim)
            keys: list[torch.Tensor] = []
            values: list[torch.Tensor] = []
            outputs = []
            mlp_gradients = MLPGradients(ttt_length)
            for step in range(ttt_length):
                embeds = token_embeds[:, 1 + step: 1 + step + length].reshape(rows, -1)  # x_{t+1+k}
                q, k, v = kernels.pre(embeds, hidden, layer.input_layernorm.weight, layer.hidden_norm.weight, w_qkv,
                                      positions + step * position_step, self.inv_freq)
                keys.append(k)
                values.append(v)
                out = ttt_attention(q, keys, values, layout, scale, kernels).reshape(rows, -1)  # [N, heads*hd]
                residual, normed = kernels.mid(out, hidden, w_o, layer.post_attention_layernorm.weight)
                mlp_out = _SwiGLUMLP.apply(normed, w_gate_up, w_down, step < mlp_recompute_steps, kernels,
                                           mlp_gradients)
                hidden, normed = kernels.post(residual, mlp_out, self.norm.weight)
                normed = normed.view(batch, length, -1)
                outputs.append(F.linear(normed, cast(self.lm_head.weight)) if head else normed)
        return outputs


@dataclass
class TeacherTargets:
    """The target's view of a batch, unshifted: row s is the target's distribution of token s + 1.

    ``step(k)`` gives the rows of step k: row t of the drafter's step-k logits is scored against
    row t + 1 + k here, for x_{t+2+k}.
    """

    logits: torch.Tensor  # [B, T, D] the target's logits restricted to the draft vocabulary, in the matmul's dtype
    argmax: torch.Tensor  # [B, T] int64, draft id of the target's top-1 (meaningless where not in_draft)
    in_draft: torch.Tensor  # [B, T] bool, the target's top-1 over its full vocabulary is in the draft vocabulary
    loss_mask: torch.Tensor  # [B, T] bool, x_s is an assistant token
    doc_ids: torch.Tensor  # [B, T] int64, packed sample of each row

    @cached_property
    def probs(self) -> torch.Tensor:
        """[B, T, D] float32: the soft targets, softmax of ``logits`` (``fused_ttt_loss`` computes them per chunk
        instead, so that the [B, T, D] float32 tensor never exists)."""
        return torch.softmax(self.logits.float(), dim=-1)

    def valid(self, step: int) -> torch.Tensor:
        """Rows t [B, T] bool whose step-k prediction x_{t+2+k} exists, is in t's sample and is loss-masked."""
        same_doc = (shift_left(self.doc_ids, 2 + step, -1) == self.doc_ids) & (
            shift_left(self.doc_ids, 1 + step, -1) == self.doc_ids)
        return same_doc & shift_left(self.loss_mask, 2 + step, False)

    def position_mask(self, step: int) -> torch.Tensor:
        """Rows t [B, T] bool trained at step k: valid, and the target's top-1 at t+1+k is in the draft vocabulary."""
        return self.valid(step) & shift_left(self.in_draft, 1 + step, False)

    def step_probs(self, step: int) -> torch.Tensor:
        """The teacher rows of step k for drafter rows 0..T-2-k: a view [B, T-1-k, D] (no copy)."""
        return self.probs[:, 1 + step:]

    def step_argmax(self, step: int) -> torch.Tensor:
        """The teacher's draft-vocabulary top-1 for drafter rows t at step k, [B, T] (-1 past the end)."""
        return shift_left(self.argmax, 1 + step, -1)


@torch.no_grad()
def teacher_targets(
    last_hidden: torch.Tensor,
    target_lm_head: torch.Tensor,
    t2d: torch.Tensor,
    d2t: torch.Tensor,
    loss_mask: torch.Tensor,
    doc_ids: torch.Tensor | None = None,
    chunk_rows: int | None = None,
) -> TeacherTargets:
    """The target's soft targets over the draft vocabulary from its stored last hidden states.

    ``last_hidden`` [B, T, H] (after the target's final norm, as extracted), ``target_lm_head``
    [V, H] (the matmul runs in its dtype: float32 for exact targets, bf16 to halve its memory),
    ``loss_mask`` [B, T]. Rows are done ``chunk_rows`` at a time (default: as many as keep the
    full-vocabulary logits of a chunk within 128 MiB). Only the draft-vocabulary logits are kept, in the
    matmul's dtype (exact: that is the dtype the matmul produced); ``probs`` is their softmax in float32.
    """
    batch, length, hidden = last_hidden.shape
    if target_lm_head.dim() != 2 or target_lm_head.shape[1] != hidden or target_lm_head.shape[0] != t2d.numel():
        raise ValueError(f"target lm_head {tuple(target_lm_head.shape)} does not fit hidden size {hidden} and "
                         f"vocabulary {t2d.numel()}")
    if chunk_rows is None:
        chunk_rows = max(1, TEACHER_CHUNK_BYTES // (t2d.numel() * target_lm_head.element_size()))
    draft_ids = (d2t + torch.arange(d2t.numel(), device=d2t.device)).to(last_hidden.device)  # [D] target ids
    t2d = t2d.to(last_hidden.device)
    draft_index = torch.cumsum(t2d.long(), 0) - 1  # [V]: draft id of a target id (valid where t2d)
    rows = last_hidden.reshape(batch * length, hidden)
    draft_logits = torch.empty(batch * length, d2t.numel(), dtype=target_lm_head.dtype, device=last_hidden.device)
    top = torch.empty(batch * length, dtype=torch.int64, device=last_hidden.device)
    for start in range(0, rows.shape[0], chunk_rows):
        logits = F.linear(rows[start:start + chunk_rows].to(target_lm_head.dtype), target_lm_head)  # [n, V]
        top[start:start + chunk_rows] = logits.argmax(-1)  # the same as on float32 copies: the cast is monotonic
        draft_logits[start:start + chunk_rows] = logits[:, draft_ids]
    top = top.view(batch, length)
    return TeacherTargets(
        logits=draft_logits.view(batch, length, -1),
        argmax=draft_index[top],
        in_draft=t2d[top],
        loss_mask=loss_mask.to(torch.bool),
        doc_ids=default_doc_ids(loss_mask) if doc_ids is None else doc_ids,
    )


@dataclass
class TTTLoss:
    """The weighted loss to backpropagate, and its parts per step."""

    loss: torch.Tensor  # scalar, sum_k decay^k * CE_k
    step_losses: torch.Tensor  # [K] CE_k, detached
    step_counts: torch.Tensor  # [K] rows in each step's mask (local)


def ttt_loss(
    step_logits: Sequence[torch.Tensor],
    teacher: TeacherTargets,
    decay: float = STEP_DECAY,
    denominators: torch.Tensor | None = None,
) -> TTTLoss:
    """sum_k decay^k * soft cross-entropy of step k over its masked rows.

    Each CE_k is divided by the step's masked row count, or by ``denominators[k]`` when given
    (the global counts under DDP, so that every rank's share adds up to the global mean).
    """
    total = step_logits[0].new_zeros((), dtype=torch.float32)
    losses, counts = [], []
    for step, logits in enumerate(step_logits):
        if logits.shape != teacher.logits.shape:
            raise ValueError(f"step {step}: logits {tuple(logits.shape)} and teacher {tuple(teacher.logits.shape)} "
                             "must both be [B, T, draft_vocab_size]")
        rows = max(logits.shape[1] - 1 - step, 0)
        mask = teacher.position_mask(step)[:, :rows]  # [B, rows]
        log_p = torch.log_softmax(logits[:, :rows].float(), dim=-1)  # [B, rows, D]
        ce = -(teacher.step_probs(step)[:, :rows] * log_p).sum(-1)  # [B, rows]
        summed = (ce * mask).sum()
        count = mask.sum()
        denominator = denominators[step] if denominators is not None else count
        mean = summed / denominator.clamp(min=1)
        total = total + decay**step * mean
        losses.append(mean.detach())
        counts.append(count)
    return TTTLoss(loss=total, step_losses=torch.stack(losses), step_counts=torch.stack(counts))


def _accumulate_product(total: torch.Tensor | None, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """total + a @ b in float32 (a, b in the compute dtype); on CUDA bf16 the matmul accumulates into total."""
    if a.dtype == torch.float32:
        return torch.mm(a, b) if total is None else total.addmm_(a, b)
    if a.is_cuda:
        if total is None:
            return torch.mm(a, b, out_dtype=torch.float32)
        return torch.addmm(total, a, b, out_dtype=torch.float32, out=total)
    product = torch.mm(a, b).float()
    return product if total is None else total.add_(product)


class _FusedHeadLoss(torch.autograd.Function):
    """lm_head + soft cross-entropy of every TTT step, the gradients computed in the forward.

    Inputs: (weight [D, H], teacher logits [N, D], row weights [K, N] (mask / denominator), decay, soft_ce
    (``soft_ce_rows`` or its compiled form), chunk_rows, need_grad, hidden_0 .. hidden_{K-1} [N, H]).
    Step k's row t is scored against teacher row t + 1 + k. The [rows, D] logits exist one chunk at a time;
    what the backward keeps is the gradient of each step's hidden [N, H] and of the weight [D, H] (float32),
    both scaled by the incoming gradient then.
    Outputs: the loss, the per-step CE [K] and the drafter's top-1 [K, N] (-1 where no teacher row).
    """

    @staticmethod
    def forward(ctx, weight, teacher_logits, row_weights, decay, soft_ce, chunk_rows, need_grad, *hiddens):
        rows = hiddens[0].shape[0]
        w = weight.to(hiddens[0].dtype)
        step_losses = torch.zeros(len(hiddens), dtype=row_weights.dtype, device=w.device)
        argmax = torch.full((len(hiddens), rows), -1, dtype=torch.int64, device=w.device)
        grad_hiddens, grad_weight = [], None
        for step, hidden in enumerate(hiddens):
            scored = max(rows - 1 - step, 0)
            grad_hidden = torch.zeros_like(hidden) if need_grad else None
            for start in range(0, scored, chunk_rows):
                stop = min(scored, start + chunk_rows)
                part = hidden[start:stop]
                weights = row_weights[step, start:stop]
                ce, grad, top = soft_ce(F.linear(part, w), teacher_logits[start + 1 + step: stop + 1 + step],
                                        weights * decay**step)
                step_losses[step] += (ce * weights).sum()
                argmax[step, start:stop] = top
                if need_grad:
                    torch.mm(grad, w, out=grad_hidden[start:stop])
                    grad_weight = _accumulate_product(grad_weight, grad.t(), part)
            grad_hiddens.append(grad_hidden)
        decays = torch.tensor([decay**k for k in range(len(hiddens))], dtype=row_weights.dtype, device=w.device)
        ctx.grads = (grad_weight, grad_hiddens)
        ctx.mark_non_differentiable(step_losses, argmax)
        return (decays * step_losses).sum(), step_losses, argmax

    @staticmethod
    def backward(ctx, grad_loss, _grad_steps, _grad_argmax):
        grad_weight, grad_hiddens = ctx.grads
        ctx.grads = None
        if grad_weight is None:
            raise RuntimeError("fused_ttt_loss was run with need_grad=False; it has no gradient to give")
        grad_weight.mul_(grad_loss)  # 1 when the loss is the root of the backward
        for grad in grad_hiddens:
            grad.mul_(grad_loss.to(grad.dtype))
        return (grad_weight, None, None, None, None, None, None, *grad_hiddens)


def fused_ttt_loss(
    step_hidden: Sequence[torch.Tensor],
    lm_head_weight: torch.Tensor,
    teacher: TeacherTargets,
    decay: float = STEP_DECAY,
    denominators: torch.Tensor | None = None,
    *,
    kernels: FusedKernels | None = None,
    chunk_rows: int | None = None,
) -> tuple[TTTLoss, list[torch.Tensor]]:
    """``ttt_loss`` of ``forward_fused(..., head=False)``'s normed hidden states [B, T, H] per step, the lm_head
    applied here; also each step's top-1 draft id [B, T] for ``ttt_metrics_from_argmax``.

    Memory: no [T, D] float32 tensor per step is kept for the backward (only the hidden states' gradients,
    [T, H] each, and the lm_head weight's, which the optimizer needs anyway); ``chunk_rows`` bounds the
    transient logits (default: all rows when the kernels are compiled, which fuse the softmax, else 256).
    """
    batch, length, _ = step_hidden[0].shape
    rows = batch * length
    if teacher.logits.shape[:2] != (batch, length):
        raise ValueError(f"hidden states [{batch}, {length}, H] and teacher {tuple(teacher.logits.shape)} differ")
    masks = [teacher.position_mask(step) for step in range(len(step_hidden))]  # [B, T] each
    counts = torch.stack([mask.sum() for mask in masks])
    dtype = torch.promote_types(step_hidden[0].dtype, torch.float32)
    divide = (denominators if denominators is not None else counts).to(dtype).clamp(min=1)
    row_weights = torch.stack([mask.reshape(rows).to(dtype) / divide[k] for k, mask in enumerate(masks)])  # [K, N]
    if chunk_rows is None:
        chunk_rows = rows if kernels is not None and kernels.compiled else 256
    need_grad = torch.is_grad_enabled() and (lm_head_weight.requires_grad or any(h.requires_grad for h in step_hidden))
    loss, step_losses, argmax = _FusedHeadLoss.apply(
        lm_head_weight, teacher.logits.reshape(rows, -1), row_weights, decay,
        kernels.soft_ce if kernels is not None else soft_ce_rows, max(1, chunk_rows), need_grad,
        *[h.reshape(rows, -1) for h in step_hidden])
    return (TTTLoss(loss=loss, step_losses=step_losses.detach(), step_counts=counts),
            list(argmax.view(len(step_hidden), batch, length)))


def acceptance_length(cond_acc: Sequence[float]) -> float:
    """sum_k prod_{i<=k} cond_acc_i: expected draft tokens accepted per verify for a chain of len(cond_acc)."""
    total, chain = 0.0, 1.0
    for accuracy in cond_acc:
        chain *= accuracy
        total += chain
    return total


@dataclass
class TTTMetrics:
    """Counts per step (sum them over ranks and batches, then read the ratios)."""

    hits: torch.Tensor  # [K] rows of the position mask where the drafter's top-1 is the teacher's
    rows: torch.Tensor  # [K] rows of the position mask
    chain_hits: torch.Tensor  # [K] valid rows right at steps 0..k
    chain_rows: torch.Tensor  # [K] valid rows right at steps 0..k-1
    # [B, T] per row: steps right in a row from step 0 (valid ones): the drafts a round from that row accepts
    # (``evaluate.rounds``); not a count, so never summed.
    leads: torch.Tensor | None = None

    @property
    def acc(self) -> list[float]:
        """acc_k: top-1 agreement over the trained rows."""
        return [float(h) / float(r) if r else 0.0 for h, r in zip(self.hits, self.rows)]

    @property
    def cond_acc(self) -> list[float]:
        """Conditional acc_k: agreement at step k given the chain was right at steps 0..k-1."""
        return [float(h) / float(r) if r else 0.0 for h, r in zip(self.chain_hits, self.chain_rows)]

    @property
    def acceptance_length(self) -> float:
        """The simulated acceptance length sum_k prod_{i<=k} cond_acc_i."""
        return acceptance_length(self.cond_acc)


@torch.no_grad()
def ttt_metrics(step_logits: Sequence[torch.Tensor], teacher: TeacherTargets) -> TTTMetrics:
    """acc_k, conditional acc_k and the simulated acceptance length's counts for one batch."""
    return ttt_metrics_from_argmax([logits.argmax(-1) for logits in step_logits], teacher)


@torch.no_grad()
def ttt_metrics_from_argmax(step_argmax: Sequence[torch.Tensor], teacher: TeacherTargets) -> TTTMetrics:
    """``ttt_metrics`` from the drafter's top-1 draft id [B, T] of each step (``fused_ttt_loss`` gives them)."""
    hits, rows, chain_hits, chain_rows = [], [], [], []
    chain = leads = None
    for step, top in enumerate(step_argmax):
        valid = teacher.valid(step)  # [B, T]
        right = (top == teacher.step_argmax(step)) & shift_left(teacher.in_draft, 1 + step, False)
        trained = teacher.position_mask(step)
        hits.append((right & trained).sum())
        rows.append(trained.sum())
        tried = valid if chain is None else chain & valid
        chain = tried & right
        leads = chain.long() if leads is None else leads + chain
        chain_hits.append(chain.sum())
        chain_rows.append(tried.sum())
    return TTTMetrics(hits=torch.stack(hits), rows=torch.stack(rows), chain_hits=torch.stack(chain_hits),
                      chain_rows=torch.stack(chain_rows), leads=leads)
