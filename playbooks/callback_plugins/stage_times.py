"""Where a playbook's time went: wall seconds per role and the slowest tasks, printed after the recap.

Enabled in ansible.cfg (``callbacks_enabled``). A task's time runs from its start to the next task's start (or
the end of the play): with the default linear strategy every host is in step, so that is the wall time the
task held the run, waits on long jobs included.
"""

from __future__ import annotations

import time

from ansible.plugins.callback import CallbackBase

DOCUMENTATION = """
name: stage_times
type: aggregate
short_description: wall seconds per role and the slowest tasks, after the recap
description:
  - After the play recap, prints the wall seconds each role held the run, the tasks outside roles together,
    the playbook's total and its slowest tasks.
  - A task's time runs from its start to the next task's start or the end of its play.
requirements:
  - enabled in ansible.cfg (callbacks_enabled = stage_times)
"""

SLOWEST = 5  # how many of the slowest tasks the last line names
OUTSIDE_ROLES = "(outside roles)"


class CallbackModule(CallbackBase):
    CALLBACK_VERSION = 2.0
    CALLBACK_TYPE = "aggregate"
    CALLBACK_NAME = "stage_times"
    CALLBACK_NEEDS_ENABLED = True

    def __init__(self):
        super().__init__()
        self._began = time.monotonic()
        self._current: tuple[str, str, float] | None = None  # (role, task name, start)
        self._roles: dict[str, float] = {}
        self._tasks: list[tuple[float, str]] = []

    def _close(self) -> None:
        if self._current is None:
            return
        role, name, start = self._current
        seconds = time.monotonic() - start
        self._roles[role] = self._roles.get(role, 0.0) + seconds
        self._tasks.append((seconds, name))
        self._current = None

    def _start(self, task) -> None:
        self._close()
        role = task._role.get_name() if task._role else OUTSIDE_ROLES  # noqa: SLF001 - ansible's own attribute
        self._current = (role, task.get_name().strip(), time.monotonic())  # the name says "role : task"

    def v2_playbook_on_task_start(self, task, is_conditional):
        self._start(task)

    def v2_playbook_on_handler_task_start(self, task):
        self._start(task)

    def v2_playbook_on_play_start(self, play):
        self._close()  # a play's gathering and setup are not the last task's

    def v2_playbook_on_stats(self, stats):
        self._close()
        total = time.monotonic() - self._began
        if not self._tasks:
            return
        width = max(len(role) for role in self._roles)
        lines = [f"{role:<{width}} {seconds:9.1f} s" for role, seconds in self._roles.items()]
        lines.append(f"{'playbook':<{width}} {total:9.1f} s")
        slowest = sorted(self._tasks, reverse=True)[:SLOWEST]
        lines.append("slowest tasks: " + "; ".join(f"{name} {seconds:.1f} s" for seconds, name in slowest))
        self._display.banner("STAGE TIMES (wall seconds per role, in the order they first ran)")
        for line in lines:
            self._display.display(line)
