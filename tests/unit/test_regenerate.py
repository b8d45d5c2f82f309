"""The regeneration's pieces: the turn-by-turn loop, its limits, the part files and the merge, the command's
options, the serving server's plan and the progress line the role prints.

The chat template and tokenizer are the embedded tiny model's (real files). The answering
function here is a scripted one that records every prompt it is sent, so that what the loop
asks for is checked exactly; the real server answers in tests/integration/test_regenerate_run.py.
"""

from __future__ import annotations

import argparse
import json

import pytest
from ansible.module_utils.extraction_progress import PartStage, progress_line
from tiny_target import built_tiny_model

from eagle3_pipeline.conversations.template import load_renderer
from eagle3_pipeline.parts.files import StoreError, claim_settings
from eagle3_pipeline.regenerate import output
from eagle3_pipeline.regenerate.conversation import (
    Answer,
    ConversationSkipped,
    NotAnswered,
    regenerate_conversation,
)
from eagle3_pipeline.regenerate.job import config_from_args, configure_parser
from eagle3_pipeline.serve.plan import SERVE_MAX_BATCH_SIZE, PlanError, server_plan

CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is json?"},
    {"role": "assistant", "content": "An ORIGINAL answer one."},
    {"role": "user", "content": "Tell me more."},
    {"role": "assistant", "content": "An ORIGINAL answer two."},
    {"role": "user", "content": "And then?"},
    {"role": "assistant", "content": "An ORIGINAL answer three."},
]


@pytest.fixture(scope="module")
def renderer():
    return load_renderer(built_tiny_model())


class Scripted:
    """Answers turn k with ``texts[k]`` as the tiny tokenizer's ids, finishing as ``finishes[k]`` says."""

    def __init__(self, renderer, texts, finishes=None):
        self.renderer = renderer
        self.texts = texts
        self.finishes = finishes or ["stop"] * len(texts)
        self.prompts: list[list[int]] = []
        self.budgets: list[int] = []

    def __call__(self, prompt: list[int], budget: int) -> Answer:
        k = len(self.prompts)
        self.prompts.append(prompt)
        self.budgets.append(budget)
        ids = self.renderer.tokenizer(self.texts[k], add_special_tokens=False)["input_ids"]
        return Answer(self.texts[k], ids, self.finishes[k])


def run(renderer, script, **kwargs):
    options = {"max_new_tokens": 64, "max_length": 2048, **kwargs}
    return regenerate_conversation(CONVERSATION, renderer, script, **options)


def test_each_turn_is_asked_after_the_regenerated_history_and_replaced(renderer):
    script = Scripted(renderer, ["first new", "second new", "third new"])
    result = run(renderer, script)
    assert [m["content"] for m in result.messages] == [
        "Be brief.", "What is json?", "first new", "Tell me more.", "second new", "And then?", "third new"]
    assert [m["role"] for m in result.messages] == [m["role"] for m in CONVERSATION]
    history = []
    for k, message in enumerate(result.messages):
        if message["role"] == "assistant":
            n = sum(1 for m in history if m["role"] == "assistant")
            assert script.prompts[n] == renderer.generation_prompt_ids(history)  # the extraction's rendering
            assert "ORIGINAL" not in renderer.tokenizer.decode(script.prompts[n])
        history.append(result.messages[k])
    assert (result.turns, result.finish, result.turns_left_out) == (3, {"stop": 3}, 0)
    assert result.generated_tokens == sum(len(renderer.tokenizer(t, add_special_tokens=False)["input_ids"])
                                          for t in script.texts)
    assert result.prompt_tokens == sum(len(p) for p in script.prompts)


def test_assistant_turns_before_the_first_user_turn_are_left_out_and_the_rest_answered(renderer):
    """ShareGPT splits long conversations: a later part starts with the assistant, answering nothing asked."""
    continued = [{"role": "assistant", "content": "An ORIGINAL answer to a question of an earlier part."},
                 *CONVERSATION[1:3]]
    script = Scripted(renderer, ["first new"])
    result = regenerate_conversation(continued, renderer, script, max_new_tokens=64, max_length=2048)
    assert [(m["role"], m["content"]) for m in result.messages] == [("user", "What is json?"),
                                                                   ("assistant", "first new")]
    assert (result.turns, result.leading_dropped, result.turns_left_out) == (1, 1, 0)
    with pytest.raises(ConversationSkipped) as skipped:
        regenerate_conversation(continued[:1], renderer, script, max_new_tokens=64, max_length=2048)
    assert skipped.value.reason == "no_user_turn"


def test_the_prompt_tokens_are_the_extractions_tokens_of_the_same_text(renderer):
    script = Scripted(renderer, ["first new", "second new", "third new"])
    result = run(renderer, script)
    full_ids, mask = renderer.render(result.messages)
    for prompt in script.prompts:
        assert full_ids[: len(prompt)] == prompt  # each prompt is a prefix of what the extraction renders
        assert mask[len(prompt) - 1] == 0 and mask[len(prompt)] == 1  # and the answer starts right after it


@pytest.mark.parametrize("on_length", ["keep", "cut", "drop"])
def test_an_answer_at_the_token_limit_is_kept_cut_after_or_dropped(renderer, on_length):
    script = Scripted(renderer, ["first new", "second cut short", "third new"], ["stop", "length", "stop"])
    if on_length == "drop":
        with pytest.raises(ConversationSkipped) as caught:
            run(renderer, script, on_length="drop")
        assert caught.value.reason == "answer_truncated" and "assistant turn 2" in caught.value.detail
        assert len(script.prompts) == 2
        return
    result = run(renderer, script, on_length=on_length)
    if on_length == "keep":
        assert result.turns == 3 and result.truncated_kept == 1 and not result.cut
        assert result.finish == {"stop": 2, "length": 1}
    else:
        assert result.cut and result.turns == 2 and result.turns_left_out == 1 and result.truncated_kept == 0
        assert [m["content"] for m in result.messages][-1] == "second cut short"
        assert result.messages[-1]["role"] == "assistant"  # the user turn after it has no answer: it goes too


def test_a_conversation_stops_once_it_reaches_the_max_length(renderer):
    script = Scripted(renderer, ["a much longer first answer " * 6, "second", "third"])
    first_prompt = len(renderer.generation_prompt_ids(CONVERSATION[:2]))
    result = run(renderer, script, max_length=first_prompt + 5)
    assert result.limited and result.turns == 1 and result.turns_left_out == 2
    assert result.messages[-1]["role"] == "assistant" and len(result.messages) == 3
    with pytest.raises(ConversationSkipped) as caught:
        run(renderer, Scripted(renderer, ["x"]), max_length=first_prompt)
    assert caught.value.reason == "too_long"


def test_the_budget_is_cut_to_what_the_servers_context_has_left(renderer):
    script = Scripted(renderer, ["first", "second", "third"])
    first_prompt = len(renderer.generation_prompt_ids(CONVERSATION[:2]))
    run(renderer, script, context_length=first_prompt + 10)
    assert script.budgets[0] == 10


def test_a_stopping_run_leaves_the_conversation_before_its_next_request(renderer):
    script = Scripted(renderer, ["first", "second", "third"])
    asked = iter([False, True])
    with pytest.raises(NotAnswered):
        run(renderer, script, stopping=lambda: next(asked))
    assert len(script.prompts) == 1


def record(ordinal: int, status: str = "ok", **extra) -> dict:
    base = {"key": f"k{ordinal}", "ordinal": ordinal, "line": ordinal + 1, "id": f"c{ordinal}"}
    if status != "ok":
        return {**base, "status": status, "reason": "answer_truncated", "detail": "cut"}
    return {**base, "status": "ok", "engine": "reference 1", "messages": [{"role": "user", "content": f"q{ordinal}"},
            {"role": "assistant", "content": f"a{ordinal}"}], "turns": 1, "prompt_tokens": 10, "generated_tokens": 5,
            "finish": {"stop": 1}, "truncated_kept": 0, "cut": False, "limited": False, "turns_left_out": 0, **extra}


def test_parts_merge_in_the_datasets_record_order_and_a_second_merge_changes_nothing(tmp_path):
    claim_settings(tmp_path, {"max_length": 8}, file_name=output.SETTINGS_FILE, what="conversations regenerated")
    dataset = {"name": "d.jsonl", "sha256": "0" * 64, "num_samples_limit": None}
    parts = {0: [record(0), record(2, "skipped"), record(4)], 1: [record(3), record(1, limited=True)]}
    reader_skip = {"line": 6, "id": None, "reason": "malformed_json", "detail": "not JSON"}
    for index, records in parts.items():
        texts = output.part_documents(index, 2, 3, records, [reader_skip] if index == 1 else [], dataset)
        assert output.write_part(tmp_path, index, 2, texts) is True
        assert output.part_is_written(tmp_path, index, 2, texts)
    summary, changed = output.merge(tmp_path)
    lines = (tmp_path / output.OUTPUT_FILE).read_text().splitlines()
    assert [json.loads(line)["id"] for line in lines] == ["c0", "c1", "c3", "c4"]
    assert json.loads(lines[0]) == {"id": "c0", "messages": [{"role": "user", "content": "q0"},
                                                             {"role": "assistant", "content": "a0"}]}
    assert changed and output.is_merged(tmp_path)
    assert (summary["num_records"], summary["num_conversations"], summary["num_skipped"], summary["turns"]) == \
        (6, 4, 2, 4)
    assert summary["skipped_reasons"] == {"answer_truncated": 1, "malformed_json": 1}
    assert summary["limited"] == 1 and summary["finish_reasons"] == {"stop": 4}
    before = {p.name: p.stat().st_mtime_ns for p in tmp_path.iterdir() if p.is_file()}
    assert output.merge(tmp_path)[1] is False
    assert before == {p.name: p.stat().st_mtime_ns for p in tmp_path.iterdir() if p.is_file()}
    (tmp_path / output.OUTPUT_FILE).write_text(lines[0] + "\n")
    assert not output.is_merged(tmp_path)


def test_a_merge_waits_for_every_part(tmp_path):
    claim_settings(tmp_path, {"max_length": 8}, file_name=output.SETTINGS_FILE, what="conversations regenerated")
    texts = output.part_documents(0, 2, 1, [record(0)], [], {"name": "d"})
    output.write_part(tmp_path, 0, 2, texts)
    with pytest.raises(output.OutputError, match=r"parts \[1\] of 2 are not done yet"):
        output.merge(tmp_path)


def test_other_settings_over_a_regeneration_are_refused_naming_the_setting(tmp_path):
    settings = {"temperature": 0.0, "max_new_tokens": 512, "target_model_path": "/a"}
    claim_settings(tmp_path, settings, file_name=output.SETTINGS_FILE, what="conversations regenerated")
    claim_settings(tmp_path, {**settings, "target_model_path": "/b"}, file_name=output.SETTINGS_FILE)  # informational
    with pytest.raises(StoreError, match="max_new_tokens: recorded 512, now 128") as caught:
        claim_settings(tmp_path, {**settings, "max_new_tokens": 128}, file_name=output.SETTINGS_FILE,
                       what="conversations regenerated")
    assert "holds conversations regenerated with other settings" in str(caught.value)


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    configure_parser(parser)
    return parser.parse_args(["--dataset", "d.jsonl", "--output-dir", "out", "--server-url", "http://h:1", *argv])


def test_the_command_line_defaults_are_greedy_and_the_extractions_max_length(tmp_path):
    cfg = config_from_args(parse())
    assert (cfg.temperature, cfg.max_new_tokens, cfg.on_length, cfg.max_length, cfg.part) == \
        (0.0, 512, "keep", 2048, (0, 1))
    key = tmp_path / "key"
    key.write_text("s3cret\n")
    assert config_from_args(parse("--api-key-file", str(key), "--part", "1/3")).api_key == "s3cret"
    key.write_text("\n")
    with pytest.raises(ValueError, match="first line is empty"):
        config_from_args(parse("--api-key-file", str(key)))
    for bad, message in ((("--max-new-tokens", "0"), "--max-new-tokens"), (("--part", "3/3"), "0 <= K < N"),
                         (("--temperature", "-1"), "--temperature")):
        with pytest.raises(ValueError, match=message):
            config_from_args(parse(*bad))


@pytest.fixture
def model_dir(tmp_path):
    path = tmp_path / "model"
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 8, "hidden_size": 64}))
    return path


def test_a_serving_reference_plan_captures_nothing_and_batches_large(model_dir):
    plan = server_plan("reference", "/venv/bin/python", str(model_dir), "127.0.0.1", 30100, "/dev/shm/cap",
                       purpose="serve")
    assert "--capture-dir" not in plan["argv"] and "--aux-layers" not in plan["argv"]
    at = plan["argv"].index("--max-batch-size")
    assert plan["argv"][at + 1] == str(SERVE_MAX_BATCH_SIZE)
    assert plan["expected_server_info"] == {"engine": "reference", "model_path": str(model_dir),
                                            "enable_return_aux_hidden_states": False, "capture_dir": None,
                                            "dp_size": 1}
    assert plan["probe_input_ids"] == [] and plan["num_aux"] == 0 and plan["purpose"] == "serve"
    extra = server_plan("reference", "py", str(model_dir), "127.0.0.1", 30100, "", purpose="serve",
                        extra_args=["--max-batch-size", "8"])
    assert extra["argv"][-2:] == ["--max-batch-size", "8"]  # given after the plan's own: it wins


def test_a_serving_sglang_plan_has_no_capture_flag_and_refuses_them(model_dir):
    plan = server_plan("sglang", "/venv/bin/python", str(model_dir), "127.0.0.1", 30100, "/dev/shm/cap",
                       api_key_file="/state/key.yaml", purpose="serve")
    argv = plan["argv"]
    for flag in ("--disable-radix-cache", "--chunked-prefill-size", "--cuda-graph-backend-decode",
                 "--enable-return-aux-hidden-states", "--forward-hooks", "--speculative-algorithm"):
        assert flag not in argv
    assert argv[argv.index("--config") + 1] == "/state/key.yaml"
    assert plan["expected_server_info"]["disable_radix_cache"] is False
    assert plan["expected_server_info"]["enable_return_aux_hidden_states"] is False
    for extra, named in ((["--forward-hooks", "[]"], "--forward-hooks"), (["--disable-radix-cache"], "radix"),
                         (["--speculative-algorithm", "EAGLE3"], "--speculative-algorithm"),
                         (["--disable-radix"], "abbreviation"), (["--port", "1"], "--port")):
        with pytest.raises(PlanError, match=named):
            server_plan("sglang", "py", str(model_dir), "127.0.0.1", 30100, "", extra_args=extra, purpose="serve")
    with pytest.raises(PlanError, match="sglang_server_purpose"):
        server_plan("sglang", "py", str(model_dir), "127.0.0.1", 30100, "", purpose="both")


def test_the_regeneration_progress_line_counts_conversations_and_turns():
    progress = {"state": "running", "pid": 1, "unit": "conversations", "total": 400, "done": 12, "skipped": 1,
                "failed": 0, "turns": 30, "tokens": 800, "tokens_per_s": 1234.5, "eta_s": 192.0}
    assert progress_line(progress) == (
        "12/400 conversations, 1 skipped, 0 failed, 30 turns, 1,234 tokens/s, about 0:03:12 left")
    extraction = {k: v for k, v in progress.items() if k not in ("unit", "turns")}
    assert progress_line(extraction).startswith("12/400 samples, 1 skipped, 0 failed, 1,234 tokens/s")
    failed = {**progress, "state": "failed", "message": "the server went away"}
    part = PartStage({"output_dir": "/nonexistent", "stage": "regeneration", "part_index": 0, "part_count": 1})
    assert part.failed_message(failed, "job", "/nonexistent.log", 1).startswith(
        "regeneration part 0/1 failed: the server went away")
    assert part.dead_message(progress, {"pid": 7, "exit_code": 3}, "job", "/nonexistent.log", 1).startswith(
        "the regeneration job job of part 0/1 exited with code 3")
    assert "raise the timeout (regeneration_timeout_s)" in part.timeout_message(progress, {"pid": 7}, 60)


def test_a_part_written_from_the_journal_is_byte_equal_to_one_written_fresh():
    fresh = record(0)
    reread = json.loads(json.dumps(fresh, sort_keys=True))  # as Journal.load gives it back: keys sorted
    assert list(reread["messages"][0]) == ["content", "role"]
    assert output.part_documents(0, 1, 1, [fresh], [], {}) == output.part_documents(0, 1, 1, [reread], [], {})
    assert output.conversation_line("c0", reread["messages"]).startswith('{"id":"c0","messages":[{"role":"user",')
