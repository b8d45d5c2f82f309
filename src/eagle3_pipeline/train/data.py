"""Reading an extraction's output for training: samples packed into token-budget batches.

Nothing is padded: a batch is the concatenation of whole samples (``[N]`` tokens, N at most
the budget) with ``doc_ids`` saying which sample each token belongs to and ``position_ids``
restarting at 0 in each, which is what ``Eagle3Drafter.forward_ttt`` takes (after adding the
batch dimension: ``t[None]``).

Order is a pure function of (seed, epoch, rank, world, batch budget, sample list): the
shuffle is seeded by (seed, epoch), the train/eval split by a hash of each sample's id (so it
never changes with the order of the manifest or the number of extraction hosts), and a run
resumed from a ``DataState`` continues at exactly the next batch.

Files are read with safetensors only (no pickle, no code loaded), and each file's tensor
names, shapes and dtypes are checked against the manifest before use (``extract/storage.py``).
States stored as float8 are dequantized transparently: on the CPU by ``load_batch``, or, for
the trainer (``dequantize=False``), on the device after the float8 bytes and their scales were
moved there (``PackedBatch.to``), half the bytes of bf16 to read and to copy.
"""

from __future__ import annotations

import hashlib
import json
import queue
import random
import threading
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path

import torch

from eagle3_pipeline.extract import storage
from eagle3_pipeline.extract.store import FORMAT, FORMAT_VERSION, MANIFEST_FILE

# First-fit packing looks at most this many open batches back (keeps packing O(samples)).
PACK_WINDOW = 64


class DataError(ValueError):
    """The training data cannot be used as asked; the message says why and what to do."""


@dataclass(frozen=True)
class Sample:
    """One stored sample: ``index`` is its place in ``TrainData.samples``."""

    index: int
    file: str
    id: str
    tokens: int
    loss_tokens: int


def _split_key(sample_id: str) -> float:
    """A number in [0, 1) from the sample id alone (the same on every host and Python)."""
    digest = hashlib.sha256(sample_id.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


@dataclass
class TrainData:
    """An extraction output directory opened for training."""

    root: Path
    manifest: dict
    samples: list[Sample]
    n_aux: int
    hidden_size: int
    dtype: torch.dtype  # the target's: what the states read back as
    layout: storage.Layout

    @property
    def num_tokens(self) -> int:
        return sum(s.tokens for s in self.samples)

    def split(self, eval_ratio: float) -> tuple[list[Sample], list[Sample]]:
        """(train, eval): a sample is held out when the hash of its id falls below ``eval_ratio``.

        Deterministic and independent of the samples' order; each list keeps manifest order.
        With a small dataset the held-out share is only approximately ``eval_ratio``.
        """
        if not 0.0 <= eval_ratio < 1.0:
            raise DataError(f"eval_ratio {eval_ratio}: expected 0 <= ratio < 1")
        train, held = [], []
        for sample in self.samples:
            (held if _split_key(sample.id) < eval_ratio else train).append(sample)
        if not train:
            raise DataError(f"eval_ratio {eval_ratio} leaves no training sample out of {len(self.samples)}")
        return train, held


def open_dataset(data_dir: str | Path) -> TrainData:
    """Read ``data_config.json`` and the sample list of its shards; refuse unusable data clearly."""
    root = Path(data_dir)
    path = root / MANIFEST_FILE
    if not root.is_dir():
        raise DataError(f"{root}: no such directory (eagle_training_data_dir must be an extraction output directory)")
    unfinished = storage.unfinished_conversion(root)
    if unfinished:
        raise DataError(unfinished)
    if not path.is_file():
        raise DataError(
            f"{root}: no {MANIFEST_FILE}: the extraction has not completed or been merged there "
            "(run the extraction to the end, or `eagle3-pipeline extract-merge DIR`)"
        )
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise DataError(f"{path}: unreadable manifest: {exc}") from None
    if not isinstance(manifest, dict):
        raise DataError(f"{path}: not a manifest (a JSON object expected)")
    if manifest.get("format") != FORMAT or manifest.get("format_version") != FORMAT_VERSION:
        raise DataError(
            f"{path}: format {manifest.get('format')!r} version {manifest.get('format_version')!r} is not "
            f"{FORMAT!r} version {FORMAT_VERSION}; re-extract with this version of eagle3-pipeline"
        )
    missing = [key for key in ("aux_layers", "hidden_size", "dtype", "shards") if key not in manifest]
    if missing:
        raise DataError(f"{path}: the manifest lacks {missing}; it is incomplete or damaged (re-run the merge)")
    dtype = getattr(torch, str(manifest["dtype"]), None)
    if not isinstance(dtype, torch.dtype):
        raise DataError(f"{path}: unknown dtype {manifest['dtype']!r}")
    try:
        layout = storage.Layout.of(manifest)
    except storage.StorageError as exc:
        raise DataError(f"{path}: {exc}") from None
    # In dataset order (the line of each record), whatever order the JSON keys of the shards have.
    entries = sorted((entry for shard in manifest["shards"].values() for entry in shard["files"]),
                     key=lambda entry: (int(entry.get("line", 0)), entry["file"]))
    samples = [Sample(index, entry["file"], str(entry["id"]), int(entry["tokens"]), int(entry["loss_tokens"]))
               for index, entry in enumerate(entries)]
    if not samples:
        raise DataError(f"{path}: no samples (every record was skipped or failed); nothing to train on")
    if manifest.get("num_samples", len(samples)) != len(samples):
        raise DataError(f"{path}: lists {len(samples)} sample files but says num_samples "
                        f"{manifest['num_samples']}; the manifest is damaged (re-run the merge)")
    return TrainData(root, manifest, samples, len(manifest["aux_layers"]), int(manifest["hidden_size"]), dtype,
                     layout)


# -- order ---------------------------------------------------------------------------------
def _epoch_rng(seed: int, epoch: int) -> random.Random:
    digest = hashlib.sha256(f"eagle3-pack/{seed}/{epoch}".encode()).digest()
    return random.Random(int.from_bytes(digest[:8], "big"))


def pack(samples: list[Sample], batch_tokens: int, seed: int, epoch: int) -> list[list[int]]:
    """Batches (lists of ``Sample.index``) of at most ``batch_tokens`` tokens, each sample once.

    The samples are shuffled by (seed, epoch), then placed greedily: each into the first of the
    last ``PACK_WINDOW`` open batches where it fits, else into a new batch. A sample longer than
    ``batch_tokens`` gets a batch of its own and is TRUNCATED to its first ``batch_tokens``
    tokens when loaded (``load_batch(..., max_tokens=batch_tokens)``, as ``batches`` does).
    """
    if batch_tokens < 1:
        raise DataError(f"batch_tokens {batch_tokens}: must be at least 1")
    order = list(samples)
    _epoch_rng(seed, epoch).shuffle(order)
    batches: list[list[int]] = []
    room: list[int] = []
    for sample in order:
        size = min(sample.tokens, batch_tokens)
        first = max(0, len(batches) - PACK_WINDOW)
        for slot in range(first, len(batches)):
            if room[slot] >= size:
                batches[slot].append(sample.index)
                room[slot] -= size
                break
        else:
            batches.append([sample.index])
            room.append(batch_tokens - size)
    return batches


def shard(batches: list[list[int]], rank: int, world: int, group: int = 1) -> list[list[int]]:
    """This rank's batches: ``batches[rank::world]``, cut so every rank gets the same number, a multiple of
    ``group`` (the batches one optimizer step accumulates on each rank).

    The last ``len(batches) % (world * group)`` batches of the epoch are DROPPED (a different set each
    epoch, since the shuffle changes), so that no rank waits on a step the others never take. Step s then
    trains on ``batches[s * G: (s + 1) * G]`` with G = world * group, whatever the split of G: the same steps
    on 1 process accumulating G batches as on G processes with one each.
    """
    if not 0 <= rank < world:
        raise DataError(f"rank {rank} of world {world}: need 0 <= rank < world")
    if group < 1:
        raise DataError(f"group {group}: a step takes at least one batch")
    per_rank = len(batches) // (world * group) * group
    return batches[rank: per_rank * world: world]


# -- loading -------------------------------------------------------------------------------
@dataclass
class PackedBatch:
    """Samples concatenated along one token axis (no padding).

    With ``aux_scales`` set, the states are still float8 as stored (``load_batch(..., dequantize=False)``):
    ``to(device)`` moves them so and dequantizes there; ``dequantized()`` does it where they are.
    """

    input_ids: torch.Tensor  # [N] int64
    loss_mask: torch.Tensor  # [N] bool
    aux_hidden: torch.Tensor  # [N, n_aux*H], the target's dtype (or float8 with aux_scales)
    last_hidden: torch.Tensor  # [N, H], the target's dtype (or float8 with last_scales)
    doc_ids: torch.Tensor  # [N] int64, 0..k-1 per sample
    position_ids: torch.Tensor  # [N] int64, from 0 in each sample
    sample_ids: list[str] = field(default_factory=list)
    aux_scales: torch.Tensor | None = None  # [N, n_aux] float32, while aux_hidden is float8
    last_scales: torch.Tensor | None = None  # [N, 1] float32, while last_hidden is float8
    hidden_dtype: torch.dtype | None = None  # what float8 states dequantize to (the target's dtype)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def quantized(self) -> bool:
        return self.aux_scales is not None

    def pinned(self) -> PackedBatch:
        """The batch in pinned (page-locked) host memory: its copy to the GPU is queued behind the work already
        there, where a copy from ordinary memory first waits for all of it."""
        tensors = {item.name: getattr(self, item.name) for item in fields(self)}
        return replace(self, **{name: value.pin_memory() for name, value in tensors.items()
                                if isinstance(value, torch.Tensor) and value.device.type == "cpu"})

    def dequantized(self) -> PackedBatch:
        """The batch with its states in the target's dtype, computed on the states' device."""
        if not self.quantized:
            return self
        return replace(self, aux_hidden=storage.dequantize(self.aux_hidden, self.aux_scales, self.hidden_dtype),
                       last_hidden=storage.dequantize(self.last_hidden, self.last_scales, self.hidden_dtype),
                       aux_scales=None, last_scales=None)

    def to(self, device: torch.device | str, non_blocking: bool = False) -> PackedBatch:
        """On ``device``, states in the target's dtype (float8 ones move as float8 and scales, then dequantize)."""
        names = ["input_ids", "loss_mask", "aux_hidden", "last_hidden", "doc_ids", "position_ids"]
        if self.quantized:
            names += ["aux_scales", "last_scales"]
        moved = {name: getattr(self, name).to(device, non_blocking=non_blocking) for name in names}
        return replace(self, **moved, sample_ids=list(self.sample_ids)).dequantized()


def opening_mask(loss_mask: torch.Tensor, doc_ids: torch.Tensor, tokens: int) -> torch.Tensor:
    """The loss-masked tokens that serving a first answer of ``tokens`` tokens drafts: per packed
    sample, tokens 2 to ``tokens`` of its first run of loss-masked tokens (its first assistant turn).

    ``loss_mask`` [N] bool and ``doc_ids`` [N] as in ``PackedBatch`` (a sample's tokens contiguous).
    The evaluation decodes the answer to a conversation's first user turn, ``max_new_tokens`` at
    most, and drafts every token of it but the first (the prefill's); the training's held-out
    accuracy over these tokens is what that measurement should find, while its accuracy over
    every loss token also counts later turns and the tails of long answers.
    """
    mask = loss_mask.bool()
    new_doc = torch.ones_like(mask)
    new_doc[1:] = doc_ids[1:] != doc_ids[:-1]
    previous = torch.zeros_like(mask)
    previous[1:] = mask[:-1]
    starts = (mask & (new_doc | ~previous)).long()  # the first token of each run of loss tokens
    # Runs begun so far in this sample: the running count minus the count before the sample's first token.
    running = starts.cumsum(0)
    doc_start = torch.nonzero(new_doc).squeeze(1)
    before = (running - starts)[doc_start]
    lengths = torch.diff(torch.cat([doc_start, torch.tensor([mask.numel()], device=mask.device)]))
    runs = running - torch.repeat_interleave(before, lengths)
    first = mask & (runs == 1)
    # Index of each token within the (contiguous) first run.
    seen = first.long().cumsum(0)
    seen_before = torch.repeat_interleave((seen - first.long())[doc_start], lengths)
    place = seen - seen_before  # 1 for the answer's first token
    return first & (place >= 2) & (place <= tokens)


def opening_answers(opening: torch.Tensor, doc_ids: torch.Tensor, leads: torch.Tensor) -> list[tuple[list[int], int]]:
    """Per packed sample with tokens in ``opening`` (``opening_mask``: o_1..o_{L-1} of its first answer):
    (``leads`` of the rows whose round proposes each of them, L): the input of ``evaluate.rounds.answer_rounds``.

    ``leads`` [N]: per row, drafts right in a row from its step 0 (``train.loss.TTTMetrics.leads`` of a forward
    scored over ``opening``). The round proposing the token at position s drafts from row s - 2 (its aux state
    paired with the token at s - 1), which is in the same sample: a prompt precedes every answer.
    """
    positions = torch.nonzero(opening.bool()).squeeze(1).cpu()
    if not positions.numel():
        return []
    docs = doc_ids.cpu()[positions]
    rows = leads.cpu()[positions - 2].tolist()
    cuts = (torch.nonzero(docs[1:] != docs[:-1]).squeeze(1) + 1).tolist()
    bounds = [0, *cuts, len(rows)]
    return [(rows[start:stop], stop - start + 1) for start, stop in zip(bounds, bounds[1:])]


def _read_sample(data: TrainData, sample: Sample) -> dict[str, torch.Tensor]:
    """A sample's tensors as stored (float8 ones with their scales), checked against the manifest."""
    try:
        return storage.read_sample(data.root / sample.file, data.layout, sample.tokens, dequantize=False)
    except storage.StorageError as exc:
        raise DataError(str(exc)) from None


def load_batch(data: TrainData, indices: list[int], max_tokens: int | None = None, *,
               dequantize: bool = True) -> PackedBatch:
    """Read the samples ``data.samples[i]`` and concatenate them; ``max_tokens`` cuts the tail.

    ``dequantize=False`` leaves float8 states as stored, with their scales (``PackedBatch.to``
    dequantizes them on the device); unquantized data reads the same either way.
    """
    if not indices:
        raise DataError("load_batch: no samples given")
    parts: dict[str, list[torch.Tensor]] = {"input_ids": [], "loss_mask": [], "aux_hidden_states": [],
                                            "last_hidden_states": [], "doc_ids": [], "position_ids": []}
    if data.layout.quantized:
        parts.update({name: [] for name in storage.SCALE_NAMES.values()})
    left = max_tokens if max_tokens is not None else sum(data.samples[i].tokens for i in indices)
    ids = []
    for doc, index in enumerate(indices):
        if left <= 0:
            break
        sample = data.samples[index]
        tensors = _read_sample(data, sample)
        keep = min(sample.tokens, left)
        left -= keep
        for name, tensor in tensors.items():
            parts[name].append(tensor[:keep])
        parts["doc_ids"].append(torch.full((keep,), doc, dtype=torch.int64))
        parts["position_ids"].append(torch.arange(keep, dtype=torch.int64))
        ids.append(sample.id)
    batch = PackedBatch(
        input_ids=torch.cat(parts["input_ids"]).long(),
        loss_mask=torch.cat(parts["loss_mask"]).bool(),
        aux_hidden=torch.cat(parts["aux_hidden_states"]),
        last_hidden=torch.cat(parts["last_hidden_states"]),
        doc_ids=torch.cat(parts["doc_ids"]),
        position_ids=torch.cat(parts["position_ids"]),
        sample_ids=ids,
    )
    if data.layout.quantized:
        batch = replace(batch, aux_scales=torch.cat(parts["aux_hidden_scales"]),
                        last_scales=torch.cat(parts["last_hidden_scales"]), hidden_dtype=data.dtype)
    return batch.dequantized() if dequantize else batch


# -- the resumable stream ------------------------------------------------------------------
@dataclass(frozen=True)
class DataState:
    """Where the stream stands: the next batch to yield is batch ``batch`` of epoch ``epoch``."""

    epoch: int = 0
    batch: int = 0

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, value: dict) -> DataState:
        try:
            epoch, batch = int(value["epoch"]), int(value["batch"])
        except (KeyError, TypeError, ValueError):
            raise DataError(f"data state {value!r}: expected {{'epoch': int, 'batch': int}}") from None
        if epoch < 0 or batch < 0:
            raise DataError(f"data state {value!r}: negative position")
        return cls(epoch, batch)


def prefetch(stream: Iterator, depth: int = 2, pin: bool = False) -> Iterator:
    """The ``(state, PackedBatch)`` items of ``stream``, read up to ``depth`` ahead in a thread of their own, so
    that reading the next batches from disk goes on while the GPU trains on this one; each batch in pinned memory
    when ``pin`` (``PackedBatch.pinned``). A failure while reading is raised here, in the order the items come;
    closing this generator (or leaving a loop over it) stops the thread."""
    items: queue.Queue = queue.Queue(maxsize=max(1, depth))
    closed = threading.Event()
    end = object()

    def put(item) -> bool:
        while not closed.is_set():
            try:
                items.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def read() -> None:
        try:
            for state, batch in stream:
                if not put((state, batch.pinned() if pin else batch)):
                    return
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer, raised there
            put((end, exc))
            return
        put((end, None))

    thread = threading.Thread(target=read, name="batch-prefetch", daemon=True)
    thread.start()
    try:
        while True:
            state, batch = items.get()
            if state is end:
                if batch is not None:
                    raise batch
                return
            yield state, batch
    finally:
        closed.set()
        thread.join(timeout=10)


def batches(data: TrainData, batch_tokens: int, seed: int, rank: int, world: int, state: DataState | None = None,
            *, samples: list[Sample] | None = None, epochs: int | None = None, dequantize: bool = True,
            group: int = 1) -> Iterator[tuple[DataState, PackedBatch]]:
    """Yield (state after this batch, batch) for this rank, from ``state`` on.

    ``samples`` defaults to all of ``data.samples`` (pass the train half of ``split``);
    ``epochs`` None runs forever. Saving the yielded state with a checkpoint taken after the
    step on that batch and passing it back continues at exactly the next batch, provided the
    seed, budget, world size and sample list are unchanged. The state after the last batch of
    an epoch is (epoch + 1, 0). ``dequantize``: as ``load_batch``'s. ``group``: as ``shard``'s.
    """
    pool = data.samples if samples is None else samples
    state = state or DataState()
    epoch, position = state.epoch, state.batch
    while epochs is None or epoch < epochs:
        mine = shard(pack(pool, batch_tokens, seed, epoch), rank, world, group)
        if not mine:
            raise DataError(f"{len(pool)} samples make fewer than {world * group} batches of {batch_tokens} tokens: "
                            "nothing for every rank; lower the budget, the global batch or the number of "
                            "processes")
        if position > len(mine):
            raise DataError(f"data state batch {position} of epoch {epoch}: this rank has only {len(mine)} batches "
                            "per epoch; resume with the seed, batch budget, world size and data of the saved run")
        for index in range(position, len(mine)):
            after = DataState(epoch, index + 1) if index + 1 < len(mine) else DataState(epoch + 1, 0)
            yield after, load_batch(data, mine[index], max_tokens=batch_tokens, dequantize=dequantize)
        epoch, position = epoch + 1, 0
