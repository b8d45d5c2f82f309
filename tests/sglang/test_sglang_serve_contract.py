"""Contract tests of the serving launch (the regeneration's server) against the real SGLang 0.5.23 wheel.

They show that SGLang's own parser accepts ``serve_launch_argv`` and leaves every capture
setting at SGLang's default (radix cache on, CUDA graphs and chunked prefill at their
defaults, no aux hidden states, no hook, no speculative algorithm), that the API key still
arrives through the ``--config`` file, that the extras refused for serving are ones SGLang
would have accepted, and that every flag the refusal lists is a real flag of this SGLang.
Run under .venv-sglang (see conftest.py).
"""

from __future__ import annotations

import argparse
import json

import pytest

from eagle3_pipeline.serve import sglang_command as sc


@pytest.fixture
def llama_dir(tmp_path):
    path = tmp_path / "tiny-llama"
    path.mkdir()
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 16,
              "intermediate_size": 32, "num_attention_heads": 2, "num_key_value_heads": 2, "num_hidden_layers": 8,
              "vocab_size": 32, "rms_norm_eps": 1e-5}
    (path / "config.json").write_text(json.dumps(config))
    return path


def _parse(argv):
    from sglang.srt.server_args import prepare_server_args

    return prepare_server_args(list(argv))


def _parser() -> argparse.ArgumentParser:
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    return parser


def _argv(llama_dir, **kwargs):
    return sc.serve_launch_argv("/opt/sglang/bin/python", str(llama_dir), "127.0.0.1", 30100, 1, **kwargs)


def test_the_serving_launch_parses_with_every_capture_setting_at_sglangs_default(llama_dir):
    argv = _argv(llama_dir)
    assert argv[1:3] == ["-m", "sglang.launch_server"]
    args = _parse(argv[3:])
    defaults = _parse(["--model-path", str(llama_dir)])
    assert args.model_path == str(llama_dir) and args.port == 30100 and args.tp_size == 1
    for field in ("disable_radix_cache", "chunked_prefill_size", "cuda_graph_backend_prefill",
                  "cuda_graph_backend_decode", "cuda_graph_config", "disable_custom_all_reduce",
                  "enable_return_aux_hidden_states", "return_aux_hidden_state_layer_ids", "forward_hooks",
                  "speculative_algorithm"):
        assert getattr(args, field) == getattr(defaults, field), field
    assert args.disable_radix_cache is False and args.enable_return_aux_hidden_states is False
    assert args.forward_hooks is None and args.speculative_algorithm is None


def test_the_serving_launch_lacks_every_flag_the_capture_launch_adds(llama_dir, tmp_path):
    capture = sc.launch_argv("/opt/sglang/bin/python", str(llama_dir), "127.0.0.1", 30100, 1, [1, 3, 5],
                             str(tmp_path / "cap"), num_hidden_layers=8)
    capture_flags = {token for token in capture if token.startswith("--")} - set(_argv(llama_dir))
    assert capture_flags == {"--disable-radix-cache", "--chunked-prefill-size", "--cuda-graph-backend-prefill",
                             "--cuda-graph-backend-decode", "--disable-custom-all-reduce",
                             "--enable-return-aux-hidden-states", "--speculative-algorithm",
                             "--return-aux-hidden-state-layer-ids", "--forward-hooks"}
    assert not any(flag in _argv(llama_dir) for flag in capture_flags)


def test_the_api_key_reaches_the_serving_server_through_its_config_file(llama_dir, tmp_path):
    key = "s3cr3t-key with spaces: and # marks"
    config = tmp_path / "sglang-secrets.yaml"
    config.write_text(sc.api_key_config_text(key))
    argv = _argv(llama_dir, api_key_config=str(config))
    assert not any(key in token for token in argv)
    args = _parse(argv[3:])
    assert args.api_key == key and args.disable_radix_cache is False


REFUSED_FOR_SERVING = [
    (["--disable-radix-cache"], "disable_radix_cache", True),
    (["--enable-return-aux-hidden-states"], "enable_return_aux_hidden_states", True),
    (["--return-aux-hidden-state-layer-ids", "2", "4"], "return_aux_hidden_state_layer_ids", [2, 4]),
    (["--forward-hooks", "[]"], "forward_hooks", []),
    (["--speculative-algorithm", "EAGLE3"], "speculative_algorithm", "EAGLE3"),
    (["--disable-cuda-graph"], "disable_cuda_graph", True),
    (["--api-key", "visible-in-ps"], "api_key", "visible-in-ps"),
    (["--port", "1234"], "port", 1234),
    (["--disable-radix"], "disable_radix_cache", True),  # argparse abbreviation
]


@pytest.mark.parametrize(("extra", "field", "value"), REFUSED_FOR_SERVING,
                         ids=[" ".join(e[0]) for e in REFUSED_FOR_SERVING])
def test_a_refused_serving_extra_is_one_sglang_would_accept(llama_dir, extra, field, value):
    args = _parse(_argv(llama_dir)[3:] + extra)  # SGLang takes it: without our check it would reach the server
    assert getattr(args, field) == value
    with pytest.raises(ValueError, match="sglang_server_extra_args|spell flags in full"):
        _argv(llama_dir, extra_args=extra)


def test_the_serving_refusals_name_real_flags_and_allow_the_rest(llama_dir):
    options = {opt for action in _parser()._actions for opt in action.option_strings}
    assert sorted(flag for flag in sc._SERVE_SET_FLAGS if flag not in options) == []
    for prefix in sc._SERVE_REFUSED_PREFIXES:
        assert any(opt.startswith(prefix) for opt in options), prefix
    extra = ["--mem-fraction-static", "0.85", "--chunked-prefill-size", "8192", "--cuda-graph-max-bs-decode", "256"]
    args = _parse(_argv(llama_dir, extra_args=extra)[3:])
    assert args.mem_fraction_static == 0.85 and args.chunked_prefill_size == 8192
    assert args.cuda_graph_max_bs_decode == 256


@pytest.mark.parametrize("purpose", ["capture", "serve"])
def test_replicas_over_a_hosts_gpus_reach_sglang_with_the_capture_intact(llama_dir, tmp_path, purpose):
    # sglang_server_dp_size: a small model on every GPU of a host, one replica each behind one endpoint.
    from eagle3_pipeline.serve.plan import server_plan

    plan = server_plan("sglang", "/opt/sglang/bin/python", str(llama_dir), "127.0.0.1", 30100,
                       str(tmp_path / "cap"), aux_layers=[1, 3, 5], purpose=purpose, dp_size=8)
    args = _parse(plan["argv"][3:])
    assert (args.dp_size, args.tp_size) == (8, 1)
    expected = plan["expected_server_info"]
    assert expected["dp_size"] == 8
    for field in ("dp_size", "tp_size", "disable_radix_cache", "chunked_prefill_size",
                  "enable_return_aux_hidden_states"):
        if field in expected:  # what the role verifies on the live server is what SGLang resolved
            assert getattr(args, field) == expected[field], field
    if purpose == "capture":
        assert args.disable_radix_cache is True and args.chunked_prefill_size == -1 and args.forward_hooks
    one = server_plan("sglang", "py", str(llama_dir), "127.0.0.1", 30100, str(tmp_path / "cap"),
                      aux_layers=[1, 3, 5], purpose=purpose)
    assert "--dp-size" not in one["argv"] and _parse(one["argv"][3:]).dp_size == 1
