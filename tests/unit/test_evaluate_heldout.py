"""Held-out prompts: rendered as the extraction renders them, excluded (and listed) when the training data has
them, the run refused only when too few remain."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from extraction_settings import RUN, settings
from tiny_target import built_tiny_model

from eagle3_pipeline.conversations.dataset import Sample, read_dataset
from eagle3_pipeline.conversations.template import load_renderer
from eagle3_pipeline.evaluate.heldout import (
    HeldoutError,
    load_heldout_prompts,
    prefix_digest,
    select_heldout_prompts,
)
from eagle3_pipeline.extract import store
from eagle3_pipeline.train.data import open_dataset

HIDDEN = 8


def _chat(sample_id, question, answer, system=None):
    turns = ([{"from": "system", "value": system}] if system else []) + [
        {"from": "human", "value": question}, {"from": "gpt", "value": answer}]
    record = {"conversations": turns}
    if sample_id is not None:
        record["id"] = sample_id
    return record


TRAINING = [
    _chat("t-0", "What does heapq.heapify do?", "It turns a list into a heap."),
    _chat("t-1", "Explain the Python module json.", "JSON encoding and decoding."),
    _chat(None, "What is os.path.join for?", "It joins path parts.", system="Be brief."),  # id: line-3
]


def _write_jsonl(path: Path, records) -> Path:
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return path


@pytest.fixture(scope="module")
def renderer():
    return load_renderer(built_tiny_model())


@pytest.fixture(scope="module")
def training_data(tmp_path_factory, renderer):
    """An extraction of TRAINING as the extraction stores it (ids and mask by the renderer; zero states)."""
    root = tmp_path_factory.mktemp("data")
    source = _write_jsonl(root.parent / "train.jsonl", TRAINING)
    store.claim_settings(root, settings(HIDDEN, [0, 1, 2], 4096, 8, "float32"))
    entries = []
    for sample in read_dataset(source):
        assert isinstance(sample, Sample)
        ids, mask = renderer.render(sample.messages)
        file = f"{store.shard_dir_name(sample.ordinal, 8)}/{sample.file_stem}{store.SAMPLE_SUFFIX}"
        tokens = len(ids)
        size, sha = store.write_sample(root / file, torch.tensor(ids, dtype=torch.int32),
                                       torch.tensor(mask, dtype=torch.uint8), torch.zeros(tokens, 3 * HIDDEN),
                                       torch.zeros(tokens, HIDDEN), {"format": store.FORMAT, "id": sample.sample_id})
        entries.append({"key": f"k-{sample.ordinal}", "status": "ok", "ordinal": sample.ordinal, "line": sample.line,
                        "id": sample.sample_id, "file": file, "tokens": tokens, "loss_tokens": sum(mask),
                        "bytes": size, "sha256": sha})
    store.write_part_manifest(root, 0, 1, entries, [], [], len(entries), RUN)
    store.merge(root)
    return open_dataset(root)


def test_prompt_is_the_rendering_up_to_the_generation_prompt(tmp_path, renderer):
    path = _write_jsonl(tmp_path / "held.jsonl", [_chat("h-0", "What is the class zipfile.ZipFile used for?", "x")])
    prompts, skipped = load_heldout_prompts(path, renderer)
    expected = renderer.tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the class zipfile.ZipFile used for?"}], add_generation_prompt=True,
        tokenize=False)
    assert skipped == []
    assert renderer.tokenizer.decode(list(prompts[0].input_ids), skip_special_tokens=False) == expected
    assert expected.endswith("<|assistant|>\n")


def test_records_without_a_prompt_are_left_out_with_the_reason(tmp_path, renderer):
    path = _write_jsonl(tmp_path / "held.jsonl", [
        {"id": "a", "conversations": [{"from": "gpt", "value": "I start."}, {"from": "human", "value": "ok"}]},
        "not an object", _chat("b", "What is re.sub?", "Substitutes.")])
    prompts, skipped = load_heldout_prompts(path, renderer)
    assert [p.sample_id for p in prompts] == ["b"]
    assert "no turn before the first assistant turn" in skipped[0] and "not_an_object" in skipped[1]
    with pytest.raises(HeldoutError, match="no usable prompt"):
        load_heldout_prompts(_write_jsonl(tmp_path / "none.jsonl", ["x"]), renderer)


def test_prompts_unseen_in_training_pass(tmp_path, renderer, training_data):
    path = _write_jsonl(tmp_path / "held.jsonl", [
        _chat("h-0", "What is the class zipfile.ZipFile used for?", "Zip files."),
        _chat(None, "What does heapq.heappush do?", "Pushes."),  # line-2: a generated id, like a training one
        _chat("h-2", "What does heapq.heapify do?", "Same question, but with a system prompt.", system="Be brief.")])
    selection = select_heldout_prompts(path, renderer, training_data, 10)
    assert [p.sample_id for p in selection.prompts] == ["h-0", "line-2", "h-2"] and selection.excluded == []
    assert selection.summary()["training_samples"] == 3 and selection.summary()["usable_prompts"] == 3


def test_prompts_seen_in_training_are_excluded_by_their_tokens_and_the_next_ones_taken(tmp_path, renderer,
                                                                                        training_data):
    path = _write_jsonl(tmp_path / "held.jsonl", [
        _chat("fresh", "What is the class zipfile.ZipFile used for?", "Zip files."),
        _chat("renamed", "Explain the Python module json.", "A different answer: the prompt is what counts."),
        _chat("again", "What is os.path.join for?", "x", system="Be brief."),
        _chat("repeat", "What is the class zipfile.ZipFile used for?", "The same prompt as 'fresh'."),
        _chat("next", "What does shutil.copy do?", "Copies."),
        _chat("unused", "What does shutil.move do?", "Moves.")])
    selection = select_heldout_prompts(path, renderer, training_data, 2)
    assert [p.sample_id for p in selection.prompts] == ["fresh", "next"]  # two asked for: "unused" is not read
    assert [(e["id"], e["line"], e["reason"], e["other"]) for e in selection.excluded] == [
        ("renamed", 2, "same prompt tokens as a training sample", "t-1"),
        ("again", 3, "same prompt tokens as a training sample", "line-3"),
        ("repeat", 4, "same prompt tokens as an earlier held-out prompt", "fresh")]


def test_a_training_id_is_excluded_even_with_another_prompt(tmp_path, renderer, training_data):
    path = _write_jsonl(tmp_path / "held.jsonl", [_chat("t-0", "A question never trained on?", "x"),
                                                  _chat("h-1", "Another question never trained on?", "y")])
    selection = select_heldout_prompts(path, renderer, training_data, 5)
    assert [p.sample_id for p in selection.prompts] == ["h-1"]
    assert selection.excluded == [{"id": "t-0", "line": 1, "reason": "same id as a training sample", "other": "t-0"}]


def test_too_few_prompts_left_refuses_naming_the_exclusions(tmp_path, renderer, training_data):
    path = _write_jsonl(tmp_path / "held.jsonl", [
        _chat("renamed", "Explain the Python module json.", "x"), _chat("h-1", "Never trained on?", "y")])
    with pytest.raises(HeldoutError, match=r"only 1 usable held-out prompt\(s\), at least 2 needed: 1 excluded as "
                                           r"seen in training, repeated or too long \(renamed \(same prompt tokens "
                                           r"as a training sample: "
                                           r"t-1\)\)"):
        select_heldout_prompts(path, renderer, training_data, 5, min_prompts=2)


def test_prefix_digest_cuts_at_the_first_assistant_token():
    assert prefix_digest([1, 2, 3, 4], [0, 0, 1, 1]) == prefix_digest([1, 2, 9], [0, 0, 1])
    assert prefix_digest([1, 2, 3, 4], [0, 0, 1, 1]) != prefix_digest([1, 2, 3, 4], [0, 0, 0, 1])



def test_ids_the_reader_made_up_are_known_from_the_manifest():
    """A JSON array's records without an id are named record-N: the manifest says they were made up (older
    manifests: JSON Lines' line-N), so a held-out record whose real id is record-N is not taken for them."""
    from types import SimpleNamespace

    from eagle3_pipeline.evaluate.heldout import _generated_ids

    files = [{"id": "record-3", "id_generated": True, "line": 1}, {"id": "record-4", "id_generated": False, "line": 1},
             {"id": "line-2", "line": 2}, {"id": "t-9", "line": 3}]
    assert _generated_ids(SimpleNamespace(manifest={"shards": {"rows_0-8": {"files": files}}})) == {"record-3",
                                                                                                  "line-2"}


def test_prompts_whose_decode_passes_the_trainings_max_length_are_excluded(tmp_path, renderer, training_data):
    """The extraction skipped such records (too long): from the training's own file they are its records that did
    not fit, and the drafter never trained at those positions, so they are not held-out prompts."""
    path = _write_jsonl(tmp_path / "held.jsonl", [
        _chat("long", "Explain, in detail, " + "every module of the standard library " * 4, "x"),
        _chat("short", "What is the class zipfile.ZipFile used for?", "y")])
    prompts, _ = load_heldout_prompts(path, renderer)
    long_tokens, short_tokens = (len(p.input_ids) for p in prompts)
    assert long_tokens > short_tokens
    max_length = training_data.manifest["max_length"]
    selection = select_heldout_prompts(path, renderer, training_data, 5, max_new_tokens=max_length - short_tokens)
    assert [p.sample_id for p in selection.prompts] == ["short"]
    assert selection.excluded == [{
        "id": "long", "line": 1, "reason": "longer than the training's samples",
        "other": f"{long_tokens} prompt tokens + {max_length - short_tokens} new > max_length {max_length}"}]
    assert selection.summary()["longest_prompt_tokens"] == short_tokens
    # One token more of decode and the short prompt passes the limit too: nothing is left.
    with pytest.raises(HeldoutError, match="only 0 usable held-out prompt"):
        select_heldout_prompts(path, renderer, training_data, 5, max_new_tokens=max_length - short_tokens + 1)


HELD = [
    _chat("h-0", "What is the class zipfile.ZipFile used for?", "Zip files."),
    _chat("h-1", "Explain the Python module json.", "A training prompt: excluded by its tokens."),
    _chat("h-2", "What does shutil.copy do?", "Copies."),
    _chat("h-3", "What does shutil.move do?", "Moves."),
]


def test_held_out_prompts_from_parquet_shards_are_those_of_the_jsonl(tmp_path, renderer, training_data):
    from test_dataset_tables import write_parquet_shards

    from_jsonl = select_heldout_prompts(_write_jsonl(tmp_path / "held.jsonl", HELD), renderer, training_data, 10)
    from_shards = select_heldout_prompts(write_parquet_shards(tmp_path / "held", HELD, shards=2), renderer,
                                         training_data, 10)
    assert [p.sample_id for p in from_shards.prompts] == [p.sample_id for p in from_jsonl.prompts] == [
        "h-0", "h-2", "h-3"]
    assert [list(p.input_ids) for p in from_shards.prompts] == [list(p.input_ids) for p in from_jsonl.prompts]
    assert [e["id"] for e in from_shards.excluded] == ["h-1"]


def test_a_mixture_of_held_out_prompts_takes_each_sources_count_and_names_its_source(tmp_path, renderer,
                                                                                     training_data):
    from eagle3_pipeline.conversations.dataset import parse_sources

    first = _write_jsonl(tmp_path / "first.jsonl", HELD[:2])
    second = _write_jsonl(tmp_path / "second.jsonl", [_chat("t-0", "A question never trained on?", "x"), *HELD[2:]])
    sources = tuple(parse_sources([{"path": str(first)}, {"path": str(second), "name": "traffic", "count": 2}]))
    selection = select_heldout_prompts(sources, renderer, training_data, 10)
    # traffic's first two records only; t-0 is a training id without its source's prefix, h-1 a training prompt.
    assert [p.sample_id for p in selection.prompts] == ["first.h-0", "traffic.h-2"]
    assert [(e["id"], e["reason"]) for e in selection.excluded] == [
        ("first.h-1", "same prompt tokens as a training sample"), ("traffic.t-0", "same id as a training sample")]
    with pytest.raises(HeldoutError, match="no such file"):
        select_heldout_prompts((*sources, *parse_sources([{"path": str(tmp_path / "gone.jsonl")}])), renderer,
                               training_data, 10)


def test_the_evaluate_commands_prompts_a_file_a_folder_or_a_mixture_each_with_its_digest(tmp_path):
    from test_dataset_tables import write_parquet_shards

    from eagle3_pipeline.checksum import file_sha256
    from eagle3_pipeline.cli_args import dataset_arg
    from eagle3_pipeline.evaluate.command import BadInput, _prompts, shown_dataset

    held = _write_jsonl(tmp_path / "held.jsonl", HELD)
    path, digest = _prompts(dataset_arg(str(held)))
    assert path == held.resolve() and digest == file_sha256(held)  # a file's digest, as evaluations recorded it
    shards = write_parquet_shards(tmp_path / "shards", HELD, shards=2)
    _, folder_digest = _prompts(dataset_arg(str(shards)))
    (shards / "train-00001-of-00002.parquet").write_bytes(b"changed")
    assert _prompts(dataset_arg(str(shards)))[1] != folder_digest  # a shard's content is in the digest
    mixture = dataset_arg(json.dumps([{"path": str(held), "count": 2}, {"path": str(shards), "name": "more"}]))
    sources, _ = _prompts(mixture)
    assert json.loads(shown_dataset(sources)) == [{"path": str(held.resolve()), "name": "held", "count": 2},
                                                  {"path": str(shards.resolve()), "name": "more"}]
    with pytest.raises(BadInput, match="takes a count per source"):
        _prompts(dataset_arg(json.dumps([{"path": str(held), "weight": 1}, {"path": str(shards), "weight": 1}])))
    with pytest.raises(BadInput, match=r"gone\.jsonl: no such file"):
        _prompts(dataset_arg(json.dumps([{"path": str(held)}, {"path": str(tmp_path / "gone.jsonl")}])))
