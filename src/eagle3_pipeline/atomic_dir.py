"""Directories that appear whole or not at all: build in a temporary sibling, then rename into place.

``atomic.py`` does this for single files; a model checkpoint is a directory of several files,
so it is built in ``.<name>.staging-<pid>-*`` beside its target and renamed to the target
only once complete. A crash (even ``kill -9``) leaves the previous directory (or none) and a
staging directory that the next run removes: the process named in it is gone.

Replacing an existing directory takes two renames (old aside, new in). The old one waits in
``.<name>.replaced-<pid>-*/previous`` until the new one is in place; should the process die
between the two renames, the next run puts it back.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

STAGING = "staging"
REPLACED = "replaced"
PREVIOUS = "previous"  # the old directory's name inside its .replaced-* holder


def _process_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    return True


def _sibling_pid(path: Path, kind: str) -> int | None:
    """The PID in ``.<name>.<kind>-<pid>-<random>``, or None when the name has no number there."""
    pid = path.name.rsplit(f".{kind}-", 1)[1].split("-", 1)[0]
    return int(pid) if pid.isdigit() else None


def abandoned(output_dir: Path) -> list[tuple[str, Path]]:
    """(kind, path) of the staging and set-aside directories beside ``output_dir`` whose processes are gone.

    Set-aside (replaced) directories come first: one may hold the only copy of ``output_dir``.
    Entries of live processes are not listed: a run in progress.
    """
    output_dir = Path(output_dir)
    found = []
    for kind in (REPLACED, STAGING):
        for path in sorted(output_dir.parent.glob(f".{output_dir.name}.{kind}-*")):
            pid = _sibling_pid(path, kind)
            if pid is not None and not _process_exists(pid):
                found.append((kind, path))
    return found


def remove_abandoned(output_dir: Path, log: Callable[[str], None]) -> list[Path]:
    """Clear what runs that died left beside ``output_dir``; return the paths handled.

    Staging directories of dead processes are deleted. A directory set aside for replacement
    by a dead process is put back when ``output_dir`` is missing (the process died between its
    two renames), else deleted.
    """
    output_dir = Path(output_dir)
    handled = []
    for kind, path in abandoned(output_dir):
        pid = _sibling_pid(path, kind)
        if kind == REPLACED and (path / PREVIOUS).is_dir() and not output_dir.exists():
            os.replace(path / PREVIOUS, output_dir)
            log(f"restored {output_dir} from {path}, set aside by process {pid}, which died before replacing it")
        else:
            log(f"removing {path}, left by process {pid}, which did not finish")
        shutil.rmtree(path, ignore_errors=True)
        handled.append(path)
    return handled


@contextlib.contextmanager
def directory_lock(output_dir: Path, log: Callable[[str], None]) -> Iterator[None]:
    """Hold the lock of ``output_dir`` (``.<name>.lock`` beside it): one writer of a directory at a time.

    A second writer waits, saying so, and then finds the directory as the first one left it.
    The lock is released when the holder exits or dies.
    """
    import fcntl  # noqa: PLC0415 - POSIX only, like the pipeline's hosts

    output_dir = Path(output_dir)
    output_dir.parent.mkdir(parents=True, exist_ok=True)
    path = output_dir.parent / f".{output_dir.name}.lock"
    fd = os.open(path, os.O_RDONLY | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log(f"waiting for another process writing {output_dir} to finish (lock {path})")
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _readable_like_a_new_directory(root: Path) -> None:
    # mkdtemp makes the directory private (0700): a server running as another user must be able
    # to read it, as any directory the user creates.
    umask = os.umask(0)
    os.umask(umask)
    for directory, _dirs, files in os.walk(root):
        os.chmod(directory, 0o777 & ~umask)
        for name in files:
            os.chmod(os.path.join(directory, name), 0o666 & ~umask)


@contextlib.contextmanager
def staged_directory(output_dir: Path) -> Iterator[Path]:
    """Yield an empty staging directory beside ``output_dir``; when the block ends normally, it becomes
    ``output_dir`` (replacing what was there). On an exception it is deleted and ``output_dir`` is untouched.

    Hold ``directory_lock(output_dir)`` around it when other processes may write the same directory.
    """
    output_dir = Path(output_dir).absolute()
    output_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{output_dir.name}.{STAGING}-{os.getpid()}-", dir=output_dir.parent))
    try:
        yield tmp
        _readable_like_a_new_directory(tmp)
        if output_dir.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{output_dir.name}.{REPLACED}-{os.getpid()}-", dir=output_dir.parent))
            os.replace(output_dir, old / PREVIOUS)
            os.replace(tmp, output_dir)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, output_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
