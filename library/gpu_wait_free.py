#!/usr/bin/python
"""Ansible module gpu_wait_free: poll NVML until the selected GPUs hold no memory."""

from __future__ import absolute_import, division, print_function

DOCUMENTATION = r"""
---
module: gpu_wait_free
short_description: Wait, by polling NVML, until GPUs hold no memory and run no process
description:
  - Polls every O(poll_s) seconds until every selected GPU has at most O(max_used_mib) MiB
    used (NVML's v2 memory call, which leaves out the driver's own reservation) and no
    compute process, or O(timeout_s) passes.
  - On timeout the message names each GPU still held, the MiB it holds and each holder (PID,
    command line, and why it was left, e.g. protected, not matched, part of this run), or says
    that no process holds it (driver state; see the gpu_reset role's gpu_reset_smi_reset).
  - With O(spare_pipeline_jobs) (the default) a GPU whose processes all belong to the pipeline's
    own running jobs (the extraction, regeneration or training under the project's supervisor, or
    the server on this host such a job uses; see the gpu_processes module) is not waited on. It is
    reported in RV(held_by_pipeline_jobs), its stage waits on the job, and it does not fail.
  - Never changes anything.
options:
  gpus:
    description: V(all), or a list of GPU indices.
    type: raw
    default: all
  max_used_mib:
    description: Used MiB (v2) at or below which a GPU counts as free.
    type: int
    default: 0
  timeout_s:
    description: Seconds to wait before failing.
    type: float
    default: 60
  poll_s:
    description: Seconds between polls.
    type: float
    default: 0.1
  match:
    description: The match patterns the stop step used; only used to explain why a holder was left.
    type: list
    elements: str
    default: []
  protect:
    description: The protect patterns the stop step used; only used to explain why a holder was left.
    type: list
    elements: str
    default: []
  spare_pipeline_jobs:
    description: Do not wait on GPUs held only by the pipeline's running jobs (and the servers they use); V(false) waits on them too.
    type: bool
    default: true
  pipeline_state_dirs:
    description: Supervisor state directories whose state files also tell running jobs (as for gpu_processes).
    type: list
    elements: path
    default: []
  pipeline_output_dirs:
    description: This run's output directories; a job writing elsewhere is reported as another run's (as for gpu_processes).
    type: list
    elements: path
    default: []
notes:
  - Supports check mode; it changes nothing in either mode.
requirements:
  - nvidia-ml-py and an NVIDIA driver on the managed host.
author:
  - eagle3-pipeline developers
"""

EXAMPLES = r"""
- name: Wait up to two minutes for all GPUs to be free
  gpu_wait_free:
    timeout_s: 120
"""

RETURN = r"""
gpus:
  description:
    - The last poll, one entry per GPU.
    - With O(spare_pipeline_jobs), C(pipeline_jobs) names the pipeline's running jobs among its processes and
      C(held_by_pipeline_jobs) says whether they alone hold it.
  returned: always
  type: list
  elements: dict
  sample: [{index: 0, memory_used_mib: 0, memory_reserved_mib: 615, processes: [], free: true, pipeline_jobs: [],
            held_by_pipeline_jobs: false}]
seconds:
  description: Seconds spent waiting.
  returned: always
  type: float
polls:
  description: Number of polls made.
  returned: always
  type: int
freed_at:
  description: Epoch seconds when every GPU was seen free (or held only by the pipeline's running jobs).
  returned: on success
  type: float
held_by_pipeline_jobs:
  description: The GPUs held only by the pipeline's running jobs (not waited on), with the MiB used and the jobs.
  returned: always
  type: list
  elements: dict
  sample: [{index: 0, memory_used_mib: 9120, jobs: ["training eagle3-train-run-0123456789 (pid 5120)"]}]
held_without_process:
  description: Indices of GPUs still holding memory with no process on them (driver state).
  returned: always
  type: list
  elements: int
"""

import os
import time

from ansible.module_utils.basic import AnsibleModule
from ansible.module_utils.gpu_free import held_by_pipeline_jobs, held_message, held_without_process, wait_free
from ansible.module_utils.gpu_holders import ancestors, compile_patterns, read_proc, snapshot, why_not_selectable
from ansible.module_utils.gpu_nvml import (
    NVML_FAILURE_REMEDY,
    NvmlUnavailable,
    device_count,
    handles,
    load_nvml,
    select_indices,
)
from ansible.module_utils.pipeline_jobs import find_jobs, spared_labels, spared_reasons

# A process NVML shows that no job was known to have (a worker just started) makes the jobs be
# looked for again, at most this often.
JOBS_REFRESH_S = 1.0


class JobView(object):
    """The pipeline's running jobs as seen now, looked for again when NVML shows a PID not known."""

    def __init__(self, state_dirs, output_dirs, clock=time.monotonic):
        self.state_dirs = state_dirs
        self.output_dirs = output_dirs
        self.clock = clock
        self.refreshed_at = None
        self.refresh()

    def refresh(self):
        self.procs = snapshot()
        self.shielded = ancestors(os.getpid(), self.procs)
        self.jobs = find_jobs(self.procs, self.shielded, self.state_dirs, self.output_dirs)
        self.labels = spared_labels(self.jobs)
        self.reasons = spared_reasons(self.jobs)
        self.refreshed_at = self.clock()

    def label(self, pid):
        """The label of the job a PID belongs to, or None."""
        if pid not in self.labels and pid not in self.procs and self.clock() - self.refreshed_at >= JOBS_REFRESH_S:
            self.refresh()
        return self.labels.get(pid)


def main():
    """Map options to the wait; results and the failure message to JSON."""
    module = AnsibleModule(
        argument_spec=dict(
            gpus=dict(type="raw", default="all"),
            max_used_mib=dict(type="int", default=0),
            timeout_s=dict(type="float", default=60.0),
            poll_s=dict(type="float", default=0.1),
            match=dict(type="list", elements="str", default=[]),
            protect=dict(type="list", elements="str", default=[]),
            spare_pipeline_jobs=dict(type="bool", default=True),
            pipeline_state_dirs=dict(type="list", elements="path", default=[]),
            pipeline_output_dirs=dict(type="list", elements="path", default=[]),
        ),
        supports_check_mode=True,
    )
    p = module.params
    if p["max_used_mib"] < 0:
        module.fail_json(msg="max_used_mib must be >= 0, got %d" % p["max_used_mib"])
    if p["timeout_s"] < 0:
        module.fail_json(msg="timeout_s must be >= 0 seconds, got %s" % p["timeout_s"])
    if p["poll_s"] <= 0:
        module.fail_json(msg="poll_s must be > 0 seconds, got %s" % p["poll_s"])
    try:
        match = compile_patterns(p["match"], "match")
        protect = compile_patterns(p["protect"], "protect")
    except ValueError as exc:
        module.fail_json(msg=str(exc))
    try:
        nvml = load_nvml()
    except NvmlUnavailable as exc:
        module.fail_json(msg="cannot verify that GPUs are free: %s" % exc)
    jobs = JobView(p["pipeline_state_dirs"], p["pipeline_output_dirs"]) if p["spare_pipeline_jobs"] else None
    try:
        try:
            indices = select_indices(p["gpus"], device_count(nvml))
        except ValueError as exc:
            module.fail_json(msg=str(exc))
        ok, states, seconds, polls = wait_free(
            nvml, indices, handles(nvml, indices), p["max_used_mib"], p["timeout_s"], p["poll_s"],
            spared=jobs.label if jobs else None,
        )
    except nvml.NVMLError as exc:
        module.fail_json(
            msg="NVML query failed while waiting for the GPUs to be free (gpus=%s): %s; %s" % (p["gpus"], exc, NVML_FAILURE_REMEDY)
        )
    finally:
        nvml.nvmlShutdown()
    result = dict(
        changed=False,
        gpus=states,
        seconds=seconds,
        polls=polls,
        held_without_process=held_without_process(states),
        held_by_pipeline_jobs=held_by_pipeline_jobs(states),
    )
    if ok:
        module.exit_json(freed_at=time.time(), **result)

    procs = snapshot()
    shielded = ancestors(os.getpid(), procs)
    spared = jobs.reasons if jobs else None

    def explain(pid):
        proc = procs.get(pid) or read_proc(pid)
        if proc is None:
            return "command line unknown", "not visible from this host's /proc (another PID namespace?)"
        reason = why_not_selectable(proc, match, protect, shielded, spared)
        return proc.display, reason or "selectable, but still running: it was not stopped before this check"

    module.fail_json(msg=held_message(states, p["max_used_mib"], p["timeout_s"], explain), **result)


if __name__ == "__main__":
    main()
