"""A real process for the unit tests: holds a stand-in device file, reacts to SIGTERM as told.

Run by tests/unit/conftest.py as ``python holder_child.py --ready FILE [options]``. It writes
FILE (JSON: its pid and its children's pids, written atomically) once everything it was asked
to do is in place, then sleeps until a signal ends it. Options:

  --hold PATH          keep PATH open (an fd, as a CUDA process keeps /dev/nvidia0 open)
  --mmap PATH          map PATH, then close the fd (only /proc/<pid>/maps shows it)
  --ignore-term        survive SIGTERM (only SIGKILL ends it)
  --term-marker PATH   write PATH when SIGTERM arrives (then exit, unless --ignore-term)
  --children N         start N children of this script in this process group; never reap them
  --child-hold PATH    the children hold PATH
  --child-ignore-term  the children survive SIGTERM
  --spawn-on-term PATH on SIGTERM, start a TERM-ignoring child in this group and write its pid
                       to PATH (a launcher that respawns a worker while being stopped)
  --comm NAME          set the process name (/proc/<pid>/comm)
  --die-with-parent    get SIGKILL if the parent dies (a safety net if the test run is killed)
  --tag WORD           ignored: a word in the command line for match/protect patterns
"""

import argparse
import ctypes
import json
import mmap
import os
import signal
import subprocess
import sys
import time

PR_SET_PDEATHSIG = 1


def write_atomic(path, text):
    """Write text to path through a temporary file and a rename, so readers never see half."""
    tmp = "%s.tmp.%d" % (path, os.getpid())
    with open(tmp, "w") as handle:
        handle.write(text)
    os.rename(tmp, path)


def wait_ready(paths, deadline_s=10.0):
    """Wait (polling) until every child has written its ready file."""
    deadline = time.monotonic() + deadline_s
    while not all(os.path.exists(p) for p in paths):
        if time.monotonic() > deadline:
            sys.exit("children not ready after %s s" % deadline_s)
        time.sleep(0.005)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--ready", required=True)
    parser.add_argument("--hold")
    parser.add_argument("--mmap")
    parser.add_argument("--ignore-term", action="store_true")
    parser.add_argument("--term-marker")
    parser.add_argument("--children", type=int, default=0)
    parser.add_argument("--child-hold")
    parser.add_argument("--child-ignore-term", action="store_true")
    parser.add_argument("--spawn-on-term")
    parser.add_argument("--comm")
    parser.add_argument("--die-with-parent", action="store_true")
    parser.add_argument("--tag")
    args = parser.parse_args()

    if args.die_with_parent:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if args.comm:
        with open("/proc/self/comm", "w") as handle:
            handle.write(args.comm)

    children = []

    def on_term(_signum, _frame):
        if args.spawn_on_term:
            late = subprocess.Popen(
                [sys.executable, os.path.abspath(__file__), "--ready", args.spawn_on_term + ".ready", "--ignore-term"]
            )
            children.append(late)
            write_atomic(args.spawn_on_term, str(late.pid))
        if args.term_marker:
            write_atomic(args.term_marker, "SIGTERM\n")
        if not args.ignore_term:
            os._exit(0)

    if args.ignore_term or args.term_marker or args.spawn_on_term:
        signal.signal(signal.SIGTERM, on_term)

    held = []
    if args.hold:
        held.append(open(args.hold, "rb"))  # held until the process ends
    if args.mmap:
        # libc's mmap, not Python's: mmap.mmap keeps a dup() of the fd open until 3.13.
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
        with open(args.mmap, "rb") as handle:
            address = libc.mmap(
                None, os.fstat(handle.fileno()).st_size, mmap.PROT_READ, mmap.MAP_SHARED, handle.fileno(), 0
            )
        if address in (None, ctypes.c_void_p(-1).value):
            sys.exit("mmap of %s failed: errno %d" % (args.mmap, ctypes.get_errno()))

    child_ready = []
    for number in range(args.children):
        ready = "%s.child%d" % (args.ready, number)
        command = [sys.executable, os.path.abspath(__file__), "--ready", ready]
        if args.child_hold:
            command += ["--hold", args.child_hold]
        if args.child_ignore_term:
            command += ["--ignore-term"]
        # Kept referenced and never waited for: a child that exits stays a zombie of this one.
        children.append(subprocess.Popen(command))
        child_ready.append(ready)
    wait_ready(child_ready)

    write_atomic(args.ready, json.dumps({"pid": os.getpid(), "children": [c.pid for c in children]}))
    while True:
        signal.pause()


if __name__ == "__main__":
    main()
