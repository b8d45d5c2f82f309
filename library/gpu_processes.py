#!/usr/bin/python
"""Ansible module gpu_processes: find the processes holding GPUs and stop the allowed ones."""

from __future__ import absolute_import, division, print_function

DOCUMENTATION = r"""
---
module: gpu_processes
short_description: Find the processes that hold GPUs and stop only those it may stop
description:
  - Finds GPU holders in NVML's process lists and among the processes that have one of
    O(device_paths) open or mapped (what C(fuser -v /dev/nvidia*) shows, read from /proc).
  - Selects the holders whose command line matches O(match) (all holders when empty), never
    those matching O(protect), never PID 1, kernel threads, or the module's own ancestors
    (the Ansible run, its SSH session, whatever started it).
  - With O(state=absent) it stops the selected ones with SIGTERM, polls every 50 ms up to
    O(grace_s), then sends SIGKILL and waits for them to exit (a zombie counts as exited; its
    parent is named). A process group is signalled as a whole only when every member of it
    may be stopped, which catches children that outlive a kill of their parent; otherwise
    each selected process is signalled alone.
  - With O(state=present) it only reports. In check mode it signals nothing and reports what
    it would stop.
  - With O(spare_pipeline_jobs) (the default) the pipeline's own running jobs, the extraction,
    the regeneration and the training started under this project's supervisor
    (C(eagle3_pipeline.cli supervise ... start -- ... eagle3_pipeline.cli extract|regenerate|train)),
    are never signalled, whatever O(match) says, and neither is the server on this host that such
    a job talks to (its C(--server-url)). A job's processes are its supervisor, the job, every
    descendant of it (torchrun and its workers) and the rest of the supervisor's session. They are
    reported in RV(pipeline_jobs), and each one holding a GPU is in RV(left) with the job it
    belongs to. Other servers stay stoppable.
options:
  state:
    description: V(present) reports holders; V(absent) stops the selected ones.
    type: str
    choices: [present, absent]
    default: present
  gpus:
    description: V(all), or a list of GPU indices whose holders are wanted.
    type: raw
    default: all
  device_paths:
    description:
      - Device files (glob patterns) whose holders count as GPU holders.
      - Empty means the NVIDIA device files of the selected GPUs (/dev/nvidia<minor>, plus
        /dev/nvidiactl and /dev/nvidia-uvm* when all GPUs are selected).
    type: list
    elements: str
    default: []
  match:
    description: Regular expressions searched in command lines; only matching holders are stopped. Empty means any holder.
    type: list
    elements: str
    default: []
  protect:
    description: Regular expressions searched in command lines; matching processes are never signalled.
    type: list
    elements: str
    default: []
  grace_s:
    description: Seconds between SIGTERM and SIGKILL.
    type: float
    default: 10
  kill_wait_s:
    description: Seconds to wait for processes to exit after SIGKILL before failing.
    type: float
    default: 10
  use_nvml:
    description: Also take holders from NVML's process lists (V(auto) uses NVML when it loads).
    type: str
    choices: [auto, always, never]
    default: auto
  spare_pipeline_jobs:
    description:
      - Never signal the pipeline's own running jobs (extraction, regeneration, training under the
        project's supervisor) nor the server on this host each one uses; a rerun's stage waits on them.
      - V(false) treats them as any other holder.
    type: bool
    default: true
  pipeline_state_dirs:
    description:
      - Supervisor state directories whose state files also tell running jobs (a job whose supervisor
        process is gone but whose recorded PID still runs, which its stage would wait on).
      - Jobs with a live supervisor are found from /proc whatever their state directory.
    type: list
    elements: path
    default: []
  pipeline_output_dirs:
    description:
      - This run's output directories. A job writing elsewhere is reported as another run's job
        (spared too). Empty means this is not known and no job is called another run's.
    type: list
    elements: path
    default: []
notes:
  - Supports check mode.
  - Run as root (become) to see and stop other users' processes; otherwise the result
    counts the processes whose files could not be read in RV(unreadable_pids).
author:
  - eagle3-pipeline developers
"""

EXAMPLES = r"""
- name: Stop SGLang servers holding any GPU, leaving monitoring daemons alone
  gpu_processes:
    state: absent
    match: ['sglang']
    protect: ['nvidia-persistenced', 'nv-hostengine', 'dcgm']
    grace_s: 15

- name: Only list what holds GPU 3
  gpu_processes:
    gpus: [3]
  register: holders
"""

RETURN = r"""
holders:
  description: Every process holding a selected GPU or device file.
  returned: always
  type: list
  elements: dict
  sample: [{pid: 4242, pgid: 4240, sid: 4240, cmdline: "python -m sglang.launch_server", gpus: [0], devices: ["/dev/nvidia0"], used_mib: 70000}]
left:
  description:
    - Holders that were not stopped, each with its reason (protected, not matched, part of this run,
      a process of this pipeline's running job or of the server it uses).
    - A process of a running job also has C(pipeline_job), the job's name.
  returned: always
  type: list
  elements: dict
  sample: [{pid: 5120, cmdline: "python -m eagle3_pipeline.cli train ...", gpus: [0], pipeline_job: eagle3-train-run-0123456789,
            reason: "this pipeline's running training eagle3-train-run-0123456789 (pid 5120): its stage waits on it (gpu_reset_spare_pipeline_jobs)"}]
pipeline_jobs:
  description:
    - The pipeline's running jobs found (empty with O(spare_pipeline_jobs=false)), each with its name,
      kind (extraction, regeneration, training), job PID, supervisor PID, output directory, whether it
      is this run's (C(this_run), null when O(pipeline_output_dirs) is empty), the PIDs of its processes
      and of the server it uses, the GPUs and device files they hold, and the reason it is spared.
  returned: always
  type: list
  elements: dict
  sample: [{name: eagle3-train-run-0123456789, kind: training, pid: 5120, supervisor_pid: 5119, found_by: supervisor,
            output_dir: /data/run, this_run: true, pids: [5119, 5120], server_pids: [], holder_pids: [5120], gpus: [0],
            devices: ["/dev/nvidia0"]}]
units:
  description: What was (or would be) signalled, a process group as a whole or a single process.
  returned: always
  type: list
  elements: dict
  sample: [{kind: group, id: 4240, pids: [4240, 4242, 4243]}]
stopped:
  description: Processes that exited, with the signal that ended them (null when one exited before any signal) and seconds from the first signal.
  returned: always
  type: list
  elements: dict
  sample: [{pid: 4242, pgid: 4240, cmdline: "python -m sglang.launch_server", unit: "group 4240", signal: SIGTERM, seconds: 0.41, gpus: [0]}]
would_stop:
  description: In check mode, the processes that would be signalled.
  returned: in check mode
  type: list
  elements: dict
first_signal_at:
  description: Epoch seconds of the first signal sent (null when nothing was signalled).
  returned: always
  type: float
seconds:
  description: Seconds from the first signal until every stopped process had exited.
  returned: always
  type: float
nvml_available:
  description: Whether NVML's process lists were used.
  returned: always
  type: bool
device_paths:
  description: The device files whose holders were looked for.
  returned: always
  type: list
  elements: str
unreadable_pids:
  description: Number of processes whose open files could not be read (not running as root).
  returned: always
  type: int
"""

import os

from ansible.module_utils.basic import AnsibleModule
from ansible.module_utils.gpu_holders import (
    ancestors,
    compile_patterns,
    default_device_patterns,
    device_holders,
    expand_device_paths,
    find_holders,
    plan_stop,
    snapshot,
)
from ansible.module_utils.gpu_nvml import (
    NVML_FAILURE_REMEDY,
    NvmlUnavailable,
    device_count,
    handles,
    load_nvml,
    minor_number,
    running_processes,
    select_indices,
)
from ansible.module_utils.pipeline_jobs import find_jobs, spared_reasons
from ansible.module_utils.proc_stop import stop_units, survivor_message


def nvml_view(requested, use_nvml):
    """(available, {gpu index: [process dicts]}, minor numbers or None, reason).

    Raises ValueError, with the message to show, for unknown GPUs or a failed NVML query.
    """
    if use_nvml == "never":
        return False, {}, None, "use_nvml=never"
    try:
        nvml = load_nvml()
    except NvmlUnavailable as exc:
        if use_nvml == "always":
            raise
        return False, {}, None, str(exc)
    try:
        count = device_count(nvml)
        indices = select_indices(requested, count)
        per_gpu = {}
        minors = []
        for index, handle in zip(indices, handles(nvml, indices)):
            per_gpu[index] = running_processes(nvml, handle)
            minors.append(minor_number(nvml, handle))
        all_selected = len(indices) == count
        return True, per_gpu, None if all_selected or None in minors else minors, None
    except nvml.NVMLError as exc:
        raise ValueError(
            "NVML query failed while listing the GPUs' processes (gpus=%s): %s; %s; or set use_nvml: never "
            "to find holders from device_paths only" % (requested, exc, NVML_FAILURE_REMEDY)
        ) from exc
    finally:
        nvml.nvmlShutdown()


def main():
    """Map options to discovery, selection and stopping; results to JSON."""
    module = AnsibleModule(
        argument_spec=dict(
            state=dict(type="str", choices=["present", "absent"], default="present"),
            gpus=dict(type="raw", default="all"),
            device_paths=dict(type="list", elements="str", default=[]),
            match=dict(type="list", elements="str", default=[]),
            protect=dict(type="list", elements="str", default=[]),
            grace_s=dict(type="float", default=10.0),
            kill_wait_s=dict(type="float", default=10.0),
            use_nvml=dict(type="str", choices=["auto", "always", "never"], default="auto"),
            spare_pipeline_jobs=dict(type="bool", default=True),
            pipeline_state_dirs=dict(type="list", elements="path", default=[]),
            pipeline_output_dirs=dict(type="list", elements="path", default=[]),
        ),
        supports_check_mode=True,
    )
    p = module.params
    for name in ("grace_s", "kill_wait_s"):
        if p[name] < 0:
            module.fail_json(msg="%s must be >= 0 seconds, got %s" % (name, p[name]))
    try:
        match = compile_patterns(p["match"], "match")
        protect = compile_patterns(p["protect"], "protect")
    except ValueError as exc:
        module.fail_json(msg=str(exc))
    try:
        nvml_available, per_gpu, minors, _reason = nvml_view(p["gpus"], p["use_nvml"])
    except NvmlUnavailable as exc:
        module.fail_json(msg="use_nvml=always but NVML is unavailable: %s" % exc)
    except ValueError as exc:
        module.fail_json(msg=str(exc))
    if not nvml_available and p["gpus"] not in ("all", None) and not p["device_paths"]:
        module.fail_json(
            msg="gpus=%s needs NVML to map GPU indices to device files, and NVML is unavailable; "
            "select gpus: all or give device_paths" % (p["gpus"],)
        )

    patterns = p["device_paths"] or default_device_patterns(minors)
    paths = expand_device_paths(patterns)
    procs = snapshot()
    hits, unreadable = device_holders(paths)
    holders = find_holders(procs, per_gpu, hits)
    shielded = ancestors(os.getpid(), procs)
    jobs = []
    if p["spare_pipeline_jobs"]:
        jobs = find_jobs(procs, shielded, p["pipeline_state_dirs"], p["pipeline_output_dirs"])
    spared = spared_reasons(jobs)
    units, left = plan_stop(holders, procs, match, protect, shielded, spared)
    job_of = dict((pid, job.name) for job in jobs for pid in job.pids | job.server_pids)
    for record in left:
        if record["pid"] in job_of:
            record["pipeline_job"] = job_of[record["pid"]]

    def annotate(record):
        holder = holders.get(record["pid"])
        record["gpus"] = sorted(holder.gpus) if holder else []
        record["holder"] = holder is not None
        return record

    result = dict(
        changed=False,
        holders=[holders[pid].as_dict() for pid in sorted(holders)],
        left=left,
        pipeline_jobs=[job.as_dict(holders) for job in jobs],
        units=[u.as_dict() for u in units],
        stopped=[],
        first_signal_at=None,
        seconds=0.0,
        nvml_available=nvml_available,
        device_paths=paths,
        unreadable_pids=len(unreadable),
    )
    if p["state"] == "present" or not units:
        module.exit_json(**result)
    if module.check_mode:
        result["would_stop"] = [
            annotate({"pid": m.pid, "pgid": m.pgid, "cmdline": m.display, "unit": "%s %d" % (u.kind, u.ident)})
            for u in units
            for m in u.members
        ]
        result["changed"] = True
        module.exit_json(**result)

    report = stop_units(units, grace_s=p["grace_s"], kill_wait_s=p["kill_wait_s"])
    result.update(
        # Nothing was signalled when every selected process exited on its own meanwhile.
        changed=report["first_signal_at"] is not None,
        stopped=[annotate(r) for r in report["stopped"]],
        first_signal_at=report["first_signal_at"],
        seconds=report["seconds"],
    )
    if report["survivors"]:
        result["survivors"] = [annotate(r) for r in report["survivors"]]
        module.fail_json(msg=survivor_message(report["survivors"], p["kill_wait_s"]), **result)
    module.exit_json(**result)


if __name__ == "__main__":
    main()
