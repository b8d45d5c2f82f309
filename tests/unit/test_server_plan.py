"""The server plan the sglang_server role acts on: argv, expected live settings, refusals."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from eagle3_pipeline.capture.layers import check_aux_layers
from eagle3_pipeline.serve.plan import PlanError, server_plan, write_secret


@pytest.fixture
def model_dir(tmp_path):
    path = tmp_path / "model"
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 8, "hidden_size": 64}))
    return path


def test_explicit_aux_layers_are_checked_against_the_model():
    assert check_aux_layers([0, 3, 6], 8) == [0, 3, 6]
    with pytest.raises(ValueError, match=r"use 0\.\.6"):
        check_aux_layers([1, 7], 8)
    with pytest.raises(ValueError, match="empty"):
        check_aux_layers([], 8)


def test_reference_plan_has_the_capture_settings_and_probe(model_dir, tmp_path):
    plan = server_plan("reference", "/venv/bin/python", str(model_dir), "127.0.0.1", 30080, str(tmp_path / "cap"))
    assert plan["aux_layers"] == [1, 3, 4]  # [1, L/2 - 1, L - 4] for L = 8
    assert plan["hidden_size"] == 64 and plan["num_aux"] == 3
    argv = plan["argv"]
    assert argv[:4] == ["/venv/bin/python", "-m", "eagle3_pipeline.cli", "serve-reference"]
    assert argv[argv.index("--aux-layers") + 1] == "1,3,4"
    assert argv[argv.index("--host") + 1] == "127.0.0.1"
    assert argv[argv.index("--decode") + 1] == "transformers"  # captures only: no slot cache to allocate
    assert plan["expected_server_info"]["disable_radix_cache"] is True
    assert plan["expected_server_info"]["chunked_prefill_size"] == -1
    assert "--api-key-env" not in argv and plan["secret_format"] is None
    with_key = server_plan("reference", "py", str(model_dir), "127.0.0.1", 30080, "c", api_key_file="/s/k.env")
    assert with_key["argv"][with_key["argv"].index("--api-key-env") + 1] == "EAGLE3_API_KEY"
    assert with_key["secret_format"] == "env"
    assert "--dp-size" not in argv and plan["expected_server_info"]["dp_size"] == 1
    for purpose in ("capture", "serve"):  # replicas over the GPUs, checked live as dp_size
        replicas = server_plan("reference", "py", str(model_dir), "127.0.0.1", 30080, "c", purpose=purpose, dp_size=4)
        assert replicas["argv"][replicas["argv"].index("--dp-size") + 1] == "4"
        assert replicas["expected_server_info"]["dp_size"] == 4


def test_a_serving_reference_servers_slots_are_sized_to_the_longest_request(model_dir):
    """The regeneration's requests hold at most its max length + max new tokens: the slots take that many tokens (not
    the engine's 4,096), so the same memory holds more of them; an operator's own --slot-tokens, given after, wins; a
    capture server has no slots, and SGLang no such flag."""
    import argparse  # noqa: PLC0415

    from eagle3_pipeline.engine.reference_server import configure_parser  # noqa: PLC0415

    def served(argv):
        parser = argparse.ArgumentParser()
        configure_parser(parser)
        return parser.parse_args(argv[argv.index("serve-reference") + 1:])

    plan = server_plan("reference", "py", str(model_dir), "127.0.0.1", 30100, "", purpose="serve", request_tokens=2560)
    assert served(plan["argv"]).slot_tokens == 2560
    own = server_plan("reference", "py", str(model_dir), "127.0.0.1", 30100, "", purpose="serve", request_tokens=2560,
                      extra_args=["--slot-tokens", "8192"])
    assert served(own["argv"]).slot_tokens == 8192
    assert served(server_plan("reference", "py", str(model_dir), "127.0.0.1", 30100, "", purpose="serve")["argv"]
                  ).slot_tokens == 4096  # not known: the engine's default
    assert "--slot-tokens" not in server_plan("reference", "py", str(model_dir), "127.0.0.1", 30080, "c",
                                              request_tokens=2560)["argv"]
    assert "--slot-tokens" not in server_plan("sglang", "py", str(model_dir), "127.0.0.1", 30100, "", purpose="serve",
                                              request_tokens=2560)["argv"]
    with pytest.raises(PlanError, match="request tokens: -1"):
        server_plan("reference", "py", str(model_dir), "127.0.0.1", 30100, "", purpose="serve", request_tokens=-1)


def test_sglang_plan_keeps_the_key_out_of_argv_and_refuses_unsafe_extras(model_dir):
    plan = server_plan("sglang", "py", str(model_dir), "127.0.0.1", 30000, "/dev/shm/c", api_key_file="/s/k.yaml")
    assert plan["argv"][1:3] == ["-m", "sglang.launch_server"]
    assert plan["argv"][plan["argv"].index("--config") + 1] == "/s/k.yaml"
    assert plan["secret_format"] == "sglang_config"
    assert plan["expected_server_info"]["disable_radix_cache"] is True
    flag = "--disaggregation-decode-enable-radix-cache"
    with pytest.raises(PlanError, match=f"sglang_server_extra_args: .*{flag}"):
        server_plan("sglang", "py", str(model_dir), "127.0.0.1", 30000, "c", extra_args=[flag])


def test_secret_file_is_private_and_idempotent(tmp_path):
    path = tmp_path / "s" / "key.env"
    assert write_secret(str(path), "env", "k1") is True
    assert path.read_text() == "EAGLE3_API_KEY=k1\n"
    assert path.stat().st_mode & 0o777 == 0o600
    assert write_secret(str(path), "env", "k1") is False
    assert write_secret(str(path), "env", "k2") is True
    done = subprocess.run([sys.executable, "-m", "eagle3_pipeline.serve.plan", "write-secret", "--path",
                           str(tmp_path / "k.yaml"), "--format", "sglang_config"], input="k3\n",
                          capture_output=True, text=True, check=False)
    assert done.returncode == 0 and json.loads(done.stdout)["changed"] is True
    assert (tmp_path / "k.yaml").read_text() == 'api-key: "k3"\n'
    assert "k3" not in done.stdout


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"engine": "vllm"}, "sglang_server_engine"),
        ({"port": 70000}, "sglang_server_port"),
        ({"aux_layers": [2, 9]}, "sglang_server_aux_layers"),
        ({"tp_size": 2}, "sglang_server_tp_size"),
        ({"dp_size": 0}, "sglang_server_dp_size: 0 is not a replica count"),
        ({"extra_args": ["--dp-size", "2"]}, "--dp-size is set by the role itself"),
        ({"engine": "sglang", "dp_size": 0}, "sglang_server_dp_size: 0 is not a replica count"),
        ({"engine": "sglang", "extra_args": ["--dp-size", "2"]},
         r"--dp-size is set by the sglang_server role \(set from sglang_server_dp_size\)"),
        ({"engine": "sglang", "extra_args": ["--data-parallel-size=2"]}, "alias of --dp-size"),
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
    serving = subprocess.run([*base, "--purpose", "serve", "--request-tokens", "1280"], capture_output=True, text=True,
                             check=False)
    argv = json.loads(serving.stdout)["argv"]
    assert argv[argv.index("--slot-tokens") + 1] == "1280"
    bad = subprocess.run([*base, "--aux-layers", "1,99"], capture_output=True, text=True, check=False)
    assert bad.returncode == 2
    assert bad.stderr.startswith("error: sglang_server_aux_layers: aux layer 99")
