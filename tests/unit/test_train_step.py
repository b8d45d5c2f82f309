"""StepRunner: the fused path against the reference on the CPU, the host-side embeddings, the fused
AdamW switch, and ``bench/training.py --tiny`` (so that the benchmark cannot rot)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from eagle3_pipeline.train.data import PackedBatch
from eagle3_pipeline.train.model import DrafterConfig, Eagle3Drafter
from eagle3_pipeline.train.step import StepRunner, use_fused_adamw

ROOT = Path(__file__).resolve().parents[2]
TARGET = {"hidden_size": 16, "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 24,
          "vocab_size": 40, "rms_norm_eps": 1e-6, "max_position_embeddings": 128}


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def drafter(seed: int = 0) -> Eagle3Drafter:
    torch.manual_seed(seed)
    model = Eagle3Drafter(DrafterConfig.from_target(TARGET, 3, 24))
    torch.nn.init.normal_(model.embed_tokens.weight)
    return model


def batch(seed: int = 1) -> PackedBatch:
    generator = torch.Generator().manual_seed(seed)
    doc_ids = torch.tensor([0] * 7 + [1] * 5)
    return PackedBatch(input_ids=torch.randint(0, 40, (12,), generator=generator),
                       loss_mask=torch.rand(12, generator=generator) > 0.2,
                       aux_hidden=torch.randn(12, 48, generator=generator),
                       last_hidden=torch.randn(12, 16, generator=generator),
                       doc_ids=doc_ids, position_ids=torch.tensor(list(range(7)) + list(range(5))))


def test_the_runner_picks_the_reference_on_the_cpu_and_refuses_unknown_choices():
    runner = StepRunner(drafter(), torch.randn(40, 16), ttt_length=3, device=torch.device("cpu"))
    assert (runner.attention, runner.embeddings, runner.compile) == ("sdpa", "device", False)
    with pytest.raises(ValueError, match="attention must be one of"):
        StepRunner(drafter(), torch.randn(40, 16), ttt_length=3, device=torch.device("cpu"), attention="flash")


def test_fused_train_steps_follow_the_reference_steps():
    head = torch.randn(40, 16)
    runs = {}
    for attention in ("sdpa", "fused"):
        model = drafter()
        runner = StepRunner(model, head, ttt_length=3, device=torch.device("cpu"), attention=attention,
                            mlp_recompute_steps=1)
        # SGD: Adam would divide float32 rounding noise in near-zero gradients by its own size.
        optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
        losses = [float(runner.train_step(batch(seed), optimizer, 0.1, 1.0)[0].loss.detach()) for seed in range(3)]
        runs[attention] = (losses, [p.detach().clone() for p in model.parameters() if p.requires_grad])
    assert runs["fused"][0] == pytest.approx(runs["sdpa"][0], rel=1e-5)
    for a, b in zip(runs["fused"][1], runs["sdpa"][1]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_host_embeddings_give_the_same_rows_and_the_same_loss():
    head = torch.randn(40, 16)
    on_device = StepRunner(drafter(), head, ttt_length=3, device=torch.device("cpu"), attention="fused")
    on_host = StepRunner(drafter(), head, ttt_length=3, device=torch.device("cpu"), attention="fused",
                         embeddings="host")
    assert on_host.model._ddp_params_and_buffers_to_ignore == ["embed_tokens.weight"]
    ids = batch().input_ids[None]
    rows = on_host.model.token_embeddings(ids, 3)
    assert rows.shape == (1, 15, 16)
    torch.testing.assert_close(rows[0, 12:], on_host.model.embed_tokens.weight[[0, 0, 0]])
    a, _ = on_device.forward(batch(), training=False)
    b, _ = on_host.forward(batch(), training=False)
    torch.testing.assert_close(a.step_losses, b.step_losses)


def test_trained_embeddings_stay_on_the_device():
    model = drafter()
    model.embed_tokens.weight.requires_grad_(True)
    with pytest.raises(ValueError, match="frozen embed_tokens"):
        StepRunner(model, torch.randn(40, 16), ttt_length=3, device=torch.device("cpu"), attention="fused",
                   embeddings="host")
    runner = StepRunner(model, torch.randn(40, 16), ttt_length=3, device=torch.device("cpu"), attention="fused")
    assert runner.embeddings == "device"
    loss, _ = runner.forward(batch())
    loss.loss.backward()
    assert model.embed_tokens.weight.grad is not None and model.embed_tokens.weight.grad.abs().sum() > 0


def test_fused_adamw_switch_leaves_cpu_optimizers_alone():
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.ones(3))], lr=0.1)
    use_fused_adamw(optimizer)
    assert not optimizer.param_groups[0]["fused"]


def test_the_training_benchmark_runs_tiny_on_the_cpu():
    result = subprocess.run([sys.executable, str(ROOT / "bench" / "training.py"), "--tiny", "--steps", "2",
                             "--warmup", "1", "--profile", "1"], capture_output=True, text=True, timeout=300,
                            check=False)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "ours (sdpa" in result.stdout and "ours (fused" in result.stdout
    assert "tokens/s" in result.stdout and "MFU" in result.stdout
    # The profile: a step's wall time and the operators' table (no kernels on the CPU).
    profiled = [r["profile"] for r in json.loads(result.stdout[result.stdout.index("\n[") + 1:])]
    assert len(profiled) == 2 and all(p["wall_ms_per_step"] > 0 and p["kernels_per_step"] == 0 for p in profiled)
    assert "aten::mm" in result.stdout and "Self CPU" in result.stdout


def _soft_ce_inputs():
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(12, 50, generator=generator)
    logits[0] = 0  # a row of ties
    return logits, torch.randn(12, 50, generator=generator), torch.rand(12, generator=generator)


def test_a_faster_soft_ce_that_agrees_with_the_reference_takes_over_after_its_first_call():
    from eagle3_pipeline.train.kernels import CheckedSoftCE, soft_ce_rows

    calls = []

    def candidate(logits, teacher, weight):
        calls.append("candidate")
        ce, grad, top = soft_ce_rows(logits, teacher, weight)
        top[0] = 7  # another of the tied maxima of row 0: the same answer
        return ce * (1 + 1e-7), grad, top

    checked = CheckedSoftCE(candidate, soft_ce_rows, devices=("cpu",))
    inputs = _soft_ce_inputs()
    first = checked(*inputs)
    assert checked.failure is None and int(first[2][0]) == 7  # checked, and its result used
    checked(*inputs)
    assert calls == ["candidate", "candidate"]
    # Not on a listed device: the reference, the candidate never called.
    assert CheckedSoftCE(candidate, soft_ce_rows, devices=("cuda",))(*inputs)[2][0] == 0 and len(calls) == 2


@pytest.mark.parametrize("fault", ["wrong CE", "wrong argmax", "wrong gradient in the last block", "raises"])
def test_a_faster_soft_ce_that_differs_or_fails_is_turned_off_with_a_warning_naming_why(fault, monkeypatch):
    from eagle3_pipeline.train import kernels
    from eagle3_pipeline.train.kernels import CheckedSoftCE, soft_ce_rows

    monkeypatch.setattr(kernels, "CHECK_ROWS", 5)  # the gradients compared in blocks of 5, 5 and 2 rows

    calls = []

    def candidate(logits, teacher, weight):
        calls.append(1)
        if fault == "raises":
            raise RuntimeError("no kernel image for this device")
        ce, grad, top = soft_ce_rows(logits, teacher, weight)
        if fault == "wrong CE":
            return ce + 0.01, grad, top
        if fault == "wrong gradient in the last block":
            grad = grad.clone()
            grad[-1, 3] += 0.05 * grad.abs().max()
            return ce, grad, top
        return ce, grad, (top + 1) % logits.shape[1]

    checked = CheckedSoftCE(candidate, soft_ce_rows, devices=("cpu",))
    inputs = _soft_ce_inputs()
    want = soft_ce_rows(*inputs)
    with pytest.warns(RuntimeWarning, match="compiled one trains instead") as caught:
        got = checked(*inputs)
    assert all(torch.equal(a, b) for a, b in zip(got, want))  # the reference's result, not the candidate's
    expected = {"wrong CE": "CE differs", "wrong argmax": "argmax in 11 rows", "raises": "no kernel image",
                "wrong gradient in the last block": "the gradient by 0.05 of its largest value"}[fault]
    assert expected in str(caught[0].message)
    checked(*inputs)
    assert len(calls) == 1  # never again
