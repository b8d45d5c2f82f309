"""The teacher, the TTT loss and the metrics of the drafter's steps (``train/model.py``).

Loss: sum_k decay^k * CE_k (decay: ``step_decay``, 0.5 by default, EAGLE-3's 0.8), CE_k the soft
cross-entropy -sum_d q(d) log softmax(logits)(d) averaged over the rows whose step-k mask is set
(``denominators`` lets DDP divide by the global count).
Metrics per step: acc_k = top-1 agreement over the masked rows; conditional acc_k = agreement at
step k among rows whose chain was right at steps 0..k-1 (rows where the target's top-1 is out of
the draft vocabulary count as misses, as when serving); simulated acceptance length
sum_k prod_{i<=k} cond_acc_i, the expected number of draft tokens accepted per verify (SGLang's
reported accept length adds the target's own token: 1 + this).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property

import torch
import torch.nn.functional as F

from eagle3_pipeline.train.kernels import FusedKernels, default_doc_ids, soft_ce_rows
from eagle3_pipeline.train.recipe import DEFAULT_STEP_DECAY

TEACHER_CHUNK_BYTES = 128 << 20
STEP_DECAY = DEFAULT_STEP_DECAY
MASK_STEPS = 8  # TeacherTargets.step_masks makes at least this many steps' masks (TTT lengths are 7 or so)


@dataclass
class StepMasks:
    """Every TTT step's rows at once, [K, B, T] each: at step k, drafter row t predicts x_{t+2+k}."""

    valid: torch.Tensor  # bool: x_{t+2+k} exists, is in t's sample and is loss-masked
    in_draft: torch.Tensor  # bool: the target's top-1 at t+1+k (the step's target token) is in the draft vocabulary
    trained: torch.Tensor  # bool: valid and in_draft, the rows the loss trains
    argmax: torch.Tensor  # int64: the teacher's draft-vocabulary top-1 for row t at step k (-1 past the end)


def shifts_left(x: torch.Tensor, first: int, count: int, fill: int | bool) -> torch.Tensor:
    """``x`` [B, T] moved left by ``first``, ``first`` + 1, ... (``count`` of them): [count, B, T], row t of the i-th
    the row t + first + i of ``x``, ``fill`` past the end; ``shift_left`` of each, in one copy (views of it)."""
    batch, length = x.shape
    padded = torch.cat([x, x.new_full((batch, first + count), fill)], dim=1)
    return padded.unfold(1, length, 1)[:, first:first + count].transpose(0, 1)


@dataclass
class TeacherTargets:
    """The target's view of a batch, unshifted: row s is the target's distribution of token s + 1.

    ``step(k)`` gives the rows of step k: row t of the drafter's step-k logits is scored against
    row t + 1 + k here, for x_{t+2+k}.
    """

    logits: torch.Tensor  # [B, T, D] the target's logits restricted to the draft vocabulary, in the matmul's dtype
    argmax: torch.Tensor  # [B, T] int64, draft id of the target's top-1 (meaningless where not in_draft)
    in_draft: torch.Tensor  # [B, T] bool, the target's top-1 over its full vocabulary is in the draft vocabulary
    loss_mask: torch.Tensor  # [B, T] bool, x_s is an assistant token
    doc_ids: torch.Tensor  # [B, T] int64, packed sample of each row
    # The steps' masks (``step_masks``), made once for all steps: the loss, its row counts and the metrics all ask for
    # them; made step by step at every ask they were hundreds of small kernels a training step. Never changed in place.
    _step_masks: StepMasks | None = field(default=None, init=False, repr=False, compare=False)

    @cached_property
    def probs(self) -> torch.Tensor:
        """[B, T, D] float32: the soft targets, softmax of ``logits`` (``fused_ttt_loss`` computes them per chunk
        instead, so that the [B, T, D] float32 tensor never exists)."""
        return torch.softmax(self.logits.float(), dim=-1)

    def __setattr__(self, name: str, value) -> None:
        if name != "_step_masks":
            self.__dict__["_step_masks"] = None  # an input changed: the masks made from it are stale
        super().__setattr__(name, value)

    def step_masks(self, steps: int) -> StepMasks:
        """The masks of steps 0..``steps``-1, [steps, B, T] each, made in a few batched operations (once a batch)."""
        have = self._step_masks
        if have is None or have.valid.shape[0] < steps:
            made = max(steps, MASK_STEPS)  # a caller asking step by step gets them from one making
            docs = shifts_left(self.doc_ids, 1, made + 1, -1)  # [K + 1, B, T]: moved by 1..K+1
            same = docs == self.doc_ids
            # Step k: x_{t+1+k} and x_{t+2+k} both in t's sample, x_{t+2+k} loss-masked.
            valid = same[1:] & same[:-1] & shifts_left(self.loss_mask, 2, made, False)
            in_draft = shifts_left(self.in_draft, 1, made, False)
            have = StepMasks(valid=valid, in_draft=in_draft, trained=valid & in_draft,
                             argmax=shifts_left(self.argmax, 1, made, -1))
            self._step_masks = have
        if have.valid.shape[0] == steps:
            return have
        return StepMasks(*(getattr(have, name)[:steps] for name in ("valid", "in_draft", "trained", "argmax")))

    def valid(self, step: int) -> torch.Tensor:
        """Rows t [B, T] bool whose step-k prediction x_{t+2+k} exists, is in t's sample and is loss-masked."""
        return self.step_masks(step + 1).valid[step]

    def position_mask(self, step: int) -> torch.Tensor:
        """Rows t [B, T] bool trained at step k: valid, and the target's top-1 at t+1+k is in the draft vocabulary."""
        return self.step_masks(step + 1).trained[step]

    def step_probs(self, step: int) -> torch.Tensor:
        """The teacher rows of step k for drafter rows 0..T-2-k: a view [B, T-1-k, D] (no copy)."""
        return self.probs[:, 1 + step:]

    def step_argmax(self, step: int) -> torch.Tensor:
        """The teacher's draft-vocabulary top-1 for drafter rows t at step k, [B, T] (-1 past the end)."""
        return self.step_masks(step + 1).argmax[step]


@torch.no_grad()
def teacher_targets(
    last_hidden: torch.Tensor,
    target_lm_head: torch.Tensor,
    t2d: torch.Tensor,
    d2t: torch.Tensor,
    loss_mask: torch.Tensor,
    doc_ids: torch.Tensor | None = None,
    chunk_rows: int | None = None,
    temperature: float = 1.0,
) -> TeacherTargets:
    """The target's soft targets over the draft vocabulary from its stored last hidden states.

    ``last_hidden`` [B, T, H] (after the target's final norm, as extracted), ``target_lm_head``
    [V, H] (the matmul runs in its dtype: float32 for exact targets, bf16 to halve its memory),
    ``loss_mask`` [B, T]. Rows are done ``chunk_rows`` at a time (default: as many as keep the
    full-vocabulary logits of a chunk within 128 MiB). Only the draft-vocabulary logits are kept, in the
    matmul's dtype (exact: that is the dtype the matmul produced); ``probs`` is their softmax in float32.
    ``temperature`` divides them: below 1 the soft targets lean toward the target's top-1, the token a greedy
    verify accepts (the top-1 itself, ``argmax``, does not change).
    """
    if not temperature > 0:
        raise ValueError(f"teacher temperature must be positive, got {temperature!r}")
    batch, length, hidden = last_hidden.shape
    if target_lm_head.dim() != 2 or target_lm_head.shape[1] != hidden or target_lm_head.shape[0] != t2d.numel():
        raise ValueError(f"target lm_head {tuple(target_lm_head.shape)} does not fit hidden size {hidden} and "
                         f"vocabulary {t2d.numel()}")
    if chunk_rows is None:
        chunk_rows = max(1, TEACHER_CHUNK_BYTES // (t2d.numel() * target_lm_head.element_size()))
    draft_ids = (d2t + torch.arange(d2t.numel(), device=d2t.device)).to(last_hidden.device)  # [D] target ids
    t2d = t2d.to(last_hidden.device)
    draft_index = torch.cumsum(t2d.long(), 0) - 1  # [V]: draft id of a target id (valid where t2d)
    rows = last_hidden.reshape(batch * length, hidden)
    draft_logits = torch.empty(batch * length, d2t.numel(), dtype=target_lm_head.dtype, device=last_hidden.device)
    top = torch.empty(batch * length, dtype=torch.int64, device=last_hidden.device)
    for start in range(0, rows.shape[0], chunk_rows):
        logits = F.linear(rows[start:start + chunk_rows].to(target_lm_head.dtype), target_lm_head)  # [n, V]
        top[start:start + chunk_rows] = logits.argmax(-1)  # the same as on float32 copies: the cast is monotonic
        draft_logits[start:start + chunk_rows] = logits[:, draft_ids]
    if temperature != 1.0:
        draft_logits.div_(temperature)
    top = top.view(batch, length)
    return TeacherTargets(
        logits=draft_logits.view(batch, length, -1),
        argmax=draft_index[top],
        in_draft=t2d[top],
        loss_mask=loss_mask.to(torch.bool),
        doc_ids=default_doc_ids(loss_mask) if doc_ids is None else doc_ids,
    )


@dataclass
class TTTLoss:
    """The weighted loss to backpropagate, and its parts per step."""

    loss: torch.Tensor  # scalar, sum_k decay^k * CE_k
    step_losses: torch.Tensor  # [K] CE_k, detached
    step_counts: torch.Tensor  # [K] rows in each step's mask (local)


def ttt_loss(
    step_logits: Sequence[torch.Tensor],
    teacher: TeacherTargets,
    decay: float = STEP_DECAY,
    denominators: torch.Tensor | None = None,
) -> TTTLoss:
    """sum_k decay^k * soft cross-entropy of step k over its masked rows.

    Each CE_k is divided by the step's masked row count, or by ``denominators[k]`` when given
    (the global counts under DDP, so that every rank's share adds up to the global mean).
    """
    total = step_logits[0].new_zeros((), dtype=torch.float32)
    losses, counts = [], []
    trained = teacher.step_masks(len(step_logits)).trained
    for step, logits in enumerate(step_logits):
        if logits.shape != teacher.logits.shape:
            raise ValueError(f"step {step}: logits {tuple(logits.shape)} and teacher {tuple(teacher.logits.shape)} "
                             "must both be [B, T, draft_vocab_size]")
        rows = max(logits.shape[1] - 1 - step, 0)
        mask = trained[step][:, :rows]  # [B, rows]
        log_p = torch.log_softmax(logits[:, :rows].float(), dim=-1)  # [B, rows, D]
        ce = -(teacher.step_probs(step)[:, :rows] * log_p).sum(-1)  # [B, rows]
        summed = (ce * mask).sum()
        count = mask.sum()
        denominator = denominators[step] if denominators is not None else count
        mean = summed / denominator.clamp(min=1)
        total = total + decay**step * mean
        losses.append(mean.detach())
        counts.append(count)
    return TTTLoss(loss=total, step_losses=torch.stack(losses), step_counts=torch.stack(counts))


def _accumulate_product(total: torch.Tensor | None, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """total + a @ b in float32 (a, b in the compute dtype); on CUDA bf16 the matmul accumulates into total."""
    if a.dtype == torch.float32:
        return torch.mm(a, b) if total is None else total.addmm_(a, b)
    if a.is_cuda:
        if total is None:
            return torch.mm(a, b, out_dtype=torch.float32)
        return torch.addmm(total, a, b, out_dtype=torch.float32, out=total)
    product = torch.mm(a, b).float()
    return product if total is None else total.add_(product)


class _FusedHeadLoss(torch.autograd.Function):
    """lm_head + soft cross-entropy of every TTT step, the gradients computed in the forward.

    Inputs: (weight [D, H], teacher logits [N, D], row weights [K, N] (mask / denominator), decay, soft_ce
    (``soft_ce_rows`` or its compiled form), chunk_rows, need_grad, hidden_0 .. hidden_{K-1} [N, H]).
    Step k's row t is scored against teacher row t + 1 + k. The [rows, D] logits exist one chunk at a time;
    what the backward keeps is the gradient of each step's hidden [N, H] and of the weight [D, H] (float32),
    both scaled by the incoming gradient then.
    Outputs: the loss, the per-step CE [K] and the drafter's top-1 [K, N] (-1 where no teacher row).
    """

    @staticmethod
    def forward(ctx, weight, teacher_logits, row_weights, decay, soft_ce, chunk_rows, need_grad, *hiddens):
        rows = hiddens[0].shape[0]
        w = weight.to(hiddens[0].dtype)
        step_losses = torch.zeros(len(hiddens), dtype=row_weights.dtype, device=w.device)
        argmax = torch.full((len(hiddens), rows), -1, dtype=torch.int64, device=w.device)
        grad_hiddens, grad_weight = [], None
        for step, hidden in enumerate(hiddens):
            scored = max(rows - 1 - step, 0)
            grad_hidden = torch.zeros_like(hidden) if need_grad else None
            for start in range(0, scored, chunk_rows):
                stop = min(scored, start + chunk_rows)
                part = hidden[start:stop]
                weights = row_weights[step, start:stop]
                ce, grad, top = soft_ce(F.linear(part, w), teacher_logits[start + 1 + step: stop + 1 + step],
                                        weights * decay**step)
                step_losses[step] += (ce * weights).sum()
                argmax[step, start:stop] = top
                if need_grad:
                    torch.mm(grad, w, out=grad_hidden[start:stop])
                    grad_weight = _accumulate_product(grad_weight, grad.t(), part)
            grad_hiddens.append(grad_hidden)
        # Made on the device: a tensor copied from the host's list would wait for every kernel queued before it.
        decays = torch.pow(decay, torch.arange(len(hiddens), dtype=row_weights.dtype, device=w.device))
        ctx.grads = (grad_weight, grad_hiddens)
        ctx.mark_non_differentiable(step_losses, argmax)
        return (decays * step_losses).sum(), step_losses, argmax

    @staticmethod
    def backward(ctx, grad_loss, _grad_steps, _grad_argmax):
        grad_weight, grad_hiddens = ctx.grads
        ctx.grads = None
        if grad_weight is None:
            raise RuntimeError("fused_ttt_loss was run with need_grad=False; it has no gradient to give")
        grad_weight.mul_(grad_loss)  # 1 when the loss is the root of the backward
        for grad in grad_hiddens:
            grad.mul_(grad_loss.to(grad.dtype))
        return (grad_weight, None, None, None, None, None, None, *grad_hiddens)


def fused_ttt_loss(
    step_hidden: Sequence[torch.Tensor],
    lm_head_weight: torch.Tensor,
    teacher: TeacherTargets,
    decay: float = STEP_DECAY,
    denominators: torch.Tensor | None = None,
    *,
    kernels: FusedKernels | None = None,
    chunk_rows: int | None = None,
) -> tuple[TTTLoss, list[torch.Tensor]]:
    """``ttt_loss`` of ``forward_fused(..., head=False)``'s normed hidden states [B, T, H] per step, the lm_head
    applied here; also each step's top-1 draft id [B, T] for ``ttt_metrics_from_argmax``.

    Memory: no [T, D] float32 tensor per step is kept for the backward (only the hidden states' gradients,
    [T, H] each, and the lm_head weight's, which the optimizer needs anyway); ``chunk_rows`` bounds the
    transient logits (default: all rows when the kernels are compiled, which fuse the softmax, else 256).
    """
    batch, length, _ = step_hidden[0].shape
    rows = batch * length
    if teacher.logits.shape[:2] != (batch, length):
        raise ValueError(f"hidden states [{batch}, {length}, H] and teacher {tuple(teacher.logits.shape)} differ")
    trained = teacher.step_masks(len(step_hidden)).trained  # [K, B, T]
    counts = trained.sum((1, 2))
    dtype = torch.promote_types(step_hidden[0].dtype, torch.float32)
    divide = (denominators if denominators is not None else counts).to(dtype).clamp(min=1)
    row_weights = trained.reshape(len(step_hidden), rows).to(dtype) / divide[:, None]  # [K, N]
    if chunk_rows is None:
        chunk_rows = rows if kernels is not None and kernels.compiled else 256
    need_grad = torch.is_grad_enabled() and (lm_head_weight.requires_grad or any(h.requires_grad for h in step_hidden))
    loss, step_losses, argmax = _FusedHeadLoss.apply(
        lm_head_weight, teacher.logits.reshape(rows, -1), row_weights, decay,
        kernels.soft_ce if kernels is not None else soft_ce_rows, max(1, chunk_rows), need_grad,
        *[h.reshape(rows, -1) for h in step_hidden])
    return (TTTLoss(loss=loss, step_losses=step_losses.detach(), step_counts=counts),
            list(argmax.view(len(step_hidden), batch, length)))


def acceptance_length(cond_acc: Sequence[float]) -> float:
    """sum_k prod_{i<=k} cond_acc_i: expected draft tokens accepted per verify for a chain of len(cond_acc)."""
    total, chain = 0.0, 1.0
    for accuracy in cond_acc:
        chain *= accuracy
        total += chain
    return total


@dataclass
class TTTMetrics:
    """Counts per step (sum them over ranks and batches, then read the ratios)."""

    hits: torch.Tensor  # [K] rows of the position mask where the drafter's top-1 is the teacher's
    rows: torch.Tensor  # [K] rows of the position mask
    chain_hits: torch.Tensor  # [K] valid rows right at steps 0..k
    chain_rows: torch.Tensor  # [K] valid rows right at steps 0..k-1
    # [B, T] per row: steps right in a row from step 0 (valid ones): the drafts a round from that row accepts
    # (``evaluate.rounds``); not a count, so never summed.
    leads: torch.Tensor | None = None

    def plus(self, other: TTTMetrics) -> TTTMetrics:
        """The counts of both (``leads`` is per row, not a count: dropped)."""
        return TTTMetrics(self.hits + other.hits, self.rows + other.rows, self.chain_hits + other.chain_hits,
                          self.chain_rows + other.chain_rows)

    @property
    def acc(self) -> list[float]:
        """acc_k: top-1 agreement over the trained rows."""
        return [float(h) / float(r) if r else 0.0 for h, r in zip(self.hits, self.rows)]

    @property
    def cond_acc(self) -> list[float]:
        """Conditional acc_k: agreement at step k given the chain was right at steps 0..k-1."""
        return [float(h) / float(r) if r else 0.0 for h, r in zip(self.chain_hits, self.chain_rows)]

    @property
    def acceptance_length(self) -> float:
        """The simulated acceptance length sum_k prod_{i<=k} cond_acc_i."""
        return acceptance_length(self.cond_acc)


@torch.no_grad()
def ttt_metrics(step_logits: Sequence[torch.Tensor], teacher: TeacherTargets) -> TTTMetrics:
    """acc_k, conditional acc_k and the simulated acceptance length's counts for one batch."""
    return ttt_metrics_from_argmax([logits.argmax(-1) for logits in step_logits], teacher)


@torch.no_grad()
def ttt_metrics_from_argmax(step_argmax: Sequence[torch.Tensor], teacher: TeacherTargets) -> TTTMetrics:
    """``ttt_metrics`` from the drafter's top-1 draft id [B, T] of each step (``fused_ttt_loss`` gives them), all
    steps at once."""
    top = torch.stack(list(step_argmax))  # [K, B, T]
    masks = teacher.step_masks(top.shape[0])
    right = (top == masks.argmax) & masks.in_draft
    # A chain is right at step k where it was valid and right at every step 0..k; step k is tried where the chain was
    # right at steps 0..k-1 and k is valid.
    chain = (~(masks.valid & right)).cumsum(0) == 0
    tried = masks.valid.clone()
    tried[1:] &= chain[:-1]
    return TTTMetrics(hits=(right & masks.trained).sum((1, 2)), rows=masks.trained.sum((1, 2)),
                      chain_hits=chain.sum((1, 2)), chain_rows=tried.sum((1, 2)), leads=chain.sum(0))
