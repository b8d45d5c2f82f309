"""Fixtures for the integration tests: real holder processes and real runs of playbooks/gpu_reset.yml.

The playbook runs through ansible-runner, as Python programs drive this project, against
localhost (inventory/local.yml, where ``gpu_reset_required`` is false: there is no GPU here).
A GPU holder is stood in for by a process that holds an ordinary file open; the file is given
to the role as ``gpu_reset_device_paths``. Every process a test starts is killed when the test
ends, and nothing else is ever signalled.
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
from runner_runs import run_project_playbook

ROOT = Path(__file__).resolve().parents[2]
PLAYBOOK = ROOT / "playbooks" / "gpu_reset.yml"
INVENTORY = ROOT / "inventory" / "local.yml"
HOLDER_SCRIPT = ROOT / "tests" / "device_holder.py"
READY_DEADLINE_S = 60.0  # generous: a loaded CI machine can be slow to start Python
HOST = "localhost"
# A holder's own safety net (SIGALRM) should the test run die before its teardown kills it: longer
# than any playbook run takes on a loaded machine (device_holder's default, 120 s, is not).
HOLDER_LIFETIME_S = 900


def proc_stat(pid: int) -> tuple[str, int, int] | None:
    """(state, start time, process group) of a PID from /proc, or None when there is none."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rfind(")") + 2 :].split()
    return fields[0], int(fields[19]), int(fields[2])


def is_alive(pid: int, starttime: int) -> bool:
    """Whether the process started at ``starttime`` under ``pid`` still runs (a zombie does not)."""
    now = proc_stat(pid)
    return now is not None and now[1] == starttime and now[0] not in ("Z", "X", "x")


@dataclass
class Holder:
    """A tests/device_holder.py started by a test: what it is, and what happened to it."""

    popen: subprocess.Popen
    tag: str
    ready: Path
    term_marker: Path
    starttime: int = 0
    child_pid: int | None = None
    child_starttime: int = 0

    @property
    def pid(self) -> int:
        """The holder's PID (also its process group and session: it is started in a new session)."""
        return self.popen.pid

    @property
    def child_term_marker(self) -> Path:
        """The file the child appends to on SIGTERM (its --term-marker)."""
        return self.term_marker.with_name(self.term_marker.name + ".child")

    def alive(self) -> bool:
        """Whether the holder still runs."""
        return is_alive(self.pid, self.starttime)

    def child_alive(self) -> bool:
        """Whether the holder's child still runs."""
        return self.child_pid is not None and is_alive(self.child_pid, self.child_starttime)

    def got_sigterm(self) -> bool:
        """Whether the holder received SIGTERM (its handler writes the marker)."""
        return self.term_marker.exists()

    def exit_status(self, timeout_s: float = 10.0) -> int:
        """Reap the holder and return its exit status (negative: killed by that signal)."""
        return self.popen.wait(timeout=timeout_s)

    def kill(self) -> None:
        """SIGKILL whatever of this holder still runs; reap the holder."""
        if self.popen.returncode is None:
            # Not reaped yet, so its PID (which is also its process group id) cannot have been
            # reused: the group holds only what this holder started.
            try:
                os.killpg(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.popen.wait(timeout=10)
        if self.child_alive():
            os.kill(self.child_pid, signal.SIGKILL)


@pytest.fixture
def device_file(tmp_path: Path) -> Path:
    """An ordinary file standing in for a GPU device file."""
    path = tmp_path / "nvidia-standin"
    path.write_bytes(b"")
    return path


@pytest.fixture
def start_holder(tmp_path: Path):
    """Start tests/device_holder.py instances; each is killed when the test ends, whatever happened."""
    started: list[Holder] = []

    def start(tag: str, device: Path, *, ignore_term: bool = False, child: bool = False) -> Holder:
        ready = tmp_path / f"{tag}.ready"
        marker = tmp_path / f"{tag}.sigterm"
        command = [
            sys.executable, str(HOLDER_SCRIPT),
            "--tag", tag, "--hold", str(device), "--ready", str(ready), "--term-marker", str(marker),
            "--lifetime", str(HOLDER_LIFETIME_S),
        ]  # fmt: skip
        if ignore_term:
            command.append("--ignore-term")
        if child:
            # One child in the holder's group, as a launcher's worker: it holds no device file
            # and ignores SIGTERM, but notes it.
            command += [
                "--children", "1", "--child-tag", f"{tag}-child", "--child-ignore-term",
                "--child-term-marker", str(marker.with_name(marker.name + ".child")),
            ]  # fmt: skip
        popen = subprocess.Popen(command, start_new_session=True, stdin=subprocess.DEVNULL)
        holder = Holder(popen=popen, tag=tag, ready=ready, term_marker=marker, starttime=proc_stat(popen.pid)[1])
        started.append(holder)
        deadline = time.monotonic() + READY_DEADLINE_S
        while not ready.exists():
            if popen.poll() is not None:
                pytest.fail(f"holder {tag} exited with status {popen.returncode} before it was ready")
            if time.monotonic() > deadline:
                pytest.fail(f"holder {tag} was not ready within {READY_DEADLINE_S} s")
            time.sleep(0.01)
        info = json.loads(ready.read_text())
        assert info["pid"] == popen.pid
        assert len(info["children"]) == (1 if child else 0)
        if info["children"]:
            (holder.child_pid,) = info["children"]
            child_stat = proc_stat(holder.child_pid)
            assert child_stat is not None and child_stat[2] == popen.pid, "child not in the holder's group"
            holder.child_starttime = child_stat[1]
        return holder

    yield start
    for holder in started:
        holder.kill()


@dataclass
class PlaybookRun:
    """The outcome of one ansible-runner run: status, stats and the per-task results."""

    status: str
    rc: int
    stats: dict
    events: list[dict] = field(repr=False)
    stdout: str = field(repr=False)

    def task_results(self, kinds: tuple[str, ...] = ("runner_on_ok", "runner_on_failed")) -> list[dict]:
        """event_data of every task result of these event kinds, in order."""
        return [e["event_data"] for e in self.events if e.get("event") in kinds]

    def task_events(self, action: str, kinds: tuple[str, ...] = ("runner_on_ok", "runner_on_failed")) -> list[dict]:
        """event_data of the results of tasks whose action is ``action`` (short name or FQCN)."""
        return [
            data
            for data in self.task_results(kinds)
            if data.get("task_action") == action or data.get("task_action", "").endswith("." + action)
        ]

    def result(self, action: str) -> dict:
        """The result (``res``) of the one task with this action; fails the test otherwise."""
        found = self.task_events(action)
        assert len(found) == 1, f"expected one {action} result, got {len(found)}\n{self.stdout}"
        return found[0]["res"]

    def failed(self) -> list[dict]:
        """event_data of every failed task."""
        return [e["event_data"] for e in self.events if e.get("event") == "runner_on_failed"]

    def changed_tasks(self) -> list[str]:
        """Names of the tasks that reported a change."""
        return [data["task"] for data in self.task_results(("runner_on_ok",)) if data["res"].get("changed")]

    def changed(self, host: str = HOST) -> int:
        """How many tasks reported a change on host."""
        return (self.stats or {}).get("changed", {}).get(host, 0)

    def summary(self) -> list[str]:
        """The lines of the role's summary (the 'Show the report' debug task)."""
        debug = self.task_events("debug", ("runner_on_ok",))
        shown = [data["res"]["msg"] for data in debug if data["task"] == "Show the report"]
        assert len(shown) == 1, self.stdout
        return shown[0]


@pytest.fixture
def run_gpu_reset(tmp_path_factory: pytest.TempPathFactory):
    """Run playbooks/gpu_reset.yml through ansible-runner with these extra vars; return a PlaybookRun."""

    def run(extravars: dict, *, check: bool = False) -> PlaybookRun:
        runner = run_project_playbook(tmp_path_factory.mktemp("runner"), PLAYBOOK, INVENTORY, extravars, check)
        return PlaybookRun(
            status=runner.status,
            rc=runner.rc,
            stats=runner.stats or {},
            events=list(runner.events),
            stdout=runner.stdout.read(),
        )

    return run
