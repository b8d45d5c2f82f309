"""Which decoder layers' outputs are captured for EAGLE-3 (our convention: 0-based layer
indices whose OUTPUT is captured, i.e. Hugging Face ``hidden_states[i + 1]``)."""

from __future__ import annotations


def default_aux_layers(num_layers: int) -> list[int]:
    """EAGLE-3's usual choice: an early, a middle and a late layer, [1, L/2 - 1, L - 4].

    For a 61-layer model that is [1, 29, 57]; for small models the picks are clamped into
    range and kept distinct and sorted.
    """
    if num_layers < 1:
        raise ValueError(f"a model with {num_layers} decoder layers has nothing to capture")
    picks = [1, num_layers // 2 - 1, num_layers - 4]
    return sorted({min(max(i, 0), num_layers - 1) for i in picks})


def check_aux_layers(aux_layers: list[int], num_layers: int) -> list[int]:
    """Validate explicit aux layers against the model; raise ValueError naming the bad one."""
    if not aux_layers:
        raise ValueError("aux layers: the list is empty")
    for layer in aux_layers:
        if not isinstance(layer, int) or isinstance(layer, bool) or not 0 <= layer < num_layers:
            raise ValueError(
                f"aux layer {layer!r} is not a decoder layer of this model (0-based, 0 to {num_layers - 1})"
            )
    if len(set(aux_layers)) != len(aux_layers):
        raise ValueError(f"aux layers {aux_layers} repeat a layer")
    return list(aux_layers)
