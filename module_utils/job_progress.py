"""Follow a job that this project's supervisor runs: its progress file, and whether the job behind it still lives.

What the ``job_progress`` module does for every stage's job. What differs is a ``Stage``
(module_utils/extraction_progress.py: an extraction's or a regeneration's part;
module_utils/training_progress.py: a training): where its progress file is, which progress file
is this job's, its one-line summary, the figures it returns and the words of its messages.

The jobs (``eagle3-pipeline extract``, ``regenerate``, ``train``) rewrite their progress file
atomically while they run. They run under this project's supervisor, whose state file
``<state_dir>/<name>.json`` records the job's PID with its start time, its process group and,
once it ended, its exit code. Reading both tells the four cases apart that a poll of the
progress file alone cannot: still running, finished, failed and said so (the progress message
says why), and died without a word (SIGKILL, the OOM killer, a crash before the first progress
write): then only the supervisor's record and the log's last lines tell the operator what
happened.

One call of a module waits at most ``wait_s`` (one short SSH round trip); the modules' action
plugin (action_plugins/polling.py) calls it again until the job is done, failed or the wait's
``timeout_s`` passed, and passes each call the seconds waited so far (``waited_s``): the
timeout is counted on the controller, across calls, without comparing two hosts' clocks.
"""

from __future__ import absolute_import, division, print_function

import abc
import json
import os
import signal
import time

from ansible.module_utils.gpu_holders import read_proc
from ansible.module_utils.sglang_http import log_tail

# "stopped": the job was asked to stop (SIGTERM, e.g. the supervisor's stop) and exited cleanly.
FINAL_STATES = ("done", "failed", "stopped")
# The supervisor's record, as the modules return it.
JOB_KEYS = ("name", "pid", "pgid", "supervisor_pid", "exit_code", "started_at", "ended_at", "log_file")


def argument_spec(**stage_options):
    """The options every progress module takes, with the stage's own (see doc_fragments/job_progress.py)."""
    spec = dict(
        output_dir=dict(type="path", required=True),
        state_dir=dict(type="path"),
        name=dict(type="str"),
        log_file=dict(type="path"),
        log_lines=dict(type="int", default=30),
        wait_s=dict(type="float", default=30.0),
        poll_s=dict(type="float", default=0.5),
        timeout_s=dict(type="float"),
        follow=dict(type="bool", default=True),
        waited_s=dict(type="float", default=0.0),
    )
    spec.update(stage_options)
    return spec


class ProgressError(Exception):
    """The job cannot finish as things stand; ``str()`` says why and what to do."""


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


def number(record, key):
    """``record[key]`` when it is a number (not a bool), else None."""
    value = (record or {}).get(key)
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def count(record, key):
    """``record[key]`` when it is an int (not a bool), else 0."""
    value = (record or {}).get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


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


def describe_exit(code, meanings=None):
    """``exited with code 2`` (with its meaning, when known) or ``was killed by SIGKILL`` (the supervisor
    records -N for signal N)."""
    if code is not None and code < 0:
        try:
            return "was killed by %s" % signal.Signals(-code).name
        except ValueError:
            return "was killed by signal %d" % -code
    meaning = (meanings or {}).get(code)
    return "exited with code %s" % code + (" (%s)" % meaning if meaning else "")


def format_duration(seconds):
    """H:MM:SS, e.g. 0:03:12."""
    seconds = int(round(max(0.0, float(seconds))))
    return "%d:%02d:%02d" % (seconds // 3600, seconds // 60 % 60, seconds % 60)


def assess_by_pid(progress):
    """Without a supervisor record, the progress file alone decides, through its own ``pid``:
    ``(state, mine)`` as ``Stage.assess`` returns it."""
    if progress is None:
        return "starting", None
    state = progress.get("state")
    if state in FINAL_STATES:
        return state, progress
    return ("running" if process_running(progress.get("pid")) else "dead"), progress


def wait_for_change(look, wait_s, poll_s, clock=time.monotonic, sleep=time.sleep):
    """Call ``look()`` (returning a tuple whose third item is the state) until the state is final
    (done, failed, stopped, dead), differs from the first look's, or ``wait_s`` passed; return the
    last look and the seconds waited.

    Counters change every second and are not a reason to return: one return per ``wait_s`` is
    what keeps the output to one line per interval.
    """
    start = clock()
    first = seen = look()
    end = start + wait_s
    while seen[2] not in FINAL_STATES + ("dead",) and seen[2] == first[2] and clock() < end:
        sleep(max(0.0, min(poll_s, end - clock())))
        seen = look()
    return seen, round(clock() - start, 3)


class Stage(abc.ABC):
    """One kind of job followed: the parts every module has in common, and the hooks a stage fills in.

    A subclass sets ``job`` (the job's name in messages: "extraction"), ``timeout_variable`` (the
    role variable that sets ``timeout_s``), ``exit_meanings``, ``resume`` and ``continue_hint``
    (what a rerun does), and gives ``progress_file``, ``assess``, ``progress_line``,
    ``subject``, ``failed_subject``, ``wait_subject`` and ``fields`` (``failed_at``,
    ``initial_fields``, ``summary`` and ``validate`` when it has more to say).
    """

    job = "job"
    timeout_variable = "timeout_s"
    exit_meanings = {}
    resume = "the job resumes where it stopped"
    continue_hint = "continue where it stopped"
    # Before the progress line in ``msg``, and before the messages of a failure.
    line_prefix = ""
    message_prefix = ""

    def __init__(self, params):
        self.params = params

    def validate(self):
        """A message naming a stage option out of range, or None."""
        return None

    @property
    @abc.abstractmethod
    def progress_file(self):
        """The job's progress file on the host."""

    @abc.abstractmethod
    def assess(self, progress, job):
        """``(state, mine)``: ``state`` is ``starting`` (no progress of this job yet), ``running``,
        ``done``, ``failed`` or ``stopped`` (the job said so) or ``dead`` (it ended without saying
        so); ``mine`` is the progress when it belongs to this job, else None."""

    @abc.abstractmethod
    def progress_line(self, progress):
        """The progress in one line (``progress`` None: no report of this job yet)."""

    @abc.abstractmethod
    def subject(self, job_name):
        """The job in a sentence: ``the extraction job NAME of part 0/2`` (``job_name`` None: no record)."""

    @abc.abstractmethod
    def failed_subject(self):
        """What failed, in a sentence: ``extraction part 0/2``, ``the training``."""

    def failed_at(self, progress):
        """Where it failed, after the verb: ``""``, `` at step 40/200``."""
        return ""

    @abc.abstractmethod
    def wait_subject(self):
        """What was waited for: ``part 0/2``, ``the training``."""

    def fields(self, mine, state):
        """The stage's own return values (counts, figures) for this look."""
        return {}

    def initial_fields(self):
        """The stage's return values before any look (a failure before the first)."""
        return {}

    def summary(self, mine, state):
        """``msg`` of a look that did not fail."""
        return self.line_prefix + self.progress_line(mine)

    def read_status(self, job_file=None):
        """One look: (progress or None, supervisor record or None, state, this job's progress or None).

        With ``job_file`` (the supervisor's state file) the record must exist: the caller started
        the job under the supervisor before it waits.
        """
        progress = read_json(self.progress_file)
        job = None
        if job_file:
            job = read_json(job_file)
            if job is None:
                raise ProgressError(
                    "no supervisor record %s: the %s job was never started under that name and state "
                    "directory; start it (the %s role does) before waiting for it" % (job_file, self.job, self.role))
        state, mine = assess_by_pid(progress) if job is None else self.assess(progress, job)
        if state == "dead" and job is not None and job.get("exit_code") is None:
            # The supervisor may have recorded the exit, and ended, between the read and the look at its
            # process: read its record again before saying it recorded none.
            again = read_json(job_file)
            if again is not None and again.get("exit_code") is not None:
                job = again
                state, mine = self.assess(progress, job)
        return progress, job, state, mine

    @property
    def role(self):
        return self.job

    def done_warnings(self, progress, job, job_name, log_file):
        """Warnings for a look that found the job done (none by default)."""
        return []

    def dead_message(self, progress, job, job_name, log_file, log_lines=30):
        """Why the job stopped without finishing: its exit, its last progress, the log's last lines."""
        if job is None:
            what = "%s (PID %s) no longer runs but its progress says %s" % (
                self.subject(None), (progress or {}).get("pid"), (progress or {}).get("state"))
        elif job.get("exit_code") is None:
            what = (
                "%s (PID %s) no longer runs and its supervisor recorded no exit code: both were killed (SIGKILL, "
                "the OOM killer, a reboot?)" % (self.subject(job_name), job.get("pid")))
        elif job.get("exit_code") == 0:
            what = (
                "%s exited with code 0 but its progress file does not say done (%s): is the venv's eagle3_pipeline "
                "the version this role expects?" % (
                    self.subject(job_name), "no progress of this job" if progress is None else progress.get("state")))
        else:
            what = "%s %s" % (self.subject(job_name), describe_exit(job.get("exit_code"), self.exit_meanings))
        message = self.message_prefix + what
        if progress is not None:
            message += "; last progress: %s" % self.progress_line(progress)
            if progress.get("message") and progress.get("state") not in FINAL_STATES:
                message += " (%s)" % progress["message"]
        message += ". Fix the cause and run the playbook again: %s" % self.resume
        return message + ". Last lines of %s:\n%s" % (log_file, log_tail(log_file, log_lines))

    def failed_message(self, progress, job_name, log_file, log_lines=30):
        """The job said it failed (or was stopped): its message, then the log's last lines."""
        state = progress.get("state")
        message = "%s%s %s%s: %s" % (
            self.message_prefix, self.failed_subject(),
            "failed" if state == "failed" else "was stopped before it was done", self.failed_at(progress),
            progress.get("message") or "(no message in the progress file)")
        if job_name:
            message += " (job %s)" % job_name
        if state != "failed":
            message += "; run the playbook again to %s" % self.continue_hint
        return message + ". Last lines of %s:\n%s" % (log_file, log_tail(log_file, log_lines))

    def timeout_message(self, mine, job, timeout_s):
        """The wait's timeout passed while the job runs on."""
        running = " (PID %s)" % job.get("pid") if job else ""
        return (
            "%s%s was not done within the wait's timeout (%g s); the job%s keeps running, at %s. Run the playbook "
            "again to go on waiting (it attaches to the running job), or raise the timeout (%s)"
            % (self.message_prefix, self.wait_subject(), timeout_s, running, self.progress_line(mine),
               self.timeout_variable))


def run_module(module, stage):
    """The whole of a progress module's call: check the options, wait, and exit with the look it ended on,
    or fail naming the cause (the job failed or died, or the wait's timeout passed)."""
    p = module.params
    problem = stage.validate()
    if problem is None:
        for option, low, high in (("wait_s", 0, 3600), ("timeout_s", 0, None), ("waited_s", 0, None)):
            value = p[option]
            if value is not None and (value < low or (high is not None and value > high)):
                problem = "%s must be %s seconds, got %s" % (
                    option, "between %s and %s" % (low, high) if high is not None else ">= %s" % low, value)
                break
    if problem is None and not 0 < p["poll_s"] <= 60:
        problem = "poll_s must be > 0 and <= 60 seconds, got %s" % p["poll_s"]
    if problem is None and not 1 <= p["log_lines"] <= 1000:
        problem = "log_lines must be between 1 and 1000, got %d" % p["log_lines"]
    if problem is not None:
        module.fail_json(msg=problem)

    job_file = os.path.join(p["state_dir"], p["name"] + ".json") if p["state_dir"] else None
    log_file = p["log_file"] or (os.path.join(p["state_dir"], p["name"] + ".log") if p["state_dir"] else None)
    result = dict(changed=False, finished=False, state="starting", progress_file=stage.progress_file,
                  waited_s=p["waited_s"], **stage.initial_fields())
    wait_s = p["wait_s"]
    if p["timeout_s"] is not None:
        wait_s = max(0.0, min(wait_s, p["timeout_s"] - p["waited_s"]))
    try:
        (_progress, job, state, mine), seconds = wait_for_change(
            lambda: stage.read_status(job_file), wait_s, p["poll_s"])
        fields = stage.fields(mine, state)
    except ProgressError as exc:
        module.fail_json(msg=stage.line_prefix + str(exc), **result)
    waited_s = round(p["waited_s"] + seconds, 3)
    result.update(fields)
    result.update(
        finished=state == "done",
        state=state,
        msg=stage.summary(mine, state),
        progress=mine or None,
        job=dict((key, job.get(key)) for key in JOB_KEYS) if job else None,
        seconds=seconds,
        waited_s=waited_s,
    )
    if state in ("failed", "stopped"):
        module.fail_json(**dict(result, msg=stage.failed_message(mine, p["name"], log_file, p["log_lines"])))
    if state == "dead":
        module.fail_json(**dict(result, msg=stage.dead_message(mine or None, job, p["name"], log_file,
                                                                p["log_lines"])))
    if state != "done" and p["timeout_s"] is not None and waited_s >= p["timeout_s"]:
        module.fail_json(**dict(result, msg=stage.timeout_message(mine or None, job, p["timeout_s"])))
    if state == "done":
        for warning in stage.done_warnings(mine or None, job, p["name"], log_file):
            module.warn(warning)
    module.exit_json(**result)
