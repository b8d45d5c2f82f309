"""``eagle3-pipeline convert-storage``: an extracted dataset's hidden states to float8, in place or into a copy.

The files are rewritten as the extraction itself would have written them with
``extraction_storage_dtype: float8_e4m3`` (``storage.sample_tensors``; same bytes, file for
file), with the extraction's checksum discipline:

1. every sample file listed in ``data_config.json`` is read whole, its SHA-256 and size checked
   against the manifest, its tensors against the manifest's shapes and dtypes, then quantized
   into a temp file beside its place (``--copy-to DIR``: at the same place in DIR), its new
   size and SHA-256 computed while writing;
2. that size and SHA-256 go into the conversion's journal (``storage-conversion.journal.jsonl``
   in the destination) BEFORE the temp file is renamed over the original, so whatever moment a
   kill lands at, each file is either the original (the manifest's size) or the converted one
   (the journal's size): a rerun redoes the first kind and keeps the second;
3. once every file is converted: ``extraction.json`` records ``storage_dtype``, every part's
   journal and manifest take the new sizes and checksums (so a later ``extract`` with
   ``--storage-dtype float8_e4m3`` finds every sample stored), ``data_config.json`` is merged
   again (the manifest says float8 only now, when every file is), and the conversion's journal
   is removed last. A kill during this step is finished by the rerun too.

While the journal exists the dataset mixes storage dtypes, and every reader (training,
``verify``, ``extract``, ``extract-merge``) refuses it, naming this command. The parts' locks
are held throughout, so no extraction writes into the dataset meanwhile.

Only to float8_e4m3: back to bfloat16 is refused. It would double the bytes and restore no
precision (the float8 rounding is not undone), while every reader reads float8 as it is; for
unquantized states, extract again with ``extraction_storage_dtype: bfloat16``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from eagle3_pipeline.cli_args import path_arg
from eagle3_pipeline.progress_file import ProgressReporter

EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT, EXIT_STOPPED = 0, 1, 2, 4
HEADER_KEY = "__conversion__"
PROGRESS_NAME = "storage-conversion.progress.json"  # in parts/
TARGETS = ("float8_e4m3", "bfloat16")  # storage.STORAGE_DTYPES; the second one is refused, with the reason


class ConvertError(ValueError):
    """The conversion cannot run as asked; the message says why and what to do."""


@dataclass
class ConvertConfig:
    """The command's options."""

    data_dir: Path
    to: str = "float8_e4m3"
    copy_to: Path | None = None
    threads: int = 4
    max_read_mib_s: float | None = None  # None: as fast as the disks go
    quiet: bool = False

    @property
    def dest(self) -> Path:
        return self.copy_to if self.copy_to is not None else self.data_dir

    @property
    def in_place(self) -> bool:
        return self.copy_to is None or self.copy_to.resolve() == self.data_dir.resolve()


def _log(cfg: ConvertConfig, message: str) -> None:
    if not cfg.quiet:
        print(f"[convert-storage] {message}", file=sys.stderr, flush=True)


class ReadLimit:
    """At most ``mib_s`` MiB/s read over all threads (``--max-read-mib-s``: a dataset that others read meanwhile)."""

    def __init__(self, mib_s: float | None):
        self.rate = mib_s * (1 << 20) if mib_s else None
        self._next = time.monotonic()
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> None:
        if self.rate is None:
            return
        with self._lock:
            now = time.monotonic()
            start = max(self._next, now)
            self._next = start + nbytes / self.rate
        time.sleep(max(0.0, start - now))


class Progress(ProgressReporter):
    """``parts/storage-conversion.progress.json`` and the terminal's line."""

    def __init__(self, cfg: ConvertConfig, total: int, done: int, total_bytes: int):
        from eagle3_pipeline.extract.store import PARTS_DIR  # noqa: PLC0415

        super().__init__(cfg.dest / PARTS_DIR / PROGRESS_NAME, cfg.quiet, "convert-storage")
        self.total, self.done, self.already = total, done, done
        self.total_bytes, self.read_bytes, self.written_bytes = total_bytes, 0, 0
        self.started, self._clock = time.time(), time.monotonic()
        self.state, self.message = "running", ""

    def document(self) -> dict:
        elapsed = max(time.monotonic() - self._clock, 1e-9)
        rate = self.read_bytes / elapsed
        return {"state": self.state, "pid": os.getpid(), "unit": "files", "total": self.total, "done": self.done,
                "already": self.already, "read_bytes": self.read_bytes, "written_bytes": self.written_bytes,
                "mib_per_s": round(rate / (1 << 20), 1), "started": self.started, "updated": time.time(),
                "message": self.message}

    def line(self) -> str:
        doc = self.document()
        width = 30
        filled = int(width * self.done / self.total) if self.total else width
        return (f"[convert-storage] [{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total} files, "
                f"{doc['mib_per_s']:,.1f} MiB/s read")


def _lock_parts(directory: Path, parts: int) -> list:
    """Hold every part's lock of ``directory``: no extraction (nor another conversion) writes there meanwhile."""
    from eagle3_pipeline.parts.files import lock_part  # noqa: PLC0415

    return [lock_part(directory, (index, parts), "extraction or storage conversion") for index in range(parts)]


def _entries(manifest: dict) -> list[dict]:
    return [entry for shard in manifest["shards"].values() for entry in shard["files"]]


def _check_start(cfg: ConvertConfig) -> tuple[dict, bool]:
    """(the source's manifest, whether there is nothing left to do); ``ConvertError`` when refused."""
    from eagle3_pipeline.extract import storage  # noqa: PLC0415
    from eagle3_pipeline.extract.store import MANIFEST_FILE  # noqa: PLC0415

    if cfg.to != storage.FLOAT8:
        raise ConvertError(
            f"--to {cfg.to}: refused. Float8 states do not become {cfg.to} ones again (the rounding is not undone), "
            "so converting back would double the bytes and restore no precision, and every reader of this pipeline "
            f"reads {storage.FLOAT8} as it is; for unquantized states, extract again with "
            "extraction_storage_dtype: bfloat16"
        )
    manifest_path = cfg.data_dir / MANIFEST_FILE
    if not manifest_path.is_file():
        raise ConvertError(f"{cfg.data_dir}: no {MANIFEST_FILE}: not a complete (merged) extraction output; run the "
                           "extraction to the end first")
    manifest = json.loads(manifest_path.read_text())
    journal = cfg.dest / storage.CONVERSION_JOURNAL
    if not cfg.in_place:
        if cfg.copy_to.resolve().is_relative_to(cfg.data_dir.resolve()):
            raise ConvertError(f"--copy-to {cfg.copy_to}: inside {cfg.data_dir}; choose a directory outside it")
        storage.refuse_unfinished_conversion(cfg.data_dir)
        if storage.Layout.of(manifest).quantized:
            raise ConvertError(f"{cfg.data_dir} is already stored as {storage.FLOAT8}; copy it as it is")
        if not journal.exists() and (cfg.dest / MANIFEST_FILE).is_file():
            done = json.loads((cfg.dest / MANIFEST_FILE).read_text())
            same = sorted(e["file"] for e in _entries(done)) == sorted(e["file"] for e in _entries(manifest))
            if same and storage.Layout.of(done).quantized:
                return manifest, True
            raise ConvertError(f"--copy-to {cfg.copy_to} holds another dataset; choose an empty directory")
        # Only the parts' locks there: a run killed just after taking them, before its journal began.
        if not journal.exists() and cfg.dest.is_dir() and any(
                p.is_file() and p.suffix != ".lock" for p in cfg.dest.rglob("*")):
            raise ConvertError(f"--copy-to {cfg.copy_to} is not empty; choose an empty (or new) directory")
    elif storage.Layout.of(manifest).quantized and not journal.exists():
        return manifest, True
    return manifest, False


def convert_storage(cfg: ConvertConfig) -> dict:  # noqa: PLR0915 - the steps of the module docstring, in order
    """Convert (or finish converting) ``cfg.data_dir``; a summary, or ``ConvertError`` when refused.

    Raises ``ConvertError`` too when files fail their checks (converted ones are kept: fix the
    cause, e.g. with ``verify``, and rerun) and ``InterruptedError`` when stopped by SIGTERM/SIGINT.
    """
    from eagle3_pipeline.checksum import file_sha256  # noqa: PLC0415
    from eagle3_pipeline.extract import storage  # noqa: PLC0415
    from eagle3_pipeline.extract.store import MANIFEST_FILE, Journal  # noqa: PLC0415
    from eagle3_pipeline.work_window import run_window  # noqa: PLC0415

    manifest, finished = _check_start(cfg)
    entries = _entries(manifest)
    summary = {"data_dir": str(cfg.dest), "storage_dtype": storage.FLOAT8, "files": len(entries), "converted": 0}
    if finished:
        _log(cfg, f"{cfg.dest} is stored as {storage.FLOAT8} already: nothing to do")
        return {**summary, "changed": False, "bytes": json.loads((cfg.dest / MANIFEST_FILE).read_text())["bytes"]}
    locks = _lock_parts(cfg.data_dir, int(manifest["parts"]))
    if not cfg.in_place:
        locks += _lock_parts(cfg.dest, int(manifest["parts"]))
    layout = storage.Layout(len(manifest["aux_layers"]), int(manifest["hidden_size"]), manifest["dtype"],
                            manifest["dtype"])
    journal = Journal(cfg.dest / storage.CONVERSION_JOURNAL)
    records = journal.load()
    header = {"key": HEADER_KEY, "to": storage.FLOAT8, "source": str(cfg.data_dir.resolve()), "files": len(entries)}
    if HEADER_KEY in records and {k: records[HEADER_KEY].get(k) for k in header} != header:
        raise ConvertError(f"{journal.path}: an unfinished conversion of {records[HEADER_KEY].get('source')} to "
                           f"{records[HEADER_KEY].get('to')} is there; finish it with the command that started it")
    if HEADER_KEY not in records:
        journal.append(header)

    def converted(entry: dict) -> bool:
        record = records.get(entry["file"])
        path = cfg.dest / entry["file"]
        try:
            if record is None or path.stat().st_size != record["bytes"]:
                return False
        except OSError:
            return False
        # Sizes tell the original from the converted file, unless they happen to be equal (tiny shapes).
        return record["bytes"] != entry["bytes"] or not cfg.in_place or file_sha256(path) == record["sha256"]

    todo = [entry for entry in entries if not converted(entry)]
    _remove_temp_files(cfg.dest, todo)
    progress = Progress(cfg, len(entries), len(entries) - len(todo), sum(e["bytes"] for e in entries))
    limit = ReadLimit(cfg.max_read_mib_s)
    stopping = threading.Event()
    _log(cfg, f"{cfg.data_dir}{'' if cfg.in_place else ' -> ' + str(cfg.dest)}: {len(entries)} files, "
              f"{len(entries) - len(todo)} converted already, {len(todo)} to convert to {storage.FLOAT8}")

    def work(entry: dict) -> dict | None:
        if stopping.is_set():
            return None
        return _convert_file(cfg, entry, layout, journal, limit)

    def count(record: dict) -> None:
        records[record["key"]] = record
        progress.done += 1
        progress.read_bytes += record["from_bytes"]
        progress.written_bytes += record["bytes"]
        summary["converted"] += 1

    try:
        outcome = run_window(todo, work, max(1, cfg.threads), journal, count, stopping, progress.update, "convert")
        if outcome.fatal is not None:
            progress.state, progress.message = "failed", str(outcome.fatal)
            if isinstance(outcome.fatal, (ConvertError, OSError, storage.StorageError)):
                raise ConvertError(f"{outcome.fatal}; the {progress.done} files converted are kept: fix the cause "
                                   "and rerun to continue") from outcome.fatal
            raise outcome.fatal
        if outcome.stopped:
            progress.state = "stopped"
            progress.message = f"stopped on request after {progress.done} of {len(entries)} files; rerun to continue"
            raise InterruptedError(progress.message)
        journal.close()
        result = _finish(cfg, manifest, records)
        progress.state, progress.message = "done", f"{len(entries)} files stored as {storage.FLOAT8}"
    finally:
        journal.close()
        progress.update(force=True)
        del locks
    _log(cfg, f"{cfg.dest}: every file is {storage.FLOAT8}; {manifest['bytes']:,} bytes -> {result['bytes']:,}")
    return {**summary, "changed": True, "bytes_before": manifest["bytes"], "bytes": result["bytes"]}


def _remove_temp_files(dest: Path, todo: list[dict]) -> None:
    """Temp files of the files still to convert (a kill mid-write left them)."""
    names: dict[Path, set[str]] = {}
    for entry in todo:
        folder, name = entry["file"].split("/")
        names.setdefault(dest / folder, set()).add(name)
    for folder, wanted in names.items():
        for leftover in folder.glob(".*.tmp") if folder.is_dir() else []:
            if leftover.name[1:].rsplit(".", 2)[0] in wanted:
                leftover.unlink(missing_ok=True)


def _convert_file(cfg: ConvertConfig, entry: dict, layout, journal, limit: ReadLimit) -> dict:
    """Step 1 and 2 of the module docstring for one file; its journal record (``status`` ok)."""
    from safetensors.torch import load  # noqa: PLC0415

    from eagle3_pipeline.extract import storage  # noqa: PLC0415
    from eagle3_pipeline.extract.store import write_sample  # noqa: PLC0415

    source = cfg.data_dir / entry["file"]
    limit.take(entry["bytes"])
    try:
        blob = source.read_bytes()
    except OSError as exc:
        raise ConvertError(f"{source}: cannot read: {exc}") from None
    if len(blob) != entry["bytes"] or hashlib.sha256(blob).hexdigest() != entry["sha256"]:
        raise ConvertError(f"{source}: {len(blob)} bytes whose checksum differs from data_config.json (the file "
                           f"changed or is corrupt; `eagle3-pipeline verify {cfg.data_dir}` lists every such file)")
    tensors = load(blob)
    problem = storage.check_tensors(tensors, layout, entry["tokens"], cfg.data_dir, finite=True)
    if problem:
        raise ConvertError(f"{source}: {problem}")
    record = {"key": entry["file"], "file": entry["file"], "from_bytes": entry["bytes"],
              "from_sha256": entry["sha256"]}

    def written(size: int, sha: str) -> None:
        journal.append({**record, "status": "written", "bytes": size, "sha256": sha})

    size, sha = write_sample(cfg.dest / entry["file"], tensors["input_ids"], tensors["loss_mask"],
                             tensors["aux_hidden_states"], tensors["last_hidden_states"],
                             storage.header_metadata(blob), storage.FLOAT8, on_written=written)
    return {**record, "status": "ok", "bytes": size, "sha256": sha}


def _finish(cfg: ConvertConfig, manifest: dict, records: dict[str, dict]) -> dict:
    """Step 3 of the module docstring; the new manifest."""
    from eagle3_pipeline.atomic import atomic_write  # noqa: PLC0415
    from eagle3_pipeline.extract import storage  # noqa: PLC0415
    from eagle3_pipeline.extract.store import (  # noqa: PLC0415
        PARTS_DIR,
        SETTINGS_FILE,
        TOKEN_COUNTS_FILE,
        Journal,
        merge,
        parse_part,
        read_settings,
        settings_text,
        write_if_changed,
        write_part_manifest,
    )

    def updated(sample: dict) -> dict:
        record = records[sample["file"]]
        return {**sample, "bytes": record["bytes"], "sha256": record["sha256"]}

    settings = {**read_settings(cfg.data_dir), "storage_dtype": storage.FLOAT8}
    write_if_changed(cfg.dest / SETTINGS_FILE, settings_text(settings))
    source_parts, dest_parts = cfg.data_dir / PARTS_DIR, cfg.dest / PARTS_DIR
    for path in sorted(source_parts.glob("part-*-of-*.json")):
        if path.name.endswith(".progress.json"):
            continue
        part = json.loads(path.read_text())
        run = {k: v for k, v in part.items() if k not in ("part", "num_records", "samples", "skipped", "failed")}
        write_part_manifest(cfg.dest, *parse_part(part["part"]), [updated(s) for s in part["samples"]],
                            part["skipped"], part["failed"], part["num_records"], run)
    for path in sorted(source_parts.glob("part-*-of-*.journal.jsonl")):
        kept = []
        for record in Journal(path).load(repair=False).values():
            if record.get("status") != "ok":
                kept.append(record)
            elif record.get("file") in records:
                kept.append(updated(record))
            # else: stored but not in the manifest (a smaller selection since): dropped, redone when selected
        Journal(dest_parts / path.name).rewrite(kept)
    if not cfg.in_place:
        counts = cfg.data_dir / TOKEN_COUNTS_FILE
        atomic_write(cfg.dest / TOKEN_COUNTS_FILE, lambda tmp: shutil.copyfile(counts, tmp))
    result, _ = merge(cfg.dest)
    wrong = [e["file"] for e in _entries(result) if (e["bytes"], e["sha256"]) != (records[e["file"]]["bytes"],
                                                                                     records[e["file"]]["sha256"])]
    if wrong or not storage.Layout.of(result).quantized:
        raise ConvertError(f"{cfg.dest}: the merged manifest disagrees with the conversion's journal on {wrong[:3]}; "
                           "rerun to finish, or report this")
    (cfg.dest / storage.CONVERSION_JOURNAL).unlink()
    return result


def configure_parser(parser: argparse.ArgumentParser) -> None:
    """Options of ``eagle3-pipeline convert-storage``."""
    parser.add_argument("data_dir", type=path_arg, help="the extraction's output directory (data_config.json)")
    parser.add_argument("--to", choices=list(TARGETS), required=True,
                        help="float8_e4m3 (half the bytes of bf16); bfloat16 is refused, with the reason")
    parser.add_argument("--copy-to", type=path_arg, metavar="DIR",
                        help="write the converted dataset into DIR (empty or new), leaving DATA_DIR as it is")
    parser.add_argument("--threads", type=int, default=4, help="files converted at once")
    parser.add_argument("--max-read-mib-s", type=float,
                        help="read at most this many MiB/s (a dataset others read meanwhile); default: no limit")
    parser.add_argument("--quiet", action="store_true")


def run(args: argparse.Namespace) -> int:
    """``eagle3-pipeline convert-storage``: a JSON summary on stdout; exit 0 done (or nothing to do),
    1 a file failed its checks (converted ones kept; rerun), 2 refused, 4 stopped (rerun to continue)."""
    from eagle3_pipeline.extract.storage import StorageError  # noqa: PLC0415
    from eagle3_pipeline.extract.store import StoreError  # noqa: PLC0415

    if args.threads < 1 or (args.max_read_mib_s is not None and args.max_read_mib_s <= 0):
        print("error: --threads must be at least 1 and --max-read-mib-s above 0", file=sys.stderr)
        return EXIT_BAD_INPUT
    cfg = ConvertConfig(args.data_dir, args.to, args.copy_to, args.threads, args.max_read_mib_s, args.quiet)
    try:
        summary = convert_storage(cfg)
    except InterruptedError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_STOPPED
    except ConvertError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_FAILED if exc.__cause__ is not None else EXIT_BAD_INPUT
    except (StoreError, StorageError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(json.dumps(summary, sort_keys=True))
    return EXIT_OK
