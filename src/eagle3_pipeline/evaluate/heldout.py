"""Held-out prompts: read, rendered as the served model would see them, and checked to be unseen.

Reading: the shared dataset reader (``conversations/dataset.py``: ShareGPT or OpenAI records, JSONL
or a JSON array, the same skips). The prompt of a conversation is everything before its FIRST assistant turn,
rendered with the target's chat template up to and including the generation prompt (what a
client sends to ``/generate`` to get that turn), through the extraction's ``ChatRenderer`` with
the manifest's template (refused when the template differs from the one the data was extracted
with: the prompts would not be the ones the drafter's inputs came from).

The overlap check, and why it is sound. A held-out prompt leaks when the drafter was trained on
a sample that starts the same way: then it has seen exactly the hidden states it is now asked to
continue. Two tests, both over every sample of the manifest (the training's data and its own
eval split alike):

1. ids: no held-out record's id is a training sample's id (ids the reader made up for records
   without one name no record and are left out on both sides);
2. tokens: each held-out conversation is rendered by ``ChatRenderer.render``, the very function
   that produced the training samples' ``input_ids`` and ``loss_mask``; its prompt prefix is the
   tokens before the first loss-masked (assistant) token. The SHA-256 of that token sequence is
   compared with the same prefix of every stored sample (``input_ids[:first masked]``, read from
   the sample files without their hidden states). Equal prefixes are the same system and user
   turns under the same template and tokenizer, however the records are named. Comparing the
   stored tokens (not the training file's text) also covers a dataset edited or renamed since
   the extraction, and both sides are cut at the same place by the same code, so tokenization at
   the boundary cannot hide a match. Near-duplicates (a changed word) are not caught: they are
   different prompts.

A prompt either test finds is EXCLUDED and listed (its id, line, the reason and the training sample
it matches) in evaluation.json and the report, and the next prompt of the file is taken instead;
so is a prompt that repeats an earlier held-out one (ShareGPT repeats prompts; one prompt counted
twice is not two measurements). So is a prompt whose decode would reach past the training's
``max_length``: the extraction skipped such records as too long, so from the training's own file they
are the records that did not fit (not a sample of what the drafter learned), and the drafter never
trained at those positions. The evaluation fails only when fewer than its minimum remain.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from dataclasses import dataclass

from eagle3_pipeline.conversations.dataset import Sample, dataset_paths, read_dataset
from eagle3_pipeline.conversations.template import ChatRenderer, SampleError

SHOWN_OVERLAPS = 20


class HeldoutError(ValueError):
    """The held-out prompts cannot be used; the message names the file and the fix."""


@dataclass(frozen=True)
class HeldoutPrompt:
    """One held-out prompt, ready for the target."""

    sample_id: str
    line: int
    input_ids: tuple[int, ...]  # rendered through the generation prompt of the first assistant turn
    prefix_sha256: str  # of the tokens before the first assistant token of the full rendering
    id_is_generated: bool  # the record had no id ("line-N")


def prefix_digest(input_ids, loss_mask) -> str:
    """SHA-256 of the tokens before the first loss-masked token (the whole sequence when none is masked)."""
    ids, mask = [int(i) for i in input_ids], [int(m) for m in loss_mask]
    cut = next((index for index, value in enumerate(mask) if value), len(ids))
    return hashlib.sha256(",".join(map(str, ids[:cut])).encode()).hexdigest()


def _first_assistant(messages) -> int | None:
    return next((index for index, message in enumerate(messages) if message["role"] == "assistant"), None)


@dataclass(frozen=True)
class KnownId:
    """A record whose id is in ``known_ids`` (a training sample's): not rendered, it is excluded anyway."""

    sample_id: str
    line: int


def iter_heldout_prompts(path, renderer: ChatRenderer, known_ids: frozenset[str] = frozenset(),
                         ) -> Iterator[HeldoutPrompt | KnownId | str]:
    """Every record of ``path`` as a ``HeldoutPrompt``, a ``KnownId`` (its id is in ``known_ids``: rendering a
    long conversation only to exclude it would cost most of the selection when the prompts file is the
    training's own dataset), or a line saying why it was left out, in file order."""
    for missing in (p for p in dataset_paths(path) if not p.exists()):
        raise HeldoutError(f"{missing}: no such file (the held-out prompts: ShareGPT or OpenAI records, JSONL, a "
                           "JSON array, Parquet or Arrow, or a folder of them)")
    for record in read_dataset(path):
        if not isinstance(record, Sample):
            yield f"line {record.line}: {record.reason}: {record.detail}"
            continue
        # A mixture's ids are "<source>.<id>": its records are known by their own ids too (a training on one file).
        own_id = record.sample_id.removeprefix(f"{record.source}.") if record.source else record.sample_id
        if not record.id_generated and (record.sample_id in known_ids or own_id in known_ids):
            yield KnownId(record.sample_id, record.line)
            continue
        first = _first_assistant(record.messages)
        if not first:
            yield (f"line {record.line} ({record.sample_id}): no turn before the first assistant turn: nothing to "
                   "prompt with")
            continue
        try:
            full_ids, mask = renderer.render(record.messages)
            # The extraction's own notion of where the assistant turn starts: the template's
            # rendering of the turns before it with the generation prompt.
            text = renderer._turn_start(list(record.messages), first)  # noqa: SLF001
        except SampleError as exc:
            yield f"line {record.line} ({record.sample_id}): {exc.reason}: {exc.detail}"
            continue
        ids = renderer.tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]
        yield HeldoutPrompt(record.sample_id, record.line, tuple(ids), prefix_digest(full_ids, mask),
                            record.id_generated)


def load_heldout_prompts(path: str | os.PathLike, renderer: ChatRenderer, num_prompts: int | None = None,
                         ) -> tuple[list[HeldoutPrompt], list[str]]:
    """The first ``num_prompts`` usable prompts of ``path`` (all when None) and a line per record left out."""
    prompts: list[HeldoutPrompt] = []
    skipped: list[str] = []
    for item in iter_heldout_prompts(path, renderer):
        if num_prompts is not None and len(prompts) >= num_prompts:
            break
        (prompts if isinstance(item, HeldoutPrompt) else skipped).append(item)
    if not prompts:
        shown = "; ".join(skipped[:3]) or "the file is empty"
        raise HeldoutError(f"{path}: no usable prompt ({shown})")
    return prompts, skipped


def training_prefixes(data) -> dict[str, str]:
    """{prompt prefix digest: sample id} of every sample of an opened extraction (``train.data.TrainData``).

    Only ``input_ids`` and ``loss_mask`` are read from each file (safetensors reads one tensor
    without the rest), so this costs a small fraction of reading the data.
    """
    from safetensors import SafetensorError, safe_open  # noqa: PLC0415

    digests: dict[str, str] = {}
    for sample in data.samples:
        file = data.root / sample.file
        try:
            with safe_open(str(file), framework="pt") as handle:
                ids, mask = handle.get_tensor("input_ids"), handle.get_tensor("loss_mask")
        except (OSError, SafetensorError) as exc:
            raise HeldoutError(f"{file}: unreadable ({exc}); the overlap check needs every training sample: "
                               "run `eagle3-pipeline verify` on the data") from None
        digests.setdefault(prefix_digest(ids.tolist(), mask.tolist()), sample.id)
    return digests


def _generated_ids(data) -> set[str]:
    """Manifest ids made up by the reader (records without an id): they name no record."""
    # Manifests written before ``id_generated`` was recorded: JSON Lines' made-up ids name their line.
    return {str(entry["id"]) for shard in data.manifest["shards"].values() for entry in shard["files"]
            if entry.get("id_generated", str(entry["id"]) == f"line-{entry.get('line')}")}


def longest_prompt(data, max_new_tokens: int) -> int | None:
    """The most prompt tokens a held-out prompt may have: the training's ``max_length`` less the tokens the
    evaluation decodes after it (at least 1), or None when the manifest records no ``max_length``."""
    max_length = data.manifest.get("max_length")
    return None if not max_length else max(1, int(max_length) - max(0, int(max_new_tokens)))


@dataclass
class HeldoutSelection:
    """The prompts the evaluation may use, the ones it excluded (id, line, reason) and the records left out."""

    prompts: list[HeldoutPrompt]
    excluded: list[dict]
    skipped: list[str]
    training_samples: int
    longest_prompt: int | None = None  # prompt tokens allowed (``longest_prompt``); None: no limit
    shorter: int = 0  # prompts passed over as shorter than ``min_prompt_tokens`` (not counted as excluded)

    def summary(self) -> dict:
        """The overlap check's record for evaluation.json."""
        return {"checked_prompts": len(self.prompts) + len(self.excluded), "usable_prompts": len(self.prompts),
                "excluded": len(self.excluded), "training_samples": self.training_samples,
                "longest_prompt_tokens": self.longest_prompt,
                "method": "sample ids, and SHA-256 of the prompt tokens before the first assistant token; prompts "
                          "whose decode would pass the training's max_length"}


def select_heldout_prompts(path, renderer: ChatRenderer, data, num_prompts: int,
                           min_prompts: int = 1, max_new_tokens: int = 0,
                           min_prompt_tokens: int = 0) -> HeldoutSelection:
    """The first ``num_prompts`` prompts of ``path`` that the drafter never saw (see the module docstring).

    A prompt that is in the training data (same id, or same prompt tokens as a training sample) or that
    repeats an earlier held-out prompt (ShareGPT repeats prompts: it would be counted twice) is excluded,
    with its id and reason, and the next one is taken. So is a prompt whose decode (``max_new_tokens`` more)
    would reach past the training's ``max_length`` (``longest_prompt``): the drafter never trained at
    those positions, and the extraction itself skipped such records, so when the prompts file is the
    training's own dataset these are exactly its records that did not fit, not held-out ones. Fewer than
    ``min_prompts`` left is a ``HeldoutError`` that names how many were excluded and why.
    ``min_prompt_tokens``: only prompts of at least that many tokens (long-context measurements); the shorter
    ones are passed over and counted in ``shorter``.
    """
    generated = _generated_ids(data)
    training_ids = {sample.id for sample in data.samples} - generated
    # A mixture's ids are "<source>.<id>": the held-out file is one source as it is, its ids unprefixed.
    training_ids |= {str(entry["id"]).removeprefix(f"{entry['source']}.") for shard in data.manifest["shards"].values()
                     for entry in shard["files"] if entry.get("source") and str(entry["id"]) not in generated}
    by_prefix = training_prefixes(data)
    chosen: dict[str, str] = {}  # prefix digest -> held-out id
    longest = longest_prompt(data, max_new_tokens)
    selection = HeldoutSelection([], [], [], len(data.samples), longest)
    for item in iter_heldout_prompts(path, renderer, frozenset(training_ids)):
        if len(selection.prompts) >= num_prompts:
            break
        if isinstance(item, KnownId):
            selection.excluded.append({"id": item.sample_id, "line": item.line,
                                       "reason": "same id as a training sample", "other": item.sample_id})
            continue
        if not isinstance(item, HeldoutPrompt):
            selection.skipped.append(item)
            continue
        if len(item.input_ids) < min_prompt_tokens:
            selection.shorter += 1
            continue
        reason = None
        if item.prefix_sha256 in by_prefix:
            reason, other = "same prompt tokens as a training sample", by_prefix[item.prefix_sha256]
        elif item.prefix_sha256 in chosen:
            reason, other = "same prompt tokens as an earlier held-out prompt", chosen[item.prefix_sha256]
        elif longest is not None and len(item.input_ids) > longest:
            reason = "longer than the training's samples"
            other = (f"{len(item.input_ids)} prompt tokens + {max_new_tokens} new > max_length "
                     f"{data.manifest['max_length']}")
        if reason:
            selection.excluded.append({"id": item.sample_id, "line": item.line, "reason": reason, "other": other})
            continue
        chosen[item.prefix_sha256] = item.sample_id
        selection.prompts.append(item)
    if len(selection.prompts) < min_prompts:
        shown = "; ".join(f"{e['id']} ({e['reason']}: {e['other']})" for e in selection.excluded[:SHOWN_OVERLAPS])
        shorter = f", {selection.shorter} shorter than {min_prompt_tokens} tokens" if selection.shorter else ""
        raise HeldoutError(
            f"{path}: only {len(selection.prompts)} usable held-out prompt(s), at least {min_prompts} needed: "
            f"{len(selection.excluded)} excluded as seen in training, repeated or too long ({shown or 'none'}), "
            f"{len(selection.skipped)} left out as unusable{shorter}. Give a prompts file with more conversations "
            "the drafter was not trained on (or lower the minimum)")
    return selection
