"""Held-out prompts: read, rendered as the served model would see them, and checked to be unseen.

Reading: the extraction's dataset reader (``extract/dataset.py``: ShareGPT or OpenAI records, JSONL
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
twice is not two measurements). The evaluation fails only when fewer than its minimum remain.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from eagle3_pipeline.extract.dataset import Sample, read_dataset
from eagle3_pipeline.extract.template import ChatRenderer, SampleError

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


def iter_heldout_prompts(path: str | os.PathLike, renderer: ChatRenderer) -> Iterator[HeldoutPrompt | str]:
    """Every record of ``path`` as a ``HeldoutPrompt``, or a line saying why it was left out, in file order."""
    path = Path(path)
    if not path.is_file():
        raise HeldoutError(f"{path}: no such file (the held-out prompts: ShareGPT or OpenAI records, JSONL or a JSON "
                           "array)")
    for record in read_dataset(path):
        if not isinstance(record, Sample):
            yield f"line {record.line}: {record.reason}: {record.detail}"
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


@dataclass
class HeldoutSelection:
    """The prompts the evaluation may use, the ones it excluded (id, line, reason) and the records left out."""

    prompts: list[HeldoutPrompt]
    excluded: list[dict]
    skipped: list[str]
    training_samples: int

    def summary(self) -> dict:
        """The overlap check's record for evaluation.json."""
        return {"checked_prompts": len(self.prompts) + len(self.excluded), "usable_prompts": len(self.prompts),
                "excluded": len(self.excluded), "training_samples": self.training_samples,
                "method": "sample ids, and SHA-256 of the prompt tokens before the first assistant token"}


def select_heldout_prompts(path: str | os.PathLike, renderer: ChatRenderer, data, num_prompts: int,
                           min_prompts: int = 1) -> HeldoutSelection:
    """The first ``num_prompts`` prompts of ``path`` that the drafter never saw (see the module docstring).

    A prompt that is in the training data (same id, or same prompt tokens as a training sample) or that
    repeats an earlier held-out prompt (ShareGPT repeats prompts: it would be counted twice) is excluded,
    with its id and reason, and the next one is taken. Fewer than ``min_prompts`` left is a ``HeldoutError``
    that names how many were excluded and why.
    """
    generated = _generated_ids(data)
    training_ids = {sample.id for sample in data.samples} - generated
    by_prefix = training_prefixes(data)
    chosen: dict[str, str] = {}  # prefix digest -> held-out id
    selection = HeldoutSelection([], [], [], len(data.samples))
    for item in iter_heldout_prompts(path, renderer):
        if len(selection.prompts) >= num_prompts:
            break
        if not isinstance(item, HeldoutPrompt):
            selection.skipped.append(item)
            continue
        reason = None
        if not item.id_is_generated and item.sample_id in training_ids:
            reason, other = "same id as a training sample", item.sample_id
        elif item.prefix_sha256 in by_prefix:
            reason, other = "same prompt tokens as a training sample", by_prefix[item.prefix_sha256]
        elif item.prefix_sha256 in chosen:
            reason, other = "same prompt tokens as an earlier held-out prompt", chosen[item.prefix_sha256]
        if reason:
            selection.excluded.append({"id": item.sample_id, "line": item.line, "reason": reason, "other": other})
            continue
        chosen[item.prefix_sha256] = item.sample_id
        selection.prompts.append(item)
    if len(selection.prompts) < min_prompts:
        shown = "; ".join(f"{e['id']} ({e['reason']}: {e['other']})" for e in selection.excluded[:SHOWN_OVERLAPS])
        raise HeldoutError(
            f"{path}: only {len(selection.prompts)} usable held-out prompt(s), at least {min_prompts} needed: "
            f"{len(selection.excluded)} excluded as seen in training ({shown or 'none'}), {len(selection.skipped)} "
            "left out as unusable. Give a prompts file with more conversations the drafter was not trained on "
            "(or lower the minimum)")
    return selection
