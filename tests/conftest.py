"""Shared test set-up: the project's module_utils importable as ansible.module_utils.<name>.

Ansible ships module_utils/ to the managed host under that package; tests import them the
same way, so the code under test is exactly what runs on a host.
"""

from __future__ import annotations

import sys
from pathlib import Path

# torch._dynamo registers a stand-in for sys.intern when it is first imported, and refuses if
# ansible.module_utils (imported by the module tests) has already patched sys.intern. Importing
# it first, once per test process, keeps the model tests working in the same session.
try:
    import torch._dynamo  # noqa: F401
except ImportError:  # a GPU-less helper machine without torch: nothing to protect
    pass

import ansible.module_utils

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT / "module_utils") not in ansible.module_utils.__path__:
    ansible.module_utils.__path__.append(str(ROOT / "module_utils"))
if str(ROOT / "library") not in sys.path:
    sys.path.insert(0, str(ROOT / "library"))
