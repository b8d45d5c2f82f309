"""A small process supervisor for servers on hosts without systemd.

``supervise start`` starts a supervisor process in a session of its own; it starts the
server as its child (same process group), records both in ``<state_dir>/<name>.json``, sends
the server's output to the log file, waits for it, and records the exit code. ``stop`` sends
SIGTERM to that whole process group (server, its children and the supervisor), polls, then
SIGKILL: a server's children cannot outlive it. Environment variables for the server (an API
key, say) come from an env file, never from the command line, which ``ps`` shows to everyone.

Starting again with the same configuration while the server runs changes nothing; a
different configuration stops the old server first. Every verb prints one JSON object.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import sys
import time
from pathlib import Path

from eagle3_pipeline.atomic import atomic_write_text
from eagle3_pipeline.cli_args import path_arg, path_str

POLL_S = 0.05


def _proc_start_time(pid: int) -> int | None:
    """Start time (clock ticks since boot) from /proc, or None when the PID does not run."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            fields = handle.read().rsplit(b")", 1)[1].split()
    except OSError:
        return None
    if fields[0] in (b"Z", b"X"):
        return None
    return int(fields[19])


def read_env_file(path: Path | None) -> dict[str, str]:
    """KEY=VALUE lines (blank lines and # comments skipped); the file must not be world-readable."""
    if path is None:
        return {}
    if path.stat().st_mode & 0o077:
        raise SystemExit(f"error: env file {path} is readable by others; chmod 600 it (it may hold secrets)")
    env = {}
    for number, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.partition("=")
        if not sep or not key.strip():
            raise SystemExit(f"error: {path}:{number}: expected KEY=VALUE")
        env[key.strip()] = value
    return env


def config_hash(argv: list[str], env: dict[str, str], cwd: str | None) -> str:
    """What identifies a configuration: the argv, the environment it adds, the working dir."""
    blob = json.dumps({"argv": argv, "env": sorted(env.items()), "cwd": cwd}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


class Service:
    """One supervised server: its state file, log file and process group."""

    def __init__(self, state_dir: Path, name: str):
        self.state_dir = state_dir
        self.name = name
        self.state_file = state_dir / f"{name}.json"

    def read(self) -> dict:
        """The recorded state, or {} when never started."""
        try:
            return json.loads(self.state_file.read_text())
        except (OSError, json.JSONDecodeError):
            return {}

    def write(self, state: dict) -> None:
        """Record the state atomically."""
        atomic_write_text(self.state_file, json.dumps(state, sort_keys=True) + "\n")

    def status(self) -> dict:
        """State plus ``running``: the server process recorded is alive (same PID and start time)."""
        state = self.read()
        pid, start = state.get("pid"), state.get("pid_start_time")
        state["running"] = bool(pid) and _proc_start_time(pid) == start
        return state

    def start(self, argv: list[str], log_file: Path, env: dict[str, str], cwd: str | None,
              dry_run: bool = False) -> dict:
        """Start unless the same configuration already runs; return the status and ``changed``.

        ``dry_run`` only says whether a start (or restart) would happen.
        """
        wanted = config_hash(argv, env, cwd)
        current = self.status()
        if current["running"] and current.get("config_hash") == wanted:
            return {**current, "changed": False}
        if dry_run:
            return {**current, "changed": True, "would": "restart" if current["running"] else "start"}
        stopped = self.stop(grace_s=30.0) if current["running"] else None
        self.state_dir.mkdir(parents=True, exist_ok=True)
        log_file.parent.mkdir(parents=True, exist_ok=True)
        read_fd, write_fd = os.pipe()
        first = os.fork()
        if first == 0:  # intermediate: new session, then the supervisor
            os.close(read_fd)
            os.setsid()
            if os.fork() != 0:
                os._exit(0)
            self._supervise(argv, log_file, env, cwd, wanted, write_fd)
            os._exit(0)
        os.close(write_fd)
        os.waitpid(first, 0)
        with os.fdopen(read_fd) as pipe:
            report = pipe.read()
        if not report:
            raise SystemExit(f"error: {self.name}: the supervisor died before starting {argv[0]}")
        result = json.loads(report)
        if "error" in result:
            raise SystemExit(f"error: {self.name}: {result['error']}")
        status = self.status()
        return {**status, "changed": True, "replaced": stopped}

    def _supervise(self, argv, log_file, env, cwd, wanted, report_fd) -> None:
        """Run in the supervisor process: start the server, record it, wait, record the exit."""
        # A SIGTERM to the group reaches the server too; the supervisor stays to record its exit.
        signal.signal(signal.SIGTERM, lambda *_: None)
        log = os.open(log_file, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o640)
        null = os.open(os.devnull, os.O_RDONLY)
        for fd in (0, 1, 2):
            os.dup2(null if fd == 0 else log, fd)
        child_env = {**os.environ, **env}
        # Before the fork: a job's first progress report, however soon, is never older than its start.
        started_at = time.time()
        # SIGTERM is held until the child has its default action back: one arriving between the fork and
        # then would run the supervisor's handler in the child, and be lost.
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
        try:
            pid = os.fork()
        except OSError as exc:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
            os.write(report_fd, json.dumps({"error": f"fork failed: {exc}"}).encode())
            return
        if pid == 0:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
            try:
                if cwd:
                    os.chdir(cwd)
                os.execvpe(argv[0], argv, child_env)
            except OSError as exc:
                print(f"supervisor: cannot execute {argv[0]}: {exc}", file=sys.stderr, flush=True)
            os._exit(127)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
        state = {
            "name": self.name,
            "argv": argv,
            "cwd": cwd,
            "env_keys": sorted(env),
            "config_hash": wanted,
            "log_file": str(log_file),
            "supervisor_pid": os.getpid(),
            "pgid": os.getpgrp(),
            "pid": pid,
            "pid_start_time": _proc_start_time(pid),
            "started_at": started_at,
            "exit_code": None,
        }
        self.write(state)
        os.write(report_fd, json.dumps({"pid": pid}).encode())
        os.close(report_fd)
        _, status = os.waitpid(pid, 0)
        state["exit_code"] = os.waitstatus_to_exitcode(status)
        state["ended_at"] = time.time()
        print(f"supervisor: {argv[0]} exited with {state['exit_code']}", file=sys.stderr, flush=True)
        self.write(state)

    def stop(self, grace_s: float) -> dict:
        """SIGTERM the whole process group, SIGKILL after the grace; return what happened."""
        state = self.status()
        if not state.get("pgid") or not (state["running"] or _proc_start_time(state.get("supervisor_pid", 0))):
            return {**state, "changed": False}
        pgid = state["pgid"]
        start = time.monotonic()
        signal_used = "SIGTERM"
        _killpg(pgid, signal.SIGTERM)
        while _group_alive(pgid) and time.monotonic() - start < grace_s:
            time.sleep(POLL_S)
        if _group_alive(pgid):
            signal_used = "SIGKILL"
            _killpg(pgid, signal.SIGKILL)
            while _group_alive(pgid) and time.monotonic() - start < grace_s + 10:
                time.sleep(POLL_S)
        if _group_alive(pgid):
            raise SystemExit(f"error: {self.name}: process group {pgid} survived SIGKILL for 10 s")
        state = self.status()
        return {**state, "changed": True, "signal": signal_used, "seconds": round(time.monotonic() - start, 3)}


def _killpg(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


def _group_alive(pgid: int) -> bool:
    """True while any non-zombie process is in the group."""
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as handle:
                fields = handle.read().rsplit(b")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] not in (b"Z", b"X"):
            return True
    return False


def configure_parser(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``eagle3-pipeline supervise``."""
    parser.add_argument("--name", required=True, help="the service's name (state file <state-dir>/<name>.json)")
    parser.add_argument("--state-dir", type=path_arg, required=True)
    parser.add_argument("--log-file", type=path_arg, help="where the server's output goes (start)")
    parser.add_argument("--env-file", type=path_arg, help="KEY=VALUE lines added to the server's environment (start)")
    parser.add_argument("--cwd", type=path_str, help="working directory of the server (start)")
    parser.add_argument("--grace-s", type=float, default=30.0, help="SIGTERM to SIGKILL (stop)")
    parser.add_argument("--dry-run", action="store_true", help="(start) only report whether it would (re)start")
    # Options first, then the verb, then (start) -- and the server's command:
    #   supervise --name N --state-dir D --log-file L start -- python -m server ...
    parser.add_argument("action", choices=["start", "stop", "status"])
    parser.add_argument("argv", nargs=argparse.REMAINDER, help="(start) -- then the server's command")


def run(args: argparse.Namespace) -> int:
    """Carry out the verb and print its JSON result."""
    service = Service(args.state_dir, args.name)
    if args.action == "start":
        argv = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
        if not argv:
            raise SystemExit("error: supervise start needs the server's command after --")
        log_file = args.log_file or args.state_dir / f"{args.name}.log"
        result = service.start(argv, log_file, read_env_file(args.env_file), args.cwd, dry_run=args.dry_run)
    elif args.action == "stop":
        result = service.stop(args.grace_s)
    else:
        result = service.status()
    print(json.dumps(result, sort_keys=True))
    return 0
