"""Slot decoding on CUDA (flash attention over the slots, CUDA graphs) against transformers' full forwards.

A SmolLM2-shaped Llama with random weights (30 layers, hidden 576, 9 query and 3 KV heads, vocabulary
49,152). The decode is teacher-forced (every row is fed given tokens), so the comparison never depends on
which of two near-equal logits a path picked: at every step each row's logits must match a full forward of
the same sequence within the tolerance the engine's own start-up check allows. Rows of many lengths, in
slots scattered by an earlier round's releases, in a batch that is not a power of two (the graph's padding
rows ride along).
"""

from __future__ import annotations

import random

import pytest
import torch
from harness import build_random_llama

from eagle3_pipeline.engine.batcher import CACHED_FORWARD_TOLERANCE, GenerateJob, ModelRunner, SamplingConfig

STEPS = 12


@pytest.fixture(scope="module")
def smollm2_shaped(tmp_path_factory):
    return build_random_llama(tmp_path_factory.mktemp("models") / "smollm2-shaped", hidden=576, layers=30, heads=9,
                              kv_heads=3, intermediate=1536, vocab=49152)


def full_logits(runner: ModelRunner, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return runner.model(input_ids=torch.tensor([ids], device=runner.device)).logits[0].float()


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).abs().max() / want.abs().max()).item()


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_teacher_forced_slot_decoding_matches_full_forwards(smollm2_shaped, dtype):
    runner = ModelRunner(str(smollm2_shaped), device="cuda", dtype=dtype)
    assert runner.enable_slots(64, 1024, graphs=True), runner.decode_path
    if dtype == "bfloat16":
        assert "flash attention" in runner.decode_path and "CUDA graphs" in runner.decode_path, runner.decode_path
    decoder = runner.slot_decoder
    rng = random.Random(0)
    tolerance = CACHED_FORWARD_TOLERANCE[dtype]
    worst = 0.0
    held: list[int] = []
    for round_ in range(2):
        count = 40 if round_ == 0 else 27
        slots = decoder.take(count)
        sequences = [[rng.randrange(49152) for _ in range(rng.randrange(5, 900) + STEPS)] for _ in range(count)]
        prompts = [seq[:-STEPS] for seq in sequences]
        with torch.inference_mode():
            got = [decoder.prefill(slots, prompts)[0]]
            for step in range(STEPS - 1):
                got.append(decoder.decode(slots, [seq[len(p) + step] for seq, p in zip(sequences, prompts)],
                                          [len(p) + step for p in prompts]))
        for b, (seq, prompt) in enumerate(zip(sequences, prompts)):
            want = full_logits(runner, seq)
            for step in range(STEPS):
                error = relative_error(got[step][b], want[len(prompt) - 1 + step])
                worst = max(worst, error)
                assert error <= tolerance, (round_, b, len(prompt), step, error)
        # Release every other slot: the next round's rows land in scattered slots among held ones.
        decoder.release(slots[::2])
        held += slots[1::2]
    decoder.release(held)
    print(f"{dtype}: worst relative logit difference {worst:.3g} (allowed {tolerance})")


def test_greedy_requests_decode_the_same_over_slots_and_over_transformers_cache(smollm2_shaped):
    """float32 (no near-ties from rounding): the server's two decode paths give the same tokens."""
    runner = ModelRunner(str(smollm2_shaped), device="cuda", dtype="float32")
    assert runner.enable_slots(32, 1024, graphs=True), runner.decode_path
    rng = random.Random(1)
    prompts = [[rng.randrange(49152) for _ in range(rng.randrange(3, 400))] for _ in range(24)]
    budgets = [rng.randrange(1, 48) for _ in prompts]

    def jobs():
        return [GenerateJob(rid=f"r{i}", input_ids=p, capture=False,
                            sampling=SamplingConfig(max_new_tokens=n, temperature=0.0, ignore_eos=True))
                for i, (p, n) in enumerate(zip(prompts, budgets))]

    over_slots = runner.run_batch(jobs())
    assert runner.slot_decoder.free_slots == 32
    decoder, runner.slot_decoder = runner.slot_decoder, None
    over_transformers = runner.run_batch(jobs())
    runner.slot_decoder = decoder
    for i, (a, b) in enumerate(zip(over_slots, over_transformers)):
        assert a.output_ids == b.output_ids, i
        assert len(a.output_ids) == budgets[i]


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_speculative_decoding_over_slots_gives_the_targets_greedy_decode(smollm2_shaped, dtype):
    """The evaluation's own oracle on CUDA: every output of a batched chain-of-3 speculative decode over the slot
    cache is the target's greedy decode by full forwards, or parts from it at a near-tie only."""
    from eagle3_pipeline.evaluate.speculative import (
        EagleProposer,
        TargetModel,
        compare_with_reference,
        judge_mismatches,
        speculative_generate,
    )
    from eagle3_pipeline.train.model import DrafterConfig, Eagle3Drafter

    target = TargetModel.load(smollm2_shaped, [1, 14, 26], device="cuda", dtype=dtype)
    torch.manual_seed(0)
    config = DrafterConfig(hidden_size=576, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                           intermediate_size=1536, target_hidden_size=576, num_aux_hidden_states=3,
                           vocab_size=49152, draft_vocab_size=49152)
    drafter = Eagle3Drafter(config, torch.zeros(49152, dtype=torch.long), torch.ones(49152, dtype=torch.bool))
    drafter.load_target_embeddings(target.input_embeddings().detach().float().cpu())
    proposer = EagleProposer(drafter.to("cuda").eval())
    rng = random.Random(2)
    prompts = [[rng.randrange(49152) for _ in range(rng.randrange(5, 600))] for _ in range(32)]
    results = speculative_generate(target, proposer, prompts, 32, 3, ignore_eos=True)
    assert target.slots, target.runner.decode_path
    assert target.runner.slot_decoder.free_slots == target.runner.slot_decoder.slots
    reference = target.greedy_reference(prompts, 32, ignore_eos=True)
    mismatches = [compare_with_reference(r, ref) for r, ref in zip(results, reference)]
    judge_mismatches(target, prompts, mismatches)
    faults = [m for m in mismatches if m is not None and not m.near_tie]
    assert not faults, faults
    print(f"{dtype}: {sum(m is not None for m in mismatches)} of 32 outputs part from the full-forward decode, "
          "all at near-ties")


def test_float32_slots_decode_without_graphs(smollm2_shaped):
    """Float32 has no flash attention, and CUDA graphs need it (the other attention reads host-side lengths): the
    slots decode eagerly, decode and prefill graphs both off, and say so."""
    runner = ModelRunner(str(smollm2_shaped), device="cuda", dtype="float32")
    assert runner.enable_slots(64, 1024, graphs=True), runner.decode_path
    decoder = runner.slot_decoder
    assert not decoder.flash and not decoder.graphs_on and decoder.prefill_graph_tokens == 0
    assert "scaled dot-product attention, no CUDA graphs" in runner.decode_path, runner.decode_path


def test_prefills_replayed_as_cuda_graphs_match_full_forwards_and_decode_on(smollm2_shaped):
    """Prefills of a few prompts replay CUDA graphs (padded to a power of two of tokens and rows): each row's
    logits, and the teacher-forced decode that reads the keys the replay wrote, match full forwards; graphs are
    captured once per shape and reused; a prefill beyond the graphs' tokens stays eager. (The graphs need flash
    attention: bf16 here, float32 above.)"""
    dtype = "bfloat16"
    runner = ModelRunner(str(smollm2_shaped), device="cuda", dtype=dtype)
    assert runner.enable_slots(64, 1024, graphs=True), runner.decode_path
    decoder = runner.slot_decoder
    assert decoder.prefill_graph_tokens >= 4096 and "prefills up to" in runner.decode_path, runner.decode_path
    tolerance = CACHED_FORWARD_TOLERANCE[dtype]
    rng = random.Random(3)
    worst = 0.0
    for count, low, high in [(1, 3, 40), (3, 100, 300), (17, 50, 400), (2, 900, 1000), (5, 100, 300)]:
        sequences = [[rng.randrange(49152) for _ in range(rng.randrange(low, high) + 4)] for _ in range(count)]
        prompts = [seq[:-4] for seq in sequences]
        shape = decoder._prefill_shape(prompts)
        assert shape is not None, (count, sum(map(len, prompts)))
        slots = decoder.take(count)
        try:
            with torch.inference_mode():
                got = [decoder.prefill(slots, prompts)[0]]
                for step in range(3):
                    got.append(decoder.decode(slots, [seq[len(p) + step] for seq, p in zip(sequences, prompts)],
                                              [len(p) + step for p in prompts]))
        finally:
            decoder.release(slots)
        assert shape in decoder._prefill_graphs
        for b, (seq, prompt) in enumerate(zip(sequences, prompts)):
            want = full_logits(runner, seq)
            for step in range(4):
                error = relative_error(got[step][b], want[len(prompt) - 1 + step])
                worst = max(worst, error)
                assert error <= tolerance, (count, b, len(prompt), step, error)
    shapes = len(decoder._prefill_graphs)
    slots = decoder.take(len(prompts))
    with torch.inference_mode():
        again = decoder.prefill(slots, prompts)[0]
    decoder.release(slots)
    assert len(decoder._prefill_graphs) == shapes  # the same shape again: replayed, not captured again
    assert torch.equal(again, got[0])  # and the same kernels on the same inputs
    big = [[rng.randrange(49152) for _ in range(1000)] for _ in range(decoder.prefill_graph_tokens // 1000 + 1)]
    assert decoder._prefill_shape(big) is None  # eager
    print(f"{dtype}: prefill graphs up to {decoder.prefill_graph_tokens} tokens, {shapes} shapes; worst relative "
          f"logit difference {worst:.3g} (allowed {tolerance})")
