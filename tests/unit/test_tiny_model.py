"""The embedded tiny target model: loads with transformers, speaks its chat template, predicts
far better than chance, is cached, deterministic, and never looks built after a crash.

The full model is built once per session (the slow part, about 1.5 min on 2 cores); the
determinism and crash tests use a miniature recipe that runs the same code in seconds.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tiny_target import built_tiny_model

from eagle3_pipeline.data.demo_dataset import demo_conversations, sharegpt_to_messages
from eagle3_pipeline.data.stdlib_corpus import extract_entries
from eagle3_pipeline.models import tiny
from eagle3_pipeline.models.tiny import (
    ASSISTANT_TOKEN,
    END_TOKEN,
    STAMP_NAME,
    TinyRecipe,
    assistant_token_spans,
    build_tiny_model,
    entry_text,
    is_built,
    is_evaluation_entry,
    read_stamp,
)

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

# Same code paths as the real recipe, a few seconds of work (the corpus and tokenizer dominate).
MINI = TinyRecipe(
    vocab_size=512,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=64,
    seq_len=32,
    batch_size=2,
    steps=3,
    warmup_steps=1,
    eval_tokens=64,
)


@pytest.fixture(scope="session")
def tiny_model_dir():
    """The real tiny model, in the checkout's cache shared with Molecule and the demo: built
    at most once per checkout (its recipe hash decides), then reused."""
    return built_tiny_model()


@pytest.fixture(scope="session")
def loaded(tiny_model_dir):
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir, local_files_only=True)
    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_model_dir, local_files_only=True)
    return model.eval(), tokenizer


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_loads_as_a_gqa_llama_with_its_own_lm_head(tiny_model_dir, loaded):
    from safetensors import safe_open

    model, tokenizer = loaded
    config = json.loads((tiny_model_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["num_key_value_heads"] < config["num_attention_heads"]
    assert config["tie_word_embeddings"] is False
    assert config["max_position_embeddings"] == 2048
    assert model.config.vocab_size == len(tokenizer) == 4096
    with safe_open(tiny_model_dir / "model.safetensors", "pt") as weights:
        keys = set(weights.keys())
        assert {"lm_head.weight", "model.embed_tokens.weight"} <= keys
        assert not torch.equal(weights.get_tensor("lm_head.weight"), weights.get_tensor("model.embed_tokens.weight"))
    generation = json.loads((tiny_model_dir / "generation_config.json").read_text())
    assert generation["eos_token_id"] == tokenizer.convert_tokens_to_ids(END_TOKEN) == tokenizer.eos_token_id
    assert tokenizer.bos_token == "<s>" and tokenizer.pad_token == "<pad>"
    tokenizer_config = json.loads((tiny_model_dir / "tokenizer_config.json").read_text())
    assert "add_generation_prompt" in tokenizer_config["chat_template"]


def test_chat_template_marks_the_assistant_tokens(loaded):
    _, tokenizer = loaded
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What does json.dumps do?"},
        {"role": "assistant", "content": "Serialize obj to a JSON formatted str."},
        {"role": "user", "content": "Tell me more about json.dumps."},
        {"role": "assistant", "content": "If skipkeys is true, keys that are not basic types are skipped."},
    ]
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    assert text.startswith("<s><|system|>\nBe brief.<|end|>\n<|user|>\n")
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert ids == tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"]
    assistant_id, end_id = tokenizer.convert_tokens_to_ids([ASSISTANT_TOKEN, END_TOKEN])
    spans = assistant_token_spans(ids, assistant_id, end_id)
    decoded = [tokenizer.decode(ids[start:stop]) for start, stop in spans]
    assert decoded == [messages[2]["content"] + END_TOKEN, messages[4]["content"] + END_TOKEN]

    prompt = tokenizer.apply_chat_template(messages[:2], tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|user|>\nWhat does json.dumps do?<|end|>\n<|assistant|>\n")
    with pytest.raises(Exception, match="unknown role tool"):
        tokenizer.apply_chat_template([{"role": "tool", "content": "x"}], tokenize=False)


def test_predicts_held_out_stdlib_text_far_better_than_chance(tiny_model_dir, loaded):
    model, tokenizer = loaded
    held_out = [entry for entry in extract_entries() if is_evaluation_entry(entry)]
    assert len(held_out) > 100
    ids = [token for entry in held_out for token in tokenizer("<s>" + entry_text(entry))["input_ids"]]
    rows = torch.tensor(ids[: 32 * 256]).view(32, 256)
    with torch.no_grad():
        logits = model(input_ids=rows).logits[:, :-1]
    targets = rows[:, 1:]
    accuracy = (logits.argmax(-1) == targets).float().mean().item()
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten()).item()
    most_frequent_share = torch.bincount(targets.flatten()).max().item() / targets.numel()
    print(f"held-out top-1 {accuracy:.3f}, loss {loss:.3f} (uniform {math.log(4096):.3f})")
    # Chance is 1/4096; measured about 0.17 (the most frequent token alone gives about 0.08).
    assert accuracy > 0.12
    assert accuracy > 1.5 * most_frequent_share
    assert loss < math.log(4096) - 2.0
    metrics = read_stamp(tiny_model_dir)["metrics"]
    assert metrics["held_out_top1_accuracy"] > 0.12
    assert metrics["final_train_loss"] < metrics["uniform_loss"] - 2.5


def test_has_learned_the_chat_template(loaded):
    model, tokenizer = loaded
    _, held_out = demo_conversations(40, 0.5, seed=7)
    assistant_id = tokenizer.convert_tokens_to_ids(ASSISTANT_TOKEN)
    hits = 0
    for record in held_out:
        user_turns = [m for m in sharegpt_to_messages(record) if m["role"] != "assistant"][:2]
        text = tokenizer.apply_chat_template(user_turns, tokenize=False)  # ends with "<|end|>\n"
        ids = torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]])
        with torch.no_grad():
            hits += int(model(input_ids=ids).logits[0, -1].argmax().item() == assistant_id)
    assert hits >= 0.9 * len(held_out), f"{hits}/{len(held_out)} user turns followed by {ASSISTANT_TOKEN}"


def test_second_build_returns_the_cached_directory_untouched(tiny_model_dir, capsys):
    weights = tiny_model_dir / "model.safetensors"
    before = (weights.stat().st_mtime_ns, (tiny_model_dir / STAMP_NAME).read_bytes())
    started = time.monotonic()
    assert build_tiny_model(tiny_model_dir) == tiny_model_dir
    # Hashing the corpus and the files, not training again: less than the build took on this machine.
    assert time.monotonic() - started < read_stamp(tiny_model_dir)["metrics"]["build_seconds"]
    assert (weights.stat().st_mtime_ns, (tiny_model_dir / STAMP_NAME).read_bytes()) == before
    parser = argparse.ArgumentParser()
    tiny.configure_parser(parser)
    assert tiny.run(parser.parse_args(["--output", str(tiny_model_dir)])) == 0
    assert capsys.readouterr().out.strip() == str(tiny_model_dir)
    assert weights.stat().st_mtime_ns == before[0]


def test_forced_rebuild_gives_identical_bytes_readable_by_all_like_any_new_directory(tmp_path):
    out = build_tiny_model(tmp_path / "mini", recipe=MINI)
    umask = os.umask(0)
    os.umask(umask)
    assert out.stat().st_mode & 0o777 == 0o777 & ~umask  # not mkdtemp's 0700
    assert {path.stat().st_mode & 0o777 for path in out.iterdir()} == {0o666 & ~umask}
    first = {name: sha256(out / name) for name in tiny.MODEL_FILES}
    stamp = read_stamp(out)
    assert {name: record["sha256"] for name, record in stamp["files"].items()} == first
    weights_mtime = (out / "model.safetensors").stat().st_mtime_ns
    build_tiny_model(out, recipe=MINI, force=True)
    assert (out / "model.safetensors").stat().st_mtime_ns != weights_mtime  # really rebuilt
    assert {name: sha256(out / name) for name in tiny.MODEL_FILES} == first


def test_a_changed_recipe_or_a_damaged_file_is_not_built(tmp_path):
    out = build_tiny_model(tmp_path / "mini", recipe=MINI)
    recipe_hash = read_stamp(out)["recipe_sha256"]
    assert is_built(out, recipe_hash)
    assert not is_built(out, "0" * 64)
    with (out / "model.safetensors").open("ab") as handle:
        handle.write(b"\0")
    assert not is_built(out, recipe_hash)
    # A stale build is replaced, not reused.
    other = build_tiny_model(out, recipe=TinyRecipe(**{**MINI.__dict__, "seed": 1}))
    assert read_stamp(other)["recipe_sha256"] != recipe_hash
    assert is_built(other, read_stamp(other)["recipe_sha256"])


def test_the_seed_comes_from_the_environment_and_gives_other_weights_over_the_same_tokenizer(
    tmp_path, monkeypatch, capsys,
):
    monkeypatch.delenv(tiny.SEED_ENV, raising=False)
    assert tiny.default_recipe() == TinyRecipe() and tiny.cache_name(0) == "tiny-llama"
    monkeypatch.setenv(tiny.SEED_ENV, "7")
    assert tiny.default_recipe() == TinyRecipe(seed=7) and tiny.cache_name(7) == "tiny-llama-seed-7"
    parser = argparse.ArgumentParser()
    tiny.configure_parser(parser)
    for bad in ("-1", "seven", "1.5"):
        monkeypatch.setenv(tiny.SEED_ENV, bad)
        with pytest.raises(ValueError, match=f"{tiny.SEED_ENV}='{re.escape(bad)}'"):
            tiny.default_recipe()
        assert tiny.run(parser.parse_args(["--output", str(tmp_path / "none")])) == 2
        assert "must be an integer >= 0" in capsys.readouterr().err
    assert not (tmp_path / "none").exists()
    # The seed is part of the recipe: another seed trains other weights, over the same tokenizer (the
    # vocabulary and the chat template the tests and the data rely on).
    one = build_tiny_model(tmp_path / "one", recipe=MINI)
    other = build_tiny_model(tmp_path / "other", recipe=TinyRecipe(**{**MINI.__dict__, "seed": 1}))
    assert sha256(one / "tokenizer.json") == sha256(other / "tokenizer.json")
    assert sha256(one / "model.safetensors") != sha256(other / "model.safetensors")
    assert read_stamp(one)["recipe_sha256"] != read_stamp(other)["recipe_sha256"]


def test_a_build_under_other_library_versions_is_taken_only_when_asked(tmp_path):
    out = build_tiny_model(tmp_path / "mini", recipe=MINI)
    # The same recipe and corpus, as if built under another transformers release (its own stamp and hash).
    stamp = read_stamp(out)
    fingerprint = {key: value for key, value in stamp.items() if key not in ("recipe_sha256", "files", "metrics")}
    fingerprint["versions"] = {**fingerprint["versions"], "transformers": "5.0.0"}
    other_hash = tiny._hash(fingerprint)
    (out / STAMP_NAME).write_text(json.dumps({**stamp, **fingerprint, "recipe_sha256": other_hash}))
    weights = out / "model.safetensors"
    mtime = weights.stat().st_mtime_ns

    assert build_tiny_model(out, recipe=MINI, any_versions=True) == out
    assert weights.stat().st_mtime_ns == mtime and read_stamp(out)["recipe_sha256"] == other_hash  # taken as it is
    # Another recipe is not taken, whatever the versions.
    with_seed = tiny.recipe_fingerprint(TinyRecipe(**{**MINI.__dict__, "seed": 1}), stamp["corpus_sha256"])
    assert not is_built(out, "", fingerprint=with_seed)
    # Without any_versions it does not count as built (build_tiny_model would replace it: the hash decides, as
    # test_a_changed_recipe_or_a_damaged_file_is_not_built shows).
    assert not is_built(out, stamp["recipe_sha256"])
    assert is_built(out, other_hash)


def test_an_interrupted_build_leaves_nothing_that_counts_as_built(tmp_path, monkeypatch):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(tiny, "_train", interrupted)
    with pytest.raises(KeyboardInterrupt):
        build_tiny_model(tmp_path / "mini", recipe=MINI)
    assert os.listdir(tmp_path) == []  # neither the output nor the temporary build directory

    monkeypatch.undo()
    out = build_tiny_model(tmp_path / "mini", recipe=MINI)
    stamp = (out / STAMP_NAME).read_bytes()
    monkeypatch.setattr(tiny, "_train", interrupted)
    with pytest.raises(KeyboardInterrupt):
        build_tiny_model(out, recipe=MINI, force=True)
    assert (out / STAMP_NAME).read_bytes() == stamp  # the previous build is still whole
    assert is_built(out, read_stamp(out)["recipe_sha256"])
    assert sorted(os.listdir(tmp_path)) == ["mini"]


def test_a_killed_build_process_leaves_no_output_and_its_debris_is_cleared(tmp_path):
    out = tmp_path / "mini"
    script = (
        "import sys\n"
        "from eagle3_pipeline.models.tiny import TinyRecipe, build_tiny_model\n"
        f"build_tiny_model(sys.argv[1], recipe=TinyRecipe(**{dict(MINI.__dict__, steps=100000)!r}))\n"
    )
    process = subprocess.Popen(
        [sys.executable, "-c", script, str(out)], stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        for line in process.stderr:
            if "; training" in line:  # mid-build: tokenizer written, weights not yet
                break
        os.killpg(process.pid, signal.SIGKILL)
    finally:
        process.wait(timeout=60)
    leftovers = [path.name for path in tmp_path.iterdir()]
    assert not out.exists()
    assert len(leftovers) == 1 and leftovers[0].startswith(".mini.building-")
    build_tiny_model(out, recipe=MINI)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["mini"]


def test_an_unrelated_directory_is_refused(tmp_path):
    (tmp_path / "precious").mkdir()
    (tmp_path / "precious" / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="not a tiny-model build"):
        build_tiny_model(tmp_path / "precious", recipe=MINI)
    assert (tmp_path / "precious" / "notes.txt").read_text() == "keep me"


def test_builds_on_one_machine_take_turns(tmp_path):
    out = tmp_path / "mini"
    script = (
        "import sys\n"
        "from eagle3_pipeline.models.tiny import TinyRecipe, build_tiny_model\n"
        f"build_tiny_model(sys.argv[1], recipe=TinyRecipe(**{MINI.__dict__!r}))\n"
    )
    with tiny._build_lock():  # as another build would
        process = subprocess.Popen([sys.executable, "-c", script, str(out)], stderr=subprocess.PIPE, text=True)
        line = ""
        while "[tiny-model]" not in line:  # past any import-time warnings
            line = process.stderr.readline()
            assert line, "the build process ended without a word"
        assert "waiting for another tiny-model build" in line
        time.sleep(0.5)
        assert process.poll() is None and not out.exists()
    rest = process.communicate(timeout=300)[1]
    assert process.returncode == 0, rest
    assert is_built(out, read_stamp(out)["recipe_sha256"])
