"""Documentation shared by the modules that action_plugins/polling.py calls in a loop."""

from __future__ import absolute_import, division, print_function


class ModuleDocFragment(object):
    """The polling options (C(extends_documentation_fragment: polling))."""

    DOCUMENTATION = r"""
options:
  wait_s:
    description:
      - Longest wait, in seconds, of one call of the module on the host (one SSH round trip); the
        call returns earlier when what it waits for happens (0 returns at once).
      - With O(follow), its action plugin prints the call's C(msg) and calls the module again.
    type: float
    default: 30
  follow:
    description:
      - Call the module again and again until it is finished, fails, or its timeout passed,
        printing C(msg) after each call; the loop runs in the action plugin, on the controller.
      - V(false) makes one call, which returns after at most O(wait_s).
    type: bool
    default: true
  waited_s:
    description:
      - Seconds that earlier calls of the same task waited, counted on the controller; the action
        plugin sets it on every call, and the module's timeout counts from it. Leave it unset.
    type: float
    default: 0
notes:
  - Its action plugin (action_plugins/polling.py) runs the wait as many short calls of the module,
    each one SSH round trip of at most O(wait_s), and prints C(msg) on the controller after each
    (C([host] msg), through Ansible's display, with no C(-v) needed). Use it without C(until),
    as a task retried with C(until) prints C(FAILED - RETRYING) for every retry.
  - A call that cannot reach the host (a dropped connection) is tried again a few times, after a
    reset of the connection, before the task is reported unreachable.
"""
