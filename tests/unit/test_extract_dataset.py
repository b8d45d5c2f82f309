"""Reading conversation datasets: both ShareGPT styles and OpenAI messages become samples, and
every kind of bad input from the field becomes a skip with its reason code and line number.

All tests write real JSONL files (bytes, where the bytes matter) and read them back.
"""

from __future__ import annotations

import codecs
import hashlib
import json

import pytest

from eagle3_pipeline.extract.dataset import Sample, Skip, file_stem_for, read_dataset


def jsonl(*records) -> bytes:
    """One line per record: dicts/lists are dumped as JSON, bytes and str written as they are."""
    lines = []
    for record in records:
        if isinstance(record, bytes):
            lines.append(record)
        elif isinstance(record, str):
            lines.append(record.encode())
        else:
            lines.append(json.dumps(record).encode())
    return b"\n".join(lines) + b"\n"


def write(tmp_path, data: bytes, name="data.jsonl"):
    path = tmp_path / name
    path.write_bytes(data)
    return path


def chat(question="What is 2 + 2?", answer="4.", **extra):
    return {"conversations": [{"from": "human", "value": question}, {"from": "gpt", "value": answer}], **extra}


def outcome(item):
    """(line, reason or "ok") of a read result."""
    return (item.line, item.reason if isinstance(item, Skip) else "ok")


def hashed(sample_id: str) -> str:
    return "id-" + hashlib.sha256(sample_id.encode()).hexdigest()[:16]


def test_sharegpt_from_value_turns_become_normalised_messages(tmp_path):
    record = {
        "id": "conv-1",
        "conversations": [
            {"from": "system", "value": "Be brief."},
            {"from": "human", "value": "Hi"},
            {"from": "gpt", "value": "Hello."},
            {"from": "user", "value": "And?"},
            {"from": "chatgpt", "value": "That is all."},
            {"from": "human", "value": "Sure?"},
            {"from": "bing", "value": "Yes."},
            {"from": "human", "value": "Really?"},
            {"from": "model", "value": "Really."},
            {"from": "Human", "value": "OK"},
            {"from": "assistant", "value": "Bye."},
        ],
    }
    [sample] = read_dataset(write(tmp_path, jsonl(record)))
    assert sample == Sample(
        ordinal=0,
        line=1,
        sample_id="conv-1",
        file_stem="conv-1",
        messages=(
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello."},
            {"role": "user", "content": "And?"},
            {"role": "assistant", "content": "That is all."},
            {"role": "user", "content": "Sure?"},
            {"role": "assistant", "content": "Yes."},
            {"role": "user", "content": "Really?"},
            {"role": "assistant", "content": "Really."},
            {"role": "user", "content": "OK"},
            {"role": "assistant", "content": "Bye."},
        ),
    )


def test_sharegpt_with_role_content_turns_and_openai_messages(tmp_path):
    sharegpt_roles = {
        "id": "a",
        "conversations": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}],
    }
    openai = {
        "id": "b",
        "messages": [
            {"role": "developer", "content": "Rules."},
            {"role": "user", "content": "Q2"},
            {"role": "assistant", "content": "A2", "name": "bot"},
        ],
    }
    a, b = read_dataset(write(tmp_path, jsonl(sharegpt_roles, openai)))
    assert a.messages == ({"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"})
    assert b.messages == (
        {"role": "system", "content": "Rules."},
        {"role": "user", "content": "Q2"},
        {"role": "assistant", "content": "A2"},
    )
    assert (a.ordinal, a.line, b.ordinal, b.line) == (0, 1, 1, 2)


def test_list_of_text_parts_is_joined_with_newlines(tmp_path):
    record = {
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "first"}, {"type": "text", "text": "second"}]},
            {"role": "assistant", "content": [{"type": "text", "text": "only part"}]},
        ]
    }
    [sample] = read_dataset(write(tmp_path, jsonl(record)))
    assert sample.messages == (
        {"role": "user", "content": "first\nsecond"},
        {"role": "assistant", "content": "only part"},
    )


def test_ids_are_strings_ints_or_the_line_number(tmp_path):
    data = jsonl(chat(id="text-id"), chat(id=42), chat(), chat(id=""), chat(id=1.5), chat(id=True), chat(id=None))
    samples = list(read_dataset(write(tmp_path, data)))
    assert [s.sample_id for s in samples] == ["text-id", "42", "line-3", "line-4", "line-5", "line-6", "line-7"]
    assert [s.file_stem for s in samples] == [s.sample_id for s in samples]


def test_unsafe_ids_get_a_hashed_file_stem(tmp_path):
    unsafe = ["a/b", "../etc/passwd", "..", ".hidden", "x.tmp", "with space", "é", "-dash-first", "a" * 129, "a\nb"]
    safe = ["A", "a.b_c-d", "0", "a" * 128, "x.tmpl", "a..b"]
    samples = list(read_dataset(write(tmp_path, jsonl(*(chat(id=i) for i in unsafe + safe)))))
    assert all(isinstance(s, Sample) for s in samples)
    assert [s.sample_id for s in samples] == unsafe + safe
    assert [s.file_stem for s in samples] == [hashed(i) for i in unsafe] + safe
    assert [file_stem_for(i) for i in unsafe + safe] == [s.file_stem for s in samples]


def test_bad_input_corpus_gives_reason_codes_and_line_numbers(tmp_path):
    image = {
        "messages": [
            {
                "role": "user",
                "content": [{"type": "text", "text": "what is it?"}, {"type": "image_url", "image_url": {}}],
            },
            {"role": "assistant", "content": "a cat"},
        ]
    }
    tool_turn = {
        "messages": [
            {"role": "user", "content": "weather?"},
            {"role": "tool", "content": "sunny"},
            {"role": "assistant", "content": "Sunny."},
        ]
    }
    lines = [
        chat(id="first"),  # 1 ok
        '{"id": "x", "conversations": [',  # 2 malformed JSON
        '[{"from": "human", "value": "hi"}]',  # 3 a JSON array
        "",  # 4 blank: not a record
        "   \t",  # 5 blank too
        {"id": "empty", "conversations": []},  # 6
        {"id": "noasst", "conversations": [{"from": "human", "value": "hello?"}]},  # 7
        image,  # 8
        tool_turn,  # 9
        chat(id="first"),  # 10 duplicate of line 1
        b'{"id": "latin1", "conversations": [{"from": "human", "value": "caf\xe9"}]}',  # 11
        {"id": "nothing", "text": "no turns here"},  # 12
        {"id": "notlist", "conversations": "human: hi"},  # 13
        {"id": "blank", "conversations": [{"from": "human", "value": " "}, {"from": "gpt", "value": ""}]},  # 14
        {"conversations": [{"value": "no speaker"}, {"from": "gpt", "value": "A"}]},  # 15
        {"conversations": [{"from": "human"}, {"from": "gpt", "value": "A"}]},  # 16
        {"conversations": [{"from": "human", "value": 7}, {"from": "gpt", "value": "A"}]},  # 17
        {"conversations": ["human: hi", {"from": "gpt", "value": "A"}]},  # 18
        {"messages": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": None}]},  # 19
        '{"conversations": [{"from": "human", "value": "\\ud800"}, {"from": "gpt", "value": "A"}]}',  # 20
        "42",  # 21
        "[" * 100_000 + "]" * 100_000,  # 22
        chat(id="last"),  # 23 ok
    ]
    results = list(read_dataset(write(tmp_path, jsonl(*lines))))
    assert [outcome(r) for r in results] == [
        (1, "ok"),
        (2, "malformed_json"),
        (3, "not_an_object"),
        (6, "empty_conversation"),
        (7, "no_assistant_turn"),
        (8, "non_text_content"),
        (9, "unknown_role"),
        (10, "duplicate_id"),
        (11, "undecodable_bytes"),
        (12, "no_turns"),
        (13, "no_turns"),
        (14, "empty_conversation"),
        (15, "unknown_role"),
        (16, "non_text_content"),
        (17, "non_text_content"),
        (18, "not_an_object"),
        (19, "non_text_content"),
        (20, "undecodable_bytes"),
        (21, "not_an_object"),
        (22, "malformed_json"),
        (23, "ok"),
    ]
    # Ordinals count non-blank lines: the two blank lines are not records.
    assert [r.ordinal for r in results] == list(range(21))
    by_line = {r.line: r for r in results}
    assert "at the end of the line" in by_line[2].detail and "each line must be one object" in by_line[2].detail
    assert "nested too deeply" in by_line[22].detail
    assert by_line[3].sample_id is None and "an array" in by_line[3].detail
    assert by_line[6].sample_id == "empty"
    assert "of type 'image_url'" in by_line[8].detail and "part 1" in by_line[8].detail
    assert "'tool'" in by_line[9].detail and "turn 1" in by_line[9].detail
    assert "line 1" in by_line[10].detail and by_line[10].sample_id == "first"
    assert by_line[11].sample_id is None and "0xe9" in by_line[11].detail and "UTF-8" in by_line[11].detail
    assert "'conversations'" in by_line[12].detail and "'text'" in by_line[12].detail
    assert by_line[15].sample_id == "line-15" and "neither 'from' nor 'role'" in by_line[15].detail
    assert "no 'value'" in by_line[16].detail
    assert "'content' is null" in by_line[19].detail
    assert "\\ud800" in by_line[20].detail
    assert all(r.detail for r in results if isinstance(r, Skip))


def test_ids_colliding_only_after_sanitising_are_duplicates(tmp_path):
    unsafe = "a/b"
    data = jsonl(
        chat(id=unsafe),  # 1: stem hashed
        chat(id=hashed(unsafe)),  # 2: a literal id equal to line 1's stem
        chat(id=7),  # 3
        chat(id="7"),  # 4: the same id once read
        chat(id="line-6"),  # 5: an explicit id equal to line 6's default
        chat(),  # 6
    )
    results = list(read_dataset(write(tmp_path, data)))
    assert [outcome(r) for r in results] == [
        (1, "ok"),
        (2, "duplicate_id"),
        (3, "ok"),
        (4, "duplicate_id"),
        (5, "ok"),
        (6, "duplicate_id"),
    ]
    assert "'a/b'" in results[1].detail and "line 1" in results[1].detail
    assert "line 3" in results[3].detail
    assert "line 5" in results[5].detail and results[5].sample_id == "line-6"


def test_malformed_json_names_the_column(tmp_path):
    [skip] = read_dataset(write(tmp_path, b'{"id": 1,, "messages": []}\n'))
    assert (skip.line, skip.reason) == (1, "malformed_json")
    assert "column 10" in skip.detail


def test_a_skipped_record_does_not_claim_its_id(tmp_path):
    data = jsonl({"id": "x", "conversations": []}, chat(id="x"))
    assert [outcome(r) for r in read_dataset(write(tmp_path, data))] == [(1, "empty_conversation"), (2, "ok")]


def test_bom_on_the_first_line_crlf_endings_and_no_final_newline(tmp_path):
    data = codecs.BOM_UTF8 + json.dumps(chat(id="bom")).encode() + b"\r\n\r\n" + json.dumps(chat(id="end")).encode()
    results = list(read_dataset(write(tmp_path, data)))
    assert [(r.line, r.sample_id) for r in results] == [(1, "bom"), (3, "end")]
    assert all(isinstance(r, Sample) for r in results)


def test_a_bom_after_the_first_line_is_not_json(tmp_path):
    data = jsonl(chat(id="a"), codecs.BOM_UTF8 + json.dumps(chat(id="b")).encode())
    assert [outcome(r) for r in read_dataset(write(tmp_path, data))] == [(1, "ok"), (2, "malformed_json")]


def test_utf8_text_is_kept_exactly(tmp_path):
    record = chat(id="u", question="Qu'est-ce qu'un café ? 🐍", answer="Ein Getränk. 一杯の")
    [sample] = read_dataset(write(tmp_path, json.dumps(record, ensure_ascii=False).encode() + b"\n"))
    assert [m["content"] for m in sample.messages] == ["Qu'est-ce qu'un café ? 🐍", "Ein Getränk. 一杯の"]


def test_num_samples_counts_records_skips_included_and_stops_reading(tmp_path):
    data = jsonl(chat(id="a"), "not json", "", chat(id="b"), chat(id="c")) + b"\xff\xfe not even text\n"
    path = write(tmp_path, data)
    assert [outcome(r) for r in read_dataset(path, num_samples=3)] == [(1, "ok"), (2, "malformed_json"), (4, "ok")]
    assert list(read_dataset(path, num_samples=0)) == []
    assert [outcome(r) for r in read_dataset(path)][-1] == (6, "undecodable_bytes")


def test_reading_is_lazy_and_line_by_line(tmp_path):
    path = write(tmp_path, jsonl(*(chat(id=f"s{i}") for i in range(1000))))
    reader = read_dataset(path)
    first = next(reader)
    assert first.sample_id == "s0"
    # The file is open and read line by line: later records still come, in order.
    assert [s.sample_id for s in reader][-1] == "s999"


def test_bad_arguments_are_refused_at_the_call(tmp_path):
    with pytest.raises(ValueError, match="num_samples must be >= 0"):
        read_dataset(tmp_path / "missing.jsonl", num_samples=-1)
    with pytest.raises(TypeError, match="num_samples"):
        read_dataset(tmp_path / "missing.jsonl", num_samples="3")
    with pytest.raises(FileNotFoundError):
        next(read_dataset(tmp_path / "missing.jsonl"))


def test_demo_dataset_file_reads_without_a_skip(tmp_path):
    from eagle3_pipeline.data.demo_dataset import sharegpt_to_messages, write_jsonl

    records = [{"id": f"demo-{i:05d}", "conversations": chat(f"q{i}", f"a{i}")["conversations"]} for i in range(5)]
    records[2]["conversations"].insert(0, {"from": "system", "value": "Sys."})
    path = tmp_path / "demo.jsonl"
    write_jsonl(path, records)
    samples = list(read_dataset(path))
    assert [s.messages for s in samples] == [tuple(sharegpt_to_messages(r)) for r in records]
    assert [s.file_stem for s in samples] == [r["id"] for r in records]
