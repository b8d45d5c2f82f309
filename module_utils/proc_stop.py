"""Stop processes politely, then firmly, and watch them go: SIGTERM, poll, SIGKILL, poll.

Polling (every ``poll_s``, 50 ms by default) replaces fixed sleeps: a process that exits at
once costs one poll, not a five-second nap. A zombie counts as gone (its GPU memory and
device files are released at exit); its parent is named, since only the parent can reap it.
Processes are tracked by (pid, start time) so a reused PID is never mistaken for a survivor.
"""

from __future__ import absolute_import, division, print_function

import errno
import os
import signal
import time

from ansible.module_utils.gpu_holders import PROC, read_proc, snapshot


def _alive(proc, proc_root):
    """(alive, current ProcInfo or None). A zombie or a new process under the PID is not alive."""
    now = read_proc(proc.pid, proc_root)
    if now is None or now.starttime != proc.starttime:
        return False, None
    return now.state not in ("Z", "X", "x"), now


def _send(unit, sig):
    """Signal a unit; a unit already gone is not an error."""
    try:
        if unit.kind == "group":
            os.killpg(unit.ident, sig)
        else:
            os.kill(unit.ident, sig)
    except OSError as exc:
        if exc.errno != errno.ESRCH:
            raise


def _running(unit, tracked):
    """Whether a process of the unit was still running at the last sweep.

    Only such a unit is signalled (or gains members): once all its processes are gone, its
    PID or group id may belong to an unrelated process.
    """
    return any(entry["unit"] is unit and "signal" not in entry for entry in tracked.values())


def _group_members(unit, tracked, proc_root):
    """Members of a group unit, including processes that joined it since planning (forks)."""
    if unit.kind != "group" or not _running(unit, tracked):
        return
    for proc in snapshot(proc_root).values():
        if proc.pgid == unit.ident and proc.key() not in tracked:
            tracked[proc.key()] = {"proc": proc, "unit": unit}


def stop_units(units, grace_s, kill_wait_s=10.0, poll_s=0.05, proc_root=PROC, clock=time.monotonic):
    """Stop every unit; return a report dict.

    Report keys: ``stopped`` (one record per process: pid, pgid, cmdline, unit, signal that
    ended it (None when it had exited before any signal), seconds from the first signal to its
    exit, zombie_parent when it ended as a zombie), ``survivors`` (processes still alive after
    SIGKILL and ``kill_wait_s``, with their state), ``first_signal_at`` (time.time() of the
    first signal, None when none was sent) and ``seconds``.
    """
    tracked = {}
    for unit in units:
        for member in unit.members:
            tracked[member.key()] = {"proc": member, "unit": unit}
    report = {"stopped": [], "survivors": [], "first_signal_at": None, "seconds": 0.0}
    if not units:
        return report
    start = clock()

    def sweep(now_signal, adopt=True):
        if adopt:
            for unit in units:
                _group_members(unit, tracked, proc_root)
        pending = 0
        for entry in tracked.values():
            if "signal" in entry:
                continue
            alive, current = _alive(entry["proc"], proc_root)
            if alive:
                pending += 1
                entry["state"] = current.state
                continue
            entry["signal"] = now_signal
            entry["seconds"] = round(clock() - start, 3)
            if current is not None:  # a zombie: name the parent that has to reap it
                parent = read_proc(current.ppid, proc_root)
                entry["zombie_parent"] = {
                    "pid": current.ppid,
                    "cmdline": parent.display if parent else None,
                }
        return pending

    # Processes already gone are never signalled: their PIDs may have been reused.
    sweep(None, adopt=False)
    signal_name = "SIGTERM"
    for unit in units:
        if _running(unit, tracked):
            if report["first_signal_at"] is None:
                report["first_signal_at"] = time.time()
            _send(unit, signal.SIGTERM)
    deadline = start + grace_s
    pending = sweep(signal_name)
    while pending and clock() < deadline:
        time.sleep(poll_s)
        pending = sweep(signal_name)
    if pending:
        signal_name = "SIGKILL"
        for unit in units:
            if _running(unit, tracked):
                _send(unit, signal.SIGKILL)
        deadline = clock() + kill_wait_s
        pending = sweep(signal_name)
        while pending and clock() < deadline:
            time.sleep(poll_s)
            pending = sweep(signal_name)

    for entry in tracked.values():
        proc, unit = entry["proc"], entry["unit"]
        record = {
            "pid": proc.pid,
            "pgid": proc.pgid,
            "cmdline": proc.display,
            "unit": "%s %d" % (unit.kind, unit.ident),
        }
        if "signal" in entry:
            record["signal"] = entry["signal"]
            record["seconds"] = entry["seconds"]
            if "zombie_parent" in entry:
                record["zombie_parent"] = entry["zombie_parent"]
            report["stopped"].append(record)
        else:
            record["state"] = entry.get("state")
            report["survivors"].append(record)
    report["stopped"].sort(key=lambda r: r["pid"])
    report["seconds"] = round(clock() - start, 3)
    return report


def survivor_message(survivors, kill_wait_s):
    """A message naming each process that outlived SIGKILL, and what that usually means."""
    lines = []
    for record in survivors:
        state = record.get("state")
        hint = (
            "uninterruptible sleep (state D), usually stuck in the driver or on I/O; "
            "only a driver reset or reboot frees it"
            if state == "D"
            else "state %s" % state
        )
        lines.append(
            "PID %d (%s) is still alive %.0f s after SIGKILL: %s"
            % (record["pid"], record["cmdline"], kill_wait_s, hint)
        )
    return "; ".join(lines)
