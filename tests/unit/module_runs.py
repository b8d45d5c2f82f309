"""Running an Ansible module's ``main()`` in-process, as ansible-core's own tests do."""

from __future__ import annotations

import json

import pytest
from ansible.module_utils.testing import patch_module_args

# For the progress modules' waits: far longer than a look at a job takes on any machine (a few files and
# /proc read: milliseconds), so that "within a poll" tells a wait that returned at its first look from
# one that slept, and "within wait_s" one that returned on a change or a deadline from one that ran out.
POLL_S = 5.0
WAIT_S = 30


def run_module(module, args, capsys, check_mode=False):
    """Run ``module.main()`` with ``args``; return (exit code, parsed JSON result)."""
    args = dict(args)
    if check_mode:
        args["_ansible_check_mode"] = True
    with patch_module_args(args), pytest.raises(SystemExit) as exc:
        module.main()
    return exc.value.code, json.loads(capsys.readouterr().out)
