"""Follow one training job: its progress file, and whether the job behind it still lives.

``eagle3-pipeline train`` (rank 0) rewrites ``<output_dir>/progress.json`` atomically while it
runs: ``state`` (running, done, failed, stopped), ``step``, ``total_steps``, ``epoch``, ``loss``,
``acc_k``, ``acceptance_length``, ``tokens_per_s``, ``elapsed_s``, ``eta_s``, ``message``,
``pid`` and ``updated`` (epoch seconds). The role starts the command under this project's
supervisor, whose state file ``<state_dir>/<name>.json`` records the job's PID, start time and,
once it ended, its exit code; reading both tells running, finished, failed-and-said-so and
died-without-a-word apart, as for the extraction (``extraction_progress``, whose generic pieces
this module reuses).

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

from ansible.module_utils.extraction_progress import (
    FINAL_STATES,
    ProgressError,
    describe_exit,
    format_duration,
    job_running,
    read_json,
    wait_for_change,
)
from ansible.module_utils.extraction_progress import assess as assess_without_supervisor
from ansible.module_utils.sglang_http import log_tail

__all__ = [
    "FINAL_STATES", "ProgressError", "assess", "dead_message", "failed_message", "format_duration", "last_records",
    "progress_line", "progress_path", "read_status", "wait_for_change",
]  # fmt: skip

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


def number(progress, key):
    """``progress[key]`` when it is a number (not a bool), else None."""
    value = (progress or {}).get(key)
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None


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


def is_this_jobs(progress, job):
    """Whether the progress file was written by this job (or by its rank 0, see the docstring)."""
    if progress is None:
        return False
    if progress.get("pid") == job.get("pid"):
        return True
    updated, started = number(progress, "updated"), number(job, "started_at")
    return updated is not None and started is not None and updated >= started


def assess(progress, job, node_rank=0):
    """What the progress file and the supervisor's record say together.

    Returns ``(state, mine)``: ``state`` is ``starting`` (no progress of this job yet),
    ``running``, ``done``, ``failed`` or ``stopped`` (the job said so), or ``dead`` (it ended
    without saying so); ``mine`` is the progress when it belongs to this job, else None.
    ``job`` None (no supervisor): the progress file alone decides, through its ``pid``.
    """
    if job is None:
        return assess_without_supervisor(progress, None)
    mine = progress if is_this_jobs(progress, job) else None
    said = mine.get("state") if mine is not None else None
    exit_code = job.get("exit_code")
    alive = job_running(job)
    if said in ("failed", "stopped") or (said == "done" and (node_rank == 0 or not alive)):
        return said, mine
    if alive:
        return ("running" if mine is not None else "starting"), mine
    if exit_code == 0 and node_rank == 0 and progress is not None and progress.get("state") == "done":
        # Exit 0 is "trained and exported, or already complete": a job that found the export
        # done may leave the previous run's progress file as it was.
        return "done", progress
    # On a node of rank > 0, exit 0 is its share done: rank 0 writes the progress.
    return ("done" if exit_code == 0 and node_rank > 0 else "dead"), mine


def read_status(progress_file, job_file=None, node_rank=0):
    """One look: (progress or None, supervisor record or None, state, this job's progress or None).

    With ``job_file`` the record must exist: the caller started the job under the supervisor.
    """
    progress = read_json(progress_file)
    job = None
    if job_file:
        job = read_json(job_file)
        if job is None:
            raise ProgressError(
                "no supervisor record %s: the training job was never started under that name and state "
                "directory; start it (the eagle_training role does) before waiting for it" % job_file)
    state, mine = assess(progress, job, node_rank)
    return progress, job, state, mine


def _exit_text(code):
    meaning = EXIT_MEANINGS.get(code)
    return describe_exit(code) + (" (%s)" % meaning if meaning else "")


def dead_message(label, progress, job, job_name, log_file, log_lines=30):
    """Why the training stopped without finishing: exit, last progress, the log's last lines."""
    if job is None:
        what = "the training job (PID %s)%s no longer runs but its progress says %s" % (
            (progress or {}).get("pid"), label, (progress or {}).get("state"))
    elif job.get("exit_code") is None:
        what = (
            "the training job %s%s (PID %s) no longer runs and its supervisor recorded no exit code: both were "
            "killed (SIGKILL, the OOM killer, a reboot?)" % (job_name, label, job.get("pid")))
    elif job.get("exit_code") == 0:
        what = (
            "the training job %s%s exited with code 0 but its progress file does not say done (%s): is the venv's "
            "eagle3_pipeline the version this role expects?" % (
                job_name, label, "no progress of this job" if progress is None else progress.get("state")))
    else:
        what = "the training job %s%s %s" % (job_name, label, _exit_text(job.get("exit_code")))
    message = what
    if progress is not None:
        message += "; last progress: %s" % progress_line(progress)
        if progress.get("message") and progress.get("state") not in ("failed", "stopped"):
            message += " (%s)" % progress["message"]
    message += ". Fix the cause and run the playbook again: the training resumes from its last checkpoint"
    return message + ". Last lines of %s:\n%s" % (log_file, log_tail(log_file, log_lines))


def failed_message(label, progress, job_name, log_file, log_lines=30):
    """The job said it failed (or was stopped): its message, then the log's last lines."""
    state = progress.get("state")
    message = "the training%s %s at step %s/%s: %s" % (
        label, "failed" if state == "failed" else "was stopped before it was done",
        progress.get("step"), progress.get("limit_steps") or progress.get("total_steps"),
        progress.get("message") or "(no message in the progress file)")
    if job_name:
        message += " (job %s)" % job_name
    if state != "failed":
        message += "; run the playbook again to resume from its last checkpoint"
    return message + ". Last lines of %s:\n%s" % (log_file, log_tail(log_file, log_lines))


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
