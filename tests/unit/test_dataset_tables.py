"""Datasets as hubs publish them: Parquet shards, Arrow files and Hugging Face dataset folders.

The same conversations in every layout give the same samples (ordinal, id, messages); a row
group that cannot be read costs its rows and no other; a file cut short is an error naming it.
"""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from eagle3_pipeline.conversations.dataset import DatasetError, Sample, Skip, dataset_facts, read_dataset

RECORDS = [
    {"id": f"c{i}", "conversations": [{"from": "human", "value": f"question {i}"},
                                      {"from": "gpt", "value": f"answer {i} " * (i % 3 + 1)}]}
    for i in range(11)
]
# OpenAI messages and an unusable record (no assistant text) among them, as real mixtures hold.
RECORDS[4] = {"id": "c4", "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
RECORDS[7] = {"id": "c7", "conversations": []}


def outcomes(items):
    return [(i.ordinal, i.sample_id, i.messages) if isinstance(i, Sample) else (i.ordinal, i.sample_id, i.reason)
            for i in items]


def table(records):
    """The records as one table whose columns are those of every record (from_pylist takes the first one's)."""
    return pa.Table.from_struct_array(pa.array(records))


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def write_parquet_shards(folder, records, shards=3, row_group_size=2):
    folder.mkdir()
    step = -(-len(records) // shards)
    for k in range(shards):
        pq.write_table(table(records[k * step:(k + 1) * step]), folder / f"train-{k:05d}-of-{shards:05d}.parquet",
                       row_group_size=row_group_size)
    return folder


def write_saved_dataset(folder, records, files=2):
    """The layout datasets.save_to_disk writes: Arrow stream files, state.json naming them, dataset_info.json."""
    folder.mkdir()
    step = -(-len(records) // files)
    names = []
    for k in range(files):
        name = f"data-{k:05d}-of-{files:05d}.arrow"
        part = table(records[k * step:(k + 1) * step])
        with pa.OSFile(str(folder / name), "wb") as sink, pa.ipc.new_stream(sink, part.schema) as writer:
            for batch in part.to_batches(max_chunksize=2):
                writer.write_batch(batch)
        names.append(name)
    (folder / "state.json").write_text(json.dumps({"_data_files": [{"filename": n} for n in names],
                                                   "_split": "train"}))
    (folder / "dataset_info.json").write_text(json.dumps({"features": {}}))
    return folder


def test_the_same_conversations_in_every_layout_give_the_same_samples(tmp_path):
    expected = outcomes(read_dataset(write_jsonl(tmp_path / "data.jsonl", RECORDS)))
    assert [o[2] for o in expected].count("empty_conversation") == 1 and len(expected) == len(RECORDS)
    (tmp_path / "data.json").write_text(json.dumps(RECORDS, indent=1))
    one = tmp_path / "one.parquet"
    pq.write_table(table(RECORDS), one, row_group_size=3)
    arrow_file = tmp_path / "one.arrow"
    with pa.OSFile(str(arrow_file), "wb") as sink, pa.ipc.new_file(sink, table(RECORDS).schema) as writer:
        writer.write_table(table(RECORDS), max_chunksize=4)
    layouts = {
        "json array": tmp_path / "data.json",
        "parquet": one,
        "parquet shards": write_parquet_shards(tmp_path / "shards", RECORDS),
        "save_to_disk folder": write_saved_dataset(tmp_path / "saved", RECORDS),
        "arrow file": arrow_file,
    }
    for name, path in layouts.items():
        assert outcomes(read_dataset(path)) == expected, name
    # num_samples: the first N records of the whole folder, across its shards
    assert outcomes(read_dataset(layouts["parquet shards"], num_samples=5)) == expected[:5]


def test_a_folder_of_shards_records_each_file_and_reads_in_name_order(tmp_path):
    folder = write_parquet_shards(tmp_path / "shards", RECORDS, shards=2)
    (folder / "README.md").write_text("not data")
    facts = dataset_facts(folder)
    assert [f["name"] for f in facts["files"]] == ["train-00000-of-00002.parquet", "train-00001-of-00002.parquet"]
    assert all(len(f["sha256"]) == 64 for f in facts["files"])
    assert [i.sample_id for i in read_dataset(folder)] == [r["id"] for r in RECORDS]


def test_a_row_group_that_cannot_be_read_costs_its_rows_only(tmp_path):
    path = tmp_path / "data.parquet"
    pq.write_table(table(RECORDS), path, row_group_size=4, compression="snappy")
    column = pq.ParquetFile(path).metadata.row_group(1).column(1)  # the conversations of rows 5-8
    data = bytearray(path.read_bytes())
    start = column.data_page_offset
    data[start + 8:start + column.total_compressed_size - 8] = b"\xff" * (column.total_compressed_size - 16)
    path.write_bytes(bytes(data))
    items = list(read_dataset(path))
    assert [i.ordinal for i in items] == list(range(len(RECORDS)))
    bad = [i for i in items if isinstance(i, Skip) and i.reason == "unreadable_row_group"]
    assert [i.ordinal for i in bad] == [4, 5, 6, 7]
    assert "data.parquet row 5" in bad[0].detail and "row group 1" in bad[0].detail
    assert outcomes(items[8:]) == outcomes(read_dataset(write_jsonl(tmp_path / "d.jsonl", RECORDS)))[8:]


def test_a_parquet_file_cut_short_is_an_error_naming_it(tmp_path):
    path = tmp_path / "train-00000-of-00001.parquet"
    pq.write_table(table(RECORDS), path)
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(DatasetError, match=r"train-00000-of-00001.parquet: not a readable Parquet file .*fetch it"):
        list(read_dataset(path))


def test_an_arrow_stream_cut_short_keeps_every_row_before_the_cut(tmp_path):
    folder = write_saved_dataset(tmp_path / "saved", RECORDS, files=1)
    arrow = folder / "data-00000-of-00001.arrow"
    arrow.write_bytes(arrow.read_bytes()[:-200])
    items = list(read_dataset(folder))
    *kept, last = items
    assert isinstance(last, Skip) and last.reason == "truncated" and "data-00000-of-00001.arrow row" in last.detail
    assert outcomes(kept) == outcomes(read_dataset(write_jsonl(tmp_path / "d.jsonl", RECORDS)))[:len(kept)]


def test_folders_that_hold_no_dataset_say_what_to_point_at(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(DatasetError, match="no dataset files there"):
        list(read_dataset(tmp_path / "empty"))
    splits = tmp_path / "dict"
    (splits / "train").mkdir(parents=True)
    (splits / "test").mkdir()
    (splits / "dataset_dict.json").write_text('{"splits": ["train", "test"]}')
    with pytest.raises(DatasetError, match=r"splits \(test, train\): point at one split's folder"):
        list(read_dataset(splits))


def test_a_mixture_takes_each_sources_count_or_weighted_share_with_ids_that_name_it(tmp_path):
    from eagle3_pipeline.conversations.dataset import parse_sources

    sharegpt = write_parquet_shards(tmp_path / "sharegpt", RECORDS, shards=2)
    ours = write_jsonl(tmp_path / "traffic.jsonl", [{k: v for k, v in r.items() if k != "id"} for r in RECORDS])
    counted = parse_sources([{"path": str(sharegpt), "count": 6}, {"path": str(ours), "name": "ours", "count": 3}])
    items = list(read_dataset(counted))
    assert [i.ordinal for i in items] == list(range(9))
    assert [i.sample_id for i in items] == [f"sharegpt.c{k}" for k in range(6)] + ["ours.line-1", "ours.line-2",
                                                                                    "ours.line-3"]
    assert {i.source for i in items} == {"sharegpt", "ours"} and items[6].messages == items[0].messages
    # Shares of num_samples by weight (3:1 of 8), the largest remainders rounded up; skips keep their place.
    weighted = parse_sources(json.dumps([{"path": str(sharegpt), "weight": 3}, {"path": str(ours), "weight": 1}]))
    items = list(read_dataset(weighted, num_samples=8))
    assert [i.source for i in items] == ["sharegpt"] * 6 + ["traffic"] * 2
    assert [i.sample_id for i in items][:6] == [f"sharegpt.c{k}" for k in range(6)]
    # The same records as a JSON Lines source and a Parquet one: the same messages, told apart by their ids.
    twice = list(read_dataset(parse_sources([{"path": str(sharegpt), "name": "a"},
                                             {"path": str(write_jsonl(tmp_path / "b.jsonl", RECORDS))}])))
    first, second = twice[:len(RECORDS)], twice[len(RECORDS):]
    assert [o[2] for o in outcomes(first)] == [o[2] for o in outcomes(second)]
    assert [i.sample_id.split(".", 1)[1] for i in first] == [i.sample_id.split(".", 1)[1] for i in second]
    assert [i.reason for i in twice if isinstance(i, Skip)] == ["empty_conversation"] * 2


@pytest.mark.parametrize(("sources", "message"), [
    ([{"path": "/a.jsonl", "count": 2}, {"path": "/b/a.parquet"}], "the name.s. a stand for more than one source"),
    ([{"path": "/a.jsonl", "weight": 1}, {"path": "/b.jsonl", "count": 3}], "every source a weight, or none"),
    ([{"path": "/a.jsonl", "count": 0}], "count must be a whole number >= 1"),
    ([{"path": "/a.jsonl", "share": 0.5}], "unknown key.s. share"),
    ([], "non-empty list"),
])
def test_a_mixture_that_cannot_be_read_as_meant_is_refused_naming_the_source(sources, message):
    from eagle3_pipeline.conversations.dataset import parse_sources

    with pytest.raises(ValueError, match=message):
        parse_sources(sources)


def test_weights_without_a_total_ask_for_num_samples(tmp_path):
    from eagle3_pipeline.conversations.dataset import parse_sources

    path = write_jsonl(tmp_path / "a.jsonl", RECORDS)
    with pytest.raises(ValueError, match="share num_samples"):
        list(read_dataset(parse_sources([{"path": str(path), "weight": 1}])))
