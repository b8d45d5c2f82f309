"""Tasks that run on the controller (delegate_to: localhost) never take the host's become.

An operator's inventory sets ``ansible_become: true`` for the hosts; a task delegated to the
controller inherits it, so Ansible would run sudo on the operator's laptop (a password prompt, or
root-owned files in the checkout). Every such task, or a block around it, says ``become: false``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
SECTIONS = ("block", "rescue", "always")
CONTROLLER = ("localhost", "127.0.0.1")


def task_files() -> list[Path]:
    """Every task list the roles and playbooks hold."""
    return sorted(ROOT.glob("roles/*/tasks/*.yml")) + sorted(ROOT.glob("playbooks/*.yml"))


def delegated_without_become_false(tasks: list, become=None, delegate=None, where: str = "") -> list[str]:
    """Names of tasks delegated to the controller whose own or inherited become is not false.

    A block passes its become and its delegate_to on to the tasks inside it.
    """
    found = []
    for task in tasks or []:
        if not isinstance(task, dict):
            continue
        own = task.get("become", become)
        target = task.get("delegate_to", delegate)
        if "tasks" in task and "hosts" in task:  # a play
            found += delegated_without_become_false(task["tasks"], task.get("become"), None, where)
            continue
        if any(section in task for section in SECTIONS):
            for section in SECTIONS:
                found += delegated_without_become_false(task.get(section), own, target,
                                                        f"{where}{task.get('name', '?')} > ")
            continue
        if target in CONTROLLER and own is not False:
            found.append(where + task.get("name", "?"))
    return found


@pytest.mark.parametrize("path", task_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_tasks_on_the_controller_do_not_inherit_the_hosts_become(path):
    offending = delegated_without_become_false(yaml.safe_load(path.read_text()))
    assert not offending, f"{path.relative_to(ROOT)}: delegated to the controller without become: false: {offending}"


def test_the_check_finds_a_delegated_task_that_inherits_become():
    tasks = [{"name": "outer", "become": True, "block": [{"name": "write here", "delegate_to": "localhost"}]},
             {"name": "on the controller", "delegate_to": "localhost", "block": [{"name": "inherits it"}]},
             {"name": "fine", "delegate_to": "localhost", "become": False}]
    assert delegated_without_become_false(tasks) == ["outer > write here", "on the controller > inherits it"]
