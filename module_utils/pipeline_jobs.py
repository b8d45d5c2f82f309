"""The pipeline's own running jobs, which the GPU reset never signals.

The extraction, the regeneration and the training run detached under this project's
supervisor: ``python -m eagle3_pipeline.cli supervise --name N --state-dir D ... start -- ARGV``
forks a supervisor in a session of its own, which starts ARGV (``... eagle3_pipeline.cli
extract|regenerate|train ...``) as its child and waits for it. A rerun of a stage finds the same
job running and waits on it, so the reset that comes first must leave it alone, whatever
``gpu_reset_match`` says: a SIGTERM would stop it (the training checkpoints and exits), a GPU it
holds would fail the wait for free GPUs.

A running job is found two ways, so that neither its supervisor's command line nor its state
file alone is needed:

- a live supervisor process whose command line starts such a job, with a child that is no
  longer a fork of it (the job, once executed);
- a state file ``<state_dir>/<name>.json`` of the supervisor whose job PID still runs with the
  recorded start time (what ``supervise status`` calls running: what the stage waits on), in
  the state directories given; it covers a job whose supervisor was killed.

Its processes: the job, its supervisor, every descendant of the job (torchrun runs in a
session of its own, its workers are its children) and every process of the supervisor's session
(what the job started and then left, a double fork). The server a job talks to
(``--server-url`` on this host: the capture or serving server) is spared with it while the job
runs: killing it would fail the job a moment later. Any other server stays stoppable; the
reset's job is to free GPUs from a leftover one.
"""

from __future__ import absolute_import, division, print_function

import glob
import json
import os
import socket
from urllib.parse import urlsplit

from ansible.module_utils.gpu_holders import PROC

CLI_MODULE = "eagle3_pipeline.cli"
CONSOLE_SCRIPT = "eagle3-pipeline"
JOB_KINDS = {"extract": "extraction", "regenerate": "regeneration", "train": "training"}
# supervise's options that take a value (the verb and the job's argv come after them).
SUPERVISE_VALUE_OPTIONS = ("--name", "--state-dir", "--log-file", "--env-file", "--cwd", "--grace-s")
TCP_LISTEN = "0A"


def cli_command(argv):
    """(subcommand, index of its first argument) when argv runs this package's CLI, else (None, None).

    The CLI runs as ``python [options] -m eagle3_pipeline.cli CMD ...`` (what the roles start, and
    a torchrun worker's ``... -m eagle3_pipeline.cli train``) or as the console script
    ``eagle3-pipeline CMD ...``.
    """
    if not argv:
        return None, None
    if os.path.basename(argv[0]) == CONSOLE_SCRIPT:
        return (argv[1], 2) if len(argv) > 1 else (None, None)
    for index in range(1, len(argv) - 2):
        if argv[index] == "-m" and argv[index + 1] == CLI_MODULE:
            return argv[index + 2], index + 3
    return None, None


def option_value(args, name):
    """The value of ``--name VALUE`` or ``--name=VALUE`` in args (before a ``--``), or None."""
    for index, arg in enumerate(args):
        if arg == "--":
            break
        if arg == name and index + 1 < len(args):
            return args[index + 1]
        if arg.startswith(name + "="):
            return arg[len(name) + 1:]
    return None


def supervised_argv(argv):
    """What a ``supervise ... start -- JOB`` command line starts: dict(name, state_dir, log_file, argv), or None.

    None for another verb, a ``--dry-run`` (it starts nothing) or another command.
    """
    command, first = cli_command(argv)
    if command != "supervise":
        return None
    args = argv[first:]
    index = 0
    while index < len(args):
        arg = args[index]
        if arg in SUPERVISE_VALUE_OPTIONS:
            index += 2
            continue
        if arg == "--dry-run":
            return None
        if arg.startswith("--") and "=" in arg:
            index += 1
            continue
        if arg != "start":
            return None
        job = args[index + 1:]
        if job[:1] == ["--"]:
            job = job[1:]
        options = args[:index]
        return {
            "name": option_value(options, "--name"),
            "state_dir": option_value(options, "--state-dir"),
            "log_file": option_value(options, "--log-file"),
            "argv": job,
        }
    return None


def job_kind(argv):
    """'extraction', 'regeneration' or 'training' for a job's argv, else None."""
    return JOB_KINDS.get(cli_command(argv)[0])


def _children(procs):
    by_parent = {}
    for proc in procs.values():
        by_parent.setdefault(proc.ppid, []).append(proc)
    return by_parent


def descendants(roots, by_parent):
    """PIDs of the roots and of every process below them."""
    found = set()
    stack = list(roots)
    while stack:
        pid = stack.pop()
        if pid in found:
            continue
        found.add(pid)
        stack.extend(child.pid for child in by_parent.get(pid, ()))
    return found


def _same_path(left, right):
    return os.path.realpath(os.path.expanduser(left)) == os.path.realpath(os.path.expanduser(right))


def is_local_host(host):
    """Whether a URL's host is this machine: loopback, or an address a socket here can bind."""
    if not host or host == "localhost":
        return True
    try:
        infos = socket.getaddrinfo(host, None)
    except (OSError, UnicodeError):
        return False
    for family, _type, _proto, _name, address in infos:
        ip = address[0]
        if ip.startswith("127.") or ip in ("::1", "0.0.0.0", "::"):
            return True
        try:
            probe = socket.socket(family, socket.SOCK_DGRAM)
        except OSError:
            continue
        try:
            probe.bind((ip, 0))
            return True
        except OSError:
            pass
        finally:
            probe.close()
    return False


def url_port(url):
    """(host, port) of an http(s) URL, or None when it has no usable port."""
    try:
        parts = urlsplit(url)
        port = parts.port or {"http": 80, "https": 443}.get(parts.scheme)
    except ValueError:
        return None
    return (parts.hostname or "", port) if port else None


def listening_inodes(port, proc_root=PROC):
    """Socket inodes listening on a TCP port (IPv4 and IPv6), from /proc/net/tcp{,6}."""
    inodes = set()
    for name in ("tcp", "tcp6"):
        try:
            with open(os.path.join(proc_root, "net", name)) as handle:
                lines = handle.readlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) < 10 or fields[3] != TCP_LISTEN:
                continue
            if int(fields[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(fields[9])
    return inodes


def socket_owners(inodes, procs, proc_root=PROC):
    """PIDs that have one of these socket inodes open."""
    wanted = set("socket:[%s]" % inode for inode in inodes)
    owners = set()
    if not wanted:
        return owners
    for pid in procs:
        base = os.path.join(proc_root, str(pid), "fd")
        try:
            fds = os.listdir(base)
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(os.path.join(base, fd)) in wanted:
                    owners.add(pid)
                    break
            except OSError:
                continue
    return owners


class PipelineJob(object):
    """One running job of the pipeline and the processes it is made of."""

    def __init__(self, name, kind, job, supervisor, argv, state_dir=None, log_file=None, found_by="supervisor"):
        self.name = name
        self.kind = kind
        self.job = job  # ProcInfo of the job's own process (the supervisor's child)
        self.supervisor = supervisor  # ProcInfo, or None when the supervisor is gone
        self.argv = argv
        self.state_dir = state_dir
        self.log_file = log_file
        self.found_by = found_by
        self.output_dir = option_value(argv, "--output-dir")
        self.server_url = option_value(argv, "--server-url")
        self.this_run = None  # True/False once the run's output directories are known
        self.pids = set()
        self.server_pids = set()
        self.server_port = None

    @property
    def label(self):
        """'training eagle3-train-x (pid 123)'."""
        return "%s %s (pid %d)" % (self.kind, self.name, self.job.pid)

    def reason(self):
        """Why the job's own processes are left alone."""
        if self.this_run is False:
            return (
                "this pipeline's running %s of another run (output directory %s, not this run's): never stopped "
                "by the reset (gpu_reset_spare_pipeline_jobs); it keeps its GPUs" % (self.label, self.output_dir)
            )
        return "this pipeline's running %s: its stage waits on it (gpu_reset_spare_pipeline_jobs)" % self.label

    def server_reason(self):
        """Why the server the job uses is left alone."""
        return (
            "the server on port %d that this pipeline's running %s uses: left running while the job needs it "
            "(gpu_reset_spare_pipeline_jobs)" % (self.server_port, self.label)
        )

    def as_dict(self, holders=None):
        """A JSON-ready record; ``holders`` ({pid: Holder}) adds the GPUs and files its processes hold."""
        record = {
            "name": self.name,
            "kind": self.kind,
            "pid": self.job.pid,
            "cmdline": self.job.display,
            "supervisor_pid": self.supervisor.pid if self.supervisor else None,
            "found_by": self.found_by,
            "state_dir": self.state_dir,
            "log_file": self.log_file,
            "output_dir": self.output_dir,
            "this_run": self.this_run,
            "server_url": self.server_url,
            "pids": sorted(self.pids),
            "server_pids": sorted(self.server_pids),
            "reason": self.reason(),
        }
        if holders is not None:
            held = [holders[pid] for pid in sorted(self.pids | self.server_pids) if pid in holders]
            record["holder_pids"] = [holder.proc.pid for holder in held]
            record["gpus"] = sorted(set(gpu for holder in held for gpu in holder.gpus))
            record["devices"] = sorted(set(path for holder in held for path in holder.devices))
        return record


def _alive(proc):
    return proc is not None and proc.state not in ("Z", "X", "x")


def _from_supervisors(procs, by_parent, shielded):
    """Jobs whose supervisor runs: {job pid: PipelineJob}."""
    jobs = {}
    for proc in procs.values():
        if proc.pid in shielded or not _alive(proc):
            continue
        started = supervised_argv(proc.argv)
        if started is None:
            continue
        kind = job_kind(started["argv"])
        if kind is None:
            continue
        # The job is the child that has executed its argv; a child still holding the supervisor's
        # own argv is a fork not executed yet (and the `supervise start` caller's child is the
        # short-lived intermediate, also a fork): no job yet.
        executed = [child for child in by_parent.get(proc.pid, ()) if child.argv != proc.argv and _alive(child)]
        if not executed:
            continue
        job = min(executed, key=lambda child: child.starttime)
        jobs[job.pid] = PipelineJob(
            started["name"] or "?", kind, job, proc, started["argv"], started["state_dir"], started["log_file"]
        )
    return jobs


def _from_state_files(procs, state_dirs, shielded, jobs):
    """Add the jobs that supervisor state files in state_dirs record as running."""
    for state_dir in state_dirs or ():
        for path in sorted(glob.glob(os.path.join(state_dir, "*.json"))):
            try:
                with open(path) as handle:
                    state = json.load(handle)
                pid, start = int(state["pid"]), state.get("pid_start_time")
                argv = list(state["argv"])
            except (OSError, ValueError, KeyError, TypeError):
                continue
            proc = procs.get(pid)
            if pid in jobs or pid in shielded or not _alive(proc) or proc.starttime != start:
                continue
            kind = job_kind(argv)
            if kind is None or state.get("exit_code") is not None:
                continue
            supervisor = procs.get(state.get("supervisor_pid") or 0)
            if not (_alive(supervisor) and supervisor.pid == proc.ppid):
                supervisor = None
            name = state.get("name") or os.path.basename(path)[: -len(".json")]
            jobs[pid] = PipelineJob(
                name, kind, proc, supervisor, argv, state_dir, state.get("log_file"), found_by="state file"
            )


def _session_members(sid, procs, shielded):
    """PIDs of a session that belongs to a job alone, or nothing when it is shared.

    The supervisor's session is its own: its leader (the supervisor's parent, which set it up)
    has exited. A session whose leader still runs, or that holds this run, is somebody else's.
    """
    if sid <= 1 or sid in procs:
        return set()
    members = set(proc.pid for proc in procs.values() if proc.sid == sid)
    return set() if members & shielded else members


def _server_root(pid, procs):
    """The server to spare for a listener: its supervisor when it runs under one, else itself."""
    parent = procs.get(procs[pid].ppid)
    if parent is not None and parent.pid > 1 and supervised_argv(parent.argv) is not None:
        return parent.pid
    return pid


def find_jobs(procs, shielded, state_dirs=(), output_dirs=(), proc_root=PROC):
    """The pipeline's running jobs, with their processes and the servers they use: [PipelineJob].

    ``shielded``: PIDs never counted (the caller's ancestors); ``output_dirs``: this run's output
    directories (when given, a job writing elsewhere is marked as another run's).
    """
    by_parent = _children(procs)
    jobs = _from_supervisors(procs, by_parent, shielded)
    _from_state_files(procs, state_dirs, shielded, jobs)
    for job in jobs.values():
        roots = [job.job.pid] + ([job.supervisor.pid] if job.supervisor else [])
        roots += sorted(_session_members(job.job.sid, procs, shielded))
        job.pids = descendants(roots, by_parent) - shielded
        if output_dirs and job.output_dir:
            job.this_run = any(_same_path(job.output_dir, mine) for mine in output_dirs)
    taken = set(pid for job in jobs.values() for pid in job.pids)
    for job in sorted(jobs.values(), key=lambda j: j.job.pid):
        address = url_port(job.server_url) if job.server_url else None
        if address is None or not is_local_host(address[0]):
            continue
        job.server_port = address[1]
        listeners = socket_owners(listening_inodes(address[1], proc_root), procs, proc_root)
        for pid in sorted(listeners - taken - shielded):
            if pid <= 1 or procs[pid].is_kernel_thread:
                continue
            job.server_pids |= descendants([_server_root(pid, procs)], by_parent) - shielded - taken
    return sorted(jobs.values(), key=lambda j: j.job.pid)


def spared_reasons(jobs):
    """{pid: reason} of every process of the jobs and of the servers they use."""
    reasons = {}
    for job in jobs:
        for pid in job.server_pids:
            reasons.setdefault(pid, job.server_reason())
        for pid in job.pids:
            reasons[pid] = job.reason()
    return reasons


def spared_labels(jobs):
    """{pid: 'training NAME (pid N)'}: which job each spared process belongs to (for the GPUs' report)."""
    labels = {}
    for job in jobs:
        for pid in job.pids | job.server_pids:
            labels.setdefault(pid, job.label)
    return labels
