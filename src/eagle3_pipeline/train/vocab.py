"""The draft vocabulary: which target tokens the drafter can propose, and the two maps SGLang reads.

The drafter's ``lm_head`` scores D tokens, not the target's V. They are the D target tokens seen
most often at loss-masked positions of the extracted data (the assistant tokens, the ones the
target generates and the drafter has to guess), counted by the extraction into
``<data>/token_counts.safetensors`` (``counts`` [V] int64).

Two maps go into the drafter's checkpoint:

- ``d2t`` int64 [D]: offsets, target id = i + d2t[i] for draft id i (SGLang's
  ``hot_token_id = d2t + arange(D)``);
- ``t2d`` bool [V]: True for the target ids in the draft vocabulary.

Draft ids are ordered by target id (draft id i is the i-th smallest chosen target id), not by
frequency. Then ``t2d.nonzero()`` and ``arange(D) + d2t`` list the same ids in the same order,
so slicing a full-vocabulary tensor with the boolean ``t2d`` (what SpecForge and speculators do
to the target's logits and lm_head) and indexing it with ``d2t`` give the same columns, and
either map alone reconstructs the other. ``check_mapping`` insists on that order.

Ties in the counts are broken by the lower target id, and when fewer than D tokens have been
seen at all, the lowest unseen ids fill the rest, so the same counts always give the same
mapping.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from eagle3_pipeline.extract.store import MANIFEST_FILE, TOKEN_COUNTS_FILE, file_sha256

DEFAULT_DRAFT_VOCAB_SIZE = 32000
DRAFT_VOCAB_VARIABLE = "eagle_training_draft_vocab_size"


class VocabError(ValueError):
    """Counts or a mapping that cannot make a valid draft vocabulary; the message says why."""


@dataclass(frozen=True)
class DraftVocab:
    """A draft vocabulary of D tokens over a target vocabulary of V tokens."""

    d2t: torch.Tensor  # [D] int64, target id = i + d2t[i]
    t2d: torch.Tensor  # [V] bool, True where the target id is in the draft vocabulary
    num_seen: int  # how many of the D tokens were seen at loss-masked positions (the rest is padding)
    coverage: float  # share of the loss-masked tokens whose id is in the draft vocabulary

    @property
    def draft_vocab_size(self) -> int:
        """D."""
        return int(self.d2t.numel())

    @property
    def vocab_size(self) -> int:
        """V, the target's vocabulary size."""
        return int(self.t2d.numel())

    def target_ids(self) -> torch.Tensor:
        """The target id of every draft id, [D] int64, increasing."""
        return self.d2t + torch.arange(self.d2t.numel(), dtype=torch.int64)


def default_draft_vocab_size(vocab_size: int) -> int:
    """32000, or the target's vocabulary size when that is smaller."""
    return min(DEFAULT_DRAFT_VOCAB_SIZE, vocab_size)


def resolve_draft_vocab_size(vocab_size: int, draft_vocab_size: int | None) -> int:
    """The draft vocabulary size to use; an explicit one larger than V (or below 1) is refused."""
    if draft_vocab_size is None:
        return default_draft_vocab_size(vocab_size)
    if isinstance(draft_vocab_size, bool) or not isinstance(draft_vocab_size, int):
        raise VocabError(f"{DRAFT_VOCAB_VARIABLE} must be an integer, got {draft_vocab_size!r}")
    if draft_vocab_size < 1:
        raise VocabError(f"{DRAFT_VOCAB_VARIABLE}={draft_vocab_size}: the draft vocabulary needs at least one token")
    if draft_vocab_size > vocab_size:
        raise VocabError(
            f"{DRAFT_VOCAB_VARIABLE}={draft_vocab_size} is larger than the target's vocabulary ({vocab_size} tokens); "
            f"set it to at most {vocab_size}, or leave it unset for min({DEFAULT_DRAFT_VOCAB_SIZE}, {vocab_size})"
        )
    return draft_vocab_size


def build_draft_vocab(counts: torch.Tensor, draft_vocab_size: int | None = None) -> DraftVocab:
    """The D most frequent target tokens of ``counts`` ([V] int64), as ``d2t`` and ``t2d``.

    Ties go to the lower id; when fewer than D ids have a non-zero count, the lowest unseen ids
    pad the vocabulary. ``draft_vocab_size`` None means min(32000, V).
    """
    if counts.dim() != 1 or counts.numel() == 0:
        raise VocabError(f"token counts must be a non-empty 1-D tensor [V], got shape {tuple(counts.shape)}")
    if counts.dtype.is_floating_point or counts.dtype == torch.bool:
        raise VocabError(f"token counts must be integers, got {counts.dtype}")
    counts = counts.to(torch.int64)
    if bool((counts < 0).any()):
        raise VocabError(f"token counts must be non-negative; {int((counts < 0).sum())} ids have negative counts")
    vocab_size = int(counts.numel())
    size = resolve_draft_vocab_size(vocab_size, draft_vocab_size)
    ids = torch.arange(vocab_size, dtype=torch.int64)
    # A stable sort on the negated counts keeps equal counts in id order: ties go to the lower id,
    # and the unseen ids (count 0) come last, lowest first, which is the padding rule.
    order = torch.sort(-counts, stable=True).indices
    chosen = torch.sort(ids[order[:size]]).values
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[chosen] = True
    d2t = chosen - torch.arange(size, dtype=torch.int64)
    total = int(counts.sum())
    covered = int(counts[chosen].sum())
    return DraftVocab(
        d2t=d2t,
        t2d=t2d,
        num_seen=int((counts[chosen] > 0).sum()),
        coverage=covered / total if total else 0.0,
    )


def check_mapping(d2t: torch.Tensor, t2d: torch.Tensor, vocab_size: int) -> None:
    """Refuse a ``d2t``/``t2d`` pair that is not one draft vocabulary over ``vocab_size`` target ids.

    Checks dtypes and shapes, that every target id is in range and appears once, that draft ids
    follow target id order, and that ``t2d`` marks exactly the ids ``d2t`` lists.
    """
    if d2t.dim() != 1 or d2t.numel() == 0:
        raise VocabError(f"d2t must be a non-empty 1-D tensor [D], got shape {tuple(d2t.shape)}")
    if d2t.dtype != torch.int64:
        raise VocabError(f"d2t must be int64 offsets (target id = i + d2t[i]), got {d2t.dtype}")
    if t2d.dtype != torch.bool:
        raise VocabError(f"t2d must be bool over the target vocabulary, got {t2d.dtype}")
    if t2d.dim() != 1 or t2d.numel() != vocab_size:
        raise VocabError(f"t2d has shape {tuple(t2d.shape)}, the target vocabulary has {vocab_size} tokens")
    size = int(d2t.numel())
    if size > vocab_size:
        raise VocabError(f"d2t has {size} entries, more than the target's {vocab_size} tokens")
    target_ids = d2t.cpu() + torch.arange(size, dtype=torch.int64)
    bad = ((target_ids < 0) | (target_ids >= vocab_size)).nonzero().flatten()
    if bad.numel():
        i = int(bad[0])
        raise VocabError(
            f"d2t maps {bad.numel()} draft ids outside the target vocabulary [0, {vocab_size}): "
            f"draft id {i} -> target id {int(target_ids[i])}"
        )
    unique, counts = torch.unique(target_ids, return_counts=True)
    if unique.numel() != size:
        dup = int(unique[counts > 1][0])
        raise VocabError(f"d2t maps several draft ids to the same target id ({dup}); each target id may appear once")
    if size > 1 and not bool((target_ids[1:] > target_ids[:-1]).all()):
        raise VocabError(
            "d2t is not in target id order (draft id i must be the i-th smallest target id), so slicing "
            "with t2d would pick the columns in another order than d2t; rebuild the mapping"
        )
    marked = int(t2d.sum())
    if marked != size:
        raise VocabError(f"t2d marks {marked} target ids, d2t lists {size}: the two maps are of different vocabularies")
    if not torch.equal(t2d.cpu().nonzero().flatten(), target_ids):
        raise VocabError("t2d does not mark the target ids d2t lists: the two maps are of different vocabularies")


def load_token_counts(data_dir: Path | str) -> torch.Tensor:
    """The extraction's loss-masked token counts, [V] int64, checked against its manifest.

    When ``data_config.json`` is there, the file's SHA-256 and the vocabulary size must match
    what it records (a counts file left from another extraction is refused).
    """
    data_dir = Path(data_dir)
    path = data_dir / TOKEN_COUNTS_FILE
    if not path.is_file():
        raise VocabError(f"{path}: no token counts; run the extraction (and its merge) on {data_dir} first")
    try:
        with safe_open(str(path), framework="pt") as handle:
            if "counts" not in handle.keys():
                raise VocabError(f"{path}: no 'counts' tensor (found {sorted(handle.keys())})")
            counts = handle.get_tensor("counts")
    except (SafetensorError, OSError) as exc:
        raise VocabError(f"{path}: unreadable ({exc}); rerun the extraction's merge to rewrite it") from exc
    if counts.dim() != 1 or counts.dtype != torch.int64:
        raise VocabError(f"{path}: counts must be [V] int64, got {tuple(counts.shape)} {counts.dtype}")
    manifest_path = data_dir / MANIFEST_FILE
    if manifest_path.is_file():
        manifest = json.loads(manifest_path.read_text())
        vocab_size = manifest.get("vocab_size")
        if vocab_size is not None and vocab_size != counts.numel():
            raise VocabError(f"{path}: {counts.numel()} counts, the manifest's target has {vocab_size} tokens")
        recorded = (manifest.get("token_counts") or {}).get("sha256")
        if recorded is not None and recorded != file_sha256(path):
            raise VocabError(f"{path}: its SHA-256 differs from {manifest_path}'s; rerun the extraction's merge")
    return counts
