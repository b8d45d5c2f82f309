"""GPU tests: run on a machine with an NVIDIA GPU (make test-gpu); skipped elsewhere."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from harness import Holders, new_tag  # noqa: E402


def _gpu_present() -> bool:
    try:
        import pynvml

        pynvml.nvmlInit()
        count = pynvml.nvmlDeviceGetCount()
        pynvml.nvmlShutdown()
        return count > 0
    except Exception:  # noqa: BLE001 - any failure means: no usable GPU here
        return False


def pytest_collection_modifyitems(config, items):
    """Skip every GPU test, with the reason, where no GPU can be used."""
    if _gpu_present():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU with NVML (run make test-gpu on the GPU machine)")
    for item in items:
        item.add_marker(skip)


@pytest.fixture
def holders(tmp_path):
    """Tagged GPU holders, all killed at the end whatever happened."""
    h = Holders(tag=new_tag(), workdir=tmp_path)
    yield h
    h.kill_all()
