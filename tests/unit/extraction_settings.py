"""The settings and run facts of a made-up extraction, for tests that write datasets with the store."""

from __future__ import annotations

RUN = {
    "dataset": {"name": "chats.jsonl", "sha256": "d" * 64, "num_samples_limit": None},
    "verification": {"positions": "all", "tolerance_logits": 0.05, "checks": ["top1"]},
}


def settings(hidden: int, aux_layers: list[int], vocab: int, shard: int, dtype: str) -> dict:
    """What ``store.claim_settings`` records for an extraction of these shapes."""
    return {
        "target_model_path": "/models/target",
        "target_config_sha256": "c" * 64,
        "tokenizer_sha256": {"tokenizer.json": "t" * 64},
        "chat_template_sha256": "h" * 64,
        "chat_template_file": None,
        "engine": "reference",
        "engine_version": "0.1.0",
        "aux_layers": aux_layers,
        "aux_layer_convention": "0-based",
        "engine_layer_ids": None,
        "hidden_size": hidden,
        "num_hidden_layers": 4,
        "vocab_size": vocab,
        "dtype": dtype,
        "max_length": 64,
        "overflow": "truncate",
        "shard_size": shard,
    }
