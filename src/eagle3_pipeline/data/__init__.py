"""Datasets: the demo conversations (and, later, extraction's reader and writer)."""
