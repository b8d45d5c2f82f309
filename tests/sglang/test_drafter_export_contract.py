"""Contract: SGLang 0.5.23's own LlamaForCausalLMEagle3 loads our exported drafter, every parameter of it.

Under .venv-sglang (see conftest.py), on a CPU: the real ``LlamaForCausalLMEagle3`` is built from
our exported ``config.json`` (parsed by transformers' AutoConfig, as SGLang's ModelConfig does)
inside a published SGLang runtime context (``runtime_context.publish`` with a rank bundle, a
one-rank gloo process group from SGLang's own ``init_distributed_environment`` /
``initialize_model_parallel``). Its ``load_weights`` is fed our ``model.safetensors`` through
SGLang's own ``safetensors_weights_iterator``. Every parameter is first filled with NaN; after
loading, each one must equal our tensors in SGLang's fused layout (q/k/v rows of ``qkv_proj``,
gate/up rows of ``gate_up_proj``, the first D rows of the padded ``lm_head``), so nothing was
skipped and nothing landed in the wrong slot. ``hot_token_id`` (what SGLang maps draft ids
through) must be ``arange(D) + d2t``.

What is not run: the forward pass. It needs SGLang's attention backend and a ForwardBatch over
a KV pool, i.e. a launched server with CUDA kernels; SGLang cannot run on these machines. One
module is patched for construction only: ``layers.rotary_embedding.base._is_cpu`` is set True
so that RotaryEmbedding does not import ``vllm._custom_ops`` (its fallback kernel for a non-CUDA,
non-CPU-engine device), which only matters for the forward. ``SGLANG_USE_CPU_ENGINE=1`` would
set it properly but makes SGLang import ``sgl_kernel``, which is CUDA/CPU-engine-only.

The aux layer ids: SGLang's own ``_resolve_eagle_aux_hidden_state`` reads them from our draft
config (a published server with ``--speculative-algorithm EAGLE3 --speculative-draft-model-path``
our export) and ``configure_aux_hidden_state_capture`` hands them to the target's real
``set_eagle3_layers_to_capture``; the layers captured are then exactly the manifest's.
"""

from __future__ import annotations

import json
import socket
import sys
import types

import pytest
import torch

from eagle3_pipeline.train import export as ex
from eagle3_pipeline.train.vocab import build_draft_vocab

HIDDEN, HEADS, KV_HEADS, INTER, VOCAB, DRAFT = 32, 4, 2, 64, 100, 40
TARGET_LAYERS = 8


def _drafter_cfg(**overrides):
    cfg = {
        "hidden_size": HIDDEN, "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS,
        "intermediate_size": INTER, "vocab_size": VOCAB, "draft_vocab_size": DRAFT, "target_hidden_size": HIDDEN,
        "num_aux_hidden_states": 3, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 256,
        "dtype": "float32",
    }  # fmt: skip
    return {**cfg, **overrides}


def _manifest(target_dir, **overrides):
    base = {
        "target_model_path": str(target_dir), "aux_layers": [1, 3, 5], "engine": "reference",
        "hidden_size": HIDDEN, "num_hidden_layers": TARGET_LAYERS, "vocab_size": VOCAB,
    }  # fmt: skip
    return {**base, **overrides}


def _random_state(cfg, seed=0):
    """Random weights; the maps from the pipeline's own vocabulary builder over random token counts."""
    gen = torch.Generator().manual_seed(seed)
    vocab = build_draft_vocab(torch.randint(0, 1000, (cfg["vocab_size"],), generator=gen), cfg["draft_vocab_size"])
    weights = {name: torch.randn(shape, generator=gen) for name, shape in ex.expected_sglang_tensors(cfg).items()}
    return {**weights, "d2t": vocab.d2t, "t2d": vocab.t2d}


def _target_dir(path, hidden=HIDDEN, model_type="llama"):
    """A target model directory: only its config.json is read (by our exporter and SGLang's ModelConfig)."""
    path.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": model_type, "hidden_size": hidden,
        "intermediate_size": 2 * hidden, "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS,
        "num_hidden_layers": TARGET_LAYERS, "vocab_size": VOCAB, "rms_norm_eps": 1e-5, "torch_dtype": "float32",
        "max_position_embeddings": 256,
    }  # fmt: skip
    (path / "config.json").write_text(json.dumps(config))
    return path


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _publish(argv):
    from sglang.srt.runtime_context import SpawnRanks, publish
    from sglang.srt.server_args import prepare_server_args

    server_args = prepare_server_args(list(argv))
    publish(server_args, role="test", ranks=SpawnRanks(world_rank=0))
    return server_args


@pytest.fixture(scope="module")
def sglang_runtime(tmp_path_factory):
    """A published one-rank SGLang runtime (gloo), torn down after this module's tests."""
    from sglang.srt.distributed import parallel_state
    from sglang.srt.runtime_context import reset_context

    target = _target_dir(tmp_path_factory.mktemp("runtime") / "target")
    _publish(["--model-path", str(target), "--device", "cpu", "--skip-tokenizer-init"])
    parallel_state.init_distributed_environment(
        world_size=1, rank=0, local_rank=0, backend="gloo",
        distributed_init_method=f"tcp://127.0.0.1:{_free_port()}",
    )  # fmt: skip
    parallel_state.initialize_model_parallel()
    yield
    # destroy_model_parallel imports distributed/bootstrap.py (uvicorn, fastapi: server packages this
    # venv lacks) only to reset an init guard that calling initialize_model_parallel directly never set.
    bootstrap = "sglang.srt.distributed.bootstrap"
    stub = bootstrap not in sys.modules
    if stub:
        sys.modules[bootstrap] = types.SimpleNamespace(reset_parallel_initialised=lambda: None)
    try:
        parallel_state.destroy_model_parallel()
    finally:
        if stub:
            del sys.modules[bootstrap]
    parallel_state.destroy_distributed_environment()
    reset_context()


def _build_and_load(export_dir, monkeypatch, weights_path=None):
    """SGLang's model from our config.json, all params NaN, then its load_weights over our file."""
    import sglang.srt.layers.rotary_embedding.base as rotary_base
    from sglang.srt.model_loader.weight_utils import safetensors_weights_iterator
    from sglang.srt.models.llama_eagle3 import LlamaForCausalLMEagle3
    from transformers import AutoConfig

    monkeypatch.setattr(rotary_base, "_is_cpu", True)  # construction only; see the module docstring
    hf_config = AutoConfig.from_pretrained(str(export_dir))
    model = LlamaForCausalLMEagle3(hf_config)
    with torch.no_grad():
        for param in model.parameters():
            param.fill_(float("nan"))
    weights = weights_path or export_dir / ex.WEIGHTS_FILE
    model.load_weights(safetensors_weights_iterator([str(weights)]))
    return model


def _assert_every_param_is_ours(model, state, cfg):
    """Each SGLang parameter equals our tensors in its fused layout; returns the names not from our file."""
    params = dict(model.named_parameters())
    q = HEADS * (HIDDEN // HEADS)
    kv = KV_HEADS * (HIDDEN // HEADS)
    ours = {
        "model.layers.0.self_attn.qkv_proj.weight": torch.cat([state["midlayer.self_attn.q_proj.weight"],
                                                               state["midlayer.self_attn.k_proj.weight"],
                                                               state["midlayer.self_attn.v_proj.weight"]]),
        "model.layers.0.self_attn.o_proj.weight": state["midlayer.self_attn.o_proj.weight"],
        "model.layers.0.mlp.gate_up_proj.weight": torch.cat([state["midlayer.mlp.gate_proj.weight"],
                                                             state["midlayer.mlp.up_proj.weight"]]),
        "model.layers.0.mlp.down_proj.weight": state["midlayer.mlp.down_proj.weight"],
        "model.layers.0.input_layernorm.weight": state["midlayer.input_layernorm.weight"],
        "model.layers.0.hidden_norm.weight": state["midlayer.hidden_norm.weight"],
        "model.layers.0.post_attention_layernorm.weight": state["midlayer.post_attention_layernorm.weight"],
        "model.fc.weight": state["fc.weight"],
        "model.norm.weight": state["norm.weight"],
        "lm_head.weight": state["lm_head.weight"],  # ParallelLMHead pads rows; the first D are ours
    }
    if "embed_tokens.weight" in state:
        ours["model.embed_tokens.weight"] = state["embed_tokens.weight"]
    assert params["model.layers.0.self_attn.qkv_proj.weight"].shape == (q + 2 * kv, 2 * HIDDEN)  # input 2H
    for name, tensor in ours.items():
        param = params[name].detach()
        rows = tensor.shape[0]
        assert param.shape[1:] == tensor.shape[1:], name
        assert torch.equal(param[:rows], tensor), f"{name}: not loaded from our checkpoint (or into the wrong slot)"
    hot = model.get_hot_token_id()
    assert hot is not None and torch.equal(hot, torch.arange(DRAFT) + state["d2t"])
    assert torch.equal(hot, state["t2d"].nonzero().flatten())
    return sorted(set(params) - set(ours))


def test_sglang_loads_every_parameter_of_our_export(sglang_runtime, tmp_path, monkeypatch):
    cfg = _drafter_cfg()
    state = _random_state(cfg)
    out = ex.export_sglang(state, cfg, _manifest(_target_dir(tmp_path / "target")), tmp_path / "drafter")
    model = _build_and_load(out, monkeypatch)
    assert model.load_lm_head_from_target is False  # draft_vocab_size is set: the head is ours, not the target's
    assert model.model.num_aux_hidden_states == 3 and len(model.model.layers) == 1
    not_ours = _assert_every_param_is_ours(model, state, cfg)
    # The only parameter our file does not fill is the embedding, which the EAGLE worker replaces by the
    # target's (eagle_worker_v2.py init_lm_head -> set_embed) when the hidden sizes agree.
    assert not_ours == ["model.embed_tokens.weight"]
    target_embed = torch.randn(VOCAB, HIDDEN)
    model.set_embed(target_embed)
    assert model.model.embed_tokens.weight is target_embed


@pytest.mark.parametrize("norm_before_fc", [False, True], ids=["eagle3.1", "eagle3.1+norm_before_fc"])
def test_sglang_builds_and_loads_our_eagle3_1_export_with_its_norms(sglang_runtime, tmp_path, monkeypatch,
                                                                    norm_before_fc):
    """EAGLE 3.1: SGLang reads fc_norm, norm_output (and norm_before_fc) from our config.json, builds the per-aux
    norms (and the one before fc), and loads each from our file; with our eagle3 export it builds none."""
    cfg = _drafter_cfg(fc_norm=True, norm_output=True, norm_before_fc=norm_before_fc)
    state = _random_state(cfg)
    out = ex.export_sglang(state, cfg, _manifest(_target_dir(tmp_path / "target")), tmp_path / "drafter")
    model = _build_and_load(out, monkeypatch)
    assert model.model.norm_output is True and len(model.model.fc_norm) == 3
    assert (model.model.input_norm is not None) is norm_before_fc
    params = dict(model.named_parameters())
    extra = {f"model.fc_norm.{i}.weight": state[f"fc_norm.{i}.weight"] for i in range(3)}
    if norm_before_fc:
        extra["model.input_norm.weight"] = state["input_norm.weight"]
    for name, tensor in extra.items():
        assert torch.equal(params[name].detach(), tensor), f"{name}: not loaded from our checkpoint"
    assert _assert_every_param_is_ours(model, state, cfg) == sorted(["model.embed_tokens.weight", *extra])

    plain = ex.export_sglang(_random_state(_drafter_cfg()), _drafter_cfg(),
                             _manifest(_target_dir(tmp_path / "target")), tmp_path / "plain")
    model = _build_and_load(plain, monkeypatch)
    assert model.model.fc_norm is None and model.model.input_norm is None and model.model.norm_output is False


MLA = {"q_lora_rank": 16, "kv_lora_rank": 8, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 8}
# SGLang builds MLA's RoPE on a CPU only with DeepSeek's YaRN (rotary_embedding/factory.py); Kimi-K2.x has it.
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 32, "beta_slow": 1,
        "mscale": 1.0, "mscale_all_dim": 1.0}


@pytest.mark.parametrize("variant", [{}, {"fc_norm": True, "norm_output": True}], ids=["eagle3", "eagle3.1"])
def test_sglang_builds_the_mla_drafter_from_our_export_and_loads_every_weight(sglang_runtime, tmp_path, monkeypatch,
                                                                             variant):
    """The MLA layout: SGLang's own Eagle3DeepseekV2ForCausalLM (kimi_k25_eagle3.py) from our config.json, every
    parameter filled from our file: q_a_proj and kv_a_proj_with_mqa fused into fused_qkv_a_proj_with_mqa,
    gate/up into gate_up_proj, kv_b_proj split into the absorbed w_kc / w_vc after the load."""
    import sglang.srt.layers.rotary_embedding.base as rotary_base
    from safetensors.torch import load_file
    from sglang.srt.model_loader.weight_utils import safetensors_weights_iterator
    from sglang.srt.models.kimi_k25_eagle3 import Eagle3DeepseekV2ForCausalLM
    from transformers import AutoConfig

    cfg = _drafter_cfg(layout="mla", num_key_value_heads=HEADS, rope_scaling=YARN, **MLA, **variant)
    state = _random_state(cfg)
    man = _manifest(_target_dir(tmp_path / "target", model_type="deepseek_v3"))
    out = ex.export_sglang(state, cfg, man, tmp_path / "drafter")
    monkeypatch.setattr(rotary_base, "_is_cpu", True)  # construction only; see the module docstring
    model = Eagle3DeepseekV2ForCausalLM(AutoConfig.from_pretrained(str(out)))
    with torch.no_grad():
        for param in model.parameters():
            param.fill_(float("nan"))
    model.load_weights(safetensors_weights_iterator([str(out / ex.WEIGHTS_FILE)]))
    stored = load_file(out / ex.WEIGHTS_FILE)
    attn = "model.midlayer.self_attn."
    ours = {
        attn + "fused_qkv_a_proj_with_mqa.weight": torch.cat([stored["midlayer.self_attn.q_a_proj.weight"],
                                                              stored["midlayer.self_attn.kv_a_proj_with_mqa.weight"]]),
        "model.midlayer.mlp.gate_up_proj.weight": torch.cat([stored["midlayer.mlp.gate_proj.weight"],
                                                             stored["midlayer.mlp.up_proj.weight"]]),
        "lm_head.weight": stored["lm_head.weight"],
    }
    for name in ("q_a_layernorm", "q_b_proj", "kv_a_layernorm", "kv_b_proj", "o_proj"):
        ours[attn + name + ".weight"] = stored[f"midlayer.self_attn.{name}.weight"]
    for name in ("mlp.down_proj", "input_layernorm", "hidden_norm", "post_attention_layernorm"):
        ours[f"model.midlayer.{name}.weight"] = stored[f"midlayer.{name}.weight"]
    ours["model.fc.weight"], ours["model.norm.weight"] = stored["fc.weight"], stored["norm.weight"]
    if variant:
        ours |= {f"model.fc_norm.{i}.weight": stored[f"fc_norm.{i}.weight"] for i in range(3)}
    params = dict(model.named_parameters())
    for name, tensor in ours.items():
        param = params[name].detach()
        assert torch.equal(param[: tensor.shape[0]], tensor), f"{name}: not loaded from our checkpoint"
    assert sorted(set(params) - set(ours)) == ["model.embed_tokens.weight"]  # the target's, at serving
    assert model.model.norm_output is bool(variant) and (model.model.fc_norm is not None) is bool(variant)
    nope = MLA["qk_nope_head_dim"]
    per_head = stored["midlayer.self_attn.kv_b_proj.weight"].view(HEADS, nope + MLA["v_head_dim"], -1)
    absorbed = model.model.midlayer.self_attn
    assert torch.equal(absorbed.w_kc, per_head[:, :nope]) and torch.equal(absorbed.w_vc, per_head[:, nope:].mT)
    hot = model.get_hot_token_id()
    assert torch.equal(hot, torch.arange(DRAFT) + stored["d2t"])


def test_wider_target_exports_embed_tokens_that_sglang_loads(sglang_runtime, tmp_path, monkeypatch):
    """T != H: set_embed keeps the draft's own embedding, so it must come from our file; fc is n x T wide."""
    cfg = _drafter_cfg(target_hidden_size=48, num_aux_hidden_states=4)
    state = _random_state(cfg)
    man = _manifest(_target_dir(tmp_path / "target", hidden=48), aux_layers=[1, 2, 4, 5], hidden_size=48)
    out = ex.export_sglang(state, cfg, man, tmp_path / "drafter")
    model = _build_and_load(out, monkeypatch)
    assert model.model.fc.weight.shape == (HIDDEN, 4 * 48)
    assert _assert_every_param_is_ours(model, state, cfg) == []
    before = model.model.embed_tokens.weight
    model.set_embed(torch.zeros(VOCAB, 48))
    assert model.model.embed_tokens.weight is before


def test_sglang_skips_a_misnamed_tensor_silently(sglang_runtime, tmp_path, monkeypatch):
    """Why the exporter refuses extra names: SGLang's load_weights drops an unknown name without a word."""
    from safetensors.torch import save_file

    cfg = _drafter_cfg()
    state = _random_state(cfg)
    out = ex.export_sglang(state, cfg, _manifest(_target_dir(tmp_path / "target")), tmp_path / "drafter")
    renamed = {("midlayer.hiddn_norm.weight" if k == "midlayer.hidden_norm.weight" else k): v for k, v in state.items()}
    save_file(renamed, str(tmp_path / "renamed.safetensors"))
    model = _build_and_load(out, monkeypatch, weights_path=tmp_path / "renamed.safetensors")  # no error
    assert torch.isnan(model.model.layers[0].hidden_norm.weight).all()
    with pytest.raises(ex.ExportError, match=r"missing: midlayer\.hidden_norm\.weight"):
        ex.check_drafter_tensors(renamed, cfg)


def test_config_json_reads_as_sglang_draft_model_config(sglang_runtime, tmp_path):
    """SGLang's own ModelConfig (draft mode) reads our config.json: architecture, dtype, one layer, sizes."""
    from sglang.srt.configs.model_config import ModelConfig

    cfg = _drafter_cfg(dtype="bfloat16")  # (SGLang's "auto" serves a float32 config in float16)
    out = ex.export_sglang(_random_state(cfg), cfg, _manifest(_target_dir(tmp_path / "target")), tmp_path / "d")
    config = ModelConfig(str(out), is_draft_model=True)
    assert config.hf_config.architectures == ["LlamaForCausalLMEagle3"]
    assert config.dtype == torch.bfloat16 and config.num_hidden_layers == 1
    assert config.hf_config.draft_vocab_size == DRAFT and config.hf_config.target_hidden_size == HIDDEN


@pytest.mark.parametrize(
    ("model_type", "aux", "target_class"),
    [
        ("llama", [1, 3, 5], "llama"),
        ("llama", [0, 3, 6], "llama"),
        ("deepseek_v2", [1, 4, 6], "deepseek"),
        ("deepseek_v3", [2, 3, 5], "deepseek"),
        ("kimi_k25", [3, 4, 6], "deepseek"),
    ],
)
def test_target_captures_exactly_the_manifest_layers(sglang_runtime, tmp_path, model_type, aux, target_class):
    """Draft config -> SGLang's resolver -> the target's set_eagle3_layers_to_capture -> our layers' outputs."""
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.model_executor.model_runner_components.attention_backend_setup import (
        configure_aux_hidden_state_capture,
    )
    from sglang.srt.model_executor.model_runner_components.spec_aux_hidden_state import (
        resolve_spec_aux_hidden_state_config,
    )
    from sglang.srt.models.deepseek_v2 import DeepseekV2ForCausalLM
    from sglang.srt.models.llama import LlamaForCausalLM
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    target = _target_dir(tmp_path / "target")
    cfg = _drafter_cfg()
    out = ex.export_sglang(_random_state(cfg), cfg, _manifest(target, aux_layers=aux), tmp_path / "d",
                           target_model_type_override=model_type)
    server_args = _publish([
        "--model-path", str(target), "--device", "cpu", "--skip-tokenizer-init",
        "--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", str(out),
    ])  # fmt: skip
    resolved = resolve_spec_aux_hidden_state_config(
        server_args=server_args, model_config=ModelConfig(str(target)),
        spec_algorithm=SpeculativeAlgorithm.EAGLE3, is_draft_worker=False,
    )  # fmt: skip
    written = json.loads((out / ex.CONFIG_FILE).read_text())["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    assert resolved.eagle_use_aux_hidden_state is True
    assert resolved.eagle_aux_hidden_state_layer_ids == written

    cls = LlamaForCausalLM if target_class == "llama" else DeepseekV2ForCausalLM
    holder = type("Target", (), {"set_eagle3_layers_to_capture": cls.set_eagle3_layers_to_capture})()
    holder.pp_group = type("PP", (), {"is_last_rank": True})()
    holder.model = type("Model", (), {})()
    configure_aux_hidden_state_capture(
        model=holder, eagle_use_aux_hidden_state=True,
        eagle_aux_hidden_state_layer_ids=resolved.eagle_aux_hidden_state_layer_ids,
        dflash_use_aux_hidden_state=False, dflash_target_layer_ids=None, is_dspark=False,
    )  # fmt: skip
    # Both decoder loops capture a layer's INPUT, i.e. the output of the layer before it.
    assert [layer - 1 for layer in holder.model.layers_to_capture] == aux
