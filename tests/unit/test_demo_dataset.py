"""The demo conversations: ShareGPT format, sizes, byte-for-byte determinism, a disjoint held-out split."""

from __future__ import annotations

import argparse
import json
import random

import pytest

from eagle3_pipeline.data import demo_dataset
from eagle3_pipeline.data.demo_dataset import (
    build_conversation,
    demo_conversations,
    sharegpt_to_messages,
    write_demo_dataset,
)
from eagle3_pipeline.data.stdlib_corpus import corpus_fingerprint, extract_entries, stdlib_source_files


@pytest.fixture(scope="module")
def entries():
    return extract_entries()


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo") / "demo.jsonl"
    train, held_out = write_demo_dataset(out)
    return train, held_out


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def human_turns(records):
    return {turn["value"] for record in records for turn in record["conversations"] if turn["from"] == "human"}


def test_stdlib_corpus_is_parsed_not_imported_and_names_are_unique(entries):
    names = [entry.name for entry in entries]
    assert len(names) == len(set(names)) > 2000
    by_name = {entry.name: entry for entry in entries}
    assert by_name["json.dumps"].kind == "function"
    assert by_name["json.dumps"].signature.startswith("(obj, *, skipkeys=False")
    assert by_name["json.encoder.JSONEncoder.encode"].signature == "(o)"  # self dropped
    assert "JSON" in by_name["json"].summary
    assert not {entry.module.split(".")[0] for entry in entries} & {"test", "idlelib", "lib2to3", "turtledemo"}
    assert not any(part.startswith("_") for entry in entries for part in entry.module.split("."))
    assert all(module.split(".")[0] != "test" for module, _ in stdlib_source_files())


def test_corpus_fingerprint_is_stable_and_follows_the_files(tmp_path):
    files = stdlib_source_files()[:5]
    assert corpus_fingerprint(files) == corpus_fingerprint(files)
    copy = tmp_path / "mod.py"
    copy.write_bytes(files[0][1].read_bytes())
    changed = [(files[0][0], copy), *files[1:]]
    assert corpus_fingerprint(changed) == corpus_fingerprint(files)
    copy.write_bytes(copy.read_bytes() + b"\n# edited\n")
    assert corpus_fingerprint(changed) != corpus_fingerprint(files)


def test_records_are_sharegpt_conversations(written):
    for path in written:
        for record in read_jsonl(path):
            assert set(record) == {"id", "conversations"}
            speakers = [turn["from"] for turn in record["conversations"]]
            if speakers[0] == "system":
                speakers = speakers[1:]
            assert speakers in (["human", "gpt"], ["human", "gpt", "human", "gpt"]), record
            assert all(isinstance(turn["value"], str) and turn["value"].strip() for turn in record["conversations"])
            assert all(set(turn) == {"from", "value"} for turn in record["conversations"])


def test_default_sizes_and_mix(written):
    train, held_out = (read_jsonl(path) for path in written)
    assert (len(train), len(held_out)) == (400, 40)
    assert written[1].name == "demo.heldout.jsonl"
    assert len({record["id"] for record in train + held_out}) == 440
    with_system = sum(record["conversations"][0]["from"] == "system" for record in train)
    multi_turn = sum(len([t for t in record["conversations"] if t["from"] == "human"]) == 2 for record in train)
    assert 60 <= with_system <= 180, with_system  # about 30 %
    assert 20 <= multi_turn <= 150, multi_turn


def test_held_out_shares_no_conversation_and_no_prompt(written):
    train, held_out = (read_jsonl(path) for path in written)
    assert not {json.dumps(r["conversations"]) for r in train} & {json.dumps(r["conversations"]) for r in held_out}
    assert not human_turns(train) & human_turns(held_out)


def test_same_seed_same_bytes_other_seed_other_bytes(tmp_path, written):
    again = write_demo_dataset(tmp_path / "again.jsonl")
    assert [path.read_bytes() for path in again] == [path.read_bytes() for path in written]
    other = write_demo_dataset(tmp_path / "other.jsonl", tmp_path / "other-held.jsonl", seed=1)
    assert other[0].read_bytes() != written[0].read_bytes()
    assert other[1] == tmp_path / "other-held.jsonl"


def test_sizes_follow_the_arguments_and_too_many_is_refused(entries):
    train, held_out = demo_conversations(50, 0.25, 3, entries)
    assert (len(train), len(held_out)) == (50, 13)
    train, held_out = demo_conversations(10, 0.0, 3, entries)
    assert (len(train), len(held_out)) == (10, 0)
    with pytest.raises(ValueError, match="lower --num-samples"):
        demo_conversations(len(entries), 0.1, 0, entries)


def test_answers_come_from_the_docstrings(entries):
    entry = next(e for e in entries if e.name == "json.dumps")
    conversation = build_conversation(entry, random.Random(0), "x")
    turns = conversation["conversations"]
    question = next(t["value"] for t in turns if t["from"] == "human")
    answer = next(t["value"] for t in turns if t["from"] == "gpt")
    assert "json.dumps" in question
    assert entry.summary in answer


def test_sharegpt_to_messages_maps_roles_and_names_bad_speakers():
    record = {"id": "a", "conversations": [{"from": "system", "value": "s"}, {"from": "human", "value": "q"}]}
    assert sharegpt_to_messages(record) == [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}]
    with pytest.raises(ValueError, match="'a'.*'bot'"):
        sharegpt_to_messages({"id": "a", "conversations": [{"from": "bot", "value": "q"}]})


def test_cli_writes_both_files(tmp_path, capsys):
    parser = argparse.ArgumentParser()
    demo_dataset.configure_parser(parser)
    args = parser.parse_args(["--output", str(tmp_path / "d.jsonl"), "--num-samples", "20", "--seed", "2"])
    assert demo_dataset.run(args) == 0
    printed = capsys.readouterr().out.split()
    assert printed == [str(tmp_path / "d.jsonl"), str(tmp_path / "d.heldout.jsonl")]
    assert (len(read_jsonl(tmp_path / "d.jsonl")), len(read_jsonl(tmp_path / "d.heldout.jsonl"))) == (20, 2)
    args = parser.parse_args(["--output", str(tmp_path / "e.jsonl"), "--num-samples", "0"])
    assert demo_dataset.run(args) == 2
    assert "num_samples >= 1" in capsys.readouterr().err
