"""The MLA drafter (train/model_mla.py): chosen for an MLA target, SGLang's MLA weight names, YaRN as
transformers computes it, the TTT forward against a plain per-step computation written here, the fused
path refused, and the incremental proposer reproducing the training forward."""

from __future__ import annotations

import math

import pytest
import torch
from test_train_model import N_AUX, one_thread, plain_rope, step_tokens, with_random_norms  # noqa: F401 - one_thread: autouse

from eagle3_pipeline.evaluate.speculative import EagleProposer
from eagle3_pipeline.train.model import DrafterConfig, DrafterConfigError, Eagle3Drafter
from eagle3_pipeline.train.model_mla import mla_scales, yarn_mscale
from eagle3_pipeline.train.vocab import build_draft_vocab

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 32,
        "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 1.0}
MLA_TARGET = {
    "model_type": "deepseek_v3", "hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 4,
    "intermediate_size": 48, "vocab_size": 40, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
    "max_position_embeddings": 256, "hidden_act": "silu", "q_lora_rank": 16, "kv_lora_rank": 12,
    "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 6, "rope_scaling": YARN,
}  # fmt: skip
H, HEADS, QL, KVL, NOPE, ROPE, VD, V, DRAFT = 32, 4, 16, 12, 8, 4, 6, 40, 24


def mla_drafter(seed: int = 0, target: dict | None = None, **overrides) -> Eagle3Drafter:
    torch.manual_seed(seed)
    config = DrafterConfig.from_target(target or MLA_TARGET, N_AUX, DRAFT, **overrides)
    vocab = build_draft_vocab(torch.randint(0, 50, (V,)), DRAFT)
    model = Eagle3Drafter(config, vocab.d2t, vocab.t2d)
    torch.nn.init.normal_(model.embed_tokens.weight)
    with torch.no_grad():  # the MLA norms away from 1 too
        for name, param in model.named_parameters():
            if name.endswith("layernorm.weight"):
                param.uniform_(0.5, 1.5)
    return model


def test_an_mla_target_gets_the_mla_drafter_with_sglangs_names():
    model = mla_drafter()
    assert model.config.layout == "mla" and model.config.head_dim == NOPE + ROPE
    attention = {name: tuple(t.shape) for name, t in model.state_dict().items() if ".self_attn." in name}
    assert attention == {
        "midlayer.self_attn.q_a_proj.weight": (QL, 2 * H),
        "midlayer.self_attn.q_a_layernorm.weight": (QL,),
        "midlayer.self_attn.q_b_proj.weight": (HEADS * (NOPE + ROPE), QL),
        "midlayer.self_attn.kv_a_proj_with_mqa.weight": (KVL + ROPE, 2 * H),
        "midlayer.self_attn.kv_a_layernorm.weight": (KVL,),
        "midlayer.self_attn.kv_b_proj.weight": (HEADS * (NOPE + VD), KVL),
        "midlayer.self_attn.o_proj.weight": (H, HEADS * VD),
    }
    # The inventory may say otherwise (a Llama drafter has no YaRN: for a target without it).
    assert mla_drafter(target={**MLA_TARGET, "rope_scaling": None}, layout="llama").config.layout == "llama"
    with pytest.raises(DrafterConfigError, match="rope type 'yarn' is not supported by the llama layout"):
        mla_drafter(layout="llama")
    llama_target = {key: value for key, value in MLA_TARGET.items()
                    if key not in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                                   "v_head_dim", "rope_scaling")}
    assert mla_drafter(target=llama_target).config.layout == "llama"
    with pytest.raises(DrafterConfigError, match="no multi-latent attention"):
        mla_drafter(target=llama_target, layout="mla")


def test_yarn_frequencies_and_scales_are_transformers_deepseek_v3s():
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention

    hf = transformers.DeepseekV3Config(**{k: v for k, v in MLA_TARGET.items() if k != "model_type"})
    theirs, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](hf, "cpu")
    model = mla_drafter()
    torch.testing.assert_close(model.inv_freq, theirs.float(), rtol=1e-6, atol=0)
    scale, rope_factor = mla_scales(model.config)
    assert rope_factor == pytest.approx(attention_factor, rel=1e-12)
    assert scale == pytest.approx(DeepseekV3Attention(hf, layer_idx=0).scaling, rel=1e-12)
    assert scale == pytest.approx((NOPE + ROPE) ** -0.5 * yarn_mscale(4.0, 1.0) ** 2, rel=1e-12)


def plain_mla(attn, x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor):
    """q, k [B, T, n, d_n + d_r] and v [B, T, n, d_v] row by row, head by head, RoPE on pairs (2i, 2i+1)."""
    eps = 1e-6

    def norm(vector, weight):
        return weight * vector / torch.sqrt(vector.pow(2).mean() + eps)

    def rope_pairs(vector, position):  # GPT-J style, with YaRN's factor on cos and sin
        out = vector.clone()
        for i in range(vector.shape[0] // 2):
            angle = position * inv_freq[i].double()
            c, s = math.cos(angle) * attn.rope_mscale, math.sin(angle) * attn.rope_mscale
            out[2 * i] = vector[2 * i] * c - vector[2 * i + 1] * s
            out[2 * i + 1] = vector[2 * i + 1] * c + vector[2 * i] * s
        return out

    batch, length, _ = x.shape
    qs, ks, vs = [], [], []
    for b in range(batch):
        q_rows, k_rows, v_rows = [], [], []
        for t in range(length):
            row, position = x[b, t], int(positions[b, t])
            q_latent = norm(attn.q_a_proj.weight @ row, attn.q_a_layernorm.weight)
            q = (attn.q_b_proj.weight @ q_latent).view(HEADS, NOPE + ROPE)
            kv_a = attn.kv_a_proj_with_mqa.weight @ row
            kv = (attn.kv_b_proj.weight @ norm(kv_a[:KVL], attn.kv_a_layernorm.weight)).view(HEADS, NOPE + VD)
            k_rope = rope_pairs(kv_a[KVL:], position)
            q_rows.append(torch.stack([torch.cat([q[h, :NOPE], rope_pairs(q[h, NOPE:], position)])
                                       for h in range(HEADS)]))
            k_rows.append(torch.stack([torch.cat([kv[h, :NOPE], k_rope]) for h in range(HEADS)]))
            v_rows.append(kv[:, NOPE:])
        qs.append(torch.stack(q_rows))
        ks.append(torch.stack(k_rows))
        vs.append(torch.stack(v_rows))
    return torch.stack(qs), torch.stack(ks), torch.stack(vs)


def reference_mla_ttt(model: Eagle3Drafter, input_ids, aux, positions, steps: int) -> list[torch.Tensor]:
    """The TTT steps of one packed sample written plainly (the pattern of test_train_model.reference_ttt)."""
    layer, attn = model.midlayer, model.midlayer.self_attn
    batch, length = input_ids.shape
    hidden = model.fuse_aux(aux)
    keys, values, logits = [], [], []
    for step in range(steps):
        x = layer.attention_input(model.embed_tokens(step_tokens(input_ids, step)), hidden)
        q, k, v = plain_mla(attn, x, positions + step, model.inv_freq)
        keys.append(k)
        values.append(v)
        out = torch.zeros(batch, length, HEADS, VD, dtype=x.dtype)
        for b in range(batch):
            for t in range(length):
                for h in range(HEADS):
                    ks = [keys[0][b, j, h] for j in range(t + 1)] + [keys[i][b, t, h] for i in range(1, step + 1)]
                    vs = [values[0][b, j, h] for j in range(t + 1)] + [values[i][b, t, h] for i in range(1, step + 1)]
                    weights = torch.softmax(torch.stack(ks) @ q[b, t, h] * attn.scale, dim=0)
                    out[b, t, h] = weights @ torch.stack(vs)
        hidden = model.carry(layer.finish(hidden, out.reshape(batch, length, -1)))
        logits.append(model.logits(hidden))
    return logits


@pytest.mark.parametrize("variant", ["eagle3", "eagle3.1"])
def test_the_mla_ttt_forward_equals_a_plain_per_step_computation(variant):
    model = with_random_norms(mla_drafter(seed=1, variant=variant).double())
    generator = torch.Generator().manual_seed(2)
    input_ids = torch.randint(0, V, (2, 6), generator=generator)
    aux = torch.randn(2, 6, N_AUX * H, generator=generator, dtype=torch.float64)
    positions = torch.tensor([[3, 4, 5, 6, 7, 8], [0, 1, 2, 3, 4, 5]])
    with torch.no_grad():
        ours = model.forward_ttt(input_ids, aux, positions, ttt_length=3)
        plain = reference_mla_ttt(model, input_ids, aux, positions, 3)
    for step, (a, b) in enumerate(zip(ours, plain)):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-10, msg=f"step {step}")
    with pytest.raises(ValueError, match="attention 'fused' runs the llama layout only"):
        model.forward_ttt(input_ids, aux, positions, ttt_length=3, attention="fused")


def test_the_neox_rope_of_a_target_without_interleave_is_followed():
    target = {**MLA_TARGET, "rope_interleave": False, "rope_scaling": None}
    model = mla_drafter(target=target).double()
    attn = model.midlayer.self_attn
    assert not attn.interleave and attn.rope_mscale == 1.0
    x = torch.randn(1, 3, 2 * H, dtype=torch.float64)
    positions = torch.tensor([[5, 6, 7]])
    from eagle3_pipeline.train.kernels import rope_cos_sin

    cos, sin = rope_cos_sin(model.inv_freq, positions)
    with torch.no_grad():
        q, _, _ = attn.project(x, cos.double(), sin.double())
        raw = attn.q_b_proj(attn.q_a_layernorm(attn.q_a_proj(x))).view(1, 3, HEADS, NOPE + ROPE)
    for t, position in enumerate((5, 6, 7)):
        for h in range(HEADS):
            want = plain_rope(raw[0, t, h, NOPE:], position, model.inv_freq)
            torch.testing.assert_close(q[0, h, t, NOPE:], want, rtol=0, atol=1e-12)


@pytest.mark.parametrize("variant", ["eagle3", "eagle3.1"])
def test_the_incremental_mla_proposer_reproduces_the_training_forward(variant):
    model = mla_drafter(seed=3, variant=variant).eval()
    length, steps = 10, 3
    ids = torch.randint(0, V, (1, length), generator=torch.Generator().manual_seed(4))
    aux = torch.randn(1, length, N_AUX * H, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        ttt = model.forward_ttt(ids, aux, ttt_length=steps)
    anchors = list(range(length - steps - 1))
    batch, width = len(anchors), max(anchors) + 1
    proposer = EagleProposer(model)
    proposer.reset(batch)
    positions = torch.arange(width).expand(batch, width)
    proposer.extend(aux[0, :width].expand(batch, -1, -1), ids[0, 1: width + 1].expand(batch, -1), positions,
                    positions <= torch.tensor(anchors)[:, None])
    hidden, every = proposer.last_hidden, torch.ones((batch, 1), dtype=torch.bool)
    for step in range(steps):
        want = torch.stack([ttt[step][0, row] for row in anchors])
        with torch.no_grad():
            torch.testing.assert_close(model.logits(hidden), want, atol=1e-5, rtol=1e-5)
            if step + 1 < steps:
                tokens = torch.stack([ids[0, row + 2 + step] for row in anchors])[:, None]
                hidden = proposer._layer(hidden[:, None], tokens, (proposer.last_position + step + 1)[:, None],
                                         every)[:, 0]
