"""Action plugin for the extraction_progress module: run it, then print its progress line.

The role waits for an extraction part with ``until: result.finished`` and many retries. The
default callback prints only ``FAILED - RETRYING: ... (N retries left)`` for each retry, and
shows the result itself only from ``-vv`` on; a module cannot change that, because Ansible
strips the ``_ansible_*`` keys (``_ansible_verbose_always``) from a module's result. An action
plugin runs on the controller and may print: after each call of the module it shows the
module's one-line ``msg`` (``[host] part 0/2: 412/1000 samples, ...``) through Ansible's own
display, which the worker processes hand to the controller, so every stdout callback and
ansible-runner get it in order. A failure is left to the callback, which prints its message.
"""

from __future__ import annotations

from ansible.plugins.action import ActionBase
from ansible.utils.display import Display

display = Display()


class ActionModule(ActionBase):
    """Run the module of the same name and print its progress line."""

    _supports_check_mode = True
    _supports_async = False

    def run(self, tmp=None, task_vars=None):
        """Execute the module; print ``msg`` unless the call failed or was skipped."""
        result = super().run(tmp, task_vars)
        del tmp  # no effect since ansible-core 2.10
        result.update(self._execute_module(task_vars=task_vars))
        self._remove_tmp_path(self._connection._shell.tmpdir)
        if not result.get("failed") and not result.get("skipped") and result.get("msg"):
            host = (task_vars or {}).get("inventory_hostname", self._task.get_name())
            display.display("[%s] %s" % (host, result["msg"]))
        return result
