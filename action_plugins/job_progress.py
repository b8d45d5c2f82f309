"""The job_progress module's action: the loop of action_plugins/polling.py (see its docstring)."""

from __future__ import annotations

from ansible.plugins.loader import action_loader

ActionModule = action_loader.get("polling", class_only=True)
if ActionModule is None:  # pragma: no cover - both files ship in action_plugins/
    raise ImportError("action plugin polling not found next to job_progress")
