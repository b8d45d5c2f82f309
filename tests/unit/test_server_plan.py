"""The server plan the sglang_server role acts on: argv, expected live settings, refusals."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from eagle3_pipeline.capture.layers import check_aux_layers, default_aux_layers
from eagle3_pipeline.serve.plan import PlanError, server_plan


@pytest.fixture
def model_dir(tmp_path):
    path = tmp_path / "model"
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 8, "hidden_size": 64}))
    return path


def test_default_aux_layers_follow_eagle3s_choice():
    assert default_aux_layers(61) == [1, 29, 57]
    assert default_aux_layers(32) == [1, 15, 28]
    assert default_aux_layers(4) == [0, 1]  # [1, 1, 0] clamped and deduplicated
    with pytest.raises(ValueError, match="0 decoder layers"):
        default_aux_layers(0)


def test_explicit_aux_layers_are_checked_against_the_model():
    assert check_aux_layers([0, 3, 7], 8) == [0, 3, 7]
    with pytest.raises(ValueError, match="0 to 7"):
        check_aux_layers([1, 8], 8)
    with pytest.raises(ValueError, match="repeat"):
        check_aux_layers([1, 1], 8)


def test_reference_plan_has_the_capture_settings_and_probe(model_dir, tmp_path):
    plan = server_plan("reference", "/venv/bin/python", str(model_dir), "127.0.0.1", 30080, str(tmp_path / "cap"))
    assert plan["aux_layers"] == [1, 3, 4]
    assert plan["hidden_size"] == 64 and plan["num_aux"] == 3
    argv = plan["argv"]
    assert argv[:4] == ["/venv/bin/python", "-m", "eagle3_pipeline.cli", "serve-reference"]
    assert argv[argv.index("--aux-layers") + 1] == "1,3,4"
    assert argv[argv.index("--host") + 1] == "127.0.0.1"
    assert plan["expected_server_info"]["disable_radix_cache"] is True
    assert plan["expected_server_info"]["chunked_prefill_size"] == -1
    assert "--api-key-env" not in argv and plan["api_key_env"] is None
    with_key = server_plan("reference", "py", str(model_dir), "127.0.0.1", 30080, "c", api_key=True)
    assert with_key["argv"][with_key["argv"].index("--api-key-env") + 1] == with_key["api_key_env"]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"engine": "vllm"}, "sglang_server_engine"),
        ({"port": 70000}, "sglang_server_port"),
        ({"aux_layers": [2, 9]}, "sglang_server_aux_layers"),
        ({"tp_size": 2}, "sglang_server_tp_size"),
        ({"extra_args": ["--aux-layers", "1"]}, "set by the role itself"),
    ],
)
def test_bad_variables_are_refused_naming_them(model_dir, kwargs, message):
    args = {"engine": "reference", "python": "py", "model_path": str(model_dir), "host": "127.0.0.1", "port": 30080,
            "capture_dir": "c", **kwargs}
    with pytest.raises(PlanError, match=message):
        server_plan(**args)


def test_missing_model_says_how_to_get_one(tmp_path):
    with pytest.raises(PlanError, match="sglang_server_build_tiny_model"):
        server_plan("reference", "py", str(tmp_path / "none"), "127.0.0.1", 30080, "c")


def test_command_line_prints_json_or_the_error(model_dir):
    base = [sys.executable, "-m", "eagle3_pipeline.serve.plan", "--json", "--engine", "reference",
            "--model-path", str(model_dir), "--port", "30080", "--capture-dir", "c"]
    done = subprocess.run(base, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["aux_layers"] == [1, 3, 4]
    bad = subprocess.run([*base, "--aux-layers", "1,99"], capture_output=True, text=True, check=False)
    assert bad.returncode == 2
    assert bad.stderr.startswith("error: sglang_server_aux_layers: aux layer 99")
