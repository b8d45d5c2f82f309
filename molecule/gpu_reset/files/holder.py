"""Real processes for the Molecule scenario gpu_reset: holders of a stand-in GPU device file.

Run by the scenario's playbooks, never imported. Every process started here writes
``<name>.pid`` (JSON: pid and start time, so a reused PID is never mistaken for it), then
``<name>.ready`` once it holds the device, in ``--workdir``; on SIGTERM it writes
``<name>.term`` ("got TERM", or "ignored TERM" for the stubborn one). Each ends itself after
``--lifetime`` seconds (SIGALRM) should a failed run leave it behind.

  start CASE        start the processes of one case, then exit without waiting for them:
                      plain         a holder in its own session; SIGTERM ends it
                      stubborn      a holder in its own session that ignores SIGTERM
                      protected     a holder whose command line carries --tag
                      launcher      a parent in its own session that holds nothing and keeps two
                                    children holding the device, restarting one that exits, as a
                                    supervisor does: stopping the children alone brings new ones
                      runner-group  two holders left in the caller's process group (no new
                                    session); the caller's ancestry is written to runner.json
  hold NAME         be one holder (what start runs)
  supervise NAME    be the launcher parent (what start runs)
  ps                JSON {name: pid, state (running, zombie, gone), ppid, pgid, sid, cmdline}
                    for every .pid file in the work dir, read from /proc now
  holders-of PATH   JSON list of the PIDs that have PATH open or mapped, read from /proc
                    (independent of the module under test)
  stop-all          SIGKILL whatever still runs of the processes started here (whole process
                    group where one was started in its own session); JSON of what was killed
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

LAUNCHER_CHILDREN = 2
MAX_RESTARTS = 5


def write_atomically(path: Path, text: str) -> None:
    """Write a file so a reader never sees it half written."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def read_stat(pid: int) -> dict | None:
    """Fields of /proc/<pid>/stat that matter here, or None when the PID does not exist."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rfind(")") + 2 :].split()  # comm, in parentheses, may hold spaces
    return {
        "state": fields[0],
        "ppid": int(fields[1]),
        "pgid": int(fields[2]),
        "sid": int(fields[3]),
        "starttime": int(fields[19]),
    }


def read_cmdline(pid: int) -> str:
    """The command line of a PID, arguments joined by spaces ('' when unreadable)."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return ""
    return " ".join(part.decode("utf-8", "replace") for part in raw.split(b"\0") if part)


def describe(pid: int, starttime: int | None = None) -> dict:
    """A PID as /proc shows it now; 'gone' also when the PID now belongs to a later process."""
    stat = read_stat(pid)
    if stat is None or (starttime is not None and stat["starttime"] != starttime):
        return {"pid": pid, "state": "gone"}
    return {
        "pid": pid,
        "state": "zombie" if stat["state"] in ("Z", "X") else "running",
        "ppid": stat["ppid"],
        "pgid": stat["pgid"],
        "sid": stat["sid"],
        "cmdline": read_cmdline(pid),
    }


def recorded(workdir: Path) -> dict[str, dict]:
    """{name: contents of <name>.pid} for every process started in workdir."""
    records = {}
    for pid_file in sorted(workdir.glob("*.pid")):
        records[pid_file.stem] = json.loads(pid_file.read_text())
    return records


def common_args(args: argparse.Namespace, name: str) -> list[str]:
    """The options every started process gets: where to write, what to hold, how long to live."""
    return [
        name,
        "--workdir",
        str(args.workdir),
        "--device",
        str(args.device),
        "--lifetime",
        str(args.lifetime),
    ]


def spawn(command: list[str], workdir: Path, name: str, *, new_session: bool) -> subprocess.Popen:
    """Start a process detached from our stdio (its output goes to <name>.log)."""
    with (workdir / f"{name}.log").open("ab") as log:
        return subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=new_session,
        )


def ancestry() -> list[dict]:
    """This process and its parents up to PID 1, as /proc shows them."""
    chain = []
    pid = os.getpid()
    while pid > 0:
        entry = describe(pid)
        if entry["state"] == "gone":
            break
        chain.append(entry)
        pid = entry["ppid"]
    return chain


def cmd_start(args: argparse.Namespace) -> None:
    """Start the processes of one case."""
    me = [sys.executable, os.path.abspath(__file__)]
    workdir = args.workdir
    if args.case == "plain":
        spawn([*me, "hold", *common_args(args, "plain")], workdir, "plain", new_session=True)
    elif args.case == "stubborn":
        command = [*me, "hold", *common_args(args, "stubborn"), "--ignore-term"]
        spawn(command, workdir, "stubborn", new_session=True)
    elif args.case == "protected":
        if not args.tag:
            sys.exit("holder.py start protected needs --tag (the word gpu_reset_protect_extra matches)")
        command = [*me, "hold", *common_args(args, "protected"), "--tag", args.tag]
        spawn(command, workdir, "protected", new_session=True)
    elif args.case == "launcher":
        spawn([*me, "supervise", *common_args(args, "launcher")], workdir, "launcher", new_session=True)
    elif args.case == "runner-group":
        write_atomically(workdir / "runner.json", json.dumps({"chain": ancestry()}, indent=1) + "\n")
        for number in (1, 2):
            name = f"runner-group-{number}"
            spawn([*me, "hold", *common_args(args, name)], workdir, name, new_session=False)


def announce(workdir: Path, name: str) -> None:
    """Write <name>.pid (pid and start time), then <name>.ready."""
    record = {"pid": os.getpid(), "starttime": read_stat(os.getpid())["starttime"]}
    write_atomically(workdir / f"{name}.pid", json.dumps(record) + "\n")
    write_atomically(workdir / f"{name}.ready", "ready\n")


def cmd_hold(args: argparse.Namespace) -> None:
    """Hold the device open, announce, and wait for signals."""
    signal.alarm(args.lifetime)  # default action of SIGALRM: terminate
    term_marker = args.workdir / f"{args.name}.term"

    def on_term(_signum, _frame):
        if args.ignore_term:
            write_atomically(term_marker, "ignored TERM\n")
            return
        write_atomically(term_marker, "got TERM\n")
        os._exit(0)

    signal.signal(signal.SIGTERM, on_term)
    held = args.device.open("rb")  # open until the process ends, as a CUDA process holds /dev/nvidia0
    announce(args.workdir, args.name)
    while not held.closed:
        signal.pause()


def cmd_supervise(args: argparse.Namespace) -> None:
    """Keep LAUNCHER_CHILDREN holders running in this process group; hold nothing itself.

    SIGTERM keeps its default action here: the parent dies at once, as a launcher without a
    handler does.
    """
    signal.alarm(args.lifetime)
    me = [sys.executable, os.path.abspath(__file__)]
    children: dict[int, str] = {}

    def start_child(name: str) -> None:
        child = spawn([*me, "hold", *common_args(args, name)], args.workdir, name, new_session=False)
        children[child.pid] = name

    for slot in range(1, LAUNCHER_CHILDREN + 1):
        start_child(f"{args.name}-child-{slot}")
    announce(args.workdir, args.name)
    restarts = 0
    while True:
        pid, _status = os.wait()
        name = children.pop(pid, None)
        if name is None:
            continue
        if restarts >= MAX_RESTARTS:
            continue
        restarts += 1
        time.sleep(0.2)
        start_child(f"{name.split('-again-')[0]}-again-{restarts}")


def cmd_ps(args: argparse.Namespace) -> None:
    """Print what /proc shows now of every process started in the work dir."""
    report = {}
    for name, record in recorded(args.workdir).items():
        report[name] = describe(record["pid"], record["starttime"])
    print(json.dumps(report, indent=1, sort_keys=True))


def holders_of(path: Path) -> list[int]:
    """PIDs with path open (an fd) or mapped, as fuser finds them."""
    target = os.path.realpath(path)
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        found = False
        try:
            for fd in (entry / "fd").iterdir():
                try:
                    if os.readlink(fd) == target:
                        found = True
                        break
                except OSError:
                    continue
            if not found:
                with (entry / "maps").open("rb") as maps:
                    found = any(line.rstrip(b"\n").endswith(b" " + target.encode()) for line in maps)
        except OSError:
            continue
        if found:
            pids.append(int(entry.name))
    return sorted(pids)


def cmd_holders_of(args: argparse.Namespace) -> None:
    """Print the PIDs holding a file."""
    print(json.dumps(holders_of(args.path)))


def cmd_stop_all(args: argparse.Namespace) -> None:
    """SIGKILL what still runs of the processes started here, and wait until it is gone."""
    if not args.workdir.is_dir():
        print(json.dumps({"killed": []}))
        return
    killed = []
    for name, record in recorded(args.workdir).items():
        now = describe(record["pid"], record["starttime"])
        if now["state"] != "running" or str(args.workdir) not in now["cmdline"]:
            continue
        try:
            if now["pgid"] == now["pid"]:  # started in its own session: its children too
                os.killpg(now["pgid"], signal.SIGKILL)
            else:
                os.kill(now["pid"], signal.SIGKILL)
        except ProcessLookupError:
            continue
        killed.append({"name": name, "pid": now["pid"]})
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        states = [describe(r["pid"], r["starttime"])["state"] for r in recorded(args.workdir).values()]
        if "running" not in states:
            break
        time.sleep(0.05)
    else:
        sys.exit(f"holder.py stop-all: processes in {args.workdir} still run 10 s after SIGKILL")
    print(json.dumps({"killed": killed}))


def main() -> None:
    """Parse the subcommand and run it."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    def with_workdir(subparser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        subparser.add_argument("--workdir", type=Path, required=True)
        return subparser

    def with_process_options(subparser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        with_workdir(subparser)
        subparser.add_argument("--device", type=Path, required=True)
        subparser.add_argument("--lifetime", type=int, default=900, help="seconds before SIGALRM ends it")
        return subparser

    start = with_process_options(sub.add_parser("start"))
    start.add_argument("case", choices=["plain", "stubborn", "protected", "launcher", "runner-group"])
    start.add_argument("--tag", help="a word in the protected holder's command line")
    start.set_defaults(func=cmd_start)

    hold = with_process_options(sub.add_parser("hold"))
    hold.add_argument("name")
    hold.add_argument("--ignore-term", action="store_true")
    hold.add_argument("--tag")
    hold.set_defaults(func=cmd_hold)

    supervise = with_process_options(sub.add_parser("supervise"))
    supervise.add_argument("name")
    supervise.set_defaults(func=cmd_supervise)

    with_workdir(sub.add_parser("ps")).set_defaults(func=cmd_ps)

    holders = sub.add_parser("holders-of")
    holders.add_argument("path", type=Path)
    holders.set_defaults(func=cmd_holders_of)

    with_workdir(sub.add_parser("stop-all")).set_defaults(func=cmd_stop_all)

    args = parser.parse_args()
    args.func(args)


if __name__ == "__main__":
    main()
