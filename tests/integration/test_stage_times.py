"""The stage_times callback (playbooks/callback_plugins/stage_times.py), on a real playbook run through ansible-runner:
after the recap, the wall seconds each role held the run, the playbook's total and the slowest tasks."""

from __future__ import annotations

import re
import sys
import time

import ansible_runner
from runner_runs import ROOT

from eagle3_pipeline.cli import runner_path

SLEEP_S = 1.5


def test_each_role_s_wall_time_and_the_slowest_tasks_follow_the_recap(tmp_path):
    tasks = tmp_path / "roles" / "slow_role" / "tasks"
    tasks.mkdir(parents=True)
    (tasks / "main.yml").write_text(
        f"- name: Sleep in the role\n  ansible.builtin.command:\n    argv: [sleep, '{SLEEP_S}']\n"
        "  changed_when: false\n")
    # Beside the playbook, as beside the project's own (where ansible-runner, which sets its own callback path,
    # finds it too).
    (tmp_path / "callback_plugins").symlink_to(ROOT / "playbooks" / "callback_plugins")
    playbook = tmp_path / "play.yml"
    playbook.write_text(
        "- name: Time a role\n  hosts: localhost\n  gather_facts: false\n  roles: [slow_role]\n"
        "  tasks:\n    - name: Say hello\n      ansible.builtin.debug:\n        msg: hello\n")
    (tmp_path / "private").mkdir()
    began = time.monotonic()
    runner = ansible_runner.run(
        private_data_dir=str(tmp_path / "private"), playbook=str(playbook), inventory=["localhost,"],
        extravars={"ansible_connection": "local", "ansible_python_interpreter": sys.executable},
        envvars={"ANSIBLE_CONFIG": str(ROOT / "ansible.cfg"), "PATH": runner_path(), "ANSIBLE_NOCOLOR": "1",
                 "ANSIBLE_ROLES_PATH": str(tmp_path / "roles")},
        quiet=True)
    wall = time.monotonic() - began
    assert runner.rc == 0, runner.stdout.read()
    stdout = runner.stdout.read()
    after = stdout[stdout.index("PLAY RECAP"):]
    assert "STAGE TIMES (wall seconds per role" in after, stdout
    role = float(re.search(r"^slow_role +([0-9.]+) s$", after, re.M).group(1))
    outside = float(re.search(r"^\(outside roles\) +([0-9.]+) s$", after, re.M).group(1))
    total = float(re.search(r"^playbook +([0-9.]+) s$", after, re.M).group(1))
    assert SLEEP_S <= role <= total <= wall
    assert outside < role and role + outside <= total + 0.1  # printed to 0.1 s
    slowest = re.search(r"^slowest tasks: (.*)$", after, re.M).group(1)
    assert slowest.startswith("slow_role : Sleep in the role "), slowest
    assert "Say hello" in slowest
