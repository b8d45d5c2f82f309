"""Wait until GPUs are free, by NVML's v2 used memory and its process lists, polling.

A GPU is free when its used memory (v2: without the driver's own reservation) is at most
``max_used_mib`` and no compute process runs on it. When the wait times out, the message
names each GPU still held, the MiB it holds, and each holder with the reason it was left,
or says that no process holds it (driver state; a GPU reset is the remedy).
"""

from __future__ import absolute_import, division, print_function

import time

from ansible.module_utils.gpu_nvml import memory_mib, running_processes


def gpu_state(nvml, index, handle, max_used_mib):
    """One poll of one GPU: dict with index, used/reserved MiB, compute processes, free."""
    _total, used, reserved = memory_mib(nvml, handle)
    procs = running_processes(nvml, handle)
    return {
        "index": index,
        "memory_used_mib": used,
        "memory_reserved_mib": reserved,
        "processes": procs,
        "free": used <= max_used_mib and not procs,
    }


def wait_free(nvml, indices, handles, max_used_mib, timeout_s, poll_s=0.1, clock=time.monotonic):
    """Poll until every GPU is free or ``timeout_s`` passes; return (ok, states, seconds, polls)."""
    start = clock()
    polls = 0
    while True:
        polls += 1
        states = [gpu_state(nvml, i, h, max_used_mib) for i, h in zip(indices, handles)]
        elapsed = clock() - start
        if all(s["free"] for s in states):
            return True, states, round(elapsed, 3), polls
        if elapsed >= timeout_s:
            return False, states, round(elapsed, 3), polls
        time.sleep(min(poll_s, max(0.0, timeout_s - elapsed)))


def held_message(states, max_used_mib, timeout_s, explain):
    """The failure message for GPUs still held.

    ``explain(pid)`` returns (command line, why it was left) for a PID; it lets the caller
    apply its own match/protect rules so the reason matches what the stop step did.
    """
    parts = []
    for state in states:
        if state["free"]:
            continue
        head = "GPU %d holds %d MiB (limit %d MiB)" % (state["index"], state["memory_used_mib"], max_used_mib)
        if state["processes"]:
            holders = []
            for proc in state["processes"]:
                cmdline, reason = explain(proc["pid"])
                used = "%s MiB" % proc["used_mib"] if proc["used_mib"] is not None else "MiB unknown"
                holders.append("PID %d (%s, %s): %s" % (proc["pid"], cmdline, used, reason))
            parts.append(head + ", held by " + "; ".join(holders))
        else:
            parts.append(
                head + ": no process holds it: driver state; see gpu_reset_smi_reset "
                "(nvidia-smi -r on that GPU) or reboot the host"
            )
    return "GPUs not free after %s s: %s" % (timeout_s, " | ".join(parts))


def held_without_process(states):
    """Indices of GPUs that are not free although no process runs on them."""
    return [s["index"] for s in states if not s["free"] and not s["processes"]]
