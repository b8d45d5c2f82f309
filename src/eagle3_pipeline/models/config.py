"""The language model's fields of a Hugging Face ``config.json`` (standard library only).

Multimodal targets (Kimi-K2.5, for one) keep ``hidden_size``, ``num_hidden_layers`` and
``vocab_size`` in ``text_config``; plain language models keep them at the top level.
"""

from __future__ import annotations

import json
from pathlib import Path


def text_config(config: dict) -> dict:
    """The fields of the language model: the top level when it has them, else ``text_config``."""
    if "hidden_size" not in config and isinstance(config.get("text_config"), dict):
        return config["text_config"]
    return config


def read_text_config(model_path: str | Path) -> dict:
    """``text_config`` of ``<model_path>/config.json``."""
    return text_config(json.loads((Path(model_path) / "config.json").read_text()))
