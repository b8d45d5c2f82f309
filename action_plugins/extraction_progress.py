"""Action plugin for the extraction_progress module: call it until done, printing its progress line after each call.

The loop is action_plugins/polling.py's (see its docstring): one task, many short calls of the
module (each one SSH round trip of at most its ``wait_s``), the module's one-line ``msg``
printed on the controller after each, and no ``until``, so no ``FAILED - RETRYING`` lines.
Its class is that plugin's, found through Ansible's own plugin loader (action plugins are not
importable as a package).
"""

from __future__ import annotations

from ansible.plugins.loader import action_loader

ActionModule = action_loader.get("polling", class_only=True)
if ActionModule is None:  # pragma: no cover - both files ship in action_plugins/
    raise ImportError("action plugin polling not found next to extraction_progress")
