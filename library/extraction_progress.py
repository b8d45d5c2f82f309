#!/usr/bin/python
"""Ansible module extraction_progress: wait a while for an extraction (or regeneration) part, and tell finished from dead."""

from __future__ import absolute_import, division, print_function

DOCUMENTATION = r"""
---
module: extraction_progress
short_description: Wait for an extraction (or regeneration) part's progress, and fail at once when its job died
description:
  - Reads the progress file C(<output_dir>/parts/part-K-of-N.progress.json) that
    C(eagle3-pipeline extract --part K/N) rewrites about once a second, and returns its counts
    and a one-line summary in C(msg), e.g. C(412/1000 samples, 3 skipped, 0 failed, 5,210 tokens/s,
    about 0:03:12 left).
  - With O(stage=regeneration) it follows C(eagle3-pipeline regenerate --part K/N) the same way,
    whose progress file counts conversations and the assistant turns answered
    (C(412/1000 conversations, 0 skipped, 0 failed, 655 turns, 5,210 tokens/s, ...)).
  - Polls for up to O(wait_s) seconds and returns early when the part reaches a final state or
    its state changes (e.g. the job's first report). Counters alone do not end the wait, so a
    task retried with C(until) prints one line per O(wait_s).
  - With O(state_dir) and O(name), reads the state file that this project's supervisor keeps
    for the job, C(<state_dir>/<name>.json), with its PID, start time and exit code. It fails at
    once, with the progress message and the last lines of O(log_file), when the job exited with
    a non-zero code, or when the recorded process no longer runs while the part is not done.
    A progress file written by another PID than the recorded job (a previous run's) is ignored.
  - Fails when the part reports C(failed) or C(stopped) (the job was asked to stop), naming the
    job's message, and when O(deadline) passes before the part is done (the job itself keeps
    running).
  - Changes nothing.
options:
  output_dir:
    description: The extraction's (or regeneration's) output directory (the job's C(--output-dir)).
    type: path
    required: true
  stage:
    description: Which job writes the progress file; it names the job in messages.
    type: str
    choices: [extraction, regeneration]
    default: extraction
  part_index:
    description: K of the part K/N, 0-based.
    type: int
    default: 0
  part_count:
    description: N of the part K/N, the number of parts (hosts) the dataset is split into.
    type: int
    default: 1
  state_dir:
    description:
      - The supervisor's state directory (C(eagle3-pipeline supervise --state-dir)).
      - Without it only the progress file's own C(pid) is checked, with no exit code to report.
    type: path
  name:
    description: The supervised job's name (C(eagle3-pipeline supervise --name)); needed with O(state_dir).
    type: str
  log_file:
    description: The job's log, whose last lines go into failure messages; default C(<state_dir>/<name>.log).
    type: path
  log_lines:
    description: How many of the log's last lines a failure message shows.
    type: int
    default: 30
  wait_s:
    description: Longest wait, in seconds, before returning the current progress (0 returns at once).
    type: float
    default: 30
  poll_s:
    description: Seconds between reads of the progress file.
    type: float
    default: 0.5
  deadline:
    description:
      - Epoch seconds by which the part must be done; past it the module fails and says that the
        job keeps running. Unset, it waits without limit (bound the retries instead).
    type: float
notes:
  - Supports check mode; it only reads in either mode.
  - Its action plugin (action_plugins/extraction_progress.py) prints C(msg) on the controller
    after every call, so that each retry of an C(until) loop shows the progress without C(-v).
  - The results C(samples_skipped) and C(samples_failed) are not called C(skipped) and C(failed),
    because Ansible reads those keys of a result as the task's own status.
author:
  - eagle3-pipeline developers
"""

EXAMPLES = r"""
- name: Wait for the extraction part of this host, printing its progress every 30 s
  extraction_progress:
    output_dir: /data/eagle3/kimi
    part_index: 0
    part_count: 2
    state_dir: /var/lib/eagle3-pipeline/jobs
    name: eagle3-extract-part-0-of-2
    wait_s: 30
  register: part
  until: part.finished or part is failed
  retries: 2880
  delay: 0
"""

RETURN = r"""
finished:
  description: Whether the part is done (the job said so in its progress file).
  returned: always
  type: bool
state:
  description: >-
    V(starting) (no progress of this job yet), V(running), V(done), V(failed) or V(stopped) (the
    job said so), or V(dead) (the job ended without saying so).
  returned: always
  type: str
part:
  description: The part, as K/N.
  returned: always
  type: str
  sample: 0/2
turns:
  description: Assistant turns answered so far (regeneration only; 0 for an extraction).
  returned: always
  type: int
samples_total:
  description: Samples (dataset records) of this part; for a regeneration, its conversations.
  returned: always
  type: int
samples_done:
  description: Samples verified and stored, including those of earlier runs.
  returned: always
  type: int
samples_skipped:
  description: Records skipped (bad input, too long, ...).
  returned: always
  type: int
samples_failed:
  description: Samples that failed verification or the request after every retry.
  returned: always
  type: int
tokens:
  description: Tokens stored so far (a regeneration's, generated so far).
  returned: always
  type: int
tokens_per_s:
  description: The job's current rate (stored tokens, or a regeneration's generated tokens, per second), or null.
  returned: always
  type: float
eta_s:
  description: The job's estimate of the seconds left, or null.
  returned: always
  type: float
msg:
  description: The progress in one line.
  returned: always
  type: str
  sample: 412/1000 samples, 3 skipped, 0 failed, 5,210 tokens/s, about 0:03:12 left
progress:
  description: This job's progress file as read, or null before its first report.
  returned: always
  type: dict
progress_file:
  description: The progress file's path.
  returned: always
  type: str
job:
  description: The supervisor's record of the job (PID, process group, exit code, log file), or null.
  returned: always
  type: dict
seconds:
  description: Seconds this call waited.
  returned: always
  type: float
"""

import os
import time

from ansible.module_utils.basic import AnsibleModule
from ansible.module_utils.extraction_progress import (
    ProgressError,
    dead_message,
    failed_message,
    progress_line,
    progress_path,
    read_status,
    wait_for_change,
)

JOB_KEYS = ("name", "pid", "pgid", "supervisor_pid", "exit_code", "started_at", "ended_at", "log_file")


def _number(progress, key):
    value = (progress or {}).get(key)
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def main():
    """Map options to the wait; the look it ends on to JSON, or to a failure naming the cause."""
    module = AnsibleModule(
        argument_spec=dict(
            output_dir=dict(type="path", required=True),
            stage=dict(type="str", default="extraction", choices=["extraction", "regeneration"]),
            part_index=dict(type="int", default=0),
            part_count=dict(type="int", default=1),
            state_dir=dict(type="path"),
            name=dict(type="str"),
            log_file=dict(type="path"),
            log_lines=dict(type="int", default=30),
            wait_s=dict(type="float", default=30.0),
            poll_s=dict(type="float", default=0.5),
            deadline=dict(type="float"),
        ),
        required_together=[("state_dir", "name")],
        supports_check_mode=True,
    )
    p = module.params
    if p["part_count"] < 1:
        module.fail_json(msg="part_count must be >= 1, got %d" % p["part_count"])
    if not 0 <= p["part_index"] < p["part_count"]:
        module.fail_json(msg="part_index must be in 0..%d (part_count - 1), got %d" % (p["part_count"] - 1, p["part_index"]))
    if not 0 <= p["wait_s"] <= 3600:
        module.fail_json(msg="wait_s must be between 0 and 3600 seconds, got %s" % p["wait_s"])
    if not 0 < p["poll_s"] <= 60:
        module.fail_json(msg="poll_s must be > 0 and <= 60 seconds, got %s" % p["poll_s"])
    if not 1 <= p["log_lines"] <= 1000:
        module.fail_json(msg="log_lines must be between 1 and 1000, got %d" % p["log_lines"])

    label = "%d/%d" % (p["part_index"], p["part_count"])
    progress_file = progress_path(p["output_dir"], p["part_index"], p["part_count"])
    job_file = os.path.join(p["state_dir"], p["name"] + ".json") if p["state_dir"] else None
    log_file = p["log_file"] or (os.path.join(p["state_dir"], p["name"] + ".log") if p["state_dir"] else None)
    result = dict(changed=False, finished=False, state="starting", part=label, progress_file=progress_file)
    try:
        (_progress, job, state, mine), seconds = wait_for_change(
            lambda: read_status(progress_file, job_file, p["stage"]), p["wait_s"], p["poll_s"], p["deadline"]
        )
    except ProgressError as exc:
        module.fail_json(msg="part %s: %s" % (label, exc), **result)
    result.update(
        finished=state == "done",
        state=state,
        samples_total=_number(mine, "total") or 0,
        samples_done=_number(mine, "done") or 0,
        samples_skipped=_number(mine, "skipped") or 0,
        samples_failed=_number(mine, "failed") or 0,
        tokens=_number(mine, "tokens") or 0,
        turns=_number(mine, "turns") or 0,
        tokens_per_s=_number(mine, "tokens_per_s"),
        eta_s=_number(mine, "eta_s"),
        msg="part %s: %s" % (label, progress_line(mine)),
        progress=mine,
        job=dict((key, job.get(key)) for key in JOB_KEYS) if job else None,
        seconds=seconds,
    )
    if state in ("failed", "stopped"):
        module.fail_json(**dict(result, msg=failed_message(label, mine, p["name"], log_file, p["log_lines"],
                                                           p["stage"])))
    if state == "dead":
        module.fail_json(**dict(result, msg=dead_message(label, mine, job, p["name"], log_file, p["log_lines"],
                                                         p["stage"])))
    if state != "done" and p["deadline"] is not None and time.time() >= p["deadline"]:
        running = " (PID %s)" % job.get("pid") if job else ""
        module.fail_json(
            **dict(
                result,
                msg="part %s was not done by the deadline; the job%s keeps running, at %s. Run the playbook again "
                "to go on waiting (it attaches to the running job), or raise the timeout (%s_timeout_s)"
                % (label, running, progress_line(mine), p["stage"]),
            )
        )
    module.exit_json(**result)


if __name__ == "__main__":
    main()
