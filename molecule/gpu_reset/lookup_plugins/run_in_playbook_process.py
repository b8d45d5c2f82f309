"""Lookup run_in_playbook_process: run an argv list from the process that templates the lookup.

Used in a play keyword, it runs in the ansible-playbook process itself (not in a task worker,
which has its own session), so what it starts stays in the process group of molecule and
ansible-playbook. No shell is involved: the command is an argv list.
"""

from __future__ import annotations

import subprocess

from ansible.errors import AnsibleError
from ansible.plugins.lookup import LookupBase

DOCUMENTATION = r"""
name: run_in_playbook_process
short_description: Run an argv list from the templating process; return nothing
description:
  - Runs the given argv (a list of strings) without a shell and returns an empty string.
options:
  _terms:
    description: The argv list.
    required: true
"""


class LookupModule(LookupBase):
    """Run the argv; fail with its output when it fails."""

    def run(self, terms, variables=None, **kwargs):
        argv = [str(part) for part in (terms[0] if terms and isinstance(terms[0], list) else terms)]
        done = subprocess.run(argv, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise AnsibleError("%s exited %d: %s" % (argv[0], done.returncode, done.stderr.strip()))
        return [""]
