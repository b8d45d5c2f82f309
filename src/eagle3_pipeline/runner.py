"""The Python API: run a stage of the pipeline (one of the project's playbooks) through ansible-runner.

``run("site", inventory=...)`` runs ``playbooks/site.yml``; ``run("train", ...)`` only the
training. It streams simplified progress events to ``on_event`` while Ansible runs, and returns
a ``RunResult`` (status, per-host stats, the paths produced, the failures) or raises
``PipelineError`` naming the failing task(s), host(s) and the module's message.

ansible-runner is imported only when a run starts, so ``import eagle3_pipeline`` stays light.

Paths produced. The roles cannot be asked directly, so the result's ``paths`` come from the
event stream, in this order of precedence:

1. ``ansible.builtin.set_stats`` data under the key ``eagle3_pipeline_paths`` (``per_host:
   false``; a dict of name -> path, merged across tasks), which ansible-runner hands over in
   the final stats event (``artifact_data``). This is the convention roles follow to name what
   they produce.
2. Otherwise, the well-known files that the roles' own tasks read or write, recognised in the
   task results (``dest``, ``path``, ``source`` and the module's ``output_dir`` argument):
   ``<data>/data_config.json`` and the extraction progress module's ``output_dir``
   (``data_dir``); ``<drafter>/config.json`` read or checked (``drafter_dir``) and the training
   progress module's ``output_dir`` (``training_dir``); the gpu_reset
   role's per-host JSON report (``gpu_reset_dir``); ``evaluation.json`` (``evaluation``) and
   ``report/index.html`` (``report``).
"""

from __future__ import annotations

import os
import re
import sys
import sysconfig
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from eagle3_pipeline import project_root

# Stage name -> playbook under playbooks/.
STAGES = {
    "site": "site.yml",
    "gpu-reset": "gpu_reset.yml",
    "regenerate": "regenerate.yml",
    "serve": "sglang_server.yml",
    "extract": "extract.yml",
    "train": "train.yml",
    "evaluate": "evaluate.yml",
    "report": "report.yml",
}
PATHS_STATS_KEY = "eagle3_pipeline_paths"
# Lines that the action plugins print for each poll: "[host] part 0/2: 412/1000 samples, ..."
PROGRESS_LINE = re.compile(r"^\[(?P<host>[^\]\s]+)\] (?P<message>.+)$", re.DOTALL)
STDERR_LINES_IN_MESSAGE = 15

ProgressCallback = Callable[[dict], None]


class PipelineError(RuntimeError):
    """A stage that did not succeed; ``result`` is its ``RunResult`` (None when it could not start)."""

    def __init__(self, message: str, result: RunResult | None = None):
        super().__init__(message)
        self.result = result


@dataclass
class HostStats:
    """Ansible's recap for one host."""

    ok: int = 0
    changed: int = 0
    failed: int = 0
    skipped: int = 0
    unreachable: int = 0
    rescued: int = 0
    ignored: int = 0


@dataclass
class TaskFailure:
    """One failed task on one host (or an unreachable host)."""

    task: str
    host: str
    message: str
    play: str = ""
    role: str = ""
    action: str = ""
    unreachable: bool = False
    # A failure inside a block whose rescue ran, or under ignore_errors: the run went on.
    recovered: bool = False

    def describe(self) -> str:
        """``task 'X' on host: message`` (the message's lines indented)."""
        what = "unreachable" if self.unreachable else "failed"
        label = f"{self.role} : {self.task}" if self.role else self.task
        message = self.message.strip().replace("\n", "\n    ")
        return f"task '{label}' {what} on {self.host}: {message}"


@dataclass
class RunResult:
    """The outcome of one stage's run."""

    stage: str
    playbook: Path
    status: str  # ansible-runner's: successful, failed, timeout, canceled
    rc: int
    check: bool
    stats: dict[str, HostStats]
    paths: dict[str, str]
    failures: list[TaskFailure]
    events: list[dict] = field(repr=False, default_factory=list)  # ansible-runner's raw events

    @property
    def ok(self) -> bool:
        """Whether the run succeeded."""
        return self.status == "successful" and self.rc == 0

    @property
    def changed(self) -> int:
        """How many task results reported a change, over all hosts."""
        return sum(host.changed for host in self.stats.values())

    def error_message(self) -> str:
        """What went wrong, naming the tasks, hosts and messages (for a failed run)."""
        failures = [failure for failure in self.failures if not failure.recovered] or self.failures
        head = f"stage {self.stage} ({self.playbook.name}) {self.status} (rc {self.rc})"
        if not failures:
            # Ansible stopped before any task ran (a syntax error, a missing role): its own words.
            output = [str(e.get("stdout") or "").replace("\r", "") for e in self.events if e.get("stdout")]
            tail = "\n".join("\n".join(output).strip().splitlines()[-STDERR_LINES_IN_MESSAGE:])
            return head + (":\n" + tail if tail else ": no task failed and Ansible printed nothing")
        return head + ":\n" + "\n".join(f"  {failure.describe()}" for failure in failures)


def playbook_for(stage: str, root: Path | None = None) -> Path:
    """The playbook of ``stage``; ValueError for an unknown stage, FileNotFoundError for a missing playbook."""
    if stage not in STAGES:
        raise ValueError(f"unknown stage {stage!r}: expected one of {', '.join(STAGES)}")
    playbook = (root or project_root()) / "playbooks" / STAGES[stage]
    if not playbook.is_file():
        raise FileNotFoundError(
            f"stage {stage!r} needs playbooks/{STAGES[stage]}, which is not in this checkout ({playbook.parent})"
        )
    return playbook


def runner_path() -> str:
    """PATH for the playbook run, led by this Python's scripts directory.

    ansible-runner looks ``ansible-playbook`` up on PATH; a venv's console script run without
    activating the venv would otherwise find none (or another installation's).
    """
    scripts = sysconfig.get_path("scripts")
    return os.pathsep.join([scripts, os.environ.get("PATH", os.defpath)])


def run(
    stage: str = "site",
    inventory: str | os.PathLike | dict | None = None,
    extravars: dict | None = None,
    on_event: ProgressCallback | None = None,
    check: bool = False,
    tags: str | list[str] | None = None,
    skip_tags: str | list[str] | None = None,
    limit: str | None = None,
    quiet: bool = True,
    private_data_dir: str | os.PathLike | None = None,
) -> RunResult:
    """Run one stage of the pipeline and return its ``RunResult``; raise ``PipelineError`` if it fails.

    ``stage`` is one of ``STAGES`` (``site`` runs them all). ``inventory`` is an inventory file
    (default: the embedded ``inventory/local.yml``) or an inventory dict. ``on_event`` receives
    a simplified event (see ``simplify_event``) for each Ansible event, in order, while the run
    goes on. ``check`` runs Ansible's check mode; ``tags``/``skip_tags``/``limit`` are Ansible's.
    ``quiet=False`` also prints Ansible's own output. ``private_data_dir`` keeps ansible-runner's
    artifacts (job events, stdout) there; by default a temporary directory is used and removed.
    """
    root = project_root()
    playbook = playbook_for(stage, root)
    if inventory is None:
        inventory = root / "inventory" / "local.yml"
    if not isinstance(inventory, dict):
        inventory = Path(inventory).resolve()
        if not inventory.exists():
            raise FileNotFoundError(f"inventory {inventory} does not exist")
        inventory = str(inventory)
    try:
        import ansible_runner  # noqa: PLC0415 - heavy; only a run needs it
    except ImportError:
        raise PipelineError(
            "ansible-runner is not installed; run `make venv` and use .venv/bin/python"
        ) from None

    envvars = {"ANSIBLE_CONFIG": str(root / "ansible.cfg"), "PATH": runner_path()}
    if quiet or not sys.stdout.isatty():
        # ansible-runner gives ansible-playbook a pseudo-terminal: colours would land in the events.
        envvars["ANSIBLE_NOCOLOR"] = "1"
    events: list[dict] = []

    def handle(event: dict) -> bool:
        events.append(event)
        if on_event is not None:
            simple = simplify_event(event)
            if simple is not None:
                on_event(simple)
        return True

    def start(data_dir: str) -> RunResult:
        runner = ansible_runner.run(
            private_data_dir=data_dir,
            project_dir=str(root),
            playbook=str(playbook),
            inventory=inventory,
            extravars=dict(extravars or {}),
            cmdline="--check" if check else None,
            tags=_join(tags),
            skip_tags=_join(skip_tags),
            limit=limit,
            envvars=envvars,
            quiet=quiet,
            event_handler=handle,
        )
        stats = next((e.get("event_data") or {} for e in reversed(events) if e.get("event") == "playbook_on_stats"),
                     {})
        return RunResult(
            stage=stage,
            playbook=playbook,
            status=runner.status,
            rc=runner.rc if runner.rc is not None else 1,
            check=check,
            stats=host_stats(stats),
            paths=produced_paths(events),
            failures=task_failures(events),
            events=events,
        )

    if private_data_dir is not None:
        Path(private_data_dir).mkdir(parents=True, exist_ok=True)
        result = start(str(private_data_dir))
    else:
        with tempfile.TemporaryDirectory(prefix="eagle3-runner-") as data_dir:
            result = start(data_dir)
    if not result.ok:
        raise PipelineError(result.error_message(), result)
    return result


def _join(value: str | list[str] | None) -> str | None:
    if value is None or isinstance(value, str):
        return value or None
    return ",".join(value) or None


def host_stats(stats: dict) -> dict[str, HostStats]:
    """ansible-runner's stats (``{"ok": {host: n}, "dark": ...}``) per host."""
    names = {"ok": "ok", "changed": "changed", "failures": "failed", "skipped": "skipped",
             "dark": "unreachable", "rescued": "rescued", "ignored": "ignored"}
    hosts: dict[str, HostStats] = {}
    for key, counts in stats.items():
        if key not in names and key != "processed":
            continue
        for host, count in (counts or {}).items():
            record = hosts.setdefault(host, HostStats())
            if key in names:
                setattr(record, names[key], int(count))
    return dict(sorted(hosts.items()))


def result_message(res: dict) -> str:
    """The message of a failed task's result: its msg, the failed loop items', and stderr's last lines."""
    lines = []
    msg = res.get("msg")
    if isinstance(msg, list):
        msg = "\n".join(str(line) for line in msg)
    if msg:
        lines.append(str(msg))
    for item in res.get("results") or []:
        if isinstance(item, dict) and item.get("failed"):
            label = item.get("item", item.get("ansible_loop_var", ""))
            lines.append(f"item {label}: {result_message(item)}")
    for key in ("stderr", "module_stderr"):
        text = res.get(key)
        if isinstance(text, str) and text.strip():
            tail = text.strip().splitlines()[-STDERR_LINES_IN_MESSAGE:]
            lines.append(f"{key}:\n" + "\n".join(tail))
            break
    if res.get("rc") not in (None, 0) and "rc" not in " ".join(lines[:1]):
        lines.append(f"rc {res['rc']}")
    if not lines and res.get("exception"):
        lines.append(str(res["exception"]).strip().splitlines()[-1])
    return "\n".join(lines) or "failed with no message"


def _debug_message(res: dict) -> str | None:
    msg = res.get("msg")
    if isinstance(msg, list):
        return "\n".join(str(line) for line in msg)
    return None if msg is None else str(msg)


def simplify_event(event: dict) -> dict | None:
    """The progress event ``on_event`` gets for one of ansible-runner's events, or None for none.

    Keys: ``kind``, ``play``, ``task``, ``role``, ``host``, ``message``, ``counter`` and the raw
    ``event`` name; ``kind`` is one of ``start`` (message: the playbook), ``play``, ``task``,
    ``ok``, ``changed``, ``skipped``, ``failed`` (``ignored``: true when the run goes on),
    ``unreachable``, ``retry``, ``progress`` (a line an action plugin prints at each poll of a
    long stage: ``[host] step 40/200 ...``, ``host`` parsed out; or a check on a command that runs
    asynchronously: ``still running on the host ...``, ``task`` empty: the task started last runs
    it), ``warning``, ``output``
    (other lines of Ansible's output) and ``recap`` (``stats``: per host, as ``HostStats``
    fields; only the ``output`` lines of STAGE TIMES, the wall seconds per role, follow it).
    ``message`` holds the debug message of an ok result (a role's summary, its lines joined) and
    the failure message of a failed one.
    """
    name = event.get("event", "")
    data = event.get("event_data") or {}
    simple = {
        "kind": "",
        "event": name,
        "counter": event.get("counter"),
        "play": data.get("play", ""),
        "task": data.get("task", ""),
        "role": data.get("role", ""),
        "host": data.get("host"),
        "message": None,
    }
    stdout = (event.get("stdout") or "").replace("\r", "").strip()
    res = data.get("res") or {}
    if name == "playbook_on_start":
        simple.update(kind="start", message=data.get("playbook"))
    elif name == "playbook_on_play_start":
        simple.update(kind="play", play=data.get("name") or data.get("play", ""))
    elif name in ("playbook_on_task_start", "playbook_on_handler_task_start"):
        simple.update(kind="task")
    elif name == "runner_on_ok":
        simple.update(kind="changed" if res.get("changed") else "ok", message=_debug_message(res)
                      if data.get("task_action", "").endswith("debug") else None)
    elif name == "runner_on_skipped":
        simple.update(kind="skipped")
    elif name == "runner_on_failed":
        simple.update(kind="failed", message=result_message(res), ignored=bool(data.get("ignore_errors")))
    elif name == "runner_on_unreachable":
        simple.update(kind="unreachable", message=result_message(res))
    elif name == "runner_retry":
        simple.update(kind="retry", message=stdout)
    elif name == "runner_on_async_poll":
        # A long command running asynchronously on the host, checked on by the controller (once per poll).
        # ansible-runner names the event after its async_status check, not after the task that runs the
        # command (the task started last): no task name rather than that one.
        simple.update(kind="progress", task="", message="still running on the host (asynchronous job %s)"
                      % (data.get("jid") or res.get("ansible_job_id") or "?"))
    elif name in ("warning", "deprecated", "error"):
        simple.update(kind="warning", message=stdout)
    elif name == "verbose" and stdout:
        match = PROGRESS_LINE.match(stdout)
        if match and data.get("task"):
            simple.update(kind="progress", host=match["host"], message=match["message"])
        else:
            simple.update(kind="output", message=stdout)
    elif name == "playbook_on_stats":
        stats = {key: data.get(key) for key in ("ok", "changed", "failures", "skipped", "dark", "rescued",
                                                 "ignored", "processed")}
        simple.update(kind="recap", stats={host: vars(s) for host, s in host_stats(stats).items()})
    else:
        return None
    return simple


def task_failures(events: list[dict]) -> list[TaskFailure]:
    """Every failed task and unreachable host, in order.

    ``recovered``: under ``ignore_errors``, or on a host that the recap counts no failure for
    (every failure of it was rescued by a block's ``rescue``).
    """
    failed_hosts: dict[str, int] | None = None
    for event in events:
        if event.get("event") == "playbook_on_stats":
            data = event.get("event_data") or {}
            failed_hosts = {**(data.get("failures") or {}), **(data.get("dark") or {})}
    failures = []
    for event in events:
        name = event.get("event")
        if name not in ("runner_on_failed", "runner_on_unreachable"):
            continue
        data = event.get("event_data") or {}
        host = data.get("host", "?")
        rescued = failed_hosts is not None and not failed_hosts.get(host)
        failures.append(TaskFailure(
            task=data.get("task", "?"),
            host=host,
            message=result_message(data.get("res") or {}),
            play=data.get("play", ""),
            role=data.get("role", ""),
            action=data.get("task_action", ""),
            unreachable=name == "runner_on_unreachable",
            recovered=bool(data.get("ignore_errors")) or rescued,
        ))
    return failures


def _result_path(data: dict) -> str | None:
    """The path a task result names: the file written or read, else the module's output directory."""
    res = data.get("res") or {}
    args = (res.get("invocation") or {}).get("module_args") or {}
    # Not the module's ``src`` argument: for copy it is a temporary file on the host.
    for value in (res.get("dest"), res.get("path"), res.get("source"), args.get("output_dir")):
        if isinstance(value, str) and value.startswith("/"):
            return os.path.normpath(value)
    return None


def produced_paths(events: list[dict]) -> dict[str, str]:
    """The paths the run produced or confirmed: set_stats ``eagle3_pipeline_paths``, else well-known files."""
    paths: dict[str, str] = {}
    for event in events:
        data = event.get("event_data") or {}
        if event.get("event") != "runner_on_ok":
            continue
        action = (data.get("task_action") or "").rsplit(".", 1)[-1]
        # job_progress follows every stage's job: its stage option says whose output directory it names.
        stage = ((data.get("res") or {}).get("invocation") or {}).get("module_args", {}).get("stage")
        path = _result_path(data)
        if path is None:
            continue
        parts = Path(path).parts
        if path.endswith("/data_config.json") or (action, stage) == ("job_progress", "extraction"):
            paths["data_dir"] = os.path.dirname(path) if path.endswith(".json") else path
        elif parts[-2:] == ("drafter", "config.json"):
            # Not the training directory: the drafter may be exported elsewhere (eagle_training_drafter_dir).
            paths["drafter_dir"] = os.path.dirname(path)
        elif (action, stage) == ("job_progress", "training"):
            paths["training_dir"] = path
        elif data.get("role") == "gpu_reset" and action == "copy" and path.endswith(".json"):
            paths["gpu_reset_dir"] = os.path.dirname(path)
        elif path.endswith("/evaluation.json"):
            paths["evaluation"] = path
        elif parts[-2:] == ("report", "index.html"):
            paths["report"] = path
    for event in events:
        if event.get("event") == "playbook_on_stats":
            declared = ((event.get("event_data") or {}).get("artifact_data") or {}).get(PATHS_STATS_KEY) or {}
            if isinstance(declared, dict):
                paths.update({str(k): os.path.normpath(str(v)) for k, v in declared.items() if v})
    return dict(sorted(paths.items()))
