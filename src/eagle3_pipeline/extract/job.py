"""``eagle3-pipeline extract``: conversations in, verified per-token hidden states out.

One run is one part (``--part K/N``, default 0/1) of the dataset, run by the part job that the
regeneration shares (``parts/job.py``: the split over hosts, the lock, the journal, the worker
pool, progress, the exit codes). What the extraction adds:

1. ask the server what it captures (``/server_info``), load the target's tokenizer and chat
   template, and compare the data-shaping settings with ``D/extraction.json``;
2. read the dataset; render and tokenize each of this part's conversations (``loss_mask`` on
   the assistant tokens); skip bad records with a reason and line number;
3. drop what the journal already holds (a key hashes the sample id, its tokens and mask, and
   the settings); refuse, with the numbers, when the disk cannot hold the rest; then lock the
   settings in ``D/extraction.json`` (a refused run locks nothing);
4. send the rest, ``concurrency`` requests in flight; check and store each sample (``verify.py``,
   ``store.py``), retrying a rejected one once; append each outcome to the journal and keep a
   progress file current;
5. write the part's manifest; with one part (and without ``--no-merge``) merge it into
   ``D/data_config.json``.

``--storage-dtype float8_e4m3`` stores the states quantized (``storage.py``): the requests ask
the engine's capture writer for float8 (ids ending in ``.f8``, ``capture/writer.py``), which
quantizes on its GPU and adds the last states unquantized for step 4's top-1 check; an engine
that does not (an older eagle3-pipeline) sends them as captured, and they are quantized here
after the checks.

SIGTERM (the supervisor's stop) and SIGINT stop sending, let the requests in flight finish
and be stored, and exit; a rerun continues. A kill -9 loses at most the samples in flight.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import secrets
import shutil
import sys
import threading
import time
from array import array
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from eagle3_pipeline.capture.layers import AUX_LAYER_CONVENTION
from eagle3_pipeline.checksum import file_sha256
from eagle3_pipeline.cli_args import path_str
from eagle3_pipeline.models.config import read_text_config
from eagle3_pipeline.parts import job as part_job
from eagle3_pipeline.parts.job import (
    EXIT_FAILED,
    EXIT_OK,
    PartConfig,
    PartJob,
    PartPlan,
    PartProgress,
    gib,
)

# storage.STORAGE_DTYPES, named here too: that module imports torch, this one not until a run starts.
STORAGE_DTYPES = ("bfloat16", "float8_e4m3")
# The default: float8 for a 16-bit target, as captured for a float32 one, what an existing dataset
# holds for a rerun (``resolve_storage_dtype``).
AUTO_STORAGE = "auto"
RID_PREFIX = "e3x"
HEADER_BYTES = 400  # a sample file's safetensors header, about
WRITERS = 2  # threads storing samples beyond the requests in flight


def window_size(cfg) -> int:
    """Samples in hand at once: ``concurrency`` in flight, as many queued to replace them at
    once (so the server forms its next batch while ours is being stored), and the storers."""
    return 2 * cfg.concurrency + WRITERS


@dataclass
class ExtractConfig(PartConfig):
    """Everything one run needs (the CLI's options): the shared ones and the extraction's."""

    capture_dir: str | None = None
    overflow: str = "truncate"
    shard_size: int = 2000
    verify_positions: int = 32
    verify_full_every: int = 32
    verify_tolerance: float = 0.05
    verify_device: str = "cpu"
    max_skip_ratio: float = 0.05
    capture_wait_s: float = 60.0
    storage_dtype: str = AUTO_STORAGE  # bfloat16: as captured; float8_e4m3; auto (resolve_storage_dtype)
    render_processes: int = 0  # processes rendering the plan's conversations (0: part_job.read_processes decides)


@dataclass
class Prepared:
    """A sample of this part, tokenized, with its key and file."""

    ordinal: int
    line: int
    sample_id: str
    file: str  # relative to the output directory
    key: str
    input_ids: array
    loss_mask: array
    id_generated: bool = False  # the record had no id: the reader made one up (it names no record)
    source: str | None = None  # in a mixture: the source it came from


@dataclass
class Plan(PartPlan):
    """What a run found before sending anything: the shared plan, its items ``Prepared``."""

    facts: object = None  # the server's EngineFacts
    failed: dict[str, dict] = field(default_factory=dict)  # key -> journal record of samples failed in this run


def _sha256_file(path: Path) -> str | None:
    return file_sha256(path) if path.is_file() else None


def _dtype_name(server_dtype: str | None, config: dict) -> str:
    from eagle3_pipeline.extract.storage import DTYPE_BYTES  # noqa: PLC0415

    if server_dtype in DTYPE_BYTES:
        return server_dtype
    configured = str(config.get("torch_dtype") or config.get("dtype") or "bfloat16").removeprefix("torch.")
    return configured if configured in DTYPE_BYTES else "bfloat16"


def data_settings(facts, model_path: Path, renderer, cfg: ExtractConfig) -> dict:
    """The settings that shape the stored data (all parts and reruns must share them)."""
    config = read_text_config(model_path)
    tokenizer_files = {name: _sha256_file(model_path / name) for name in ("tokenizer.json", "tokenizer_config.json",
                                                                            "tokenizer.model")}
    settings = {
        "target_model_path": str(model_path),
        "target_config_sha256": _sha256_file(model_path / "config.json"),
        "tokenizer_sha256": {k: v for k, v in tokenizer_files.items() if v},
        "chat_template_sha256": renderer.template_hash,
        "chat_template_file": str(cfg.chat_template) if cfg.chat_template else None,
        "engine": facts.engine,
        "engine_version": facts.version,
        "aux_layers": list(facts.aux_layers),
        "aux_layer_convention": AUX_LAYER_CONVENTION,
        "engine_layer_ids": facts.engine_layer_ids,
        "hidden_size": int(config["hidden_size"]),
        "num_hidden_layers": int(config["num_hidden_layers"]),
        "vocab_size": int(config["vocab_size"]),
        "dtype": _dtype_name(facts.dtype, config),
        "max_length": cfg.max_length,
        "overflow": cfg.overflow,
        "shard_size": cfg.shard_size,
    }
    storage_dtype = resolve_storage_dtype(cfg.storage_dtype, settings["dtype"], cfg.output_dir)
    if storage_dtype == STORAGE_DTYPES[1]:  # recorded only when quantized: unquantized data keeps its settings
        settings["storage_dtype"] = storage_dtype
    return settings


def resolve_storage_dtype(requested: str, target_dtype: str, output_dir: Path) -> str:
    """The storage dtype a run stores: ``requested``, or for ``auto`` the one measured best.

    ``auto``: what the dataset in ``output_dir`` already holds (a rerun continues it as it is),
    else float8 for a 16-bit target (bfloat16, float16: every served model), else as captured
    (a float32 target: the tiny CPU model). Float8 measured on the H200 (docs/benchmarks.md):
    half the bytes, the drafter's acceptance unchanged (within the seed-to-seed spread), the
    extraction no slower, the training reading it 1.5-1.9x faster. A float32 target keeps its
    states: float8 would drop 20 of its 24 mantissa bits, not 5 of bfloat16's 8, and a CPU
    training reads float8 slower (it dequantizes on the CPU).
    """
    from eagle3_pipeline.extract.store import SETTINGS_FILE  # noqa: PLC0415

    if requested != AUTO_STORAGE:
        return requested
    recorded = Path(output_dir) / SETTINGS_FILE
    if recorded.is_file():
        try:
            return json.loads(recorded.read_text()).get("storage_dtype") or STORAGE_DTYPES[0]
        except (OSError, ValueError):
            pass  # unreadable: claim_settings says so, naming the file
    return STORAGE_DTYPES[1] if target_dtype in ("bfloat16", "float16") else STORAGE_DTYPES[0]


def _settings_hash(settings: dict) -> str:
    from eagle3_pipeline.extract.store import INFORMATIONAL_SETTINGS, STORAGE_SETTINGS  # noqa: PLC0415

    shaping = {k: v for k, v in settings.items() if k not in INFORMATIONAL_SETTINGS + STORAGE_SETTINGS}
    return hashlib.sha256(json.dumps(shaping, sort_keys=True).encode()).hexdigest()


def sample_key(settings_hash: str, sample_id: str, ids: array, mask: array) -> str:
    """What identifies a stored sample: its id, its tokens and mask, and the shaping settings."""
    digest = hashlib.sha256(settings_hash.encode())
    digest.update(sample_id.encode("utf-8", "surrogatepass") + b"\0")
    digest.update(ids.tobytes())
    digest.update(mask.tobytes())
    return digest.hexdigest()


def make_plan(cfg: ExtractConfig, client, dry: bool = False, facts=None) -> Plan:
    """Steps 1-3 of the module docstring; raises ``ValueError`` subclasses on bad settings.

    The settings are compared with the recorded ones, not recorded (``ExtractionJob.run`` does
    that once its checks pass). ``dry``: leave the journal as it is, even a torn last line (a
    live run may be appending to it). ``facts``: what the server would say (``--check --offline``
    takes them from the stored settings); default: ask the server.
    """
    from eagle3_pipeline.conversations.template import SampleError, fit_length, load_renderer  # noqa: PLC0415
    from eagle3_pipeline.extract import store  # noqa: PLC0415
    from eagle3_pipeline.extract.storage import refuse_unfinished_conversion  # noqa: PLC0415
    from eagle3_pipeline.server_client import engine_facts  # noqa: PLC0415

    part_job.check_dataset(cfg.dataset)
    refuse_unfinished_conversion(cfg.output_dir)
    facts = facts or engine_facts(client.server_info())
    model_path = Path(cfg.model_path or facts.model_path)
    if not (model_path / "config.json").is_file():
        raise FileNotFoundError(
            f"target model {model_path}: no config.json there; the extraction reads the tokenizer and lm_head "
            "from the server's model directory on this host (give --model-path when it lives elsewhere here)"
        )
    capture_dir = Path(cfg.capture_dir or facts.capture_dir or ".")
    if facts.capture_dir is not None and not capture_dir.is_dir():
        raise FileNotFoundError(
            f"capture directory {capture_dir} does not exist on this host: run the extraction on the server's host"
        )
    cfg.capture_dir = str(capture_dir)
    renderer = load_renderer(model_path, cfg.chat_template, trust_remote_code=cfg.trust_remote_code)
    settings = data_settings(facts, model_path, renderer, cfg)
    store.claim_settings(cfg.output_dir, settings, create=False)
    settings_hash = _settings_hash(settings)

    def prepare(item):
        try:
            ids, mask = renderer.render(list(item.messages))
            ids, mask, _ = fit_length(ids, mask, cfg.max_length, cfg.overflow)
        except SampleError as exc:
            return part_job.skip_record(item.line, item.sample_id, exc.reason, exc.detail)
        ids_a, mask_a = array("i", ids), array("B", mask)
        return Prepared(
            item.ordinal, item.line, item.sample_id,
            f"{store.shard_dir_name(item.ordinal, cfg.shard_size)}/{item.file_stem}{store.SAMPLE_SUFFIX}",
            sample_key(settings_hash, item.sample_id, ids_a, mask_a), ids_a, mask_a, item.id_generated, item.source,
        )

    records, prepared, skipped = part_job.read_part(
        cfg, prepare, part_job.read_processes(cfg.render_processes, cfg.num_samples))
    journal, records_by_key = part_job.open_journal(cfg, "extracted", dry)
    done = {p.key: records_by_key[p.key] for p in prepared
            if store.stored_ok(cfg.output_dir, records_by_key.get(p.key))}
    plan = Plan(settings, records, prepared, skipped, journal, done, facts=facts)
    plan.todo = [p for p in prepared if p.key not in done]
    return plan


def estimate_bytes(tokens: int, settings: dict, captured: bool = False) -> int:
    """Bytes on disk for ``tokens`` tokens as stored (``Layout.bytes_per_token``: float8 values and
    scales, or the target's dtype; plus ids and mask), or as the engine's ``captured`` files hold them."""
    from eagle3_pipeline.extract.storage import DTYPE_BYTES, Layout  # noqa: PLC0415

    layout = Layout.of(settings)
    if captured:
        return tokens * (layout.n_aux + 1) * layout.hidden * DTYPE_BYTES[layout.dtype]
    return tokens * layout.bytes_per_token()


def check_room(cfg: ExtractConfig, plan: Plan) -> None:
    """Refuse to start, with the numbers, when the output or capture filesystem is too small."""
    from eagle3_pipeline.extract.storage import Layout  # noqa: PLC0415
    from eagle3_pipeline.extract.store import StoreError  # noqa: PLC0415

    layout = Layout.of(plan.settings)
    tokens = sum(len(p.input_ids) for p in plan.todo)
    need = estimate_bytes(tokens, plan.settings) + HEADER_BYTES * len(plan.todo)
    usage = shutil.disk_usage(cfg.output_dir)
    margin = min(usage.total // 100, 1 << 30)
    if need > usage.free - margin:
        raise StoreError(
            f"not enough disk: {len(plan.todo):,} samples to store ({tokens:,} tokens x {layout.bytes_per_token():,} "
            f"bytes as {layout.storage}: {layout.formula()}) need {gib(need)}, {cfg.output_dir} has "
            f"{gib(usage.free)} free (keeping {gib(margin)} spare); free space, lower extraction_num_samples, "
            "store float8 (extraction_storage_dtype: float8_e4m3), or choose another extraction_output_dir. "
            "Nothing was sent."
        )
    if plan.todo:
        longest = max(len(p.input_ids) for p in plan.todo)
        capture_need = window_size(cfg) * estimate_bytes(longest, plan.settings, captured=True)
        capture_free = shutil.disk_usage(cfg.capture_dir).free
        if capture_need > capture_free:
            raise StoreError(
                f"capture directory {cfg.capture_dir} has {gib(capture_free)} free, but {cfg.concurrency} requests "
                f"in flight of up to {longest:,} tokens may need {gib(capture_need)}; lower extraction_concurrency "
                "or extraction_max_length, or give the capture directory more room"
            )


class Progress(PartProgress):
    """The part's progress: samples stored, tokens/s, the time left from the tokens still to send."""

    unit = "samples"

    def __init__(self, cfg: ExtractConfig, plan: Plan):
        super().__init__(cfg, "extract", plan, sum(r["tokens"] for r in plan.done.values()))
        self.tokens_todo = sum(len(p.input_ids) for p in plan.todo)

    def eta_s(self) -> float | None:
        rate = self.tokens_now / self.elapsed()
        left = self.tokens_todo - self.tokens_now
        return round(left / rate, 1) if rate > 0 and left > 0 else (0.0 if left <= 0 else None)

    def counts(self) -> str:
        return f"{self.failed} failed"


def first_checked_position(cfg: ExtractConfig, ordinal: int, tokens: int) -> int:
    """Where the top-1 check starts: 0 (every position) for every ``verify_full_every``-th record
    and when ``verify_positions`` is 0; otherwise the last ``verify_positions`` positions.

    Input logprobs at every position cost the engine a full-vocabulary softmax per token and a
    large JSON answer; the tail catches a mixed-up request, a wrong layer and shifted rows, and
    the periodic full check catches damage confined to the start of a prompt.
    """
    full = cfg.verify_positions <= 0 or (cfg.verify_full_every > 0 and ordinal % cfg.verify_full_every == 0)
    return 0 if full else max(0, tokens - cfg.verify_positions)


class NotSent(Exception):
    """A queued sample found the run stopping before its request went out."""


class SampleWorker:
    """Sends one sample, checks its capture, stores it; safe to run in many threads."""

    def __init__(self, cfg: ExtractConfig, plan: Plan, client, lm_head):
        self.cfg = cfg
        self.plan = plan
        self.client = client
        self.lm_head = lm_head
        self.inflight = threading.BoundedSemaphore(cfg.concurrency)
        self.n_aux = len(plan.settings["aux_layers"])
        self.hidden = plan.settings["hidden_size"]
        self.dtype = plan.settings["dtype"]
        from eagle3_pipeline.extract import storage  # noqa: PLC0415

        self.layout = storage.Layout.of(plan.settings)
        # Where this run's float8 samples were quantized: "engine" (its capture writer) or "client"
        # (here, for an engine running an older eagle3-pipeline); for the run's log.
        self.quantized_by: Counter = Counter()
        self.count_lock = threading.Lock()
        self.stopping = threading.Event()
        # Request ids differ between runs: a killed run's requests may still be in the server
        # ("Duplicate request ID") or write their captures late.
        self.run_id = secrets.token_hex(3)

    def _wait_capture(self, rid: str) -> Path:
        from eagle3_pipeline.capture.writer import capture_path, incomplete_path  # noqa: PLC0415
        from eagle3_pipeline.extract.verify import SampleRejected  # noqa: PLC0415

        path, incomplete = capture_path(self.cfg.capture_dir, rid), incomplete_path(self.cfg.capture_dir, rid)
        deadline = time.monotonic() + self.cfg.capture_wait_s
        delay = 0.001
        while True:
            if path.exists():
                return path
            if incomplete.exists():
                record = json.loads(incomplete.read_text())
                incomplete.unlink(missing_ok=True)
                raise SampleRejected("capture_incomplete", f"the engine did not capture the whole prefill: {record}")
            if time.monotonic() > deadline:
                raise SampleRejected(
                    "capture_missing",
                    f"no capture file {path} within {self.cfg.capture_wait_s:.0f} s of the answer; is the server's "
                    "capture directory this one, and is the capture hook installed?",
                )
            time.sleep(delay)
            delay = min(delay * 2, 0.05)

    def _attempt(self, prep: Prepared, attempt: int) -> dict:
        import torch  # noqa: PLC0415
        from safetensors.torch import load_file  # noqa: PLC0415

        from eagle3_pipeline.capture.writer import FLOAT8_RID_SUFFIX, capture_path, incomplete_path  # noqa: PLC0415
        from eagle3_pipeline.extract import storage, store, verify  # noqa: PLC0415

        index = self.cfg.part[0]
        rid = f"{RID_PREFIX}-{index}-{self.run_id}-{prep.key[:16]}-{attempt}"
        if self.layout.quantized:  # the engine's capture writer quantizes it on its GPU
            rid += FLOAT8_RID_SUFFIX
        tokens = len(prep.input_ids)
        start = first_checked_position(self.cfg, prep.ordinal, tokens)
        try:
            with self.inflight:
                if self.stopping.is_set():  # queued when the run was told to stop: not sent
                    raise NotSent
                answer = self.client.generate(prep.input_ids.tolist(), rid, start)
            meta = answer["meta_info"]
            verify.check_meta(meta, tokens)
            path = self._wait_capture(rid)
            ids = torch.frombuffer(bytearray(prep.input_ids.tobytes()), dtype=torch.int32)
            mask = torch.frombuffer(bytearray(prep.loss_mask.tobytes()), dtype=torch.uint8)
            last, sample, quantizer = self._checked_capture(load_file(str(path)), ids, mask)
            agreement = verify.check_top1(last, self.lm_head, start, verify.engine_top1(meta, tokens, start),
                                          self.cfg.verify_tolerance)
            if self.layout.quantized and quantizer is None:  # an engine whose writer does not quantize
                sample = storage.sample_tensors(ids, mask, sample["aux_hidden_states"], last, self.layout.storage)
                quantizer = "client"
            size, sha = store.write_tensors(
                self.cfg.output_dir / prep.file, sample,
                {"format": store.FORMAT, "id": prep.sample_id, "line": str(prep.line), "key": prep.key})
            if quantizer:
                with self.count_lock:
                    self.quantized_by[quantizer] += 1
        finally:
            capture_path(self.cfg.capture_dir, rid).unlink(missing_ok=True)
            incomplete_path(self.cfg.capture_dir, rid).unlink(missing_ok=True)
        return {
            "key": prep.key, "status": "ok", "ordinal": prep.ordinal, "line": prep.line, "id": prep.sample_id,
            "id_generated": prep.id_generated, "file": prep.file, "tokens": tokens,
            "loss_tokens": int(sum(prep.loss_mask)), "bytes": size,
            "sha256": sha, "checked_positions": agreement.checked, "near_ties": agreement.near_ties,
            "attempts": attempt + 1, **({"source": prep.source} if prep.source else {}),
        }

    def _checked_capture(self, tensors: dict, ids, mask) -> tuple:
        """(the last states as the engine computed them, for the top-1 check; the sample's tensors in
        file order; "engine" when the engine quantized them, else None), once shapes, dtypes and
        finiteness are checked."""
        from eagle3_pipeline.capture.writer import UNQUANTIZED_LAST  # noqa: PLC0415
        from eagle3_pipeline.extract import storage, verify  # noqa: PLC0415

        tokens = len(ids)
        if UNQUANTIZED_LAST in tensors:  # quantized by the engine (its rid asked so)
            last = tensors.pop(UNQUANTIZED_LAST)
            sample = {"input_ids": ids, "loss_mask": mask,
                      **{name: tensors[name] for name in storage.FLOAT8_FILE_ORDER if name in tensors}}
            problem = storage.check_quantized_sample(sample, self.layout, tokens)
            if problem:
                raise verify.SampleRejected(problem[0], f"float8 capture: {problem[1]}")
            if tuple(last.shape) != (tokens, self.hidden):
                raise verify.SampleRejected("capture_shape", f"capture's unquantized last states are "
                                            f"{tuple(last.shape)}, expected ({tokens}, {self.hidden})")
            verify.check_finite("last_hidden_states", last)
            quantizer = "engine"
        else:
            aux, last = tensors["aux_hidden_states"], tensors["last_hidden_states"]
            verify.check_capture(aux, last, tokens, self.n_aux, self.hidden)
            sample = {"input_ids": ids, "loss_mask": mask, "aux_hidden_states": aux, "last_hidden_states": last}
            quantizer = None
        if str(last.dtype).removeprefix("torch.") != self.dtype:
            raise verify.SampleRejected("capture_dtype", f"capture is {last.dtype}, the dataset is {self.dtype}")
        return last, sample, quantizer

    def __call__(self, prep: Prepared) -> dict | None:
        """The sample's journal record, or None when it was not sent (the run is stopping)."""
        from eagle3_pipeline.extract.verify import SampleRejected  # noqa: PLC0415
        from eagle3_pipeline.server_client import EngineError  # noqa: PLC0415

        failure = None
        for attempt in range(2):  # a rejected sample is tried once more, then recorded as failed
            if self.stopping.is_set() and attempt:
                break
            try:
                return self._attempt(prep, attempt)
            except NotSent:
                return None
            except SampleRejected as exc:
                failure = exc
            except EngineError as exc:
                failure = SampleRejected("engine_error", str(exc))
        return {"key": prep.key, "status": "failed", "ordinal": prep.ordinal, "line": prep.line,
                "id": prep.sample_id, "tokens": len(prep.input_ids), "reason": failure.reason if failure else "stopped",
                "detail": failure.detail if failure else "stopped before the retry"}


def _remove_leftovers(cfg: ExtractConfig, plan: Plan) -> None:
    """Temp files of this part's samples (a crash mid-write) and this part's stale captures."""
    ours: dict[Path, set[str]] = {}
    for prep in plan.todo:
        folder, name = prep.file.split("/")
        ours.setdefault(cfg.output_dir / folder, set()).add(name)
    for folder, names in ours.items():
        if not folder.is_dir():
            continue
        for entry in folder.iterdir():
            if entry.name.startswith(".") and entry.name.endswith(".tmp"):
                target = entry.name[1:].rsplit(".", 2)[0]
                if target in names:
                    entry.unlink(missing_ok=True)
    _remove_stale_captures(cfg)


def _remove_stale_captures(cfg: ExtractConfig) -> None:
    """Capture files of this part's request ids, and the temp files of a server killed while writing
    one (``.<capture>.*.tmp``, up to a sample's states in /dev/shm): none is awaited when no request is
    in flight."""
    prefix = f"{RID_PREFIX}-{cfg.part[0]}-"
    for pattern in (f"{prefix}*", f".{prefix}*.tmp"):
        for entry in Path(cfg.capture_dir).glob(pattern):
            entry.unlink(missing_ok=True)


class ExtractionJob(PartJob):
    """The extraction's part of the shared part job: send, check and store each sample."""

    label, what, done_what, unit = "extract", "extraction", "extracted", "sample"

    def __init__(self, cfg: ExtractConfig):
        super().__init__(cfg)
        self.worker: SampleWorker | None = None

    def make_plan(self, dry: bool = False) -> Plan:
        return make_plan(self.cfg, self.client, dry)

    def claim_settings(self, settings: dict, create: bool = True) -> bool:
        from eagle3_pipeline.extract import store  # noqa: PLC0415

        return store.claim_settings(self.cfg.output_dir, settings, create)

    def describe(self, plan: Plan) -> str:
        index, count = self.cfg.part
        return (f"part {index}/{count}: {plan.records} records, {len(plan.items)} samples, {len(plan.skipped)} "
                f"skipped, {len(plan.done)} already stored, {len(plan.todo)} to extract "
                f"({sum(len(p.input_ids) for p in plan.todo):,} tokens) from {self.client.url} ({plan.facts.engine} "
                f"{plan.facts.version}, aux layers {plan.facts.aux_layers})")

    def refusal(self, plan: Plan) -> str | None:
        cfg = self.cfg
        if not plan.records or len(plan.skipped) / plan.records <= cfg.max_skip_ratio:
            return None
        first = "; ".join(f"line {s['line']}: {s['reason']}: {s['detail']}" for s in plan.skipped[:3])
        return (f"{len(plan.skipped)} of {plan.records} records are unusable, more than the allowed "
                f"{cfg.max_skip_ratio:.0%} (extraction_max_skip_ratio); fix the dataset or raise the ratio. "
                f"First: {first}")

    def check_room(self, plan: Plan) -> None:
        check_room(self.cfg, plan)

    def progress(self, plan: Plan) -> Progress:
        return Progress(self.cfg, plan)

    def window(self) -> int:
        return window_size(self.cfg)

    def start_work(self, plan: Plan, progress: Progress) -> SampleWorker:
        from eagle3_pipeline.extract.verify import load_lm_head  # noqa: PLC0415

        cfg = self.cfg
        _remove_leftovers(cfg, plan)
        device = cfg.verify_device
        lm_head = load_lm_head(plan.settings["target_model_path"], device)
        self.log(f"top-1 check: lm_head on {device}; the last {cfg.verify_positions} positions of each sample"
                 + (f", all positions of every {cfg.verify_full_every}-th record" if cfg.verify_full_every else "")
                 if cfg.verify_positions else
                 f"top-1 check: lm_head on {device}; every position of every sample")
        self.worker = SampleWorker(cfg, plan, self.client, lm_head)
        progress.restart_clock()  # tokens/s from the first request, not from loading lm_head
        return self.worker

    def end_work(self, worker: SampleWorker) -> None:
        _remove_stale_captures(self.cfg)  # those of requests a killed earlier run left in flight
        if worker.layout.quantized:
            here = worker.quantized_by["client"]
            self.log(f"float8: {worker.quantized_by['engine']} samples quantized by the engine's capture writer, "
                     f"{here} here on the CPU" + (" (slower: the server's eagle3-pipeline predates quantizing in "
                                                    "its capture writer; update it there)" if here else ""))

    def count(self, plan: Plan, progress: Progress, record: dict) -> None:
        if record["status"] == "ok":
            plan.done[record["key"]] = record
            plan.failed.pop(record["key"], None)
            progress.done += 1
            progress.tokens_now += record["tokens"]
        else:
            plan.failed[record["key"]] = record
            progress.failed += 1
            progress.tokens_todo -= record["tokens"]

    def finish(self, plan: Plan, progress: Progress) -> tuple[int, str]:
        from eagle3_pipeline.conversations.dataset import dataset_facts  # noqa: PLC0415
        from eagle3_pipeline.extract import store  # noqa: PLC0415

        cfg = self.cfg
        index, count = cfg.part
        samples = [plan.done[p.key] for p in plan.items if p.key in plan.done]
        failures = [{k: r[k] for k in ("line", "id", "reason", "detail")} for r in plan.failed.values()]
        run_facts = {
            "dataset": {**dataset_facts(cfg.dataset), "num_samples_limit": cfg.num_samples},
            "verification": {"positions": cfg.verify_positions or "all", "all_positions_every": cfg.verify_full_every,
                             "tolerance_logits": cfg.verify_tolerance,
                             "checks": ["prompt_tokens", "cached_tokens == 0", "shapes", "finite",
                                        "top1 lm_head(last)"]},
        }
        store.write_part_manifest(cfg.output_dir, index, count, samples, plan.skipped, failures, plan.records,
                                  run_facts)
        bad = len(plan.skipped) + len(failures)
        if plan.records and bad / plan.records > cfg.max_skip_ratio:
            return EXIT_FAILED, (
                f"{len(failures)} samples failed verification and {len(plan.skipped)} were skipped: more than "
                f"{cfg.max_skip_ratio:.0%}; see {store.PARTS_DIR}/{store.part_name(index, count)}.json")
        message = f"part {index}/{count} complete: {len(samples)} samples stored, {len(plan.skipped)} skipped, " \
                  f"{len(failures)} failed"
        return EXIT_OK, message

    def merge(self) -> str:
        from eagle3_pipeline.extract import store  # noqa: PLC0415

        manifest, _ = store.merge(self.cfg.output_dir)
        return f"{store.MANIFEST_FILE}: {manifest['num_samples']} samples, {manifest['num_tokens']:,} tokens"


def offline_facts(cfg: ExtractConfig, engine: str | None, aux_layers: list[int] | None):
    """(facts, None) from the stored settings for ``--check --offline``, or (None, why not complete).

    The server that would run is described by ``--model-path``, ``--engine`` and ``--aux-layers``;
    when it differs from the one the data came from, the data is not complete for it.
    """
    from eagle3_pipeline.extract import store  # noqa: PLC0415
    from eagle3_pipeline.server_client import EngineFacts  # noqa: PLC0415

    try:
        stored = store.read_settings(cfg.output_dir)
    except store.StoreError:
        return None, "nothing extracted yet"
    differences = []
    if cfg.model_path and Path(cfg.model_path).resolve() != Path(stored["target_model_path"]).resolve():
        differences.append(f"model {stored['target_model_path']} -> {cfg.model_path}")
    if engine and engine != stored["engine"]:
        differences.append(f"engine {stored['engine']} -> {engine}")
    if aux_layers is not None and list(aux_layers) != list(stored["aux_layers"]):
        differences.append(f"aux layers {stored['aux_layers']} -> {aux_layers}")
    if differences:
        return None, "the stored data came from another server: " + "; ".join(differences)
    facts = EngineFacts(stored["engine"], str(stored["engine_version"]), str(stored["target_model_path"]),
                        [int(i) for i in stored["aux_layers"]], stored.get("engine_layer_ids"), None, stored["dtype"])
    return facts, None


def check_status(cfg: ExtractConfig, offline: bool = False, engine: str | None = None,
                 aux_layers: list[int] | None = None) -> dict:
    """``--check``: what a run would do, sending no sample. ``offline``: without the server (see
    ``offline_facts``); settings that differ from the stored ones make it incomplete, not an error."""
    from eagle3_pipeline.extract import store  # noqa: PLC0415
    from eagle3_pipeline.server_client import EngineClient  # noqa: PLC0415

    client = EngineClient(cfg.server_url, cfg.api_key, cfg.request_timeout_s, cfg.retries)
    facts = None
    if offline:
        facts, why = offline_facts(cfg, engine, aux_layers)
        if facts is None:
            return {"part": f"{cfg.part[0]}/{cfg.part[1]}", "complete": False, "reason": why, "offline": True}
        try:
            plan = make_plan(cfg, client, dry=True, facts=facts)
        except (OSError, ValueError) as exc:
            return {"part": f"{cfg.part[0]}/{cfg.part[1]}", "complete": False, "reason": str(exc), "offline": True}
    else:
        plan = make_plan(cfg, client, dry=True)
    index, count = cfg.part
    manifest = cfg.output_dir / store.PARTS_DIR / f"{store.part_name(index, count)}.json"
    return {
        "part": f"{index}/{count}",
        "records": plan.records,
        "samples": len(plan.items),
        "skipped": len(plan.skipped),
        "stored": len(plan.done),
        "todo": len(plan.todo),
        "todo_tokens": sum(len(p.input_ids) for p in plan.todo),
        "estimated_bytes": estimate_bytes(sum(len(p.input_ids) for p in plan.todo), plan.settings),
        "storage_dtype": plan.settings.get("storage_dtype") or plan.settings["dtype"],  # what auto resolved to
        "complete": not plan.todo and manifest.is_file(),
        "offline": offline,
    }


def configure_parser(parser: argparse.ArgumentParser) -> None:
    """Options of ``eagle3-pipeline extract``: the part job's, and the extraction's."""
    part_job.add_options(parser, server="capturing", concurrency=8, concurrency_help="requests in flight",
                         check_help="print what a run would do as JSON; send nothing",
                         merged_file="data_config.json")
    parser.add_argument("--api-key-env", metavar="NAME", help="read the server's API key from this variable")
    parser.add_argument("--api-key-stdin", action="store_true",
                        help="read the server's API key from the first line of standard input")
    part_job.model_path_option(parser, "the tokenizer and lm_head")
    parser.add_argument("--capture-dir", type=path_str,
        help="the server's capture directory (default: from /server_info)")
    parser.add_argument("--max-length", type=int, default=part_job.DEFAULT_MAX_LENGTH)
    parser.add_argument("--overflow", choices=["truncate", "skip"], default="truncate",
                        help="a sample longer than --max-length is cut there, or skipped")
    parser.add_argument("--shard-size", type=int, default=2000, help="samples per rows_<a>-<b> directory")
    parser.add_argument("--verify-positions", type=int, default=32,
                        help="check the top-1 at the last N positions of each sample (0: all positions always)")
    parser.add_argument("--verify-full-every", type=int, default=32,
                        help="also check every position of every N-th record (1: all samples; 0: never)")
    parser.add_argument("--verify-tolerance", type=float, default=0.05,
                        help="a top-1 mismatch within this many logits of our best is a near-tie, accepted")
    parser.add_argument("--verify-device", choices=["cpu", "cuda"], default="cpu",
                        help="where lm_head runs for the check; cpu by default: on the server's GPU the check's "
                        "kernels time-slice with the server's (measured on an H200: 8%% fewer tokens/s)")
    parser.add_argument("--max-skip-ratio", type=float, default=0.05)
    parser.add_argument("--storage-dtype", choices=[AUTO_STORAGE, *STORAGE_DTYPES], default=AUTO_STORAGE,
                        help="how the hidden states are stored: bfloat16 (as captured, in the target's dtype), "
                        "float8_e4m3 (half the bytes: per-token, per-layer scales; quantized by the engine's capture "
                        "writer) or auto (the default: float8_e4m3 for a bfloat16 or float16 target, as captured for "
                        "a float32 one; a rerun keeps what the dataset holds)")
    parser.add_argument("--render-processes", type=int, default=0, metavar="N",
                        help="processes that render and tokenize the conversations before anything is sent (0, the "
                        f"default: up to {part_job.READ_PROCESSES_MAX} of the CPUs, or 1 when --num-samples keeps "
                        f"fewer than {part_job.READ_PARALLEL_MIN_RECORDS} records)")
    parser.add_argument("--offline", action="store_true",
                        help="with --check: judge from the stored settings, without asking the server (the "
                        "server that would run: --model-path, --engine, --aux-layers)")
    parser.add_argument("--engine", choices=["reference", "sglang"], help="with --check --offline: the server's engine")
    parser.add_argument("--aux-layers", help="with --check --offline: the server's aux layers, comma-separated")


def config_from_args(args: argparse.Namespace) -> ExtractConfig:
    """The run's settings from the command line; ValueError naming the option that is wrong."""
    api_key = None
    if args.api_key_stdin:
        api_key = sys.stdin.readline().strip()
        if not api_key:
            raise ValueError("--api-key-stdin: standard input held no key")
    elif args.api_key_env:
        api_key = os.environ.get(args.api_key_env)
        if not api_key:
            raise ValueError(f"--api-key-env {args.api_key_env}: that variable is unset or empty")
    if args.shard_size < 1:
        raise ValueError("--shard-size must be at least 1")
    if args.verify_positions < 0 or args.verify_full_every < 0 or args.verify_tolerance < 0:
        raise ValueError("--verify-positions, --verify-full-every and --verify-tolerance must not be negative")
    if not 0 <= args.max_skip_ratio <= 1:
        raise ValueError("--max-skip-ratio must be between 0 and 1")
    if args.render_processes < 0:
        raise ValueError("--render-processes must not be negative (0 lets the extraction choose)")
    return ExtractConfig(
        **part_job.config_fields(args, api_key), capture_dir=args.capture_dir, overflow=args.overflow,
        shard_size=args.shard_size, verify_positions=args.verify_positions, verify_full_every=args.verify_full_every,
        verify_tolerance=args.verify_tolerance, verify_device=args.verify_device, max_skip_ratio=args.max_skip_ratio,
        storage_dtype=args.storage_dtype, render_processes=args.render_processes,
    )


def run(args: argparse.Namespace) -> int:
    """``eagle3-pipeline extract``."""
    def check(cfg: ExtractConfig) -> dict:
        aux = [int(i) for i in args.aux_layers.split(",")] if args.aux_layers else None
        return check_status(cfg, args.offline, args.engine, aux)

    return part_job.main(args, config_from_args, check, ExtractionJob)
