"""engine/slots.py's plan: a model the slot cache cannot hold (multi-latent attention) gets no slots, so the
reference server starts on the transformers path instead of failing (a DeepSeek-V3 target has no head_dim)."""

from __future__ import annotations

import torch
from train_fixtures import build_target

from eagle3_pipeline.engine.slots import plan_slots, unsupported


def test_a_deepseek_v3_target_gets_no_slots_and_a_llama_target_gets_them(tmp_path):
    torch.set_num_threads(1)
    _, deepseek = build_target(tmp_path / "deepseek", deepseek=True)
    assert unsupported(deepseek) is not None
    assert plan_slots(deepseek, 8, 256, 1.0) == (0, 256)
    _, llama = build_target(tmp_path / "llama")
    assert unsupported(llama) is None
    slots, tokens = plan_slots(llama, 8, 128, 1.0)
    assert slots == 8 and tokens == 128
