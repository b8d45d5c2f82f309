"""Float8 storage of hidden states: the round trip's error bounds, the sample files, ``verify``, the readers,
``compare_datasets`` and ``convert-storage`` (in place, into a copy, stopped in its last step, refused).

Datasets are real output directories written with the store's own functions (as in
test_extract_store.py); the conversion runs as the command does, through ``convert.run``.
"""

from __future__ import annotations

import argparse
import json
import struct
from pathlib import Path

import pytest
import torch
from extraction_settings import RUN, settings
from safetensors.torch import load_file, save_file

from eagle3_pipeline.extract import convert, job, storage, store
from eagle3_pipeline.extract.storage import FLOAT8, FLOAT8_MAX, Layout, StorageError
from eagle3_pipeline.train.data import DataError, load_batch, open_dataset

HIDDEN = 32
AUX_LAYERS = [0, 1, 2]
VOCAB = 40
SHARD = 4
NUM_RECORDS = 9
SETTINGS = settings(HIDDEN, AUX_LAYERS, VOCAB, SHARD, "bfloat16")
E4M3_UNIT = 2.0**-4  # e4m3's unit roundoff: 3 stored mantissa bits
UNIT = {torch.bfloat16: 2.0**-8, torch.float32: 2.0**-24}  # the read-back's rounding into the target's dtype
SUBNORMAL_STEP = 2.0**-9  # e4m3fn's smallest subnormal


def hidden_states(tokens: int, width: int, seed: int, dtype=torch.bfloat16) -> torch.Tensor:
    """Heavy-tailed values like a residual stream's: a few channels hundreds of times the rest, some tiny."""
    generator = torch.Generator().manual_seed(seed)
    values = torch.randn(tokens, width, generator=generator)
    values = values / torch.rand(tokens, width, generator=generator).clamp(min=0.05)  # heavy tails
    values[:, 3] *= 300.0  # a massive-activation channel
    values[:, 5] *= 1e-6  # values in e4m3's subnormal range after scaling
    return values.to(dtype)


# -- the round trip ----------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_round_trip_stays_within_the_bounds_e4m3_allows_element_by_element(dtype):
    slices = 4
    x = hidden_states(64, slices * HIDDEN, 0, dtype)
    x[7, HIDDEN:2 * HIDDEN] = 0  # one token's slice all zeros
    values, scales = storage.quantize(x, slices)
    back = storage.dequantize(values, scales, dtype)

    assert values.dtype == torch.float8_e4m3fn and scales.dtype == torch.float32
    assert values.shape == x.shape and scales.shape == (64, slices) and back.dtype == dtype
    xs, bs = x.double().reshape(64, slices, HIDDEN), back.double().reshape(64, slices, HIDDEN)
    absmax = xs.abs().amax(dim=-1, keepdim=True)
    error, rounding = (bs - xs).abs(), UNIT[dtype] * bs.abs()
    slack = 1 + 2.0**-20  # the float32 division and product around the e4m3 rounding
    assert bool((error <= absmax / 28 * slack + rounding).all()), "every element: |x' - x| <= absmax / 28"
    assert bool((error <= E4M3_UNIT * absmax + rounding).all())
    normal = xs.abs() >= absmax * 2.0**-6 / FLOAT8_MAX
    assert bool((error <= (E4M3_UNIT * xs.abs() * slack + rounding))[normal].all()), "normal range: 2^-4 of |x|"
    assert bool((error <= absmax * SUBNORMAL_STEP / 2 / FLOAT8_MAX * slack + rounding)[~normal].all())
    assert int((~normal).sum()) > 0, "the data reaches e4m3's subnormal range"
    assert float(scales[7, 1]) == 0.0 and bool((back[7, HIDDEN:2 * HIDDEN] == 0).all()), "zeros stay zeros"
    top = values.float().reshape(64, slices, HIDDEN).abs().amax(dim=-1)
    assert bool((top[scales > 0] == FLOAT8_MAX).all()), "each slice's absmax lands on 448"


def test_float8_storage_takes_half_the_bytes_of_bf16_by_the_formula():
    kimi = Layout(3, 7168, "bfloat16", FLOAT8)
    assert kimi.bytes_per_token() == 4 * 7168 * 1 + 4 * 4 + 5 == 28_693
    assert Layout(3, 7168, "bfloat16", "bfloat16").bytes_per_token() == 4 * 7168 * 2 + 5 == 57_349
    assert Layout(3, 576, "bfloat16", FLOAT8).bytes_per_token() == 2_325
    assert kimi.formula() == "(3 aux + 1) x 7168 x 1 + (3 aux + 1) x 4 (scales) + 5 (ids, mask)"
    described = kimi.describe()
    assert (described["dtype"], described["quantized"], described["read_as"]) == (FLOAT8, True, "bfloat16")
    assert described["scales"]["tensors"] == {"aux_hidden_scales": ["T", 3], "last_hidden_scales": ["T", 1]}
    fp8_settings = {**SETTINGS, "storage_dtype": FLOAT8}
    assert job.estimate_bytes(1000, fp8_settings) == 1000 * (4 * HIDDEN + 16 + 5)
    assert job.estimate_bytes(1000, SETTINGS) == 1000 * (4 * HIDDEN * 2 + 5)
    assert job.estimate_bytes(1000, fp8_settings, captured=True) == 1000 * 4 * HIDDEN * 2, "captures stay bf16"
    assert job.STORAGE_DTYPES == storage.STORAGE_DTYPES


def header(path: Path) -> dict:
    blob = path.read_bytes()
    (length,) = struct.unpack("<Q", blob[:8])
    return json.loads(blob[8:8 + length])


def test_a_float8_sample_file_holds_values_and_scales_and_reads_back_dequantized(tmp_path):
    tokens = 11
    ids, mask = torch.arange(tokens, dtype=torch.int32), torch.ones(tokens, dtype=torch.uint8)
    aux, last = hidden_states(tokens, 3 * HIDDEN, 1), hidden_states(tokens, HIDDEN, 2)
    path = tmp_path / "rows_0-4" / "s-0.safetensors"

    size, sha = store.write_sample(path, ids, mask, aux, last, {"format": store.FORMAT, "id": "s-0"}, FLOAT8)

    assert (size, sha) == (path.stat().st_size, store.file_sha256(path))
    described = {name: (v["dtype"], v["shape"]) for name, v in header(path).items() if name != "__metadata__"}
    assert described == {
        "input_ids": ("I32", [tokens]), "loss_mask": ("U8", [tokens]),
        "aux_hidden_states": ("F8_E4M3", [tokens, 3 * HIDDEN]), "aux_hidden_scales": ("F32", [tokens, 3]),
        "last_hidden_states": ("F8_E4M3", [tokens, HIDDEN]), "last_hidden_scales": ("F32", [tokens, 1]),
    }
    layout = Layout(3, HIDDEN, "bfloat16", FLOAT8)
    data_bytes = size - 8 - struct.unpack("<Q", path.read_bytes()[:8])[0]
    assert data_bytes == tokens * layout.bytes_per_token()
    read = storage.read_sample(path, layout, tokens)
    assert read.keys() == {"input_ids", "loss_mask", "aux_hidden_states", "last_hidden_states"}
    assert read["aux_hidden_states"].dtype == torch.bfloat16
    assert torch.equal(read["aux_hidden_states"], storage.dequantize(*storage.quantize(aux, 3), torch.bfloat16))
    raw = storage.read_sample(path, layout, tokens, dequantize=False)
    assert raw["last_hidden_states"].dtype == torch.float8_e4m3fn and raw["last_hidden_scales"].shape == (tokens, 1)
    with pytest.raises(StorageError, match=r"holds float8_e4m3 hidden states, data_config.json says bfloat16.*"
                                           r"convert-storage .* --to float8_e4m3"):
        storage.read_sample(path, Layout(3, HIDDEN, "bfloat16", "bfloat16"), tokens)


# -- datasets ------------------------------------------------------------------------------------
def store_sample(out_dir: Path, ordinal: int, storage_dtype: str | None = None) -> dict:
    """One sample file as the extraction writes it; its journal record."""
    tokens = 5 + (ordinal * 3) % 7
    generator = torch.Generator().manual_seed(ordinal)
    ids = torch.randint(0, VOCAB, (tokens,), generator=generator).to(torch.int32)
    mask = (torch.arange(tokens) >= 2).to(torch.uint8)
    aux, last = hidden_states(tokens, 3 * HIDDEN, 10 + ordinal), hidden_states(tokens, HIDDEN, 100 + ordinal)
    file = f"{store.shard_dir_name(ordinal, SHARD)}/s-{ordinal}{store.SAMPLE_SUFFIX}"
    metadata = {"format": store.FORMAT, "id": f"s-{ordinal}", "line": str(ordinal + 1), "key": f"key-{ordinal}"}
    size, sha = store.write_sample(out_dir / file, ids, mask, aux, last, metadata, storage_dtype)
    return {"key": f"key-{ordinal}", "status": "ok", "ordinal": ordinal, "line": ordinal + 1, "id": f"s-{ordinal}",
            "file": file, "tokens": tokens, "loss_tokens": int(mask.sum()), "bytes": size, "sha256": sha}


def build(out_dir: Path, storage_dtype: str | None = None, parts: int = 2) -> Path:
    """A complete, merged output directory (journals included), stored as ``storage_dtype`` says."""
    store.claim_settings(out_dir, {**SETTINGS, **({"storage_dtype": storage_dtype} if storage_dtype else {})})
    for part in range(parts):
        samples = [store_sample(out_dir, i, storage_dtype) for i in range(NUM_RECORDS) if i % parts == part]
        journal = store.Journal(out_dir / store.PARTS_DIR / f"{store.part_name(part, parts)}.journal.jsonl")
        for record in samples:
            journal.append(record)
        journal.close()
        store.write_part_manifest(out_dir, part, parts, samples, [], [], len(samples), RUN)
    store.merge(out_dir)
    return out_dir


def files_of(directory: Path) -> dict[str, bytes]:
    """Every data and manifest file's bytes (the locks and the conversion's progress are status, not data)."""
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*"))
            if p.is_file() and p.suffix != ".lock" and not p.name.endswith(".progress.json")}


def run_convert(data_dir: Path, *extra: str, to: str = FLOAT8) -> int:
    parser = argparse.ArgumentParser()
    convert.configure_parser(parser)
    return convert.run(parser.parse_args([str(data_dir), "--to", to, "--quiet", *extra]))


@pytest.fixture
def bf16_dir(tmp_path) -> Path:
    return build(tmp_path / "bf16")


@pytest.fixture
def fp8_dir(tmp_path) -> Path:
    """The same samples, written in float8 by the store as the extraction writes them."""
    return build(tmp_path / "fp8", FLOAT8)


def test_a_float8_dataset_records_its_storage_and_verifies(fp8_dir):
    manifest = json.loads((fp8_dir / store.MANIFEST_FILE).read_text())
    assert manifest["storage_dtype"] == FLOAT8 and manifest["dtype"] == "bfloat16"
    assert manifest["storage"] == Layout(3, HIDDEN, "bfloat16", FLOAT8).describe()
    report = store.verify_dataset(fp8_dir)
    assert report["ok"] and report["storage_dtype"] == FLOAT8 and report["checked"] == NUM_RECORDS, report


def rewrite(data_dir: Path, entry: dict, change) -> None:
    """Apply ``change`` to a sample's tensors, save them, and record the new checksum and size in the manifest."""
    path = data_dir / entry["file"]
    tensors = load_file(str(path))
    change(tensors)
    save_file(tensors, str(path))
    manifest_path = data_dir / store.MANIFEST_FILE
    manifest = json.loads(manifest_path.read_text())
    for shard in manifest["shards"].values():
        for listed in shard["files"]:
            if listed["file"] == entry["file"]:
                listed.update(sha256=store.file_sha256(path), bytes=path.stat().st_size)
    manifest_path.write_text(json.dumps(manifest))


def test_verify_checks_the_scales_and_values_of_float8_files(fp8_dir):
    entries = [e for shard in json.loads((fp8_dir / store.MANIFEST_FILE).read_text())["shards"].values()
               for e in shard["files"]]

    def nan_scale(t):
        t["aux_hidden_scales"][1, 2] = float("nan")

    def negative_scale(t):
        t["last_hidden_scales"][0, 0] = -1.0

    def nan_value(t):  # 0x7f is e4m3fn's NaN
        t["last_hidden_states"].view(torch.uint8)[2, 3] = 0x7F

    def flat_scales(t):
        t["aux_hidden_scales"] = t["aux_hidden_scales"][:, 0].contiguous()

    def bf16_values(t):
        t["aux_hidden_states"] = t["aux_hidden_states"].to(torch.bfloat16)

    for entry, change in zip(entries, (nan_scale, negative_scale, nan_value, flat_scales, bf16_values), strict=False):
        rewrite(fp8_dir, entry, change)
    problems = store.verify_dataset(fp8_dir)["problems"]

    tokens = [e["tokens"] for e in entries]
    assert problems == [
        f"{entries[0]['file']}: aux_hidden_scales has NaN or inf values",
        f"{entries[1]['file']}: a scale is negative",
        f"{entries[2]['file']}: last_hidden_states has NaN or inf values",
        f"{entries[3]['file']}: aux_hidden_scales is ({tokens[3]},), expected ({tokens[3]}, 3)",
        f"{entries[4]['file']}: aux_hidden_states is torch.bfloat16, the manifest says float8_e4m3",
    ]


def test_the_finite_check_of_float8_bits_agrees_with_converting_every_value():
    # All 256 bytes of e4m3fn, one at a time beside finite ones: the check over the bits says what
    # isfinite over the values converted to float32 says (0x7F and 0xFF, the two NaNs, are the only non-finite).
    every = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn)
    for byte in range(256):
        one = torch.zeros(4, 3, dtype=torch.uint8)
        one[2, 1] = byte
        values = one.view(torch.float8_e4m3fn)
        assert storage.all_finite(values) == bool(torch.isfinite(values.float()).all()), hex(byte)
    assert [b for b in range(256) if not torch.isfinite(every[b:b + 1].float()).all()] == [0x7F, 0xFF]
    assert storage.all_finite(torch.tensor([1.0, -448.0]).to(torch.bfloat16))
    assert not storage.all_finite(torch.tensor([1.0, float("inf")]).to(torch.bfloat16))
    assert not storage.all_finite(torch.tensor([float("nan")]))


# -- the readers -------------------------------------------------------------------------------
def test_training_reads_float8_as_stored_and_dequantizes_where_the_batch_goes(bf16_dir, fp8_dir):
    data, reference = open_dataset(fp8_dir), open_dataset(bf16_dir)
    indices = [0, 3, 4]

    raw = load_batch(data, indices, dequantize=False)
    ready = load_batch(data, indices)
    original = load_batch(reference, indices)

    assert raw.quantized and raw.aux_hidden.dtype == torch.float8_e4m3fn and raw.aux_scales.shape == (raw.num_tokens, 3)
    assert not ready.quantized and ready.aux_hidden.dtype == torch.bfloat16
    moved = raw.to("cpu")
    assert not moved.quantized and torch.equal(moved.aux_hidden, ready.aux_hidden)
    assert torch.equal(moved.last_hidden, ready.last_hidden) and torch.equal(moved.input_ids, original.input_ids)
    assert raw.aux_hidden.nbytes + raw.aux_scales.nbytes < 0.6 * original.aux_hidden.nbytes, "half the bytes to move"
    error = (ready.aux_hidden.double() - original.aux_hidden.double()).abs().reshape(-1, 3, HIDDEN)
    absmax = original.aux_hidden.double().abs().reshape(-1, 3, HIDDEN).amax(dim=-1, keepdim=True)
    assert bool((error <= absmax / 28 + 2.0**-8 * ready.aux_hidden.double().abs().reshape(error.shape)).all())


# -- conversion ----------------------------------------------------------------------------------
def test_conversion_in_place_and_into_a_copy_write_what_a_float8_extraction_writes(bf16_dir, fp8_dir, tmp_path):
    before = files_of(bf16_dir)
    copy = tmp_path / "copy"

    assert run_convert(bf16_dir, "--copy-to", str(copy)) == 0
    assert files_of(bf16_dir) == before, "--copy-to leaves the source as it was"
    assert run_convert(bf16_dir, "--copy-to", str(copy)) == 0, "a rerun finds it done"
    assert run_convert(bf16_dir, "--threads", "2") == 0
    assert run_convert(bf16_dir) == 0, "a rerun finds it done"

    expected = files_of(fp8_dir)
    assert files_of(copy) == expected
    assert files_of(bf16_dir) == expected, "rows, parts' journals and manifests, extraction.json, data_config.json"
    assert store.verify_dataset(bf16_dir)["ok"] and store.verify_dataset(copy)["ok"]


def test_a_conversion_stopped_in_its_last_step_is_finished_by_the_rerun(bf16_dir, fp8_dir, monkeypatch):
    def killed(*_):
        raise KeyboardInterrupt("killed while merging")

    monkeypatch.setattr(store, "merge", killed)
    with pytest.raises(KeyboardInterrupt):
        run_convert(bf16_dir)
    monkeypatch.undo()

    assert (bf16_dir / storage.CONVERSION_JOURNAL).exists()
    manifest = json.loads((bf16_dir / store.MANIFEST_FILE).read_text())
    assert "storage_dtype" not in manifest, "the manifest says float8 only when every file is"
    with pytest.raises(DataError, match=r"a storage conversion is unfinished there .* `eagle3-pipeline "
                                        r"convert-storage .*bf16 --to float8_e4m3`"):
        open_dataset(bf16_dir)

    assert run_convert(bf16_dir) == 0
    assert files_of(bf16_dir) == files_of(fp8_dir)


def test_a_half_converted_dataset_is_refused_by_every_reader_naming_the_command(bf16_dir, capsys):
    entries = sorted((e for shard in json.loads((bf16_dir / store.MANIFEST_FILE).read_text())["shards"].values()
                      for e in shard["files"]), key=lambda e: e["file"])
    damaged = bf16_dir / entries[-1]["file"]
    good = damaged.read_bytes()
    damaged.write_bytes(good[:-1] + bytes([good[-1] ^ 1]))

    assert run_convert(bf16_dir, "--threads", "1") == 1, "a file failing its checksum fails the run"
    message = capsys.readouterr().err
    assert f"{damaged}: {len(good)} bytes whose checksum differs from data_config.json" in message
    assert "files converted are kept: fix the cause and rerun to continue" in message
    assert (bf16_dir / storage.CONVERSION_JOURNAL).exists()
    command = f"eagle3-pipeline convert-storage {bf16_dir} --to float8_e4m3"
    for read in (open_dataset, store.verify_dataset, lambda d: storage.compare_datasets(d, d)):
        with pytest.raises(ValueError, match="a storage conversion is unfinished there") as refused:
            read(bf16_dir)
        assert command in str(refused.value)
    extraction = job.ExtractConfig(dataset=bf16_dir / store.MANIFEST_FILE, output_dir=bf16_dir, server_url="http://x")
    with pytest.raises(ValueError, match=f"a storage conversion is unfinished there .*`{command}`"):
        job.make_plan(extraction, client=None)

    # Without the journal (deleted by hand), the files themselves tell: the first float8 one read.
    journal = (bf16_dir / storage.CONVERSION_JOURNAL).read_bytes()
    (bf16_dir / storage.CONVERSION_JOURNAL).unlink()
    data = open_dataset(bf16_dir)
    converted = next(s.index for s in data.samples if s.file == entries[0]["file"])
    with pytest.raises(DataError, match=rf"{entries[0]['file']}: holds float8_e4m3 hidden states, data_config.json "
                                        rf"says bfloat16: the dataset mixes storage dtypes .*`{command}`"):
        load_batch(data, [converted])
    (bf16_dir / storage.CONVERSION_JOURNAL).write_bytes(journal)

    damaged.write_bytes(good)  # the cause fixed: the rerun finishes
    assert run_convert(bf16_dir) == 0
    assert store.verify_dataset(bf16_dir)["ok"]


def test_back_to_bfloat16_a_float8_source_and_a_used_copy_directory_are_refused(fp8_dir, bf16_dir, tmp_path, capsys):
    assert run_convert(fp8_dir, to="bfloat16") == 2
    assert "restore no precision" in capsys.readouterr().err
    assert run_convert(fp8_dir, "--copy-to", str(tmp_path / "c")) == 2
    assert "already stored as float8_e4m3" in capsys.readouterr().err
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    assert run_convert(bf16_dir, "--copy-to", str(tmp_path / "full")) == 2
    assert "is not empty" in capsys.readouterr().err
    locked = tmp_path / "locked" / store.PARTS_DIR
    locked.mkdir(parents=True)
    (locked / "part-0-of-2.lock").write_text("123\n")  # a run killed after taking the locks, before its journal
    assert run_convert(bf16_dir, "--copy-to", str(locked.parent)) == 0


def test_a_rerun_of_the_extraction_with_another_storage_dtype_is_refused_naming_the_conversion(bf16_dir):
    with pytest.raises(store.StoreError, match=r"storage_dtype: recorded None, now 'float8_e4m3'.*eagle3-pipeline "
                                               r"convert-storage .* --to float8_e4m3"):
        store.claim_settings(bf16_dir, {**SETTINGS, "storage_dtype": FLOAT8})
    assert job._settings_hash(SETTINGS) == job._settings_hash({**SETTINGS, "storage_dtype": FLOAT8}), \
        "a sample's key does not depend on how it is stored: the journals stay valid through a conversion"


def test_auto_stores_float8_for_a_16_bit_target_as_captured_for_float32_and_a_rerun_what_the_dataset_holds(
    bf16_dir, fp8_dir, tmp_path
):
    resolve = job.resolve_storage_dtype
    new = tmp_path / "new"
    assert [resolve("auto", dtype, new) for dtype in ("bfloat16", "float16", "float32")] == \
        [FLOAT8, FLOAT8, "bfloat16"]
    # A rerun continues the dataset as it is stored, whatever auto would choose for a new one.
    assert resolve("auto", "bfloat16", bf16_dir) == "bfloat16"
    assert resolve("auto", "float32", fp8_dir) == FLOAT8
    # An explicit choice is kept (a mismatch with the dataset is claim_settings' to refuse).
    assert resolve("bfloat16", "bfloat16", new) == "bfloat16" and resolve(FLOAT8, "float32", bf16_dir) == FLOAT8
    assert job.ExtractConfig.__dataclass_fields__["storage_dtype"].default == "auto"


# -- measuring -----------------------------------------------------------------------------------
def test_compare_datasets_measures_bytes_per_token_and_the_error_per_layer(bf16_dir, tmp_path):
    copy = tmp_path / "copy"
    assert run_convert(bf16_dir, "--copy-to", str(copy)) == 0

    result = storage.compare_datasets(bf16_dir, copy)

    manifest = json.loads((bf16_dir / store.MANIFEST_FILE).read_text())
    tokens = manifest["num_tokens"]
    assert (result["samples"], result["tokens"]) == (NUM_RECORDS, tokens)
    for side, layout in (("reference", Layout(3, HIDDEN, "bfloat16", "bfloat16")),
                         ("quantized", Layout(3, HIDDEN, "bfloat16", FLOAT8))):
        measured = result[side]
        directory = copy if side == "quantized" else bf16_dir
        assert measured["bytes"] == sum(p.stat().st_size for p in directory.glob("rows_*/*.safetensors"))
        assert measured["formula_bytes_per_token"] == layout.bytes_per_token()
        assert measured["bytes_per_token"] == pytest.approx(layout.bytes_per_token()
                                                            + measured["per_token"]["headers"])
    assert result["bytes_ratio"] < 0.75
    assert list(result["layers"]) == ["aux 0", "aux 1", "aux 2", "last"]
    for layer in result["layers"].values():
        assert 0 < layer["err_over_absmax_mean"] < layer["err_over_absmax_worst"] <= 1 / 28 + 2.0**-8
        assert 0 < layer["rel_l2_mean"] < layer["rel_l2_worst"] <= E4M3_UNIT * (1 + 2.0**-8) + 2.0**-8


def test_the_manifests_storage_record_reads_back_as_the_layout(bf16_dir, fp8_dir):
    for directory, quantized in ((bf16_dir, False), (fp8_dir, True)):
        manifest = json.loads((directory / store.MANIFEST_FILE).read_text())
        assert Layout.of(manifest).quantized is quantized
        assert manifest["storage"]["quantized"] is quantized
    old = json.loads((bf16_dir / store.MANIFEST_FILE).read_text())
    del old["storage"]  # a manifest merged before storage dtypes existed reads as unquantized
    assert Layout.of(old) == Layout(3, HIDDEN, "bfloat16", "bfloat16")
