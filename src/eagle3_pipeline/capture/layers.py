"""Which decoder layers' outputs are captured for EAGLE-3 (our convention: 0-based layer
indices whose OUTPUT is captured, i.e. Hugging Face ``hidden_states[i + 1]``).

SGLang's ``LlamaForCausalLM.set_eagle3_layers_to_capture`` (0.5.23) adds 1 to the ids it is
given and captures before those layers, so for Llama its ids equal ours; with no ids it
captures before layers ``[2, L // 2, L - 3]``, i.e. the outputs of ``[1, L // 2 - 1, L - 4]``.
The last layer's output cannot be an aux layer: Hugging Face reports it after the final
norm (it is captured as ``last_hidden_states``) and SGLang does not capture it either.
"""

from __future__ import annotations

# What an aux layer index means, recorded with the data and the drafter it is read into.
AUX_LAYER_CONVENTION = "0-based decoder layer index; captured = output of that layer = HF hidden_states[i + 1]"


def default_aux_layers(num_layers: int) -> list[int]:
    """EAGLE-3's usual three aux layers, in this project's convention (0-based, output of the layer).

    SGLang's ``LlamaForCausalLM.set_eagle3_layers_to_capture`` defaults to capturing before
    layers ``[2, L // 2, L - 3]``, i.e. the outputs of layers ``[1, L // 2 - 1, L - 4]``. The ids
    must be distinct and ascending (servers concatenate captures in layer order, and the drafter's
    export refuses anything else), and within ``[0, L - 2]`` (the last layer's output is not
    capturable, see the module docstring). For shallow models (L < 8) where that formula repeats
    or leaves the range, three layers spread evenly over ``[0, L - 2]`` are taken instead (all
    of them when fewer than three exist).
    """
    if num_layers < 2:
        raise ValueError(f"the model has {num_layers} decoder layer(s); EAGLE-3 capture needs at least 2")
    usual = [1, num_layers // 2 - 1, num_layers - 4]
    if usual == sorted(set(usual)) and 0 <= usual[0] and usual[-1] <= num_layers - 2:
        return usual
    last = num_layers - 2
    if last < 2:
        return list(range(last + 1))
    return sorted({round(i * last / 2) for i in range(3)})


def check_aux_layers(aux_layers: list[int], num_layers: int) -> list[int]:
    """Refuse aux layer ids outside ``[0, L - 2]`` or not distinct and ascending, with the reason."""
    if not aux_layers:
        raise ValueError("--aux-layers is empty: give at least one 0-based decoder layer index, e.g. 1,3,5")
    if list(aux_layers) != sorted(set(aux_layers)):
        raise ValueError(f"aux layers {list(aux_layers)}: use distinct layer indices in ascending order (servers "
                         "concatenate the captures in layer order, and the drafter is exported that way)")
    for layer in aux_layers:
        if not 0 <= layer <= num_layers - 2:
            raise ValueError(
                f"aux layer {layer} is out of range for a model with {num_layers} decoder layers: "
                f"use 0..{num_layers - 2} "
                f"(0-based; the output of layer {num_layers - 1} feeds the final norm and is captured as "
                "last_hidden_states after that norm)"
            )
    return list(aux_layers)
