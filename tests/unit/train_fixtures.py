"""A tiny random Llama target and an extraction of it, for the training tests (CPU, seconds)."""

from __future__ import annotations

from pathlib import Path

import torch
from extraction_settings import RUN, settings

from eagle3_pipeline.extract import store

VOCAB, HIDDEN, LAYERS, AUX = 64, 32, 4, [0, 1, 2]
NUM_SAMPLES = 14


# A DeepSeek-V3-shaped target (multi-latent attention, YaRN, dense layers): what Kimi-K2.x is, tiny.
DEEPSEEK_V3 = {"q_lora_rank": 16, "kv_lora_rank": 8, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 8,
               "num_key_value_heads": 4, "num_hidden_layers": LAYERS + 1, "first_k_dense_replace": LAYERS + 1,
               "n_routed_experts": 4,
               "num_experts_per_tok": 2, "n_group": 1, "topk_group": 1, "moe_intermediate_size": 16,
               "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                                "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}}


def build_target(path: Path, deepseek: bool = False):
    """A tiny random Llama (``deepseek``: DeepSeek-V3) saved to ``path`` with a sharp lm_head (something to
    learn); (path, model)."""
    import transformers  # noqa: PLC0415

    torch.manual_seed(0)
    shape = {"vocab_size": VOCAB, "hidden_size": HIDDEN, "intermediate_size": 64, "num_hidden_layers": LAYERS,
             "num_attention_heads": 4, "max_position_embeddings": 256, "tie_word_embeddings": False}
    if deepseek:
        model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**{**shape, **DEEPSEEK_V3})).eval()
    else:
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**shape, num_key_value_heads=2)).eval()
    with torch.no_grad():  # a sharp teacher (a random head is near uniform): something to learn
        model.lm_head.weight.mul_(40.0)
    model.save_pretrained(path, safe_serialization=True)
    return path, model


def build_data(out: Path, path: Path, model, aux: list[int] = AUX) -> Path:
    """The target's real hidden states of NUM_SAMPLES patterned samples at layers ``aux``, stored as an extraction
    does."""
    store.claim_settings(out, {**settings(HIDDEN, aux, VOCAB, 4, "float32"), "target_model_path": str(path),
                               "num_hidden_layers": model.config.num_hidden_layers})
    samples = []
    gen = torch.Generator().manual_seed(1)
    for ordinal in range(NUM_SAMPLES):
        tokens = 12 + (ordinal * 5) % 20
        # A repetitive pattern the drafter can learn, plus noise.
        ids = ((torch.arange(tokens) * (1 + ordinal % 3) + torch.randint(0, 3, (tokens,), generator=gen)) % VOCAB)
        mask = torch.ones(tokens, dtype=torch.uint8)
        mask[:3] = 0
        with torch.no_grad():
            hidden = model(ids[None], output_hidden_states=True).hidden_states
        states = torch.cat([hidden[layer + 1][0] for layer in aux], dim=-1).float()
        last = hidden[-1][0].float()
        file = f"{store.shard_dir_name(ordinal, 4)}/s-{ordinal}{store.SAMPLE_SUFFIX}"
        size, sha = store.write_sample(out / file, ids.to(torch.int32), mask, states, last,
                                       {"format": store.FORMAT, "id": f"s-{ordinal}"})
        samples.append({"key": f"k-{ordinal}", "status": "ok", "ordinal": ordinal, "line": ordinal + 1,
                        "id": f"s-{ordinal}", "file": file, "tokens": tokens, "loss_tokens": int(mask.sum()),
                        "bytes": size, "sha256": sha})
    store.write_part_manifest(out, 0, 1, samples, [], [], NUM_SAMPLES, RUN)
    store.merge(out)
    return out
