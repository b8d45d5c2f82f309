"""The evaluation's SGLang launch command (serving the trained drafter) through SGLang 0.5.23's own parser.

Run under .venv-sglang (see conftest.py). ``prepare_server_args`` parses and resolves the argv as
``sglang.launch_server`` would; resolution reads the target's config.json (a llama here).
"""

from __future__ import annotations

import json

import pytest

from eagle3_pipeline.serve import sglang_command as sc


@pytest.fixture
def dirs(tmp_path):
    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
        "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 4, "vocab_size": 128,
        "rms_norm_eps": 1e-5, "max_position_embeddings": 256}))
    drafter = tmp_path / "drafter"
    drafter.mkdir()
    (drafter / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": 64,
        "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 1,
        "vocab_size": 128, "draft_vocab_size": 64, "target_hidden_size": 64,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 1, 2], "use_aux_hidden_state": True}}))
    return target, drafter


def _parse(argv):
    from sglang.srt.server_args import prepare_server_args

    return prepare_server_args(list(argv))


@pytest.mark.parametrize("steps", [1, 3, 5])
def test_sglang_parses_the_speculative_launch_as_an_eagle3_chain(dirs, steps):
    target, drafter = dirs
    argv = sc.speculative_launch_argv("/opt/sglang/bin/python", str(target), str(drafter), 30100, num_steps=steps)
    assert argv[1:3] == ["-m", "sglang.launch_server"]
    args = _parse(argv[3:])
    assert args.model_path == str(target)
    assert args.host == "127.0.0.1" and args.port == 30100 and args.tp_size == 1
    assert args.speculative_algorithm == "EAGLE3"
    assert args.speculative_draft_model_path == str(drafter)
    assert args.speculative_num_steps == steps
    assert args.speculative_eagle_topk == 1
    assert args.speculative_num_draft_tokens == steps + 1
    assert args.enable_return_aux_hidden_states is False and not args.forward_hooks


def test_the_default_chain_is_sglangs_own_default_for_topk_one():
    from sglang.srt.arg_groups import speculative_hook

    source = speculative_hook._auto_choose_speculative_params.__code__.co_consts
    assert (3, 1, 4) in source  # SGLang's default (steps, topk, draft tokens) for most architectures
    assert sc.DEFAULT_SPECULATIVE_STEPS == 3


def test_extras_that_would_change_the_speculative_setup_are_refused_yet_sglang_accepts_them(dirs):
    target, drafter = dirs
    for extra, field, value in [(["--speculative-eagle-topk", "4"], "speculative_eagle_topk", 4),
                                (["--speculative-num-steps", "7"], "speculative_num_steps", 7),
                                (["--port", "31000"], "port", 31000)]:
        with pytest.raises(ValueError):
            sc.speculative_launch_argv("python", str(target), str(drafter), 30100, extra_args=extra)
        import argparse

        from sglang.srt.server_args import ServerArgs

        parser = argparse.ArgumentParser()
        ServerArgs.add_cli_args(parser)
        assert getattr(parser.parse_args(["--model-path", str(target), *extra]), field) == value


def test_meta_info_fields_the_client_reads_are_sglangs():
    """Read as text: importing tokenizer_manager needs fastapi, a server dependency not installed here."""
    import importlib.util
    from pathlib import Path

    managers = Path(importlib.util.find_spec("sglang.srt.managers").submodule_search_locations[0])
    text = (managers / "tokenizer_manager.py").read_text()
    source = text[text.index("def _calculate_spec_decoding_metrics"):]
    source = source[: source.index("\n    def ", 10)]
    for name in ("spec_verify_ct", "spec_num_correct_drafts", "spec_correct_drafts_histogram", "spec_accept_length"):
        assert f'meta_info["{name}"]' in source, name
    assert "recv_obj.completion_tokens[i] / recv_obj.spec_verify_ct[i]" in source
