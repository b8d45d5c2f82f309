"""Shared test set-up: the project's module_utils importable as ansible.module_utils.<name>.

Ansible ships module_utils/ to the managed host under that package; tests import them the
same way, so the code under test is exactly what runs on a host.
"""

from __future__ import annotations

import sys
from pathlib import Path

import ansible.module_utils

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT / "module_utils") not in ansible.module_utils.__path__:
    ansible.module_utils.__path__.append(str(ROOT / "module_utils"))
if str(ROOT / "library") not in sys.path:
    sys.path.insert(0, str(ROOT / "library"))
