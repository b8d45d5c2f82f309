"""Small checks on real processes shared by the unit tests: polling with a deadline, liveness."""

from __future__ import annotations

import time

import pytest
from ansible.module_utils.gpu_holders import read_proc


def wait_for(predicate, timeout_s, what):
    """Poll predicate until it is true; fail the test naming ``what`` after timeout_s."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail("timed out after %s s waiting for %s" % (timeout_s, what))
        time.sleep(0.005)


def running(key):
    """Whether the process (pid, start time) still runs: not gone, not a zombie, not reused."""
    pid, starttime = key
    info = read_proc(pid)
    return info is not None and info.starttime == starttime and info.state not in ("Z", "X", "x")


def state(pid):
    """The process state letter now, or None when the PID is gone."""
    info = read_proc(pid)
    return None if info is None else info.state
