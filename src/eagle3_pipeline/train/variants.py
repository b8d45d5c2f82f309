"""The drafter's variants and what each one is in SGLang's terms: its config keys and its extra weights.

SGLang 0.5.23's ``LlamaForCausalLMEagle3`` (``srt/models/llama_eagle3.py``) reads three flags
beside the EAGLE-3 layout of May 2025; EAGLE 3.1 (May 2026: the EAGLE, vLLM and TorchSpec teams)
is two of them:

==================  ===============================================  ====================================
flag                what SGLang does with it                          weights it loads
==================  ===============================================  ====================================
``fc_norm``         an RMSNorm on each aux state before ``fc``        ``fc_norm.{i}.weight`` [T], one per
                    (legacy key ``use_aux_norm``)                     aux layer (legacy names
                                                                      ``aux_norm_{low,mid,high}``)
``norm_before_fc``  one RMSNorm over the concatenated aux states      ``input_norm.weight`` [n*T]
                    before ``fc`` (top level or ``eagle_config``)
``norm_output``     the next draft step reads the final norm's        none
                    output, not the pre-norm sum
==================  ===============================================  ====================================

``eagle3.1`` sets ``fc_norm`` and ``norm_output`` (the paper's fix for "attention drift": as
drafting goes deeper, the highest aux layer dominates the fused input and the residual stream's
magnitude grows); ``norm_before_fc`` is a separate option of either variant. The names below are
the checkpoint's, as the exporter writes them (SGLang looks each up as is or under ``model.``).
"""

from __future__ import annotations

from collections.abc import Mapping

VARIANTS = {
    "eagle3": {"fc_norm": False, "norm_output": False},
    "eagle3.1": {"fc_norm": True, "norm_output": True},
}
DEFAULT_VARIANT = "eagle3"
FLAGS = ("fc_norm", "norm_before_fc", "norm_output")


class VariantError(ValueError):
    """A variant or a set of flags this project cannot train or export; the message names it."""


def variant_flags(variant: str, norm_before_fc: bool = False) -> dict[str, bool]:
    """The flags of ``variant`` (``eagle3`` or ``eagle3.1``), with ``norm_before_fc``."""
    if variant not in VARIANTS:
        raise VariantError(f"drafter variant {variant!r}: use one of {', '.join(VARIANTS)}")
    return {**VARIANTS[variant], "norm_before_fc": bool(norm_before_fc)}


def flags_of(config: Mapping) -> dict[str, bool]:
    """The flags a config holds, read as SGLang reads them: ``fc_norm`` or the legacy ``use_aux_norm``;
    ``norm_before_fc`` in ``eagle_config`` or at the top level; ``norm_output``."""
    eagle = config.get("eagle_config") if isinstance(config.get("eagle_config"), Mapping) else {}
    return {
        "fc_norm": bool(config.get("fc_norm") or config.get("use_aux_norm")),
        "norm_before_fc": bool(eagle.get("norm_before_fc", config.get("norm_before_fc", False))),
        "norm_output": bool(config.get("norm_output", False)),
    }


def variant_name(flags: Mapping) -> str:
    """The variant a set of flags is (``norm_before_fc`` aside), or a description of flags that are neither."""
    core = {key: bool(flags.get(key)) for key in ("fc_norm", "norm_output")}
    for name, wanted in VARIANTS.items():
        if core == wanted:
            return name
    return "custom (" + ", ".join(f"{key}={value}" for key, value in core.items()) + ")"


def sglang_keys(flags: Mapping) -> dict[str, bool]:
    """The config.json keys that tell SGLang the flags (only the ones set: an eagle3 config is as before)."""
    return {key: True for key in FLAGS if flags.get(key)}


def extra_tensors(flags: Mapping, num_aux: int, target_hidden: int) -> dict[str, tuple[int, ...]]:
    """The checkpoint tensors the flags add, with their shapes."""
    tensors: dict[str, tuple[int, ...]] = {}
    if flags.get("norm_before_fc"):
        tensors["input_norm.weight"] = (num_aux * target_hidden,)
    if flags.get("fc_norm"):
        tensors.update({f"fc_norm.{i}.weight": (target_hidden,) for i in range(num_aux)})
    return tensors
