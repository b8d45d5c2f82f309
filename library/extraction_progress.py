#!/usr/bin/python
"""Ansible module extraction_progress: wait for an extraction (or regeneration) part, and tell finished from dead."""

from __future__ import absolute_import, division, print_function

DOCUMENTATION = r"""
---
module: extraction_progress
short_description: Wait for an extraction (or regeneration) part, printing its progress, and fail at once when its job died
description:
  - Reads the progress file C(<output_dir>/parts/part-K-of-N.progress.json) that
    C(eagle3-pipeline extract --part K/N) rewrites about once a second, and returns its counts
    and a one-line summary in C(msg), e.g. C(412/1000 samples, 3 skipped, 0 failed,
    5,210 tokens/s, about 0:03:12 left) after C(part 0/2).
  - With O(stage=regeneration) it follows C(eagle3-pipeline regenerate --part K/N) the same way,
    whose progress file counts conversations and the assistant turns answered
    (C(412/1000 conversations, 0 skipped, 0 failed, 655 turns, 5,210 tokens/s, ...)).
  - One call looks for up to O(wait_s) seconds and returns early when the part reaches a final
    state or its state changes (e.g. the job's first report); counters alone do not end it. Its
    action plugin calls it again until the part is done (O(follow)), printing C(msg) after each
    call, so one line per O(wait_s), in one task.
  - With O(state_dir) and O(name), reads the state file that this project's supervisor keeps
    for the job, C(<state_dir>/<name>.json), with its PID, start time and exit code. It fails at
    once, with the progress message and the last lines of O(log_file), when the job exited with
    a non-zero code, or when the recorded process no longer runs while the part is not done.
    A progress file written by another PID than the recorded job (a previous run's) is ignored.
  - Fails when the part reports C(failed) or C(stopped) (the job was asked to stop), naming the
    job's message, and when O(timeout_s) passes before the part is done (the job itself keeps
    running).
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
extends_documentation_fragment:
  - job_progress
  - polling
notes:
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
    timeout_s: 86400
  register: part

- name: One look at the part, without waiting
  extraction_progress:
    output_dir: /data/eagle3/kimi
    part_index: 0
    part_count: 2
    wait_s: 0
    follow: false
  register: look
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
  sample: "part 0/2: 412/1000 samples, 3 skipped, 0 failed, 5,210 tokens/s, about 0:03:12 left"
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
  description: Seconds the last call waited.
  returned: always
  type: float
waited_s:
  description: Seconds the task waited in all, up to the end of the last call.
  returned: always
  type: float
polls:
  description: The calls of the module that the action plugin made (each one SSH round trip).
  returned: always
  type: int
"""

from ansible.module_utils.basic import AnsibleModule
from ansible.module_utils.extraction_progress import PartStage
from ansible.module_utils.job_progress import argument_spec, run_module


def main():
    """Map options to the wait; the look it ends on to JSON, or to a failure naming the cause."""
    module = AnsibleModule(
        argument_spec=argument_spec(
            stage=dict(type="str", default="extraction", choices=["extraction", "regeneration"]),
            part_index=dict(type="int", default=0),
            part_count=dict(type="int", default=1),
        ),
        required_together=[("state_dir", "name")],
        supports_check_mode=True,
    )
    run_module(module, PartStage(module.params))


if __name__ == "__main__":
    main()
