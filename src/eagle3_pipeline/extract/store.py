"""The extracted dataset on disk: sample files, the journal, the settings lock, the manifests.

Layout of an output directory ``D``::

    D/extraction.json                 the settings that shape the data (first run writes it; later
                                      runs and other hosts must match it, or are refused)
    D/rows_<a>-<b>/<stem>.safetensors one verified sample: input_ids [T] int32, loss_mask [T] uint8,
                                      aux_hidden_states [T, n_aux*H], last_hidden_states [T, H]
                                      (float8 with per-token scales beside them: storage.py)
    D/parts/part-K-of-N.journal.jsonl one line per sample stored (or failed) by part K of N
    D/parts/part-K-of-N.json          the part's manifest, written when the part is complete
    D/parts/part-K-of-N.progress.json progress of the running part (for the role and the CLI)
    D/token_counts.safetensors        counts [V] int64 of the loss-masked target tokens
    D/data_config.json                the merged manifest: settings, shards, per-file checksums

Crash safety: a sample file appears by rename (never half-written under its name), then its
journal line is appended. Killed between the two, the file is simply redone (same bytes). A
journal line counts only when its file exists with the recorded size; ``verify`` re-reads
every byte against the recorded SHA-256. A torn last journal line (kill -9 mid-write) is cut
off on the next open.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from eagle3_pipeline.atomic import atomic_write
from eagle3_pipeline.capture.writer import save_safetensors
from eagle3_pipeline.checksum import file_sha256  # noqa: F401 - also this module's public name
from eagle3_pipeline.extract import storage
from eagle3_pipeline.parts import files

# The part files every stage of this kind shares (parts/files.py), used here and by this module's readers.
from eagle3_pipeline.parts.files import (  # noqa: F401
    INFORMATIONAL_SETTINGS,
    PARTS_DIR,
    Journal,
    StoreError,
    parse_part,
    part_name,
    settings_text,
    write_if_changed,
)

FORMAT = "eagle3-pipeline/hidden-states"
FORMAT_VERSION = 1
SETTINGS_FILE = "extraction.json"
MANIFEST_FILE = "data_config.json"
TOKEN_COUNTS_FILE = "token_counts.safetensors"
# Compared between runs, but not part of a sample's key: how the values are stored, not which
# values; convert-storage changes it and the journals' keys stay valid.
STORAGE_SETTINGS = ("storage_dtype",)
SAMPLE_SUFFIX = ".safetensors"


def shard_dir_name(ordinal: int, shard_size: int) -> str:
    """``rows_<a>-<b>`` holding record ``ordinal`` (a multiple of ``shard_size``)."""
    start = ordinal // shard_size * shard_size
    return f"rows_{start}-{start + shard_size}"


def write_sample(path: Path, input_ids: torch.Tensor, loss_mask: torch.Tensor, aux: torch.Tensor,
                 last: torch.Tensor, metadata: dict[str, str], storage_dtype: str | None = None,
                 on_written: Callable[[int, str], None] | None = None) -> tuple[int, str]:
    """Write one sample atomically; return (bytes, sha256) computed while writing.

    ``storage_dtype`` ``float8_e4m3`` stores the states quantized (``storage.sample_tensors``).
    ``on_written(bytes, sha256)`` runs once the temp file is whole, before it takes the sample's
    name (``convert-storage`` journals the new checksum there).
    """
    tensors = storage.sample_tensors(input_ids, loss_mask, aux, last, storage_dtype)
    return write_tensors(path, tensors, metadata, on_written)


def write_tensors(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str],
                  on_written: Callable[[int, str], None] | None = None) -> tuple[int, str]:
    """``write_sample`` for tensors already in the file's layout (``storage.sample_tensors``'s, or
    the states an engine quantized, with the ids and mask first)."""
    digest = hashlib.sha256()
    sizes = []

    def write(tmp: str) -> None:
        sizes.append(save_safetensors(tensors, tmp, metadata, digest))
        if on_written is not None:
            on_written(sizes[-1], digest.hexdigest())

    atomic_write(path, write)
    return sizes[-1], digest.hexdigest()


# -- the settings lock --------------------------------------------------------------------
def _storage_hint(out_dir: Path, differ: list[str]) -> str:
    if not set(differ) <= set(STORAGE_SETTINGS):
        return ""
    return (" (storage_dtype unset means as captured; set extraction_storage_dtype to what the data is stored in, "
            f"or convert the stored data: eagle3-pipeline convert-storage {out_dir} --to {storage.FLOAT8})")


def claim_settings(out_dir: Path, settings: dict, create: bool = True) -> bool:
    """Record ``settings`` in ``D/extraction.json``, or check that they match the recorded ones
    (``files.claim_settings``: True when this call created the file, ``StoreError`` naming every
    field that differs)."""
    return files.claim_settings(out_dir, settings, create, file_name=SETTINGS_FILE, what="data extracted",
                                hint=lambda differ: _storage_hint(out_dir, differ))


def read_settings(out_dir: Path) -> dict:
    path = out_dir / SETTINGS_FILE
    if not path.is_file():
        raise StoreError(f"{out_dir}: no {SETTINGS_FILE}: not an extraction output directory (or nothing ran yet)")
    return json.loads(path.read_text())


def stored_ok(out_dir: Path, record: dict | None) -> bool:
    """A journal record of a stored sample whose file is present with the recorded size."""
    if not record or record.get("status") != "ok":
        return False
    try:
        return (out_dir / record["file"]).stat().st_size == record["bytes"]
    except OSError:
        return False


# -- manifests ----------------------------------------------------------------------------
def _dump(document: dict) -> str:
    return json.dumps(document, indent=1, sort_keys=True) + "\n"


def write_part_manifest(out_dir: Path, index: int, count: int, samples: list[dict], skipped: list[dict],
                        failed: list[dict], num_records: int, run: dict) -> bool:
    """The manifest of one complete part; True when (re)written.

    ``run`` records the dataset (name, checksum, the first-N limit) and the verification settings.
    """
    document = {
        "part": f"{index}/{count}",
        **run,
        "num_records": num_records,
        "samples": sorted(samples, key=lambda s: s["ordinal"]),
        "skipped": sorted(skipped, key=lambda s: s["line"]),
        "failed": sorted(failed, key=lambda s: s["line"]),
    }
    return write_if_changed(out_dir / PARTS_DIR / f"{part_name(index, count)}.json", _dump(document))


COUNT_BATCH_TOKENS = 1 << 20  # loss-masked tokens of several files counted by one bincount


def count_tokens(out_dir: Path, files: Iterable[str], vocab_size: int) -> torch.Tensor:
    """Counts [V] int64 of the loss-masked target tokens of these sample files.

    The tokens of many files are counted at once: a bincount and a sum over the whole vocabulary for each file
    cost more than reading it (the extraction's merge and the training's start count every file; on a 16-core
    GPU host file by file took over 6 s for 2,733 files, docs/benchmarks.md)."""
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    pending: list[torch.Tensor] = []
    held = 0

    def add_pending() -> None:
        if pending:
            counts.add_(torch.bincount(torch.cat(pending).long(), minlength=vocab_size)[:vocab_size])
            pending.clear()

    for name in files:
        with safe_open(str(out_dir / name), framework="pt") as handle:
            ids = handle.get_tensor("input_ids")
            mask = handle.get_tensor("loss_mask").bool()
        pending.append(ids[mask])
        held += pending[-1].numel()
        if held >= COUNT_BATCH_TOKENS:
            add_pending()
            held = 0
    add_pending()
    return counts


def merge(out_dir: Path) -> tuple[dict, bool]:
    """Merge the parts' manifests into ``data_config.json`` and count the target tokens.

    Every part 0..N-1 of one N must be complete. Returns (manifest, changed); a merge over
    unchanged parts rewrites nothing.
    """
    settings = read_settings(out_dir)
    parts_dir = out_dir / PARTS_DIR
    found = sorted(parts_dir.glob("part-*-of-*.json")) if parts_dir.is_dir() else []
    manifests = [p for p in found if not p.name.endswith((".progress.json",))]
    counts = {int(p.name.split("-of-")[1][:-5]) for p in manifests}
    if len(counts) != 1:
        raise StoreError(
            f"{parts_dir}: " + ("no complete part yet" if not counts else f"parts of different splits {sorted(counts)}")
            + "; run the extraction (every part) first"
        )
    count = counts.pop()
    parts = {int(p.name.split("-")[1]): json.loads(p.read_text()) for p in manifests}
    missing = [k for k in range(count) if k not in parts]
    if missing:
        raise StoreError(f"{parts_dir}: parts {missing} of {count} are not complete yet; wait for them, or rerun them")
    samples = sorted((s for part in parts.values() for s in part["samples"]), key=lambda s: s["ordinal"])
    skipped = sorted((s for part in parts.values() for s in part["skipped"]), key=lambda s: s["line"])
    failed = sorted((s for part in parts.values() for s in part["failed"]), key=lambda s: s["line"])
    shards: dict[str, dict] = {}
    for sample in samples:
        shard = shards.setdefault(sample["file"].split("/")[0], {"num_samples": 0, "num_tokens": 0, "files": []})
        shard["num_samples"] += 1
        shard["num_tokens"] += sample["tokens"]
        shard["files"].append({key: sample[key] for key in ("file", "id", "id_generated", "line", "tokens",
                                                              "loss_tokens", "bytes", "sha256", "source")
                                  if key in sample})
    token_counts = count_tokens(out_dir, (s["file"] for s in samples), settings["vocab_size"])
    counts_changed = False
    counts_path = out_dir / TOKEN_COUNTS_FILE
    existing = None
    if counts_path.is_file():
        try:
            with safe_open(str(counts_path), framework="pt") as handle:
                existing = handle.get_tensor("counts")
        except (SafetensorError, OSError):
            existing = None
    if existing is None or not torch.equal(existing, token_counts):
        atomic_write(counts_path, lambda tmp: save_safetensors({"counts": token_counts}, tmp, {"format": FORMAT}))
        counts_changed = True
    manifest = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        **settings,
        "dataset": parts[0]["dataset"],
        "verification": parts[0]["verification"],
        "num_records": sum(part["num_records"] for part in parts.values()),
        "num_samples": len(samples),
        "num_tokens": sum(s["tokens"] for s in samples),
        "num_loss_tokens": sum(s["loss_tokens"] for s in samples),
        "bytes": sum(s["bytes"] for s in samples),
        "parts": count,
        "shards": dict(sorted(shards.items(), key=lambda kv: int(kv[0].split("_")[1].split("-")[0]))),
        "skipped": skipped,
        "failed": failed,
        "token_counts": {"file": TOKEN_COUNTS_FILE, "sha256": file_sha256(counts_path),
                         "loss_tokens": int(token_counts.sum())},
        "storage": storage.Layout.of(settings).describe(),
    }
    changed = write_if_changed(out_dir / MANIFEST_FILE, _dump(manifest))
    return manifest, changed or counts_changed


# -- verify -------------------------------------------------------------------------------
def _check_file(  # noqa: PLR0911 - one return per problem found
    out_dir: Path, entry: dict, layout: storage.Layout, deep: bool
) -> str | None:
    path = out_dir / entry["file"]
    try:
        size = path.stat().st_size
    except OSError:
        return f"{entry['file']}: missing"
    if size != entry["bytes"]:
        return f"{entry['file']}: {size} bytes, the manifest says {entry['bytes']}"
    if not deep:
        return None
    if file_sha256(path) != entry["sha256"]:
        return f"{entry['file']}: checksum differs from the manifest (the file changed or is corrupt)"
    try:
        with safe_open(str(path), framework="pt") as handle:
            tensors = {name: handle.get_tensor(name) for name in handle.keys()}  # noqa: SIM118 - not a dict
    except (SafetensorError, OSError, RuntimeError) as exc:
        return f"{entry['file']}: unreadable: {exc}"
    problem = storage.check_tensors(tensors, layout, entry["tokens"], out_dir, finite=True)
    if problem:
        return f"{entry['file']}: {problem}"
    if int(tensors["loss_mask"].sum()) != entry["loss_tokens"]:
        return f"{entry['file']}: loss_mask has {int(tensors['loss_mask'].sum())} ones, the manifest says " \
               f"{entry['loss_tokens']}"
    return None


def verify_dataset(out_dir: Path, deep: bool = True, threads: int = 4) -> dict:
    """Re-check every file against ``data_config.json``; a report with the problems found."""
    manifest_path = out_dir / MANIFEST_FILE
    if not manifest_path.is_file():
        raise StoreError(f"{out_dir}: no {MANIFEST_FILE}; the extraction has not completed (or merged) there")
    storage.refuse_unfinished_conversion(out_dir)
    manifest = json.loads(manifest_path.read_text())
    entries = [entry for shard in manifest["shards"].values() for entry in shard["files"]]
    layout = storage.Layout.of(manifest)
    with ThreadPoolExecutor(max_workers=max(1, threads)) as pool:
        results = list(pool.map(lambda e: _check_file(out_dir, e, layout, deep), entries))
    problems = [r for r in results if r]
    listed = {entry["file"] for entry in entries}
    extra = sorted(
        str(p.relative_to(out_dir)) for p in out_dir.glob("rows_*/*")
        if str(p.relative_to(out_dir)) not in listed
    )
    counts = manifest.get("token_counts") or {}
    counts_path = out_dir / counts.get("file", TOKEN_COUNTS_FILE)
    if not counts_path.is_file() or (deep and file_sha256(counts_path) != counts.get("sha256")):
        problems.append(f"{counts_path.name}: missing or changed since the merge")
    return {
        "ok": not problems,
        "checked": len(entries),
        "deep": deep,
        "problems": problems,
        "extra_files": extra,
        "num_samples": manifest["num_samples"],
        "num_tokens": manifest["num_tokens"],
        "bytes": manifest["bytes"],
        "storage_dtype": layout.storage,
        "skipped": len(manifest["skipped"]),
        "failed": len(manifest["failed"]),
    }
