"""Wait until GPUs are free, by NVML's v2 used memory and its process lists, polling.

A GPU is free when its used memory (v2: without the driver's own reservation) is at most
``max_used_mib`` and no compute process runs on it. When the wait times out, the message
names each GPU still held, the MiB it holds, and each holder with the reason it was left,
or says that no process holds it (driver state; a GPU reset is the remedy).

A GPU whose processes all belong to the pipeline's own running jobs (``spared``, see
pipeline_jobs) is not waited on: its memory is the job's, which its stage waits on. It is
reported as held by that job (``pipeline_jobs``) and does not fail the wait.
"""

from __future__ import absolute_import, division, print_function

import time

from ansible.module_utils.gpu_nvml import memory_mib, running_processes


def gpu_state(nvml, index, handle, max_used_mib, spared=None):
    """One poll of one GPU: dict with index, used/reserved MiB, compute processes, free.

    With ``spared`` (pid -> the label of the pipeline's running job it belongs to, or None) the
    state also has ``pipeline_jobs``: the labels of the jobs among its processes, sorted; a GPU
    not free whose processes all belong to such jobs is held by them, not waited on.
    """
    _total, used, reserved = memory_mib(nvml, handle)
    procs = running_processes(nvml, handle)
    state = {
        "index": index,
        "memory_used_mib": used,
        "memory_reserved_mib": reserved,
        "processes": procs,
        "free": used <= max_used_mib and not procs,
    }
    if spared is not None:
        labels = [spared(proc["pid"]) for proc in procs]
        state["pipeline_jobs"] = sorted(set(label for label in labels if label))
        state["held_by_pipeline_jobs"] = not state["free"] and bool(procs) and all(labels)
    return state


def settled(state):
    """Free, or held only by the pipeline's running jobs."""
    return state["free"] or state.get("held_by_pipeline_jobs", False)


def wait_free(nvml, indices, handles, max_used_mib, timeout_s, poll_s=0.1, clock=time.monotonic, spared=None):
    """Poll until every GPU is free (or held only by spared jobs) or ``timeout_s`` passes.

    Returns (ok, states, seconds, polls).
    """
    start = clock()
    polls = 0
    while True:
        polls += 1
        states = [gpu_state(nvml, i, h, max_used_mib, spared) for i, h in zip(indices, handles)]
        elapsed = clock() - start
        if all(settled(s) for s in states):
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
        if settled(state):
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


def held_by_pipeline_jobs(states):
    """[{index, memory_used_mib, jobs}] of the GPUs held only by the pipeline's running jobs."""
    return [
        {"index": s["index"], "memory_used_mib": s["memory_used_mib"], "jobs": s["pipeline_jobs"]}
        for s in states
        if s.get("held_by_pipeline_jobs")
    ]
