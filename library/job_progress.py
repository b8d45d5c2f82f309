#!/usr/bin/python
"""Ansible module job_progress: wait for a stage's job (an extraction or regeneration part, a training), and tell finished from dead."""

from __future__ import absolute_import, division, print_function

DOCUMENTATION = r"""
---
module: job_progress
short_description: Wait for a stage's supervised job, printing its progress, and fail at once when it died
description:
  - Follows the job of one O(stage) through the progress file it rewrites about once a second, and
    returns its figures and a one-line summary in C(msg).
  - O(stage=extraction) follows C(eagle3-pipeline extract --part K/N) through
    C(<output_dir>/parts/part-K-of-N.progress.json) (C(412/1000 samples, 3 skipped, 0 failed,
    5,210 tokens/s, about 0:03:12 left) after C(part 0/2)); O(stage=regeneration) follows
    C(eagle3-pipeline regenerate --part K/N) the same way, counting conversations and the assistant
    turns answered (C(412/1000 conversations, 0 skipped, 0 failed, 655 turns, ...)).
  - O(stage=training) follows C(eagle3-pipeline train) (its rank 0) through C(<output_dir>/progress.json)
    (C(step 40/200, loss 3.21, acc 0.41/0.30/0.22…, accept len 1.9, 1,234 tok/s, about 0:02:10 left), with the epoch).
    On the other nodes of a multi-node run (O(node_rank) > 0) the job's exit code 0 means that node's
    share is done. After the progress says done, the training is done once its job has exited (its GPUs
    free for the next stage); until then C(msg) ends with C(waiting for the job to exit). A job that exits
    non-zero after its report, or on rank 0 still runs 120 s after it, is done with a warning naming it.
    Once done, the last C(train) and C(eval) records of C(<output_dir>/metrics.jsonl) are returned
    (read from the file's end only).
  - One call looks for up to O(wait_s) seconds and returns early when the job reaches a final state or
    its state changes (e.g. its first report); counters alone do not end it. Its action plugin calls it
    again until the job is done (O(follow)), printing C(msg) after each call, so one line per O(wait_s),
    in one task.
  - With O(state_dir) and O(name), reads the state file that this project's supervisor keeps for the
    job, C(<state_dir>/<name>.json), with its PID, start time and exit code. It fails at once, with the
    last progress and the last lines of O(log_file), when the job exited with a non-zero code, or when
    the recorded process no longer runs while the job is not done. A progress file of another job (a
    previous run's) is ignored.
  - Fails when the job reports C(failed) or C(stopped) (it was asked to stop), naming the job's message,
    and when O(timeout_s) passes before it is done (the job itself keeps running).
options:
  stage:
    description: The stage whose job this follows; it says where the progress file is, and names the job in messages.
    type: str
    choices: [extraction, regeneration, training]
    required: true
  output_dir:
    description: The job's output directory (its C(--output-dir)).
    type: path
    required: true
  part_index:
    description: K of the part K/N, 0-based (extraction and regeneration; default 0).
    type: int
  part_count:
    description: N of the part K/N, the number of parts (hosts) the dataset is split into (extraction and
      regeneration; default 1).
    type: int
  node_rank:
    description: This host's node rank (C(--node-rank)) in a multi-node training; 0 on a single node (training;
      default 0).
    type: int
  nnodes:
    description: The number of nodes (C(--nnodes)); above 1, messages name the node (training; default 1).
    type: int
extends_documentation_fragment:
  - job_progress
  - polling
notes:
  - The results C(samples_skipped) and C(samples_failed) are not called C(skipped) and C(failed),
    because Ansible reads those keys of a result as the task's own status.
  - The options of one stage given to another (O(node_rank) to an extraction, O(part_index) to a
    training) are refused, naming the stage they belong to.
author:
  - eagle3-pipeline developers
"""

EXAMPLES = r"""
- name: Wait for the extraction part of this host, printing its progress every 30 s
  job_progress:
    stage: extraction
    output_dir: /data/eagle3/kimi
    part_index: 0
    part_count: 2
    state_dir: /var/lib/eagle3-pipeline/jobs
    name: eagle3-extract-part-0-of-2
    wait_s: 30
    timeout_s: 86400
  register: part

- name: Wait for the training on this host
  job_progress:
    stage: training
    output_dir: /mnt/shared/eagle3/kimi-k2.5/drafter-run
    state_dir: /var/lib/eagle3-pipeline/jobs
    name: eagle3-train-drafter-run-3f2a9c01d4
    wait_s: 30
    timeout_s: 604800
  register: training

- name: Read a finished training's last figures (no job to follow, one look)
  job_progress:
    stage: training
    output_dir: /mnt/shared/eagle3/kimi-k2.5/drafter-run
    wait_s: 0
    follow: false
  register: finished
"""

RETURN = r"""
finished:
  description: >-
    Whether the job is done (it said so in its progress file; a training's job has also exited, and on a node of
    rank > 0 its job exited with 0).
  returned: always
  type: bool
state:
  description: >-
    V(starting) (no progress of this job yet), V(running), V(done), V(failed) or V(stopped) (the
    job said so), or V(dead) (the job ended without saying so).
  returned: always
  type: str
msg:
  description: The progress in one line.
  returned: always
  type: str
  sample: "part 0/2: 412/1000 samples, 3 skipped, 0 failed, 5,210 tokens/s, about 0:03:12 left"
tokens_per_s:
  description: >-
    The job's current rate (stored tokens, a regeneration's generated tokens, a training's tokens per second), or null.
  returned: always
  type: float
eta_s:
  description: The job's estimate of the seconds left, or null.
  returned: always
  type: float
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
part:
  description: The part, as K/N.
  returned: for extraction and regeneration
  type: str
  sample: 0/2
samples_total:
  description: Samples (dataset records) of this part; for a regeneration, its conversations.
  returned: for extraction and regeneration
  type: int
samples_done:
  description: Samples verified and stored, including those of earlier runs.
  returned: for extraction and regeneration
  type: int
samples_skipped:
  description: Records skipped (bad input, too long, ...).
  returned: for extraction and regeneration
  type: int
samples_failed:
  description: Samples that failed verification or the request after every retry.
  returned: for extraction and regeneration
  type: int
tokens:
  description: Tokens stored so far (a regeneration's, generated so far).
  returned: for extraction and regeneration
  type: int
turns:
  description: Assistant turns answered so far (regeneration only; 0 for an extraction).
  returned: for extraction and regeneration
  type: int
step:
  description: Optimizer steps done, including those of earlier runs it resumed from.
  returned: for training
  type: int
total_steps:
  description: Steps of the whole schedule (epochs x batches per epoch).
  returned: for training
  type: int
limit_steps:
  description: The step this run stops at (C(--max-steps) when lower than C(total_steps)), the denominator of C(msg).
  returned: for training
  type: int
epoch:
  description: The epoch the job reports, or null.
  returned: for training
  type: int
loss:
  description: The last training loss, or null.
  returned: for training
  type: float
acc_k:
  description: The last training top-1 agreement with the target at each draft position (TTT step).
  returned: for training
  type: list
  elements: float
acceptance_length:
  description: The simulated acceptance length from the last step's conditional accuracies, or null.
  returned: for training
  type: float
last_train:
  description: The last C(train) record of metrics.jsonl (loss, loss_k, acc_k, cond_acc_k, acceptance_length, ...) once done, else null.
  returned: for training
  type: dict
last_eval:
  description: The last C(eval) record of metrics.jsonl (held-out figures; none without eagle_training_eval_ratio) once done, else null.
  returned: for training
  type: dict
"""

from ansible.module_utils.basic import AnsibleModule
from ansible.module_utils.extraction_progress import PartStage
from ansible.module_utils.job_progress import argument_spec, run_module
from ansible.module_utils.training_progress import TrainingStage

# Each stage's own options (with their defaults) and what follows its job.
STAGES = {
    "extraction": (PartStage, dict(part_index=0, part_count=1)),
    "regeneration": (PartStage, dict(part_index=0, part_count=1)),
    "training": (TrainingStage, dict(node_rank=0, nnodes=1)),
}


def main():
    """Map options to the wait of the stage's job; the look it ends on to JSON, or to a failure naming the cause."""
    module = AnsibleModule(
        argument_spec=argument_spec(
            stage=dict(type="str", required=True, choices=sorted(STAGES)),
            part_index=dict(type="int"),
            part_count=dict(type="int"),
            node_rank=dict(type="int"),
            nnodes=dict(type="int"),
        ),
        required_together=[("state_dir", "name")],
        supports_check_mode=True,
    )
    stage_class, own = STAGES[module.params["stage"]]
    for option in ("part_index", "part_count", "node_rank", "nnodes"):
        if option not in own and module.params[option] is not None:
            module.fail_json(msg="%s is not an option of stage %s: it is one of %s" % (
                option, module.params["stage"],
                " and ".join(name for name, (_, theirs) in sorted(STAGES.items()) if option in theirs)))
    for option, default in own.items():
        if module.params[option] is None:
            module.params[option] = default
    run_module(module, stage_class(module.params))


if __name__ == "__main__":
    main()
