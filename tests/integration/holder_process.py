"""A stand-in GPU process for the integration tests: it holds a device file open until signalled.

Started by tests/integration/conftest.py, never collected by pytest. On SIGTERM it appends a
line to its ``--term-marker`` file (so a test can tell whether it was signalled at all), then
exits with status 0, or, with ``--ignore-term``, carries on until SIGKILL. With ``--child`` it
first starts a child in its own process group that holds no device file and ignores SIGTERM,
as a launcher's worker does. It writes ``--ready`` (JSON: its PID and the child's) atomically
once it holds the file, and ends itself after ``--lifetime`` seconds (SIGALRM) should the test
that started it die before killing it.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path


def write_atomically(path: Path, text: str) -> None:
    """Write a file so a reader never sees it half written."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def wait_for_file(path: Path, deadline_s: float) -> None:
    """Poll until path exists, or exit with an error at the deadline."""
    deadline = time.monotonic() + deadline_s
    while not path.exists():
        if time.monotonic() > deadline:
            sys.exit(f"holder_process: {path} did not appear within {deadline_s} s")
        time.sleep(0.01)


def main() -> None:
    """Hold the device, report ready, wait for signals."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--tag", required=True, help="a word in the command line for gpu_reset_match")
    parser.add_argument("--device", type=Path, help="the file to hold open (none for a child)")
    parser.add_argument("--ready", type=Path, required=True)
    parser.add_argument("--term-marker", type=Path, required=True)
    parser.add_argument("--ignore-term", action="store_true")
    parser.add_argument("--child", action="store_true")
    parser.add_argument("--lifetime", type=int, default=120)
    args = parser.parse_args()

    signal.alarm(args.lifetime)  # default action of SIGALRM: terminate

    def on_term(_signum, _frame):
        with args.term_marker.open("a") as marker:
            marker.write(f"SIGTERM {os.getpid()}\n")
        if not args.ignore_term:
            os._exit(0)

    signal.signal(signal.SIGTERM, on_term)
    _held = args.device.open("rb") if args.device else None  # open until the process ends

    child_pid = None
    if args.child:
        child_ready = args.ready.with_name(args.ready.name + ".child")
        child = subprocess.Popen(
            [
                sys.executable,
                __file__,
                "--tag",
                f"{args.tag}-child",
                "--ready",
                str(child_ready),
                "--term-marker",
                str(args.term_marker.with_name(args.term_marker.name + ".child")),
                "--ignore-term",
                "--lifetime",
                str(args.lifetime),
            ]
        )
        wait_for_file(child_ready, 10)
        child_pid = child.pid

    write_atomically(args.ready, json.dumps({"pid": os.getpid(), "child_pid": child_pid}))
    while True:
        signal.pause()


if __name__ == "__main__":
    main()
