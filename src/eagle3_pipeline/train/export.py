"""Export the trained drafter in the two forms servers load: SGLang's and speculators' (vLLM's).

Both forms are a directory with ``config.json`` and ``model.safetensors``. The exporter takes a
plain ``state_dict`` in the drafter's names (SGLang's checkpoint names: ``midlayer.*``, ``fc``,
``norm``, ``lm_head``, ``d2t``, ``t2d``) and a drafter config dict, and checks every tensor
against what the server reads before writing anything: a missing, extra, misshapen or wrongly
typed tensor is refused with a message listing each one, because both servers skip unknown
names silently and a drafter with a weight left at its random init loads fine and accepts
nothing.

What SGLang 0.5.23 reads (``sglang/srt/models/llama_eagle3.py``, ``LlamaForCausalLMEagle3``)
-----------------------------------------------------------------------------------------------
Modules (H = ``hidden_size``, T = ``target_hidden_size``, n = number of aux layers, D =
``draft_vocab_size``, V = ``vocab_size``, hd = ``head_dim`` or H / heads):

- ``model.layers.{0..num_hidden_layers-1}``: ``LlamaDecoderLayer``; layer 0 replaces
  ``self_attn.qkv_proj`` by a ``QKVParallelLinear`` whose input is 2H ([input_layernorm(embeds);
  hidden_norm(hidden)]) and adds ``hidden_norm``. Only layer 0 gets weights from a checkpoint
  (``legacy_name_map`` turns ``midlayer`` into ``layers.0``), so ``num_hidden_layers`` must be 1.
  The residual is the un-normed hidden state (no ``norm_before_residual`` in SGLang).
- ``model.fc``: ``nn.Linear(T * n, H, bias=config.bias)``; n is ``num_aux_hidden_states`` if set,
  else ``len(eagle_config.eagle_aux_hidden_state_layer_ids)``, else 3.
- ``model.norm`` [H]; ``lm_head``: ``ParallelLMHead(D, H)`` unless ``tie_word_embeddings`` (then
  ``lm_head`` IS ``embed_tokens`` and a stored ``lm_head.weight`` is silently dropped), and when
  ``draft_vocab_size`` is null the head is taken from the target at full vocabulary
  (``load_lm_head_from_target``). We write ``tie_word_embeddings: false`` and D.
- ``model.embed_tokens`` [V, H]: replaced by the target's embedding by the EAGLE worker
  (``speculative/eagle_worker_v2.py`` ``init_lm_head`` -> ``LlamaForCausalLM.set_embed``), EXCEPT
  when ``target_hidden_size != hidden_size`` (``set_embed`` returns early): then the checkpoint
  must carry ``embed_tokens.weight`` [V, H], so we require it exactly in that case.

``load_weights`` per checkpoint name: every ``midlayer`` -> ``layers.0`` (substring replace);
a name containing ``d2t`` sets ``hot_token_id = d2t + arange(D)`` (the draft-to-target map used
on every proposed token: ``eagle_worker_v2.py`` ``topk_index = hot_token_id[topk_index]``);
``t2d`` is skipped; ``.q_proj/.k_proj/.v_proj`` go into ``qkv_proj`` shards q/k/v and
``.gate_proj/.up_proj`` into ``gate_up_proj`` shards 0/1; then the name is looked up as is or
under ``model.``; a name found neither way is skipped without a word. Checkpoint tensors:

==========================================  ==================  ======
``midlayer.self_attn.q_proj.weight``        [heads*hd, 2H]      float
``midlayer.self_attn.{k,v}_proj.weight``    [kv_heads*hd, 2H]   float
``midlayer.self_attn.o_proj.weight``        [H, heads*hd]       float
``midlayer.mlp.{gate,up}_proj.weight``      [I, H]              float
``midlayer.mlp.down_proj.weight``           [H, I]              float
``midlayer.{input_layernorm,hidden_norm,    [H]                 float
post_attention_layernorm}.weight``
``fc.weight``                               [H, n*T]            float
``norm.weight``                             [H]                 float
``lm_head.weight``                          [D, H]              float
``d2t``                                     [D]                 int64
``t2d``                                     [V]                 bool
``embed_tokens.weight`` (only if T != H)    [V, H]              float
``fc_norm.{i}.weight`` (EAGLE 3.1)          [T] per aux layer   float
``input_norm.weight`` (``norm_before_fc``)  [n*T]               float
==========================================  ==================  ======

The EAGLE 3.1 flags (``fc_norm``, ``norm_before_fc``, ``norm_output``) are written at the top
level of config.json when set; ``train/variants.py`` says what SGLang does with each.

Aux layer ids (``eagle_config.eagle_aux_hidden_state_layer_ids``)
-------------------------------------------------------------------
SGLang hands the DRAFT's ids straight to the TARGET: ``model_runner_components/
spec_aux_hidden_state.py`` ``_resolve_eagle_aux_hidden_state`` reads
``draft_model_config.hf_config.eagle_config["eagle_aux_hidden_state_layer_ids"]`` (any
exception there -> ``None``, i.e. the target's default layers, silently), and
``attention_backend_setup.py`` ``configure_aux_hidden_state_capture`` calls
``target_model.set_eagle3_layers_to_capture(ids)``. That is the same call capture mode makes
with ``--return-aux-hidden-state-layer-ids``, so the drafter's ids are exactly the ids the
extraction's server was launched with: ``serve.sglang_command.sglang_layer_ids(aux_layers,
model_type)`` (llama: ours; deepseek_v2/v3, kimi_k2, kimi_k25: ours + 1; see that module). The
manifest's ``aux_layers`` (0-based, output of the layer, HF ``hidden_states[i + 1]``) are
converted with it, and when the data came from SGLang, the manifest's ``engine_layer_ids`` must
agree. ``eagle_worker``'s ``get_draft_hidden_size_from_config`` (``speculative/eagle_utils.py``)
also takes n from the same list, so its length must be the drafter's n.

What speculators / vLLM read (``speculators_model_type: eagle3``)
----------------------------------------------------------------
Facts from vllm-project/speculators ``src/speculators/config.py``,
``src/speculators/models/eagle3/{config,core,model_definitions_llama}.py`` and vllm-project/vllm
``vllm/transformers_utils/configs/speculators/{base,algos}.py``,
``vllm/model_executor/models/llama_eagle3.py``:

- config.json: ``speculators_model_type: "eagle3"``; ``transformer_layer_config`` (a Llama
  config dict: the decoder layer's sizes, ``vocab_size`` = V, ``num_hidden_layers`` 1);
  ``draft_vocab_size``; ``target_hidden_size``; ``norm_before_residual`` (vLLM's
  ``update_eagle3`` DEFAULTS IT TO TRUE when absent, which is not SGLang's layer, so we always
  write ``false``); ``eagle_aux_hidden_state_layer_ids``; ``speculators_config`` with
  ``algorithm``, ``proposal_methods`` (``[{"proposal_type": "greedy", "speculative_tokens": k}]``,
  vLLM takes ``num_speculative_tokens`` from the first), ``default_proposal_method`` and
  ``verifier`` (``name_or_path``, ``architectures``); vLLM validates exactly those keys.
- Aux ids: vLLM captures ``hidden_states + residual`` ENTERING decoder layer ``id`` for every
  model class (``if idx in self.aux_hidden_state_layers`` before ``layer(...)``), i.e. the output
  of layer ``id - 1``, so the speculators ids are ours + 1, whatever the target.
- Weights: ``layers.0.*`` (vLLM also maps ``midlayer.`` to ``layers.0.``), ``fc.weight``,
  ``norm.weight``, ``lm_head.weight``, ``d2t`` (loaded as ``draft_id_to_target_id`` [D] long),
  ``t2d`` (skipped by vLLM); ``embed_tokens.weight`` optional (shared from the target when absent).
  vLLM's ``fc`` is ``target_hidden_size * 3`` wide and speculators' is ``3 * hidden_size``: the
  speculators form needs exactly 3 aux layers, and is refused otherwise.

Files appear atomically (``eagle3_pipeline.atomic``): ``config.json`` is removed first, the
weights are written to a temp file and renamed, then ``config.json`` (which records the
weights' SHA-256) is renamed into place. A directory without ``config.json`` is an incomplete
export, and ``load_export`` refuses weights whose checksum differs from the one recorded.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from eagle3_pipeline.atomic import atomic_write, atomic_write_text
from eagle3_pipeline.capture.layers import AUX_LAYER_CONVENTION, check_aux_layers
from eagle3_pipeline.capture.writer import save_safetensors
from eagle3_pipeline.serve.sglang_command import LAYER_ID_CONVENTIONS, SGLANG_VERSION, sglang_layer_ids
from eagle3_pipeline.train.model_mla import MLA_FIELDS
from eagle3_pipeline.train.variants import extra_tensors, flags_of, sglang_keys, variant_name
from eagle3_pipeline.train.vocab import VocabError, check_mapping

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
SGLANG_ARCHITECTURE = "LlamaForCausalLMEagle3"
SGLANG_MLA_ARCHITECTURE = "Eagle3DeepseekV2ForCausalLM"  # srt/models/kimi_k25_eagle3.py: the MLA layout
SPECULATORS_ARCHITECTURE = "Eagle3Speculator"
SPECULATORS_AUX_COUNT = 3  # vLLM's Eagle3 fc is target_hidden_size * 3 wide
PROVENANCE_KEY = "eagle3_pipeline"
FORMS = ("sglang", "speculators")

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
_MIDLAYER = "midlayer."
_SPECULATORS_LAYER = "layers.0."


class ExportError(ValueError):
    """A drafter that cannot be exported or loaded as asked; the message lists every problem."""


@dataclass(frozen=True)
class DrafterShape:
    """The sizes that fix every exported tensor's shape, validated from a drafter config dict."""

    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int  # V, the target's vocabulary
    draft_vocab_size: int  # D
    target_hidden_size: int  # T
    num_aux_hidden_states: int  # n
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    dtype: str  # of every float tensor in the export
    flags: tuple[tuple[str, bool], ...] = ()  # EAGLE 3.1's (train/variants.py), as (key, value) pairs
    layout: str = "llama"  # the attention: llama, or mla (train/model_mla.py)
    mla: tuple[tuple[str, int], ...] = ()  # the MLA sizes (MLA_FIELDS), as (key, value) pairs
    rope_interleave: bool = True  # MLA: RoPE on pairs (2i, 2i+1)

    @classmethod
    def from_config(cls, cfg: Mapping) -> DrafterShape:
        """Read and check a drafter config (Hugging Face Llama key names, plus the EAGLE-3 ones).

        Required: ``hidden_size``, ``num_attention_heads``, ``intermediate_size``, ``vocab_size``,
        ``draft_vocab_size``. Defaults: ``num_key_value_heads`` = heads, ``head_dim`` = H / heads,
        ``target_hidden_size`` = H, ``num_aux_hidden_states`` = len(``aux_layers``) or 3,
        ``rms_norm_eps`` 1e-6, ``rope_theta`` 10000, ``max_position_embeddings`` 2048,
        ``dtype``/``torch_dtype`` bfloat16.
        """
        problems = [f"missing {key!r}" for key in ("hidden_size", "num_attention_heads", "intermediate_size",
                                                   "vocab_size", "draft_vocab_size") if cfg.get(key) is None]
        if problems:
            raise ExportError(f"drafter config: {'; '.join(problems)}")
        hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        n_aux = cfg.get("num_aux_hidden_states")
        if n_aux is None:
            n_aux = len(cfg["aux_layers"]) if cfg.get("aux_layers") else 3
        dtype = str(cfg.get("dtype") or cfg.get("torch_dtype") or "bfloat16").removeprefix("torch.")
        layout = str(cfg.get("layout") or ("mla" if cfg.get("kv_lora_rank") else "llama"))
        mla = tuple((key, int(cfg.get(key) or 0)) for key in MLA_FIELDS) if layout == "mla" else ()
        head_dim = (dict(mla)["qk_nope_head_dim"] + dict(mla)["qk_rope_head_dim"] if mla
                    else int(cfg.get("head_dim") or (hidden // heads if heads else 0)))
        shape = cls(
            hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=kv_heads,
            head_dim=head_dim,
            intermediate_size=int(cfg["intermediate_size"]), vocab_size=int(cfg["vocab_size"]),
            draft_vocab_size=int(cfg["draft_vocab_size"]),
            target_hidden_size=int(cfg.get("target_hidden_size") or hidden), num_aux_hidden_states=int(n_aux),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)), rope_theta=float(cfg.get("rope_theta", 10000.0)),
            rope_scaling=cfg.get("rope_scaling"), max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            dtype=dtype, flags=tuple(sorted(flags_of(cfg).items())), layout=layout, mla=mla,
            rope_interleave=bool(cfg.get("rope_interleave", True)),
        )  # fmt: skip
        shape._check(cfg)
        return shape

    def _check(self, cfg: Mapping) -> None:
        problems = []
        for name in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size",
                     "vocab_size", "draft_vocab_size", "target_hidden_size", "num_aux_hidden_states"):
            if getattr(self, name) <= 0:
                problems.append(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_key_value_heads > 0 and self.num_attention_heads % self.num_key_value_heads:
            problems.append(f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                            f"num_key_value_heads {self.num_key_value_heads}")
        if self.draft_vocab_size > self.vocab_size:
            problems.append(f"draft_vocab_size {self.draft_vocab_size} is larger than the target's vocab_size "
                            f"{self.vocab_size}")
        if self.dtype not in _DTYPES:
            problems.append(f"dtype {self.dtype!r}: use one of {sorted(_DTYPES)}")
        if cfg.get("hidden_act", "silu") != "silu":
            problems.append(f"hidden_act {cfg['hidden_act']!r}: SGLang's LlamaMLP supports only silu")
        if int(cfg.get("num_hidden_layers", 1)) != 1:
            problems.append(f"num_hidden_layers {cfg['num_hidden_layers']}: SGLang loads weights into layer 0 only "
                            "(midlayer -> layers.0); the drafter has exactly one decoder layer")
        if cfg.get("norm_before_residual"):
            problems.append("norm_before_residual is true: SGLang's LlamaForCausalLMEagle3 keeps the un-normed "
                            "hidden state as the residual; train with norm_before_residual false")
        if cfg.get("tie_word_embeddings"):
            problems.append("tie_word_embeddings is true: the drafter's lm_head [D, H] is its own weight")
        if self.layout not in ("llama", "mla"):
            problems.append(f"layout {self.layout!r}: llama or mla")
        if self.layout == "mla":
            problems += [f"the mla layout needs {key}" for key, value in self.mla if value <= 0]
            if self.num_key_value_heads != self.num_attention_heads:
                problems.append("the mla layout has a key and a value per head: num_key_value_heads must be "
                                "num_attention_heads")
            if self.variant_flags.get("norm_before_fc"):
                problems.append("norm_before_fc: SGLang's Eagle3DeepseekV2ForCausalLM has no norm before fc (it "
                                "would skip input_norm.weight silently); train the mla layout without it")
        if problems:
            raise ExportError("drafter config: " + "; ".join(problems))

    @property
    def mla_sizes(self) -> dict[str, int]:
        """The MLA sizes (empty for the llama layout)."""
        return dict(self.mla)

    @property
    def layout_fields(self) -> dict:
        """The layout and its sizes, as ``DrafterConfig`` takes them."""
        return {"layout": self.layout, **self.mla_sizes, "rope_interleave": self.rope_interleave}

    @property
    def variant_flags(self) -> dict[str, bool]:
        """fc_norm, norm_before_fc, norm_output: what the drafter adds to the EAGLE-3 layout."""
        return dict(self.flags)

    @property
    def torch_dtype(self) -> torch.dtype:
        """The float dtype of the exported weights."""
        return _DTYPES[self.dtype]

    @property
    def needs_embed_tokens(self) -> bool:
        """SGLang shares the target's embedding only when the hidden sizes agree (``set_embed``)."""
        return self.target_hidden_size != self.hidden_size


def _shape_of(cfg: Mapping | DrafterShape) -> DrafterShape:
    return cfg if isinstance(cfg, DrafterShape) else DrafterShape.from_config(cfg)


def expected_sglang_tensors(cfg: Mapping | DrafterShape) -> dict[str, tuple[int, ...]]:
    """Every tensor SGLang's ``LlamaForCausalLMEagle3.load_weights`` must find, with its shape.

    Names are the checkpoint's (``midlayer.*``), in the order they are written.
    """
    s = _shape_of(cfg)
    h, inter = s.hidden_size, s.intermediate_size
    tensors = _attention_tensors(s) | {
        "midlayer.mlp.gate_proj.weight": (inter, h),
        "midlayer.mlp.up_proj.weight": (inter, h),
        "midlayer.mlp.down_proj.weight": (h, inter),
        "midlayer.input_layernorm.weight": (h,),
        "midlayer.hidden_norm.weight": (h,),
        "midlayer.post_attention_layernorm.weight": (h,),
        "fc.weight": (h, s.num_aux_hidden_states * s.target_hidden_size),
        "norm.weight": (h,),
        "lm_head.weight": (s.draft_vocab_size, h),
        "d2t": (s.draft_vocab_size,),
        "t2d": (s.vocab_size,),
    }
    tensors.update(extra_tensors(s.variant_flags, s.num_aux_hidden_states, s.target_hidden_size))
    if s.needs_embed_tokens:
        tensors["embed_tokens.weight"] = (s.vocab_size, h)
    return tensors


def _attention_tensors(s: DrafterShape) -> dict[str, tuple[int, ...]]:
    """The attention's tensors: q/k/v/o (llama), or the MLA projections (train/model_mla.py's docstring)."""
    h = s.hidden_size
    if s.layout == "mla":
        m, heads = s.mla_sizes, s.num_attention_heads
        return {  # input: [input_layernorm(embeds); hidden_norm(hidden)], 2H
            "midlayer.self_attn.q_a_proj.weight": (m["q_lora_rank"], 2 * h),
            "midlayer.self_attn.q_a_layernorm.weight": (m["q_lora_rank"],),
            "midlayer.self_attn.q_b_proj.weight": (heads * s.head_dim, m["q_lora_rank"]),
            "midlayer.self_attn.kv_a_proj_with_mqa.weight": (m["kv_lora_rank"] + m["qk_rope_head_dim"], 2 * h),
            "midlayer.self_attn.kv_a_layernorm.weight": (m["kv_lora_rank"],),
            "midlayer.self_attn.kv_b_proj.weight": (heads * (m["qk_nope_head_dim"] + m["v_head_dim"]),
                                                    m["kv_lora_rank"]),
            "midlayer.self_attn.o_proj.weight": (h, heads * m["v_head_dim"]),
        }
    q, kv = s.num_attention_heads * s.head_dim, s.num_key_value_heads * s.head_dim
    return {
        "midlayer.self_attn.q_proj.weight": (q, 2 * h),  # input: [input_layernorm(embeds); hidden_norm(hidden)]
        "midlayer.self_attn.k_proj.weight": (kv, 2 * h),
        "midlayer.self_attn.v_proj.weight": (kv, 2 * h),
        "midlayer.self_attn.o_proj.weight": (h, q),
    }


def expected_speculators_tensors(cfg: Mapping | DrafterShape) -> dict[str, tuple[int, ...]]:
    """The same tensors under speculators' names (``layers.0.*`` for ``midlayer.*``)."""
    return {_to_speculators_name(name): shape for name, shape in expected_sglang_tensors(cfg).items()}


def _to_speculators_name(name: str) -> str:
    return _SPECULATORS_LAYER + name[len(_MIDLAYER):] if name.startswith(_MIDLAYER) else name


def _to_drafter_name(name: str) -> str:
    return _MIDLAYER + name[len(_SPECULATORS_LAYER):] if name.startswith(_SPECULATORS_LAYER) else name


def _expected_dtype(name: str, shape: DrafterShape) -> torch.dtype:
    return {"d2t": torch.int64, "t2d": torch.bool}.get(name, shape.torch_dtype)


def check_drafter_tensors(state_dict: Mapping[str, torch.Tensor], cfg: Mapping | DrafterShape) -> dict:
    """Check a drafter state dict (drafter names) against SGLang's expectations; return the export tensors.

    Refuses, listing every problem at once: missing names, extra names (SGLang would skip them
    silently), wrong shapes, a non-float weight, ``d2t`` not int64, ``t2d`` not bool,
    non-finite values, and a ``d2t``/``t2d`` pair that is not one draft vocabulary
    (``train.vocab.check_mapping``). Float weights are cast to the export dtype
    (``cfg['dtype']``), so fp32 master weights can be passed as they are. The result is ordered
    as ``expected_sglang_tensors`` and holds contiguous CPU tensors.
    """
    s = _shape_of(cfg)
    expected = expected_sglang_tensors(s)
    problems = []
    missing = [name for name in expected if name not in state_dict]
    if missing:
        problems.append(f"missing: {', '.join(missing)}")
    extra = sorted(name for name in state_dict if name not in expected)
    if extra:
        hint = ""
        if "embed_tokens.weight" in extra:
            hint = (" (embed_tokens.weight is exported only when target_hidden_size != hidden_size; otherwise "
                    "SGLang uses the target's embedding: drop it from the state dict)")
        problems.append(f"unexpected (SGLang would skip them silently): {', '.join(extra)}{hint}")
    out = {}
    for name, want in expected.items():
        tensor = state_dict.get(name)
        if tensor is None:
            continue
        if not isinstance(tensor, torch.Tensor):
            problems.append(f"{name}: not a tensor ({type(tensor).__name__})")
            continue
        if tuple(tensor.shape) != want:
            problems.append(f"{name}: shape {list(tensor.shape)}, expected {list(want)}")
            continue
        dtype = _expected_dtype(name, s)
        if dtype.is_floating_point:
            if not tensor.is_floating_point():
                problems.append(f"{name}: dtype {tensor.dtype}, expected a float dtype (exported as {s.dtype})")
                continue
            tensor = tensor.detach().to(device="cpu", dtype=dtype)
            if not bool(torch.isfinite(tensor).all()):
                problems.append(f"{name}: has non-finite values")
                continue
        elif tensor.dtype != dtype:
            problems.append(f"{name}: dtype {tensor.dtype}, expected {dtype}")
            continue
        out[name] = tensor.detach().to("cpu").contiguous()
    if "d2t" in out and "t2d" in out:
        try:
            check_mapping(out["d2t"], out["t2d"], s.vocab_size)
        except VocabError as exc:
            problems.append(f"d2t/t2d: {exc}")
    if problems:
        architecture = SGLANG_MLA_ARCHITECTURE if s.layout == "mla" else SGLANG_ARCHITECTURE
        raise ExportError(f"drafter weights do not match what SGLang's {architecture} loads:\n  - "
                          + "\n  - ".join(problems))
    return out


def _target_config(manifest: Mapping) -> dict:
    path = manifest.get("target_model_path")
    if not path or not (Path(path) / CONFIG_FILE).is_file():
        return {}
    try:
        return json.loads((Path(path) / CONFIG_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}


def target_model_type(manifest: Mapping, override: str | None = None) -> str:
    """The target's ``model_type`` (config.json), which picks SGLang's layer-id rule.

    From ``override``, else the manifest's ``target_model_type``/``model_type``, else the
    target's config.json at the manifest's ``target_model_path``.
    """
    model_type = override or manifest.get("target_model_type") or manifest.get("model_type") \
        or _target_config(manifest).get("model_type")
    if not model_type:
        raise ExportError(
            f"cannot tell the target's model_type: the manifest names no model_type and "
            f"{manifest.get('target_model_path')!r} has no readable config.json here; pass target_model_type "
            f"(one of {sorted(LAYER_ID_CONVENTIONS)})"
        )
    return str(model_type)


def _aux_layers(manifest: Mapping, shape: DrafterShape) -> list[int]:
    aux = manifest.get("aux_layers")
    if not aux:
        raise ExportError("the manifest has no aux_layers: export needs the layers the training data was captured at")
    aux = [int(a) for a in aux]
    if len(aux) != shape.num_aux_hidden_states:
        raise ExportError(f"the manifest captured {len(aux)} aux layers {aux}, the drafter's fc takes "
                          f"{shape.num_aux_hidden_states}: this drafter was not trained on this data")
    problems = []
    if manifest.get("hidden_size") is not None and int(manifest["hidden_size"]) != shape.target_hidden_size:
        problems.append(f"the manifest's hidden_size {manifest['hidden_size']} != the drafter's target_hidden_size "
                        f"{shape.target_hidden_size}")
    if manifest.get("vocab_size") is not None and int(manifest["vocab_size"]) != shape.vocab_size:
        problems.append(f"the manifest's vocab_size {manifest['vocab_size']} != the drafter's vocab_size "
                        f"{shape.vocab_size}")
    if problems:
        raise ExportError("the manifest is from another model than the drafter's: " + "; ".join(problems))
    return aux


def _provenance(manifest: Mapping, aux: list[int], model_type: str, form: str) -> dict:
    return {
        "form": form,
        "aux_layers": aux,
        "aux_layer_convention": AUX_LAYER_CONVENTION,
        "target_model_type": model_type,
        "target_model_path": manifest.get("target_model_path"),
        "target_config_sha256": manifest.get("target_config_sha256"),
        "sglang_version": SGLANG_VERSION,
    }


def _layer_config(shape: DrafterShape) -> dict:
    """The Llama decoder-layer keys both forms share."""
    return {
        "model_type": "llama",
        "hidden_size": shape.hidden_size,
        "intermediate_size": shape.intermediate_size,
        "num_hidden_layers": 1,
        "num_attention_heads": shape.num_attention_heads,
        "num_key_value_heads": shape.num_key_value_heads,
        "head_dim": shape.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": shape.rms_norm_eps,
        "rope_theta": shape.rope_theta,
        "rope_scaling": shape.rope_scaling,
        "max_position_embeddings": shape.max_position_embeddings,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "vocab_size": shape.vocab_size,
        "torch_dtype": shape.dtype,
    }


def sglang_config(drafter_cfg: Mapping, manifest: Mapping, target_model_type_override: str | None = None) -> dict:
    """``config.json`` for SGLang's ``LlamaForCausalLMEagle3``, aux layer ids in SGLang's numbering.

    ``eagle_config.eagle_aux_hidden_state_layer_ids`` = ``sglang_layer_ids(manifest aux_layers,
    target model_type)``: SGLang passes it unchanged to the target's
    ``set_eagle3_layers_to_capture`` (module docstring), so the target captures exactly the
    layers the training data was captured at. When the data came from SGLang, the manifest's
    ``engine_layer_ids`` (what the capture server was launched with) must be the same ids.
    """
    shape = _shape_of(drafter_cfg)
    aux = _aux_layers(manifest, shape)
    model_type = target_model_type(manifest, target_model_type_override)
    try:
        ids = sglang_layer_ids(aux, model_type, manifest.get("num_hidden_layers"))
    except ValueError as exc:
        raise ExportError(f"aux layers {aux}: {exc}") from exc
    engine_ids = manifest.get("engine_layer_ids")
    if str(manifest.get("engine", "")).startswith("sglang") and engine_ids is not None \
            and [int(i) for i in engine_ids] != ids:
        raise ExportError(f"the data was captured by SGLang with layer ids {list(engine_ids)}, but aux_layers {aux} "
                          f"of a {model_type} target give {ids}: the manifest's model_type or layers are wrong")
    return {
        "architectures": [SGLANG_MLA_ARCHITECTURE if shape.layout == "mla" else SGLANG_ARCHITECTURE],
        **(_mla_config(shape) if shape.layout == "mla" else _layer_config(shape)),
        "draft_vocab_size": shape.draft_vocab_size,
        "target_hidden_size": shape.target_hidden_size,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": ids, "use_aux_hidden_state": True},
        **sglang_keys(shape.variant_flags),
        PROVENANCE_KEY: {**_provenance(manifest, aux, model_type, "sglang"),
                         "variant": variant_name(shape.variant_flags), "layout": shape.layout},
    }


def _mla_config(shape: DrafterShape) -> dict:
    """The keys of the MLA layout: a DeepSeek-V3 config (what transformers parses and SGLang's
    ``Eagle3MLADecoderLayer`` reads), its head_dim left to the config class (q . k spans d_nope + d_rope)."""
    layer = {key: value for key, value in _layer_config(shape).items() if key != "head_dim"}
    return {**layer, "model_type": "deepseek_v3", **shape.mla_sizes, "rope_interleave": shape.rope_interleave}


def speculators_config(drafter_cfg: Mapping, manifest: Mapping, speculative_tokens: int = 3,
                       target_model_type_override: str | None = None) -> dict:
    """``config.json`` in speculators' Eagle3 form (what vLLM reads); aux ids = ours + 1 (module docstring)."""
    shape = _shape_of(drafter_cfg)
    aux = _aux_layers(manifest, shape)
    if len(aux) != SPECULATORS_AUX_COUNT:
        raise ExportError(f"the speculators/vLLM Eagle3 drafter takes exactly {SPECULATORS_AUX_COUNT} aux layers "
                          f"(fc is target_hidden_size * 3 wide); this one has {len(aux)}: export the SGLang form only")
    if int(speculative_tokens) < 1:
        raise ExportError(f"speculative_tokens {speculative_tokens} must be >= 1")
    if shape.layout == "mla":
        raise ExportError("the speculators/vLLM Eagle3 drafter has Llama attention, not this drafter's multi-latent "
                          "attention: export the SGLang form only")
    if any(shape.variant_flags.values()):
        set_flags = ", ".join(key for key, value in sorted(shape.variant_flags.items()) if value)
        raise ExportError(f"the speculators/vLLM Eagle3 drafter has no {set_flags} (EAGLE 3.1): export the SGLang "
                          "form only")
    model_type = target_model_type(manifest, target_model_type_override)
    try:
        if manifest.get("num_hidden_layers") is not None:
            check_aux_layers(aux, int(manifest["num_hidden_layers"]))
    except ValueError as exc:
        raise ExportError(str(exc)) from exc
    if aux != sorted(set(aux)):
        raise ExportError(f"aux_layers {aux}: distinct ids in ascending order (servers concatenate in layer order)")
    layer_config = _layer_config(shape)
    dtype = layer_config.pop("torch_dtype")
    return {
        "architectures": [SPECULATORS_ARCHITECTURE],
        "speculators_model_type": "eagle3",
        "transformer_layer_config": layer_config,
        "draft_vocab_size": shape.draft_vocab_size,
        "target_hidden_size": shape.target_hidden_size,
        "norm_before_residual": False,  # vLLM defaults an absent key to True, not SGLang's layer
        "eagle_aux_hidden_state_layer_ids": [a + 1 for a in aux],
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": int(speculative_tokens)}],
            "default_proposal_method": "greedy",
            "verifier": {
                "name_or_path": manifest.get("target_model_path"),
                "architectures": list(_target_config(manifest).get("architectures") or []),
            },
        },
        "torch_dtype": dtype,
        PROVENANCE_KEY: _provenance(manifest, aux, model_type, "speculators"),
    }


def _write(out_dir: Path, tensors: dict[str, torch.Tensor], config: dict) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    # Without config.json the directory is an incomplete export: a crash below leaves it so.
    (out_dir / CONFIG_FILE).unlink(missing_ok=True)
    digest = hashlib.sha256()

    def write_weights(tmp: str) -> None:
        save_safetensors(tensors, tmp, {"format": "pt", "producer": PROVENANCE_KEY}, digest)

    atomic_write(out_dir / WEIGHTS_FILE, write_weights)
    config = {**config, PROVENANCE_KEY: {**config[PROVENANCE_KEY], "weights_sha256": digest.hexdigest()}}
    atomic_write_text(out_dir / CONFIG_FILE, json.dumps(config, indent=2) + "\n")
    return out_dir


def export_sglang(state_dict: Mapping[str, torch.Tensor], drafter_cfg: Mapping, manifest: Mapping,
                  out_dir: str | os.PathLike, target_model_type_override: str | None = None) -> Path:
    """Write ``out_dir/config.json`` + ``model.safetensors`` that SGLang 0.5.23 loads as an EAGLE-3 draft.

    Everything is checked before anything is written (``check_drafter_tensors``,
    ``sglang_config``); files appear atomically (module docstring).
    """
    shape = _shape_of(drafter_cfg)
    config = sglang_config(drafter_cfg, manifest, target_model_type_override)
    tensors = check_drafter_tensors(state_dict, shape)
    return _write(Path(out_dir), tensors, config)


def export_speculators(state_dict: Mapping[str, torch.Tensor], drafter_cfg: Mapping, manifest: Mapping,
                       out_dir: str | os.PathLike, speculative_tokens: int = 3,
                       target_model_type_override: str | None = None) -> Path:
    """Write the speculators form (``speculators_model_type: eagle3``) that vLLM loads, checked the same way.

    Weight names are speculators' (``layers.0.*`` for ``midlayer.*``); the tensors are those of
    ``check_drafter_tensors``.
    """
    shape = _shape_of(drafter_cfg)
    config = speculators_config(drafter_cfg, manifest, speculative_tokens, target_model_type_override)
    tensors = check_drafter_tensors(state_dict, shape)
    return _write(Path(out_dir), {_to_speculators_name(k): v for k, v in tensors.items()}, config)


def remove_export(out_dir: str | os.PathLike) -> bool:
    """Remove a directory this exporter wrote (its config.json names this project as producer, or it holds only
    an incomplete export's files); False when there is none. Anything else is left alone."""
    out_dir = Path(out_dir)
    if not out_dir.is_dir():
        return False
    try:
        ours = PROVENANCE_KEY in json.loads((out_dir / CONFIG_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        ours = {p.name for p in out_dir.iterdir()} <= {WEIGHTS_FILE}
    if ours:
        shutil.rmtree(out_dir)
    return ours


def _shape_from_export(config: Mapping, where: Path) -> tuple[str, DrafterShape]:
    if config.get("speculators_model_type") == "eagle3":
        layer = dict(config.get("transformer_layer_config") or {})
        ids = config.get("eagle_aux_hidden_state_layer_ids") or []
        cfg = {**layer, "draft_vocab_size": config.get("draft_vocab_size"),
               "target_hidden_size": config.get("target_hidden_size"), "num_aux_hidden_states": len(ids) or None,
               "torch_dtype": config.get("torch_dtype")}
        return "speculators", DrafterShape.from_config(cfg)
    architectures = config.get("architectures") or []
    if SGLANG_ARCHITECTURE in architectures or SGLANG_MLA_ARCHITECTURE in architectures:
        ids = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids") or []
        layout = "mla" if SGLANG_MLA_ARCHITECTURE in architectures else "llama"
        return "sglang", DrafterShape.from_config({**config, "num_aux_hidden_states": len(ids) or None,
                                                   "layout": layout})
    raise ExportError(f"{where / CONFIG_FILE}: neither an SGLang {SGLANG_ARCHITECTURE} or "
                      f"{SGLANG_MLA_ARCHITECTURE} nor a speculators eagle3 config")


def load_export(out_dir: str | os.PathLike) -> tuple[dict[str, torch.Tensor], dict]:
    """Read an export back: (state dict in the drafter's names, config as written).

    Either form; speculators' ``layers.0.*`` come back as ``midlayer.*``, so the result loads
    into the drafter. Refuses an incomplete export (no config.json), weights whose SHA-256
    differs from the one config.json records, and tensors that do not match the config (the
    same check as on export, dtypes exact).
    """
    out_dir = Path(out_dir)
    config_path, weights_path = out_dir / CONFIG_FILE, out_dir / WEIGHTS_FILE
    if not config_path.is_file():
        raise ExportError(f"{out_dir}: no {CONFIG_FILE}, so not a complete export (an interrupted export leaves "
                          "it so); export again")
    config = json.loads(config_path.read_text(encoding="utf-8"))
    form, shape = _shape_from_export(config, out_dir)
    if not weights_path.is_file():
        raise ExportError(f"{weights_path}: missing; export again")
    recorded = (config.get(PROVENANCE_KEY) or {}).get("weights_sha256")
    if recorded:
        actual = hashlib.sha256(weights_path.read_bytes()).hexdigest()
        if actual != recorded:
            raise ExportError(f"{weights_path}: SHA-256 {actual} differs from {recorded} recorded in {CONFIG_FILE}: "
                              "the weights were changed or belong to another export")
    try:
        stored = load_file(weights_path)
    except (SafetensorError, OSError) as exc:
        raise ExportError(f"{weights_path}: not a readable safetensors file ({exc})") from exc
    state = {_to_drafter_name(k) if form == "speculators" else k: v for k, v in stored.items()}
    wrong = [f"{name}: {v.dtype}, expected {_expected_dtype(name, shape)}" for name, v in state.items()
             if name in expected_sglang_tensors(shape) and v.dtype != _expected_dtype(name, shape)]
    if wrong:
        raise ExportError(f"{weights_path}: dtypes differ from config.json's: {'; '.join(wrong)}")
    check_drafter_tensors(state, shape)
    return state, config
