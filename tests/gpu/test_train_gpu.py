"""``eagle3-pipeline train`` on the GPU: bf16 with fp32 master weights, the same numbers as the CPU
in fp32, and torchrun over two GPUs (DDP over NCCL, and FSDP) when the machine has two.

Data: the tiny random Llama of ``tests/unit/train_fixtures.py`` and its real hidden states.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "unit"))

from train_fixtures import build_data, build_target  # noqa: E402

pytestmark = pytest.mark.gpu
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return build_data(tmp_path_factory.mktemp("extracted"), *build_target(tmp_path_factory.mktemp("target")))


def train(data_dir, out, *extra, timeout=600) -> dict:
    cmd = [sys.executable, "-m", "eagle3_pipeline.cli", "train", "--data-dir", str(data_dir), "--output-dir",
           str(out), "--draft-vocab-size", "48", "--ttt-length", "3", "--lr", "3e-3", "--warmup-steps", "2",
           "--batch-tokens", "64", "--eval-ratio", "0.2", "--epochs", "8", "--no-tensorboard", "--no-charts",
           *extra]
    result = subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=timeout, check=False)
    print(result.stderr[-3000:])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return json.loads((out / "training.json").read_text())


def losses(out) -> list[float]:
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in records if r["kind"] == "train"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_bf16_on_the_gpu_learns_and_exports(data_dir, tmp_path):
    record = train(data_dir, tmp_path / "bf16", "--max-steps", "40")
    assert record["device"] == "cuda:0" and record["dtype"] == "bfloat16"
    curve = losses(tmp_path / "bf16")
    assert len(curve) == 40 and sum(curve[-5:]) < 0.8 * sum(curve[:5])
    config = json.loads((tmp_path / "bf16" / "drafter" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["torch_dtype"] == "bfloat16"


def test_fp32_on_the_gpu_follows_the_cpu(data_dir, tmp_path):
    gpu = train(data_dir, tmp_path / "gpu", "--max-steps", "5", "--dtype", "float32")
    cpu = train(data_dir, tmp_path / "cpu", "--max-steps", "5", "--device", "cpu")
    assert gpu["device"] == "cuda:0" and cpu["device"] == "cpu"
    for a, b in zip(losses(tmp_path / "gpu"), losses(tmp_path / "cpu"), strict=True):
        assert abs(a - b) <= 1e-3 * abs(b), (a, b)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs (the nvidia-h200-x2 kind)")
@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_two_gpus_under_torchrun(data_dir, tmp_path, parallel):
    out = tmp_path / parallel
    record = train(data_dir, out, "--max-steps", "12", "--nproc-per-node", "2", "--parallel", parallel,
                   "--master-port", str(free_port()))
    assert record["world"] == 2 and record["steps"] == 12 and record["dtype"] == "bfloat16"
    curve = losses(out)
    assert len(curve) == 12 and sum(curve[-3:]) < sum(curve[:3])
    assert (out / "drafter" / "model.safetensors").is_file()
