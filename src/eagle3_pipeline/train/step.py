"""One training step over a packed batch: what the trainer runs and ``bench/training.py`` measures.

``StepRunner`` holds the drafter (wrapped for DDP or FSDP when several processes train), the
target's ``lm_head`` for the teacher, and the precision policy:

- ``float32``: everything in fp32 (the CPU default; exact, for the resume and DDP equality tests);
- ``bfloat16``: fp32 master weights, the forward and backward in bf16 (weights cast once per forward,
  as autocast does); the optimizer updates the fp32 weights.

On CUDA in bfloat16 (``attention="auto"``) the step takes the fused path, the same function as the
reference (masked SDPA, autocast, ``ttt_loss``) computed fast and light:

- ``Eagle3Drafter.forward_fused``: flash attention over the step-0 prefix merged through the
  log-sum-exp with each row's own keys of steps 1..k (O(T) memory, not O(T * K*T)), [q;k;v] and
  [gate;up] as single matmuls, the pointwise parts ``torch.compile``d, and the MLP's [T, 2I] gate/up
  output recomputed in the backward for the first ``mlp_recompute_steps`` steps instead of kept;
- ``fused_ttt_loss``: lm_head + soft CE with the gradients computed in the forward, so no [T, D]
  float32 tensor per step is kept; the teacher keeps only the draft-vocabulary logits in bf16;
- the frozen ``embed_tokens`` lives in pinned host memory in bf16 (``keep_embeddings_on_host``):
  the batch's rows are gathered there and copied over (2.1 GB of GPU memory less at 128256 x 4096);
- the previous step's gradients are freed before the forward, and a CUDA AdamW runs its fused kernel
  (the same update without the foreach implementation's full-size temporaries).

The CPU (and ``float32``) path is the reference, unchanged: exact fp32, what the resume and DDP
equality tests check. FSDP keeps the reference path too (the fused loss reads the lm_head weight
directly, which FSDP shards outside the lm_head's own forward).

The loss of each TTT step is divided by the global count of its masked rows divided by the
number of processes (``denominators``), so that DDP's average of the per-process gradients is
the gradient of the global mean: two processes on halves of a batch step exactly as one process
on the whole batch (up to float rounding).
"""

from __future__ import annotations

import gc
import warnings
from collections.abc import Sequence
from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch import nn

from eagle3_pipeline.train.data import PackedBatch
from eagle3_pipeline.train.kernels import fused_kernels, packed_layout
from eagle3_pipeline.train.loss import (
    STEP_DECAY,
    TeacherTargets,
    TTTLoss,
    TTTMetrics,
    fused_ttt_loss,
    teacher_targets,
    ttt_loss,
    ttt_metrics,
    ttt_metrics_from_argmax,
)
from eagle3_pipeline.train.model import Eagle3Drafter

PARALLEL_MODES = ("ddp", "fsdp")
ATTENTION_CHOICES = ("auto", "sdpa", "fused")
EMBEDDING_PLACES = ("auto", "device", "host")
# Fused path: TTT steps whose MLP gate/up output is recomputed in the backward. 5 of 7 keeps a
# Llama-3.1-8B-shaped drafter (2048 tokens) at 8.91 GiB peak allocated on an H200 (7: 8.69 GiB, 4: 9.02 GiB).
DEFAULT_MLP_RECOMPUTE = 5


def distributed() -> bool:
    """A process group is up (torchrun with more than one process, or a test's group)."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def leave_process_group() -> None:
    """Destroy the process group (if one is up), after freeing what still holds it.

    The training's modules outlive ``trainer.train`` in reference cycles (18 or 19 a process), and the
    DDP / FSDP wrapper among them holds the group. Left to the interpreter's shutdown, the group's gloo
    threads are torn down after Python's and abort the process ("terminate called without an active
    exception": 2 two-process FSDP runs in 53 on a loaded 2-core machine, and once in CI). Collected
    here, while the interpreter runs, the group goes with the modules that held it.
    """
    if dist.is_available() and dist.is_initialized():
        gc.collect()
        dist.destroy_process_group()


def all_reduce(tensor: torch.Tensor) -> torch.Tensor:
    """Sum ``tensor`` over the processes, in place (a no-op for one process)."""
    if distributed():
        dist.all_reduce(tensor)
    return tensor


def step_counts(teacher: TeacherTargets, steps: int) -> torch.Tensor:
    """Masked rows per TTT step [K], as ``ttt_loss`` counts them."""
    return teacher.step_masks(steps).trained.sum((1, 2))  # rows past step k's last (T-2-k) are never trained


def wrap(model: Eagle3Drafter, device: torch.device, parallel: str) -> nn.Module:
    """The module the training forward goes through: the drafter itself, or its DDP / FSDP wrapper."""
    if parallel not in PARALLEL_MODES:
        raise ValueError(f"parallel must be one of {PARALLEL_MODES}, got {parallel!r}")
    if not distributed():
        return model
    if parallel == "fsdp":
        from torch.distributed.fsdp import fully_shard  # noqa: PLC0415

        # lm_head is called as a module (its own unit: gathered, then freed); the midlayer's
        # pieces are called as methods, which FSDP's hooks do not see, so they go with the root.
        fully_shard(model.lm_head)
        return fully_shard(model)
    ids = [device.index if device.index is not None else torch.cuda.current_device()] if device.type == "cuda" else None
    # Buffers (d2t, t2d, RoPE frequencies) never change: no broadcast on every forward.
    with warnings.catch_warnings():  # torch 2.13 renames the option; 2.11 (the GPU machine's) has only this one
        warnings.filterwarnings("ignore", message=".*broadcast_buffers.*", category=FutureWarning)
        return nn.parallel.DistributedDataParallel(model, device_ids=ids, broadcast_buffers=False)


class StepRunner:
    """Teacher, forward, loss and metrics of one packed batch, and the optimizer step on it.

    Options beyond the trainer's (defaults suit it): ``attention`` ("auto": fused on CUDA in bfloat16
    unless FSDP, else the reference "sdpa"), ``compile`` (torch.compile the fused path's pointwise
    parts; default on CUDA), ``mlp_recompute_steps`` (fused path: steps whose MLP gate/up output is
    recomputed in the backward; default ``DEFAULT_MLP_RECOMPUTE``, which keeps a Llama-3.1-8B-shaped
    drafter at TTT 7 and 2048 tokens within 9 GiB), ``embeddings`` ("auto": on the host with the fused
    path on CUDA when ``embed_tokens`` is frozen, else on the device).
    """

    def __init__(self, model: Eagle3Drafter, lm_head: torch.Tensor, *, ttt_length: int, device: torch.device,
                 dtype: str = "float32", parallel: str = "ddp", attention: str = "auto", compile: bool | None = None,
                 mlp_recompute_steps: int | None = None, embeddings: str = "auto", teacher_temperature: float = 1.0,
                 step_decay: float = STEP_DECAY):
        if attention not in ATTENTION_CHOICES:
            raise ValueError(f"attention must be one of {ATTENTION_CHOICES}, got {attention!r}")
        if embeddings not in EMBEDDING_PLACES:
            raise ValueError(f"embeddings must be one of {EMBEDDING_PLACES}, got {embeddings!r}")
        sharded = distributed() and parallel == "fsdp"
        if attention == "fused" and sharded:
            raise ValueError("attention 'fused' does not run under FSDP (use parallel 'ddp' or attention 'sdpa')")
        self.model = model
        self.lm_head = lm_head
        self.teacher_temperature = teacher_temperature
        self.step_decay = step_decay
        self.ttt_length = ttt_length
        self.device = device
        self.dtype = dtype
        if attention == "auto":
            attention = ("fused" if device.type == "cuda" and dtype == "bfloat16" and not sharded
                         and model.config.layout == "llama" else "sdpa")  # the MLA layout has no fused path yet
        self.attention = attention
        self.compile = (device.type == "cuda") if compile is None else compile
        self.mlp_recompute_steps = DEFAULT_MLP_RECOMPUTE if mlp_recompute_steps is None else mlp_recompute_steps
        trained_embeddings = model.embed_tokens.weight.requires_grad  # a drafter wider or narrower than its target
        if embeddings == "auto":
            host = attention == "fused" and device.type == "cuda" and not trained_embeddings
            embeddings = "host" if host else "device"
        if embeddings == "host":
            if trained_embeddings or attention != "fused":
                raise ValueError("embeddings 'host' needs attention 'fused' and a frozen embed_tokens")
            model.keep_embeddings_on_host(torch.bfloat16 if dtype == "bfloat16" else torch.float32)
        self.embeddings = embeddings
        self.module = wrap(model, device, parallel)
        self.world = dist.get_world_size() if distributed() else 1

    @property
    def compute_dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.dtype == "bfloat16" else torch.float32

    def autocast(self):
        if self.dtype != "bfloat16":
            return nullcontext()
        return torch.autocast(self.device.type, dtype=torch.bfloat16)

    def teacher(self, batch: PackedBatch) -> TeacherTargets:
        batch = batch.dequantized()  # float8 states (a batch not moved by ``forward``): where they are
        return teacher_targets(batch.last_hidden[None], self.lm_head, self.model.t2d, self.model.d2t,
                               batch.loss_mask[None], batch.doc_ids[None], temperature=self.teacher_temperature)

    def forward(self, batch: PackedBatch, *, training: bool = True,
                denominators: torch.Tensor | None = None) -> tuple[TTTLoss, TTTMetrics]:
        """(loss, metrics) of one batch. ``training``: through the DDP/FSDP wrapper, with the global
        denominators (a collective: every process must call it); else the local model, each step's
        CE summed (``denominators`` of ones) unless given."""
        prepared = self._prepare(batch)
        if denominators is None:
            if training:
                denominators = all_reduce(step_counts(prepared[2], self.ttt_length).float()) / self.world
            else:
                denominators = torch.ones(self.ttt_length, device=self.device)
        return self._run(prepared, training, denominators)

    def _prepare(self, batch: PackedBatch) -> tuple:
        """The batch on the device, its host-gathered embeddings and its packed layout (fused path), its teacher.

        Nothing here waits for the GPU when the batch comes in pinned host memory (``PackedBatch.pinned``): the
        embeddings and the layout are made from the host's copy, and every copy is queued behind the work before,
        so the host goes on queueing this step while the GPU finishes the last."""
        token_embeds = layout = None
        if self.attention == "fused":
            if self.embeddings == "host":
                token_embeds = self.model.token_embeddings(batch.input_ids[None], self.ttt_length, self.device,
                                                           self.compute_dtype)
            if batch.doc_ids.device.type == "cpu":
                layout = packed_layout(batch.doc_ids[None], self.device)
        batch = batch.to(self.device, non_blocking=True)
        return batch, token_embeds, self.teacher(batch), layout

    def _run(self, prepared, training: bool, denominators: torch.Tensor) -> tuple[TTTLoss, TTTMetrics]:
        batch, token_embeds, teacher, layout = prepared
        module = self.module if training else self.model
        inputs = (batch.input_ids[None], batch.aux_hidden[None], batch.position_ids[None], self.ttt_length,
                  batch.doc_ids[None])
        if self.attention == "fused":
            hidden = module(*inputs, attention="fused", compute_dtype=self.compute_dtype, token_embeds=token_embeds,
                            mlp_recompute_steps=self.mlp_recompute_steps, compile=self.compile, head=False,
                            layout=layout)
            kernels = fused_kernels(self.model.config, self.compile)
            loss, top = fused_ttt_loss(hidden, self.model.lm_head.weight, teacher, denominators=denominators,
                                       decay=self.step_decay, kernels=kernels)
            return loss, ttt_metrics_from_argmax(top, teacher)
        with self.autocast():
            logits = module(*inputs)
        return ttt_loss(logits, teacher, denominators=denominators, decay=self.step_decay), ttt_metrics(logits, teacher)

    def train_step(self, batch: PackedBatch | Sequence[PackedBatch], optimizer: torch.optim.Optimizer, lr: float,
                   grad_clip: float) -> tuple[TTTLoss, TTTMetrics]:
        """Forward, backward, clip, update; the step's (loss, metrics).

        A list of batches is one step accumulated over them: each step's loss is divided by the rows of every
        batch of every process together (a collective over their counts, before any backward), so the step
        is the one a single batch holding them all would give, whatever the number of processes."""
        for group in optimizer.param_groups:
            group["lr"] = lr
        if self.device.type == "cuda":
            use_fused_adamw(optimizer)
        # Before the forward, so that the last step's gradients are not held through this one's.
        optimizer.zero_grad(set_to_none=True)
        if isinstance(batch, PackedBatch):
            loss, metrics = self.forward(batch)
            loss.loss.backward()
        else:
            loss, metrics = self._accumulate(list(batch))
        if grad_clip > 0:
            torch.nn.utils.clip_grad_norm_([p for p in self.model.parameters() if p.requires_grad], grad_clip)
        optimizer.step()
        return loss, metrics

    def _accumulate(self, batches: list[PackedBatch]) -> tuple[TTTLoss, TTTMetrics]:
        if not batches:
            raise ValueError("a training step needs at least one batch")
        prepared = [self._prepare(batch) for batch in batches]
        counts = torch.stack([step_counts(p[2], self.ttt_length).float() for p in prepared]).sum(0)
        denominators = all_reduce(counts) / self.world
        total_loss, total_metrics = None, None
        for index, one in enumerate(prepared):
            with gradient_sync(self.module, index == len(prepared) - 1):  # the gradients reduced once, at the end
                loss, metrics = self._run(one, True, denominators)
                loss.loss.backward()
            total_loss = TTTLoss(loss.loss.detach(), loss.step_losses, loss.step_counts) if total_loss is None \
                else TTTLoss(total_loss.loss + loss.loss.detach(), total_loss.step_losses + loss.step_losses,
                             total_loss.step_counts + loss.step_counts)
            total_metrics = metrics if total_metrics is None else total_metrics.plus(metrics)
        return total_loss, total_metrics


def gradient_sync(module: nn.Module, enabled: bool):
    """A context in which the backward reduces gradients over the processes (``enabled``) or only accumulates
    them: DDP's ``no_sync``, FSDP's ``set_requires_gradient_sync``; a plain module always accumulates."""
    if enabled:
        return nullcontext()
    if isinstance(module, nn.parallel.DistributedDataParallel):
        return module.no_sync()
    if hasattr(module, "set_requires_gradient_sync"):
        return _FsdpNoSync(module)
    return nullcontext()


class _FsdpNoSync:
    def __init__(self, module):
        self.module = module

    def __enter__(self):
        self.module.set_requires_gradient_sync(False)

    def __exit__(self, *exc):
        self.module.set_requires_gradient_sync(True)


def use_fused_adamw(optimizer: torch.optim.Optimizer) -> None:
    """Switch a torch Adam/AdamW whose parameters are all float CUDA tensors to its fused kernel.

    The same update as the default foreach implementation, which allocates temporaries the size
    of all parameters (1.7 GB for a 425M-parameter drafter) at every step.
    """
    if not isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW):
        return
    for group in optimizer.param_groups:
        if group.get("fused") or group.get("differentiable"):
            continue
        if not all(p.is_cuda and p.is_floating_point() for p in group["params"]):
            continue
        group["fused"], group["foreach"] = True, False
        for p in group["params"]:  # a resumed state's step counters are CPU tensors; the fused kernel wants them here
            state = optimizer.state.get(p)
            if state and "step" in state and state["step"].device != p.device:
                state["step"] = state["step"].to(p.device, torch.float32)
