"""Contract tests against the real SGLang 0.5.23 wheel (run under .venv-sglang, see conftest.py).

They show that SGLang's own parser accepts our launch command with capture on, that the extras
we refuse are ones SGLang would have accepted (so the refusal is needed), that SGLang's own
hook_manager attaches our hook, and that the hook, called through a model's forward with a real
ForwardBatch, writes exactly the rows of each request.

The model is a small torch model with SGLang's module names and calling convention
(``LlamaForCausalLM.forward`` -> ``logits_processor(input_ids, hidden_states, lm_head,
forward_batch, aux_hidden_states)``), not SGLang's LlamaForCausalLM or LogitsProcessor: those
build parallel linear layers and read the published runtime config (``get_parallel()``,
``get_exec()``), which exist only inside a launched server.
"""

from __future__ import annotations

import argparse
import json

import pytest
import torch
from torch import nn

from eagle3_pipeline.capture.sglang_hook import SGLangCaptureHook
from eagle3_pipeline.capture.writer import capture_path, incomplete_path, read_capture, write_capture
from eagle3_pipeline.serve import sglang_command as sc

NUM_LAYERS, HIDDEN, VOCAB = 8, 16, 32
AUX = [1, 3, 5]


@pytest.fixture
def llama_dir(tmp_path):
    """A model directory with a llama config.json (the parser does not read it; resolution would)."""
    path = tmp_path / "tiny-llama"
    path.mkdir()
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": HIDDEN,
        "intermediate_size": 32, "num_attention_heads": 2, "num_key_value_heads": 2,
        "num_hidden_layers": NUM_LAYERS, "vocab_size": VOCAB, "rms_norm_eps": 1e-5,
    }  # fmt: skip
    (path / "config.json").write_text(json.dumps(config))
    return path


def _argv(llama_dir, capture_dir, **kwargs):
    return sc.launch_argv(
        "/opt/sglang/bin/python", str(llama_dir), "127.0.0.1", 30000, 1, AUX, str(capture_dir),
        model_type="llama", num_hidden_layers=NUM_LAYERS, **kwargs,
    )  # fmt: skip


def _parse(argv):
    from sglang.srt.server_args import prepare_server_args

    return prepare_server_args(list(argv))


def _parser() -> argparse.ArgumentParser:
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    return parser


# --- (1) the launch command, through SGLang's own parser --------------------------------------


def test_prepare_server_args_accepts_launch_argv_with_capture_on(llama_dir, tmp_path):
    argv = _argv(llama_dir, tmp_path / "cap")
    assert argv[1:3] == ["-m", "sglang.launch_server"]
    args = _parse(argv[3:])
    assert args.model_path == str(llama_dir)
    assert args.disable_radix_cache is True
    assert args.chunked_prefill_size == -1
    assert args.cuda_graph_backend_prefill == "disabled"
    assert args.cuda_graph_backend_decode == "disabled"
    assert args.cuda_graph_config is None
    assert args.disable_custom_all_reduce is True
    assert args.enable_return_aux_hidden_states is True
    assert args.speculative_algorithm == "EAGLE3"
    assert args.speculative_draft_model_path is None
    assert args.return_aux_hidden_state_layer_ids == sc.sglang_layer_ids(AUX, "llama") == AUX
    assert args.forward_hooks == [sc.hook_spec(str(tmp_path / "cap"), AUX, AUX, "llama")]
    assert args.api_key is None


def test_launch_argv_uses_no_deprecated_flag(llama_dir, tmp_path):
    parser = _parser()
    by_flag = {opt: action for action in parser._actions for opt in action.option_strings}
    flags = [token for token in _argv(llama_dir, tmp_path)[3:] if token.startswith("--")]
    assert all(flag in by_flag for flag in flags)
    deprecated = [flag for flag in flags if "Deprecated" in type(by_flag[flag]).__name__]
    assert deprecated == []
    assert "Deprecated" in type(by_flag["--disable-cuda-graph"]).__name__  # why we do not use it


def test_api_key_reaches_sglang_through_config_file_not_argv(llama_dir, tmp_path):
    key = "s3cr3t-key with spaces: and # marks"
    config = tmp_path / "sglang-secrets.yaml"
    config.write_text(sc.api_key_config_text(key))
    argv = _argv(llama_dir, tmp_path / "cap", api_key_config=str(config))
    assert not any(key in token for token in argv)
    args = _parse(argv[3:])
    assert args.api_key == key
    assert args.disable_radix_cache is True and args.chunked_prefill_size == -1


# Extras that would undo capture, each with a value SGLang's parser accepts.
GRAPH_JSON = '{"prefill": {"backend": "full"}}'
DANGEROUS_EXTRAS = [
    (["--enable-mixed-chunk"], "enable_mixed_chunk", True),
    (["--enable-hierarchical-cache"], "enable_hierarchical_cache", True),
    (["--enable-hicache"], "enable_hierarchical_cache", True),
    (["--hicache-ratio", "2"], "hicache_ratio", 2.0),
    (["--enable-lmcache"], "enable_lmcache", True),
    (["--chunked-prefill-size", "8192"], "chunked_prefill_size", 8192),
    (["--chunked-prefill-size=-1"], "chunked_prefill_size", -1),
    (["--cuda-graph-config", GRAPH_JSON], "cuda_graph_config", json.loads(GRAPH_JSON)),
    (["--cuda-graph-backend-prefill", "breakable"], "cuda_graph_backend_prefill", "breakable"),
    (["--cuda-graph-bs-prefill", "1", "2"], "cuda_graph_bs_prefill", [1, 2]),
    (["--disable-cuda-graph"], "disable_cuda_graph", True),
    (["--enable-torch-compile"], "enable_torch_compile", True),
    (["--speculative-algorithm", "EAGLE"], "speculative_algorithm", "EAGLE"),
    (["--speculative-num-steps", "3"], "speculative_num_steps", 3),
    (["--return-aux-hidden-state-layer-ids", "2", "4"], "return_aux_hidden_state_layer_ids", [2, 4]),
    (["--forward-hooks", "[]"], "forward_hooks", []),
    (["--attn-dp-size", "2"], "attn_dp_size", 2),
    (["--enable-dp-attention"], "enable_dp_attention", True),
    (["--pp-size", "2"], "pp_size", 2),
    (["--enable-layernorm-sp"], "enable_layernorm_sp", True),
    (["--enable-two-batch-overlap"], "enable_two_batch_overlap", True),
    (["--enable-prefill-cp"], "enable_prefill_cp", True),
    (["--enable-mis"], "enable_mis", True),
    (["--radix-cache-backend", "custom"], "radix_cache_backend", "custom"),
    (["--is-embedding"], "is_embedding", True),
    (["--api-key", "visible-in-ps"], "api_key", "visible-in-ps"),
    (["--tp-size", "2"], "tp_size", 2),
    (["--enable-mixed"], "enable_mixed_chunk", True),  # argparse abbreviation
]


@pytest.mark.parametrize(("extra", "field", "value"), DANGEROUS_EXTRAS, ids=[" ".join(e[0]) for e in DANGEROUS_EXTRAS])
def test_refused_extra_is_one_sglang_would_accept(llama_dir, tmp_path, extra, field, value):
    base = _argv(llama_dir, tmp_path)[3:]
    args = _parse(base + extra)  # SGLang takes it: without our check it would reach the server
    assert getattr(args, field) == value
    with pytest.raises(ValueError, match=extra[0].split("=")[0]):
        sc.check_extra_args(extra)
    with pytest.raises(ValueError, match="sglang_server_extra_args|spell flags in full"):
        _argv(llama_dir, tmp_path, extra_args=extra)


def test_refusal_lists_name_real_flags_of_this_sglang():
    options = {opt for action in _parser()._actions for opt in action.option_strings}
    stale = sorted(flag for flag in [*sc._SET_FLAGS, *sc._REFUSED_FLAGS] if flag not in options)
    assert stale == []
    for prefix in sc._REFUSED_PREFIXES:
        assert any(opt.startswith(prefix) for opt in options), prefix


def test_every_other_sglang_flag_passes_check_extra_args():
    refused_set = {*sc._SET_FLAGS, *sc._REFUSED_FLAGS}
    for action in _parser()._actions:
        for opt in action.option_strings:
            if not opt.startswith("--") or opt == "--help":
                continue
            if opt in refused_set or any(opt.startswith(p) for p in sc._REFUSED_PREFIXES):
                with pytest.raises(ValueError):
                    sc.check_extra_args([opt])
            else:
                sc.check_extra_args([opt])  # no false refusal of a full flag as an "abbreviation"


def test_allowed_extras_pass_both_checks(llama_dir, tmp_path):
    extra = ["--mem-fraction-static", "0.85", "--context-length=8192", "--trust-remote-code"]
    argv = _argv(llama_dir, tmp_path, extra_args=extra)
    args = _parse(argv[3:])
    assert args.mem_fraction_static == 0.85 and args.context_length == 8192 and args.trust_remote_code


def test_deepseek_ids_survive_sglang_rule():
    """DeepseekV2ForCausalLM.set_eagle3_layers_to_capture, run on our ids, captures our layers' outputs."""
    from sglang.srt.models.deepseek_v2 import DeepseekV2ForCausalLM

    for aux in ([1, 30, 57], [2, 29, 56], [5]):
        ids = sc.sglang_layer_ids(aux, "kimi_k25", num_hidden_layers=61)
        holder = type("Holder", (), {})()
        holder.pp_group = type("PP", (), {"is_last_rank": True})()
        holder.model = type("M", (), {})()
        DeepseekV2ForCausalLM.set_eagle3_layers_to_capture(holder, ids)
        # the decoder layer captures its INPUT, i.e. the output of the layer before it
        assert [layer - 1 for layer in holder.model.layers_to_capture] == aux


def test_llama_ids_survive_sglang_rule():
    """LlamaForCausalLM.set_eagle3_layers_to_capture, run on our ids, captures our layers' outputs."""
    from sglang.srt.models.llama import LlamaForCausalLM

    ids = sc.sglang_layer_ids(AUX, "llama", num_hidden_layers=NUM_LAYERS)
    holder = type("Holder", (), {})()
    holder.pp_group = type("PP", (), {"is_last_rank": True})()
    holder.model = type("M", (), {})()
    LlamaForCausalLM.set_eagle3_layers_to_capture(holder, ids)
    assert [layer - 1 for layer in holder.model.layers_to_capture] == AUX


# --- (2)+(3) SGLang's hook_manager attaches our hook; the hook writes per request -------------


class TinyLogitsProcessor(nn.Module):
    """Same call signature as sglang's LogitsProcessor.forward; returns next-token logits."""

    def forward(self, input_ids, hidden_states, lm_head, logits_metadata, aux_hidden_states=None):
        return lm_head(hidden_states)


class TinyLlamaModel(nn.Module):
    """LlamaModel's capture rule: layer i in layers_to_capture records its INPUT (a clone)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed_tokens = nn.Embedding(VOCAB, HIDDEN)
        self.layers = nn.ModuleList(nn.Linear(HIDDEN, HIDDEN) for _ in range(NUM_LAYERS))
        self.norm = nn.LayerNorm(HIDDEN)
        self.layers_to_capture: list[int] = []

    def forward(self, input_ids, positions, forward_batch):
        hidden = self.embed_tokens(input_ids)
        aux = []
        for i, layer in enumerate(self.layers):
            if i in self.layers_to_capture:
                aux.append(hidden.clone())
            hidden = hidden + torch.tanh(layer(hidden))
        return self.norm(hidden), aux

    def reference_outputs(self, input_ids):
        """HF-style hidden_states: [embeddings, output of layer 0, ..., output of the last layer]."""
        hidden = self.embed_tokens(input_ids)
        outputs = [hidden]
        for layer in self.layers:
            hidden = hidden + torch.tanh(layer(hidden))
            outputs.append(hidden)
        return outputs


class TinyLlamaForCausalLM(nn.Module):
    """LlamaForCausalLM's module names (model, lm_head, logits_processor) and forward."""

    def __init__(self):
        super().__init__()
        self.model = TinyLlamaModel()
        self.lm_head = nn.Linear(HIDDEN, VOCAB, bias=False)
        self.logits_processor = TinyLogitsProcessor()

    def set_eagle3_layers_to_capture(self, layer_ids):
        self.model.layers_to_capture = [val + 1 for val in layer_ids]  # as models/llama.py

    @torch.no_grad()
    def forward(self, input_ids, positions, forward_batch):
        hidden_states, aux_hidden_states = self.model(input_ids, positions, forward_batch)
        return self.logits_processor(input_ids, hidden_states, self.lm_head, forward_batch, aux_hidden_states)


class TinyKimiWrapper(nn.Module):
    """KimiK25ForConditionalGeneration holds the text model as ``language_model``."""

    def __init__(self):
        super().__init__()
        self.language_model = TinyLlamaForCausalLM()


def _register(model, capture_dir, model_type="llama"):
    from sglang.srt.model_executor.hook_manager import register_forward_hooks

    ids = sc.sglang_layer_ids(AUX, model_type, NUM_LAYERS)
    spec = sc.hook_spec(str(capture_dir), AUX, ids, model_type)
    register_forward_hooks(model, json.loads(json.dumps([spec])))  # as it arrives from --forward-hooks
    return ids


def _forward_batch(rids, seq_lens, prefix_lens, mode="EXTEND", orig=None):
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode

    total = sum(seq_lens)
    seq = [p + n for p, n in zip(prefix_lens, seq_lens)]
    return ForwardBatch(
        forward_mode=ForwardMode[mode],
        batch_size=len(rids),
        input_ids=torch.zeros(total, dtype=torch.int64),
        req_pool_indices=torch.arange(len(rids)),
        seq_lens=torch.tensor(seq),
        out_cache_loc=torch.arange(total),
        seq_lens_sum=sum(seq),
        seq_lens_cpu=torch.tensor(seq),
        orig_seq_lens=torch.tensor(orig if orig is not None else seq, dtype=torch.int32),
        rids=list(rids),
        extend_seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        extend_prefix_lens=torch.tensor(prefix_lens, dtype=torch.int32),
        extend_seq_lens_cpu=list(seq_lens),
        extend_prefix_lens_cpu=list(prefix_lens),
    )


def _tp_rank(rank):
    from sglang.srt.runtime_context import get_parallel

    return get_parallel().override(tp_rank=rank)


def test_hook_manager_attaches_capture_hook_to_logits_processor(tmp_path):
    model = TinyLlamaForCausalLM()
    _register(model, tmp_path)
    hooked = {name: list(m._forward_hooks.values()) for name, m in model.named_modules() if m._forward_hooks}
    assert list(hooked) == ["logits_processor"]
    (hook,) = hooked["logits_processor"]
    assert isinstance(hook, SGLangCaptureHook)
    assert hook.aux_layer_ids == AUX and hook.capture_dir == str(tmp_path)


def test_hook_manager_finds_kimi_language_model_logits_processor(tmp_path):
    model = TinyKimiWrapper()
    _register(model, tmp_path, model_type="kimi_k25")
    hooked = [name for name, m in model.named_modules() if m._forward_hooks]
    assert hooked == ["language_model.logits_processor"]


def test_hook_writes_each_request_of_an_extend_batch(tmp_path):
    model = TinyLlamaForCausalLM()
    ids = _register(model, tmp_path)
    model.set_eagle3_layers_to_capture(ids)  # what SGLang does with --return-aux-hidden-state-layer-ids
    lens = [3, 5, 2]
    input_ids = torch.randint(0, VOCAB, (sum(lens),), generator=torch.Generator().manual_seed(1))
    batch = _forward_batch(["req-a", "req-b", "req-c"], lens, [0, 0, 0])
    seen = {}
    model.logits_processor.register_forward_hook(lambda m, args, out: seen.update(h=args[1], aux=args[4]))
    with _tp_rank(0):
        model(input_ids, torch.arange(sum(lens)), batch)

    reference = model.model.reference_outputs(input_ids)
    start = 0
    for rid, n in zip(["req-a", "req-b", "req-c"], lens):
        cap = read_capture(capture_path(tmp_path, rid))
        rows = slice(start, start + n)
        start += n
        assert cap.last_hidden_states.shape == (n, HIDDEN)
        assert cap.aux_hidden_states.shape == (n, len(AUX) * HIDDEN)
        assert torch.equal(cap.last_hidden_states, seen["h"][rows])
        assert torch.equal(cap.aux_hidden_states, torch.cat(seen["aux"], dim=-1)[rows])
        # and the aux columns are the OUTPUTS of our aux layers (HF hidden_states[i + 1])
        expected = torch.cat([reference[a + 1][rows] for a in AUX], dim=-1)
        assert torch.allclose(cap.aux_hidden_states, expected)
        assert cap.aux_layer_ids == AUX and cap.engine == "sglang-0.5.23"


def test_hook_quantizes_the_requests_that_ask_for_float8_beside_plain_ones(tmp_path):
    from eagle3_pipeline.capture.writer import FLOAT8_RID_SUFFIX, UNQUANTIZED_LAST  # noqa: PLC0415
    from eagle3_pipeline.extract.storage import FLOAT8, quantize_states  # noqa: PLC0415

    model = TinyLlamaForCausalLM()
    model.set_eagle3_layers_to_capture(_register(model, tmp_path))
    lens, rids = [3, 5], ["req-plain", "req-q" + FLOAT8_RID_SUFFIX]
    batch = _forward_batch(rids, lens, [0, 0])
    seen = {}
    model.logits_processor.register_forward_hook(lambda m, args, out: seen.update(h=args[1], aux=args[4]))
    with _tp_rank(0):
        model(torch.randint(0, VOCAB, (sum(lens),)), torch.arange(sum(lens)), batch)

    plain, quantized = (read_capture(capture_path(tmp_path, rid)) for rid in rids)
    assert plain.storage_dtype is None and torch.equal(plain.last_hidden_states, seen["h"][:3])
    rows = slice(3, 8)
    expected = quantize_states(torch.cat(seen["aux"], dim=-1)[rows], seen["h"][rows])
    assert quantized.storage_dtype == FLOAT8 and quantized.num_tokens == 5
    for name, tensor in expected.items():
        assert torch.equal(quantized.tensors[name].view(torch.uint8), tensor.view(torch.uint8)), name
    assert torch.equal(quantized.tensors[UNQUANTIZED_LAST], seen["h"][rows])


def test_hook_records_cached_prefix_and_split_prefill_as_incomplete(tmp_path):
    model = TinyLlamaForCausalLM()
    model.set_eagle3_layers_to_capture(_register(model, tmp_path))
    # an earlier, whole-looking capture of req-split must not survive its incomplete record
    write_capture(tmp_path, "req-split", torch.zeros(2, 3 * HIDDEN), torch.zeros(2, HIDDEN), AUX, "x")
    lens, prefixes = [4, 3, 2], [0, 6, 0]
    batch = _forward_batch(["req-ok", "req-cached", "req-split"], lens, prefixes, orig=[4, 9, 7])
    with _tp_rank(0):
        model(torch.randint(0, VOCAB, (sum(lens),)), torch.arange(sum(lens)), batch)
    assert read_capture(capture_path(tmp_path, "req-ok")).num_tokens == 4
    cached = json.loads(incomplete_path(tmp_path, "req-cached").read_text())
    assert cached["reason"] == "prefix_not_computed" and cached["prefix_len"] == 6
    assert not capture_path(tmp_path, "req-cached").exists()
    split = json.loads(incomplete_path(tmp_path, "req-split").read_text())
    assert split["reason"] == "split_prefill" and split["prompt_len"] == 7
    assert not capture_path(tmp_path, "req-split").exists()


def test_hook_writes_nothing_on_other_tp_ranks_or_in_decode(tmp_path):
    model = TinyLlamaForCausalLM()
    model.set_eagle3_layers_to_capture(_register(model, tmp_path))
    with _tp_rank(1):
        model(torch.zeros(3, dtype=torch.int64), torch.arange(3), _forward_batch(["r1"], [3], [0]))
    decode = _forward_batch(["r2", "r3"], [1, 1], [5, 7], mode="DECODE")
    with _tp_rank(0):
        model(torch.zeros(2, dtype=torch.int64), torch.arange(2), decode)
    assert list(tmp_path.iterdir()) == []


def test_hook_records_batch_without_aux_states_as_incomplete(tmp_path):
    model = TinyLlamaForCausalLM()
    _register(model, tmp_path)  # aux capture never switched on: the model returns no aux states
    with _tp_rank(0):
        model(torch.zeros(3, dtype=torch.int64), torch.arange(3), _forward_batch(["r1"], [3], [0]))
    assert json.loads(incomplete_path(tmp_path, "r1").read_text())["reason"] == "no_aux_hidden_states"
    assert not capture_path(tmp_path, "r1").exists()
