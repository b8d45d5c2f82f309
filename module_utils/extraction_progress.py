"""Follow one extraction (or regeneration) part: its progress file, read as ``job_progress`` reads every job's.

The extraction job (``eagle3-pipeline extract --part K/N``) rewrites
``<output_dir>/parts/part-K-of-N.progress.json`` about once a second, atomically; the
regeneration job (``eagle3-pipeline regenerate --part K/N``) keeps the same file with the same
fields, counting conversations (its ``unit``) and the assistant turns answered (``turns``).

A progress file is taken as this job's only when its ``pid`` is the PID the supervisor
started; an older file (a previous run's "done" or "failed") is otherwise ignored, so a new
job is never reported finished on its predecessor's word.
"""

from __future__ import absolute_import, division, print_function

import os

from ansible.module_utils.job_progress import (
    FINAL_STATES,
    ProgressError,
    Stage,
    count,
    format_duration,
    job_running,
    number,
)

__all__ = ["FINAL_STATES", "PartStage", "ProgressError", "format_duration", "progress_line", "progress_path"]


def progress_path(output_dir, part_index, part_count):
    """``<output_dir>/parts/part-K-of-N.progress.json``."""
    return os.path.join(output_dir, "parts", "part-%d-of-%d.progress.json" % (part_index, part_count))


def progress_line(progress):
    """One line for the operator, e.g.
    ``412/1000 samples, 3 skipped, 0 failed, 5,210 tokens/s, about 0:03:12 left``, or for a
    regeneration ``412/1000 conversations, 3 skipped, 0 failed, 655 turns, 5,210 tokens/s, ...``."""
    if progress is None:
        return "waiting for the job's first progress report"
    unit = progress.get("unit")
    line = "%d/%d %s, %d skipped, %d failed" % (
        count(progress, "done"), count(progress, "total"), unit if isinstance(unit, str) and unit else "samples",
        count(progress, "skipped"), count(progress, "failed"))
    if "turns" in progress:
        line += ", %d turns" % count(progress, "turns")
    state = progress.get("state")
    if state == "done":
        return line + ", %s tokens: done" % format(count(progress, "tokens"), ",d")
    if state in ("failed", "stopped"):
        return line + ": %s: %s" % (state, progress.get("message") or "no message")
    rate = number(progress, "tokens_per_s")
    if rate is not None:
        line += ", %s tokens/s" % format(rate, ",.0f")
    eta = number(progress, "eta_s")
    return line + (", about %s left" % format_duration(eta) if eta is not None else ", time left not known yet")


class PartStage(Stage):
    """Part K/N of an extraction (``stage: extraction``) or of a regeneration (``stage: regeneration``)."""

    resume = "the job resumes where it stopped"
    continue_hint = "continue where it stopped"

    def __init__(self, params):
        Stage.__init__(self, params)
        self.job = params.get("stage") or "extraction"
        self.timeout_variable = "%s_timeout_s" % self.job
        self.part = "%d/%d" % (params.get("part_index", 0), params.get("part_count", 1))
        self.line_prefix = "part %s: " % self.part

    def validate(self):
        p = self.params
        if p["part_count"] < 1:
            return "part_count must be >= 1, got %d" % p["part_count"]
        if not 0 <= p["part_index"] < p["part_count"]:
            return "part_index must be in 0..%d (part_count - 1), got %d" % (p["part_count"] - 1, p["part_index"])
        return None

    @property
    def progress_file(self):
        return progress_path(self.params["output_dir"], self.params["part_index"], self.params["part_count"])

    def assess(self, progress, job):
        pid = job.get("pid")
        mine = progress if progress is not None and progress.get("pid") == pid else None
        state = mine.get("state") if mine is not None else None
        if state in FINAL_STATES:
            return state, mine
        if job_running(job):
            return ("running" if mine is not None else "starting"), mine
        # The process ended: through the supervisor (exit code recorded) or with it (none recorded).
        return "dead", mine

    def progress_line(self, progress):
        return progress_line(progress)

    def subject(self, job_name):
        return "the %s job%s of part %s" % (self.job, " " + job_name if job_name else "", self.part)

    def failed_subject(self):
        return "%s part %s" % (self.job, self.part)

    def wait_subject(self):
        return "part %s" % self.part

    def initial_fields(self):
        return dict(part=self.part)

    def fields(self, mine, state):
        return dict(
            part=self.part,
            samples_total=count(mine, "total"),
            samples_done=count(mine, "done"),
            samples_skipped=count(mine, "skipped"),
            samples_failed=count(mine, "failed"),
            tokens=count(mine, "tokens"),
            turns=count(mine, "turns"),
            tokens_per_s=number(mine, "tokens_per_s"),
            eta_s=number(mine, "eta_s"),
        )
