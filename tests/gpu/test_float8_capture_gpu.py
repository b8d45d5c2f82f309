"""Float8 quantization on the GPU gives the CPU's bits: what the capture writer makes on the
engine's GPU is the sample a CPU conversion (``convert-storage``) or the client would make.

The states: bf16 and float32 rows spanning 10 decades (scales from 1e-6 to 1e4, so scaled values
fall in e4m3's subnormal range too), rows of zeros, exact ties between two e4m3 values, a
huge outlier, and more rows than one GPU chunk (``QUANTIZE_CHUNK_GPU``) holds, so the chunking
is crossed. Then the whole capture file of a ``.f8`` request written from CUDA tensors against
the one written from the same tensors on the CPU, byte for byte.

Run: PYTHONPATH=src python3 -m pytest tests/gpu/test_float8_capture_gpu.py -v (add --noconftest
where ansible is not installed).
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.gpu

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from eagle3_pipeline.capture.writer import FLOAT8_RID_SUFFIX, capture_path, write_capture  # noqa: E402
from eagle3_pipeline.extract import storage  # noqa: E402

HIDDEN, N_AUX = 2048, 3


def wide_states(tokens: int, dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    row_scale = torch.logspace(-6, 4, tokens)[torch.randperm(tokens, generator=generator)][:, None]
    aux = (torch.randn(tokens, N_AUX * HIDDEN, generator=generator) * row_scale).to(dtype)
    last = (torch.randn(tokens, HIDDEN, generator=generator) * row_scale).to(dtype)
    aux[0] = 0
    aux[1, :HIDDEN] = torch.linspace(-448, 448, HIDDEN)  # scale exactly 1: values on and between e4m3 steps
    aux[2, HIDDEN:2 * HIDDEN] = torch.arange(HIDDEN) * (448 / 2047)  # a slice full of near-ties
    last[3, 7] = 3e4
    return aux, last


def bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.cpu().contiguous().view(torch.uint8)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_quantizing_on_the_gpu_gives_the_cpus_bits(dtype):
    tokens = storage.QUANTIZE_CHUNK_GPU // (N_AUX * HIDDEN) * 2 + 37  # two and a bit GPU chunks
    aux, last = wide_states(tokens, dtype)

    on_cpu = storage.quantize_states(aux, last)
    on_gpu = storage.quantize_states(aux.cuda(), last.cuda())

    for name, expected in on_cpu.items():
        got = on_gpu[name]
        assert got.device.type == "cuda" and got.dtype == expected.dtype
        differ = int((bits(got) != bits(expected)).sum())
        assert differ == 0, f"{name}: {differ} of {expected.numel() * expected.element_size()} bytes differ"


def test_a_float8_capture_written_from_the_gpu_is_the_cpus_byte_for_byte(tmp_path):
    aux, last = wide_states(1500, torch.bfloat16, seed=1)
    rid = "e3x-0-gpu-test-0" + FLOAT8_RID_SUFFIX

    from_gpu = write_capture(tmp_path / "gpu", rid, aux.cuda(), last.cuda(), [1, 9, 17], engine="reference")
    from_cpu = write_capture(tmp_path / "cpu", rid, aux, last, [1, 9, 17], engine="reference")

    assert from_gpu == capture_path(tmp_path / "gpu", rid)
    assert from_gpu.read_bytes() == from_cpu.read_bytes()
