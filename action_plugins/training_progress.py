"""Action plugin for the training_progress module: run it, then print its progress line.

The same job as action_plugins/extraction_progress.py (see its docstring: the default callback
shows nothing of a retried task's result below ``-vv``, so the plugin prints the module's
one-line ``msg`` through Ansible's display after every call), for the training's polls:
``[host] step 40/200 (epoch 1), loss 3.21, ...``. Its class is that plugin's, found through
Ansible's own plugin loader (action plugins are not importable as a package).
"""

from __future__ import annotations

from ansible.plugins.loader import action_loader

ActionModule = action_loader.get("extraction_progress", class_only=True)
if ActionModule is None:  # pragma: no cover - both files ship in action_plugins/
    raise ImportError("action plugin extraction_progress not found next to training_progress")
