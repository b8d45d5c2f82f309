"""The embedded tiny target model as the tests use it: built once per checkout and seed, then shared.

The seed comes from ``$EAGLE3_TINY_SEED`` (0 when unset), as the package's own builds take it, and each
seed has its own directory in the checkout's cache (.cache/models/tiny-llama, tiny-llama-seed-N): the
model is trained on each machine, so its answers differ between machines, and ``make test-seeds`` runs
the tests that use it against models built from other seeds, to show that they hold for any of them.
"""

from __future__ import annotations

from pathlib import Path

from eagle3_pipeline.models.tiny import build_tiny_model, cache_name, seed_from_env

ROOT = Path(__file__).resolve().parents[1]


def tiny_model_dir() -> Path:
    """Where this checkout keeps the tiny model of the seed the tests run with (built or not)."""
    return ROOT / ".cache" / "models" / cache_name(seed_from_env())


def built_tiny_model(any_versions: bool = False) -> Path:
    """The tiny model of the tests' seed, built on first use (one build at a time on a machine)."""
    return build_tiny_model(tiny_model_dir(), any_versions=any_versions)
