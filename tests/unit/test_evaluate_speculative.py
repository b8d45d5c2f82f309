"""Speculative decoding on real (tiny) models: the output is the target's greedy decode by full forwards, batched
decoding equals one request at a time, tau is counted right, and a KV cache the model ignores is caught."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from tiny_target import built_tiny_model

from eagle3_pipeline.evaluate.speculative import (
    AcceptanceStats,
    EagleProposer,
    EvaluationError,
    SpeculativeOutput,
    TargetModel,
    compare_with_reference,
    drafter_aux_layers,
    judge_mismatches,
    load_drafter,
    replay_chains,
    speculative_generate,
)
from eagle3_pipeline.train.export import export_sglang
from eagle3_pipeline.train.model import DrafterConfig, Eagle3Drafter

VOCAB, HIDDEN, LAYERS, AUX = 64, 32, 4, [0, 1, 2]
EOS = 2


def _random_llama(path: Path, zero_norm: bool = False) -> Path:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=64,
                                      num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=256, tie_word_embeddings=False, eos_token_id=EOS)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(40.0)  # large logit gaps between random tokens (ties stay as rare as ever)
        if zero_norm:  # every logit 0: the greedy choice is token 0 at every position
            model.model.norm.weight.zero_()
    model.save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="module", params=["slots", "transformers"])
def random_target(tmp_path_factory, request) -> TargetModel:
    """The target read over the engine's slot cache, and over transformers' own cache with masks."""
    target = TargetModel.load(_random_llama(tmp_path_factory.mktemp("llama")), AUX, device="cpu",
                              decode=request.param)
    yield target
    if request.param == "slots":  # every batch gave its slots back
        assert target.slots and target.runner.slot_decoder.free_slots == target.runner.slot_decoder.slots


def _drafter(draft_vocab: int = 48, seed: int = 1, vocab: int = VOCAB, hidden: int = HIDDEN,
             **flags: bool) -> Eagle3Drafter:
    torch.manual_seed(seed)
    config = DrafterConfig(hidden_size=hidden, num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4,
                           intermediate_size=2 * hidden, target_hidden_size=hidden, num_aux_hidden_states=3,
                           vocab_size=vocab, draft_vocab_size=draft_vocab, **flags)
    # A draft vocabulary of every other token from 3 on: d2t offsets that are not zero.
    t2d = torch.zeros(vocab, dtype=torch.bool)
    chosen = (torch.arange(draft_vocab) * 2 + 3) % vocab if 2 * draft_vocab + 3 <= vocab else torch.arange(draft_vocab)
    t2d[chosen] = True
    ids = t2d.nonzero().flatten()
    drafter = Eagle3Drafter(config, ids - torch.arange(draft_vocab), t2d)
    with torch.no_grad():
        for parameter in drafter.parameters():
            if parameter.requires_grad:
                parameter.normal_(0, 0.2)
    return drafter.eval()


def _prompts(count: int, seed: int = 5) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (int(torch.randint(3, 20, (1,), generator=gen)),), generator=gen).tolist()
            for _ in range(count)]


class OracleProposer:
    """A perfect drafter: proposes the target's own greedy continuation (by full forwards) of each request."""

    def __init__(self, target: TargetModel, prompts: list[list[int]]):
        self.target, self.prompts, self.known = target, prompts, []

    def reset(self, batch_size):
        assert batch_size == len(self.prompts)
        self.known = [list(prompt[:1]) for prompt in self.prompts]

    def extend(self, aux, token_ids, positions, valid):
        for b in range(len(self.known)):
            rows = valid[b].nonzero().flatten().tolist()
            if rows:  # tokens through the first row's position, then the token after each row
                start = int(positions[b, rows[0]])
                self.known[b] = self.known[b][: start + 1] + [int(token_ids[b, r]) for r in rows]

    def propose(self, count):
        drafts = [ids for ids, _ in self.target.greedy_reference(self.known, count, ignore_eos=True)]
        return torch.tensor(drafts, dtype=torch.long)


class WrongProposer(OracleProposer):
    """Always wrong: the oracle's tokens shifted by one."""

    def propose(self, count):
        return (super().propose(count) + 1) % VOCAB


def _reference(target, prompts, budget, ignore_eos=False):
    return [ids for ids, _ in target.greedy_reference(prompts, budget, ignore_eos=ignore_eos)]


def _is_greedy(target, prompt, result, reference) -> bool:
    """Assert ``result`` is the target's greedy decode ``reference`` (ids, top-2) up to a float32 near-tie (two
    float32 paths may order a near-tie differently: then the decodes part there); True when equal throughout."""
    mismatch = compare_with_reference(result, reference)
    judge_mismatches(target, [prompt], [mismatch])
    assert mismatch is None or mismatch.near_tie, mismatch
    return mismatch is None


def _engine_is_greedy(engine_ids, reference) -> None:
    """The engine's decode (ids only) against the reference's: equal, or parted at a float32 near-tie of the
    reference where the engine took the runner-up."""
    ids, tops = reference
    at = next((i for i, (a, b) in enumerate(zip(engine_ids, ids)) if a != b), None)
    if at is None:
        assert len(engine_ids) == len(ids)
        return
    top = tops[at]
    assert engine_ids[at] == top.second_id and top.first_logit - top.second_logit <= 1e-4 * abs(top.first_logit), \
        (at, top)


@pytest.mark.parametrize("flags", [{}, {"fc_norm": True, "norm_output": True, "norm_before_fc": True}],
                         ids=["eagle3", "eagle3.1+norm_before_fc"])
def test_incremental_drafter_reproduces_the_training_forward_row_by_row(flags):
    """extend + chain steps with the drafter's KV cache give the TTT forward's logits at every row and step,
    for a batch of requests each anchored at another row (so each is padded differently); for EAGLE 3.1 too,
    whose steps carry the normed state."""
    drafter = _drafter(draft_vocab=VOCAB, **flags)
    with torch.no_grad():  # norm weights away from 1 (an EAGLE 3.1 norm left out or doubled would show)
        for name, parameter in drafter.named_parameters():
            if "norm" in name:
                parameter.uniform_(0.5, 1.5)
    length, steps = 14, 4
    ids = torch.randint(0, VOCAB, (1, length), generator=torch.Generator().manual_seed(2))
    aux = torch.randn(1, length, 3 * HIDDEN, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ttt = drafter.forward_ttt(ids, aux, ttt_length=steps)
    anchors = list(range(length - steps - 1))  # request b stops its extend at row anchors[b]
    batch, width = len(anchors), max(anchors) + 1
    proposer = EagleProposer(drafter)
    proposer.reset(batch)
    positions = torch.arange(width).expand(batch, width)
    valid = positions <= torch.tensor(anchors)[:, None]
    proposer.extend(aux[0, :width].expand(batch, -1, -1), ids[0, 1: width + 1].expand(batch, -1), positions, valid)
    hidden = proposer.last_hidden
    every = torch.ones((batch, 1), dtype=torch.bool)
    for step in range(steps):
        want = torch.stack([ttt[step][0, row] for row in anchors])
        with torch.no_grad():
            torch.testing.assert_close(drafter.logits(hidden), want, atol=1e-5, rtol=1e-5)
        if step + 1 < steps:  # teacher forcing: feed the data's token, as the TTT forward does
            tokens = torch.stack([ids[0, row + 2 + step] for row in anchors])[:, None]
            with torch.no_grad():
                hidden = proposer._layer(hidden[:, None], tokens, (proposer.last_position + step + 1)[:, None],
                                         every)[:, 0]


def test_the_reference_decode_by_full_forwards_equals_the_engines_cached_decode(random_target):
    """Two independent paths (full forwards; the engine's batched decode with its KV cache) agree in float32."""
    for prompt, (ids, tops) in zip(_prompts(4), random_target.greedy_reference(_prompts(4), 30, ignore_eos=True)):
        _engine_is_greedy(random_target.runner.run_batch([_job(prompt, 30)])[0].output_ids, (ids, tops))
        assert len(ids) == len(tops) == 30
        assert all(top.first_logit >= top.second_logit and top.first_id != top.second_id for top in tops)


def _job(prompt, budget):
    from eagle3_pipeline.engine.batcher import GenerateJob, SamplingConfig

    return GenerateJob(rid="t", input_ids=prompt, capture=False,
                       sampling=SamplingConfig(max_new_tokens=budget, temperature=0.0, ignore_eos=True))


@pytest.mark.parametrize("draft_tokens", [1, 4])
def test_output_equals_target_greedy_decode_on_a_random_llama(random_target, draft_tokens):
    prompts = _prompts(4)  # of different lengths: the batch is padded
    results = speculative_generate(random_target, EagleProposer(_drafter()), prompts, 40, draft_tokens)
    for prompt, result, want in zip(prompts, results, random_target.greedy_reference(prompts, 40)):
        _is_greedy(random_target, prompt, result, want)
        assert sum(r.produced for r in result.rounds) == len(result.output_ids) - 1


def test_the_target_alone_decodes_its_greedy_output_one_token_per_forward(random_target):
    """A chain of 0: the baseline the evaluation's speed-up divides by, over the same engine, never drafting."""

    class NeverCalled:
        def __getattr__(self, name):
            raise AssertionError(f"the proposer's {name} was called with no drafts to make")

    prompts = _prompts(4)
    stats = AcceptanceStats(0)
    results = speculative_generate(random_target, NeverCalled(), prompts, 24, 0, ignore_eos=True)
    for prompt, result, want in zip(prompts, results, random_target.greedy_reference(prompts, 24, ignore_eos=True)):
        _is_greedy(random_target, prompt, result, want)
        assert [(r.drafted, r.accepted, r.produced) for r in result.rounds] == [(0, 0, 1)] * 23
        stats.add(result)
    assert stats.tau == 1.0 and stats.completion_tokens == 4 * 24 and stats.rounds == 4 * 23
    with pytest.raises(EvaluationError, match="draft_tokens"):
        speculative_generate(random_target, None, prompts, 24, -1)


def test_the_draft_vocabularys_reach_counts_the_answer_tokens_it_cannot_draft():
    from eagle3_pipeline.evaluate.command import draft_vocabulary_reach

    inside = torch.zeros(10, dtype=torch.bool)
    inside[[1, 2, 5]] = True
    outputs = [SpeculativeOutput([9, 1, 2, 7], []), SpeculativeOutput([3, 5], []), SpeculativeOutput([4], [])]
    # The prefill's first token (9, 3, 4) is never a draft's target; of 1, 2, 7, 5 only 7 is outside.
    assert draft_vocabulary_reach(inside, outputs) == {"draft_vocab_size": 3, "answer_tokens": 4, "outside": 1,
                                                       "share_outside": 0.25}
    assert draft_vocabulary_reach(inside, [SpeculativeOutput([4], [])])["share_outside"] is None


@pytest.fixture(scope="module")
def deepseek_target(tmp_path_factory) -> tuple[Path, TargetModel]:
    """A random DeepSeek-V3-shaped target (multi-latent attention, YaRN): what Kimi-K2.x is, tiny."""
    from train_fixtures import DEEPSEEK_V3

    torch.manual_seed(0)
    config = transformers.DeepseekV3Config(**{
        "vocab_size": VOCAB, "hidden_size": HIDDEN, "intermediate_size": 64, "max_position_embeddings": 256,
        "num_attention_heads": 4, "tie_word_embeddings": False, "eos_token_id": EOS, **DEEPSEEK_V3})
    model = transformers.DeepseekV3ForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(40.0)
    path = tmp_path_factory.mktemp("deepseek-v3")
    model.save_pretrained(path, safe_serialization=True)
    return path, TargetModel.load(path, [1, 2, 3], device="cpu")


@pytest.mark.parametrize("variant", ["eagle3", "eagle3.1"])
def test_the_mla_drafter_drafts_on_a_deepseek_v3_target_and_the_output_is_the_targets_greedy_decode(
        deepseek_target, variant):
    path, deepseek_target = deepseek_target
    config = DrafterConfig.from_target(json.loads((path / "config.json").read_text()), 3, 48, variant=variant)
    assert config.layout == "mla"
    torch.manual_seed(2)
    drafter = Eagle3Drafter(config)
    with torch.no_grad():
        for parameter in drafter.parameters():
            if parameter.requires_grad:
                parameter.normal_(0, 0.2)
    prompts = _prompts(3)
    results = speculative_generate(deepseek_target, EagleProposer(drafter.eval()), prompts, 30, 3, ignore_eos=True)
    for prompt, result, want in zip(prompts, results,
                                    deepseek_target.greedy_reference(prompts, 30, ignore_eos=True)):
        _is_greedy(deepseek_target, prompt, result, want)
        assert sum(r.produced for r in result.rounds) == len(result.output_ids) - 1


def test_a_batch_decodes_exactly_what_each_request_decodes_alone(random_target):
    """Same outputs and the same rounds, request by request: no request sees another's tokens or padding (up to a
    float32 near-tie, where padding changes the kernels' rounding)."""
    prompts = _prompts(6, seed=13)
    proposer = EagleProposer(_drafter(seed=3))
    together = speculative_generate(random_target, proposer, prompts, 25, 3, ignore_eos=True)
    for prompt, batched in zip(prompts, together):
        alone = speculative_generate(random_target, proposer, [prompt], 25, 3, ignore_eos=True)[0]
        if _is_greedy(random_target, prompt, batched, (alone.output_ids, alone.top2)):
            assert [(r.drafted, r.accepted, r.produced) for r in batched.rounds] == \
                [(r.drafted, r.accepted, r.produced) for r in alone.rounds]


def test_output_equals_target_greedy_decode_on_the_tiny_model(tmp_path):
    # any_versions: this file also runs under the oldest transformers hosts may have (make test-transformers),
    # which reads the checkout's build as it is instead of training another one (4 minutes) over it.
    model = built_tiny_model(any_versions=True)
    target = TargetModel.load(model, [0, 1, 2], device="cpu")
    vocab = target.input_embeddings().shape[0]
    hidden = target.input_embeddings().shape[1]
    drafter = _drafter(draft_vocab=512, vocab=vocab, hidden=hidden)
    drafter.load_target_embeddings(target.input_embeddings().detach())
    tokenizer = target.tokenizer
    questions = ["What does heapq.heapify do?", "Explain the Python module json.", "What is os.path.join for?"]
    prompts = []
    for question in questions:
        text = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                             tokenize=False)
        prompts.append(tokenizer(text, add_special_tokens=False)["input_ids"])
    stats = AcceptanceStats(3)
    results = speculative_generate(target, EagleProposer(drafter), prompts, 48, 3)
    for prompt, result, want in zip(prompts, results, target.greedy_reference(prompts, 48)):
        _is_greedy(target, prompt, result, want)
        stats.add(result)
    assert stats.tau >= 1.0


def test_tau_is_one_plus_the_mean_accepted_drafts(random_target):
    stats = AcceptanceStats(4)
    for result in speculative_generate(random_target, EagleProposer(_drafter()), _prompts(5, seed=9), 30, 4,
                                       ignore_eos=True):
        stats.add(result)
    assert stats.tau >= 1.0
    # ignore_eos: no round is cut by an end token, so every round produces its accepted drafts + 1
    assert stats.tau == pytest.approx(1 + stats.mean_accepted)
    assert sum(stats.accepted_per_position) == pytest.approx(stats.mean_accepted)
    assert stats.completion_tokens == 5 * 30  # every request to its budget, nothing past it
    assert stats.sglang_accept_length == pytest.approx(stats.tau + 5 / stats.rounds)


def test_a_perfect_proposer_gets_tau_k_plus_one_and_a_wrong_one_tau_one(random_target):
    prompts, k = _prompts(2, seed=4), 3
    budget = 1 + (k + 1) * 6  # the prefill's token, then six full rounds
    reference = random_target.greedy_reference(prompts, budget, ignore_eos=True)
    perfect = AcceptanceStats(k)
    exact = True
    for prompt, result, want in zip(prompts, speculative_generate(
            random_target, OracleProposer(random_target, prompts), prompts, budget, k, ignore_eos=True), reference):
        perfect.add(result)
        exact = _is_greedy(random_target, prompt, result, want) and exact
    if exact:  # a near-tie ordered differently by the verify forward would reject one draft there
        assert perfect.tau == k + 1 and perfect.rounds == 2 * 6
        assert perfect.accepted_per_position == [1.0, 1.0, 1.0]
    wrong = AcceptanceStats(k)
    results = speculative_generate(random_target, WrongProposer(random_target, prompts), prompts, budget, k,
                                   ignore_eos=True)
    for prompt, result, want in zip(prompts, results, reference):
        wrong.add(result)
        _is_greedy(random_target, prompt, result, want)
    assert wrong.tau == 1.0 and wrong.accepted_per_position == [0.0, 0.0, 0.0]


def test_a_perfect_eagle3_drafter_gets_tau_k_plus_one(tmp_path):
    """A target that always says token 0 and an exported drafter that always proposes it (both final norms zero)."""
    target = TargetModel.load(_random_llama(tmp_path / "flat", zero_norm=True), AUX, device="cpu")
    drafter = _drafter(draft_vocab=VOCAB)  # d2t = 0: draft id 0 is target id 0
    with torch.no_grad():
        drafter.norm.weight.zero_()  # every draft logit 0: top-1 is draft id 0
    manifest = {"aux_layers": AUX, "target_model_path": "/t", "target_config_sha256": "c" * 64,
                "target_config": {"model_type": "llama"}}
    cfg = {**drafter.config.__dict__, "torch_dtype": "float32"}
    out = export_sglang({k: v for k, v in drafter.state_dict().items() if k != "embed_tokens.weight"}, cfg, manifest,
                        tmp_path / "drafter", target_model_type_override="llama")
    loaded, config = load_drafter(out, target.input_embeddings())
    assert drafter_aux_layers(config) == AUX
    stats = AcceptanceStats(4)
    for result in speculative_generate(target, EagleProposer(loaded), _prompts(3), 1 + 5 * 4, 4, ignore_eos=True):
        assert result.output_ids == [0] * 21
        stats.add(result)
    assert _reference(target, _prompts(3), 21, ignore_eos=True) == [[0] * 21] * 3
    assert stats.tau == 5.0 and stats.conditional_acceptance == [1.0] * 4


def _one_token_drafter(token: int, seed: int = 2) -> Eagle3Drafter:
    """A drafter that proposes ``token`` where one coordinate of its output state is positive, else token 0: its
    drafts depend on the states it reads, and on a target that repeats ``token`` it is often right."""
    drafter = _drafter(draft_vocab=VOCAB, seed=seed)  # the whole vocabulary: draft id = target id
    with torch.no_grad():
        drafter.norm.weight.zero_()
        drafter.norm.weight[0] = 1.0
        drafter.lm_head.weight.zero_()
        drafter.lm_head.weight[token, 0] = 1.0
    return drafter


@pytest.mark.parametrize("ignore_eos", [True, False])
def test_the_replay_from_full_forwards_counts_the_rounds_the_cached_decode_counts(random_target, ignore_eos):
    """The same drafter and prompts: the rounds of the cached speculative decode and of its replay from one full
    forward per prompt (the drafter teacher-forced on the reference decode) are the same rounds, in float32."""
    prompts, budget, chains = _prompts(6, seed=3), 40, [1, 3, 5]
    saved = random_target.eos_token_ids
    plain = _reference(random_target, prompts, budget, ignore_eos=True)
    frequent = max(set(plain[0]), key=lambda token: sum(ids.count(token) for ids in plain))
    if not ignore_eos:  # an end token the random target does choose: requests end early, at different lengths
        random_target.eos_token_ids = {plain[1][11]}
    try:
        reference = random_target.greedy_reference(prompts, budget, ignore_eos=ignore_eos)
        for drafter in (_drafter(draft_vocab=VOCAB, seed=2), _one_token_drafter(frequent)):
            replayed = replay_chains(random_target, drafter, prompts, reference, chains, budget).chains
            for chain in chains:
                measured, exact = AcceptanceStats(chain), True
                for prompt, result, want in zip(prompts, speculative_generate(
                        random_target, EagleProposer(drafter), prompts, budget, chain, ignore_eos), reference):
                    measured.add(result)
                    exact = _is_greedy(random_target, prompt, result, want) and exact
                if not exact:  # a float32 near-tie taken the other way parts the decodes there
                    continue
                if ignore_eos:
                    assert replayed[chain].as_dict() == measured.as_dict()
                    assert (replayed[chain].accepted, replayed[chain].reached) == (measured.accepted, measured.reached)
                else:  # a round cut by the end token may count drafts after it in the cached decode (replay_chains)
                    assert replayed[chain].completion_tokens == measured.completion_tokens
                    assert abs(replayed[chain].rounds - measured.rounds) <= len(prompts)
        # The one-token drafter is right in some rounds and wrong in others: the counts can tell a wrong replay.
        accepted = replayed[chains[-1]].accepted
        assert 0 < accepted[0] < replayed[chains[-1]].reached[0]
    finally:
        random_target.eos_token_ids = saved


def test_the_trainings_walk_over_the_same_answers_counts_the_replays_rounds(tmp_path):
    """The training's held-out scoring (``StepRunner.forward`` over a packed batch scored on ``opening_mask``,
    walked by ``opening_answers`` and ``answer_rounds``) over the prompts' greedy answers, their states from full
    forwards: the same rounds per chain as the replay of those answers, and the same per-token acc_k as the
    replay's ``token_counts``; so a gap between the training's walk and serving is the data, nothing else."""
    from dataclasses import replace

    from eagle3_pipeline.evaluate.rounds import answer_rounds
    from eagle3_pipeline.train.data import PackedBatch, opening_answers, opening_mask
    from eagle3_pipeline.train.step import StepRunner

    target = TargetModel.load(_random_llama(tmp_path), AUX, device="cpu", decode="transformers")
    prompts, budget, chains, steps = _prompts(8, seed=6), 24, [1, 3, 5], 5
    reference = target.greedy_reference(prompts, budget, ignore_eos=True)
    frequent = max(set(reference[0][0]), key=lambda token: sum(ids.count(token) for ids, _ in reference))
    parts = {"input_ids": [], "loss_mask": [], "aux_hidden": [], "last_hidden": [], "doc_ids": [], "position_ids": []}
    for doc, (prompt, (output, _)) in enumerate(zip(prompts, reference)):
        sequence = [*prompt, *output]
        ids = torch.tensor([sequence])
        with torch.inference_mode():
            aux, last = target._forward(ids, torch.arange(len(sequence))[None], torch.ones_like(ids))  # noqa: SLF001
        parts["input_ids"].append(ids[0])
        parts["loss_mask"].append(torch.tensor([False] * len(prompt) + [True] * len(output)))
        parts["aux_hidden"].append(aux[0].clone())
        parts["last_hidden"].append(last[0].clone())
        parts["doc_ids"].append(torch.full((len(sequence),), doc))
        parts["position_ids"].append(torch.arange(len(sequence)))
    batch = PackedBatch(**{name: torch.cat(values) for name, values in parts.items()})
    served = opening_mask(batch.loss_mask, batch.doc_ids, budget)
    # A random drafter (d2t offsets that are not zero, some answer tokens outside its vocabulary) and one that
    # always proposes the answers' most frequent token (right in some rounds, wrong in others).
    for drafter in (_drafter(draft_vocab=40, seed=4), _one_token_drafter(frequent)):
        runner = StepRunner(drafter, target.runner.lm_head.weight.detach(), ttt_length=steps,
                            device=torch.device("cpu"))
        with torch.no_grad():
            _, metrics = runner.forward(replace(batch, loss_mask=served), training=False)
        answers = opening_answers(served, batch.doc_ids, metrics.leads[0])
        assert [length for _, length in answers] == [len(output) for output, _ in reference]
        replayed = replay_chains(target, drafter, prompts, reference, chains, budget)
        for chain in chains:
            walked = AcceptanceStats(chain)
            for leads, length in answers:
                walked.add_walk(answer_rounds(leads, length, chain, budget))
            assert walked.as_dict() == replayed.chains[chain].as_dict()
        assert metrics.cond_acc == pytest.approx(replayed.per_token()["cond_acc_k"], abs=0)
        assert int(metrics.chain_rows[0]) == replayed.per_token()["rows"] == sum(len(o) - 1 for o, _ in reference)
    assert 0 < replayed.chains[3].accepted[0] < replayed.chains[3].reached[0]


def test_a_random_drafter_accepts_little(random_target):
    stats = AcceptanceStats(3)
    for result in speculative_generate(random_target, EagleProposer(_drafter(seed=7)), _prompts(4, seed=11), 30, 3,
                                       ignore_eos=True):
        stats.add(result)
    assert 1.0 <= stats.tau < 1.5


def test_end_of_sequence_ends_the_request_where_it_stands(random_target):
    prompts = _prompts(2, seed=4)
    plain = _reference(random_target, prompts, 40, ignore_eos=True)[0]
    stop = 9
    saved = random_target.eos_token_ids
    # Make the 10th greedy token of the first prompt the end token (the random target never picks id 2).
    random_target.eos_token_ids = {plain[stop]}
    try:
        first = plain.index(plain[stop])
        reference = random_target.greedy_reference(prompts, 40)
        assert reference[0][0] == plain[: first + 1]  # the reference decode stops at the end token too
        results = speculative_generate(random_target, OracleProposer(random_target, prompts), prompts, 40, 4)
        for prompt, result, want in zip(prompts, results, reference):
            if _is_greedy(random_target, prompt, result, want) and want[0][-1] in random_target.eos_token_ids:
                assert result.output_ids[-1] == plain[stop] and len(result.output_ids) == first + 1
    finally:
        random_target.eos_token_ids = saved


def test_a_kv_cache_the_model_ignores_is_caught_by_the_full_forward_oracle(tmp_path, monkeypatch):
    """What transformers 5.17 did to the engine (a cache passed under a name the decoder swallows): the start-up
    check refuses such a model, and, were it to get past, the outputs differ from the full-forward decode."""
    from eagle3_pipeline.engine import batcher

    path = _random_llama(tmp_path / "llama")
    monkeypatch.setattr(batcher.ModelRunner, "_cache_keyword", lambda self: "a_cache_the_decoder_swallows")
    with pytest.raises(ValueError, match="differ from a full forward"):
        TargetModel.load(path, AUX, device="cpu")
    monkeypatch.setattr(batcher.ModelRunner, "_check_cached_forward", lambda self: None)
    target = TargetModel.load(path, AUX, device="cpu", decode="transformers")
    prompts = _prompts(4)
    results = speculative_generate(target, EagleProposer(_drafter()), prompts, 30, 3, ignore_eos=True)
    mismatches = [compare_with_reference(r, ref) for r, ref in zip(results, target.greedy_reference(prompts, 30,
                                                                                                     ignore_eos=True))]
    judge_mismatches(target, prompts, mismatches)
    assert all(m is not None and not m.near_tie for m in mismatches)


def test_batches_bound_the_padded_tokens_and_the_attention_of_a_full_forward(monkeypatch):
    from eagle3_pipeline.evaluate import speculative

    prompts = [[1] * n for n in (10, 50, 40, 30, 20)]
    batches = speculative.batches_by_tokens(prompts, 100, reserve=5)
    assert sorted(i for batch in batches for i in batch) == list(range(5))
    assert all(len(batch) * max(len(prompts[i]) + 5 for i in batch) <= 100 or len(batch) == 1 for batch in batches)
    monkeypatch.setattr(speculative, "ATTENTION_ELEMENTS", 50 * 50)  # one 50-token prompt's attention
    for batch in speculative.batches_by_tokens(prompts, 10**6):
        assert len(batch) == 1 or len(batch) * max(len(prompts[i]) for i in batch) ** 2 <= 50 * 50
