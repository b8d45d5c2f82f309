"""Follow one extraction (or regeneration) part: its progress file, and whether the job behind it still lives.

The extraction job (``eagle3-pipeline extract --part K/N``) rewrites
``<output_dir>/parts/part-K-of-N.progress.json`` about once a second, atomically; the
regeneration job (``eagle3-pipeline regenerate --part K/N``) keeps the same file with the same
fields, counting conversations (its ``unit``) and the assistant turns answered (``turns``). It runs
under this project's supervisor, whose state file ``<state_dir>/<name>.json`` records the
job's PID with its start time, its process group and, once it ended, its exit code.

Reading both tells the four cases apart that a poll of the progress file alone cannot:
still running, finished, failed and said so (the progress message says why), and died without
a word (SIGKILL, the OOM killer, a crash before the first progress write): then only the
supervisor's record and the log's last lines tell the operator what happened.

A progress file is taken as this job's only when its ``pid`` is the PID the supervisor
started; an older file (a previous run's "done" or "failed") is otherwise ignored, so a new
job is never reported finished on its predecessor's word.
"""

from __future__ import absolute_import, division, print_function

import json
import os
import signal
import time

from ansible.module_utils.gpu_holders import read_proc
from ansible.module_utils.sglang_http import log_tail

# "stopped": the job was asked to stop (SIGTERM, e.g. the supervisor's stop) and exited cleanly.
FINAL_STATES = ("done", "failed", "stopped")


class ProgressError(Exception):
    """The part cannot finish as things stand; ``str()`` says why and what to do."""


def progress_path(output_dir, part_index, part_count):
    """``<output_dir>/parts/part-K-of-N.progress.json``."""
    return os.path.join(output_dir, "parts", "part-%d-of-%d.progress.json" % (part_index, part_count))


def read_json(path):
    """The JSON object in ``path``, or None when there is no such file.

    The writers replace their files atomically, so a half-written file is never seen; a file
    that does not parse is reported, naming it, rather than waited on forever.
    """
    try:
        with open(path, "rb") as handle:
            raw = handle.read()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise ProgressError("cannot read %s: %s" % (path, exc)) from None
    try:
        data = json.loads(raw.decode("utf-8"))
    except ValueError as exc:
        raise ProgressError("%s is not valid JSON (%s); only the job itself writes it" % (path, exc)) from None
    if not isinstance(data, dict):
        raise ProgressError("%s holds %s, not a JSON object" % (path, type(data).__name__))
    return data


def process_running(pid, start_time=None):
    """True when ``pid`` runs, is no zombie, and (when given) started at ``start_time``.

    The start time (clock ticks since boot, as the supervisor records it) tells the job from a
    later process that happens to reuse its PID.
    """
    if not isinstance(pid, int) or pid <= 0:
        return False
    info = read_proc(pid)
    if info is None or info.state in ("Z", "X", "x"):
        return False
    return start_time is None or info.starttime == start_time


def job_running(job):
    """True while a supervised job has not ended for good: its process runs, or it just ended and its
    supervisor, still running, has yet to record the exit code (a process killed with SIGKILL is a
    zombie until the supervisor reaps it: judging it then would report "no exit code")."""
    if job.get("exit_code") is not None:
        return False
    return process_running(job.get("pid"), job.get("pid_start_time")) or process_running(job.get("supervisor_pid"))


def describe_exit(code):
    """``exited with code 2`` or ``was killed by SIGKILL`` (the supervisor records -N for signal N)."""
    if code is not None and code < 0:
        try:
            return "was killed by %s" % signal.Signals(-code).name
        except ValueError:
            return "was killed by signal %d" % -code
    return "exited with code %s" % code


def format_duration(seconds):
    """H:MM:SS, e.g. 0:03:12."""
    seconds = int(round(max(0.0, float(seconds))))
    return "%d:%02d:%02d" % (seconds // 3600, seconds // 60 % 60, seconds % 60)


def _count(progress, key):
    value = progress.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def progress_line(progress):
    """One line for the operator, e.g.
    ``412/1000 samples, 3 skipped, 0 failed, 5,210 tokens/s, about 0:03:12 left``, or for a
    regeneration ``412/1000 conversations, 3 skipped, 0 failed, 655 turns, 5,210 tokens/s, ...``."""
    if progress is None:
        return "waiting for the job's first progress report"
    unit = progress.get("unit")
    line = "%d/%d %s, %d skipped, %d failed" % (
        _count(progress, "done"), _count(progress, "total"), unit if isinstance(unit, str) and unit else "samples",
        _count(progress, "skipped"), _count(progress, "failed"))
    if "turns" in progress:
        line += ", %d turns" % _count(progress, "turns")
    state = progress.get("state")
    if state == "done":
        return line + ", %s tokens: done" % format(_count(progress, "tokens"), ",d")
    if state in ("failed", "stopped"):
        return line + ": %s: %s" % (state, progress.get("message") or "no message")
    rate = progress.get("tokens_per_s")
    if isinstance(rate, (int, float)) and not isinstance(rate, bool):
        line += ", %s tokens/s" % format(rate, ",.0f")
    eta = progress.get("eta_s")
    if isinstance(eta, (int, float)) and not isinstance(eta, bool):
        line += ", about %s left" % format_duration(eta)
    else:
        line += ", time left not known yet"
    return line


def assess(progress, job):
    """What the progress and the supervisor's record say together.

    ``progress``: the progress file (dict) or None; ``job``: the supervisor's state file (dict)
    or None when the job runs without one. Returns ``(state, mine)``: ``state`` is one of
    ``starting`` (no progress of this job yet), ``running``, ``done``, ``failed`` or ``stopped``
    (the job said so) or ``dead`` (it ended without saying so); ``mine`` is the progress file when it belongs
    to this job, else None.
    """
    if job is None:
        mine = progress
        if mine is None:
            return "starting", None
        state = mine.get("state")
        if state in FINAL_STATES:
            return state, mine
        return ("running" if process_running(mine.get("pid")) else "dead"), mine
    pid = job.get("pid")
    mine = progress if progress is not None and progress.get("pid") == pid else None
    state = mine.get("state") if mine is not None else None
    if state in FINAL_STATES:
        return state, mine
    if job_running(job):
        return ("running" if mine is not None else "starting"), mine
    # The process ended: through the supervisor (exit code recorded) or with it (none recorded).
    return "dead", mine


def dead_message(label, progress, job, job_name, log_file, log_lines=30, stage="extraction"):
    """Why the part stopped without finishing: exit, progress message, the log's last lines.

    ``stage`` names the job (extraction, regeneration) in the message.
    """
    if job is None:
        what = "the %s job (PID %s) of part %s no longer runs but its progress says %s" % (
            stage, (progress or {}).get("pid"), label, (progress or {}).get("state"))
    elif job.get("exit_code") is None:
        what = (
            "the %s job %s of part %s (PID %s) no longer runs and its supervisor recorded no exit "
            "code: both were killed (SIGKILL, the OOM killer, a reboot?)" % (stage, job_name, label, job.get("pid")))
    elif job.get("exit_code") == 0:
        what = (
            "the %s job %s of part %s exited with code 0 but its progress file does not say done "
            "(%s): is the venv's eagle3_pipeline the version this role expects?" % (
                stage, job_name, label, "no progress of this job" if progress is None else progress.get("state")))
    else:
        what = "the %s job %s of part %s %s" % (stage, job_name, label, describe_exit(job.get("exit_code")))
    message = what
    if progress is not None:
        message += "; last progress: %s" % progress_line(progress)
        if progress.get("message") and progress.get("state") != "failed":
            message += " (%s)" % progress["message"]
    message += ". Fix the cause and run the playbook again: the job resumes where it stopped"
    return message + ". Last lines of %s:\n%s" % (log_file, log_tail(log_file, log_lines))


def failed_message(label, progress, job_name, log_file, log_lines=30, stage="extraction"):
    """The part's job said it failed (or was stopped): its message, then the log's last lines."""
    state = progress.get("state")
    message = "%s part %s %s: %s" % (
        stage, label, "failed" if state == "failed" else "was stopped before it was done",
        progress.get("message") or "(no message in the progress file)")
    if job_name:
        message += " (job %s)" % job_name
    if state != "failed":
        message += "; run the playbook again to continue where it stopped"
    return message + ". Last lines of %s:\n%s" % (log_file, log_tail(log_file, log_lines))


def read_status(progress_file, job_file=None, stage="extraction"):
    """One look: (progress dict or None, supervisor record or None, state, this job's progress or None).

    With ``job_file`` (the supervisor's state file) the record must exist: the caller started
    the job under the supervisor before it waits.
    """
    progress = read_json(progress_file)
    job = None
    if job_file:
        job = read_json(job_file)
        if job is None:
            raise ProgressError(
                "no supervisor record %s: the %s job was never started under that name and state "
                "directory; start it (the %s role does) before waiting for it" % (job_file, stage, stage))
    state, mine = assess(progress, job)
    return progress, job, state, mine


def wait_for_change(look, wait_s, poll_s, deadline=None, clock=time.time, sleep=time.sleep):
    """Call ``look()`` (returning a tuple whose third item is the state) until the state is final
    (done, failed, stopped, dead), differs from the first look's, ``wait_s`` passed, or the epoch
    ``deadline`` came; return the last look and the seconds waited.

    Counters change every second and are not a reason to return: one return per ``wait_s`` is
    what keeps a retried task's output to one line per interval.
    """
    start = clock()
    first = seen = look()
    end = start + wait_s
    if deadline is not None:
        end = min(end, deadline)
    while seen[2] not in FINAL_STATES + ("dead",) and seen[2] == first[2] and clock() < end:
        sleep(max(0.0, min(poll_s, end - clock())))
        seen = look()
    return seen, round(clock() - start, 3)
