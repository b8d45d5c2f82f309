"""GPU tests: run on a machine with an NVIDIA GPU (make test-gpu); skipped elsewhere."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

# torch.cuda.is_available() and device_count() ask NVML instead of initialising CUDA in this process (the
# test modules ask at import): an initialised driver holds a few MiB of the GPU (3 MiB on the H200) that
# NVML attributes to no process, and the idle_gpu tests below need the GPU at 0 MiB.
os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")

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
    """Skip every GPU test, with the reason, where no GPU can be used; where one can, the tests that need
    an idle GPU run first.

    A test that uses CUDA in this process (an extraction, a training step) keeps its CUDA context, and the
    memory the context holds, until the process ends: no call gives it back. A GPU reset after it sees
    this pytest process holding memory and rightly refuses (an ancestor of the module, part of the run).
    So the tests marked idle_gpu (the reset's and the server role's, which verify zero used memory) run
    before any test has made a context here; the others keep their order.
    """
    if _gpu_present():
        items.sort(key=lambda item: item.get_closest_marker("idle_gpu") is None)  # stable
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU with NVML (run make test-gpu on the GPU machine)")
    for item in items:
        item.add_marker(skip)


@pytest.fixture(autouse=True)
def _no_cuda_context_here_for_idle_gpu_tests(request):
    """An idle_gpu test fails at once, saying why, when this process already holds a CUDA context."""
    torch = sys.modules.get("torch")
    if request.node.get_closest_marker("idle_gpu") and torch is not None and torch.cuda.is_initialized():
        pytest.fail("this pytest process holds a CUDA context (a test before this one used CUDA in-process), so "
                    "the GPU cannot be idle: run the idle_gpu tests first (the collection does) or on their own")


@pytest.fixture
def holders(tmp_path):
    """Tagged GPU holders, all killed at the end whatever happened."""
    h = Holders(tag=new_tag(), workdir=tmp_path)
    yield h
    h.kill_all()
