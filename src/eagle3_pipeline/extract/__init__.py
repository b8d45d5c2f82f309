"""Extraction: conversations in, verified per-token hidden states of the target out."""
