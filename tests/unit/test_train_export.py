"""The drafter exporter: SGLang and speculators forms, every tensor checked, files atomic (CPU, tiny tensors)."""

from __future__ import annotations

import json

import pytest
import torch

from eagle3_pipeline.train import export as ex

HIDDEN, HEADS, KV_HEADS, INTER, VOCAB, DRAFT = 16, 4, 2, 32, 50, 20


def drafter_cfg(**overrides):
    cfg = {
        "hidden_size": HIDDEN, "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS,
        "intermediate_size": INTER, "vocab_size": VOCAB, "draft_vocab_size": DRAFT, "target_hidden_size": HIDDEN,
        "num_aux_hidden_states": 3, "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "max_position_embeddings": 256,
        "dtype": "float32",
    }  # fmt: skip
    return {**cfg, **overrides}


def manifest(**overrides):
    base = {
        "target_model_path": "/models/tiny", "target_model_type": "llama", "aux_layers": [1, 3, 5],
        "engine": "reference", "engine_layer_ids": None, "hidden_size": HIDDEN, "num_hidden_layers": 8,
        "vocab_size": VOCAB, "target_config_sha256": "ab" * 32,
    }  # fmt: skip
    return {**base, **overrides}


def random_state(cfg, seed=0):
    """Random weights of the expected shapes and a valid draft vocabulary (target id order)."""
    gen = torch.Generator().manual_seed(seed)
    state = {name: torch.randn(shape, generator=gen) for name, shape in ex.expected_sglang_tensors(cfg).items()}
    chosen = torch.randperm(cfg["vocab_size"], generator=gen)[: cfg["draft_vocab_size"]].sort().values
    state["d2t"] = chosen - torch.arange(cfg["draft_vocab_size"])
    t2d = torch.zeros(cfg["vocab_size"], dtype=torch.bool)
    t2d[chosen] = True
    state["t2d"] = t2d
    return state


# --- what SGLang reads -------------------------------------------------------------------------


def test_expected_tensors_have_sglang_shapes():
    shapes = ex.expected_sglang_tensors(drafter_cfg())
    head_dim = HIDDEN // HEADS
    assert shapes["midlayer.self_attn.q_proj.weight"] == (HEADS * head_dim, 2 * HIDDEN)
    assert shapes["midlayer.self_attn.k_proj.weight"] == (KV_HEADS * head_dim, 2 * HIDDEN)
    assert shapes["midlayer.self_attn.o_proj.weight"] == (HIDDEN, HEADS * head_dim)
    assert shapes["midlayer.mlp.down_proj.weight"] == (HIDDEN, INTER)
    assert shapes["fc.weight"] == (HIDDEN, 3 * HIDDEN)
    assert shapes["lm_head.weight"] == (DRAFT, HIDDEN)
    assert shapes["d2t"] == (DRAFT,) and shapes["t2d"] == (VOCAB,)
    assert "embed_tokens.weight" not in shapes  # shared from the target when the hidden sizes agree
    assert len(shapes) == 15


def test_wider_target_needs_embed_tokens_and_wider_fc():
    shapes = ex.expected_sglang_tensors(drafter_cfg(target_hidden_size=24, num_aux_hidden_states=4))
    assert shapes["fc.weight"] == (HIDDEN, 4 * 24)
    assert shapes["embed_tokens.weight"] == (VOCAB, HIDDEN)  # SGLang's set_embed skips T != H


def test_drafter_config_errors_are_listed():
    with pytest.raises(ex.ExportError, match="missing 'hidden_size'; missing 'draft_vocab_size'"):
        ex.DrafterShape.from_config({"num_attention_heads": 2, "intermediate_size": 8, "vocab_size": 10})
    with pytest.raises(ex.ExportError) as err:
        ex.DrafterShape.from_config(drafter_cfg(draft_vocab_size=VOCAB + 1, num_hidden_layers=2,
                                                norm_before_residual=True, hidden_act="gelu"))
    message = str(err.value)
    for part in ("larger than the target's vocab_size", "num_hidden_layers 2", "norm_before_residual", "silu"):
        assert part in message


# --- round trips -------------------------------------------------------------------------------


@pytest.mark.parametrize("form", ex.FORMS)
def test_export_then_load_gives_identical_tensors_and_config(tmp_path, form):
    cfg = drafter_cfg(target_hidden_size=24)
    state = random_state(cfg)
    man = manifest(hidden_size=24)
    if form == "sglang":
        out = ex.export_sglang(state, cfg, man, tmp_path / "drafter")
    else:
        out = ex.export_speculators(state, cfg, man, tmp_path / "drafter", speculative_tokens=4)
    loaded, config = ex.load_export(out)
    assert sorted(loaded) == sorted(state)
    for name, tensor in state.items():
        assert loaded[name].dtype == tensor.dtype and torch.equal(loaded[name], tensor), name
    assert config == json.loads((out / ex.CONFIG_FILE).read_text())
    assert config[ex.PROVENANCE_KEY]["aux_layers"] == [1, 3, 5]
    assert sorted(p.name for p in out.iterdir()) == [ex.CONFIG_FILE, ex.WEIGHTS_FILE]


def test_sglang_config_fields(tmp_path):
    config = ex.sglang_config(drafter_cfg(), manifest())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["model_type"] == "llama"
    assert config["draft_vocab_size"] == DRAFT and config["vocab_size"] == VOCAB
    assert config["target_hidden_size"] == HIDDEN and config["num_hidden_layers"] == 1
    assert config["tie_word_embeddings"] is False  # a tied head would drop lm_head.weight silently
    assert (config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"]) == (16, 4, 2)
    assert (config["intermediate_size"], config["head_dim"], config["rms_norm_eps"]) == (INTER, 4, 1e-5)
    assert (config["rope_theta"], config["max_position_embeddings"], config["torch_dtype"]) == (5e5, 256, "float32")


def test_eagle3_1_export_carries_sglangs_flags_and_norm_weights_and_loads_back(tmp_path):
    from eagle3_pipeline.evaluate.speculative import drafter_config

    cfg = drafter_cfg(fc_norm=True, norm_output=True, norm_before_fc=True)
    shapes = ex.expected_sglang_tensors(cfg)
    assert {name: shapes[name] for name in shapes if "norm" in name and not name.startswith("midlayer")} == {
        "norm.weight": (HIDDEN,), "fc_norm.0.weight": (HIDDEN,), "fc_norm.1.weight": (HIDDEN,),
        "fc_norm.2.weight": (HIDDEN,), "input_norm.weight": (3 * HIDDEN,)}
    state = random_state(cfg)
    out = ex.export_sglang(state, cfg, manifest(), tmp_path / "drafter")
    config = json.loads((out / ex.CONFIG_FILE).read_text())
    # SGLang 0.5.23 reads these keys (llama_eagle3.py); an eagle3 export has none of them.
    assert (config["fc_norm"], config["norm_output"], config["norm_before_fc"]) == (True, True, True)
    assert config[ex.PROVENANCE_KEY]["variant"] == "eagle3.1"
    assert not {"fc_norm", "norm_output", "norm_before_fc"} & set(ex.sglang_config(drafter_cfg(), manifest()))
    loaded, config = ex.load_export(out)
    assert all(torch.equal(loaded[name], tensor) for name, tensor in state.items())
    rebuilt = drafter_config(config)  # what the evaluation drafts with
    assert (rebuilt.fc_norm, rebuilt.norm_output, rebuilt.norm_before_fc) == (True, True, True)
    without = {name: tensor for name, tensor in state.items() if name != "fc_norm.1.weight"}
    with pytest.raises(ex.ExportError, match=r"missing: fc_norm\.1\.weight"):
        ex.export_sglang(without, cfg, manifest(), tmp_path / "again")
    with pytest.raises(ex.ExportError, match="has no fc_norm, norm_before_fc, norm_output"):
        ex.export_speculators(state, cfg, manifest(), tmp_path / "spec")


def test_speculators_config_fields():
    config = ex.speculators_config(drafter_cfg(), manifest(), speculative_tokens=5)
    assert config["speculators_model_type"] == "eagle3"
    assert config["norm_before_residual"] is False  # vLLM would default an absent key to True
    assert config["eagle_aux_hidden_state_layer_ids"] == [2, 4, 6]  # vLLM captures the input of layer id
    layer = config["transformer_layer_config"]
    assert layer["num_hidden_layers"] == 1 and layer["vocab_size"] == VOCAB and layer["hidden_size"] == HIDDEN
    spec = config["speculators_config"]
    assert spec["proposal_methods"][0] == {"proposal_type": "greedy", "speculative_tokens": 5}
    assert spec["default_proposal_method"] == "greedy" and spec["verifier"]["name_or_path"] == "/models/tiny"


def test_speculators_export_uses_layers_0_names(tmp_path):
    out = ex.export_speculators(random_state(drafter_cfg()), drafter_cfg(), manifest(), tmp_path / "spec")
    from safetensors import safe_open

    with safe_open(out / ex.WEIGHTS_FILE, "pt") as handle:
        names = set(handle.keys())
    assert names == set(ex.expected_speculators_tensors(drafter_cfg()))
    assert "layers.0.self_attn.q_proj.weight" in names and not any(n.startswith("midlayer") for n in names)


def test_speculators_form_refuses_other_than_three_aux_layers(tmp_path):
    cfg = drafter_cfg(num_aux_hidden_states=2)
    with pytest.raises(ex.ExportError, match="exactly 3 aux layers"):
        ex.export_speculators(random_state(cfg), cfg, manifest(aux_layers=[1, 5]), tmp_path / "spec")
    assert not (tmp_path / "spec").exists()


def test_fp32_master_weights_are_exported_in_the_config_dtype(tmp_path):
    cfg = drafter_cfg(dtype="bfloat16")
    state = random_state(cfg)
    loaded, config = ex.load_export(ex.export_sglang(state, cfg, manifest(), tmp_path / "d"))
    assert config["torch_dtype"] == "bfloat16"
    assert loaded["fc.weight"].dtype == torch.bfloat16
    assert torch.equal(loaded["fc.weight"], state["fc.weight"].bfloat16())
    assert loaded["d2t"].dtype == torch.int64 and loaded["t2d"].dtype == torch.bool


# --- refusals ----------------------------------------------------------------------------------


def test_missing_extra_and_misshapen_tensors_are_all_listed(tmp_path):
    cfg = drafter_cfg()
    state = random_state(cfg)
    del state["midlayer.hidden_norm.weight"], state["lm_head.weight"]
    state["midlayer.self_attn.qkv_proj.weight"] = torch.zeros(3)  # SGLang would skip it silently
    state["embed_tokens.weight"] = torch.zeros(VOCAB, HIDDEN)
    state["fc.weight"] = torch.zeros(HIDDEN, 2 * HIDDEN)
    state["midlayer.mlp.up_proj.weight"] = torch.zeros(INTER, HIDDEN, dtype=torch.int32)
    with pytest.raises(ex.ExportError) as err:
        ex.export_sglang(state, cfg, manifest(), tmp_path / "d")
    message = str(err.value)
    assert "missing: midlayer.hidden_norm.weight, lm_head.weight" in message
    assert "unexpected (SGLang would skip them silently): embed_tokens.weight, midlayer.self_attn.qkv_proj.weight" \
        in message
    assert "target_hidden_size != hidden_size" in message  # the embed_tokens hint
    assert "fc.weight: shape [16, 32], expected [16, 48]" in message
    assert "midlayer.mlp.up_proj.weight: dtype torch.int32, expected a float dtype" in message
    assert not (tmp_path / "d").exists()  # nothing written


def test_non_finite_weights_and_wrong_map_dtypes_are_refused():
    cfg = drafter_cfg()
    state = random_state(cfg)
    state["norm.weight"][3] = float("nan")
    state["d2t"] = state["d2t"].int()
    state["t2d"] = state["t2d"].to(torch.uint8)
    with pytest.raises(ex.ExportError) as err:
        ex.check_drafter_tensors(state, cfg)
    message = str(err.value)
    assert "norm.weight: has non-finite values" in message
    assert "d2t: dtype torch.int32, expected torch.int64" in message
    assert "t2d: dtype torch.uint8, expected torch.bool" in message


def test_inconsistent_d2t_t2d_refused():
    cfg = drafter_cfg()
    state = random_state(cfg)
    target_ids = state["d2t"] + torch.arange(DRAFT)
    state["t2d"][target_ids[0]] = False  # t2d no longer marks what d2t lists
    state["t2d"][(~state["t2d"]).nonzero()[-1]] = True
    with pytest.raises(ex.ExportError, match="d2t/t2d: t2d does not mark the target ids d2t lists"):
        ex.check_drafter_tensors(state, cfg)
    state = random_state(cfg)
    state["d2t"][-1] = VOCAB  # target id out of range
    with pytest.raises(ex.ExportError, match="d2t/t2d: d2t maps 1 draft ids outside the target vocabulary"):
        ex.check_drafter_tensors(state, cfg)


def test_manifest_from_another_model_refused(tmp_path):
    state = random_state(drafter_cfg())
    with pytest.raises(ex.ExportError, match="another model.*hidden_size 32.*vocab_size 99"):
        ex.export_sglang(state, drafter_cfg(), manifest(hidden_size=32, vocab_size=99), tmp_path / "d")
    with pytest.raises(ex.ExportError, match="captured 2 aux layers"):
        ex.export_sglang(state, drafter_cfg(), manifest(aux_layers=[1, 5]), tmp_path / "d")
    with pytest.raises(ex.ExportError, match="no SGLang 0.5.23 layer-id convention"):
        ex.export_sglang(state, drafter_cfg(), manifest(target_model_type="qwen3_moe"), tmp_path / "d")
    assert not (tmp_path / "d").exists()


def test_model_type_read_from_target_config(tmp_path):
    target = tmp_path / "kimi"
    target.mkdir()
    (target / "config.json").write_text(json.dumps({"model_type": "kimi_k25", "architectures": ["KimiK25"]}))
    man = manifest(target_model_path=str(target), target_model_type=None, num_hidden_layers=61, aux_layers=[1, 30, 57])
    config = ex.sglang_config(drafter_cfg(), man)
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 31, 58]
    assert ex.speculators_config(drafter_cfg(), man)["speculators_config"]["verifier"]["architectures"] == ["KimiK25"]
    with pytest.raises(ex.ExportError, match="cannot tell the target's model_type"):
        ex.sglang_config(drafter_cfg(), manifest(target_model_path=str(tmp_path / "none"), target_model_type=None))


# --- aux layer ids -----------------------------------------------------------------------------


def test_aux_layer_ids_for_llama_class_target():
    """SGLang's LlamaForCausalLM adds 1 and captures layer inputs: its id is ours."""
    config = ex.sglang_config(drafter_cfg(), manifest(aux_layers=[1, 3, 5]))
    assert config["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": [1, 3, 5], "use_aux_hidden_state": True}
    assert config[ex.PROVENANCE_KEY]["target_model_type"] == "llama"


@pytest.mark.parametrize("model_type", ["deepseek_v3", "kimi_k2", "kimi_k25"])
def test_aux_layer_ids_for_deepseek_and_kimi_class_targets(model_type):
    """DeepseekV2ForCausalLM captures layer inputs and adds nothing (unless the first id is 1): ours + 1."""
    man = manifest(target_model_type=model_type, aux_layers=[2, 29, 56], num_hidden_layers=61)
    config = ex.sglang_config(drafter_cfg(), man)
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [3, 30, 57]
    with pytest.raises(ex.ExportError, match="cannot capture the output of layer 0"):
        ex.sglang_config(drafter_cfg(), {**man, "aux_layers": [0, 29, 56]})


def test_sglang_engine_layer_ids_must_agree():
    man = manifest(engine="sglang", engine_layer_ids=[2, 4, 6])  # as if captured with the deepseek rule
    with pytest.raises(ex.ExportError, match=r"captured by SGLang with layer ids \[2, 4, 6\]"):
        ex.sglang_config(drafter_cfg(), man)
    assert ex.sglang_config(drafter_cfg(), {**man, "engine_layer_ids": [1, 3, 5]})


def test_aux_layer_out_of_range_refused():
    with pytest.raises(ex.ExportError, match="out of range"):
        ex.sglang_config(drafter_cfg(), manifest(aux_layers=[1, 3, 7]))
    with pytest.raises(ex.ExportError, match="out of range"):
        ex.speculators_config(drafter_cfg(), manifest(aux_layers=[1, 3, 7]))


# --- atomic files ------------------------------------------------------------------------------


def _failing_save(tensors, path, metadata, digest=None):
    with open(path, "wb") as handle:
        handle.write(b"\0" * 100)  # half a file
    raise OSError(28, "No space left on device")


@pytest.mark.parametrize("form", ex.FORMS)
def test_no_partial_file_when_the_write_fails(tmp_path, monkeypatch, form):
    cfg, out = drafter_cfg(), tmp_path / "d"
    monkeypatch.setattr(ex, "save_safetensors", _failing_save)
    export = ex.export_sglang if form == "sglang" else ex.export_speculators
    with pytest.raises(OSError, match="No space left"):
        export(random_state(cfg), cfg, manifest(), out)
    assert list(out.iterdir()) == []  # no weights, no config, no temp file


def test_failed_overwrite_leaves_an_incomplete_export_that_load_refuses(tmp_path, monkeypatch):
    cfg, out = drafter_cfg(), tmp_path / "d"
    ex.export_sglang(random_state(cfg, seed=1), cfg, manifest(), out)
    monkeypatch.setattr(ex, "save_safetensors", _failing_save)
    with pytest.raises(OSError):
        ex.export_sglang(random_state(cfg, seed=2), cfg, manifest(), out)
    assert sorted(p.name for p in out.iterdir()) == [ex.WEIGHTS_FILE]  # the old weights, whole; no config
    with pytest.raises(ex.ExportError, match="not a complete export"):
        ex.load_export(out)


def test_load_refuses_weights_of_another_export(tmp_path):
    cfg = drafter_cfg()
    first = ex.export_sglang(random_state(cfg, seed=1), cfg, manifest(), tmp_path / "a")
    second = ex.export_sglang(random_state(cfg, seed=2), cfg, manifest(), tmp_path / "b")
    (first / ex.WEIGHTS_FILE).write_bytes((second / ex.WEIGHTS_FILE).read_bytes())
    with pytest.raises(ex.ExportError, match="SHA-256 .* differs"):
        ex.load_export(first)


def test_re_export_replaces_both_files(tmp_path):
    cfg, out = drafter_cfg(), tmp_path / "d"
    ex.export_sglang(random_state(cfg, seed=1), cfg, manifest(), out)
    state = random_state(cfg, seed=2)
    ex.export_sglang(state, cfg, manifest(), out)
    loaded, _ = ex.load_export(out)
    assert torch.equal(loaded["lm_head.weight"], state["lm_head.weight"])
    assert sorted(p.name for p in out.iterdir()) == [ex.CONFIG_FILE, ex.WEIGHTS_FILE]


def test_remove_export_removes_only_what_this_exporter_wrote(tmp_path):
    out = ex.export_sglang(random_state(drafter_cfg()), drafter_cfg(), manifest(), tmp_path / "ours")
    assert ex.remove_export(out) and not out.exists()
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / ex.CONFIG_FILE).write_text('{"architectures": ["LlamaForCausalLMEagle3"]}')
    (theirs / "notes.txt").write_text("an operator's file")
    assert not ex.remove_export(theirs) and (theirs / "notes.txt").is_file()
    assert not ex.remove_export(tmp_path / "absent")


MLA = {"q_lora_rank": 8, "kv_lora_rank": 6, "qk_nope_head_dim": 4, "qk_rope_head_dim": 2, "v_head_dim": 3}
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 32, "beta_slow": 1,
        "mscale": 1.0, "mscale_all_dim": 1.0}


def test_the_mla_layout_exports_sglangs_eagle3_deepseek_v2_and_loads_back(tmp_path):
    from eagle3_pipeline.evaluate.speculative import drafter_config

    cfg = drafter_cfg(layout="mla", num_key_value_heads=HEADS, rope_scaling=YARN, fc_norm=True, norm_output=True,
                      **MLA)
    shapes = ex.expected_sglang_tensors(cfg)
    attention = {name: shape for name, shape in shapes.items() if ".self_attn." in name}
    assert attention == {
        "midlayer.self_attn.q_a_proj.weight": (8, 2 * HIDDEN), "midlayer.self_attn.q_a_layernorm.weight": (8,),
        "midlayer.self_attn.q_b_proj.weight": (HEADS * 6, 8),
        "midlayer.self_attn.kv_a_proj_with_mqa.weight": (6 + 2, 2 * HIDDEN),
        "midlayer.self_attn.kv_a_layernorm.weight": (6,), "midlayer.self_attn.kv_b_proj.weight": (HEADS * 7, 6),
        "midlayer.self_attn.o_proj.weight": (HIDDEN, HEADS * 3)}
    state = random_state(cfg)
    out = ex.export_sglang(state, cfg, manifest(target_model_type="deepseek_v3"), tmp_path / "drafter")
    config = json.loads((out / ex.CONFIG_FILE).read_text())
    assert config["architectures"] == ["Eagle3DeepseekV2ForCausalLM"] and config["model_type"] == "deepseek_v3"
    assert {key: config[key] for key in MLA} == MLA and config["rope_interleave"] is True
    assert config["rope_scaling"] == YARN and "head_dim" not in config and config["fc_norm"] is True
    assert config[ex.PROVENANCE_KEY]["layout"] == "mla"
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 4, 6]  # deepseek: ours + 1
    loaded, config = ex.load_export(out)
    assert all(torch.equal(loaded[name], tensor) for name, tensor in state.items())
    rebuilt = drafter_config(config)  # the evaluation's drafter
    assert rebuilt.layout == "mla" and rebuilt.head_dim == 6 and rebuilt.v_head_dim == 3 and rebuilt.fc_norm
    with pytest.raises(ex.ExportError, match="multi-latent attention: export the SGLang form only"):
        ex.export_speculators(state, cfg, manifest(), tmp_path / "spec")
    with pytest.raises(ex.ExportError, match="Eagle3DeepseekV2ForCausalLM has no norm before fc"):
        ex.sglang_config(drafter_cfg(layout="mla", num_key_value_heads=HEADS, norm_before_fc=True, **MLA), manifest())
    with pytest.raises(ex.ExportError, match=r"Eagle3DeepseekV2ForCausalLM loads:\n  - missing: midlayer\.self_attn"):
        ex.check_drafter_tensors({k: v for k, v in state.items() if "kv_b_proj" not in k}, cfg)
