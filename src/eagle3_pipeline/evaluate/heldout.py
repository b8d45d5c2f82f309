"""Held-out prompts: read, rendered as the served model would see them, and checked to be unseen.

Reading: the extraction's dataset reader (``extract/dataset.py``: ShareGPT or OpenAI JSONL, the
same skips). The prompt of a conversation is everything before its FIRST assistant turn,
rendered with the target's chat template up to and including the generation prompt (what a
client sends to ``/generate`` to get that turn), through the extraction's ``ChatRenderer`` with
the manifest's template (refused when the template differs from the one the data was extracted
with: the prompts would not be the ones the drafter's inputs came from).

The overlap check, and why it is sound. A held-out prompt leaks when the drafter was trained on
a sample that starts the same way: then it has seen exactly the hidden states it is now asked to
continue. Two tests, both over every sample of the manifest (the training's data and its own
eval split alike):

1. ids: no held-out record's id is a training sample's id (ids generated from line numbers,
   ``line-N``, name no record and are left out on both sides);
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

Either test failing refuses the evaluation with ``HeldoutOverlapError`` naming the ids.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

from eagle3_pipeline.extract.dataset import Sample, read_dataset
from eagle3_pipeline.extract.template import ChatRenderer, SampleError

SHOWN_OVERLAPS = 20


class HeldoutError(ValueError):
    """The held-out prompts cannot be used; the message names the file and the fix."""


class HeldoutOverlapError(HeldoutError):
    """Held-out prompts found in the training data; ``overlaps`` lists (held-out id, training id, how)."""

    def __init__(self, message: str, overlaps: list[tuple[str, str, str]]):
        super().__init__(message)
        self.overlaps = overlaps


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


def load_heldout_prompts(path: str | os.PathLike, renderer: ChatRenderer, num_prompts: int | None = None,
                         ) -> tuple[list[HeldoutPrompt], list[str]]:
    """The first ``num_prompts`` usable prompts of ``path`` (all when None) and a line per record left out."""
    path = Path(path)
    if not path.is_file():
        raise HeldoutError(f"{path}: no such file (the held-out prompts, ShareGPT or OpenAI JSONL)")
    prompts: list[HeldoutPrompt] = []
    skipped: list[str] = []
    for record in read_dataset(path):
        if num_prompts is not None and len(prompts) >= num_prompts:
            break
        if not isinstance(record, Sample):
            skipped.append(f"line {record.line}: {record.reason}: {record.detail}")
            continue
        first = _first_assistant(record.messages)
        if not first:
            skipped.append(f"line {record.line} ({record.sample_id}): no turn before the first assistant turn: "
                           "nothing to prompt with")
            continue
        try:
            full_ids, mask = renderer.render(record.messages)
            # The extraction's own notion of where the assistant turn starts: the template's
            # rendering of the turns before it with the generation prompt.
            text = renderer._turn_start(list(record.messages), first)  # noqa: SLF001
        except SampleError as exc:
            skipped.append(f"line {record.line} ({record.sample_id}): {exc.reason}: {exc.detail}")
            continue
        ids = renderer.tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]
        prompts.append(HeldoutPrompt(record.sample_id, record.line, tuple(ids), prefix_digest(full_ids, mask),
                                     record.sample_id == f"line-{record.line}"))
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
    """Manifest ids made from line numbers (records without an id)."""
    return {str(entry["id"]) for shard in data.manifest["shards"].values() for entry in shard["files"]
            if str(entry["id"]) == f"line-{entry.get('line')}"}


def check_no_overlap(prompts: list[HeldoutPrompt], data) -> dict:
    """Refuse held-out prompts that are in the training data (see the module docstring); a summary when none is."""
    generated = _generated_ids(data)
    training_ids = {sample.id for sample in data.samples} - generated
    by_prefix = training_prefixes(data)
    overlaps = []
    for prompt in prompts:
        if not prompt.id_is_generated and prompt.sample_id in training_ids:
            overlaps.append((prompt.sample_id, prompt.sample_id, "same id"))
        if prompt.prefix_sha256 in by_prefix:
            overlaps.append((prompt.sample_id, by_prefix[prompt.prefix_sha256], "same prompt tokens"))
    if overlaps:
        held = sorted({held for held, _, _ in overlaps})
        shown = ", ".join(f"{held} ({how} as training sample {seen})" for held, seen, how in overlaps[:SHOWN_OVERLAPS])
        more = f" and {len(overlaps) - SHOWN_OVERLAPS} more" if len(overlaps) > SHOWN_OVERLAPS else ""
        raise HeldoutOverlapError(
            f"{len(held)} held-out prompt(s) are in the training data {data.root}: {shown}{more}. A drafter measured "
            "on prompts it was trained on overstates its acceptance: remove them from the prompts file (or give "
            "another one)", overlaps)
    return {"checked_prompts": len(prompts), "training_samples": len(data.samples), "overlaps": 0,
            "method": "sample ids, and SHA-256 of the prompt tokens before the first assistant token"}
