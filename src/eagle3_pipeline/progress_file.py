"""A job's progress, for the roles and for the operator: a JSON file kept current, and a terminal line.

The roles' waiting modules (``library/job_progress.py``) poll the file; a person at the
terminal reads the line. The file is rewritten atomically at most once a second (a reader never
sees half a file); the line is redrawn in place on a terminal (twice a second) and printed on a
line of its own every 30 s into a log. A job's own class says what the document holds
(``document()``) and how the line reads (``line()``).
"""

from __future__ import annotations

import json
import sys
import time
from abc import ABC, abstractmethod
from pathlib import Path


class ProgressReporter(ABC):
    """The throttled progress file and line of one job; subclasses give ``document()`` and ``line()``."""

    def __init__(self, path: Path, quiet: bool = False, label: str = "job"):
        self.path = Path(path)
        self.quiet = quiet
        self.label = label  # the log prefix, e.g. "extract"
        self._written = 0.0
        self._write_failed = False
        self._printed = 0.0
        self._tty = sys.stderr.isatty()

    @abstractmethod
    def document(self) -> dict:
        """The progress file's content."""

    @abstractmethod
    def line(self) -> str:
        """The one-line progress for the terminal."""

    def update(self, force: bool = False) -> None:
        """Rewrite the file (at most once a second unless ``force``) and redraw or print the line."""
        from eagle3_pipeline.atomic import atomic_write_text  # noqa: PLC0415

        now = time.monotonic()
        if force or now - self._written >= 1.0:
            self._written = now
            try:
                atomic_write_text(self.path, json.dumps(self.document(), sort_keys=True) + "\n")
            except OSError as exc:  # a full disk must end the run with its message, not a traceback here
                if not self._write_failed and not self.quiet:
                    print(f"[{self.label}] cannot write {self.path}: {exc}", file=sys.stderr, flush=True)
                self._write_failed = True
        if self.quiet:
            return
        if force or (self._tty and now - self._printed >= 0.5) or now - self._printed >= 30:
            self._printed = now
            print(("\r" if self._tty else "") + self.line(), end="" if self._tty and not force else "\n",
                  file=sys.stderr, flush=True)
