"""gpu_holders: reading /proc, finding who holds a (stand-in) device file, planning the stop."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from ansible.module_utils.gpu_holders import (
    PF_KTHREAD,
    ProcInfo,
    ancestors,
    compile_patterns,
    default_device_patterns,
    device_holders,
    expand_device_paths,
    find_holders,
    plan_stop,
    read_proc,
    snapshot,
    why_not_selectable,
)
from process_checks import state, wait_for

MODULE_UTILS = Path(__file__).resolve().parents[2] / "module_utils"
RUN_REASON = "part of this run (an ancestor of the module: the Ansible run or what started it)"


def boot_time():
    with open("/proc/stat") as handle:
        for line in handle:
            if line.startswith("btime "):
                return int(line.split()[1])
    raise AssertionError("no btime in /proc/stat")


def plan(paths, match=(), protect=(), nvml_processes=None):
    """Discover and plan exactly as gpu_processes does; return (holders, units, left)."""
    procs = snapshot()
    hits, _unreadable = device_holders(paths)
    holders = find_holders(procs, nvml_processes or {}, hits)
    shielded = ancestors(os.getpid(), procs)
    units, left = plan_stop(
        holders, procs, compile_patterns(match, "match"), compile_patterns(protect, "protect"), shielded
    )
    return holders, units, left


# -- read_proc ------------------------------------------------------------------------------


def test_read_proc_reads_a_real_child_in_its_own_session(spawn):
    before = time.time()
    child = spawn("--comm", "a) (b c", new_session=True)
    after = time.time()
    info = read_proc(child.pid)
    assert info.pid == child.pid
    assert info.ppid == os.getpid()
    assert info.pgid == child.pid
    assert info.sid == child.pid
    assert info.state in ("S", "R")  # asleep in signal.pause(), or just about to be
    assert info.comm == "a) (b c"  # parentheses and spaces in comm do not shift the fields
    assert info.cmdline == " ".join(child.popen.args)
    assert info.display == info.cmdline
    assert not info.is_kernel_thread
    started_at = boot_time() + info.starttime / os.sysconf("SC_CLK_TCK")
    assert before - 2 <= started_at <= after + 1
    assert info.key() == (child.pid, info.starttime)


def test_read_proc_of_a_child_in_the_callers_group(spawn):
    first = spawn()
    second = spawn()
    info = read_proc(second.pid)
    assert (info.pgid, info.sid) == (os.getpgrp(), os.getsid(0))
    assert info.starttime >= read_proc(first.pid).starttime


def test_read_proc_of_a_pid_that_cannot_exist_is_none():
    with open("/proc/sys/kernel/pid_max") as handle:
        assert read_proc(int(handle.read()) + 1) is None


def test_a_zombie_is_displayed_by_its_comm(spawn):
    child = spawn()
    child.popen.kill()  # not reaped yet: it stays a zombie of this test process
    wait_for(lambda: state(child.pid) == "Z", 10, "the killed child to be a zombie")
    zombie = read_proc(child.pid)
    assert zombie.cmdline == ""
    assert zombie.display == "[%s]" % zombie.comm


# -- device files ---------------------------------------------------------------------------


def test_device_holders_finds_open_and_mapped_files(spawn, device_file, tmp_path):
    other = tmp_path / "nvidia1"
    other.write_bytes(b"\0" * 4096)
    opener = spawn("--hold", device_file)
    mapper = spawn("--mmap", device_file)
    both = spawn("--hold", other, "--mmap", device_file)
    bystander = spawn()
    # The mapper closed its fd: only /proc/<pid>/maps shows the file.
    fds = [os.readlink("/proc/%d/fd/%s" % (mapper.pid, fd)) for fd in os.listdir("/proc/%d/fd" % mapper.pid)]
    assert device_file not in fds

    found, unreadable = device_holders([device_file, str(other)])
    assert found[opener.pid] == [device_file]
    assert found[mapper.pid] == [device_file]
    assert found[both.pid] == sorted([device_file, str(other)])
    assert bystander.pid not in found
    assert os.getpid() not in found
    assert set(found) == {opener.pid, mapper.pid, both.pid}
    assert not {opener.pid, mapper.pid, both.pid, bystander.pid} & set(unreadable)  # our own are readable


def test_device_holders_of_no_paths_is_empty():
    assert device_holders([]) == ({}, [])


def test_expand_device_paths_globs_resolves_links_and_drops_missing(tmp_path):
    for name in ("nvidia0", "nvidia1", "nvidiactl"):
        (tmp_path / name).write_bytes(b"")
    (tmp_path / "gpu-link").symlink_to(tmp_path / "nvidia1")
    real = os.path.realpath(tmp_path)
    paths = expand_device_paths(
        [
            str(tmp_path / "nvidia[0-9]*"),
            str(tmp_path / "gpu-link"),
            str(tmp_path / "nvidia7"),
            str(tmp_path / "nvidiactl"),
        ]
    )
    assert paths == [real + "/nvidia0", real + "/nvidia1", real + "/nvidiactl"]


def test_default_device_patterns_for_a_subset_leave_out_the_shared_files():
    assert default_device_patterns([0, 3]) == ["/dev/nvidia0", "/dev/nvidia3"]
    everything = default_device_patterns()
    assert "/dev/nvidia[0-9]*" in everything
    assert "/dev/nvidiactl" in everything
    assert "/dev/nvidia-uvm" in everything


# -- ancestors and selection ----------------------------------------------------------------


def test_ancestors_are_this_process_and_its_parents_not_its_children(spawn):
    child = spawn()
    procs = snapshot()
    chain = ancestors(os.getpid(), procs)
    assert {os.getpid(), os.getppid()} <= chain
    assert child.pid not in chain
    pid = os.getpid()
    while pid in procs:  # every link up to the top of this PID namespace
        assert pid in chain
        pid = procs[pid].ppid


def test_pid_1_is_never_selectable():
    assert why_not_selectable(read_proc(1), [], [], set()) == "PID 1 (init) is never stopped"


def test_kernel_threads_are_never_selectable():
    threads = [p for p in snapshot().values() if p.flags & PF_KTHREAD]
    if not threads:
        pytest.skip("no kernel thread visible in this PID namespace")
    for proc in threads[:5]:
        assert why_not_selectable(proc, [], [], set()) == "kernel thread"


def test_the_callers_ancestors_are_never_selectable():
    procs = snapshot()
    shielded = ancestors(os.getpid(), procs)
    assert why_not_selectable(procs[os.getpid()], [], [], shielded) == RUN_REASON
    assert why_not_selectable(procs[os.getppid()], [], [], shielded) == RUN_REASON


def test_protect_and_match_patterns_decide_with_their_reasons(spawn):
    proc = spawn("--tag", "sglang-worker").info
    protect = compile_patterns(["nvidia-persistenced", r"sglang-w\w+"], "protect")
    match = compile_patterns(["sglang"], "match")
    assert why_not_selectable(proc, [], [], set()) is None
    assert why_not_selectable(proc, match, [], set()) is None
    assert why_not_selectable(proc, compile_patterns(["vllm"], "match"), [], set()) == (
        "not matched by any pattern of gpu_reset_match"
    )
    assert why_not_selectable(proc, match, protect, set()) == (
        "protected: matches 'sglang-w\\\\w+' (gpu_reset_protect or gpu_reset_protect_extra)"
    )


def test_a_process_with_pid_2_in_a_container_is_not_a_kernel_thread():
    # In a PID namespace (a container), PID 2 and its children are ordinary processes; only
    # the PF_KTHREAD flag tells a kernel thread.
    pid2 = ProcInfo(
        pid=2,
        ppid=1,
        pgid=2,
        sid=2,
        state="S",
        flags=0x400100,
        starttime=5,
        comm="launcher",
        cmdline="python -m sglang.launch_server",
    )
    child = ProcInfo(
        pid=9,
        ppid=2,
        pgid=2,
        sid=2,
        state="S",
        flags=0x400040,
        starttime=7,
        comm="python",
        cmdline="sglang::scheduler_TP0",
    )
    for proc in (pid2, child):
        assert not proc.is_kernel_thread
        assert why_not_selectable(proc, [], [], set()) is None


NAMESPACE_SCRIPT = textwrap.dedent(
    """
    import json, os, signal, sys
    sys.path.insert(0, sys.argv[1])
    from gpu_holders import read_proc, why_not_selectable
    ready_r, ready_w = os.pipe()
    if os.fork() == 0:              # PID 2 of the new namespace
        if os.fork() == 0:          # its child: PPID 2
            os.write(ready_w, b"x")
            signal.pause()
        signal.pause()
    os.read(ready_r, 1)
    procs = [read_proc(pid) for pid in sorted(int(p) for p in os.listdir("/proc") if p.isdigit())]
    print(json.dumps([
        {"pid": p.pid, "ppid": p.ppid, "kernel_thread": p.is_kernel_thread,
         "reason": why_not_selectable(p, [], [], set())}
        for p in procs if p is not None
    ]))
    """
)  # When PID 1 of a namespace exits, the kernel kills everything left in it.


def test_pid_2_and_its_children_are_selectable_in_a_real_pid_namespace():
    unshare = shutil.which("unshare")
    if unshare is None:
        pytest.skip("unshare(1) is not installed")
    run = subprocess.run(
        [unshare, "--pid", "--fork", "--mount-proc", sys.executable, "-c", NAMESPACE_SCRIPT, str(MODULE_UTILS)],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    if run.returncode != 0 and run.stderr.startswith("unshare:"):  # unshare itself failed, not the script
        pytest.skip("cannot create a PID namespace here: %s" % run.stderr.strip())
    assert run.returncode == 0, run.stderr
    procs = {p["pid"]: p for p in json.loads(run.stdout)}
    assert procs[1]["reason"] == "PID 1 (init) is never stopped"
    assert procs[2]["ppid"] == 1
    grandchild = [p for p in procs.values() if p["ppid"] == 2]
    assert len(grandchild) == 1
    for proc in (procs[2], grandchild[0]):
        assert proc["kernel_thread"] is False
        assert proc["reason"] is None


def test_compile_patterns_names_the_option_and_the_bad_pattern():
    assert [p.pattern for p in compile_patterns(["a+", "b"], "match")] == ["a+", "b"]
    assert compile_patterns(None, "match") == []
    with pytest.raises(ValueError, match=r"^protect: '\(unclosed' is not a valid regular expression: "):
        compile_patterns(["ok", "(unclosed"], "protect")


# -- find_holders ---------------------------------------------------------------------------


def test_find_holders_merges_nvml_lists_and_device_files(spawn, device_file):
    nvml_only = spawn()
    both = spawn("--hold", device_file)
    with open("/proc/sys/kernel/pid_max") as handle:
        invisible = int(handle.read()) + 1  # a PID NVML reports from another namespace
    nvml_processes = {
        0: [{"pid": nvml_only.pid, "used_mib": 500}, {"pid": invisible, "used_mib": 1}],
        1: [{"pid": nvml_only.pid, "used_mib": 100}, {"pid": both.pid, "used_mib": None}],
    }
    holders, units, left = plan([device_file], nvml_processes=nvml_processes)
    assert set(holders) == {nvml_only.pid, both.pid}
    assert holders[nvml_only.pid].as_dict() == {
        "pid": nvml_only.pid,
        "pgid": os.getpgrp(),
        "sid": os.getsid(0),
        "cmdline": " ".join(nvml_only.popen.args),
        "gpus": [0, 1],
        "devices": [],
        "used_mib": 600,
    }
    assert holders[both.pid].gpus == {1}
    assert holders[both.pid].devices == {device_file}
    assert holders[both.pid].used_mib is None
    assert [u.as_dict() for u in units] == [
        {"kind": "process", "id": nvml_only.pid, "pids": [nvml_only.pid]},
        {"kind": "process", "id": both.pid, "pids": [both.pid]},
    ]
    assert left == []


# -- plan_stop ------------------------------------------------------------------------------


def test_a_holder_in_its_own_group_is_stopped_as_the_whole_group(spawn, device_file):
    holder = spawn("--hold", device_file, "--children", 2, new_session=True)
    holders, units, left = plan([device_file])
    assert set(holders) == {holder.pid}  # its children do not hold the file
    assert [u.as_dict() for u in units] == [
        {"kind": "group", "id": holder.pid, "pids": sorted([holder.pid, *holder.child_pids])}
    ]
    assert left == []


def test_a_holder_sharing_the_runners_group_is_stopped_alone(spawn, device_file):
    holder = spawn("--hold", device_file)
    assert holder.info.pgid == os.getpgrp()  # the group of this test run, one of its ancestors
    _holders, units, left = plan([device_file])
    assert [u.as_dict() for u in units] == [{"kind": "process", "id": holder.pid, "pids": [holder.pid]}]
    assert left == []


def test_a_group_with_an_unmatched_member_is_not_stopped_as_a_group(spawn, device_file):
    # The children's command lines have no --tag, so match leaves them out of the stop.
    holder = spawn("--hold", device_file, "--tag", "sglang", "--children", 1, new_session=True)
    _holders, units, _left = plan([device_file], match=["sglang"])
    assert [u.as_dict() for u in units] == [{"kind": "process", "id": holder.pid, "pids": [holder.pid]}]


def test_a_protected_holder_is_left_with_the_reason(spawn, device_file):
    kept = spawn("--hold", device_file, "--tag", "nv-hostengine", new_session=True)
    stopped = spawn("--hold", device_file, new_session=True)
    _holders, units, left = plan([device_file], protect=["nv-hostengine", "dcgm"])
    assert [u.as_dict() for u in units] == [{"kind": "group", "id": stopped.pid, "pids": [stopped.pid]}]
    assert left == [
        {
            "pid": kept.pid,
            "pgid": kept.pid,
            "sid": kept.pid,
            "cmdline": " ".join(kept.popen.args),
            "gpus": [],
            "devices": [device_file],
            "used_mib": None,
            "reason": "protected: matches 'nv-hostengine' (gpu_reset_protect or gpu_reset_protect_extra)",
        }
    ]


def test_holders_in_the_same_group_give_one_unit(spawn, device_file):
    parent = spawn("--hold", device_file, "--children", 2, "--child-hold", device_file, new_session=True)
    holders, units, _left = plan([device_file])
    assert set(holders) == {parent.pid, *parent.child_pids}
    assert [u.as_dict() for u in units] == [
        {"kind": "group", "id": parent.pid, "pids": sorted([parent.pid, *parent.child_pids])}
    ]


def test_ancestor_holding_the_file_is_left_as_part_of_this_run(device_file):
    with open(device_file, "rb"):
        _holders, units, left = plan([device_file])
    assert units == []
    assert [(r["pid"], r["reason"]) for r in left] == [(os.getpid(), RUN_REASON)]
