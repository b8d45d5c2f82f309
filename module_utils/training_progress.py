"""Follow one training job: its progress file, and whether the job behind it still lives.

``eagle3-pipeline train`` (rank 0) rewrites ``<output_dir>/progress.json`` atomically while it
runs: ``state`` (running, done, failed, stopped), ``step``, ``total_steps``, ``epoch``, ``loss``,
``acc_k``, ``acceptance_length``, ``tokens_per_s``, ``elapsed_s``, ``eta_s``, ``message``,
``pid`` and ``updated`` (epoch seconds). The role starts the command under this project's
supervisor, whose state file ``<state_dir>/<name>.json`` records the job's PID, start time and,
once it ended, its exit code; reading both tells running, finished, failed-and-said-so and
died-without-a-word apart, as ``job_progress`` does for every job (the extraction's too).

Which progress file is this job's: the supervisor's child is the ``train`` command; with
``--nproc-per-node`` or ``--nnodes`` above 1 that command launches torchrun, and rank 0, which
writes the file, is a grandchild with another PID (or runs on another host: the output directory
is shared between nodes). So a progress file counts as this job's when its ``pid`` is the job's
PID, or when it was updated after the job started; an older file (a previous run's "done" or
"stopped") is ignored, and a new job is never reported finished on its predecessor's word.

On the other nodes of a multi-node run (``node_rank`` > 0) the job's own exit code 0 means its
share is done: rank 0, on the first node, writes the progress.
"""

from __future__ import absolute_import, division, print_function

import json
import os
import time

from ansible.module_utils.job_progress import (
    FINAL_STATES,
    ProgressError,
    Stage,
    describe_exit,
    format_duration,
    job_running,
    number,
)

__all__ = [
    "FINAL_STATES", "ProgressError", "TrainingStage", "acc_text", "format_duration", "last_records", "metrics_path",
    "number", "progress_line", "progress_path",
]  # fmt: skip

# How long rank 0's wait waits for the job's exit after it reported done (see ``assess``).
EXIT_GRACE_S = 120.0
# How much of metrics.jsonl's end is read for the last records (one line is well under 4 KiB).
METRICS_TAIL_BYTES = 256 * 1024
# Accuracies shown per position in the progress line; more are cut with an ellipsis.
ACC_SHOWN = 3
EXIT_MEANINGS = {
    1: "it crashed",
    2: "bad input or settings",
    4: "stopped on request; a rerun resumes",
}


def progress_path(output_dir):
    """``<output_dir>/progress.json``."""
    return os.path.join(output_dir, "progress.json")


def metrics_path(output_dir):
    """``<output_dir>/metrics.jsonl``."""
    return os.path.join(output_dir, "metrics.jsonl")


def acc_text(acc_k, shown=ACC_SHOWN):
    """``0.41/0.30/0.22…``: the first ``shown`` accuracies per position, an ellipsis for more."""
    values = [value for value in (acc_k or []) if isinstance(value, (int, float)) and not isinstance(value, bool)]
    text = "/".join("%.2f" % value for value in values[:shown])
    return text + ("\u2026" if len(values) > shown else "")


def progress_line(progress):
    """One line for the operator, e.g. ``step 40/200 (epoch 1), loss 3.21, acc 0.41/0.30/0.22…,
    accept len 1.9, 1,234 tok/s, about 0:02:10 left``."""
    if progress is None:
        return "waiting for the job's first progress report"
    # limit_steps: where this run stops (eagle_training_max_steps); total_steps: the schedule's length.
    target = number(progress, "limit_steps") or number(progress, "total_steps") or 0
    line = "step %d/%d" % (number(progress, "step") or 0, target)
    if number(progress, "epoch") is not None:
        line += " (epoch %d)" % progress["epoch"]
    if number(progress, "loss") is not None:
        line += ", loss %.2f" % progress["loss"]
    if acc_text(progress.get("acc_k")):
        line += ", acc %s" % acc_text(progress.get("acc_k"))
    if number(progress, "acceptance_length") is not None:
        line += ", accept len %.1f" % progress["acceptance_length"]
    if number(progress, "tokens_per_s") is not None:
        line += ", %s tok/s" % format(progress["tokens_per_s"], ",.0f")
    state = progress.get("state")
    if state == "done":
        elapsed = number(progress, "elapsed_s")
        return line + (": done in %s" % format_duration(elapsed) if elapsed is not None else ": done")
    if state in ("failed", "stopped"):
        return line + ": %s: %s" % (state, progress.get("message") or "no message")
    eta = number(progress, "eta_s")
    return line + (", about %s left" % format_duration(eta) if eta is not None else ", time left not known yet")


def reported_for_s(progress, now=None):
    """Seconds since the progress file was written (0 when it says no time)."""
    updated = number(progress, "updated")
    return 0.0 if updated is None else (time.time() if now is None else now) - updated


def is_this_jobs(progress, job):
    """Whether the progress file was written by this job (or by its rank 0, see the docstring)."""
    if progress is None:
        return False
    if progress.get("pid") == job.get("pid"):
        return True
    updated, started = number(progress, "updated"), number(job, "started_at")
    return updated is not None and started is not None and updated >= started


def assess(progress, job, node_rank=0, now=None):
    """What the progress file and the supervisor's record say together: ``(state, mine)`` as
    ``Stage.assess`` returns it, on the node of ``node_rank``.

    A job whose progress says done is done once it has exited: after its report the job still
    leaves its process group, prints its summary and frees its GPUs, and the next stage wants them.
    Rank 0 waits up to ``EXIT_GRACE_S`` after the report for that exit (a teardown that hangs is
    then left running, named in a warning; the drafter was exported before the report).
    """
    mine = progress if is_this_jobs(progress, job) else None
    said = mine.get("state") if mine is not None else None
    exit_code = job.get("exit_code")
    alive = job_running(job)
    if said in ("failed", "stopped"):
        return said, mine
    if said == "done":
        if not alive or (node_rank == 0 and reported_for_s(mine, now) > EXIT_GRACE_S):
            return "done", mine
        return "running", mine
    if alive:
        return ("running" if mine is not None else "starting"), mine
    if exit_code == 0 and node_rank == 0 and progress is not None and progress.get("state") == "done":
        # Exit 0 is "trained and exported, or already complete": a job that found the export
        # done may leave the previous run's progress file as it was.
        return "done", progress
    # On a node of rank > 0, exit 0 is its share done: rank 0 writes the progress.
    return ("done" if exit_code == 0 and node_rank > 0 else "dead"), mine


def last_records(path, kinds=("train", "eval"), tail_bytes=METRICS_TAIL_BYTES):
    """{kind: the last JSON line of that ``kind`` in metrics.jsonl, or None}, from the file's end.

    The file grows by a line per step; only its last ``tail_bytes`` are read. A missing file
    gives Nones; lines that do not parse (a line cut by a crash) are skipped.
    """
    found = dict((kind, None) for kind in kinds)
    try:
        with open(path, "rb") as handle:
            handle.seek(0, os.SEEK_END)
            size = handle.tell()
            handle.seek(max(0, size - tail_bytes))
            lines = handle.read().decode("utf-8", "replace").splitlines()
    except FileNotFoundError:
        return found
    except OSError as exc:
        raise ProgressError("cannot read %s: %s" % (path, exc)) from None
    if size > tail_bytes:
        lines = lines[1:]  # the first line read is likely cut
    for line in reversed(lines):
        if all(found[kind] is not None for kind in kinds):
            break
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and record.get("kind") in found and found[record["kind"]] is None:
            found[record["kind"]] = record
    return found


class TrainingStage(Stage):
    """A training on this node (``node_rank`` of ``nnodes``)."""

    job = "training"
    timeout_variable = "eagle_training_timeout"
    exit_meanings = EXIT_MEANINGS
    resume = "the training resumes from its last checkpoint"
    continue_hint = "resume from its last checkpoint"

    def __init__(self, params):
        Stage.__init__(self, params)
        self.node_rank, nnodes = params.get("node_rank", 0), params.get("nnodes", 1)
        multi = nnodes > 1
        self.line_prefix = self.message_prefix = "node %d/%d: " % (self.node_rank, nnodes) if multi else ""
        self.label = " of node %d/%d" % (self.node_rank, nnodes) if multi else ""

    @property
    def role(self):
        return "eagle_training"

    def validate(self):
        p = self.params
        if p["nnodes"] < 1:
            return "nnodes must be >= 1, got %d" % p["nnodes"]
        if not 0 <= p["node_rank"] < p["nnodes"]:
            return "node_rank must be in 0..%d (nnodes - 1), got %d" % (p["nnodes"] - 1, p["node_rank"])
        return None

    @property
    def progress_file(self):
        return progress_path(self.params["output_dir"])

    def assess(self, progress, job):
        return assess(progress, job, self.node_rank)

    def progress_line(self, progress):
        return progress_line(progress)

    def done_warnings(self, mine, job, job_name, log_file):
        """What to say of a training done by its progress whose job did not end cleanly."""
        if job is None:
            return []
        if job.get("exit_code") not in (None, 0):
            return ["%s %s after it reported done (its drafter was exported and stands); the log says why: %s" % (
                self.subject(job_name), describe_exit(job["exit_code"], self.exit_meanings), log_file)]
        if job_running(job):
            return ["%s still runs %d s after it reported done (its drafter was exported and stands): it is left "
                    "running, and may still hold its GPUs; see %s" % (
                        self.subject(job_name), reported_for_s(mine), log_file)]
        return []

    def subject(self, job_name):
        return "the training job%s%s" % (" " + job_name if job_name else "", self.label)

    def failed_subject(self):
        return "the training%s" % self.label

    def failed_at(self, progress):
        return " at step %s/%s" % (progress.get("step"), progress.get("limit_steps") or progress.get("total_steps"))

    def wait_subject(self):
        return "the training"

    def initial_fields(self):
        return dict(last_train=None, last_eval=None)

    def fields(self, mine, state):
        mine = mine or {}
        acc_k = mine.get("acc_k")
        records = (last_records(metrics_path(self.params["output_dir"])) if state == "done"
                   else dict(train=None, eval=None))
        return dict(
            step=number(mine, "step") or 0,
            total_steps=number(mine, "total_steps") or 0,
            limit_steps=number(mine, "limit_steps") or number(mine, "total_steps") or 0,
            epoch=number(mine, "epoch"),
            loss=number(mine, "loss"),
            acc_k=acc_k if isinstance(acc_k, list) else [],
            acceptance_length=number(mine, "acceptance_length"),
            tokens_per_s=number(mine, "tokens_per_s"),
            eta_s=number(mine, "eta_s"),
            last_train=records["train"],
            last_eval=records["eval"],
        )

    def summary(self, mine, state):
        if not mine and state == "done":
            return self.line_prefix + "share done (rank 0 reports the progress)"
        line = self.line_prefix + progress_line(mine or None)
        if state == "running" and (mine or {}).get("state") == "done":
            return line + "; waiting for the job to exit"
        return line
