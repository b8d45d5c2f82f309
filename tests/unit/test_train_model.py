"""The EAGLE-3 drafter: SGLang's weight names, the config from the target, the TTT attention pattern
against a plain per-step computation, the teacher, the loss and the metrics on hand-made examples.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from float_rounding import U32, dot_error_bound

from eagle3_pipeline.train.kernels import packed_layout, ttt_attention, ttt_attention_mask
from eagle3_pipeline.train.loss import (
    STEP_DECAY,
    acceptance_length,
    fused_ttt_loss,
    teacher_targets,
    ttt_loss,
    ttt_metrics,
    ttt_metrics_from_argmax,
)
from eagle3_pipeline.train.model import DrafterConfig, DrafterConfigError, Eagle3Drafter, rope_inv_freq
from eagle3_pipeline.train.vocab import build_draft_vocab

SGLANG_EAGLE3 = (Path(__file__).resolve().parents[2] / ".venv-sglang/lib/python3.11/site-packages/sglang/srt/models"
                 / "llama_eagle3.py")
TARGET = {
    "hidden_size": 16,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 24,
    "vocab_size": 40,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "max_position_embeddings": 128,
    "hidden_act": "silu",
}
N_AUX = 3
DRAFT = 24


@pytest.fixture(autouse=True)
def one_thread():
    """At these tiny shapes the thread pool's overhead dominates (20x on a loaded 2-core runner)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def tiny_drafter(seed: int = 0, **overrides) -> Eagle3Drafter:
    torch.manual_seed(seed)
    config = DrafterConfig.from_target(TARGET, N_AUX, DRAFT, **overrides)
    counts = torch.randint(0, 50, (TARGET["vocab_size"],))
    vocab = build_draft_vocab(counts, DRAFT)
    model = Eagle3Drafter(config, vocab.d2t, vocab.t2d)
    torch.nn.init.normal_(model.embed_tokens.weight)
    return model


# The names and shapes SGLang 0.5.23's LlamaForCausalLMEagle3.load_weights reads (llama_eagle3.py):
# "midlayer" is renamed to "layers.0", q/k/v_proj are stacked into qkv_proj and gate/up_proj into
# gate_up_proj, other names get "model." prepended; d2t becomes hot_token_id, t2d is skipped;
# embed_tokens is replaced by the target's (eagle_worker_v2.init_lm_head -> set_embed), so the
# exporter leaves it out. qkv reads 2H (the input layer concatenates embeddings and hidden).
H, HEADS, KV, HD, MLP, V = 16, 4, 2, 4, 24, 40
SGLANG_NAMES = {
    "fc.weight": (H, N_AUX * H),
    "midlayer.input_layernorm.weight": (H,),
    "midlayer.hidden_norm.weight": (H,),
    "midlayer.self_attn.q_proj.weight": (HEADS * HD, 2 * H),
    "midlayer.self_attn.k_proj.weight": (KV * HD, 2 * H),
    "midlayer.self_attn.v_proj.weight": (KV * HD, 2 * H),
    "midlayer.self_attn.o_proj.weight": (H, HEADS * HD),
    "midlayer.post_attention_layernorm.weight": (H,),
    "midlayer.mlp.gate_proj.weight": (MLP, H),
    "midlayer.mlp.up_proj.weight": (MLP, H),
    "midlayer.mlp.down_proj.weight": (H, MLP),
    "norm.weight": (H,),
    "lm_head.weight": (DRAFT, H),
    "d2t": (DRAFT,),
    "t2d": (V,),
}


def test_state_dict_names_and_shapes_are_sglangs():
    state = tiny_drafter().state_dict()
    assert state.pop("embed_tokens.weight").shape == (V, H)
    assert {name: tuple(t.shape) for name, t in state.items()} == SGLANG_NAMES
    assert state["d2t"].dtype == torch.int64
    assert state["t2d"].dtype == torch.bool
    trainable = {name for name, p in tiny_drafter().named_parameters() if p.requires_grad}
    assert trainable == set(SGLANG_NAMES) - {"d2t", "t2d"}


def test_eagle3_1_adds_sglangs_fc_norm_and_input_norm_weights():
    state = tiny_drafter(variant="eagle3.1", norm_before_fc=True).state_dict()
    state.pop("embed_tokens.weight")
    extra = {name: tuple(t.shape) for name, t in state.items() if name not in SGLANG_NAMES}
    assert extra == {"fc_norm.0.weight": (H,), "fc_norm.1.weight": (H,), "fc_norm.2.weight": (H,),
                     "input_norm.weight": (N_AUX * H,)}
    with pytest.raises(ValueError, match="drafter variant 'eagle4'"):
        tiny_drafter(variant="eagle4")


@pytest.mark.skipif(not SGLANG_EAGLE3.is_file(), reason="no .venv-sglang (make test creates it)")
def test_the_pinned_sglang_still_maps_names_as_listed_here():
    text = SGLANG_EAGLE3.read_text()
    for mapping in ('"midlayer": "layers.0"', '(".qkv_proj", ".q_proj", "q")', '(".qkv_proj", ".k_proj", "k")',
                    '(".qkv_proj", ".v_proj", "v")', '(".gate_up_proj", ".gate_proj", 0)',
                    '(".gate_up_proj", ".up_proj", 1)', 'if "d2t" in name', 'if "t2d" in name',
                    "self.hidden_norm = RMSNorm", "hidden_size = 2 * self.hidden_size if self.is_input_layer",
                    "torch.cat([embeds, hidden_states], dim=-1)",
                    # EAGLE 3.1 (train/variants.py): the flags' keys, the norms' names, what norm_output feeds on.
                    'getattr(config, "fc_norm", None)', '"aux_norm_low": "fc_norm.0"',
                    'self.norm_output = getattr(config, "norm_output", False)',
                    'eagle_config.get("norm_before_fc"', "self.input_norm = RMSNorm",
                    "aux = hidden_states_to_logits if self.norm_output else hidden_states_to_aux"):
        assert mapping in text, mapping


def test_config_from_target_and_overrides():
    config = DrafterConfig.from_target(TARGET, N_AUX, None)
    shape = (config.hidden_size, config.num_attention_heads, config.num_key_value_heads, config.head_dim)
    assert shape == (16, 4, 2, 4)
    assert (config.intermediate_size, config.draft_vocab_size, config.rms_norm_eps) == (24, 40, 1e-6)
    wide = DrafterConfig.from_target({**TARGET, "head_dim": 8}, N_AUX, 8, hidden_size=32, intermediate_size=64)
    assert (wide.hidden_size, wide.target_hidden_size, wide.head_dim, wide.intermediate_size) == (32, 16, 8, 64)
    assert DrafterConfig.from_target({**TARGET, "head_dim": 8}, N_AUX, 8).head_dim == 8
    nested = DrafterConfig.from_target({"text_config": TARGET, "architectures": ["X"]}, 2, 8)
    assert (nested.hidden_size, nested.num_aux_hidden_states) == (16, 2)
    llama3 = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    v5 = DrafterConfig.from_target({**TARGET, "rope_parameters": llama3}, N_AUX, 8)
    assert (v5.rope_theta, v5.rope_scaling["rope_type"]) == (500000.0, "llama3")


@pytest.mark.parametrize(
    ("target", "kwargs", "words"),
    [
        (TARGET, {"draft_vocab_size": 41}, "eagle_training_draft_vocab_size=41"),
        (TARGET, {"num_attention_heads": 3}, "multiple of num_key_value_heads"),
        ({**TARGET, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, {}, "rope type 'yarn'"),
        ({**TARGET, "hidden_act": "gelu"}, {}, "hidden_act 'gelu'"),
        ({"num_attention_heads": 4}, {}, "no 'hidden_size'"),
    ],
)
def test_config_refusals_name_the_field(target, kwargs, words):
    with pytest.raises((DrafterConfigError, ValueError), match=words):
        DrafterConfig.from_target(target, N_AUX, **kwargs)


def test_llama3_rope_frequencies_match_transformers():
    modeling_rope_utils = pytest.importorskip("transformers.modeling_rope_utils")
    from transformers import LlamaConfig

    llama3 = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    target = {**TARGET, "hidden_size": 256, "num_attention_heads": 2, "num_key_value_heads": 2,
              "max_position_embeddings": 1024, "rope_parameters": llama3}
    ours = rope_inv_freq(DrafterConfig.from_target(target, N_AUX, 8))
    theirs, _ = modeling_rope_utils.ROPE_INIT_FUNCTIONS["llama3"](LlamaConfig(**target))
    # Ours is the float64 formula rounded once to float32 (1 u). transformers evaluates it in float32:
    # theta ** (i / dim) to 1 ulp and its reciprocal, 3 u; in the blended band the wavelength ratio r
    # (<= high_freq_factor = 4) carries 6 u, i.e. 24 u absolute, so the smooth factor (r - 1) / 3 is off by
    # at most (24 + 3) u / 3 + u = 10 u, which the blend amplifies by at most factor - 1 = 7 relative to its
    # smallest value inv / factor: 70 u; the blend's own 4 roundings add 4 u. A wrong band edge, factor or
    # blend is off by percents.
    torch.testing.assert_close(ours, theirs.float(), rtol=(1 + 3 + 70 + 4) * U32, atol=0)


def test_attention_mask_pattern_on_a_small_example():
    mask = ttt_attention_mask(torch.tensor([[0, 0, 1]]), 3)[0, 0].int()
    expected = [
        # step-0 keys  step-1 keys  step-2 keys
        [1, 0, 0,      1, 0, 0,     1, 0, 0],
        [1, 1, 0,      0, 1, 0,     0, 1, 0],
        [0, 0, 1,      0, 0, 1,     0, 0, 1],  # row 2 starts another packed sample
    ]
    assert mask.tolist() == expected


def plain_rope(x: torch.Tensor, position: int, inv_freq: torch.Tensor) -> torch.Tensor:
    """Rotate one head vector [hd]: pairs (i, i + hd/2) by the angle position * inv_freq[i]."""
    half = x.shape[0] // 2
    angle = position * inv_freq.to(x.dtype)
    first, second = x[:half], x[half:]
    return torch.cat([first * angle.cos() - second * angle.sin(), second * angle.cos() + first * angle.sin()])


def step_tokens(input_ids: torch.Tensor, step: int) -> torch.Tensor:
    """The tokens TTT step ``step`` reads: row t gets x_{t+1+step}, 0 past the end."""
    length = input_ids.shape[1]
    tokens = torch.zeros_like(input_ids)
    for t in range(length):
        if t + 1 + step < length:
            tokens[:, t] = input_ids[:, t + 1 + step]
    return tokens


def reference_ttt(model: Eagle3Drafter, input_ids, aux, doc_ids, positions, steps: int) -> list[torch.Tensor]:
    """The unrolled steps written plainly: row by row, head by head, keys listed explicitly."""
    layer, attn = model.midlayer, model.midlayer.self_attn
    batch, length = input_ids.shape
    group = attn.heads // attn.kv_heads
    eps = model.config.rms_norm_eps

    def plain_rms(x, weight):
        return weight * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)

    # SGLang's LlamaModel.forward: input_norm over the concatenation, then fc_norm per aux chunk, then fc.
    if model.config.norm_before_fc:
        aux = plain_rms(aux, model.input_norm.weight)
    if model.config.fc_norm:
        aux = torch.cat([plain_rms(chunk, norm.weight) for norm, chunk in zip(model.fc_norm, aux.chunk(N_AUX, -1))],
                        dim=-1)
    hidden = model.fc(aux)
    keys, values, logits = [], [], []  # keys[i][b][t]: [kv_heads, hd] of step i, row t
    for step in range(steps):
        x = layer.attention_input(model.embed_tokens(step_tokens(input_ids, step)), hidden)
        q = attn.q_proj(x).view(batch, length, attn.heads, attn.head_dim)
        k = attn.k_proj(x).view(batch, length, attn.kv_heads, attn.head_dim)
        v = attn.v_proj(x).view(batch, length, attn.kv_heads, attn.head_dim)
        q = torch.stack([torch.stack([torch.stack([plain_rope(q[b, t, h], int(positions[b, t]) + step, model.inv_freq)
                                                   for h in range(attn.heads)]) for t in range(length)])
                         for b in range(batch)])
        k = torch.stack([torch.stack([torch.stack([plain_rope(k[b, t, h], int(positions[b, t]) + step, model.inv_freq)
                                                   for h in range(attn.kv_heads)]) for t in range(length)])
                         for b in range(batch)])
        keys.append(k)
        values.append(v)
        out = torch.zeros(batch, length, attn.heads, attn.head_dim, dtype=x.dtype)
        for b in range(batch):
            for t in range(length):
                for h in range(attn.heads):
                    g = h // group
                    prefix = [j for j in range(t + 1) if doc_ids[b, j] == doc_ids[b, t]]
                    ks = [keys[0][b, j, g] for j in prefix] + [keys[i][b, t, g] for i in range(1, step + 1)]
                    vs = [values[0][b, j, g] for j in prefix] + [values[i][b, t, g] for i in range(1, step + 1)]
                    weights = torch.softmax(torch.stack(ks) @ q[b, t, h] / math.sqrt(attn.head_dim), dim=0)
                    out[b, t, h] = weights @ torch.stack(vs)
        out = layer.finish(hidden, out.reshape(batch, length, -1))
        normed = plain_rms(out, model.norm.weight)
        logits.append(model.lm_head(normed))  # SGLang's logits read the normed state in both variants
        hidden = normed if model.config.norm_output else out  # norm_output: the next step reads it too
    return logits


VARIANTS = [{}, {"variant": "eagle3.1"}, {"variant": "eagle3.1", "norm_before_fc": True}]


def with_random_norms(model: Eagle3Drafter) -> Eagle3Drafter:
    """The variant's norm weights away from 1, so that a norm left out or applied twice shows."""
    generator = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.startswith(("fc_norm.", "input_norm.", "norm.")):
                param.copy_(0.5 + torch.rand(param.shape, generator=generator, dtype=param.dtype))
    return model


@pytest.mark.parametrize("variant", VARIANTS, ids=["eagle3", "eagle3.1", "eagle3.1+norm_before_fc"])
def test_forward_ttt_equals_a_plain_per_step_computation(variant):
    model = with_random_norms(tiny_drafter(seed=1, **variant).double())
    generator = torch.Generator().manual_seed(2)
    input_ids = torch.randint(0, V, (2, 7), generator=generator)
    aux = torch.randn(2, 7, N_AUX * H, generator=generator, dtype=torch.float64)
    doc_ids = torch.tensor([[0, 0, 0, 0, 0, 0, 0], [0, 0, 0, 1, 1, 1, 1]])  # row 1 packs two samples
    positions = torch.tensor([[3, 4, 5, 6, 7, 8, 9], [0, 1, 2, 0, 1, 2, 3]])
    with torch.no_grad():
        ours = model.forward_ttt(input_ids, aux, positions, ttt_length=4, doc_ids=doc_ids)
        plain = reference_ttt(model, input_ids, aux, doc_ids, positions, 4)
    assert len(ours) == 4
    for step, (a, b) in enumerate(zip(ours, plain)):
        assert a.shape == (2, 7, DRAFT)
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5, msg=f"step {step}")


def test_default_positions_restart_in_each_packed_sample():
    model = tiny_drafter(seed=3)
    input_ids = torch.randint(0, V, (1, 6))
    aux = torch.randn(1, 6, N_AUX * H)
    doc_ids = torch.tensor([[0, 0, 1, 1, 1, 1]])
    explicit = model.forward_ttt(input_ids, aux, torch.tensor([[0, 1, 0, 1, 2, 3]]), 2, doc_ids)
    implicit = model.forward_ttt(input_ids, aux, None, 2, doc_ids)
    for a, b in zip(explicit, implicit):
        torch.testing.assert_close(a, b)


def hand_teacher():
    # V = 6 target tokens, draft vocabulary = target ids 1, 3, 4; lm_head = identity, so the
    # target's logits at row s are last_hidden[s] itself.
    d2t = torch.tensor([1, 2, 2])
    t2d = torch.tensor([False, True, False, True, True, False])
    logits = torch.tensor([
        [0.0, 2.0, 0.0, 1.0, 0.0, 0.0],  # top-1 id 1 (draft 0)
        [0.0, 0.0, 0.0, 0.0, 3.0, 0.0],  # top-1 id 4 (draft 2)
        [5.0, 0.0, 0.0, 1.0, 0.0, 0.0],  # top-1 id 0: not in the draft vocabulary
        [0.0, 0.0, 0.0, 2.0, 0.0, 0.0],  # top-1 id 3 (draft 1)
        [0.0, 1.0, 0.0, 0.0, 0.0, 0.0],  # top-1 id 1 (draft 0)
        [0.0, 0.0, 0.0, 0.0, 1.0, 0.0],  # top-1 id 4 (draft 2)
    ])[None]
    loss_mask = torch.tensor([[0, 0, 1, 1, 1, 1]])
    return teacher_targets(logits, torch.eye(6), t2d, d2t, loss_mask), logits


def test_teacher_soft_targets_and_masks_on_a_hand_made_example():
    teacher, logits = hand_teacher()
    torch.testing.assert_close(teacher.probs[0], torch.softmax(logits[0][:, [1, 3, 4]], dim=-1))
    assert teacher.argmax[0][teacher.in_draft[0]].tolist() == [0, 2, 1, 0, 2]
    assert teacher.in_draft[0].tolist() == [True, True, False, True, True, True]
    # Step 0, row t: teacher row t+1, predicted token x_{t+2}; masked by m_{t+2} and in_draft(t+1).
    assert teacher.valid(0)[0].tolist() == [True, True, True, True, False, False]
    assert teacher.position_mask(0)[0].tolist() == [True, False, True, True, False, False]
    # Step 1, row t: teacher row t+2, predicted token x_{t+3}.
    assert teacher.position_mask(1)[0].tolist() == [False, True, True, False, False, False]
    torch.testing.assert_close(teacher.step_probs(1)[0], teacher.probs[0, 2:])
    assert teacher.step_argmax(1)[0].tolist()[3:] == [2, -1, -1]


def test_a_teacher_temperature_below_one_sharpens_the_soft_targets_and_keeps_the_top_1():
    sharp, logits = hand_teacher_at(0.5)
    plain, _ = hand_teacher()
    torch.testing.assert_close(sharp.probs[0], torch.softmax(2.0 * logits[0][:, [1, 3, 4]], dim=-1))
    assert torch.equal(sharp.argmax, plain.argmax) and torch.equal(sharp.in_draft, plain.in_draft)
    # Every row's top-1 gains probability; the rest loses it.
    rows = torch.arange(6)
    assert bool((sharp.probs[0][rows, plain.probs[0].argmax(-1)] >= plain.probs[0][rows, plain.probs[0].argmax(-1)]
                 ).all())
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="temperature must be positive"):
            hand_teacher_at(bad)


def hand_teacher_at(temperature: float):
    teacher, logits = hand_teacher()
    return teacher_targets(logits, torch.eye(6), teacher_t2d(), torch.tensor([1, 2, 2]), torch.ones(1, 6),
                           temperature=temperature), logits


def teacher_t2d() -> torch.Tensor:
    return torch.tensor([False, True, False, True, True, False])


def test_the_drafter_starts_from_the_targets_head_rows_of_its_draft_vocabulary():
    model = tiny_drafter()
    target_head = torch.randn(V, H)
    final_norm = torch.linspace(0.5, 1.5, H)
    model.load_target_head(target_head, final_norm)
    # Draft id d is target id d + d2t[d]: the drafter's logit d is the target's logit of that token.
    target_ids = model.d2t + torch.arange(DRAFT)
    assert sorted(target_ids.tolist()) == torch.nonzero(model.t2d).flatten().tolist()
    torch.testing.assert_close(model.lm_head.weight, target_head[target_ids])
    torch.testing.assert_close(model.norm.weight, final_norm)
    state = torch.randn(5, H)
    torch.testing.assert_close(model.logits(state), (rms_norm_ref(state) * final_norm) @ target_head[target_ids].t())
    with pytest.raises(DrafterConfigError, match="cannot start from it"):
        model.load_target_head(torch.randn(V, H + 1), None)
    with pytest.raises(DrafterConfigError, match="final norm has shape"):
        model.load_target_head(target_head, torch.ones(H + 1))


def rms_norm_ref(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def test_teacher_masks_stop_at_a_packed_sample_boundary():
    teacher, _ = hand_teacher()
    teacher.doc_ids = torch.tensor([[0, 0, 0, 0, 1, 1]])
    # Row 2 at step 0 predicts x_4, which belongs to the next sample.
    assert teacher.valid(0)[0].tolist() == [True, True, False, False, False, False]


def test_teacher_masks_are_made_once_a_batch_and_again_when_an_input_changes():
    teacher, _ = hand_teacher()
    teacher.loss_mask = torch.ones(1, 6, dtype=torch.bool)
    masks = teacher.step_masks(3)
    first = [teacher.position_mask(k) for k in range(3)]
    # Asked again, step by step or all at once (the loss, its counts and the metrics each ask): the same memory.
    assert all(first[k].data_ptr() == masks.trained[k].data_ptr() for k in range(3))
    assert teacher.step_masks(3).valid.data_ptr() == teacher.valid(0).data_ptr() == masks.valid.data_ptr()
    fresh, _ = hand_teacher()
    fresh.loss_mask = torch.ones(1, 6, dtype=torch.bool)
    assert all(torch.equal(first[k], fresh.position_mask(k)) for k in range(3))
    # A new sample boundary: made again from it, not the stale ones.
    assert teacher.valid(0)[0].tolist() == [True, True, True, True, False, False]
    teacher.doc_ids = torch.tensor([[0, 0, 0, 0, 1, 1]])
    assert teacher.valid(0)[0].tolist() == [True, True, False, False, False, False]


def _masks_step_by_step(teacher, step: int):
    """The definitions, one step at a time: (valid, in_draft, trained, argmax), [B, T] each."""
    from eagle3_pipeline.train.kernels import shift_left  # noqa: PLC0415

    doc, mask = teacher.doc_ids, teacher.loss_mask
    valid = ((shift_left(doc, 2 + step, -1) == doc) & (shift_left(doc, 1 + step, -1) == doc)
             & shift_left(mask, 2 + step, False))
    in_draft = shift_left(teacher.in_draft, 1 + step, False)
    return valid, in_draft, valid & in_draft, shift_left(teacher.argmax, 1 + step, -1)


def _metrics_step_by_step(step_argmax, teacher):
    hits, rows, chain_hits, chain_rows, chain, leads = [], [], [], [], None, 0
    for step, top in enumerate(step_argmax):
        valid, in_draft, trained, argmax = _masks_step_by_step(teacher, step)
        right = (top == argmax) & in_draft
        hits.append(int((right & trained).sum()))
        rows.append(int(trained.sum()))
        tried = valid if chain is None else chain & valid
        chain = tried & right
        leads = leads + chain.long()
        chain_hits.append(int(chain.sum()))
        chain_rows.append(int(tried.sum()))
    return hits, rows, chain_hits, chain_rows, leads


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_all_steps_masks_and_metrics_made_at_once_equal_their_step_by_step_definitions(seed):
    """Packed samples of random lengths (some shorter than the chain), random loss masks and draft-vocabulary misses,
    drafts right often enough for long chains: every step's masks, the metrics and the row counts the same as the
    definitions give one step at a time; also for more steps than tokens."""
    from eagle3_pipeline.train.loss import TeacherTargets, ttt_metrics_from_argmax  # noqa: PLC0415
    from eagle3_pipeline.train.step import step_counts  # noqa: PLC0415

    generator = torch.Generator().manual_seed(seed)
    length, draft = 40, 5
    doc_ids = torch.repeat_interleave(torch.arange(5), torch.tensor([3, 12, 1, 17, 7]))[None]
    teacher = TeacherTargets(logits=torch.randn(1, length, draft, generator=generator),
                             argmax=torch.randint(0, draft, (1, length), generator=generator),
                             in_draft=torch.rand(1, length, generator=generator) > 0.1,
                             loss_mask=torch.rand(1, length, generator=generator) > 0.15, doc_ids=doc_ids)
    for steps in (7, length + 3):
        masks = teacher.step_masks(steps)
        for step in range(steps):
            want = _masks_step_by_step(teacher, step)
            got = (masks.valid[step], masks.in_draft[step], masks.trained[step], masks.argmax[step])
            assert all(torch.equal(a, b) for a, b in zip(got, want)), (steps, step)
            assert torch.equal(teacher.position_mask(step), want[2]) and torch.equal(teacher.valid(step), want[0])
        # The drafter's top-1: the teacher's at 90 % of the rows (so chains run on), a random draft id elsewhere.
        tops = [torch.where(torch.rand(1, length, generator=generator) < 0.9, masks.argmax[k].clamp(min=0),
                            torch.randint(0, draft, (1, length), generator=generator)) for k in range(steps)]
        got = ttt_metrics_from_argmax(tops, teacher)
        hits, rows, chain_hits, chain_rows, leads = _metrics_step_by_step(tops, teacher)
        assert (got.hits.tolist(), got.rows.tolist()) == (hits, rows)
        assert (got.chain_hits.tolist(), got.chain_rows.tolist()) == (chain_hits, chain_rows)
        assert torch.equal(got.leads, leads) and got.leads.dtype == torch.int64
        assert max(chain_hits[2:]) > 0  # chains longer than two steps were counted
        # The rows each step trains, as the loss counts them (a step's rows past its last, T-2-k, never are).
        assert step_counts(teacher, steps).tolist() == [
            int(_masks_step_by_step(teacher, k)[2][:, :max(length - 1 - k, 0)].sum()) for k in range(steps)]


def one_hot_logits(draft_ids: list[int]) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.tensor(draft_ids), 3).float()[None] * 10


def test_metrics_and_acceptance_length_on_a_hand_made_example():
    teacher, _ = hand_teacher()
    teacher.loss_mask = torch.ones(1, 6, dtype=torch.bool)
    # valid rows: step 0 -> 0..3, step 1 -> 0..2. Teacher top-1 for step-0 rows 0..3: 2, miss (out of
    # the draft vocabulary), 1, 0; for step-1 rows 0..2: miss, 1, 0.
    step0 = one_hot_logits([2, 0, 1, 1, 0, 0])  # right at rows 0, 2
    step1 = one_hot_logits([0, 1, 0, 0, 0, 0])  # right at rows 1, 2
    metrics = ttt_metrics([step0, step1], teacher)
    assert metrics.rows.tolist() == [3, 2]  # in-vocabulary valid rows
    assert metrics.hits.tolist() == [2, 2]
    assert metrics.acc == pytest.approx([2 / 3, 1.0])
    # Chains: step 0 tried at rows 0..3, right at 0 and 2; step 1 tried at rows 0 and 2, right at 2.
    assert metrics.chain_rows.tolist() == [4, 2]
    assert metrics.chain_hits.tolist() == [2, 1]
    assert metrics.cond_acc == pytest.approx([0.5, 0.5])
    assert metrics.acceptance_length == pytest.approx(0.5 + 0.25)


def test_acceptance_length_formula():
    assert acceptance_length([0.8, 0.5, 0.5]) == pytest.approx(0.8 + 0.4 + 0.2)
    assert acceptance_length([1.0] * 7) == 7
    assert acceptance_length([0.0, 1.0]) == 0


def test_loss_is_the_decayed_sum_of_masked_soft_cross_entropies():
    teacher, _ = hand_teacher()
    generator = torch.Generator().manual_seed(4)
    step_logits = [torch.randn(1, 6, 3, generator=generator) for _ in range(2)]
    result = ttt_loss(step_logits, teacher)
    expected = 0.0
    for step, logits in enumerate(step_logits):
        rows = [t for t in range(6) if bool(teacher.position_mask(step)[0, t])]
        ces = [-(teacher.probs[0, t + 1 + step] * torch.log_softmax(logits[0, t], -1)).sum() for t in rows]
        expected += 0.5**step * torch.stack(ces).mean()  # the default step decay, 0.5
    torch.testing.assert_close(result.loss, expected)
    assert result.step_counts.tolist() == [3, 2]
    halved = ttt_loss(step_logits, teacher, denominators=torch.tensor([6, 4]))
    torch.testing.assert_close(halved.loss, expected / 2)


def test_loss_decreases_over_adam_steps_on_random_data():
    model = tiny_drafter(seed=5)
    generator = torch.Generator().manual_seed(6)
    input_ids = torch.randint(0, V, (2, 16), generator=generator)
    aux = torch.randn(2, 16, N_AUX * H, generator=generator)
    last_hidden = torch.randn(2, 16, H, generator=generator)
    target_head = torch.randn(V, H, generator=generator)
    teacher = teacher_targets(last_hidden, target_head, model.t2d, model.d2t, torch.ones(2, 16))
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=3e-3)
    losses = []
    for _ in range(50):
        result = ttt_loss(model.forward_ttt(input_ids, aux, ttt_length=3), teacher)
        optimizer.zero_grad()
        result.loss.backward()
        optimizer.step()
        losses.append(float(result.loss.detach()))
    assert losses[-1] < 0.6 * losses[0], losses
    assert model.embed_tokens.weight.grad is None


def packed_example(seed: int = 2):
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, V, (2, 9), generator=generator)
    aux = torch.randn(2, 9, N_AUX * H, generator=generator, dtype=torch.float64)
    doc_ids = torch.tensor([[0] * 9, [0, 0, 0, 1, 1, 1, 1, 2, 2]])  # row 1 packs three samples
    last_hidden = torch.randn(2, 9, H, generator=generator, dtype=torch.float64)
    target_head = torch.randn(V, H, generator=generator, dtype=torch.float64)
    return input_ids, aux, doc_ids, last_hidden, target_head


@pytest.mark.parametrize("variant", VARIANTS, ids=["eagle3", "eagle3.1", "eagle3.1+norm_before_fc"])
def test_fused_forward_equals_the_masked_sdpa_reference_with_packed_samples(variant):
    model = with_random_norms(tiny_drafter(seed=1, **variant).double())
    input_ids, aux, doc_ids, _, _ = packed_example()
    with torch.no_grad():
        reference = model.forward_ttt(input_ids, aux, None, 4, doc_ids)
        fused = model.forward_ttt(input_ids, aux, None, 4, doc_ids, attention="fused", mlp_recompute_steps=2)
    for step, (a, b) in enumerate(zip(reference, fused)):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-12, msg=f"step {step}")


def float32_soft_ce_error_bounds(step_logits, teacher, step_losses: torch.Tensor) -> torch.Tensor:
    """[K] first-order bounds on |ttt_loss's float32 step CE - the exact step CE| (float64 logits given).

    In units of u, with x a step's logits, t the teacher's, D classes and R masked rows. Each log-prob
    log q_i = (x_i - m) - log(sum_j exp(x_j - m)): casting x to float32 moves it by 2 max|x|, rounding the
    differences x_j - m by 4 max|x| more (its own and, through the sum, the others'); the sum of D
    exponentials (1 ulp = 2 u each) is off by (D + 1) of itself and its log by 2 ln D more. Each teacher
    probability (the float32 softmax of t) is off by 6 max|t| + D + 4 of itself, as the same steps count.
    The CE and the loss then only add terms of one sign (p * -log q >= 0), so the D-term sum with its
    products, the R-term sum with its division and the last subtraction in log q round by D + R + 1 of
    the result.
    """
    draft = teacher.logits.shape[-1]
    teacher_max = float(teacher.logits.abs().max())
    bounds = []
    for step, (logits, ce) in enumerate(zip(step_logits, step_losses.tolist())):
        rows = int(teacher.position_mask(step).sum())
        log_prob = 6 * float(logits.abs().max()) + draft + 1 + 2 * math.log(draft)  # absolute, per log-prob
        relative = (6 * teacher_max + draft + 4) + draft + rows + 1  # of the step's CE
        bounds.append(U32 * (log_prob + relative * ce))
    return torch.tensor(bounds, dtype=torch.float64)


@pytest.mark.parametrize("variant", VARIANTS[:2], ids=["eagle3", "eagle3.1"])
def test_fused_loss_and_gradients_equal_the_reference(variant):
    model = with_random_norms(tiny_drafter(seed=1, **variant).double())
    input_ids, aux, doc_ids, last_hidden, target_head = packed_example()
    teacher = teacher_targets(last_hidden, target_head, model.t2d, model.d2t, torch.ones(2, 9), doc_ids)
    params = [p for p in model.parameters() if p.requires_grad]
    step_logits = model.forward_ttt(input_ids, aux, None, 4, doc_ids)
    reference = ttt_loss(step_logits, teacher)
    expected = torch.autograd.grad(reference.loss, params)
    hidden = model.forward_ttt(input_ids, aux, None, 4, doc_ids, attention="fused", mlp_recompute_steps=2, head=False)
    fused, top = fused_ttt_loss(hidden, model.lm_head.weight, teacher, chunk_rows=5)  # chunks cross step rows
    got = torch.autograd.grad(fused.loss, params)
    # The reference loss is float32 (ttt_loss upcasts to float32); the fused one keeps float64, so it stands
    # for the exact loss and the reference may be off by its float32 rounding, bounded per step below.
    logits = [step.detach() for step in step_logits]
    bounds = float32_soft_ce_error_bounds(logits, teacher, fused.step_losses)
    assert ((fused.step_losses - reference.step_losses.double()).abs() <= bounds).all(), (fused.step_losses,
                                                                                         reference.step_losses)
    decays = STEP_DECAY ** torch.arange(len(logits), dtype=torch.float64)
    # The decayed sum over K steps rounds K more times.
    assert abs(float(fused.loss) - float(reference.loss)) <= float((decays * bounds).sum()) + len(logits) * U32 * float(
        fused.loss)
    assert fused.step_counts.tolist() == reference.step_counts.tolist()
    for (name, _), a, b in zip([(n, p) for n, p in model.named_parameters() if p.requires_grad], got, expected):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)
    # float64 argmaxes of the two paths: they could part only at a tie within ~1e-13, far below these logits' gaps.
    ours, theirs = ttt_metrics_from_argmax(top, teacher), ttt_metrics(logits, teacher)
    for name in ("hits", "rows", "chain_hits", "chain_rows"):
        assert getattr(ours, name).tolist() == getattr(theirs, name).tolist(), name


def test_ttt_attention_gradients_match_the_masked_reference():
    torch.manual_seed(7)
    rows, heads, kv, dim = 11, 4, 2, 8
    doc_ids = torch.tensor([[0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1]])
    q = torch.randn(rows, heads, dim, dtype=torch.float64, requires_grad=True)
    keys = [torch.randn(rows, kv, dim, dtype=torch.float64, requires_grad=True) for _ in range(3)]
    values = [torch.randn(rows, kv, dim, dtype=torch.float64, requires_grad=True) for _ in range(3)]
    grad = torch.randn(rows, heads, dim, dtype=torch.float64)
    fused = ttt_attention(q, keys, values, packed_layout(doc_ids), dim**-0.5)
    mask = ttt_attention_mask(doc_ids, 3)[0, 0]  # [T, 3T]
    reference = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), torch.cat(keys).transpose(0, 1).repeat_interleave(2, 0),
        torch.cat(values).transpose(0, 1).repeat_interleave(2, 0), attn_mask=mask).transpose(0, 1)
    torch.testing.assert_close(fused, reference, rtol=0, atol=1e-12)
    inputs = [q, *keys, *values]
    for a, b in zip(torch.autograd.grad(fused, inputs, grad), torch.autograd.grad(reference, inputs, grad)):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


def test_the_teacher_keeps_draft_logits_in_the_matmul_dtype():
    model = tiny_drafter(seed=3)
    _, _, doc_ids, last_hidden, target_head = packed_example()
    rows, head = last_hidden.float(), target_head.float()
    exact = teacher_targets(rows, head, model.t2d, model.d2t, torch.ones(2, 9))
    chunked = teacher_targets(rows, head, model.t2d, model.d2t, torch.ones(2, 9), chunk_rows=4)
    assert exact.logits.dtype == chunked.logits.dtype == torch.float32
    # Chunks of 4 rows and the whole 18 run different GEMM kernels, which may round differently (on some
    # CPUs 33 of these 432 logits differ by up to 9.5e-7): both must be the exact products of the float32
    # inputs up to float32's rounding of a 16-term dot product (in any order), in the draft vocabulary's columns.
    draft_ids = (model.d2t + torch.arange(DRAFT)).tolist()
    # In float64 the products of float32 values are exact and their sum rounds at float64's unit: the
    # reference's own (negligible) error is added to the bound.
    truth = (rows.double() @ head.double().T)[..., draft_ids]
    flat = rows.reshape(-1, H)
    bound = (dot_error_bound(flat, head) + dot_error_bound(flat, head, unit=2.0**-53)).view(2, 9, -1)[..., draft_ids]
    for teacher in (exact, chunked):
        assert ((teacher.logits.double() - truth).abs() <= bound).all()
    # Their softmax: logits off by at most delta (a row's largest bound) move each probability by a factor
    # within exp(+-2 delta). The float32 softmax itself adds, relative to each probability, u |x - max| in its
    # exponential's argument and at most u max|x - max| in the normalizer's, 2 u for the exponential (1 ulp),
    # (D + 1) u for the normalizer's sum and u for the division.
    expected = torch.softmax(truth, -1)
    delta = bound.amax(-1, keepdim=True)
    spread = (truth - truth.amax(-1, keepdim=True)).abs()
    slack = expected * torch.expm1(2 * delta + U32 * (spread + spread.amax(-1, keepdim=True) + DRAFT + 4))
    assert ((exact.probs.double() - expected).abs() <= slack).all()
    half = teacher_targets(last_hidden.bfloat16(), target_head.bfloat16(), model.t2d, model.d2t, torch.ones(2, 9))
    assert half.logits.dtype == torch.bfloat16 and half.probs.dtype == torch.float32
