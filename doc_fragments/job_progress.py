"""Documentation shared by the modules that follow a supervised job's progress (module_utils/job_progress.py)."""

from __future__ import absolute_import, division, print_function


class ModuleDocFragment(object):
    """The job's options (C(extends_documentation_fragment: job_progress)) and the returns they share."""

    DOCUMENTATION = r"""
options:
  state_dir:
    description:
      - The supervisor's state directory (C(eagle3-pipeline supervise --state-dir)).
      - Without it only the progress file's own C(pid) is checked, with no exit code to report.
    type: path
  name:
    description: The supervised job's name (C(eagle3-pipeline supervise --name)); needed with O(state_dir).
    type: str
  log_file:
    description: The job's log, whose last lines go into failure messages; default C(<state_dir>/<name>.log).
    type: path
  log_lines:
    description: How many of the log's last lines a failure message shows.
    type: int
    default: 30
  poll_s:
    description: Seconds between reads of the progress file within one call.
    type: float
    default: 0.5
  timeout_s:
    description:
      - Seconds the task waits in all (counted from O(waited_s), across calls) before it fails,
        saying that the job keeps running. Unset, it waits without limit.
    type: float
notes:
  - Supports check mode; it only reads in either mode.
  - Changes nothing.
"""
