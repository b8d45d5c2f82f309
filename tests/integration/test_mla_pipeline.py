"""A DeepSeek-V3-shaped target (Kimi-K2.x's layout, tiny and random) through the pipeline's commands.

The target is built here: transformers' DeepseekV3ForCausalLM with multi-latent attention and YaRN, the
embedded tiny model's tokenizer and chat template, a sharpened head (its greedy answers are something a
drafter can learn). Then, as an operator's run does it: ``serve-reference`` serves it and captures aux
layers 1, 2, 3 (SGLang's DeepSeek models cannot capture layer 0), ``regenerate`` has it answer the demo
conversations itself, ``extract`` stores their hidden states, ``train`` picks the MLA drafter from the
target's config on its own and exports SGLang's ``Eagle3DeepseekV2ForCausalLM`` (aux ids +1, the
target's MLA sizes), and ``evaluate`` measures that drafter by speculative decoding on held-out prompts:
every output must be the target's own greedy decode, drafts must be accepted, and the evaluation's
verdict (served acceptance against the training's prediction) must pass.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from tiny_target import built_tiny_model

CLI = [sys.executable, "-m", "eagle3_pipeline.cli"]
AUX_LAYERS = [1, 2, 3]
NUM_SAMPLES = 48
# The MLA sizes of a DeepSeek-V3 config at a tiny scale: q and kv low-rank projections, RoPE on a slice of
# each head, a YaRN-scaled RoPE, every layer dense (no routed experts).
MLA = {"q_lora_rank": 32, "kv_lora_rank": 16, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16,
       "num_attention_heads": 4, "num_key_value_heads": 4, "first_k_dense_replace": 5, "n_routed_experts": 4,
       "num_experts_per_tok": 2, "n_group": 1, "topk_group": 1, "moe_intermediate_size": 32,
       "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256,
                        "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}}  # fmt: skip
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "generation_config.json")  # fmt: skip


def run_cli(argv: list[str], timeout: float = 600) -> subprocess.CompletedProcess:
    done = subprocess.run([*CLI, *argv], capture_output=True, text=True, timeout=timeout, check=False)
    assert done.returncode == 0, f"{argv[0]} exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done


@pytest.fixture(scope="module")
def mla_target(tmp_path_factory) -> Path:
    """A 5-layer DeepSeek-V3 target with the tiny model's tokenizer, saved as a model directory."""
    import transformers  # noqa: PLC0415

    tiny = built_tiny_model()
    tiny_config = json.loads((tiny / "config.json").read_text())
    out = tmp_path_factory.mktemp("mla-target")
    torch.manual_seed(0)
    config = transformers.DeepseekV3Config(
        vocab_size=tiny_config["vocab_size"], hidden_size=64, intermediate_size=128, num_hidden_layers=5,
        max_position_embeddings=1024, tie_word_embeddings=False, bos_token_id=tiny_config.get("bos_token_id"),
        eos_token_id=tiny_config.get("eos_token_id"), **MLA)  # fmt: skip
    model = transformers.DeepseekV3ForCausalLM(config).eval()
    with torch.no_grad():  # a random head is near uniform: sharpen it so that greedy answers follow the states
        model.lm_head.weight.mul_(40.0)
    model.save_pretrained(out, safe_serialization=True)
    for name in TOKENIZER_FILES:
        if (tiny / name).exists():
            shutil.copy2(tiny / name, out / name)
    return out


@pytest.fixture(scope="module")
def extracted(mla_target, tmp_path_factory) -> Path:
    """The demo conversations' hidden states at aux layers 1, 2, 3 of the MLA target, served over HTTP."""
    work = tmp_path_factory.mktemp("mla-extraction")
    log = work / "server.log"
    server = subprocess.Popen(
        [*CLI, "serve-reference", "--model-path", str(mla_target), "--host", "127.0.0.1", "--port", "0",
         "--capture-dir", str(work / "capture"), "--aux-layers", ",".join(map(str, AUX_LAYERS)), "--device", "cpu",
         "--log-file", str(log)],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=(work / "server.stderr").open("wb"),
        start_new_session=True)  # fmt: skip
    try:
        url = wait_serving(server, log, work / "server.stderr")
        run_cli(["demo-dataset", "--output", str(work / "train.jsonl")])
        # The answers the drafter learns are the target's own (a random target answers nothing like the demo's).
        run_cli(["regenerate", "--dataset", str(work / "train.jsonl"), "--output-dir", str(work / "regenerated"),
                 "--server-url", url, "--num-samples", str(NUM_SAMPLES), "--max-new-tokens", "64",
                 "--quiet"])  # fmt: skip
        run_cli(["extract", "--dataset", str(work / "regenerated" / "regenerated.jsonl"), "--output-dir",
                 str(work / "data"), "--server-url", url, "--quiet"])  # fmt: skip
    finally:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait(timeout=30)
    return work


def wait_serving(server: subprocess.Popen, log: Path, stderr: Path, timeout_s: float = 180.0) -> str:
    deadline = time.monotonic() + timeout_s
    while True:
        text = log.read_text() if log.exists() else ""
        match = re.search(r"serving (http://[\d.]+:\d+)", text)
        if match:
            return match.group(1)
        assert server.poll() is None, f"serve-reference exited {server.returncode}: {text}\n{stderr.read_text()}"
        assert time.monotonic() < deadline, f"serve-reference not serving after {timeout_s} s: {text}"
        time.sleep(0.1)


def test_an_mla_target_gets_an_mla_drafter_that_sglang_loads_and_that_drafts_its_outputs(
    mla_target, extracted, tmp_path
):
    data = extracted / "data"
    settings = json.loads((data / "data_config.json").read_text())
    assert settings["aux_layers"] == AUX_LAYERS and settings["num_hidden_layers"] == 5
    assert settings["num_samples"] == NUM_SAMPLES

    # Trained with no layout named: the target's MLA config picks the MLA drafter.
    run = tmp_path / "run"
    run_cli(["train", "--data-dir", str(data), "--output-dir", str(run), "--device", "cpu",
             "--draft-vocab-size", "4096", "--ttt-length", "3", "--batch-tokens", "512", "--epochs", "100",
             "--max-steps", "300", "--lr", "3e-3", "--eval-ratio", "0.2", "--no-tensorboard",
             "--no-charts"])  # fmt: skip
    config = json.loads((run / "drafter" / "config.json").read_text())
    assert config["architectures"] == ["Eagle3DeepseekV2ForCausalLM"]
    target = json.loads((mla_target / "config.json").read_text())
    for key in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
        assert config[key] == target[key], key
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [layer + 1 for layer in AUX_LAYERS]
    training = json.loads((run / "training.json").read_text())
    assert training["steps"] == 300 and training["config"]["layout"] == "auto"

    # Measured by speculative decoding: the drafter proposes, the target verifies; the outputs are the target's.
    # The evaluation's own verdict is on: a drafter served far below what its training predicts (a weight
    # exported to the wrong place, another RoPE) fails the command.
    out = tmp_path / "evaluation"
    run_cli(["evaluate", "--drafter-dir", str(run / "drafter"), "--prompts", str(extracted / "train.heldout.jsonl"),
             "--output-dir", str(out), "--num-prompts", "4", "--max-new-tokens", "24", "--ignore-eos",
             "--draft-tokens", "3,7", "--device", "cpu"])  # fmt: skip
    result = json.loads((out / "evaluation.json").read_text())
    assert result["outputs_match_target"] is True and result["prompts"] == 4
    assert result["reference_check"]["checked"] and result["reference_check"]["faults"] == 0
    assert [r["draft_tokens"] for r in result["runs"]] == [3, 7]
    for measured in result["runs"]:
        assert measured["requests"] == 4 and measured["tokens_generated"] == 4 * 24
        assert measured["tau"] == pytest.approx(measured["tokens_from_verify"] / measured["target_forwards"])
        assert 1.0 < measured["tau"] <= measured["draft_tokens"] + 1  # drafts were accepted
    assert result["verdict"]["passed"] is True
