"""A real process for the tests: holds a stand-in device file, reacts to SIGTERM as told.

The one holder process of the test suite: tests/unit/conftest.py and tests/integration/conftest.py
both start it as ``python device_holder.py --ready FILE [options]``; pytest never collects it.
It writes FILE (JSON ``{"pid": ..., "children": [...]}``, written atomically) once everything it
was asked to do is in place, then sleeps until a signal ends it. Options:

  --ready PATH          the ready file (required)
  --hold PATH           keep PATH open (an fd, as a CUDA process keeps /dev/nvidia0 open)
  --mmap PATH           map PATH, then close the fd (only /proc/<pid>/maps shows it)
  --ignore-term         survive SIGTERM (only SIGKILL ends it)
  --term-marker PATH    append "SIGTERM" to PATH when SIGTERM arrives (then exit with status 0,
                        unless --ignore-term), so a test can tell whether it was signalled at all
  --children N          start N children of this script in this process group; never reap them
                        (a child that exits stays a zombie of this one)
  --child-hold PATH     the children hold PATH open (by default they hold nothing)
  --child-ignore-term   the children survive SIGTERM
  --child-term-marker PATH
                        the children append "SIGTERM" to PATH when SIGTERM arrives
  --child-tag WORD      the children get ``--tag WORD`` (by default their command lines have none)
  --spawn-on-term PATH  on SIGTERM, start a TERM-ignoring child in this group and write its pid
                        to PATH (a launcher that respawns a worker while being stopped)
  --listen              listen on a TCP port of 127.0.0.1 (chosen by the kernel; "port" in the ready
                        file) and never answer: a server that a client waits on
  --comm NAME           set the process name (/proc/<pid>/comm)
  --die-with-parent     get SIGKILL if the parent dies (a safety net if the test run is killed)
  --lifetime S          end after S seconds (SIGALRM), should the test that started it die
                        before killing it; 0: never (default 120; passed on to every child)
  --tag WORD            ignored: a word in the command line for match/protect patterns
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import signal
import socket
import subprocess
import sys
import time

PR_SET_PDEATHSIG = 1
CHILD_READY_DEADLINE_S = 60.0  # generous: a loaded CI machine can be slow to start Python
SCRIPT = os.path.abspath(__file__)


def write_atomic(path: str, text: str) -> None:
    """Write text to path through a temporary file and a rename, so readers never see half."""
    tmp = "%s.tmp.%d" % (path, os.getpid())
    with open(tmp, "w") as handle:
        handle.write(text)
    os.replace(tmp, path)


def append_line(path: str, line: str) -> None:
    """Append one line to path (a single O_APPEND write)."""
    with open(path, "a") as handle:
        handle.write(line + "\n")


def wait_ready(paths: list[str], deadline_s: float = CHILD_READY_DEADLINE_S) -> None:
    """Wait (polling) until every child has written its ready file; exit with an error at the deadline."""
    deadline = time.monotonic() + deadline_s
    while not all(os.path.exists(p) for p in paths):
        if time.monotonic() > deadline:
            sys.exit("device_holder: children not ready after %s s" % deadline_s)
        time.sleep(0.005)


def map_file(path: str) -> None:
    """Map path shared and read-only, then close its fd: only /proc/<pid>/maps shows it."""
    # libc's mmap, not Python's: mmap.mmap keeps a dup() of the fd open until 3.13.
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    with open(path, "rb") as handle:
        size = os.fstat(handle.fileno()).st_size
        address = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, handle.fileno(), 0)
    if address in (None, ctypes.c_void_p(-1).value):
        sys.exit("device_holder: mmap of %s failed: errno %d" % (path, ctypes.get_errno()))


def parse_args() -> argparse.Namespace:
    """The command line (see the module docstring)."""
    parser = argparse.ArgumentParser(description="Hold a stand-in device file until signalled.")
    parser.add_argument("--ready", required=True)
    parser.add_argument("--hold")
    parser.add_argument("--mmap")
    parser.add_argument("--ignore-term", action="store_true")
    parser.add_argument("--term-marker")
    parser.add_argument("--children", type=int, default=0)
    parser.add_argument("--child-hold")
    parser.add_argument("--child-ignore-term", action="store_true")
    parser.add_argument("--child-term-marker")
    parser.add_argument("--child-tag")
    parser.add_argument("--spawn-on-term")
    parser.add_argument("--listen", action="store_true")
    parser.add_argument("--comm")
    parser.add_argument("--die-with-parent", action="store_true")
    parser.add_argument("--lifetime", type=int, default=120)
    parser.add_argument("--tag")
    return parser.parse_args()


def main() -> None:
    """Hold what was asked, start the children, report ready, wait for signals."""
    args = parse_args()

    if args.lifetime > 0:
        signal.alarm(args.lifetime)  # default action of SIGALRM: terminate
    if args.die_with_parent:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if args.comm:
        with open("/proc/self/comm", "w") as handle:
            handle.write(args.comm)

    children = []  # kept referenced and never waited for

    def on_term(_signum, _frame):
        if args.spawn_on_term:
            command = [sys.executable, SCRIPT, "--ready", args.spawn_on_term + ".ready", "--ignore-term"]
            late = subprocess.Popen(command + ["--lifetime", str(args.lifetime)])
            children.append(late)
            write_atomic(args.spawn_on_term, str(late.pid))
        if args.term_marker:
            append_line(args.term_marker, "SIGTERM")
        if not args.ignore_term:
            os._exit(0)

    if args.ignore_term or args.term_marker or args.spawn_on_term:
        signal.signal(signal.SIGTERM, on_term)

    held = []
    port = None
    if args.listen:
        server = socket.socket()
        server.bind(("127.0.0.1", 0))
        server.listen(64)  # connections wait in the backlog; nothing is ever read or answered
        held.append(server)
        port = server.getsockname()[1]
    if args.hold:
        held.append(open(args.hold, "rb"))  # held until the process ends
    if args.mmap:
        map_file(args.mmap)

    child_ready = []
    for number in range(args.children):
        ready = "%s.child%d" % (args.ready, number)
        command = [sys.executable, SCRIPT, "--ready", ready, "--lifetime", str(args.lifetime)]
        if args.child_tag:
            command += ["--tag", args.child_tag]
        if args.child_hold:
            command += ["--hold", args.child_hold]
        if args.child_ignore_term:
            command += ["--ignore-term"]
        if args.child_term_marker:
            command += ["--term-marker", args.child_term_marker]
        children.append(subprocess.Popen(command))  # in this process group; never reaped
        child_ready.append(ready)
    wait_ready(child_ready)

    ready = {"pid": os.getpid(), "children": [c.pid for c in children]}
    if port is not None:
        ready["port"] = port
    write_atomic(args.ready, json.dumps(ready))
    while True:
        signal.pause()


if __name__ == "__main__":
    main()
