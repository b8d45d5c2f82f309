"""The MLA drafter's attention: DeepSeek-V2 multi-latent attention reading the EAGLE-3 input.

SGLang 0.5.23 serves this layout as ``Eagle3DeepseekV2ForCausalLM`` (``srt/models/kimi_k25_eagle3.py``,
the ``kimi-k2.5-eagle3-mla`` and ``kimi-k2.6-eagle3.1-mla`` drafters): the EAGLE-3 layer of
``train/model.py`` (``fc``, ``[input_layernorm(emb); hidden_norm(h)]``, the residuals, the MLP, the final
norm, the draft ``lm_head``, EAGLE 3.1's ``fc_norm`` and ``norm_output``) with the attention of a
DeepSeek-V3 target, so that the draft's KV cache has the target's compact MLA shape. Only the
attention differs; its weights, under SGLang's checkpoint names (H the drafter's width, n heads,
r = ``q_lora_rank``, c = ``kv_lora_rank``, d_n / d_r / d_v = ``qk_nope_head_dim`` /
``qk_rope_head_dim`` / ``v_head_dim``)::

    midlayer.self_attn.q_a_proj.weight            [r, 2H]          x -> the query's latent
    midlayer.self_attn.q_a_layernorm.weight       [r]
    midlayer.self_attn.q_b_proj.weight            [n*(d_n+d_r), r]  per head: [nope | rope]
    midlayer.self_attn.kv_a_proj_with_mqa.weight  [c + d_r, 2H]    [the KV latent | one shared rope key]
    midlayer.self_attn.kv_a_layernorm.weight      [c]
    midlayer.self_attn.kv_b_proj.weight           [n*(d_n+d_v), c]  per head: [key nope | value]
    midlayer.self_attn.o_proj.weight              [H, n*d_v]

SGLang fuses ``q_a_proj`` and ``kv_a_proj_with_mqa`` into ``fused_qkv_a_proj_with_mqa`` at load and
splits ``kv_b_proj`` into its absorbed ``w_kc``/``w_vc``; the function is the plain one below::

    q        = q_b_proj(q_a_layernorm(q_a_proj(x)))                 # [.., n, d_n + d_r]
    c, k_r   = split(kv_a_proj_with_mqa(x), [c, d_r])
    k_n, v   = split(kv_b_proj(kv_a_layernorm(c)), [d_n, d_v])      # [.., n, d_n], [.., n, d_v]
    q_r, k_r = rope(q_r), rope(k_r)                                 # k_r shared by the heads
    out      = o_proj(softmax(scale * [q_n; q_r] . [k_n; k_r]) v)

RoPE acts on the d_r dimensions only: pairs (2i, 2i + 1) when ``rope_interleave`` (DeepSeek's
default, SGLang's ``is_neox_style=False``), else the two halves; with YaRN scaling (``rope_type``
``yarn``: DeepSeek-V3's and Kimi's) the frequencies blend interpolated and original ones and cos and
sin carry ``mscale(factor, mscale) / mscale(factor, mscale_all_dim)``, and ``scale`` is
``(d_n + d_r)^-0.5 * mscale(factor, mscale_all_dim)^2``, as SGLang's ``DeepseekScalingRotaryEmbedding``
and ``compute_mla_mscale_scaling`` compute them.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from torch import nn

from eagle3_pipeline.train.kernels import RMSNorm, apply_rope

if TYPE_CHECKING:
    from eagle3_pipeline.train.model import DrafterConfig

MLA_FIELDS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


def yarn_mscale(factor: float, mscale: float) -> float:
    """YaRN's magnitude correction (1 when the context is not stretched)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_inv_freq(dim: int, theta: float, scaling: dict) -> torch.Tensor:
    """YaRN's inverse frequencies [dim / 2], float64: the original ones on the dimensions that turn more than
    ``beta_fast`` times over the original context, the interpolated ones (divided by ``factor``) below
    ``beta_slow`` turns, a linear blend between."""
    factor = float(scaling["factor"])
    context = float(scaling["original_max_position_embeddings"])
    original = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))

    def dim_of(rotations: float) -> float:
        return dim * math.log(context / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(dim_of(float(scaling.get("beta_fast", 32)))), 0)
    high = min(math.ceil(dim_of(float(scaling.get("beta_slow", 1)))), dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    keep = (1 - ramp) * float(scaling.get("extrapolation_factor", 1))  # 1: the original frequency
    return original / factor * (1 - keep) + original * keep


def mla_scales(config: DrafterConfig) -> tuple[float, float]:
    """(softmax scale, the factor on RoPE's cos and sin) of an MLA config."""
    scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
    scaling = config.rope_scaling or {}
    if str(scaling.get("rope_type", scaling.get("type", "default"))) != "yarn":
        return scale, 1.0
    factor = float(scaling.get("factor", 1.0))
    all_dims = yarn_mscale(factor, float(scaling.get("mscale_all_dim", 0) or 0))
    rope = yarn_mscale(factor, float(scaling.get("mscale", 1))) / all_dims * float(scaling.get("attn_factor", 1))
    return scale * all_dims * all_dims, rope


def apply_rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [.., d] pair by pair, (x_2i, x_2i+1) by angle i (GPT-J style); cos and sin [.., d] in the neox
    layout of ``rope_cos_sin`` (halves repeated: the first half is read)."""
    half = x.shape[-1] // 2
    wide = torch.promote_types(x.dtype, torch.float32)
    cos, sin = cos[..., :half].to(wide), sin[..., :half].to(wide)
    even, odd = x[..., 0::2].to(wide), x[..., 1::2].to(wide)
    return torch.stack([even * cos - odd * sin, odd * cos + even * sin], dim=-1).flatten(-2).to(x.dtype)


class Eagle3MLAAttention(nn.Module):
    """The midlayer's attention in the MLA layout (module docstring): reads 2H, writes H."""

    def __init__(self, config: DrafterConfig):
        super().__init__()
        width, eps = 2 * config.hidden_size, config.rms_norm_eps
        self.heads = self.kv_heads = config.num_attention_heads
        self.nope, self.rope_dim, self.v_dim = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
        self.kv_lora = config.kv_lora_rank
        self.head_dim = self.nope + self.rope_dim  # what q . k spans
        self.out_width = self.heads * self.v_dim
        self.scale, self.rope_mscale = mla_scales(config)
        self.interleave = config.rope_interleave
        self.q_a_proj = nn.Linear(width, config.q_lora_rank, bias=False)
        self.q_a_layernorm = RMSNorm(config.q_lora_rank, eps)
        self.q_b_proj = nn.Linear(config.q_lora_rank, self.heads * self.head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(width, self.kv_lora + self.rope_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(self.kv_lora, eps)
        self.kv_b_proj = nn.Linear(self.kv_lora, self.heads * (self.nope + self.v_dim), bias=False)
        self.o_proj = nn.Linear(self.out_width, config.hidden_size, bias=False)

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        cos, sin = cos * self.rope_mscale, sin * self.rope_mscale
        return apply_rope_interleaved(x, cos, sin) if self.interleave else apply_rope(x, cos, sin)

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q and k [B, n, T, d_n + d_r], v [B, n, T, d_v] of x [B, T, 2H]; cos and sin [B, 1, T, d_r]."""
        batch, length, _ = x.shape
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(batch, length, self.heads, self.head_dim).transpose(1, 2)  # [B, n, T, d_n + d_r]
        q_nope, q_rope = q.split([self.nope, self.rope_dim], dim=-1)
        latent, k_rope = self.kv_a_proj_with_mqa(x).split([self.kv_lora, self.rope_dim], dim=-1)
        kv = self.kv_b_proj(self.kv_a_layernorm(latent))
        kv = kv.view(batch, length, self.heads, self.nope + self.v_dim).transpose(1, 2)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)  # [B, n, T, d_n], [B, n, T, d_v]
        k_rope = self._rope(k_rope[:, None], cos, sin)  # [B, 1, T, d_r]: one key for every head
        q = torch.cat([q_nope, self._rope(q_rope, cos, sin)], dim=-1)
        k = torch.cat([k_nope, k_rope.expand(batch, self.heads, length, self.rope_dim)], dim=-1)
        return q, k, v.contiguous()
