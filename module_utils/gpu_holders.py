"""Who holds the GPUs, and who may be stopped.

Holders come from two places: NVML's process lists and the processes that have one of the
GPU device files open or mapped (what ``fuser -v /dev/nvidia*`` shows, read from /proc).
Selection never takes PID 1, kernel threads, the caller's own ancestors (the Ansible run and
whatever started it) or anything matching a ``protect`` pattern. A process group is stopped
as a whole only when every member of it may be stopped; that is how a launcher's children,
which outlive a kill of their parent alone, are caught without hitting a bystander.
"""

from __future__ import absolute_import, division, print_function

import glob
import os
import re

PROC = "/proc"
PF_KTHREAD = 0x00200000

# The device files the NVIDIA driver creates; per-GPU ones are /dev/nvidia<minor>.
SHARED_DEVICE_FILES = ("/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools", "/dev/nvidia-modeset")


class ProcInfo(object):
    """One process as read from /proc/<pid>/stat and cmdline."""

    __slots__ = ("pid", "ppid", "pgid", "sid", "state", "flags", "starttime", "comm", "cmdline", "argv")

    def __init__(self, pid, ppid, pgid, sid, state, flags, starttime, comm, cmdline, argv=None):
        self.pid = pid
        self.ppid = ppid
        self.pgid = pgid
        self.sid = sid
        self.state = state
        self.flags = flags
        self.starttime = starttime
        self.comm = comm
        self.cmdline = cmdline
        # The arguments one by one (the command line's NUL-separated parts): a job's argv is
        # recognised from them, not from the joined text.
        self.argv = argv if argv is not None else cmdline.split()

    @property
    def is_kernel_thread(self):
        """Kernel threads have the PF_KTHREAD flag (and no command line).

        The flag alone decides: in a PID namespace (a container) PID 2 and its children are
        ordinary processes, not kthreadd and its threads.
        """
        return bool(self.flags & PF_KTHREAD)

    @property
    def display(self):
        """The command line, or ``[comm]`` as ps shows processes without one."""
        return self.cmdline or "[%s]" % self.comm

    def key(self):
        """(pid, start time): tells a process from a later one that reuses its PID."""
        return (self.pid, self.starttime)


def read_proc(pid, proc_root=PROC):
    """ProcInfo for a PID, or None when it does not exist (or vanished while being read)."""
    try:
        with open(os.path.join(proc_root, str(pid), "stat"), "rb") as handle:
            stat = handle.read().decode("utf-8", "replace")
    except OSError:
        return None
    # comm sits in parentheses and may itself hold spaces or parentheses.
    open_paren, close_paren = stat.find("("), stat.rfind(")")
    comm = stat[open_paren + 1:close_paren]
    fields = stat[close_paren + 2:].split()
    try:
        with open(os.path.join(proc_root, str(pid), "cmdline"), "rb") as handle:
            raw = handle.read()
    except OSError:
        raw = b""
    argv = [part.decode("utf-8", "replace") for part in raw.split(b"\0")]
    if argv and argv[-1] == "":
        argv.pop()  # the terminating NUL
    cmdline = " ".join(part for part in argv if part)
    return ProcInfo(
        pid=int(pid),
        ppid=int(fields[1]),
        pgid=int(fields[2]),
        sid=int(fields[3]),
        state=fields[0],
        flags=int(fields[6]),
        starttime=int(fields[19]),
        comm=comm,
        cmdline=cmdline,
        argv=argv,
    )


def list_pids(proc_root=PROC):
    """All numeric entries of /proc."""
    return [int(name) for name in os.listdir(proc_root) if name.isdigit()]


def snapshot(proc_root=PROC):
    """{pid: ProcInfo} of every process now."""
    procs = {}
    for pid in list_pids(proc_root):
        info = read_proc(pid, proc_root)
        if info is not None:
            procs[pid] = info
    return procs


def ancestors(pid, procs):
    """PIDs of ``pid`` and every parent up to PID 1, from a snapshot."""
    chain = set()
    while pid and pid not in chain:
        chain.add(pid)
        info = procs.get(pid)
        if info is None:
            break
        pid = info.ppid
    return chain


def expand_device_paths(patterns):
    """Glob patterns to existing real paths (symlinks resolved), in order, deduplicated."""
    paths = []
    for pattern in patterns:
        for path in sorted(glob.glob(pattern)) or ([pattern] if os.path.exists(pattern) else []):
            real = os.path.realpath(path)
            if real not in paths:
                paths.append(real)
    return paths


def default_device_patterns(minor_numbers=None):
    """The NVIDIA device files for the given GPU minor numbers (None: every GPU).

    For a subset of GPUs only their own /dev/nvidia<minor> files count: the shared files
    (nvidiactl, nvidia-uvm) are open in every CUDA process, whichever GPU it uses.
    """
    if minor_numbers is None:
        return ["/dev/nvidia[0-9]*"] + list(SHARED_DEVICE_FILES)
    return ["/dev/nvidia%d" % minor for minor in minor_numbers]


def device_holders(paths, proc_root=PROC):
    """{pid: sorted list of the given paths it has open or mapped}, and the PIDs not readable.

    Reads /proc/<pid>/fd links and /proc/<pid>/maps, as fuser does. PIDs whose fds could not
    be read (another user's, when not root) are returned apart so the caller can say so.
    """
    wanted = set(paths)
    found = {}
    unreadable = []
    if not wanted:
        return found, unreadable
    for pid in list_pids(proc_root):
        base = os.path.join(proc_root, str(pid))
        hits = set()
        try:
            fds = os.listdir(os.path.join(base, "fd"))
        except OSError as exc:
            if exc.errno in (1, 13):  # EPERM, EACCES
                unreadable.append(pid)
            continue
        for fd in fds:
            try:
                target = os.readlink(os.path.join(base, "fd", fd))
            except OSError:
                continue
            if target in wanted:
                hits.add(target)
        try:
            with open(os.path.join(base, "maps"), "rb") as handle:
                for line in handle:
                    parts = line.split(None, 5)
                    if len(parts) == 6:
                        mapped = parts[5].strip().decode("utf-8", "replace")
                        if mapped in wanted:
                            hits.add(mapped)
        except OSError:
            pass
        if hits:
            found[pid] = sorted(hits)
    return found, unreadable


def compile_patterns(patterns, option):
    """Compile a list of regexes; raise ValueError naming the option and the bad pattern."""
    compiled = []
    for pattern in patterns or []:
        try:
            compiled.append(re.compile(pattern))
        except re.error as exc:
            raise ValueError("%s: %r is not a valid regular expression: %s" % (option, pattern, exc)) from exc
    return compiled


def first_match(patterns, text):
    """The first pattern (compiled) that matches anywhere in text, or None."""
    for pattern in patterns:
        if pattern.search(text):
            return pattern
    return None


def why_not_selectable(proc, match, protect, shielded, spared=None):  # noqa: PLR0911 - one exit per reason
    """None when the process may be stopped, else the reason (for reports and messages).

    ``match`` and ``protect`` are compiled patterns searched in the command line (or
    ``[comm]`` for processes without one); ``shielded`` is the set of PIDs never touched
    (the caller's ancestors); ``spared`` maps more PIDs never touched to the reason why
    (the pipeline's own running jobs, see pipeline_jobs), whatever ``match`` says.
    """
    if proc.pid == 1:
        return "PID 1 (init) is never stopped"
    if proc.is_kernel_thread:
        return "kernel thread"
    if proc.pid in shielded:
        return "part of this run (an ancestor of the module: the Ansible run or what started it)"
    if spared and proc.pid in spared:
        return spared[proc.pid]
    hit = first_match(protect, proc.display)
    if hit is not None:
        return "protected: matches %r (gpu_reset_protect or gpu_reset_protect_extra)" % hit.pattern
    if match and first_match(match, proc.display) is None:
        return "not matched by any pattern of gpu_reset_match"
    return None


class Holder(object):
    """A process that holds a GPU: its ProcInfo and how it holds it."""

    __slots__ = ("proc", "gpus", "devices", "used_mib")

    def __init__(self, proc, gpus=None, devices=None, used_mib=None):
        self.proc = proc
        self.gpus = set(gpus or ())
        self.devices = set(devices or ())
        self.used_mib = used_mib

    def as_dict(self, reason=None):
        """A JSON-ready record."""
        record = {
            "pid": self.proc.pid,
            "pgid": self.proc.pgid,
            "sid": self.proc.sid,
            "cmdline": self.proc.display,
            "gpus": sorted(self.gpus),
            "devices": sorted(self.devices),
            "used_mib": self.used_mib,
        }
        if reason is not None:
            record["reason"] = reason
        return record


def find_holders(procs, nvml_processes, device_hits):
    """Merge NVML's per-GPU processes and device-file holders into {pid: Holder}.

    ``nvml_processes`` is {gpu index: [ {pid, used_mib, ...} ]}; ``device_hits`` is
    {pid: [paths]}. PIDs NVML reports that /proc does not show (another PID namespace)
    are skipped: nothing here could signal them anyway.
    """
    holders = {}
    for gpu, plist in (nvml_processes or {}).items():
        for entry in plist:
            proc = procs.get(entry["pid"])
            if proc is None:
                continue
            holder = holders.setdefault(proc.pid, Holder(proc))
            holder.gpus.add(gpu)
            if entry.get("used_mib") is not None:
                holder.used_mib = (holder.used_mib or 0) + entry["used_mib"]
    for pid, paths in (device_hits or {}).items():
        proc = procs.get(pid)
        if proc is None:
            continue
        holder = holders.setdefault(pid, Holder(proc))
        holder.devices.update(paths)
    return holders


class StopUnit(object):
    """What one signal goes to: a whole process group, or a single process."""

    __slots__ = ("kind", "ident", "members")

    def __init__(self, kind, ident, members):
        self.kind = kind  # "group" or "process"
        self.ident = ident  # pgid or pid
        self.members = members  # [ProcInfo] known at planning time

    def as_dict(self):
        """A JSON-ready record."""
        return {"kind": self.kind, "id": self.ident, "pids": sorted(m.pid for m in self.members)}


def plan_stop(holders, procs, match, protect, shielded, spared=None):
    """Split holders into (units to stop, protected/left records).

    Returns (units, left) where ``left`` is a list of holder dicts with the reason each one
    is left alone. A holder's whole process group becomes one unit when every member of the
    group may be stopped; otherwise each selectable holder is its own unit. ``spared``:
    {pid: reason} of processes never stopped (see why_not_selectable).
    """
    left = []
    selected = []
    for pid in sorted(holders):
        holder = holders[pid]
        reason = why_not_selectable(holder.proc, match, protect, shielded, spared)
        if reason is None:
            selected.append(holder)
        else:
            left.append(holder.as_dict(reason))
    by_group = {}
    for proc in procs.values():
        by_group.setdefault(proc.pgid, []).append(proc)
    units = []
    grouped = set()
    for holder in selected:
        proc = holder.proc
        if proc.pid in grouped:
            continue
        members = by_group.get(proc.pgid, [proc])
        whole_group = proc.pgid > 1 and all(
            why_not_selectable(member, match, protect, shielded, spared) is None for member in members
        )
        if whole_group:
            units.append(StopUnit("group", proc.pgid, sorted(members, key=lambda m: m.pid)))
            grouped.update(member.pid for member in members)
        else:
            units.append(StopUnit("process", proc.pid, [proc]))
            grouped.add(proc.pid)
    return units, left
