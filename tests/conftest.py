"""Shared test set-up: the project's module_utils importable as ansible.module_utils.<name>.

Ansible ships module_utils/ to the managed host under that package; tests import them the
same way, so the code under test is exactly what runs on a host.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

# The tests run many torch processes at once on few cores (three xdist workers, and the servers,
# extractions and trainings they start), each with as many OpenMP threads as cores. An idle OpenMP
# thread of torch's libgomp spins on its core for about 300,000 rounds before it sleeps, taking the
# cores from the other processes' work: three such processes on two cores ran a loop 5 times slower
# than with a short spin. A short spin changes no result (it is how threads wait, not what they
# compute), and keeps a lone process as fast. Set before torch is first imported (libgomp reads it
# when it loads); every process the tests start inherits it. An explicit setting wins.
os.environ.setdefault("GOMP_SPINCOUNT", "1000")

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

# make test runs the files in three xdist workers, a file in one worker (--dist loadfile), handed out in
# collection order. These files take minutes each (playbook runs, servers and trainings on the tiny
# model): collected first, they start at once instead of after dozens of quick files, and the run does
# not end with one worker on a long file while the others idle. Slowest first; the rest keep pytest's order.
SLOW_FILES_FIRST = (
    "tests/integration/test_train_playbook.py",
    "tests/integration/test_extract_run.py",
    "tests/integration/test_evaluate_playbook.py",
    "tests/integration/test_extract_playbook.py",
    "tests/integration/test_site_playbook.py",
    "tests/integration/test_import_gguf_smollm2.py",
    "tests/integration/test_regenerate_playbook.py",
    "tests/unit/test_train_command.py",
    "tests/integration/test_regenerate_run.py",
    "tests/unit/test_tiny_model.py",
    "tests/integration/test_long_waits.py",
    "tests/unit/test_wheelhouse.py",
)


def pytest_collection_modifyitems(items) -> None:
    """Put the slow files' tests first (each file's tests stay together and in their order)."""
    rank = {name: index for index, name in enumerate(SLOW_FILES_FIRST)}

    def key(item) -> int:
        path = Path(str(item.path)).resolve()
        relative = str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)
        return rank.get(relative, len(rank))

    items.sort(key=key)  # stable: the order within a file, and of the other files, is pytest's
