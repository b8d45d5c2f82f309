"""The extracted dataset on disk: sample files, the journal, the settings lock, merge and verify.

Every test writes real sample files with ``store.write_sample`` (small random tensors, no
server) into a real output directory and reads them back with safetensors; corruption is
done to the bytes on disk, the way a crash, a full disk or a bad drive would do it.
"""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest
import torch
from extraction_settings import RUN, settings
from safetensors import safe_open
from safetensors.torch import load_file

from eagle3_pipeline.extract import store
from eagle3_pipeline.extract.store import (
    FORMAT,
    Journal,
    StoreError,
    claim_settings,
    file_sha256,
    merge,
    parse_part,
    shard_dir_name,
    stored_ok,
    verify_dataset,
    write_part_manifest,
    write_sample,
)

HIDDEN = 8
AUX_LAYERS = [0, 2]
VOCAB = 32
SHARD = 3
SETTINGS = settings(HIDDEN, AUX_LAYERS, VOCAB, SHARD, "float32")


def sample_tensors(ordinal: int, tokens: int):
    """(input_ids int32, loss_mask uint8, aux, last) of one synthetic sample, reproducible."""
    generator = torch.Generator().manual_seed(ordinal)
    ids = torch.randint(0, VOCAB, (tokens,), generator=generator).to(torch.int32)
    mask = (torch.arange(tokens) >= tokens // 3).to(torch.uint8)
    aux = torch.randn(tokens, len(AUX_LAYERS) * HIDDEN, generator=generator)
    last = torch.randn(tokens, HIDDEN, generator=generator)
    return ids, mask, aux, last


def store_sample(out_dir, ordinal: int, tokens: int | None = None) -> dict:
    """Write one sample file; return its journal record (as the job writes it)."""
    tokens = tokens or 5 + ordinal % 4
    ids, mask, aux, last = sample_tensors(ordinal, tokens)
    file = f"{shard_dir_name(ordinal, SHARD)}/s-{ordinal}{store.SAMPLE_SUFFIX}"
    size, sha = write_sample(out_dir / file, ids, mask, aux, last, {"format": FORMAT, "id": f"s-{ordinal}"})
    return {"key": f"key-{ordinal}", "status": "ok", "ordinal": ordinal, "line": ordinal + 1, "id": f"s-{ordinal}",
            "file": file, "tokens": tokens, "loss_tokens": int(mask.sum()), "bytes": size, "sha256": sha}


def build_dataset(out_dir, num_records: int = 7, parts: int = 2, merged: bool = True) -> list[dict]:
    """A complete output directory: settings, samples of every part, part manifests, merged."""
    claim_settings(out_dir, SETTINGS)
    records = []
    for part in range(parts):
        ordinals = [i for i in range(num_records) if i % parts == part]
        samples = [store_sample(out_dir, i) for i in ordinals]
        records += samples
        write_part_manifest(out_dir, part, parts, samples, [], [], len(ordinals), RUN)
    if merged:
        merge(out_dir)
    return sorted(records, key=lambda r: r["ordinal"])


def problems_of(out_dir) -> list[str]:
    report = verify_dataset(out_dir)
    assert report["ok"] is not bool(report["problems"])
    return report["problems"]


# -- small pieces ------------------------------------------------------------------------------
def test_parts_and_shards_are_named_from_their_numbers():
    assert parse_part("0/1") == (0, 1)
    assert parse_part("3/4") == (3, 4)
    for bad in ("4/4", "-1/2", "1", "a/b", "1/0"):
        with pytest.raises(ValueError, match="part"):
            parse_part(bad)
    assert shard_dir_name(0, 2000) == "rows_0-2000"
    assert shard_dir_name(1999, 2000) == "rows_0-2000"
    assert shard_dir_name(2000, 2000) == "rows_2000-4000"
    assert store.part_name(1, 2) == "part-1-of-2"


def test_write_sample_returns_the_size_and_checksum_of_the_bytes_on_disk(tmp_path):
    ids, mask, aux, last = sample_tensors(0, 6)
    path = tmp_path / "rows_0-3" / "s-0.safetensors"

    size, sha = write_sample(path, ids, mask, aux, last, {"format": FORMAT, "id": "s-0"})

    assert sha == file_sha256(path)
    assert size == path.stat().st_size
    assert sorted(p.name for p in path.parent.iterdir()) == ["s-0.safetensors"], "a temp file was left behind"
    loaded = load_file(str(path))
    for name, tensor in (("input_ids", ids), ("loss_mask", mask), ("aux_hidden_states", aux),
                         ("last_hidden_states", last)):
        assert torch.equal(loaded[name], tensor) and loaded[name].dtype == tensor.dtype, name
    with safe_open(str(path), framework="pt") as handle:
        assert handle.metadata() == {"format": FORMAT, "id": "s-0"}


# -- the journal -------------------------------------------------------------------------------
def test_a_torn_last_journal_line_is_cut_off_and_later_appends_are_whole(tmp_path):
    path = tmp_path / "parts" / "part-0-of-1.journal.jsonl"
    journal = Journal(path)
    journal.append({"key": "a", "status": "ok", "n": 1})
    journal.append({"key": "b", "status": "failed", "n": 2})
    journal.close()
    whole = path.read_bytes()
    with open(path, "ab") as handle:  # kill -9 in the middle of an append
        handle.write(b'{"key":"c","sta')

    records = Journal(path).load()

    assert sorted(records) == ["a", "b"]
    assert path.read_bytes() == whole, "the torn line must be cut off on disk"
    journal = Journal(path)
    journal.append({"key": "c", "status": "ok", "n": 3})
    journal.close()
    lines = path.read_text().splitlines()
    assert [json.loads(line)["key"] for line in lines] == ["a", "b", "c"]
    assert sorted(Journal(path).load()) == ["a", "b", "c"]


def test_a_journal_holding_only_a_torn_line_loads_empty(tmp_path):
    path = tmp_path / "j.jsonl"
    path.write_bytes(b'{"key":"a","status":"o')

    assert Journal(path).load() == {}
    assert path.read_bytes() == b""
    assert Journal(tmp_path / "absent.jsonl").load() == {}
    assert not (tmp_path / "absent.jsonl").exists()


def test_a_read_only_load_leaves_a_torn_line_for_the_live_run_appending_it(tmp_path):
    path = tmp_path / "j.jsonl"
    path.write_bytes(b'{"key":"a","status":"ok"}\n{"key":"b","sta')

    assert sorted(Journal(path).load(repair=False)) == ["a"]
    assert path.read_bytes() == b'{"key":"a","status":"ok"}\n{"key":"b","sta'


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full (Linux) to stand for a full disk")
def test_a_journal_append_on_a_full_disk_raises_and_the_journal_still_closes():
    journal = Journal(Path("/dev/full"))  # every write: ENOSPC

    with pytest.raises(OSError) as caught:
        journal.append({"key": "a", "status": "ok"})

    assert caught.value.errno == errno.ENOSPC
    journal.close()  # the lost line is not retried (which would raise again, from close)


def test_the_last_journal_record_of_a_key_wins(tmp_path):
    journal = Journal(tmp_path / "j.jsonl")
    journal.append({"key": "a", "status": "failed"})
    journal.append({"key": "a", "status": "ok"})
    journal.close()

    assert Journal(tmp_path / "j.jsonl").load()["a"]["status"] == "ok"


def test_a_journal_record_counts_only_while_its_file_has_the_recorded_size(tmp_path):
    record = store_sample(tmp_path, 0)
    assert stored_ok(tmp_path, record)
    assert not stored_ok(tmp_path, {**record, "status": "failed"})
    assert not stored_ok(tmp_path, None)
    assert not stored_ok(tmp_path, {**record, "bytes": record["bytes"] + 1})
    path = tmp_path / record["file"]
    with open(path, "r+b") as handle:
        handle.truncate(record["bytes"] - 10)
    assert not stored_ok(tmp_path, record)
    path.unlink()
    assert not stored_ok(tmp_path, record)


# -- the settings lock -------------------------------------------------------------------------
def test_the_first_claim_records_the_settings_and_equal_settings_pass(tmp_path):
    out = tmp_path / "out"
    assert claim_settings(out, SETTINGS) is True
    assert json.loads((out / store.SETTINGS_FILE).read_text()) == SETTINGS
    assert claim_settings(out, dict(SETTINGS)) is False
    assert store.read_settings(out) == SETTINGS


def test_a_compare_only_claim_creates_nothing(tmp_path):
    out = tmp_path / "out"
    assert claim_settings(out, SETTINGS, create=False) is False
    assert not out.exists()


def test_informational_settings_may_differ_between_runs(tmp_path):
    claim_settings(tmp_path, SETTINGS)
    moved = {**SETTINGS, "target_model_path": "/elsewhere/target", "engine_version": "0.2.0",
             "chat_template_file": "/tmp/template.jinja"}

    assert claim_settings(tmp_path, moved) is False
    assert json.loads((tmp_path / store.SETTINGS_FILE).read_text()) == SETTINGS


def test_a_settings_mismatch_names_every_differing_field_and_nothing_else(tmp_path):
    claim_settings(tmp_path, SETTINGS)
    recorded = (tmp_path / store.SETTINGS_FILE).read_bytes()
    other = {**SETTINGS, "aux_layers": [1, 2], "max_length": 128, "target_model_path": "/elsewhere",
             "engine_version": "9"}

    with pytest.raises(StoreError) as caught:
        claim_settings(tmp_path, other)

    message = str(caught.value)
    assert "aux_layers: recorded [0, 2], now [1, 2]" in message
    assert "max_length: recorded 64, now 128" in message
    for same_or_informational in ("hidden_size", "dtype", "target_model_path", "engine_version", "vocab_size"):
        assert same_or_informational not in message
    assert str(tmp_path) in message and "another output directory" in message
    assert (tmp_path / store.SETTINGS_FILE).read_bytes() == recorded


def test_a_setting_present_on_one_side_only_is_a_mismatch(tmp_path):
    claim_settings(tmp_path, SETTINGS)
    with pytest.raises(StoreError, match="new_field: recorded None, now 1"):
        claim_settings(tmp_path, {**SETTINGS, "new_field": 1})


# -- merge -------------------------------------------------------------------------------------
def test_merge_refuses_while_a_part_is_missing(tmp_path):
    claim_settings(tmp_path, SETTINGS)
    write_part_manifest(tmp_path, 0, 2, [store_sample(tmp_path, 0)], [], [], 1, RUN)

    with pytest.raises(StoreError, match=r"parts \[1\] of 2 are not complete"):
        merge(tmp_path)
    assert not (tmp_path / store.MANIFEST_FILE).exists()
    assert not (tmp_path / store.TOKEN_COUNTS_FILE).exists()


def test_merge_refuses_with_no_part_and_with_parts_of_different_splits(tmp_path):
    claim_settings(tmp_path, SETTINGS)
    with pytest.raises(StoreError, match="no complete part yet"):
        merge(tmp_path)
    write_part_manifest(tmp_path, 0, 1, [store_sample(tmp_path, 0)], [], [], 1, RUN)
    write_part_manifest(tmp_path, 0, 2, [store_sample(tmp_path, 0)], [], [], 1, RUN)
    with pytest.raises(StoreError, match=r"parts of different splits \[1, 2\]"):
        merge(tmp_path)


def test_merge_without_settings_says_this_is_no_extraction_directory(tmp_path):
    with pytest.raises(StoreError, match="not an extraction output directory"):
        merge(tmp_path)


def test_merge_lists_every_sample_once_by_shard_with_its_checksum(tmp_path):
    records = build_dataset(tmp_path, num_records=7, parts=2, merged=False)
    skipped = {"line": 9, "id": "bad", "reason": "malformed_json", "detail": "not JSON"}
    write_part_manifest(tmp_path, 1, 2, [r for r in records if r["ordinal"] % 2], [skipped], [], 4, RUN)

    manifest, changed = merge(tmp_path)

    assert changed
    assert json.loads((tmp_path / store.MANIFEST_FILE).read_text()) == manifest
    assert list(manifest["shards"]) == ["rows_0-3", "rows_3-6", "rows_6-9"]
    listed = [entry for shard in manifest["shards"].values() for entry in shard["files"]]
    assert [entry["id"] for entry in listed] == [f"s-{i}" for i in range(7)]
    for entry, record in zip(listed, records):
        assert entry == {key: record[key] for key in ("file", "id", "line", "tokens", "loss_tokens", "bytes", "sha256")}
        assert entry["sha256"] == file_sha256(tmp_path / entry["file"])
    assert manifest["shards"]["rows_0-3"]["num_samples"] == 3
    assert manifest["num_samples"] == 7 and manifest["parts"] == 2
    assert manifest["num_records"] == 4 + 4
    assert manifest["num_tokens"] == sum(r["tokens"] for r in records)
    assert manifest["num_loss_tokens"] == sum(r["loss_tokens"] for r in records)
    assert manifest["bytes"] == sum(r["bytes"] for r in records)
    assert manifest["skipped"] == [skipped] and manifest["failed"] == []
    assert manifest["aux_layers"] == AUX_LAYERS and manifest["format"] == FORMAT
    assert manifest["dataset"] == RUN["dataset"]


def test_token_counts_are_the_bincount_of_the_stored_loss_masked_ids(tmp_path):
    build_dataset(tmp_path, num_records=7)

    expected = torch.zeros(VOCAB, dtype=torch.int64)
    for path in sorted(tmp_path.glob("rows_*/*.safetensors")):
        tensors = load_file(str(path))
        expected += torch.bincount(tensors["input_ids"][tensors["loss_mask"].bool()].long(), minlength=VOCAB)
    counts = load_file(str(tmp_path / store.TOKEN_COUNTS_FILE))["counts"]

    assert counts.dtype == torch.int64 and counts.shape == (VOCAB,)
    assert torch.equal(counts, expected)
    manifest = json.loads((tmp_path / store.MANIFEST_FILE).read_text())
    assert manifest["token_counts"]["loss_tokens"] == int(expected.sum()) == manifest["num_loss_tokens"]
    assert manifest["token_counts"]["sha256"] == file_sha256(tmp_path / store.TOKEN_COUNTS_FILE)


def test_a_second_merge_over_unchanged_parts_rewrites_nothing(tmp_path):
    build_dataset(tmp_path, merged=False)
    first, changed = merge(tmp_path)
    assert changed
    watched = [tmp_path / store.MANIFEST_FILE, tmp_path / store.TOKEN_COUNTS_FILE]
    before = [(p.stat().st_mtime_ns, p.stat().st_ino) for p in watched]

    second, changed = merge(tmp_path)

    assert changed is False
    assert second == first
    assert [(p.stat().st_mtime_ns, p.stat().st_ino) for p in watched] == before


# -- verify ------------------------------------------------------------------------------------
def test_verify_passes_a_whole_dataset(tmp_path):
    records = build_dataset(tmp_path)

    report = verify_dataset(tmp_path)

    assert report["ok"] and report["problems"] == [] and report["extra_files"] == []
    assert report["checked"] == report["num_samples"] == len(records)
    assert report["num_tokens"] == sum(r["tokens"] for r in records)


def test_verify_without_a_manifest_says_the_extraction_has_not_completed(tmp_path):
    build_dataset(tmp_path, merged=False)
    with pytest.raises(StoreError, match="has not completed"):
        verify_dataset(tmp_path)


def test_verify_catches_a_flipped_byte_by_its_checksum(tmp_path):
    records = build_dataset(tmp_path)
    path = tmp_path / records[3]["file"]
    data = bytearray(path.read_bytes())
    data[-5] ^= 0x01
    path.write_bytes(bytes(data))

    assert problems_of(tmp_path) == [f"{records[3]['file']}: checksum differs from the manifest (the file changed "
                                     "or is corrupt)"]
    assert verify_dataset(tmp_path, deep=False)["ok"], "the quick check compares sizes only"


def test_verify_catches_a_truncated_file(tmp_path):
    records = build_dataset(tmp_path)
    path = tmp_path / records[0]["file"]
    with open(path, "r+b") as handle:
        handle.truncate(records[0]["bytes"] // 2)

    expected = f"{records[0]['file']}: {records[0]['bytes'] // 2} bytes, the manifest says {records[0]['bytes']}"
    assert problems_of(tmp_path) == [expected]
    assert verify_dataset(tmp_path, deep=False)["problems"] == [expected]


def test_verify_catches_a_missing_file(tmp_path):
    records = build_dataset(tmp_path)
    (tmp_path / records[6]["file"]).unlink()

    assert problems_of(tmp_path) == [f"{records[6]['file']}: missing"]


def test_verify_lists_files_the_manifest_does_not_know(tmp_path):
    build_dataset(tmp_path)
    store_sample(tmp_path, 40)  # rows_39-42/s-40.safetensors: stored, never merged
    (tmp_path / "rows_0-3" / ".s-1.safetensors.abc.tmp").write_bytes(b"half")

    report = verify_dataset(tmp_path)

    assert report["extra_files"] == ["rows_0-3/.s-1.safetensors.abc.tmp", "rows_39-42/s-40.safetensors"]
    assert report["problems"] == []


def nan_sample(tmp_path, record: dict) -> None:
    """Rewrite a sample file with one NaN: same size (same shapes, same header), other bytes."""
    ids, mask, aux, last = sample_tensors(record["ordinal"], record["tokens"])
    aux[1, 2] = float("nan")
    size, _ = write_sample(tmp_path / record["file"], ids, mask, aux, last, {"format": FORMAT, "id": record["id"]})
    assert size == record["bytes"]


def test_verify_catches_a_nan_written_over_a_sample_by_its_checksum(tmp_path):
    records = build_dataset(tmp_path)
    nan_sample(tmp_path, records[2])

    assert verify_dataset(tmp_path, deep=False)["ok"], "same size: only the deep check can see it"
    assert problems_of(tmp_path) == [f"{records[2]['file']}: checksum differs from the manifest (the file changed "
                                     "or is corrupt)"]


def test_verify_catches_a_nan_even_when_the_manifest_records_its_checksum(tmp_path):
    records = build_dataset(tmp_path)
    nan_sample(tmp_path, records[2])
    manifest_path = tmp_path / store.MANIFEST_FILE
    manifest = json.loads(manifest_path.read_text())
    for entry in manifest["shards"]["rows_0-3"]["files"]:
        if entry["file"] == records[2]["file"]:
            entry["sha256"] = file_sha256(tmp_path / entry["file"])
    manifest_path.write_text(json.dumps(manifest))

    assert problems_of(tmp_path) == [f"{records[2]['file']}: aux_hidden_states has NaN or inf values"]


def test_verify_checks_shapes_dtypes_and_loss_tokens_against_the_manifest(tmp_path):
    records = build_dataset(tmp_path)
    manifest_path = tmp_path / store.MANIFEST_FILE
    manifest = json.loads(manifest_path.read_text())
    files = manifest["shards"]["rows_0-3"]["files"]
    files[1]["loss_tokens"] += 1
    manifest_path.write_text(json.dumps(manifest))
    assert problems_of(tmp_path) == [
        f"{records[1]['file']}: loss_mask has {records[1]['loss_tokens']} ones, the manifest says "
        f"{records[1]['loss_tokens'] + 1}"
    ]

    manifest["shards"]["rows_0-3"]["files"][1]["loss_tokens"] -= 1
    manifest["dtype"] = "bfloat16"
    manifest["hidden_size"] = HIDDEN * 2
    manifest_path.write_text(json.dumps(manifest))
    problems = problems_of(tmp_path)
    assert len(problems) == len(records)
    assert problems[0] == f"{records[0]['file']}: aux_hidden_states is ({records[0]['tokens']}, 16), expected " \
                          f"({records[0]['tokens']}, 32)"


def test_verify_catches_changed_token_counts(tmp_path):
    build_dataset(tmp_path)
    counts = tmp_path / store.TOKEN_COUNTS_FILE
    data = bytearray(counts.read_bytes())
    data[-1] ^= 0x01
    counts.write_bytes(bytes(data))

    assert problems_of(tmp_path) == [f"{store.TOKEN_COUNTS_FILE}: missing or changed since the merge"]
    os.unlink(counts)
    assert problems_of(tmp_path) == [f"{store.TOKEN_COUNTS_FILE}: missing or changed since the merge"]


def test_token_counts_over_many_files_match_a_count_of_every_file_whatever_the_batch(tmp_path, monkeypatch):
    from collections import Counter

    from safetensors.torch import save_file

    vocab = 50
    generator = torch.Generator().manual_seed(3)
    expected, names = Counter(), []
    for index in range(23):
        length = 1 + index * 3
        ids = torch.randint(0, vocab + 5, (length,), generator=generator, dtype=torch.int32)  # some beyond V
        mask = (torch.rand(length, generator=generator) > 0.3).to(torch.uint8)
        save_file({"input_ids": ids, "loss_mask": mask}, str(tmp_path / f"s{index}.safetensors"))
        names.append(f"s{index}.safetensors")
        expected.update(int(t) for t, m in zip(ids, mask) if m and t < vocab)
    want = torch.tensor([expected[t] for t in range(vocab)], dtype=torch.int64)
    for batch in (1, 7, 1 << 20):  # a bincount per file, per few files, and one for all
        monkeypatch.setattr(store, "COUNT_BATCH_TOKENS", batch)
        got = store.count_tokens(tmp_path, names, vocab)
        assert got.dtype == torch.int64 and torch.equal(got, want), batch
    assert torch.equal(store.count_tokens(tmp_path, [], vocab), torch.zeros(vocab, dtype=torch.int64))
