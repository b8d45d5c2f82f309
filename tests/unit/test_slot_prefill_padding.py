"""The padded prefill that CUDA graphs replay (``engine/slots.py``), run eagerly on the CPU.

A graph replays one fixed shape, so a prefill is padded: its tokens up to a power of two, the padding in rows
of its own over the scratch slot, its rows up to a power of two with empty ones. Whether that padding changes
anything is what these tests check on the tiny model in float32: the real rows' logits and the keys and values
written into their slots equal an unpadded prefill's, no other slot is touched, and the decode that follows is
the same. The graph capture itself needs CUDA: tests/gpu/test_slot_decode_gpu.py replays it there.
"""

from __future__ import annotations

import pytest
import torch
from tiny_target import built_tiny_model

from eagle3_pipeline.engine import slots as slot_cache
from eagle3_pipeline.engine.batcher import ModelRunner

SLOT_TOKENS = 32


@pytest.fixture(scope="module")
def decoder():
    runner = ModelRunner(str(built_tiny_model()), device="cpu", dtype="float32")
    return slot_cache.SlotDecoder(runner.model, 16, SLOT_TOKENS, graphs=False)


def rows_of(lengths, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 500, (n,), generator=generator).tolist() for n in lengths]


@pytest.mark.parametrize("lengths", [[5, 17, 1], [32], [3] * 6, [31, 30]])
def test_a_padded_prefill_writes_and_returns_what_an_unpadded_one_does(decoder, lengths):
    rows = rows_of(lengths)
    shape = decoder._prefill_shape(rows, limit=128)
    tokens, count_rows, longest = shape
    assert tokens >= sum(lengths) and tokens & (tokens - 1) == 0 and count_rows & (count_rows - 1) == 0
    assert longest == SLOT_TOKENS and count_rows >= len(rows) + -(-(tokens - sum(lengths)) // longest)
    layout = decoder._prefill_layout([0] * len(rows), rows, shape)
    assert int(layout["used"].sum()) == tokens and int(layout["cu_q"][-1]) == tokens
    assert int(layout["used"].max()) <= SLOT_TOKENS  # every padding row fits the scratch slot

    plain, padded = decoder.take(len(rows)), decoder.take(len(rows))
    bystander = decoder.take(1)
    try:
        with torch.inference_mode():
            decoder._rows(bystander, rows_of([SLOT_TOKENS], seed=9), [0])
            before = decoder.keys[:, bystander[0] * SLOT_TOKENS:(bystander[0] + 1) * SLOT_TOKENS].clone()
            want, _ = decoder._rows(plain, rows, [0] * len(rows))
            got = decoder._padded_forward(padded, rows, shape)
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        for a, b, n in zip(plain, padded, lengths):
            for cache in (decoder.keys, decoder.values):
                torch.testing.assert_close(cache[:, b * SLOT_TOKENS: b * SLOT_TOKENS + n],
                                           cache[:, a * SLOT_TOKENS: a * SLOT_TOKENS + n], rtol=1e-5, atol=1e-5)
        assert torch.equal(decoder.keys[:, bystander[0] * SLOT_TOKENS:(bystander[0] + 1) * SLOT_TOKENS], before)
        # The decode after each prefill reads those keys: the same next logits.
        room = [n for n in lengths if n < SLOT_TOKENS]
        if room:
            keep = [i for i, n in enumerate(lengths) if n < SLOT_TOKENS]
            with torch.inference_mode():
                one = decoder.decode([plain[i] for i in keep], [7] * len(keep), [lengths[i] for i in keep])
                two = decoder.decode([padded[i] for i in keep], [7] * len(keep), [lengths[i] for i in keep])
            torch.testing.assert_close(two, one, rtol=1e-5, atol=1e-5)
    finally:
        decoder.release(plain + padded + bystander)


def test_a_prefill_too_large_for_a_graph_has_no_padded_shape(decoder):
    assert decoder.prefill_graph_tokens == 0  # the CPU: no graphs, every prefill eager
    assert decoder._prefill_shape(rows_of([5]), limit=0) is None
    assert decoder._prefill_shape(rows_of([30, 30, 30]), limit=64) is None
    assert decoder._prefill_shape(rows_of([30, 30]), limit=64)[0] == 64


def test_the_graph_token_limit_keeps_a_padded_prefill_within_its_flops():
    small = torch.nn.ModuleList([torch.nn.Linear(100, 100, bias=False) for _ in range(10)])  # 100,000 parameters
    # 2 x 1e5 FLOPs a token: 16,384 tokens cost 3.3e9, within 4e12; the cap holds.
    assert slot_cache.prefill_graph_tokens(small) == slot_cache.PREFILL_GRAPH_MAX_TOKENS
    assert slot_cache.prefill_graph_tokens(small, flops=2e5 * 1000) == 512
    assert slot_cache.prefill_graph_tokens(small, flops=2e5 * 255) == 0


def test_a_prefill_graph_that_cannot_be_captured_leaves_that_prefill_and_every_later_one_eager(decoder, caplog):
    """Graphs on where they cannot be captured (no CUDA here): the prefill still returns the eager result, warns
    once with the reason, and later prefills go straight to the eager path."""
    rows = rows_of([5, 9])
    plain, forced = decoder.take(2), decoder.take(2)
    try:
        with torch.inference_mode():
            want, _ = decoder.prefill(plain, rows)
            decoder.prefill_graph_tokens = 64
            with caplog.at_level("WARNING"):
                got, _ = decoder.prefill(forced, rows)
            again, _ = decoder.prefill(forced, rows)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(again, want, rtol=1e-5, atol=1e-5)
        assert decoder.prefill_graph_tokens == 0 and decoder.prefill_graphs_failure.startswith("RuntimeError: ")
        assert "prefill graphs off" in decoder.describe()
        assert len([r for r in caplog.records if "could not replay a CUDA graph" in r.getMessage()]) == 1
    finally:
        decoder.prefill_graph_tokens, decoder.prefill_graphs_failure = 0, None
        decoder.release(plain + forced)
