"""Reading single tensors from a Hugging Face checkpoint's safetensors, without loading the model.

The extraction reads the target's ``lm_head`` to check captures; training reads its
``embed_tokens`` and ``lm_head``. A checkpoint is one ``model.safetensors`` or shards named by
``model.safetensors.index.json``; either way only the asked tensor is read (safetensors loads
no code).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open


def weight_map(model_path: str | Path) -> dict[str, str]:
    """Tensor name -> file name (relative to ``model_path``); FileNotFoundError when there are none."""
    model_path = Path(model_path)
    index_file = model_path / "model.safetensors.index.json"
    if index_file.is_file():
        return json.loads(index_file.read_text())["weight_map"]
    single = model_path / "model.safetensors"
    if not single.is_file():
        raise FileNotFoundError(f"{model_path}: no model.safetensors or model.safetensors.index.json")
    with safe_open(str(single), framework="pt") as handle:
        return {name: "model.safetensors" for name in handle.keys()}  # noqa: SIM118 - not a dict


def read_tensor(model_path: str | Path, names: dict[str, str], name: str) -> torch.Tensor:
    """The tensor ``name`` of the checkpoint (``names`` from ``weight_map``)."""
    with safe_open(str(Path(model_path) / names[name]), framework="pt") as handle:
        return handle.get_tensor(name)
