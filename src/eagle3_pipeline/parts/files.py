"""What a part keeps on disk, shared by every stage that splits a dataset into parts.

An output directory ``D`` of such a stage holds::

    D/<settings file>                  the settings that shape the output (the first run writes it;
                                       later runs and other hosts must match it, or are refused)
    D/parts/part-K-of-N.journal.jsonl  one line per record done (or left out) by part K of N
    D/parts/part-K-of-N.lock           held by the run of part K (its PID inside)
    D/parts/part-K-of-N.progress.json  the running part's progress (for the roles and the CLI)

plus what the stage writes for a finished part and for the merge. A journal line is appended
once its record's output is in place; a torn last line (kill -9 mid-write) is cut off on the
next open, so a rerun continues where the killed one stopped.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import threading
from collections.abc import Callable, Iterable
from pathlib import Path

from eagle3_pipeline.atomic import atomic_write_text

PARTS_DIR = "parts"
# Recorded for the reader, but not compared between runs: they do not change the output.
INFORMATIONAL_SETTINGS = ("target_model_path", "engine_version", "chat_template_file")


class StoreError(ValueError):
    """The output directory cannot be used as asked; the message says why and what to do."""


def part_name(index: int, count: int) -> str:
    """``part-K-of-N``."""
    return f"part-{index}-of-{count}"


def part_path(out_dir: Path, index: int, count: int, suffix: str) -> Path:
    """``D/parts/part-K-of-N<suffix>``."""
    return Path(out_dir) / PARTS_DIR / f"{part_name(index, count)}{suffix}"


def parse_part(text: str) -> tuple[int, int]:
    """``"K/N"`` to (K, N), 0 <= K < N."""
    try:
        index, count = (int(x) for x in text.split("/"))
    except ValueError:
        raise ValueError(f"part {text!r}: expected K/N, e.g. 0/2 for the first of two hosts") from None
    if not 0 <= index < count:
        raise ValueError(f"part {text!r}: need 0 <= K < N")
    return index, count


def refuse_other_split(out_dir: Path, index: int, count: int, what: str) -> None:
    """Refuse part K/N on a directory that holds parts of a split over another number of hosts."""
    splits = {p.name.split(".")[0].split("-of-")[1] for p in (Path(out_dir) / PARTS_DIR).glob("part-*-of-*.j*")}
    other = sorted(splits - {str(count)})
    if other:
        raise StoreError(
            f"{out_dir} holds parts of a split over {' and '.join(other)} host(s), this run is part "
            f"{index}/{count}: a dataset is {what} by one set of hosts; run with that many hosts, or use another "
            "output directory"
        )


def lock_part(out_dir: Path, part: tuple[int, int], what: str):
    """Hold ``parts/part-K-of-N.lock`` of ``out_dir``: a second run of the same part would do the
    same records again and remove the first one's temp files. Raises ``StoreError`` naming the
    holder; ``what`` names the job in that message. The lock lives as long as the returned file."""
    import fcntl  # noqa: PLC0415

    path = part_path(out_dir, *part, ".lock")
    path.parent.mkdir(parents=True, exist_ok=True)
    handle = open(path, "a+")  # noqa: SIM115 - kept open: the lock lives as long as the file object
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        holder = handle.read().strip() or "unknown"
        handle.close()
        raise StoreError(
            f"another {what} of part {part[0]}/{part[1]} runs on {out_dir} (pid {holder}); "
            "wait for it (eagle3-pipeline progress DIR) or stop it first"
        ) from None
    handle.seek(0)
    handle.truncate()
    handle.write(f"{os.getpid()}\n")
    handle.flush()
    return handle


# -- the settings claim -------------------------------------------------------------------
def settings_text(settings: dict) -> str:
    """A settings file's text for ``settings``."""
    return json.dumps(settings, indent=2, sort_keys=True) + "\n"


def claim_settings(out_dir: Path, settings: dict, create: bool = True, *, file_name: str, what: str = "output",
                   hint: Callable[[list[str]], str] | None = None) -> bool:
    """Record ``settings`` in ``D/<file_name>``, or check that they match the recorded ones.

    Returns True when this call created the file. Refuses (``StoreError`` naming every field
    that differs) to mix output made with other settings in one directory. ``create=False``
    only compares (when the file exists). ``what`` says what the directory holds, in that
    message; ``hint(differing keys)`` may add how to fix it.
    """
    path = out_dir / file_name
    text = settings_text(settings)
    if not create and not path.exists():
        return False
    out_dir.mkdir(parents=True, exist_ok=True)
    # Written whole beside it, then linked into place: link fails if another host (or run) got
    # there first, and no reader ever sees a half-written file.
    fd, tmp = tempfile.mkstemp(dir=out_dir, prefix=f".{file_name}.", suffix=".tmp")
    with os.fdopen(fd, "w") as handle:
        handle.write(text)
    os.chmod(tmp, 0o644)
    try:
        os.link(tmp, path)
    except FileExistsError:
        recorded = json.loads(path.read_text())
        differ = sorted(key for key in set(recorded) | set(settings)
                        if key not in INFORMATIONAL_SETTINGS and recorded.get(key) != settings.get(key))
        if differ:
            lines = "; ".join(f"{key}: recorded {recorded.get(key)!r}, now {settings.get(key)!r}" for key in differ)
            raise StoreError(
                f"{out_dir} holds {what} with other settings ({lines}){hint(differ) if hint else ''}; use another "
                "output directory, or delete that one to start over"
            ) from None
        return False
    finally:
        os.unlink(tmp)
    return True


def write_if_changed(path: Path, text: str) -> bool:
    """Write ``text`` atomically unless the file already holds it; True when written."""
    try:
        if path.read_text() == text:
            return False
    except OSError:
        pass
    atomic_write_text(path, text)
    return True


# -- the journal --------------------------------------------------------------------------
class Journal:
    """Append-only JSON lines; the last record of a key wins."""

    def __init__(self, path: Path):
        self.path = path
        self._lock = threading.Lock()
        self._handle = None

    def load(self, repair: bool = True) -> dict[str, dict]:
        """Records by key, after cutting off a torn last line (kill -9 during an append).

        ``repair=False`` only reads (a reader beside a live run must not cut its append).
        """
        records: dict[str, dict] = {}
        if not self.path.exists():
            return records
        raw = self.path.read_bytes()
        end = raw.rfind(b"\n") + 1
        if end != len(raw) and repair:
            with open(self.path, "r+b") as handle:
                handle.truncate(end)
        for line in raw[:end].splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue  # a line torn and then followed by others (should not happen; never trusted)
            records[record["key"]] = record
        return records

    @staticmethod
    def _line(record: dict) -> str:
        return json.dumps(record, sort_keys=True, separators=(",", ":")) + "\n"

    def rewrite(self, records: Iterable[dict]) -> bool:
        """Replace the journal, atomically, by ``records`` (one line each); True when it changed.

        Only while nothing appends to it (``convert-storage`` holds the part's lock).
        """
        self.close()
        return write_if_changed(self.path, "".join(self._line(record) for record in records))

    def append(self, record: dict) -> None:
        line = self._line(record)
        with self._lock:
            if self._handle is None:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self._handle = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - kept open
            try:
                self._handle.write(line)
                self._handle.flush()
            except OSError:
                # A full disk: drop the buffered rest of the line (closing would retry it); at
                # worst a torn line stays, which load() never trusts.
                handle, self._handle = self._handle, None
                with contextlib.suppress(OSError):
                    handle.close()
                raise

    def close(self) -> None:
        with self._lock:
            if self._handle is not None:
                self._handle.close()
                self._handle = None
