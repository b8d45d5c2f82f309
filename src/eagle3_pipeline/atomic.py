"""Files that appear whole or not at all: write a temp file beside the target, then rename.

A crash or a full disk leaves the old file (or none) and at most a ``.<name>.*.tmp`` beside
it, never a truncated file under the real name that a resume would take for done.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path


def atomic_write(target: str | os.PathLike, write: Callable[[str], None], mode: int | None = None) -> Path:
    """Call ``write(tmp_path)`` to fill a temp file in the target's folder, then rename it into place.

    ``mode`` (e.g. 0o600) is set on the temp file before the rename, so the file is never
    visible with looser permissions.
    """
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    os.close(fd)
    try:
        if mode is not None:
            os.chmod(tmp, mode)
        write(tmp)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return target


def atomic_write_text(target: str | os.PathLike, text: str, mode: int | None = None) -> Path:
    """Write a text file atomically."""
    return atomic_write(target, lambda tmp: Path(tmp).write_text(text, encoding="utf-8"), mode)
