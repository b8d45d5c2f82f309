"""Fixtures for the unit tests: real holder processes and a stand-in device file.

Every process a test starts (and every child those processes report) is recorded by
(pid, start time); the ``spawn`` fixture's finalizer SIGKILLs whichever of them still runs,
checking the start time first so that a PID reused by some other process is never signalled.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from ansible.module_utils.gpu_holders import read_proc
from process_checks import running

HOLDER_SCRIPT = Path(__file__).resolve().parents[1] / "device_holder.py"
READY_TIMEOUT_S = 15.0


@dataclass
class Child:
    """A holder process started by a test."""

    popen: subprocess.Popen
    key: tuple  # (pid, start time)
    children: list = field(default_factory=list)  # [(pid, start time)] of its own children
    ready: dict = field(default_factory=dict)  # what it wrote to its ready file (e.g. "port" with --listen)

    @property
    def pid(self):
        return self.key[0]

    @property
    def info(self):
        """Its ProcInfo now (None when gone)."""
        return read_proc(self.pid)

    @property
    def child_pids(self):
        return [key[0] for key in self.children]


class Spawner:
    """Starts tests/device_holder.py processes and cleans every one of them up."""

    def __init__(self, workdir):
        self.workdir = workdir
        self.started = []  # [Child]
        self.count = 0

    def __call__(self, *options, new_session=False):
        """Start a holder with device_holder.py options; return once it has written its ready file."""
        self.count += 1
        ready = self.workdir / ("ready-%d.json" % self.count)
        stderr_path = self.workdir / ("stderr-%d.txt" % self.count)
        command = [sys.executable, str(HOLDER_SCRIPT), "--ready", str(ready), "--die-with-parent"]
        command += [str(option) for option in options]
        with open(stderr_path, "wb") as stderr:
            popen = subprocess.Popen(
                command,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=stderr,
                start_new_session=new_session,
            )
        child = Child(popen=popen, key=(popen.pid, None))
        self.started.append(child)
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not ready.exists():
            if popen.poll() is not None:
                pytest.fail(
                    "holder child exited with %s before it was ready: %s" % (popen.returncode, stderr_path.read_text())
                )
            if time.monotonic() > deadline:
                pytest.fail("holder child %d not ready after %s s" % (popen.pid, READY_TIMEOUT_S))
            time.sleep(0.005)
        info = read_proc(popen.pid)
        child.key = (popen.pid, info.starttime)
        child.ready = json.loads(ready.read_text())
        for pid in child.ready["children"]:
            grandchild = read_proc(pid)
            assert grandchild is not None and grandchild.ppid == popen.pid, "child %d of %d vanished" % (pid, popen.pid)
            child.children.append(grandchild.key())
        return child

    def cleanup(self):
        """SIGKILL whatever this spawner started that still runs (same pid AND start time)."""
        for child in self.started:
            for key in child.children + [child.key]:
                if key[1] is not None and running(key):
                    try:
                        os.kill(key[0], signal.SIGKILL)
                    except ProcessLookupError:
                        pass
            if child.popen.poll() is None and child.key[1] is None:
                child.popen.kill()  # never got ready: the Popen object still knows it is ours
        for child in self.started:
            child.popen.wait(timeout=10)


@pytest.fixture
def spawn(tmp_path):
    """Factory: ``spawn("--hold", path, new_session=True)`` -> Child, ready; all killed at the end."""
    spawner = Spawner(tmp_path)
    yield spawner
    spawner.cleanup()


@pytest.fixture
def device_file(tmp_path):
    """A stand-in for /dev/nvidia0: an ordinary file (non-empty, so it can be mapped)."""
    path = tmp_path / "nvidia0"
    path.write_bytes(b"\0" * 4096)
    return str(path.resolve())
