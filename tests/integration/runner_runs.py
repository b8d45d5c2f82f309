"""Running one of the project's playbooks through ansible-runner, as Python programs drive it."""

from __future__ import annotations

from pathlib import Path

import ansible_runner

from eagle3_pipeline.cli import runner_path

ROOT = Path(__file__).resolve().parents[2]


def run_project_playbook(private_data_dir: Path, playbook: Path, inventory: Path | list[str], extravars: dict,
                         check: bool = False, event_handler=None, tags: str | None = None):
    """The finished ``ansible_runner.Runner`` of ``playbook`` (quiet; no colours in its stdout).

    ``inventory``: one file, or several (each one a ``-i``, as an operator may give them).
    ``event_handler``: called with each event as the run goes (ansible-runner's own hook), for a
    test that acts at a given task; it returns True to keep the event. ``tags``: --tags, as an operator gives them.
    """
    cmdline = " ".join((["--check"] if check else []) + ([f"--tags={tags}"] if tags else [])) or None
    return ansible_runner.run(
        private_data_dir=str(private_data_dir),
        playbook=str(playbook),
        inventory=inventory if isinstance(inventory, list) else str(inventory),
        extravars=extravars,
        cmdline=cmdline,
        # PATH: ansible-runner finds ansible-playbook there; the venv needs no activation.
        envvars={"ANSIBLE_CONFIG": str(ROOT / "ansible.cfg"), "PATH": runner_path(), "ANSIBLE_NOCOLOR": "1"},
        quiet=True,
        event_handler=event_handler,
    )
