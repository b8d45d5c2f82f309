#!/usr/bin/python
"""Ansible module training_progress: wait a while for a training job, and tell finished from dead."""

from __future__ import absolute_import, division, print_function

DOCUMENTATION = r"""
---
module: training_progress
short_description: Wait for a drafter training's progress, and fail at once when its job died
description:
  - Reads the progress file C(<output_dir>/progress.json) that C(eagle3-pipeline train) (its rank 0)
    rewrites while it trains, and returns its figures and a one-line summary in C(msg), e.g.
    C(step 40/200 (epoch 1), loss 3.21, acc 0.41/0.30/0.22…, accept len 1.9, 1,234 tok/s, about 0:02:10 left).
  - Polls for up to O(wait_s) seconds and returns early when the training reaches a final state or
    its state changes (e.g. the job's first report). Steps alone do not end the wait, so a task
    retried with C(until) prints one line per O(wait_s).
  - With O(state_dir) and O(name), reads the state file that this project's supervisor keeps for the
    job, C(<state_dir>/<name>.json), with its PID, start time and exit code. It fails at once, with
    the last progress and the last lines of O(log_file), when the job exited with a non-zero code,
    or when the recorded process no longer runs while the training is not done. A progress file
    last updated before the job started (a previous run's) is ignored.
  - On the other nodes of a multi-node run (O(node_rank) > 0), the job's exit code 0 means that
    node's share is done; rank 0, on the first node, writes the progress into the shared output directory.
  - Fails when the training reports C(failed) or C(stopped) (the job was asked to stop), naming the
    job's message, and when O(deadline) passes before it is done (the job itself keeps running).
  - When the training is done, returns the last C(train) and C(eval) records of
    C(<output_dir>/metrics.jsonl) (read from the file's end only).
  - Changes nothing.
options:
  output_dir:
    description: The training's output directory (the job's C(--output-dir)).
    type: path
    required: true
  state_dir:
    description:
      - The supervisor's state directory (C(eagle3-pipeline supervise --state-dir)).
      - Without it only the progress file's own C(pid) is checked, with no exit code to report
        (a read-only look at a finished training, say).
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
  node_rank:
    description: This host's node rank (C(--node-rank)) in a multi-node training; 0 on a single node.
    type: int
    default: 0
  nnodes:
    description: The number of nodes (C(--nnodes)); above 1, messages name the node.
    type: int
    default: 1
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
      - Epoch seconds by which the training must be done; past it the module fails and says that the
        job keeps running. Unset, it waits without limit (bound the retries instead).
    type: float
notes:
  - Supports check mode; it only reads in either mode.
  - Its action plugin (action_plugins/training_progress.py) prints C(msg) on the controller after
    every call, so that each retry of an C(until) loop shows the progress without C(-v).
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
  register: training
  until: training.finished or training is failed
  retries: 20160
  delay: 0

- name: Read a finished training's last figures (no job to follow)
  training_progress:
    output_dir: /mnt/shared/eagle3/kimi-k2.5/drafter-run
    wait_s: 0
  register: finished
"""

RETURN = r"""
finished:
  description: Whether the training is done (the job said so in its progress file; on a node of rank > 0, its job exited with 0).
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
  description: Seconds this call waited.
  returned: always
  type: float
"""

import os
import time

from ansible.module_utils.basic import AnsibleModule
from ansible.module_utils.training_progress import (
    ProgressError,
    dead_message,
    failed_message,
    last_records,
    metrics_path,
    number,
    progress_line,
    progress_path,
    read_status,
    wait_for_change,
)

JOB_KEYS = ("name", "pid", "pgid", "supervisor_pid", "exit_code", "started_at", "ended_at", "log_file")


def main():
    """Map options to the wait; the look it ends on to JSON, or to a failure naming the cause."""
    module = AnsibleModule(
        argument_spec=dict(
            output_dir=dict(type="path", required=True),
            state_dir=dict(type="path"),
            name=dict(type="str"),
            log_file=dict(type="path"),
            log_lines=dict(type="int", default=30),
            node_rank=dict(type="int", default=0),
            nnodes=dict(type="int", default=1),
            wait_s=dict(type="float", default=30.0),
            poll_s=dict(type="float", default=0.5),
            deadline=dict(type="float"),
        ),
        required_together=[("state_dir", "name")],
        supports_check_mode=True,
    )
    p = module.params
    if p["nnodes"] < 1:
        module.fail_json(msg="nnodes must be >= 1, got %d" % p["nnodes"])
    if not 0 <= p["node_rank"] < p["nnodes"]:
        module.fail_json(msg="node_rank must be in 0..%d (nnodes - 1), got %d" % (p["nnodes"] - 1, p["node_rank"]))
    if not 0 <= p["wait_s"] <= 3600:
        module.fail_json(msg="wait_s must be between 0 and 3600 seconds, got %s" % p["wait_s"])
    if not 0 < p["poll_s"] <= 60:
        module.fail_json(msg="poll_s must be > 0 and <= 60 seconds, got %s" % p["poll_s"])
    if not 1 <= p["log_lines"] <= 1000:
        module.fail_json(msg="log_lines must be between 1 and 1000, got %d" % p["log_lines"])

    multi = p["nnodes"] > 1
    prefix = "node %d/%d: " % (p["node_rank"], p["nnodes"]) if multi else ""
    label = " of node %d/%d" % (p["node_rank"], p["nnodes"]) if multi else ""
    progress_file = progress_path(p["output_dir"])
    job_file = os.path.join(p["state_dir"], p["name"] + ".json") if p["state_dir"] else None
    log_file = p["log_file"] or (os.path.join(p["state_dir"], p["name"] + ".log") if p["state_dir"] else None)
    result = dict(changed=False, finished=False, state="starting", progress_file=progress_file,
                  last_train=None, last_eval=None)
    try:
        (_progress, job, state, mine), seconds = wait_for_change(
            lambda: read_status(progress_file, job_file, p["node_rank"]), p["wait_s"], p["poll_s"], p["deadline"]
        )
        if state == "done":
            records = last_records(metrics_path(p["output_dir"]))
            result.update(last_train=records["train"], last_eval=records["eval"])
    except ProgressError as exc:
        module.fail_json(msg="%s%s" % (prefix, exc), **result)
    mine = mine or {}
    acc_k = mine.get("acc_k")
    result.update(
        finished=state == "done",
        state=state,
        step=number(mine, "step") or 0,
        total_steps=number(mine, "total_steps") or 0,
        limit_steps=number(mine, "limit_steps") or number(mine, "total_steps") or 0,
        epoch=number(mine, "epoch"),
        loss=number(mine, "loss"),
        acc_k=acc_k if isinstance(acc_k, list) else [],
        acceptance_length=number(mine, "acceptance_length"),
        tokens_per_s=number(mine, "tokens_per_s"),
        eta_s=number(mine, "eta_s"),
        msg=prefix + (progress_line(mine) if mine else (
            "share done (rank 0 reports the progress)" if state == "done" else progress_line(None))),
        progress=mine or None,
        job=dict((key, job.get(key)) for key in JOB_KEYS) if job else None,
        seconds=seconds,
    )
    if state in ("failed", "stopped"):
        module.fail_json(**dict(result, msg=prefix + failed_message(label, mine, p["name"], log_file, p["log_lines"])))
    if state == "dead":
        module.fail_json(**dict(result, msg=prefix + dead_message(
            label, mine or None, job, p["name"], log_file, p["log_lines"])))
    if state != "done" and p["deadline"] is not None and time.time() >= p["deadline"]:
        running = " (PID %s)" % job.get("pid") if job else ""
        module.fail_json(
            **dict(
                result,
                msg="%sthe training was not done by the deadline; the job%s keeps running, at %s. Run the playbook "
                "again to go on waiting (it attaches to the running job), or raise the timeout (eagle_training_timeout)"
                % (prefix, running, progress_line(mine or None)),
            )
        )
    module.exit_json(**result)


if __name__ == "__main__":
    main()
