"""The reference engine: this project's SGLang-compatible HTTP server on transformers."""
