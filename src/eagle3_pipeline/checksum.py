"""SHA-256 of files (standard library only, so that light commands need not import torch)."""

from __future__ import annotations

import hashlib
from pathlib import Path


def file_sha256(path: str | Path) -> str:
    """SHA-256 of a file, read in 8 MiB blocks (hashlib releases the GIL)."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(8 << 20):
            digest.update(block)
    return digest.hexdigest()
