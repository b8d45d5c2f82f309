"""SGLang contract tests run only under the venv built by tests/sglang/make_venv.sh.

Under any other interpreter (the project .venv, CI's default pytest) every test here is skipped
with the reason and the command that builds the venv. Under that venv, when no torchvision is
installed (PyPI's wheel is CUDA-built and cannot load against the CPU torch), the import-only
stub in tests/sglang/stubs goes on sys.path: SGLang's config package imports torchvision at
module level for vision models these tests never run; any real use of the stub raises.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
SKIP_REASON = (
    "SGLang contract tests need sglang 0.5.23 (this interpreter has none or another version): "
    "run tests/sglang/make_venv.sh, then .venv-sglang/bin/python -m pytest tests/sglang"
)


def _sglang_version() -> str | None:
    # Not find_spec("sglang"): under pytest's rootdir sys.path this directory, tests/sglang, is
    # itself importable as a namespace package named sglang.
    try:
        return importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        return None


HAVE_SGLANG = _sglang_version() == "0.5.23"

if HAVE_SGLANG and importlib.util.find_spec("torchvision") is None:
    sys.path.insert(0, str(HERE / "stubs"))


def pytest_collection_modifyitems(config, items):
    """Skip this directory's tests, saying why, when sglang is not importable."""
    if HAVE_SGLANG:
        return
    skip = pytest.mark.skip(reason=SKIP_REASON)
    for item in items:
        if HERE in Path(str(item.fspath)).resolve().parents:
            item.add_marker(skip)


def pytest_report_header(config):
    """Say which SGLang (and whether the torchvision stub) the contract tests ran against."""
    if not HAVE_SGLANG:
        return f"sglang contract tests: skipped ({SKIP_REASON})"
    import torchvision

    stub = " (torchvision import stub)" if getattr(torchvision, "STUB", False) else ""
    return f"sglang contract tests: sglang {_sglang_version()}{stub}"
