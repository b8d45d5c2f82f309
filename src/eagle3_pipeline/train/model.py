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

EAGLE 3.1 (``variant="eagle3.1"``, ``train/variants.py``) adds two things SGLang 0.5.23 reads from the
config: ``fc_norm``, an RMSNorm on each aux state before ``fc`` (weights ``fc_norm.{i}.weight`` [T]),
and ``norm_output``, the next step reading ``norm(out)`` instead of ``out`` (then the lm_head reads the
same state, with no second norm). ``norm_before_fc`` (one RMSNorm over the concatenated aux states,
``input_norm.weight`` [n*T]) is a third, separate flag::

    h_0 = fc(cat[fc_norm_i(a_i)])            (eagle3: fc(cat[a_i]))
    h_k+1 = norm(out_k), logits = lm_head(h_k+1)      (eagle3: h_k+1 = out_k, logits = lm_head(norm(out_k)))

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

The attention pattern and the kernels are in ``train/kernels.py``; the teacher, the loss and the
metrics in ``train/loss.py``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from eagle3_pipeline.train.kernels import (
    MLPGradients,
    PackedLayout,
    RMSNorm,
    _SwiGLUMLP,
    apply_rope,
    default_doc_ids,
    fused_kernels,
    packed_layout,
    positions_from_doc_ids,
    rms_norm,
    rope_cos_sin,
    shift_left,
    ttt_attention,
    ttt_attention_mask,
)
from eagle3_pipeline.train.model_mla import MLA_FIELDS, Eagle3MLAAttention, yarn_inv_freq
from eagle3_pipeline.train.variants import variant_flags
from eagle3_pipeline.train.vocab import check_mapping, resolve_draft_vocab_size

DEFAULT_TTT_LENGTH = 7
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
MLA_ROPE_TYPES = ("default", "yarn")  # DeepSeek-V3's and Kimi's YaRN (model_mla.py)
LAYOUTS = ("llama", "mla")  # the attention: Llama's (SGLang's LlamaForCausalLMEagle3) or MLA (model_mla.py)
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
    # EAGLE 3.1's flags, under SGLang's config keys (train/variants.py maps a variant's name to them).
    fc_norm: bool = False  # an RMSNorm on each aux state before fc
    norm_before_fc: bool = False  # one RMSNorm over the concatenated aux states before fc
    norm_output: bool = False  # the next step reads norm(out), not out
    # The attention layout, and the MLA one's sizes (model_mla.py; head_dim is then d_nope + d_rope).
    layout: str = "llama"
    q_lora_rank: int | None = None
    kv_lora_rank: int | None = None
    qk_nope_head_dim: int | None = None
    qk_rope_head_dim: int | None = None
    v_head_dim: int | None = None
    rope_interleave: bool = True  # MLA: RoPE on pairs (2i, 2i+1), DeepSeek's default

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
        if self.layout not in LAYOUTS:
            raise DrafterConfigError(f"drafter config: layout {self.layout!r}: use one of {', '.join(LAYOUTS)}")
        if self.layout == "mla":
            self._check_mla()
        elif self.head_dim % 2:
            raise DrafterConfigError(f"drafter config: head_dim must be even for RoPE, got {self.head_dim}")
        resolve_draft_vocab_size(self.vocab_size, self.draft_vocab_size)
        if self.hidden_act not in SUPPORTED_ACTIVATIONS:
            raise DrafterConfigError(
                f"drafter config: hidden_act {self.hidden_act!r} is not supported "
                f"(only {', '.join(SUPPORTED_ACTIVATIONS)})"
            )
        rope_type = rope_type_of(self.rope_scaling)
        supported = MLA_ROPE_TYPES if self.layout == "mla" else SUPPORTED_ROPE_TYPES
        if rope_type not in supported:
            raise DrafterConfigError(f"drafter config: rope type {rope_type!r} is not supported by the {self.layout} "
                                     f"layout (only {', '.join(supported)})")

    def _check_mla(self) -> None:
        for name in MLA_FIELDS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise DrafterConfigError(f"drafter config: the mla layout needs {name}, a positive integer, got "
                                         f"{value!r}")
        if self.qk_rope_head_dim % 2:
            raise DrafterConfigError(f"drafter config: qk_rope_head_dim must be even for RoPE, got "
                                     f"{self.qk_rope_head_dim}")
        if self.head_dim != self.qk_nope_head_dim + self.qk_rope_head_dim:
            raise DrafterConfigError(f"drafter config: head_dim {self.head_dim} must be qk_nope_head_dim + "
                                     f"qk_rope_head_dim ({self.qk_nope_head_dim + self.qk_rope_head_dim}) in the mla "
                                     "layout")
        if self.num_key_value_heads != self.num_attention_heads:
            raise DrafterConfigError("drafter config: the mla layout has a key and a value per head: "
                                     f"num_key_value_heads ({self.num_key_value_heads}) must be num_attention_heads "
                                     f"({self.num_attention_heads})")

    @classmethod
    def from_target(
        cls,
        target_config: dict,
        n_aux: int = 3,
        draft_vocab_size: int | None = None,
        *,
        variant: str = "eagle3",
        norm_before_fc: bool = False,
        layout: str = "auto",
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
        heads are overridden, else hidden_size // heads. ``variant`` (``eagle3`` or ``eagle3.1``) and
        ``norm_before_fc`` set the EAGLE 3.1 flags (``train/variants.py``). ``layout``: ``auto`` takes the
        MLA layout (``model_mla.py``) for a target with multi-latent attention (``kv_lora_rank``:
        DeepSeek-V2/V3, Kimi-K2.x), with the target's MLA sizes and KV heads = heads, else ``llama``.
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
        mla_target = bool(config.get("kv_lora_rank"))
        if layout == "auto":
            layout = "mla" if mla_target else "llama"
        if layout not in LAYOUTS:
            raise DrafterConfigError(f"drafter layout {layout!r}: use auto or one of {', '.join(LAYOUTS)}")
        mla: dict = {}
        if layout == "mla":
            if not mla_target:
                raise DrafterConfigError("drafter layout mla: the target has no multi-latent attention (no "
                                         "kv_lora_rank in its config); use layout llama or auto")
            mla = {name: config.get(name) for name in MLA_FIELDS}
            mla["rope_interleave"] = bool(config.get("rope_interleave", True))
            kv_heads, head_dim = heads, int(config["qk_nope_head_dim"]) + int(config["qk_rope_head_dim"])
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
            **variant_flags(variant, norm_before_fc),
            layout=layout,
            **mla,
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
    """The RoPE inverse frequencies [rotated dims / 2] (head_dim; the MLA layout's qk_rope_head_dim), float32,
    with the config's scaling applied."""
    dim = config.qk_rope_head_dim if config.layout == "mla" else config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    scaling = config.rope_scaling or {}
    rope_type = rope_type_of(scaling)
    if rope_type == "yarn":
        inv_freq = yarn_inv_freq(dim, config.rope_theta, scaling)
    elif rope_type == "linear":
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


class Eagle3Attention(nn.Module):
    """The midlayer's attention: q/k/v read 2H ([norm(emb); norm(hidden)]), o_proj writes H."""

    def __init__(self, config: DrafterConfig):
        super().__init__()
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.out_width = self.heads * self.head_dim  # what o_proj reads
        self.scale = self.head_dim ** -0.5  # the softmax scale (SGLang's Llama attention)
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
        self.self_attn = Eagle3MLAAttention(config) if config.layout == "mla" else Eagle3Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = Eagle3MLP(config)

    def attention_input(self, embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """[input_layernorm(embeds); hidden_norm(hidden)], [B, T, 2H], embeddings first as in SGLang."""
        return torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)

    def finish(self, hidden: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """The layer's output from its input hidden [B, T, H] and the attention's [B, T, heads*hd]."""
        residual = hidden + self.self_attn.o_proj(attn)
        return residual + self.mlp(self.post_attention_layernorm(residual))


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
        aux_width = config.num_aux_hidden_states * config.target_hidden_size
        # EAGLE 3.1's norms of the aux states, under SGLang's names (absent in an eagle3 drafter).
        self.input_norm = RMSNorm(aux_width, config.rms_norm_eps) if config.norm_before_fc else None
        self.fc_norm = nn.ModuleList([RMSNorm(config.target_hidden_size, config.rms_norm_eps)
                                      for _ in range(config.num_aux_hidden_states)]) if config.fc_norm else None
        self.fc = nn.Linear(aux_width, config.hidden_size, bias=False)
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

    @torch.no_grad()
    def load_target_head(self, lm_head: torch.Tensor, final_norm: torch.Tensor | None) -> None:
        """Start the drafter's output where the target's is: ``lm_head`` gets the target's lm_head [V, H] rows of the
        draft vocabulary (draft id d is target id d + d2t[d]), ``norm`` the target's final norm [H] when given.
        The drafter then predicts through the target's own output map and only has to learn the state to feed it."""
        if lm_head.dim() != 2 or tuple(lm_head.shape) != (self.config.vocab_size, self.config.hidden_size):
            raise DrafterConfigError(f"the target's lm_head has shape {tuple(lm_head.shape)}, the drafter's head "
                                     f"needs [{self.config.vocab_size}, {self.config.hidden_size}] (vocab_size, "
                                     "hidden_size): a drafter narrower than its target cannot start from it")
        target_ids = self.d2t + torch.arange(self.d2t.numel(), device=self.d2t.device)
        self.lm_head.weight.copy_(lm_head[target_ids.to(lm_head.device)].to(self.lm_head.weight))
        if final_norm is not None:
            if tuple(final_norm.shape) != tuple(self.norm.weight.shape):
                raise DrafterConfigError(f"the target's final norm has shape {tuple(final_norm.shape)}, the "
                                         f"drafter's is {tuple(self.norm.weight.shape)}")
            self.norm.weight.copy_(final_norm.to(self.norm.weight))

    def normed_aux(self, aux: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """What ``fc`` reads [.., n*T]: the aux states, through EAGLE 3.1's norms when the drafter has them, in
        ``dtype`` (default the aux states')."""
        aux = aux if dtype is None else aux.to(dtype)
        if self.input_norm is not None:
            aux = rms_norm(aux, self.input_norm.weight, self.config.rms_norm_eps)
        if self.fc_norm is not None:
            chunks = aux.chunk(self.config.num_aux_hidden_states, dim=-1)
            aux = torch.cat([rms_norm(chunk, norm.weight, self.config.rms_norm_eps)
                             for norm, chunk in zip(self.fc_norm, chunks)], dim=-1)
        return aux

    def fuse_aux(self, aux: torch.Tensor) -> torch.Tensor:
        """The hidden state [.., H] the first draft step reads, from the target's aux states [.., n*T]."""
        return self.fc(self.normed_aux(aux, self.fc.weight.dtype))

    def carry(self, out: torch.Tensor) -> torch.Tensor:
        """What the next draft step reads of a step's output [.., H]: ``out``, or ``norm(out)`` (norm_output)."""
        return self.norm(out) if self.config.norm_output else out

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits [.., D] of the state a step carries (``carry``) [.., H]: the lm_head of its norm,
        or of the state itself when it is normed already (norm_output)."""
        return self.lm_head(hidden if self.config.norm_output else self.norm(hidden))

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
        layout: PackedLayout | None = None,
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
        return each step's normed hidden state [B, T, H], what the lm_head reads, for ``fused_ttt_loss``) and
        ``layout`` (``packed_layout`` of ``doc_ids``, made from the host's copy before the batch went to the GPU;
        default: made here from ``doc_ids``, which waits for the GPU)).
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
                                      mlp_recompute_steps=mlp_recompute_steps, compile=compile, head=head,
                                      layout=layout)
        if not head:
            raise ValueError("head=False (normed hidden states instead of logits) needs attention='fused'")
        mask = ttt_attention_mask(doc_ids, ttt_length)  # [B, 1, T, K*T]
        length = input_ids.shape[1]
        attn = self.midlayer.self_attn
        hidden = self.fuse_aux(aux_hidden)  # [B, T, H]
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
                enable_gqa=attn.kv_heads != attn.heads, scale=attn.scale,
            )  # [B, heads, T, hd of the values]
            out = out.transpose(1, 2).reshape(input_ids.shape[0], length, attn.out_width)
            hidden = self.carry(self.midlayer.finish(hidden, out))  # [B, T, H], the next step's hidden state
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
        layout: PackedLayout | None = None,
    ) -> list[torch.Tensor]:
        """``forward_ttt`` on flattened rows [N = B*T], the weights cast once to ``compute_dtype``.

        Per step: norms + [q;k;v] matmul + RoPE (``FusedKernels.pre``), ``ttt_attention`` (flash over the
        step-0 prefix merged with the row's own step keys), o_proj + residual + norm, the SwiGLU MLP with
        [gate; up] stacked (``_SwiGLUMLP``), residual + final norm. Runs outside autocast: the weights are
        cast here, as autocast would, and the activations stay in ``compute_dtype``.
        """
        if self.config.layout != "llama":
            raise ValueError(f"attention 'fused' runs the llama layout only; the {self.config.layout} drafter trains "
                             "with attention 'sdpa'")
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
            if layout is None:  # from the ids on the device: the host waits for the GPU here
                layout = packed_layout(doc_ids)
            if token_embeds is None:
                token_embeds = self.token_embeddings(input_ids, ttt_length)
            token_embeds = token_embeds.to(device=input_ids.device, dtype=compute_dtype)  # [B, T + K, H]
            # One cast per forward, shared by the steps (autocast's weight cache does the same).
            w_qkv = torch.cat([cast(attn.q_proj.weight), cast(attn.k_proj.weight), cast(attn.v_proj.weight)])
            w_o = cast(attn.o_proj.weight)
            w_gate_up = torch.cat([cast(layer.mlp.gate_proj.weight), cast(layer.mlp.up_proj.weight)])
            w_down = cast(layer.mlp.down_proj.weight)
            hidden = F.linear(self.normed_aux(aux_hidden.reshape(rows, -1), compute_dtype),
                              cast(self.fc.weight))  # [N, H]
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
                if self.config.norm_output:
                    hidden = normed  # EAGLE 3.1: the next step reads the normed state the lm_head reads
                normed = normed.view(batch, length, -1)
                outputs.append(F.linear(normed, cast(self.lm_head.weight)) if head else normed)
        return outputs
