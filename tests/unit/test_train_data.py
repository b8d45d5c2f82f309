"""Training data: a real extraction output directory (written with the store's own functions),
packed into token-budget batches, sharded over ranks, loaded, and resumed."""

from __future__ import annotations

import json
import threading
from dataclasses import replace

import pytest
import torch
from extraction_settings import RUN, settings
from safetensors.torch import load_file, save_file

from eagle3_pipeline.extract import store
from eagle3_pipeline.train import data as train_data
from eagle3_pipeline.train.data import (
    DataError,
    DataState,
    batches,
    load_batch,
    open_dataset,
    pack,
    prefetch,
    shard,
)
from eagle3_pipeline.train.kernels import positions_from_doc_ids

HIDDEN = 4
AUX_LAYERS = [0, 1, 2]
VOCAB = 50
SHARD = 4
NUM_RECORDS = 23
LONG = 5  # the ordinal of the one sample longer than the budget
BUDGET = 32
SETTINGS = settings(HIDDEN, AUX_LAYERS, VOCAB, SHARD, "bfloat16")


def tokens_of(ordinal: int) -> int:
    return 45 if ordinal == LONG else 3 + (ordinal * 7) % 17


def store_sample(out_dir, ordinal: int) -> dict:
    tokens = tokens_of(ordinal)
    generator = torch.Generator().manual_seed(ordinal)
    ids = torch.randint(0, VOCAB, (tokens,), generator=generator).to(torch.int32)
    mask = (torch.rand(tokens, generator=generator) > 0.4).to(torch.uint8)
    aux = torch.randn(tokens, len(AUX_LAYERS) * HIDDEN, generator=generator).to(torch.bfloat16)
    last = torch.randn(tokens, HIDDEN, generator=generator).to(torch.bfloat16)
    file = f"{store.shard_dir_name(ordinal, SHARD)}/s-{ordinal}{store.SAMPLE_SUFFIX}"
    size, sha = store.write_sample(out_dir / file, ids, mask, aux, last, {"format": store.FORMAT, "id": f"s-{ordinal}"})
    return {"key": f"key-{ordinal}", "status": "ok", "ordinal": ordinal, "line": ordinal + 1, "id": f"s-{ordinal}",
            "file": file, "tokens": tokens, "loss_tokens": int(mask.sum()), "bytes": size, "sha256": sha}


def build(out_dir, num_records: int = NUM_RECORDS, parts: int = 2):
    store.claim_settings(out_dir, SETTINGS)
    for part in range(parts):
        ordinals = [i for i in range(num_records) if i % parts == part]
        samples = [store_sample(out_dir, i) for i in ordinals]
        store.write_part_manifest(out_dir, part, parts, samples, [], [], len(ordinals), RUN)
    store.merge(out_dir)
    return out_dir


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return build(tmp_path_factory.mktemp("extracted"))


@pytest.fixture()
def data(data_dir):
    return open_dataset(data_dir)


def test_open_reads_the_sample_list_of_the_manifest(data):
    assert len(data.samples) == NUM_RECORDS
    assert [s.id for s in data.samples] == [f"s-{i}" for i in range(NUM_RECORDS)]
    assert [s.tokens for s in data.samples] == [tokens_of(i) for i in range(NUM_RECORDS)]
    assert [s.index for s in data.samples] == list(range(NUM_RECORDS))
    assert (data.n_aux, data.hidden_size, data.dtype) == (3, HIDDEN, torch.bfloat16)


@pytest.mark.parametrize("seed,epoch", [(0, 0), (0, 1), (7, 3)])
def test_packing_respects_the_budget_and_covers_every_sample_once(data, seed, epoch):
    packed = pack(data.samples, BUDGET, seed, epoch)
    flat = [i for batch in packed for i in batch]
    assert sorted(flat) == list(range(NUM_RECORDS))
    for batch in packed:
        total = sum(data.samples[i].tokens for i in batch)
        assert total <= BUDGET or batch == [LONG]
    # Greedy first-fit leaves little room: fewer batches than a sample per batch by far.
    assert len(packed) <= sum(s.tokens for s in data.samples) // BUDGET + 3


def test_packing_is_deterministic_per_seed_and_epoch(data):
    assert pack(data.samples, BUDGET, 1, 2) == pack(data.samples, BUDGET, 1, 2)
    assert pack(data.samples, BUDGET, 1, 2) != pack(data.samples, BUDGET, 1, 3)
    assert pack(data.samples, BUDGET, 1, 2) != pack(data.samples, BUDGET, 2, 2)


def test_rank_shards_are_equal_length_disjoint_and_drop_only_the_remainder(data):
    packed = pack(data.samples, BUDGET, 0, 0)
    for world in (1, 2, 3, 4):
        shards = [shard(packed, rank, world) for rank in range(world)]
        assert len({len(s) for s in shards}) == 1
        assert len(shards[0]) == len(packed) // world
        seen = [tuple(b) for s in shards for b in s]
        assert len(seen) == len(set(seen)) == len(packed) // world * world
    with pytest.raises(DataError, match="rank 2 of world 2"):
        shard(packed, 2, 2)


def test_a_step_takes_the_same_batches_whatever_the_number_of_processes(data):
    # A global batch of G packed batches per step: G processes with one each, or fewer accumulating G / world.
    packed = [tuple(b) for b in pack(data.samples, BUDGET, 0, 0)]
    G = 4
    steps = len(packed) // G
    assert steps >= 2
    for world in (1, 2, 4):
        group = G // world
        shards = [shard([list(b) for b in packed], rank, world, group) for rank in range(world)]
        assert {len(s) for s in shards} == {steps * group}
        for step in range(steps):
            taken = {tuple(s[i]) for s in shards for i in range(step * group, (step + 1) * group)}
            assert taken == set(packed[step * G: (step + 1) * G]), (world, step)
    with pytest.raises(DataError, match="group 0"):
        shard([list(b) for b in packed], 0, 1, 0)


def test_split_is_stable_under_reordering_and_by_id(data):
    train, held = data.split(0.3)
    assert {s.id for s in train} | {s.id for s in held} == {s.id for s in data.samples}
    assert not {s.id for s in train} & {s.id for s in held}
    assert held  # 23 samples at 30 %: a few held out
    shuffled = replace(data, samples=list(reversed(data.samples)))
    train2, held2 = shuffled.split(0.3)
    assert {s.id for s in held2} == {s.id for s in held}
    assert data.split(0.0)[1] == []
    with pytest.raises(DataError, match="eval_ratio"):
        data.split(1.0)


def test_load_batch_equals_the_files_with_doc_and_position_ids(data, data_dir):
    indices = [3, 0, 7]
    batch = load_batch(data, indices)
    files = [load_file(data_dir / data.samples[i].file) for i in indices]
    assert torch.equal(batch.input_ids, torch.cat([f["input_ids"] for f in files]).long())
    assert torch.equal(batch.loss_mask, torch.cat([f["loss_mask"] for f in files]).bool())
    assert torch.equal(batch.aux_hidden, torch.cat([f["aux_hidden_states"] for f in files]))
    assert torch.equal(batch.last_hidden, torch.cat([f["last_hidden_states"] for f in files]))
    assert batch.input_ids.dtype == torch.int64 and batch.loss_mask.dtype == torch.bool
    assert batch.aux_hidden.dtype == batch.last_hidden.dtype == torch.bfloat16
    assert batch.aux_hidden.shape == (batch.num_tokens, 3 * HIDDEN)
    lengths = [data.samples[i].tokens for i in indices]
    assert batch.doc_ids.tolist() == [d for d, n in enumerate(lengths) for _ in range(n)]
    assert batch.position_ids.tolist() == [p for n in lengths for p in range(n)]
    assert batch.sample_ids == ["s-3", "s-0", "s-7"]
    # The drafter's own default for packed rows agrees (forward_ttt takes these with a batch dim).
    assert torch.equal(positions_from_doc_ids(batch.doc_ids[None])[0], batch.position_ids)


def test_a_sample_longer_than_the_budget_is_truncated_in_its_own_batch(data, data_dir):
    batch = load_batch(data, [LONG], max_tokens=BUDGET)
    stored = load_file(data_dir / data.samples[LONG].file)
    assert batch.num_tokens == BUDGET
    assert torch.equal(batch.aux_hidden, stored["aux_hidden_states"][:BUDGET])
    assert batch.position_ids.tolist() == list(range(BUDGET))


def test_resume_from_a_state_yields_the_remaining_batches(data):
    train, _ = data.split(0.2)
    for rank in (0, 1):
        full = list(batches(data, BUDGET, 5, rank, 2, samples=train, epochs=3))
        assert [s for s, _ in full][-1] == DataState(3, 0)
        for cut in (1, len(full) // 2, len(full) - 1):
            saved = json.loads(json.dumps(full[cut - 1][0].to_dict()))
            rest = list(batches(data, BUDGET, 5, rank, 2, DataState.from_dict(saved), samples=train, epochs=3))
            assert [s for s, _ in rest] == [s for s, _ in full[cut:]]
            assert [b.sample_ids for _, b in rest] == [b.sample_ids for _, b in full[cut:]]
            assert torch.equal(rest[0][1].aux_hidden, full[cut][1].aux_hidden)
    # An epoch of the stream is this rank's shard of that epoch's packing, every batch within budget.
    epoch0 = [b for s, b in full if s.epoch == 0 or s == DataState(1, 0)]
    expected = shard(pack(train, BUDGET, 5, 0), 1, 2)
    assert [b.sample_ids for b in epoch0] == [[data.samples[i].id for i in ids] for ids in expected]
    assert all(b.num_tokens <= BUDGET for _, b in full)


def test_batches_read_ahead_in_a_thread_come_in_order_and_a_failure_comes_where_it_happened(data):
    want = list(batches(data, BUDGET, 5, 0, 1, epochs=2))
    got = list(prefetch(batches(data, BUDGET, 5, 0, 1, epochs=2), depth=2))
    assert [s for s, _ in got] == [s for s, _ in want]
    assert all(torch.equal(a.aux_hidden, b.aux_hidden) and a.sample_ids == b.sample_ids
               for (_, a), (_, b) in zip(got, want))

    def failing():
        yield from want[:3]
        raise DataError("sample 7: its file is cut short")

    seen = []
    with pytest.raises(DataError, match="cut short"):
        for state, _ in prefetch(failing(), depth=2):
            seen.append(state)
    assert seen == [s for s, _ in want[:3]]  # every batch read before the failure was trained on first


def test_leaving_a_loop_over_prefetched_batches_stops_its_thread(data):
    stream = prefetch(batches(data, BUDGET, 5, 0, 1), depth=1)  # no epoch limit: it would read forever
    next(stream)
    stream.close()
    assert not [t for t in threading.enumerate() if t.name == "batch-prefetch" and t.is_alive()]


def test_a_state_from_another_run_shape_is_refused(data):
    with pytest.raises(DataError, match="resume with the seed"):
        next(batches(data, BUDGET, 0, 0, 1, DataState(0, 10_000)))
    with pytest.raises(DataError, match="expected"):
        DataState.from_dict({"epoch": 1})
    with pytest.raises(DataError, match="fewer than 64 batches"):
        next(batches(data, 10_000, 0, 0, 64))


def test_clear_errors_for_unusable_directories(tmp_path, data_dir):
    with pytest.raises(DataError, match="no such directory"):
        open_dataset(tmp_path / "absent")
    with pytest.raises(DataError, match="no data_config.json"):
        open_dataset(tmp_path)
    manifest = json.loads((data_dir / store.MANIFEST_FILE).read_text())
    for change, message in (({"format_version": 99}, "version 99"), ({"format": "other"}, "'other'"),
                            ({"shards": {}, "num_samples": 0}, "no samples")):
        (tmp_path / store.MANIFEST_FILE).write_text(json.dumps({**manifest, **change}))
        with pytest.raises(DataError, match=message):
            open_dataset(tmp_path)


def test_a_file_not_matching_the_manifest_is_named(tmp_path, data_dir):
    out = build(tmp_path / "d", num_records=4, parts=1)
    data = open_dataset(out)
    target = out / data.samples[2].file
    tensors = load_file(target)
    tensors["aux_hidden_states"] = tensors["aux_hidden_states"][:, :HIDDEN].contiguous()
    save_file(tensors, target)
    with pytest.raises(DataError, match=r"s-2\.safetensors: aux_hidden_states is \(\d+, 4\)"):
        load_batch(data, [0, 2])
    tensors["aux_hidden_states"] = torch.zeros(tokens_of(2), 3 * HIDDEN)  # float32, not the manifest's
    save_file(tensors, target)
    with pytest.raises(DataError, match="s-2.safetensors: aux_hidden_states is torch.float32"):
        load_batch(data, [2])
    target.unlink()
    with pytest.raises(DataError, match="s-2.safetensors: missing"):
        load_batch(data, [2])
    target.write_bytes(b"not a safetensors file")
    with pytest.raises(DataError, match="s-2.safetensors: unreadable"):
        load_batch(data, [2])
    assert train_data.PACK_WINDOW > 0


def test_the_opening_mask_is_what_serving_a_first_answer_drafts():
    # Four packed samples: two assistant turns; one turn; no assistant token; a one-token answer.
    loss_mask = torch.tensor([0, 1, 1, 1, 1, 0, 1, 1, 1, 1, 0, 0, 0, 0, 1], dtype=torch.bool)
    doc_ids = torch.tensor([0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 3])
    # Tokens 2..N of each sample's first run: never its first token (the prefill's), never a later turn.
    assert train_data.opening_mask(loss_mask, doc_ids, 3).int().tolist() == \
        [0, 0, 1, 1, 0, 0, 0, 0, 1, 1, 0, 0, 0, 0, 0]
    assert train_data.opening_mask(loss_mask, doc_ids, 100).int().tolist() == \
        [0, 0, 1, 1, 1, 0, 0, 0, 1, 1, 0, 0, 0, 0, 0]
    assert not train_data.opening_mask(loss_mask, doc_ids, 1).any()
    # A sample whose first turn ends where the next sample's begins is two runs, not one.
    joined = train_data.opening_mask(torch.ones(6, dtype=torch.bool), torch.tensor([0, 0, 0, 1, 1, 1]), 100)
    assert joined.int().tolist() == [0, 1, 1, 0, 1, 1]
