"""Speculative decoding on real (tiny) models: the output is the target's greedy decode, tau is counted right."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from eagle3_pipeline.evaluate.speculative import (
    AcceptanceStats,
    EagleProposer,
    TargetModel,
    drafter_aux_layers,
    load_drafter,
    speculative_generate,
)
from eagle3_pipeline.models.tiny import build_tiny_model
from eagle3_pipeline.train.export import export_sglang
from eagle3_pipeline.train.model import DrafterConfig, Eagle3Drafter

ROOT = Path(__file__).resolve().parents[2]
VOCAB, HIDDEN, LAYERS, AUX = 64, 32, 4, [0, 1, 2]
EOS = 2


def _random_llama(path: Path, zero_norm: bool = False) -> Path:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=64,
                                      num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=256, tie_word_embeddings=False, eos_token_id=EOS)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(40.0)  # a sharp head: greedy choices far from ties
        if zero_norm:  # every logit 0: the greedy choice is token 0 at every position
            model.model.norm.weight.zero_()
    model.save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="module")
def random_target(tmp_path_factory) -> TargetModel:
    return TargetModel.load(_random_llama(tmp_path_factory.mktemp("llama")), AUX, device="cpu")


def _drafter(draft_vocab: int = 48, seed: int = 1, vocab: int = VOCAB, hidden: int = HIDDEN) -> Eagle3Drafter:
    torch.manual_seed(seed)
    config = DrafterConfig(hidden_size=hidden, num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4,
                           intermediate_size=2 * hidden, target_hidden_size=hidden, num_aux_hidden_states=3,
                           vocab_size=vocab, draft_vocab_size=draft_vocab)
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
    """A perfect drafter: proposes the target's own greedy continuation."""

    def __init__(self, target: TargetModel, prompt: list[int]):
        self.target, self.prompt, self.known = target, prompt, []

    def reset(self):
        self.known = list(self.prompt)

    def extend(self, aux, token_ids, start):
        self.known = self.known[: start + 1] + list(token_ids)  # tokens through position start, then the new ones

    def propose(self, count):
        continuation = self.target.greedy(self.known, count, ignore_eos=True)
        return continuation[:count]


class WrongProposer(OracleProposer):
    """Always wrong: the oracle's tokens shifted by one."""

    def propose(self, count):
        return [(token + 1) % VOCAB for token in super().propose(count)]


def test_incremental_drafter_reproduces_the_training_forward_row_by_row():
    """extend + chain steps with the drafter's KV cache give the TTT forward's logits at every row and step."""
    drafter = _drafter(draft_vocab=VOCAB)
    length, steps = 14, 4
    ids = torch.randint(0, VOCAB, (1, length), generator=torch.Generator().manual_seed(2))
    aux = torch.randn(1, length, 3 * HIDDEN, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ttt = drafter.forward_ttt(ids, aux, ttt_length=steps)
    proposer = EagleProposer(drafter)
    for row in range(length - steps - 1):
        proposer.reset()
        proposer.extend(aux[0, : row + 1], ids[0, 1: row + 2].tolist(), 0)  # a_t paired with x_{t+1}
        hidden = proposer.last_hidden
        for step in range(steps):
            torch.testing.assert_close(drafter.logits(hidden), ttt[step][0, row], atol=1e-5, rtol=1e-5)
            if step + 1 < steps:  # teacher forcing: feed the data's token, as the TTT forward does
                position = torch.tensor([proposer.last_position + step + 1])
                with torch.no_grad():
                    hidden = proposer._layer(hidden[None], ids[0, row + 2 + step].view(1), position)[0]


@pytest.mark.parametrize("draft_tokens", [1, 4])
def test_output_equals_target_greedy_decode_on_a_random_llama(random_target, draft_tokens):
    proposer = EagleProposer(_drafter())
    for prompt in _prompts(4):
        result = speculative_generate(random_target, proposer, prompt, 40, draft_tokens)
        assert result.output_ids == random_target.greedy(prompt, 40)
        assert sum(r.produced for r in result.rounds) == len(result.output_ids) - 1


def test_output_equals_target_greedy_decode_on_the_tiny_model(tmp_path):
    model = build_tiny_model(ROOT / ".cache" / "models" / "tiny-llama")
    target = TargetModel.load(model, [0, 1, 2], device="cpu")
    vocab = target.input_embeddings().shape[0]
    hidden = target.input_embeddings().shape[1]
    drafter = _drafter(draft_vocab=512, vocab=vocab, hidden=hidden)
    drafter.load_target_embeddings(target.input_embeddings().detach())
    tokenizer = target.tokenizer
    questions = ["What does heapq.heapify do?", "Explain the Python module json.", "What is os.path.join for?"]
    stats = AcceptanceStats(3)
    for question in questions:
        text = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                             tokenize=False)
        prompt = tokenizer(text, add_special_tokens=False)["input_ids"]
        result = speculative_generate(target, EagleProposer(drafter), prompt, 48, 3)
        assert result.output_ids == target.greedy(prompt, 48)
        stats.add(result)
    assert stats.tau >= 1.0


def test_tau_is_one_plus_the_mean_accepted_drafts(random_target):
    stats = AcceptanceStats(4)
    proposer = EagleProposer(_drafter())
    for prompt in _prompts(5, seed=9):
        stats.add(speculative_generate(random_target, proposer, prompt, 30, 4, ignore_eos=True))
    assert stats.tau >= 1.0
    assert stats.tau == pytest.approx(1 + stats.mean_accepted)
    assert sum(stats.accepted_per_position) == pytest.approx(stats.mean_accepted)
    assert stats.completion_tokens == 5 * 30  # ignore_eos: every request to its budget, nothing past it
    assert stats.sglang_accept_length == pytest.approx(stats.tau + 5 / stats.rounds)


def test_a_perfect_proposer_gets_tau_k_plus_one_and_a_wrong_one_tau_one(random_target):
    prompt, k = _prompts(1, seed=4)[0], 3
    budget = 1 + (k + 1) * 6  # the prefill's token, then six full rounds
    perfect = AcceptanceStats(k)
    perfect.add(speculative_generate(random_target, OracleProposer(random_target, prompt), prompt, budget, k,
                                     ignore_eos=True))
    assert perfect.tau == k + 1 and perfect.rounds == 6
    assert perfect.accepted_per_position == [1.0, 1.0, 1.0]
    wrong = AcceptanceStats(k)
    result = speculative_generate(random_target, WrongProposer(random_target, prompt), prompt, budget, k,
                                  ignore_eos=True)
    wrong.add(result)
    assert wrong.tau == 1.0 and wrong.accepted_per_position == [0.0, 0.0, 0.0]
    assert result.output_ids == random_target.greedy(prompt, budget, ignore_eos=True)


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
    for prompt in _prompts(3):
        result = speculative_generate(target, EagleProposer(loaded), prompt, 1 + 5 * 4, 4, ignore_eos=True)
        assert result.output_ids == [0] * 21 == target.greedy(prompt, 21, ignore_eos=True)
        stats.add(result)
    assert stats.tau == 5.0 and stats.conditional_acceptance == [1.0] * 4


def test_a_random_drafter_accepts_little(random_target):
    stats = AcceptanceStats(3)
    proposer = EagleProposer(_drafter(seed=7))
    for prompt in _prompts(4, seed=11):
        stats.add(speculative_generate(random_target, proposer, prompt, 30, 3, ignore_eos=True))
    assert 1.0 <= stats.tau < 1.5


def test_end_of_sequence_ends_the_request_where_it_stands(random_target):
    prompt = _prompts(1, seed=4)[0]
    plain = random_target.greedy(prompt, 40, ignore_eos=True)
    stop = 9
    saved = (random_target.eos_token_ids, random_target.runner.eos_token_ids)
    # Make the 10th greedy token the end token, for both decoders (the random target never picks id 2).
    random_target.eos_token_ids = random_target.runner.eos_token_ids = {plain[stop]}
    try:
        first = plain.index(plain[stop])
        result = speculative_generate(random_target, OracleProposer(random_target, prompt), prompt, 40, 4)
        assert result.output_ids == plain[: first + 1] == random_target.greedy(prompt, 40)
    finally:
        random_target.eos_token_ids, random_target.runner.eos_token_ids = saved
