"""The polling loop of the modules that wait on a host: job_progress (every stage's job), sglang_server_info.

Not an action of its own: those two action plugins are this class (they load it through
Ansible's plugin loader; action plugins are not importable as a package).

A wait of hours (a server loading a big model) or days (an extraction, a training) over SSH is
many short calls of the module, not one long one: each call looks at the host for at most the
module's ``wait_s`` and returns (one SSH round trip, which NAT and firewalls do not drop as idle),
and this plugin, on the controller, prints the call's one-line ``msg`` and calls the module again
until the module says ``finished``, fails (the job died or failed, the server's process exited, the
timeout passed), or (``follow: false``) after the first call. Each call gets ``waited_s``, the
seconds this task has waited so far by the controller's clock, from which the module counts its
timeout: no epoch deadline is compared across two hosts' clocks.

Why here and not ``until``/``retries``: the default callback prints ``FAILED - RETRYING: ...
(N retries left)`` for every retry and shows the result itself only from ``-vv`` on, and a module
cannot change that (Ansible strips the ``_ansible_*`` keys from a module's result). An action
plugin may print: the line (``[host] part 0/2: 412/1000 samples, ...``) goes through Ansible's
display, which the worker processes hand to the controller as it comes, so every stdout callback
and ansible-runner (as a ``verbose`` event of the task) get it in order, during the wait. A failure
is left to the callback, which prints its message once.

A call that cannot reach the host (the connection dropped) is tried again, after a reset of the
connection (for ssh: a new control master), up to ``RECONNECT_TRIES`` times: the modules only look
(the jobs run detached under the supervisor), so looking again is harmless.
"""

from __future__ import annotations

import time

from ansible.errors import AnsibleConnectionFailure
from ansible.module_utils.parsing.convert_bool import boolean
from ansible.plugins.action import ActionBase
from ansible.utils.display import Display

display = Display()

# Two calls start at least this many seconds apart (wait_s 0 with follow would spin otherwise).
MIN_INTERVAL_S = 1.0
# A call that cannot reach the host: tried again this many times, wait_s apart (within these bounds).
RECONNECT_TRIES = 3
RECONNECT_DELAY_S = (1.0, 30.0)


def _seconds(value, default):
    try:
        return float(value)
    except (TypeError, ValueError):
        return default


class ActionModule(ActionBase):
    """Call the module of the task's name until it is finished or failed, printing its ``msg`` after each call."""

    _supports_check_mode = True
    _supports_async = False

    def run(self, tmp=None, task_vars=None):
        """Run the loop; the result is the last call's, with ``polls`` (the number of calls)."""
        result = super().run(tmp, task_vars)
        del tmp  # no effect since ansible-core 2.10
        task_vars = task_vars or {}
        host = task_vars.get("inventory_hostname", self._task.get_name())
        args = dict(self._task.args)
        follow = boolean(args.get("follow", True), strict=False)
        wait_s = _seconds(args.get("wait_s"), 30.0)
        start = time.monotonic()
        polls = 0
        try:
            while True:
                began = time.monotonic()
                reply = self._call(dict(args, waited_s=round(began - start, 3)), task_vars, host, wait_s)
                polls += 1
                if reply.get("failed") or reply.get("skipped"):
                    break
                if reply.get("msg"):
                    display.display("[%s] %s" % (host, reply["msg"]))
                if reply.get("finished") or not follow:
                    break
                pause = MIN_INTERVAL_S - (time.monotonic() - began)
                if pause > 0:
                    time.sleep(pause)
        finally:
            self._remove_tmp_path(self._connection._shell.tmpdir)
        result.update(reply)
        result["polls"] = polls
        return result

    def _call(self, module_args, task_vars, host, wait_s):
        """One call of the module; a connection that failed is reset and tried again a few times."""
        delay = min(max(wait_s, RECONNECT_DELAY_S[0]), RECONNECT_DELAY_S[1])
        for attempt in range(1, RECONNECT_TRIES + 2):
            try:
                return self._execute_module(module_args=dict(module_args), task_vars=task_vars)
            except AnsibleConnectionFailure as exc:
                if attempt > RECONNECT_TRIES:
                    raise
                reason = (str(exc).strip().splitlines() or ["no message"])[-1]
                display.display("[%s] lost the connection (%s); looking again in %g s (retry %d of %d)"
                                % (host, reason[:200], delay, attempt, RECONNECT_TRIES))
                try:
                    self._connection.reset()
                except Exception as reset_error:  # noqa: BLE001 - the next try reports what matters
                    display.vvv("connection reset failed: %s" % reset_error, host=host)
                time.sleep(delay)
        raise AssertionError("unreachable")  # pragma: no cover
