"""The draft vocabulary: the most frequent loss-masked target tokens, as d2t/t2d, and the checks on both maps."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from eagle3_pipeline.extract.store import MANIFEST_FILE, TOKEN_COUNTS_FILE, file_sha256
from eagle3_pipeline.train.vocab import (
    DEFAULT_DRAFT_VOCAB_SIZE,
    VocabError,
    build_draft_vocab,
    check_mapping,
    load_token_counts,
)


def counts_of(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


def test_most_frequent_tokens_ties_to_lower_id_sorted_by_target_id():
    vocab = build_draft_vocab(counts_of([5, 0, 7, 5, 1, 5]), 3)
    # 7 (id 2) first, then three 5s: ids 0 and 3 win the tie over id 5.
    assert vocab.target_ids().tolist() == [0, 2, 3]
    assert vocab.d2t.tolist() == [0, 1, 1]
    assert vocab.d2t.dtype == torch.int64
    assert vocab.t2d.tolist() == [True, False, True, True, False, False]
    assert vocab.num_seen == 3
    assert vocab.coverage == pytest.approx(17 / 23)
    check_mapping(vocab.d2t, vocab.t2d, 6)


def test_fewer_seen_than_draft_size_pads_with_lowest_unseen_ids():
    vocab = build_draft_vocab(counts_of([0, 0, 4, 0, 9, 0]), 4)
    assert vocab.target_ids().tolist() == [0, 1, 2, 4]
    assert vocab.num_seen == 2
    assert vocab.coverage == 1.0
    check_mapping(vocab.d2t, vocab.t2d, 6)


def test_matches_a_plain_sort_on_random_counts():
    generator = torch.Generator().manual_seed(0)
    counts = torch.randint(0, 6, (300,), generator=generator)  # many ties and zeros
    vocab = build_draft_vocab(counts, 120)
    expected = sorted(sorted(range(300), key=lambda i: (-int(counts[i]), i))[:120])
    assert vocab.target_ids().tolist() == expected
    assert torch.equal(vocab.t2d.nonzero().flatten(), vocab.target_ids())


def test_default_size_is_32000_or_the_target_vocabulary_when_smaller():
    assert build_draft_vocab(counts_of([3, 1, 2])).draft_vocab_size == 3
    big = torch.zeros(DEFAULT_DRAFT_VOCAB_SIZE + 5, dtype=torch.int64)
    assert build_draft_vocab(big).draft_vocab_size == DEFAULT_DRAFT_VOCAB_SIZE


def test_explicit_size_larger_than_target_vocabulary_is_refused_naming_both_and_the_variable():
    with pytest.raises(VocabError) as error:
        build_draft_vocab(counts_of([1, 2, 3]), 4)
    message = str(error.value)
    assert "eagle_training_draft_vocab_size=4" in message
    assert "(3 tokens)" in message


@pytest.mark.parametrize(
    ("counts", "size", "words"),
    [
        (counts_of([1, 2]), 0, "at least one token"),
        (counts_of([1, 2]), 1.5, "must be an integer"),
        (torch.tensor([1.0, 2.0]), 1, "must be integers"),
        (counts_of([1, -2]), 1, "non-negative"),
        (torch.zeros(2, 2, dtype=torch.int64), 1, "1-D"),
    ],
)
def test_bad_counts_or_sizes_are_refused(counts, size, words):
    with pytest.raises(VocabError, match=words):
        build_draft_vocab(counts, size)


def good_mapping() -> tuple[torch.Tensor, torch.Tensor]:
    vocab = build_draft_vocab(counts_of([0, 3, 0, 2, 1, 0, 5]), 4)  # target ids 1, 3, 4, 6
    return vocab.d2t.clone(), vocab.t2d.clone()


def test_check_mapping_refuses_each_inconsistency():
    d2t, t2d = good_mapping()
    check_mapping(d2t, t2d, 7)
    cases = []
    dup = d2t.clone()  # targets 1, 3, 4, 6
    dup[2] = 1  # draft 2 -> target 3, as draft 1
    cases.append((dup, t2d, "same target id"))
    out = d2t.clone()
    out[3] = 10
    cases.append((out, t2d, "outside the target vocabulary"))
    negative = d2t.clone()
    negative[0] = -5
    cases.append((negative, t2d, "outside the target vocabulary"))
    unsorted = torch.tensor([3, 0, 2, 3])  # targets 3, 1, 4, 6
    cases.append((unsorted, t2d, "not in target id order"))
    fewer = t2d.clone()
    fewer[6] = False
    cases.append((d2t, fewer, "t2d marks 3 target ids, d2t lists 4"))
    moved = t2d.clone()
    moved[6], moved[5] = False, True
    cases.append((d2t, moved, "does not mark the target ids d2t lists"))
    cases.append((d2t.int(), t2d, "int64"))
    cases.append((d2t, t2d.long(), "bool"))
    cases.append((d2t, t2d[:6], "target vocabulary has 7"))
    for bad_d2t, bad_t2d, words in cases:
        with pytest.raises(VocabError, match=words):
            check_mapping(bad_d2t, bad_t2d, 7)


def write_counts(directory, counts: torch.Tensor, manifest: dict | None = None) -> None:
    save_file({"counts": counts}, str(directory / TOKEN_COUNTS_FILE))
    if manifest is not None:
        (directory / MANIFEST_FILE).write_text(json.dumps(manifest))


def test_load_token_counts_checks_the_manifest(tmp_path):
    counts = counts_of([4, 0, 1])
    write_counts(tmp_path, counts)
    good = {"vocab_size": 3, "token_counts": {"sha256": file_sha256(tmp_path / TOKEN_COUNTS_FILE)}}
    (tmp_path / MANIFEST_FILE).write_text(json.dumps(good))
    assert torch.equal(load_token_counts(tmp_path), counts)

    (tmp_path / MANIFEST_FILE).write_text(json.dumps({**good, "token_counts": {"sha256": "0" * 64}}))
    with pytest.raises(VocabError, match="SHA-256 differs"):
        load_token_counts(tmp_path)
    (tmp_path / MANIFEST_FILE).write_text(json.dumps({**good, "vocab_size": 5}))
    with pytest.raises(VocabError, match="target has 5 tokens"):
        load_token_counts(tmp_path)


def test_load_token_counts_refuses_missing_or_malformed_files(tmp_path):
    with pytest.raises(VocabError, match="run the extraction"):
        load_token_counts(tmp_path)
    save_file({"other": counts_of([1])}, str(tmp_path / TOKEN_COUNTS_FILE))
    with pytest.raises(VocabError, match="no 'counts' tensor"):
        load_token_counts(tmp_path)
    write_counts(tmp_path, torch.tensor([1.0, 2.0]))
    with pytest.raises(VocabError, match=r"\[V\] int64"):
        load_token_counts(tmp_path)
    (tmp_path / TOKEN_COUNTS_FILE).write_bytes(b"not safetensors")
    with pytest.raises(VocabError, match="unreadable"):
        load_token_counts(tmp_path)
