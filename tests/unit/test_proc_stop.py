"""proc_stop: SIGTERM, grace, SIGKILL on real processes; groups, zombies and reused PIDs."""

from __future__ import annotations

import os
import time

from ansible.module_utils.gpu_holders import ProcInfo, StopUnit, read_proc, snapshot
from ansible.module_utils.proc_stop import stop_units, survivor_message
from process_checks import running, wait_for

# Longer than any healthy stop takes on any machine (a signal handled, /proc read: milliseconds), so that
# "within the grace" and "sooner than kill_wait_s" tell a prompt stop from one that waited them out.
GRACE_S = 30.0
KILL_WAIT_S = 30.0
# For stops that wait out the whole grace (something ignores SIGTERM) yet need a SIGTERM handled first:
# long enough for a process starved on a loaded machine to run its handler (or exit) before SIGKILL.
HANDLER_GRACE_S = 3.0


def process_unit(child):
    return StopUnit("process", child.pid, [read_proc(child.pid)])


def group_unit(child):
    """The whole process group led by ``child``, as plan_stop builds it."""
    members = sorted((p for p in snapshot().values() if p.pgid == child.pid), key=lambda p: p.pid)
    return StopUnit("group", child.pid, members)


def by_pid(report):
    return {record["pid"]: record for record in report["stopped"]}


def stale(info):
    """The same PID as ``info`` but an earlier start time: the process planned for is gone and
    its PID now belongs to ``info``'s process."""
    return ProcInfo(
        info.pid, info.ppid, info.pgid, info.sid, info.state, info.flags, info.starttime - 1, info.comm, info.cmdline
    )


def test_a_holder_ends_by_sigterm_well_before_the_grace(spawn, device_file, tmp_path):
    marker = tmp_path / "term"
    holder = spawn("--hold", device_file, "--term-marker", marker)
    before = time.time()
    report = stop_units([process_unit(holder)], grace_s=GRACE_S)
    assert not running(holder.key)
    assert marker.read_text() == "SIGTERM\n"
    assert report["survivors"] == []
    (record,) = report["stopped"]
    assert record["pid"] == holder.pid
    assert record["unit"] == "process %d" % holder.pid
    assert record["cmdline"] == " ".join(holder.popen.args)
    assert record["signal"] == "SIGTERM"
    # Its exit is seen within a poll; a stop that waited for the grace instead would take all of it.
    assert record["seconds"] < GRACE_S
    assert report["seconds"] < GRACE_S
    assert before <= report["first_signal_at"] <= time.time()
    # This test process has not reaped it yet: it is a zombie, and its parent is named.
    assert record["zombie_parent"]["pid"] == os.getpid()


def test_a_holder_ignoring_sigterm_ends_by_sigkill_after_the_grace(spawn, device_file, tmp_path):
    marker = tmp_path / "term"
    holder = spawn("--hold", device_file, "--ignore-term", "--term-marker", marker)
    report = stop_units([process_unit(holder)], grace_s=HANDLER_GRACE_S, kill_wait_s=KILL_WAIT_S)
    assert not running(holder.key)
    assert marker.exists()  # SIGTERM came first, and was ignored
    (record,) = report["stopped"]
    assert record["signal"] == "SIGKILL"
    # Not before the grace; and seen dead within a poll of SIGKILL, not after waiting out kill_wait_s.
    assert HANDLER_GRACE_S <= record["seconds"] < HANDLER_GRACE_S + KILL_WAIT_S
    assert report["survivors"] == []


def test_a_group_unit_leaves_no_member_and_no_orphan(spawn, device_file):
    # The parent goes on SIGTERM; its children ignore it and would live on as orphans.
    parent = spawn("--hold", device_file, "--children", 3, "--child-ignore-term", new_session=True)
    assert len(parent.children) == 3
    assert all(running(key) for key in parent.children)
    report = stop_units([group_unit(parent)], grace_s=HANDLER_GRACE_S)
    assert not running(parent.key)
    for key in parent.children:
        assert not running(key), "child %d of the group is still running" % key[0]
    assert [p.pid for p in snapshot().values() if p.pgid == parent.pid and p.state != "Z"] == []
    records = by_pid(report)
    assert set(records) == {parent.pid, *parent.child_pids}
    assert records[parent.pid]["signal"] == "SIGTERM"
    for pid in parent.child_pids:
        assert records[pid]["signal"] == "SIGKILL"
        assert records[pid]["unit"] == "group %d" % parent.pid
    assert report["survivors"] == []


def test_a_process_that_joins_the_group_while_it_is_stopped_is_stopped_too(spawn, tmp_path):
    late_pid_file = tmp_path / "late-pid"
    parent = spawn("--ignore-term", "--spawn-on-term", late_pid_file, new_session=True)
    unit = group_unit(parent)
    # The parent's handler starts a Python child and writes its pid file, all within the grace: more
    # work than HANDLER_GRACE_S is meant for.
    report = stop_units([unit], grace_s=5.0)
    late_pid = int(late_pid_file.read_text())
    late = read_proc(late_pid)
    if late is not None:  # make sure the cleanup finds it if this test fails
        parent.children.append(late.key())
    assert late_pid not in [m.pid for m in unit.members]
    assert late is None or late.state == "Z"
    records = by_pid(report)
    assert set(records) == {parent.pid, late_pid}
    assert records[late_pid]["signal"] == "SIGKILL"
    assert report["survivors"] == []


def test_a_zombie_counts_as_exited_and_names_its_parent(spawn, device_file):
    # The parent never reaps its children and is not stopped: the holder ends as its zombie.
    parent = spawn("--children", 1, "--child-hold", device_file, new_session=True)
    (child_key,) = parent.children
    child = read_proc(child_key[0])
    report = stop_units([StopUnit("process", child.pid, [child])], grace_s=5.0)
    (record,) = report["stopped"]
    assert record["pid"] == child.pid
    assert record["signal"] == "SIGTERM"
    assert record["zombie_parent"] == {"pid": parent.pid, "cmdline": " ".join(parent.popen.args)}
    assert read_proc(child.pid).state == "Z"
    assert running(parent.key)
    assert report["survivors"] == []


def test_a_reused_pid_is_never_signalled(spawn, tmp_path):
    # The planned process is gone and its PID now belongs to a stranger (here: a process this
    # test started, so that it can tell whether it was signalled). A real TERM-ignoring holder
    # makes stop_units go on to SIGKILL.
    marker = tmp_path / "stranger-term"
    stranger = spawn("--ignore-term", "--term-marker", marker)
    stranger_group = spawn("--ignore-term", "--term-marker", tmp_path / "group-term", new_session=True)
    stubborn = spawn("--ignore-term")
    units = [
        StopUnit("process", stranger.pid, [stale(stranger.info)]),
        StopUnit("group", stranger_group.pid, [stale(stranger_group.info)]),
        process_unit(stubborn),
    ]
    report = stop_units(units, grace_s=0.3)
    assert running(stranger.key)
    assert running(stranger_group.key)
    assert not marker.exists()
    assert not (tmp_path / "group-term").exists()
    assert not running(stubborn.key)
    records = by_pid(report)
    assert records[stubborn.pid]["signal"] == "SIGKILL"
    assert records[stranger.pid]["signal"] is None  # it had exited before any signal
    assert records[stranger_group.pid]["signal"] is None
    assert report["survivors"] == []


def test_a_process_gone_before_the_stop_is_reported_without_a_signal(spawn):
    gone = spawn()
    info = gone.info
    gone.popen.kill()
    gone.popen.wait(timeout=10)
    wait_for(lambda: read_proc(info.pid) is None, 10, "the reaped child to leave /proc")
    report = stop_units([StopUnit("process", info.pid, [info])], grace_s=GRACE_S)
    (record,) = report["stopped"]
    assert record["signal"] is None
    assert report["first_signal_at"] is None
    assert report["seconds"] < GRACE_S  # nothing to wait for: no grace spent on it


def test_no_units_signal_nothing():
    assert stop_units([], grace_s=1.0) == {"stopped": [], "survivors": [], "first_signal_at": None, "seconds": 0.0}


def test_survivor_message_names_each_process_and_explains_state_d():
    message = survivor_message(
        [
            {"pid": 10, "cmdline": "python -m sglang.launch_server", "state": "D"},
            {"pid": 11, "cmdline": "[worker]", "state": "S"},
        ],
        kill_wait_s=10,
    )
    assert message == (
        "PID 10 (python -m sglang.launch_server) is still alive 10 s after SIGKILL: uninterruptible sleep "
        "(state D), usually stuck in the driver or on I/O; only a driver reset or reboot frees it; "
        "PID 11 ([worker]) is still alive 10 s after SIGKILL: state S"
    )
