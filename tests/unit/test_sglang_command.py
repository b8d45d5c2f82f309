"""Unit tests of the SGLang launch command (no sglang needed; tests/sglang checks it against SGLang)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from eagle3_pipeline.serve import sglang_command as sc


def _argv(**kwargs):
    args = dict(model_type="llama", num_hidden_layers=32)
    args.update(kwargs)
    return sc.launch_argv(
        "/venv/bin/python", "/models/llama", "127.0.0.1", 30000, 2, [1, 15, 28], "/dev/shm/cap", **args
    )


def _value(argv, flag):
    return argv[argv.index(flag) + 1]


def test_launch_argv_sets_every_capture_flag():
    argv = _argv()
    assert argv[:3] == ["/venv/bin/python", "-m", "sglang.launch_server"]
    for flag in ("--disable-radix-cache", "--disable-custom-all-reduce", "--enable-return-aux-hidden-states"):
        assert flag in argv
    assert _value(argv, "--chunked-prefill-size") == "-1"
    assert _value(argv, "--cuda-graph-backend-prefill") == "disabled"
    assert _value(argv, "--cuda-graph-backend-decode") == "disabled"
    assert "--disable-cuda-graph" not in argv  # deprecated in 0.5.23
    assert _value(argv, "--speculative-algorithm") == "EAGLE3"
    assert _value(argv, "--tp-size") == "2"
    i = argv.index("--return-aux-hidden-state-layer-ids")
    assert argv[i + 1 : i + 4] == ["1", "15", "28"]
    (spec,) = json.loads(_value(argv, "--forward-hooks"))
    assert spec["hook_factory"] == "eagle3_pipeline.capture.sglang_hook:make_capture_hook"
    assert "logits_processor" in spec["target_modules"]
    assert spec["config"]["capture_dir"] == "/dev/shm/cap"
    assert spec["config"]["aux_layer_ids"] == [1, 15, 28]


def test_launch_argv_appends_extras_after_checking_them():
    argv = _argv(extra_args=["--mem-fraction-static", "0.8"])
    assert argv[-2:] == ["--mem-fraction-static", "0.8"]


def test_api_key_goes_in_a_yaml_config_never_in_argv():
    argv = _argv(api_key_config="/run/eagle3/sglang.yaml")
    assert _value(argv, "--config") == "/run/eagle3/sglang.yaml"
    assert "--api-key" not in argv
    assert sc.api_key_config_text('k"ey') == 'api-key: "k\\"ey"\n'
    with pytest.raises(ValueError, match="yaml"):
        _argv(api_key_config="/run/eagle3/sglang.conf")
    with pytest.raises(ValueError):
        sc.api_key_config_text("two\nlines")


@pytest.mark.parametrize(
    "extra",
    [
        ["--enable-mixed-chunk"],
        ["--chunked-prefill-size", "4096"],
        ["--chunked-prefill-size=-1"],
        ["--enable-hierarchical-cache"],
        ["--hicache-ratio", "2"],
        ["--cuda-graph-config", "{}"],
        ["--cuda-graph-max-bs-prefill", "8"],
        ["--speculative-num-steps", "3"],
        ["--return-aux-hidden-state-layer-ids", "2"],
        ["--forward-hooks", "[]"],
        ["--enable-dp-attention"],
        ["--attn-dp-size", "2"],
        ["--pp-size", "2"],
        ["--api-key", "secret"],
        ["--config", "x.yaml"],
        ["--disable-radix-cache"],
        ["--model", "/other"],
        ["--enable-mixed"],  # argparse would expand it
    ],
)
def test_check_extra_args_refuses_what_undoes_capture(extra):
    with pytest.raises(ValueError, match="sglang_server_extra_args|spell flags in full") as info:
        sc.check_extra_args(extra)
    assert extra[0].split("=")[0] in str(info.value)


def test_check_extra_args_accepts_harmless_flags_and_refuses_shell_strings():
    sc.check_extra_args(["--mem-fraction-static", "0.85", "--trust-remote-code", "--context-length=8192"])
    sc.check_extra_args(["--served-model-name", "-1"])  # a negative value is not a short flag
    with pytest.raises(ValueError, match="list of argv tokens"):
        sc.check_extra_args("--enable-mixed-chunk")
    with pytest.raises(ValueError, match="long flags"):
        sc.check_extra_args(["-x"])
    with pytest.raises(ValueError, match="not a string"):
        sc.check_extra_args([8192])


def test_sglang_layer_ids_per_model_class():
    assert sc.sglang_layer_ids([1, 30, 57], "llama", 61) == [1, 30, 57]
    assert sc.sglang_layer_ids([1, 30, 57], "deepseek_v3", 61) == [2, 31, 58]
    assert sc.sglang_layer_ids([1, 30, 57], "kimi_k25", 61) == [2, 31, 58]
    with pytest.raises(ValueError, match="layer 0"):
        sc.sglang_layer_ids([0, 30], "deepseek_v3")
    with pytest.raises(ValueError, match=r"use 0\.\.59"):
        sc.sglang_layer_ids([1, 60], "llama", 61)
    with pytest.raises(ValueError, match="ascending"):
        sc.sglang_layer_ids([30, 1], "llama")
    with pytest.raises(ValueError, match="no SGLang"):
        sc.sglang_layer_ids([1], "qwen3")


def test_expected_server_info_matches_the_command():
    info = sc.expected_server_info("/models/k", 30000, 8, [1, 30, 57], "/dev/shm/cap", "kimi_k25", 61)
    assert info["return_aux_hidden_state_layer_ids"] == [2, 31, 58]
    assert info["speculative_algorithm"] is None and info["aux_hidden_state_capture"] == "eagle3"
    assert info["chunked_prefill_size"] == -1 and info["disable_radix_cache"] is True
    assert info["forward_hooks"][0]["config"]["sglang_layer_ids"] == [2, 31, 58]


def test_plan_command_prints_sglang_argv_and_exits_2_on_refused_extra(tmp_path):
    # The role reaches the launch command through python -m eagle3_pipeline.serve.plan.
    (tmp_path / "config.json").write_text(
        json.dumps({"model_type": "deepseek_v3", "num_hidden_layers": 61, "hidden_size": 7168})
    )
    base = [sys.executable, "-m", "eagle3_pipeline.serve.plan", "--json", "--engine", "sglang", "--python",
            "/p/python", "--model-path", str(tmp_path), "--port", "30000", "--tp-size", "8", "--aux-layers",
            "1,30,57", "--capture-dir", "/dev/shm/cap"]  # fmt: skip
    done = subprocess.run(base, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    argv = json.loads(done.stdout)["argv"]
    i = argv.index("--return-aux-hidden-state-layer-ids")
    assert argv[i + 1 : i + 4] == ["2", "31", "58"]
    refused = subprocess.run(base + ['--extra-args-json=["--enable-mixed-chunk"]'], capture_output=True, text=True,
                             check=False)  # fmt: skip
    assert refused.returncode == 2
    assert "--enable-mixed-chunk" in refused.stderr and refused.stdout == ""
