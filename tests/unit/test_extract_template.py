"""Chat rendering for extraction: token ids exactly as ``apply_chat_template`` gives them, and a
loss mask on exactly the assistant turns' tokens (content and end-of-turn marker), for the tiny
model's template and for other template styles run on the same real tokenizer.

The tiny template's masks are checked against its own oracle (``models.tiny.assistant_token_spans``)
on many demo conversations; the other styles by decoding each masked run of tokens, which must
give back exactly an assistant turn's text and its end marker, nothing of the header or the
newline after the marker.
"""

from __future__ import annotations

import hashlib

import pytest
from tiny_target import built_tiny_model

from eagle3_pipeline.conversations.template import ChatRenderer, SampleError, fit_length, load_renderer
from eagle3_pipeline.data.demo_dataset import demo_conversations, sharegpt_to_messages
from eagle3_pipeline.data.stdlib_corpus import extract_entries, stdlib_source_files
from eagle3_pipeline.models.tiny import (
    ASSISTANT_TOKEN,
    CHAT_TEMPLATE,
    END_TOKEN,
    assistant_token_spans,
)

transformers = pytest.importorskip("transformers")

DEMO_PACKAGES = {"argparse", "collections", "email", "functools", "http", "json", "logging", "pathlib", "string"}

# ChatML, with markers that are plain text for the tiny tokenizer (it has no such special tokens).
CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# Llama-3's shape: a header, a blank line, the trimmed content, the end-of-turn marker, no newline.
LLAMA3 = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}"
    "{{ message['content'] | trim + '<|eot_id|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)
# The tiny template, with a system prompt of its own when the conversation brings none.
DEFAULT_SYSTEM_PROMPT = "You are a helpful assistant."
WITH_DEFAULT_SYSTEM = CHAT_TEMPLATE.replace(
    "{{ bos_token }}",
    "{{ bos_token }}{% if messages[0]['role'] != 'system' %}"
    "{{ '<|system|>\\n" + DEFAULT_SYSTEM_PROMPT + "<|end|>\\n' }}{% endif %}",
)
# Like Qwen3: earlier assistant turns lose their reasoning, the last one keeps it.
DROPS_EARLIER_REASONING = (
    "{% for message in messages %}"
    "{% set content = message['content'] %}"
    "{% if message['role'] == 'assistant' and not loop.last %}{% set content = content.split('</think>')[-1] %}"
    "{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + content + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# Its generation prompt opens a think block that its assistant turns do not have.
PROMPT_DIFFERS_FROM_TURNS = CHAT_TEMPLATE.replace(
    "'<|assistant|>\\n' }}{% endif %}", "'<|assistant|>\\n<think>' }}{% endif %}"
)

MULTI_TURN = [
    {"role": "system", "content": "You answer in one line."},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "Paris."},
    {"role": "user", "content": "And of Italy?"},
    {"role": "assistant", "content": "Rome, since 1871."},
    {"role": "user", "content": "Thanks!"},
    {"role": "assistant", "content": "You are welcome"},
]


@pytest.fixture(scope="module")
def tiny_model():
    """The real tiny model directory (built once per checkout, then cached; see models/tiny.py)."""
    return built_tiny_model()


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    return transformers.AutoTokenizer.from_pretrained(tiny_model, local_files_only=True)


@pytest.fixture(scope="module")
def renderer(tiny_model):
    return load_renderer(tiny_model)


@pytest.fixture(scope="module")
def demo_chats():
    """150 demo conversations as messages: single and multi-turn, with and without system prompts
    (about a few packages of the standard library: parsing all of it takes seconds)."""
    files = [(name, path) for name, path in stdlib_source_files() if name.split(".")[0] in DEMO_PACKAGES]
    train, _ = demo_conversations(150, 0.0, seed=7, entries=extract_entries(files))
    chats = [sharegpt_to_messages(conversation) for conversation in train]
    assert sum(chat[0]["role"] == "system" for chat in chats) >= 20
    assert sum(sum(m["role"] == "assistant" for m in chat) >= 2 for chat in chats) >= 10
    return chats


def template_ids(tokenizer, messages, chat_template=None) -> list[int]:
    """What transformers itself gives: a BatchEncoding (transformers 5) or a list of ids (4.x)."""
    out = tokenizer.apply_chat_template(messages, chat_template=chat_template, tokenize=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def oracle_mask(tokenizer, input_ids) -> list[int]:
    assistant, end = tokenizer.convert_tokens_to_ids([ASSISTANT_TOKEN, END_TOKEN])
    mask = [0] * len(input_ids)
    for start, stop in assistant_token_spans(input_ids, assistant, end):
        mask[start:stop] = [1] * (stop - start)
    return mask


def masked_runs(tokenizer, input_ids, mask) -> list[str]:
    """The text of each maximal run of masked tokens."""
    runs, current = [], []
    for token, bit in zip(input_ids, mask):
        if bit:
            current.append(token)
        elif current:
            runs.append(current)
            current = []
    if current:
        runs.append(current)
    return [tokenizer.decode(run, skip_special_tokens=False, clean_up_tokenization_spaces=False) for run in runs]


def assistant_texts(messages, end_marker, transform=lambda text: text) -> list[str]:
    return [transform(m["content"]) + end_marker for m in messages if m["role"] == "assistant"]


def test_tiny_template_ids_equal_apply_chat_template_and_mask_equals_the_oracle(renderer, tokenizer, demo_chats):
    for messages in demo_chats:
        input_ids, mask = renderer.render(messages)
        assert input_ids == template_ids(tokenizer, messages)
        assert len(mask) == len(input_ids) and set(mask) <= {0, 1}
        assert mask == oracle_mask(tokenizer, input_ids), messages
        assert masked_runs(tokenizer, input_ids, mask) == assistant_texts(messages, END_TOKEN)


def test_masks_cover_every_assistant_turn_and_no_header_or_newline(renderer, tokenizer):
    input_ids, mask = renderer.render(MULTI_TURN)
    assert masked_runs(tokenizer, input_ids, mask) == [
        "Paris.<|end|>",
        "Rome, since 1871.<|end|>",
        "You are welcome<|end|>",
    ]
    assert mask == oracle_mask(tokenizer, input_ids)
    tokens = tokenizer.convert_ids_to_tokens(input_ids)
    for k, token in enumerate(tokens):
        if token == ASSISTANT_TOKEN:
            assert mask[k] == 0 and mask[k + 1] == 0  # the header and its newline
            assert mask[k + 2] == 1
        if token == END_TOKEN and mask[k] == 1 and k + 1 < len(tokens):
            assert mask[k + 1] == 0  # the newline after the end marker


def test_tokenizers_without_offsets_get_the_same_masks_by_decoding(tiny_model, tokenizer, demo_chats):
    slow_path = load_renderer(tiny_model)
    slow_path._use_offsets = False  # as for a tokenizer that is not a fast one (Kimi's tiktoken-based one)
    for messages in [*demo_chats[:40], MULTI_TURN]:
        input_ids, mask = slow_path.render(messages)
        assert mask == oracle_mask(tokenizer, input_ids)
    chatml = ChatRenderer(tokenizer, CHATML)
    chatml._use_offsets = False
    assert chatml.render(MULTI_TURN) == ChatRenderer(tokenizer, CHATML).render(MULTI_TURN)


@pytest.mark.parametrize(
    ("template", "end_marker", "transform"),
    [(CHATML, "<|im_end|>", lambda text: text), (LLAMA3, "<|eot_id|>", str.strip)],
    ids=["chatml-text-markers", "llama3-header-blank-line"],
)
def test_other_template_styles_mask_exactly_content_and_end_marker(
    tokenizer, demo_chats, template, end_marker, transform
):
    styled = ChatRenderer(tokenizer, template)
    padded = [dict(m, content=f"  {m['content']} \n") if m["role"] != "system" else m for m in MULTI_TURN]
    for messages in [*demo_chats, MULTI_TURN, padded if template is LLAMA3 else MULTI_TURN]:
        input_ids, mask = styled.render(messages)
        assert input_ids == template_ids(tokenizer, messages, template)
        assert masked_runs(tokenizer, input_ids, mask) == assistant_texts(messages, end_marker, transform), messages
    # Nothing else is masked: the unmasked tokens give back the rendering less the assistant texts.
    input_ids, mask = styled.render(MULTI_TURN)
    kept = tokenizer.decode([t for t, bit in zip(input_ids, mask) if not bit], skip_special_tokens=False)
    expected, rest = "", tokenizer.apply_chat_template(MULTI_TURN, chat_template=template, tokenize=False)
    for text in assistant_texts(MULTI_TURN, end_marker, transform):
        before, found, rest = rest.partition(text)
        assert found
        expected += before
    assert kept == expected + rest


def test_a_default_system_prompt_is_rendered_and_left_unmasked(tokenizer, demo_chats):
    styled = ChatRenderer(tokenizer, WITH_DEFAULT_SYSTEM)
    without_system = [chat for chat in demo_chats if chat[0]["role"] != "system"]
    for messages in [*demo_chats, MULTI_TURN[1:]]:
        input_ids, mask = styled.render(messages)
        assert input_ids == template_ids(tokenizer, messages, WITH_DEFAULT_SYSTEM)
        assert mask == oracle_mask(tokenizer, input_ids)
    input_ids, _ = styled.render(without_system[0])
    assert DEFAULT_SYSTEM_PROMPT in tokenizer.decode(input_ids)


def test_a_conversation_starting_with_the_assistant(renderer, tokenizer):
    for messages in (MULTI_TURN[2:], [{"role": "system", "content": "S"}, *MULTI_TURN[2:]]):
        input_ids, mask = renderer.render(messages)
        assert mask == oracle_mask(tokenizer, input_ids)
    input_ids, mask = ChatRenderer(tokenizer, CHATML).render(MULTI_TURN[2:])
    assert masked_runs(tokenizer, input_ids, mask) == assistant_texts(MULTI_TURN[2:], "<|im_end|>")


def test_an_empty_assistant_turn_masks_its_end_marker_only(renderer, tokenizer):
    messages = [{"role": "user", "content": "Say nothing."}, {"role": "assistant", "content": ""}]
    input_ids, mask = renderer.render(messages)
    assert masked_runs(tokenizer, input_ids, mask) == [END_TOKEN]
    assert mask == oracle_mask(tokenizer, input_ids)


def test_a_template_that_rewrites_earlier_turns_is_a_template_error(tokenizer):
    styled = ChatRenderer(tokenizer, DROPS_EARLIER_REASONING)
    single = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "<think>add</think>4"}]
    input_ids, mask = styled.render(single)  # one assistant turn, the last: nothing is rewritten
    assert masked_runs(tokenizer, input_ids, mask) == ["<think>add</think>4<|im_end|>"]
    with pytest.raises(SampleError) as error:
        styled.render([*single, {"role": "user", "content": "3+3?"}, {"role": "assistant", "content": "6"}])
    assert error.value.reason == "template_error"
    assert "differently once later turns follow" in error.value.detail
    assert "<think>add" in error.value.detail  # where the two renderings part


def test_a_generation_prompt_unlike_the_turns_is_a_template_error(tokenizer):
    with pytest.raises(SampleError) as error:
        ChatRenderer(tokenizer, PROMPT_DIFFERS_FROM_TURNS).render(MULTI_TURN)
    assert error.value.reason == "template_error"
    assert "generation prompt" in error.value.detail and "<think>" in error.value.detail


def test_a_template_that_raises_is_a_template_error(renderer):
    with pytest.raises(SampleError) as error:
        renderer.render([{"role": "tool", "content": "sunny"}, {"role": "assistant", "content": "Sunny."}])
    assert error.value.reason == "template_error"
    assert "unknown role tool" in error.value.detail
    with pytest.raises(SampleError, match="no messages"):
        renderer.render([])


def test_template_hash_and_a_template_file(tiny_model, tmp_path, renderer):
    assert renderer.chat_template == CHAT_TEMPLATE
    assert renderer.template_hash == hashlib.sha256(CHAT_TEMPLATE.encode()).hexdigest()
    path = tmp_path / "chatml.jinja"
    path.write_text(CHATML)
    from_file = load_renderer(tiny_model, path)
    assert from_file.chat_template == CHATML
    assert from_file.template_hash == hashlib.sha256(CHATML.encode()).hexdigest() != renderer.template_hash
    input_ids, mask = from_file.render(MULTI_TURN)
    assert masked_runs(from_file.tokenizer, input_ids, mask)[0] == "Paris.<|im_end|>"


def test_missing_files_and_templates_are_named(tiny_model, tmp_path, tokenizer):
    with pytest.raises(ValueError, match="cannot read the chat template file .*missing.jinja"):
        load_renderer(tiny_model, tmp_path / "missing.jinja")
    with pytest.raises(ValueError, match="cannot load the tokenizer from .*no-model"):
        load_renderer(tmp_path / "no-model")
    bare = transformers.AutoTokenizer.from_pretrained(tiny_model, local_files_only=True)
    bare.chat_template = None
    with pytest.raises(ValueError, match="--chat-template"):
        ChatRenderer(bare)
    assert ChatRenderer(bare, CHATML).template_hash == hashlib.sha256(CHATML.encode()).hexdigest()


def test_fit_length_keeps_truncates_or_skips(renderer):
    input_ids, mask = renderer.render(MULTI_TURN)
    n = len(input_ids)
    assert fit_length(input_ids, mask, n, "skip") == (input_ids, mask, False)
    assert fit_length(input_ids, mask, 4096, "truncate") == (input_ids, mask, False)
    first_masked = mask.index(1)
    cut = first_masked + 2
    assert fit_length(input_ids, mask, cut, "truncate") == (input_ids[:cut], mask[:cut], True)
    with pytest.raises(SampleError) as error:
        fit_length(input_ids, mask, n - 1, "skip")
    assert error.value.reason == "too_long" and str(n) in error.value.detail and str(n - 1) in error.value.detail
    with pytest.raises(SampleError) as error:
        fit_length(input_ids, mask, first_masked, "truncate")  # the cut leaves no assistant token
    assert error.value.reason == "no_assistant_tokens" and "--max-length" in error.value.detail


def test_fit_length_refuses_samples_without_assistant_tokens_and_bad_settings(renderer):
    input_ids, mask = renderer.render([{"role": "user", "content": "Hello?"}])
    assert set(mask) == {0}
    with pytest.raises(SampleError) as error:
        fit_length(input_ids, mask, 100, "truncate")
    assert error.value.reason == "no_assistant_tokens"
    with pytest.raises(ValueError, match="overflow must be one of truncate, skip"):
        fit_length([1], [1], 10, "drop")
    with pytest.raises(ValueError, match="max_length must be a positive int"):
        fit_length([1], [1], 0, "truncate")
    with pytest.raises(ValueError, match="differ in length"):
        fit_length([1, 2], [1], 10, "truncate")


def test_samples_read_from_a_dataset_file_render_with_the_oracle_mask(renderer, tokenizer, tmp_path):
    from eagle3_pipeline.conversations.dataset import Sample, read_dataset
    from eagle3_pipeline.data.demo_dataset import write_jsonl

    records = [
        {"id": "sharegpt", "conversations": [{"from": "human", "value": "Q?"}, {"from": "gpt", "value": "A."}]},
        {
            "id": "openai-parts",
            "messages": [
                {"role": "system", "content": [{"type": "text", "text": "Be"}, {"type": "text", "text": "brief."}]},
                *MULTI_TURN[1:],
            ],
        },
    ]
    write_jsonl(tmp_path / "data.jsonl", records)
    samples = list(read_dataset(tmp_path / "data.jsonl"))
    assert all(isinstance(sample, Sample) for sample in samples)
    for sample in samples:
        input_ids, mask = renderer.render(sample.messages)
        assert input_ids == template_ids(tokenizer, list(sample.messages))
        assert mask == oracle_mask(tokenizer, input_ids) and sum(mask) > 0
    assert "<|system|>\nBe\nbrief.<|end|>" in tokenizer.decode(renderer.render(samples[1].messages)[0])
