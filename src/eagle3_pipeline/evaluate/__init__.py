"""Evaluation: the trained drafter measured by real speculative decoding on held-out prompts."""
