#!/usr/bin/python
"""Ansible module training_progress: wait for a training job, and tell finished from dead."""

from __future__ import absolute_import, division, print_function

DOCUMENTATION = r"""
---
module: training_progress
short_description: Wait for a drafter training, printing its progress, and fail at once when its job died
description:
  - Reads the progress file C(<output_dir>/progress.json) that C(eagle3-pipeline train) (its rank 0)
    rewrites while it trains, and returns its figures and a one-line summary in C(msg), e.g.
    C(step 40/200 (epoch 1), loss 3.21, acc 0.41/0.30/0.22…, accept len 1.9, 1,234 tok/s, about 0:02:10 left).
  - One call looks for up to O(wait_s) seconds and returns early when the training reaches a final
    state or its state changes (e.g. the job's first report); steps alone do not end it. Its action
    plugin calls it again until the training is done (O(follow)), printing C(msg) after each call,
    so one line per O(wait_s), in one task.
  - With O(state_dir) and O(name), reads the state file that this project's supervisor keeps for the
    job, C(<state_dir>/<name>.json), with its PID, start time and exit code. It fails at once, with
    the last progress and the last lines of O(log_file), when the job exited with a non-zero code,
    or when the recorded process no longer runs while the training is not done. A progress file
    last updated before the job started (a previous run's) is ignored.
  - On the other nodes of a multi-node run (O(node_rank) > 0), the job's exit code 0 means that
    node's share is done; rank 0, on the first node, writes the progress into the shared output directory.
  - After the progress says done, the training is done once its job has exited (its GPUs free for the
    next stage); until then C(msg) ends with C(waiting for the job to exit). A job that exits non-zero
    after its report, or on rank 0 still runs 120 s after it, is done with a warning naming it.
  - Fails when the training reports C(failed) or C(stopped) (the job was asked to stop), naming the
    job's message, and when O(timeout_s) passes before it is done (the job itself keeps running).
  - When the training is done, returns the last C(train) and C(eval) records of
    C(<output_dir>/metrics.jsonl) (read from the file's end only).
options:
  output_dir:
    description: The training's output directory (the job's C(--output-dir)).
    type: path
    required: true
  node_rank:
    description: This host's node rank (C(--node-rank)) in a multi-node training; 0 on a single node.
    type: int
    default: 0
  nnodes:
    description: The number of nodes (C(--nnodes)); above 1, messages name the node.
    type: int
    default: 1
extends_documentation_fragment:
  - job_progress
  - polling
author:
  - eagle3-pipeline developers
"""

EXAMPLES = r"""
- name: Wait for the training on this host, printing its progress every 30 s
  training_progress:
    output_dir: /mnt/shared/eagle3/kimi-k2.5/drafter-run
    state_dir: /var/lib/eagle3-pipeline/jobs
    name: eagle3-train-drafter-run-3f2a9c01d4
    wait_s: 30
    timeout_s: 604800
  register: training

- name: Read a finished training's last figures (no job to follow, one look)
  training_progress:
    output_dir: /mnt/shared/eagle3/kimi-k2.5/drafter-run
    wait_s: 0
    follow: false
  register: finished
"""

RETURN = r"""
finished:
  description: >-
    Whether the training is done (the job said so in its progress file, and has exited; on a node of rank > 0,
    its job exited with 0).
  returned: always
  type: bool
state:
  description: >-
    V(starting) (no progress of this job yet), V(running), V(done), V(failed) or V(stopped) (the
    job said so), or V(dead) (the job ended without saying so).
  returned: always
  type: str
step:
  description: Optimizer steps done, including those of earlier runs it resumed from.
  returned: always
  type: int
total_steps:
  description: Steps of the whole schedule (epochs x batches per epoch).
  returned: always
  type: int
limit_steps:
  description: The step this run stops at (C(--max-steps) when lower than C(total_steps)), the denominator of C(msg).
  returned: always
  type: int
epoch:
  description: The epoch the job reports, or null.
  returned: always
  type: int
loss:
  description: The last training loss, or null.
  returned: always
  type: float
acc_k:
  description: The last training top-1 agreement with the target at each draft position (TTT step).
  returned: always
  type: list
  elements: float
acceptance_length:
  description: The simulated acceptance length from the last step's conditional accuracies, or null.
  returned: always
  type: float
tokens_per_s:
  description: The job's current rate, or null.
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
  sample: step 40/200 (epoch 1), loss 3.21, acc 0.41/0.30/0.22…, accept len 1.9, 1,234 tok/s, about 0:02:10 left
progress:
  description: This job's progress file as read, or null before its first report.
  returned: always
  type: dict
progress_file:
  description: The progress file's path.
  returned: always
  type: str
last_train:
  description: The last C(train) record of metrics.jsonl (loss, loss_k, acc_k, cond_acc_k, acceptance_length, ...) once done, else null.
  returned: always
  type: dict
last_eval:
  description: The last C(eval) record of metrics.jsonl (held-out figures; none without eagle_training_eval_ratio) once done, else null.
  returned: always
  type: dict
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
from ansible.module_utils.job_progress import argument_spec, run_module
from ansible.module_utils.training_progress import TrainingStage


def main():
    """Map options to the wait; the look it ends on to JSON, or to a failure naming the cause."""
    module = AnsibleModule(
        argument_spec=argument_spec(
            node_rank=dict(type="int", default=0),
            nnodes=dict(type="int", default=1),
        ),
        required_together=[("state_dir", "name")],
        supports_check_mode=True,
    )
    run_module(module, TrainingStage(module.params))


if __name__ == "__main__":
    main()
