"""The teacher, the TTT loss and the metrics of the drafter's steps (``train/model.py``).

Loss: sum_k 0.8^k * CE_k, CE_k the soft cross-entropy -sum_d q(d) log softmax(logits)(d) averaged
over the rows whose step-k mask is set (``denominators`` lets DDP divide by the global count).
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

from eagle3_pipeline.train.kernels import FusedKernels, default_doc_ids, shift_left, soft_ce_rows

TEACHER_CHUNK_BYTES = 128 << 20
STEP_DECAY = 0.8


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
    # Each step's masks, made once: the loss, its row counts and the metrics all ask for them (eagerly, a dozen
    # small kernels each on the GPU, hundreds a training step when made again at every ask). Never changed in place.
    _masks: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    @cached_property
    def probs(self) -> torch.Tensor:
        """[B, T, D] float32: the soft targets, softmax of ``logits`` (``fused_ttt_loss`` computes them per chunk
        instead, so that the [B, T, D] float32 tensor never exists)."""
        return torch.softmax(self.logits.float(), dim=-1)

    def __setattr__(self, name: str, value) -> None:
        masks = self.__dict__.get("_masks")
        if masks and name != "_masks":
            masks.clear()  # an input changed: the masks made from it are stale
        super().__setattr__(name, value)

    def valid(self, step: int) -> torch.Tensor:
        """Rows t [B, T] bool whose step-k prediction x_{t+2+k} exists, is in t's sample and is loss-masked."""
        key = ("valid", step)
        if key not in self._masks:
            same_doc = (shift_left(self.doc_ids, 2 + step, -1) == self.doc_ids) & (
                shift_left(self.doc_ids, 1 + step, -1) == self.doc_ids)
            self._masks[key] = same_doc & shift_left(self.loss_mask, 2 + step, False)
        return self._masks[key]

    def position_mask(self, step: int) -> torch.Tensor:
        """Rows t [B, T] bool trained at step k: valid, and the target's top-1 at t+1+k is in the draft vocabulary."""
        key = ("trained", step)
        if key not in self._masks:
            self._masks[key] = self.valid(step) & self.step_in_draft(step)
        return self._masks[key]

    def step_in_draft(self, step: int) -> torch.Tensor:
        """Rows t [B, T] bool whose step-k target token (the target's top-1 at t+1+k) is in the draft vocabulary."""
        key = ("in_draft", step)
        if key not in self._masks:
            self._masks[key] = shift_left(self.in_draft, 1 + step, False)
        return self._masks[key]

    def step_probs(self, step: int) -> torch.Tensor:
        """The teacher rows of step k for drafter rows 0..T-2-k: a view [B, T-1-k, D] (no copy)."""
        return self.probs[:, 1 + step:]

    def step_argmax(self, step: int) -> torch.Tensor:
        """The teacher's draft-vocabulary top-1 for drafter rows t at step k, [B, T] (-1 past the end)."""
        return shift_left(self.argmax, 1 + step, -1)


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
    for step, logits in enumerate(step_logits):
        if logits.shape != teacher.logits.shape:
            raise ValueError(f"step {step}: logits {tuple(logits.shape)} and teacher {tuple(teacher.logits.shape)} "
                             "must both be [B, T, draft_vocab_size]")
        rows = max(logits.shape[1] - 1 - step, 0)
        mask = teacher.position_mask(step)[:, :rows]  # [B, rows]
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
    masks = [teacher.position_mask(step) for step in range(len(step_hidden))]  # [B, T] each
    counts = torch.stack([mask.sum() for mask in masks])
    dtype = torch.promote_types(step_hidden[0].dtype, torch.float32)
    divide = (denominators if denominators is not None else counts).to(dtype).clamp(min=1)
    row_weights = torch.stack([mask.reshape(rows).to(dtype) / divide[k] for k, mask in enumerate(masks)])  # [K, N]
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
    """``ttt_metrics`` from the drafter's top-1 draft id [B, T] of each step (``fused_ttt_loss`` gives them)."""
    hits, rows, chain_hits, chain_rows = [], [], [], []
    chain = leads = None
    for step, top in enumerate(step_argmax):
        valid = teacher.valid(step)  # [B, T]
        right = (top == teacher.step_argmax(step)) & teacher.step_in_draft(step)
        trained = teacher.position_mask(step)
        hits.append((right & trained).sum())
        rows.append(trained.sum())
        tried = valid if chain is None else chain & valid
        chain = tried & right
        leads = chain.long() if leads is None else leads + chain
        chain_hits.append(chain.sum())
        chain_rows.append(tried.sum())
    return TTTMetrics(hits=torch.stack(hits), rows=torch.stack(rows), chain_hits=torch.stack(chain_hits),
                      chain_rows=torch.stack(chain_rows), leads=leads)
