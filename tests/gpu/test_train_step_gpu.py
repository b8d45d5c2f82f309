"""The fused training path on a GPU: flash attention's prefix merged with the step keys against the
masked-SDPA reference, in bf16, forward and gradients, packed samples included."""

from __future__ import annotations

import pytest
import torch

from eagle3_pipeline.train.loss import fused_ttt_loss, teacher_targets, ttt_loss
from eagle3_pipeline.train.model import DrafterConfig, Eagle3Drafter

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

TARGET = {"hidden_size": 512, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 64,
          "intermediate_size": 1024, "vocab_size": 4096, "rope_theta": 500000.0, "max_position_embeddings": 4096}


def setup(seed: int = 0, length: int = 384):
    torch.manual_seed(seed)
    model = Eagle3Drafter(DrafterConfig.from_target(TARGET, 3, 1024)).cuda()
    input_ids = torch.randint(0, 4096, (1, length), device="cuda")
    aux = torch.randn(1, length, 3 * 512, device="cuda", dtype=torch.bfloat16)
    doc_ids = torch.zeros(1, length, dtype=torch.int64, device="cuda")
    doc_ids[:, 150:] = 1
    doc_ids[:, 300:] = 2  # three packed samples
    last = torch.randn(1, length, 512, device="cuda", dtype=torch.bfloat16)
    head = (torch.randn(4096, 512, device="cuda") * 0.05).to(torch.bfloat16)
    teacher = teacher_targets(last, head, model.t2d, model.d2t, torch.ones(1, length, device="cuda"), doc_ids)
    return model, input_ids, aux, doc_ids, teacher


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(a.flatten().float(), b.flatten().float(), dim=0))


@pytest.mark.parametrize("compile", [False, True])
def test_fused_bf16_step_matches_the_masked_sdpa_reference(compile):
    model, input_ids, aux, doc_ids, teacher = setup()
    params = [p for p in model.parameters() if p.requires_grad]
    with torch.autocast("cuda", dtype=torch.bfloat16):
        reference = ttt_loss(model.forward_ttt(input_ids, aux, None, 5, doc_ids), teacher)
    expected = torch.autograd.grad(reference.loss, params)
    hidden = model.forward_ttt(input_ids, aux, None, 5, doc_ids, attention="fused", compute_dtype=torch.bfloat16,
                               mlp_recompute_steps=2, compile=compile, head=False)
    fused, _ = fused_ttt_loss(hidden, model.lm_head.weight, teacher)
    got = torch.autograd.grad(fused.loss, params)
    torch.testing.assert_close(fused.step_losses, reference.step_losses, rtol=2e-2, atol=2e-2)
    for (name, _), a, b in zip([(n, p) for n, p in model.named_parameters() if p.requires_grad], got, expected):
        assert cosine(a, b) > 0.99, name


def test_flash_prefix_gradients_match_float32_dense_math():
    from eagle3_pipeline.train.kernels import packed_layout, ttt_attention

    torch.manual_seed(1)
    rows, heads, kv, dim = 256, 8, 2, 64
    doc_ids = torch.zeros(1, rows, dtype=torch.int64, device="cuda")
    doc_ids[:, 100:] = 1
    layout = packed_layout(doc_ids)
    q = torch.randn(rows, heads, dim, device="cuda", requires_grad=True)
    keys = [torch.randn(rows, kv, dim, device="cuda", requires_grad=True) for _ in range(3)]
    values = [torch.randn(rows, kv, dim, device="cuda", requires_grad=True) for _ in range(3)]
    grad = torch.randn(rows, heads, dim, device="cuda")
    dense = ttt_attention(q, keys, values, layout, dim**-0.5)  # float32: the dense path
    expected = torch.autograd.grad(dense, [q, *keys, *values], grad)
    bf16 = [t.detach().to(torch.bfloat16).requires_grad_() for t in [q, *keys, *values]]
    flash = ttt_attention(bf16[0], bf16[1:4], bf16[4:], layout, dim**-0.5)
    got = torch.autograd.grad(flash, bf16, grad.to(torch.bfloat16))
    assert cosine(flash, dense) > 0.999
    for a, b in zip(got, expected):
        assert cosine(a, b) > 0.995


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_triton_soft_ce_equals_the_compiled_one(dtype):
    """One row per program, two passes: the CE, the gradient and the argmax of ``soft_ce_rows`` (a row length that is
    not a multiple of the kernel's block, rows with tied maxima, row weights of 0 and more)."""
    from eagle3_pipeline.train.kernels import soft_ce_rows
    from eagle3_pipeline.train.soft_ce_triton import BLOCK
    from eagle3_pipeline.train.soft_ce_triton import soft_ce_rows as triton_soft_ce

    generator = torch.Generator(device="cuda").manual_seed(0)
    rows, cols = 1000, 3 * BLOCK + 77
    logits = (torch.randn(rows, cols, device="cuda", generator=generator) * 3).to(dtype)
    teacher = (torch.randn(rows, cols, device="cuda", generator=generator) * 3).to(dtype)
    logits[:10] = 0  # every column tied: the first is the argmax
    logits[10:20, 5] = logits[10:20, 5 + BLOCK] = 100  # a tie across lanes and blocks
    weights = torch.rand(rows, device="cuda", generator=generator)
    weights[::7] = 0
    ce, grad, top = triton_soft_ce(logits, teacher, weights)
    want_ce, want_grad, want_top = soft_ce_rows(logits, teacher, weights)
    torch.testing.assert_close(ce, want_ce, rtol=1e-5, atol=1e-5)
    assert torch.equal(top, want_top)
    assert grad.dtype == dtype and grad.shape == want_grad.shape
    # float32 sums in another order: the gradients agree to the logits' dtype's rounding.
    tolerance = 1e-5 if dtype == torch.float32 else 2**-7
    torch.testing.assert_close(grad.float(), want_grad.float(), rtol=tolerance, atol=1e-6)
    # A slice of a wider tensor (the loss passes row slices of the teacher's logits).
    wide = torch.randn(rows + 3, cols, device="cuda", generator=generator).to(dtype)
    ce, _, _ = triton_soft_ce(logits, wide[2: rows + 2], weights)
    torch.testing.assert_close(ce, soft_ce_rows(logits, wide[2: rows + 2], weights)[0], rtol=1e-5, atol=1e-5)
