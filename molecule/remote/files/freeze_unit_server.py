"""Freeze a systemd unit's server while it loads: SIGSTOP its main process as soon as systemd has started it.

molecule/remote's verify runs this on a host (its system Python, as root) before a playbook starts the
unit, so that the role's wait certainly watches a server that is still loading when the test kills it
(the reference engine on the tiny model would otherwise be ready within seconds, before the kill).
Once the main process runs the server's Python, it is stopped and this prints
{"unit": ..., "pid": ..., "cgroup": ..., "seconds": ...}: the pid to kill, and the control group that
shows it runs under the unit. It fails when no such process appears within --timeout-s, or when the
server already listens on its port (it was ready: the test would prove nothing).

    python3 freeze_unit_server.py UNIT PORT [--timeout-s 300]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time


def main_pid(unit: str) -> int:
    """The unit's main process as systemd sees it (0: none)."""
    shown = subprocess.run(["systemctl", "show", "--property=MainPID", "--value", "--", unit],
                           capture_output=True, text=True, check=False)
    return int(shown.stdout.strip() or 0)


def runs_python(pid: int) -> bool:
    """Whether the process has executed the server's Python (systemd's child before its exec has not)."""
    try:
        return os.path.basename(os.readlink(f"/proc/{pid}/exe")).startswith("python")
    except OSError:
        return False


def listening(port: int) -> bool:
    """Whether a socket of this host listens on the TCP port."""
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as handle:
                rows = handle.read().splitlines()[1:]
        except OSError:
            continue
        if any(r.split()[3] == "0A" and int(r.split()[1].rsplit(":", 1)[1], 16) == port for r in rows):
            return True
    return False


def main() -> int:
    """Wait for the unit's server, stop it, print what was stopped."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("unit")
    parser.add_argument("port", type=int)
    parser.add_argument("--timeout-s", type=float, default=300)
    args = parser.parse_args()
    started = time.monotonic()
    while time.monotonic() - started < args.timeout_s:
        pid = main_pid(args.unit)
        if pid and runs_python(pid):
            os.kill(pid, signal.SIGSTOP)
            if listening(args.port):
                print(f"error: the server {pid} of {args.unit} already listens on {args.port}", file=sys.stderr)
                return 1
            with open(f"/proc/{pid}/cgroup") as handle:
                cgroup = handle.read().strip().rsplit(":", 1)[-1]
            print(json.dumps({"unit": args.unit, "pid": pid, "cgroup": cgroup,
                              "seconds": round(time.monotonic() - started, 2)}))
            return 0
        time.sleep(0.02)
    print(f"error: {args.unit} started no server within {args.timeout_s:g} s", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
