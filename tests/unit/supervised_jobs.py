"""Stand-in jobs for the progress modules' tests: real processes under the real supervisor.

Each job writes a progress file as the jobs' contract says (``state``, the stage's counts or
figures, its own ``pid``, ``started`` and ``updated``), prints a line to its log, then sleeps or
exits with a given code. The progress may also be written by a child process (another PID), as
torchrun's rank 0 writes a training's. Every job a test starts is stopped when it ends.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from process_checks import wait_for

SUPERVISE = [sys.executable, "-m", "eagle3_pipeline.cli", "supervise"]

# argv: the progress file, the document (JSON, without pid and times), then "sleep" or an exit code,
# and who writes the file ("self", or "child": another process, as torchrun's rank 0).
JOB = (
    "import json, os, subprocess, sys, time\n"
    "path, document, then, writer = sys.argv[1:5]\n"
    "state = json.loads(document)['state']\n"
    "WRITE = '''\n"
    "import json, os, sys, time\n"
    "path, document = sys.argv[1], json.loads(sys.argv[2])\n"
    "document.update(pid=os.getpid(), started=time.time(), updated=time.time())\n"
    "os.makedirs(os.path.dirname(path), exist_ok=True)\n"
    "with open(path + '.tmp', 'w') as handle:\n"
    "    json.dump(document, handle)\n"
    "os.replace(path + '.tmp', path)\n"
    "'''\n"
    "if writer == 'self':\n"
    "    sys.argv = [sys.argv[0], path, document]\n"
    "    exec(WRITE)\n"
    "else:\n"
    "    subprocess.run([sys.executable, '-c', WRITE, path, document], check=True)\n"
    "print('job: wrote ' + state, flush=True)\n"
    "if then == 'sleep':\n"
    "    time.sleep(300)\n"
    "sys.exit(int(then))\n"
)


class Jobs:
    """Jobs started under the real supervisor in one state directory; all stopped at the end."""

    def __init__(self, root: Path, output_dir: Path, progress_file: Path, module_args: dict | None = None):
        self.root = root
        self.state_dir = root / "state"
        self.output_dir = output_dir
        self.progress_file = progress_file
        self.module_args = dict(module_args or {})
        self.names: list[str] = []

    def supervise(self, name: str, *args: str) -> dict:
        done = subprocess.run(
            [*SUPERVISE, "--name", name, "--state-dir", str(self.state_dir), *args],
            capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout)

    def run(self, name: str, *command: str) -> dict:
        """Start any command as the job ``name``; return the supervisor's answer."""
        self.names.append(name)
        return self.supervise(name, "--log-file", str(self.log(name)), "start", "--", *command)

    def start(self, document: dict, then: str, name: str = "job", writer: str = "self", script: str = JOB) -> dict:
        """Start a stand-in job writing ``document``; return once its progress file is written (after it started)."""
        record = self.run(name, sys.executable, "-c", script, str(self.progress_file), json.dumps(document), then,
                          writer)

        def written():
            if not self.progress_file.exists():
                return False
            progress = json.loads(self.progress_file.read_text())
            return progress["pid"] == record["pid"] or progress["updated"] >= self.record(name)["started_at"]

        wait_for(written, 20, "the job's progress file")
        return record

    def record(self, name: str = "job") -> dict:
        return json.loads((self.state_dir / f"{name}.json").read_text())

    def wait_ended(self, name: str = "job") -> dict:
        """Wait until the supervisor recorded the job's exit; return the record."""
        wait_for(lambda: self.record(name).get("exit_code") is not None, 20, "the supervisor to record the exit")
        return self.record(name)

    def log(self, name: str = "job") -> Path:
        return self.state_dir / f"{name}.log"

    def args(self, name: str = "job", **extra) -> dict:
        """The module's options for the job ``name``: one look (wait_s 0) unless ``extra`` says otherwise."""
        return {"output_dir": str(self.output_dir), "state_dir": str(self.state_dir), "name": name, "wait_s": 0,
                **self.module_args, **extra}

    def stop_all(self) -> None:
        for name in self.names:
            subprocess.run([*SUPERVISE, "--name", name, "--state-dir", str(self.state_dir), "--grace-s", "1", "stop"],
                           capture_output=True, timeout=60, check=False)
