"""The training loop, in one process or in each process of a torchrun job (DDP or FSDP).

``train(cfg)`` opens the extraction output, builds the draft vocabulary from its token counts,
the drafter from the target's ``config.json`` (embeddings copied from the target and frozen),
and trains it with AdamW, a cosine schedule with linear warmup and gradient clipping against
the teacher (the target's ``lm_head`` over the stored last hidden states). Rank 0 writes:

    <out>/progress.json                 state, step, loss, acc per position, tokens/s, time left (about 1/s)
    <out>/metrics.jsonl                 one JSON line per step ("kind": "train") and per checkpoint ("kind": "eval")
    <out>/tensorboard/                  the same scalars as TensorBoard events (when tensorboard is installed)
    <out>/charts/*.png                  loss, acc per position, simulated acceptance length (matplotlib)
    <out>/checkpoints/step-N/           model.safetensors, optimizer.safetensors, rng.safetensors, state.json
    <out>/drafter/                      the SGLang export (``export.export_sglang``)
    <out>/drafter-speculators/          the speculators form vLLM reads (when the drafter fits it)
    <out>/training.json                 the finished run: settings fingerprint, final metrics, paths

Checkpoints hold no pickle: tensors go into safetensors (the optimizer state, keyed by parameter
name, flattened to ``state.<name>.<key>``), everything else (param groups, schedule, data
position, the SHA-256 of every file) into ``state.json``, written last. A checkpoint is built in
a temp dir and renamed into place; on resume the newest one whose files all match their
recorded SHA-256 is used (a partial or damaged one is skipped), and ``metrics.jsonl`` is cut back
to its step, so a run killed at any point and restarted gives the same per-step losses as an
uninterrupted one (on the CPU with a fixed seed; the last two checkpoints are kept).

The schedule's length is ``epochs`` x batches per epoch, NOT ``max_steps``: ``max_steps`` only
stops the run, so stopping at N and continuing with a larger limit follows the same curve.

Several processes: each reads its own share of every epoch's batches (``data.shard``); the
loss of each TTT step is divided by the global count of masked rows / world (``step.py``), so
DDP's gradient average equals the global mean; metric counts are all-reduced; state dicts are
gathered whole (a collective under FSDP) and only rank 0 writes files. SIGTERM or SIGINT: every
process stops after the current step, a checkpoint is written, ``StopRequested`` is raised.
A finished run is recorded in ``training.json`` with a fingerprint of the data and the settings
that decide the result; the same call again returns at once (``Plan.status()['complete']``).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import signal
import threading
import time
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

from eagle3_pipeline.atomic import atomic_write_text
from eagle3_pipeline.checksum import file_sha256
from eagle3_pipeline.evaluate.rounds import AcceptanceStats, answer_rounds
from eagle3_pipeline.extract.store import count_tokens
from eagle3_pipeline.extract.verify import load_lm_head
from eagle3_pipeline.models.config import read_text_config
from eagle3_pipeline.train import export
from eagle3_pipeline.train.command import STOP_FILE_ENV
from eagle3_pipeline.train.data import (
    DataError,
    DataState,
    TrainData,
    batches,
    load_batch,
    open_dataset,
    opening_answers,
    opening_mask,
    pack,
    prefetch,
    shard,
)
from eagle3_pipeline.train.loss import STEP_DECAY, TTTMetrics
from eagle3_pipeline.train.model import LAYOUTS, DrafterConfig, Eagle3Drafter
from eagle3_pipeline.train.recipe import (
    DEFAULT_HEAD_INIT,
    DEFAULT_TEACHER_TEMPERATURE,
    EAGLE3_STEP_DECAY,
    HEAD_INITS,
)
from eagle3_pipeline.train.step import PARALLEL_MODES, StepRunner, all_reduce, distributed
from eagle3_pipeline.train.variants import DEFAULT_VARIANT, VARIANTS
from eagle3_pipeline.train.vocab import VocabError, build_draft_vocab, load_token_counts, resolve_draft_vocab_size

METRICS_FILE = "metrics.jsonl"
CHECKPOINTS_DIR = "checkpoints"
DRAFTER_DIR = "drafter"
KEEP_CHECKPOINTS = 2
STATE_FILE = "state.json"
MODEL_FILE = "model.safetensors"
OPTIMIZER_FILE = "optimizer.safetensors"
RNG_FILE = "rng.safetensors"
DTYPES = ("float32", "bfloat16")
SHAPE_OVERRIDES = ("hidden_size", "num_attention_heads", "num_key_value_heads", "intermediate_size")
PROGRESS_FILE = "progress.json"
TRAINING_FILE = "training.json"
SPECULATORS_DIR = "drafter-speculators"  # beside the drafter dir: <drafter dir name>-speculators
TENSORBOARD_DIR = "tensorboard"
CHARTS_DIR = "charts"
# Settings that decide what a finished run exports: the same ones over the same data -> nothing to do.
FINGERPRINT_FIELDS = ("target_model_path", "draft_vocab_size", "ttt_length", "epochs", "max_steps", "lr",
                      "warmup_steps", "weight_decay", "grad_clip", "batch_tokens", "eval_ratio", "seed", "dtype",
                      "variant", "norm_before_fc", "layout", "head_init", "teacher_temperature", "step_decay",
                      "global_batch_tokens", "max_train_samples", *SHAPE_OVERRIDES)
# What a checkpoint written before a setting was recorded had (variants, layouts and the head's start came later).
FIXED_BEFORE = {"variant": DEFAULT_VARIANT, "norm_before_fc": False, "layout": "llama", "head_init": "random",
                "accumulate": 1, "max_train_samples": None, "step_decay": EAGLE3_STEP_DECAY}



class TrainConfigError(ValueError):
    """A training setting that cannot work; the message names the field."""


@dataclass
class TrainConfig:
    """What ``train`` does; each field is the ``eagle_training_<field>`` variable."""

    data_dir: str
    output_dir: str
    target_model_path: str | None = None  # None: the manifest's
    draft_vocab_size: int | None = None  # None: min(32000, target vocab)
    ttt_length: int = 7
    epochs: int = 1
    max_steps: int | None = None  # stops the run; does not change the schedule
    lr: float = 1e-4
    warmup_steps: int = 0
    weight_decay: float = 0.0
    grad_clip: float = 0.5  # 0: no clipping
    batch_tokens: int | None = None  # None: auto_batch_tokens(the drafter's hidden size)
    # Tokens per optimizer step over all processes: a multiple of batch_tokens x processes, each process then
    # accumulating that many of its batches per step, so that the steps do not depend on the number of GPUs.
    # None: one batch per process per step (the global batch grows with the processes).
    global_batch_tokens: int | None = None
    # Train on the first N samples of the training split only (dataset order; the held-out split and its
    # metrics are unchanged, the draft vocabulary is counted over those N): what a smaller extraction gives.
    max_train_samples: int | None = None
    eval_ratio: float = 0.0
    # The held-out metrics again over the tokens serving a first answer of this many tokens drafts
    # (data.opening_mask): the evaluation's prediction when its max_new_tokens is this; 0: not computed.
    eval_opening_tokens: int = 128
    seed: int = 0
    checkpoint_every: int = 0  # 0: only at the end
    device: str = "auto"  # auto: this process's GPU under torchrun / the first GPU when there is one, else cpu
    dtype: str = "auto"  # auto: bfloat16 on a GPU, float32 on the CPU; bfloat16 = autocast, fp32 master weights
    parallel: str = "ddp"  # several processes: ddp (replicated drafter) or fsdp (sharded, for wide drafters)
    resume: bool = True  # False: discard the output dir's checkpoints and metrics, start over
    # The drafter's variant: eagle3, or eagle3.1 (fc_norm and norm_output; train/variants.py), and whether one
    # RMSNorm covers the concatenated aux states before fc.
    variant: str = DEFAULT_VARIANT
    norm_before_fc: bool = False
    # The attention: auto (MLA for a target with multi-latent attention, e.g. Kimi-K2.x; else Llama's), llama, mla.
    layout: str = "auto"
    # The recipe (train/recipe.py): the lm_head and final norm at step 0, target's or random; the soft targets'
    # temperature (below 1: leaning toward the target's top-1).
    head_init: str = DEFAULT_HEAD_INIT
    teacher_temperature: float = DEFAULT_TEACHER_TEMPERATURE
    step_decay: float = STEP_DECAY  # the loss weighs TTT step k by step_decay ** k
    # The drafter's shape; None: the target's (see DrafterConfig.from_target).
    hidden_size: int | None = None
    num_attention_heads: int | None = None
    num_key_value_heads: int | None = None
    intermediate_size: int | None = None
    drafter_dir: str | None = None  # where the SGLang export goes; None: <output_dir>/drafter
    tensorboard: bool = True  # <out>/tensorboard/ when the tensorboard package is installed
    charts: bool = True  # <out>/charts/*.png when matplotlib is installed

    def __post_init__(self) -> None:
        for name in ("data_dir", "output_dir"):
            if not getattr(self, name):
                raise TrainConfigError(f"{name} must be a directory path, got {getattr(self, name)!r}")
        optional = ("max_steps", "draft_vocab_size", "batch_tokens", "global_batch_tokens", "max_train_samples",
                    *SHAPE_OVERRIDES)
        positive = ["ttt_length", "epochs"] + [n for n in optional if getattr(self, n) is not None]
        for name in positive:
            _check_int(name, getattr(self, name), 1)
        for name in ("warmup_steps", "seed", "checkpoint_every", "eval_opening_tokens"):
            _check_int(name, getattr(self, name), 0)
        for name, low in (("lr", None), ("weight_decay", 0.0), ("grad_clip", 0.0), ("teacher_temperature", None),
                          ("step_decay", None)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) \
                    or (value <= 0 if low is None else value < low):
                raise TrainConfigError(f"{name} must be a {'positive' if low is None else 'non-negative'} number, "
                                       f"got {value!r}")
        if isinstance(self.eval_ratio, bool) or not isinstance(self.eval_ratio, int | float) \
                or not 0.0 <= self.eval_ratio < 1.0:
            raise TrainConfigError(f"eval_ratio must be in [0, 1), got {self.eval_ratio!r}")
        if self.dtype not in ("auto", *DTYPES):
            raise TrainConfigError(f"dtype must be auto or one of {DTYPES}, got {self.dtype!r}")
        if self.layout not in ("auto", *LAYOUTS):
            raise TrainConfigError(f"layout must be auto or one of {', '.join(LAYOUTS)}, got {self.layout!r}")
        if self.head_init not in HEAD_INITS:
            raise TrainConfigError(f"head_init must be one of {', '.join(HEAD_INITS)}, got {self.head_init!r}")
        if self.variant not in VARIANTS:
            raise TrainConfigError(f"variant must be one of {', '.join(VARIANTS)}, got {self.variant!r}")
        if self.parallel not in PARALLEL_MODES:
            raise TrainConfigError(f"parallel must be one of {PARALLEL_MODES}, got {self.parallel!r}")
        if self.device != "auto":
            try:
                torch.device(self.device)
            except (RuntimeError, TypeError):
                raise TrainConfigError(f"device {self.device!r} is not a torch device (auto, cpu, cuda, cuda:N)") \
                    from None


def _check_int(name: str, value, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise TrainConfigError(f"{name} must be an integer >= {low}, got {value!r}")


# -- pieces --------------------------------------------------------------------------------
def lr_at(step: int, cfg: TrainConfig, total: int) -> float:
    """The learning rate of 0-based step ``step``: linear warmup, then cosine to 0 at ``total``."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, total - cfg.warmup_steps)
    return cfg.lr * 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))


def load_target_embeddings(model_path: str | Path) -> torch.Tensor:
    """The target's input embedding [V, H] (float32), read alone from its safetensors (single or sharded)."""
    from eagle3_pipeline.models.weights import read_tensor, weight_map  # noqa: PLC0415

    try:
        weights = weight_map(model_path)
    except FileNotFoundError as exc:
        raise TrainConfigError(f"target_model_path: {exc}") from None
    names = [n for n in weights if n.endswith("embed_tokens.weight")]
    if len(names) > 1:  # multimodal checkpoints: prefer the language model's
        names = [n for n in names if "language_model" in n or n == "model.embed_tokens.weight"] or names
    if len(names) != 1:
        raise TrainConfigError(f"target_model_path {model_path}: expected one embed_tokens weight, "
                               f"found {names or 'none'}")
    return read_tensor(model_path, weights, names[0]).float()


def load_target_final_norm(model_path: str | Path, target_config: dict) -> torch.Tensor | None:
    """The target's final RMSNorm weight [H] (float32), or None where it cannot serve the drafter's ``norm``: no
    single such tensor (the reason is printed), or a Gemma-style norm that scales by 1 + weight."""
    from eagle3_pipeline.models.weights import read_tensor, weight_map  # noqa: PLC0415

    if "gemma" in str(target_config.get("model_type", "")).lower():
        print("eagle3 train: the target's final norm scales by 1 + weight (Gemma); the drafter's norm starts at 1",
              flush=True)
        return None
    weights = weight_map(model_path)
    names = [n for n in weights if (n == "norm.weight" or n.endswith(".norm.weight")) and "layers." not in n
             and not any(part in n for part in ("vision", "visual", "mm_projector", "mtp"))]
    if len(names) > 1:  # multimodal checkpoints: the language model's
        names = [n for n in names if "language_model" in n] or names
    if len(names) != 1:
        print(f"eagle3 train: no single final norm among the target's tensors ({names or 'none'}); the drafter's "
              "norm starts at 1", flush=True)
        return None
    return read_tensor(model_path, weights, names[0]).float()


def _flatten_optimizer(state: dict) -> tuple[dict[str, torch.Tensor], dict]:
    """An optimizer state dict keyed by parameter name (``get_optimizer_state_dict``'s form) as
    tensors ``state.<param name>.<key>`` and JSON for the rest."""
    tensors, scalars = {}, {}
    for name, entry in state["state"].items():
        for key, value in entry.items():
            if torch.is_tensor(value):
                tensors[f"state.{name}.{key}"] = value.detach().cpu().contiguous()
            else:
                scalars.setdefault(str(name), {})[key] = value
    return tensors, {"param_groups": state["param_groups"], "scalars": scalars}


def _unflatten_optimizer(tensors: dict[str, torch.Tensor], meta: dict) -> dict:
    state: dict[str, dict] = {}
    for flat, value in tensors.items():
        name, key = flat.removeprefix("state.").rsplit(".", 1)
        state.setdefault(name, {})[key] = value
    for name, entry in meta["scalars"].items():
        state.setdefault(name, {}).update(entry)
    groups = [{**g, "betas": tuple(g["betas"])} if "betas" in g else g for g in meta["param_groups"]]
    return {"state": state, "param_groups": groups}


def full_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """(model, optimizer) state dicts, whole and on the CPU, of a plain, DDP or FSDP model.

    A collective under FSDP: every process calls it; the tensors land on rank 0 (empty elsewhere).
    """
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_model_state_dict(model, options=options), get_optimizer_state_dict(model, optimizer, options=options)


def checkpoint_dirs(out_dir: Path) -> list[Path]:
    """``step-N`` dirs under ``<out>/checkpoints``, newest (largest N) first."""
    root = out_dir / CHECKPOINTS_DIR
    found = []
    for path in root.glob("step-*") if root.is_dir() else []:
        suffix = path.name.removeprefix("step-")
        if path.is_dir() and suffix.isdigit():
            found.append((int(suffix), path))
    return [path for _, path in sorted(found, reverse=True)]


def save_checkpoint(out_dir: Path, step: int, model_state: dict, optimizer_state: dict, state: dict) -> Path:
    """Write ``checkpoints/step-<step>`` atomically (temp dir + rename); keep the newest two."""
    root = out_dir / CHECKPOINTS_DIR
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".tmp-step-{step}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    frozen = state.get("frozen", ["embed_tokens.weight"])  # the target's own tensors: not saved
    save_file({k: v.detach().cpu().contiguous() for k, v in model_state.items() if k not in frozen},
              str(tmp / MODEL_FILE))
    opt_tensors, opt_meta = _flatten_optimizer(optimizer_state)
    save_file(opt_tensors, str(tmp / OPTIMIZER_FILE))
    rng = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        rng["cuda"] = torch.cuda.get_rng_state()
    save_file(rng, str(tmp / RNG_FILE))
    files = {name: file_sha256(tmp / name) for name in (MODEL_FILE, OPTIMIZER_FILE, RNG_FILE)}
    document = {**state, "step": step, "optimizer": opt_meta, "files": files}
    (tmp / STATE_FILE).write_text(json.dumps(document, indent=1) + "\n")
    for name in (*files, STATE_FILE):
        with open(tmp / name, "rb") as handle:
            os.fsync(handle.fileno())
    final = root / f"step-{step}"
    if final.exists():
        shutil.rmtree(final)
    os.rename(tmp, final)
    for old in checkpoint_dirs(out_dir)[KEEP_CHECKPOINTS:]:
        shutil.rmtree(old, ignore_errors=True)
    for stale in root.glob(".tmp-step-*"):
        shutil.rmtree(stale, ignore_errors=True)
    return final


def load_checkpoint(path: Path) -> tuple[dict, dict[str, torch.Tensor], dict, dict[str, torch.Tensor]]:
    """(state.json, model tensors, optimizer state dict, rng tensors); raises ValueError on any damage."""
    try:
        document = json.loads((path / STATE_FILE).read_text())
        for name, digest in document["files"].items():
            if file_sha256(path / name) != digest:
                raise ValueError(f"{path / name}: SHA-256 differs from {STATE_FILE}'s")
        model_state = load_file(str(path / MODEL_FILE))
        optimizer_state = _unflatten_optimizer(load_file(str(path / OPTIMIZER_FILE)), document["optimizer"])
        rng = load_file(str(path / RNG_FILE))
    except (OSError, KeyError, TypeError, SafetensorError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: unusable checkpoint ({exc})") from None
    return document, model_state, optimizer_state, rng


def newest_checkpoint(out_dir: Path) -> tuple[Path, tuple] | None:
    """The newest complete checkpoint and its contents, skipping partial or damaged ones."""
    for path in checkpoint_dirs(out_dir):
        try:
            return path, load_checkpoint(path)
        except ValueError as exc:
            print(f"eagle3 train: skipping {exc}", flush=True)
    return None


# -- metrics -------------------------------------------------------------------------------
def _metric_fields(loss_parts: torch.Tensor, metrics: TTTMetrics) -> dict:
    return {"loss_k": [float(x) for x in loss_parts], "acc_k": metrics.acc, "cond_acc_k": metrics.cond_acc,
            "acceptance_length": metrics.acceptance_length}


def _cut_metrics(path: Path, step: int) -> None:
    """Keep the lines of steps <= ``step`` (a killed run may have logged past its last checkpoint)."""
    kept = []
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict) and int(record.get("step", step + 1)) <= step:
                kept.append(line)
    atomic_write_text(path, "".join(f"{line}\n" for line in kept))


METRIC_COUNTS = ("hits", "rows", "chain_hits", "chain_rows")


def _counts_on_cpu(metrics: TTTMetrics) -> TTTMetrics:
    return TTTMetrics(*(getattr(metrics, name).cpu() for name in METRIC_COUNTS))


def _sum_metrics(total: TTTMetrics | None, new: TTTMetrics) -> TTTMetrics:
    return new if total is None else total.plus(new)


# -- the loop ------------------------------------------------------------------------------
@dataclass
class _Run:
    cfg: TrainConfig
    data: TrainData
    runner: StepRunner
    rank: int
    world: int

    @torch.no_grad()
    def evaluate(self, held) -> dict | None:
        """Held-out loss and metrics: every held-out sample once, the packed batches dealt round-robin
        to the processes (a process short of a batch re-runs one and discards it: FSDP's forward is
        a collective, so every process runs as many)."""
        if not held:
            return None
        model = self.runner.model
        packed = pack(held, self.cfg.batch_tokens, self.cfg.seed, 0)
        mine = packed[self.rank::self.world]
        rounds = -(-len(packed) // self.world)
        model.eval()
        sums = torch.zeros(self.cfg.ttt_length, dtype=torch.float64)
        counts = torch.zeros(self.cfg.ttt_length, dtype=torch.float64)
        metrics = opening = None
        opening_tokens = self.cfg.eval_opening_tokens
        # The held-out first answers walked round by round, as serving drafts them, for every chain length.
        walks = {chain: AcceptanceStats(chain) for chain in range(1, self.cfg.ttt_length + 1)}
        for index in range(rounds):
            spare = index >= len(mine)
            batch = load_batch(self.data, (mine or packed)[0 if spare else index], max_tokens=self.cfg.batch_tokens,
                               dequantize=False)  # float8 states: dequantized on the device (runner.forward)
            loss, batch_metrics = self.runner.forward(batch, training=False)
            if opening_tokens:
                # The same forward scored over the first answers' served tokens only: the drafter's inputs
                # do not depend on the loss mask, only which rows are counted does.
                served = opening_mask(batch.loss_mask, batch.doc_ids, opening_tokens)
                _, opening_metrics = self.runner.forward(replace(batch, loss_mask=served), training=False)
            if spare:
                continue
            if opening_tokens:
                for leads, length in opening_answers(served, batch.doc_ids, opening_metrics.leads[0]):
                    for chain, stats in walks.items():
                        stats.add_walk(answer_rounds(leads, length, chain, opening_tokens))
            sums += loss.step_losses.double().cpu()  # summed CE per step (denominator 1)
            counts += loss.step_counts.double().cpu()
            metrics = _sum_metrics(metrics, _counts_on_cpu(batch_metrics))
            if opening_tokens:
                opening = _sum_metrics(opening, _counts_on_cpu(opening_metrics))
        model.train()
        device = self.runner.device
        sums, counts = all_reduce(sums.to(device)).cpu(), all_reduce(counts.to(device)).cpu()
        metrics = self._all_reduced(metrics)
        parts = sums / counts.clamp(min=1)
        weighted = sum(self.runner.step_decay**k * float(p) for k, p in enumerate(parts))
        result = {"loss": weighted, **_metric_fields(parts, metrics), "samples": len(held)}
        if opening_tokens:
            opening = self._all_reduced(opening)
            result["opening"] = {"tokens": opening_tokens, "acc_k": opening.acc, "cond_acc_k": opening.cond_acc,
                                 "acceptance_length": opening.acceptance_length, "rows": int(opening.rows[0]),
                                 "rounds": self._walked(walks)}
        return result

    def _walked(self, walks: dict[int, AcceptanceStats]) -> dict[str, dict]:
        """Each chain's rounds summed over the processes: {chain: ``AcceptanceStats.as_dict``}."""
        flat = [stats.counts() for stats in walks.values()]
        counts = all_reduce(torch.tensor([c for row in flat for c in row], dtype=torch.int64).to(self.runner.device))
        counts, result = counts.cpu().tolist(), {}
        for chain, row in zip(walks, flat):
            result[str(chain)] = AcceptanceStats.from_counts(chain, counts[:len(row)]).as_dict()
            counts = counts[len(row):]
        return result

    def _all_reduced(self, metrics: TTTMetrics | None) -> TTTMetrics:
        """The counts summed over the processes (zeros where this one had none)."""
        if metrics is None:
            metrics = TTTMetrics(*(torch.zeros(self.cfg.ttt_length, dtype=torch.int64) for _ in range(4)))
        device = self.runner.device
        return TTTMetrics(*(all_reduce(getattr(metrics, name).to(device)).cpu() for name in METRIC_COUNTS))


class StopRequested(Exception):
    """SIGTERM/SIGINT arrived: the run checkpointed where it stood; a rerun continues."""


def resolve_device(name: str) -> torch.device:
    """``auto``: this process's GPU (LOCAL_RANK under torchrun) when there is one, else the CPU."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if name == "auto":
        return torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise TrainConfigError(f"device {name}: no GPU is visible to torch (check nvidia-smi and "
                                   "CUDA_VISIBLE_DEVICES), or use device auto / cpu")
        if device.index is None:
            device = torch.device("cuda", local_rank)
    return device


@dataclass
class Plan:
    """Everything ``train`` needs that can be checked without training (``train --check`` shows it)."""

    cfg: TrainConfig
    device: torch.device
    dtype: str
    rank: int
    world: int
    data: TrainData
    train_samples: list
    held: list
    target_path: Path
    target_config: dict
    drafter_config: DrafterConfig
    vocab: object
    total: int
    limit: int
    fixed: dict
    fingerprint: str
    accumulate: int = 1  # batches per process per optimizer step

    @property
    def out_dir(self) -> Path:
        return Path(self.cfg.output_dir)

    @property
    def drafter_dir(self) -> Path:
        """The SGLang export: ``drafter_dir``, else ``<output_dir>/drafter``; the speculators form beside it."""
        return Path(self.cfg.drafter_dir) if self.cfg.drafter_dir else self.out_dir / DRAFTER_DIR

    def check_resumable(self, path: Path, document: dict) -> None:
        """Refuse a checkpoint written with settings that change the data order, the model or the loss's weighing."""
        saved = document.get("fixed", {})
        changed = [f"{k} {saved.get(k, FIXED_BEFORE.get(k))!r} -> {v!r}" for k, v in self.fixed.items()
                   if saved.get(k, FIXED_BEFORE.get(k)) != v]
        if changed:
            raise TrainConfigError(f"{path} was written with other settings ({'; '.join(changed)}); use another "
                                   "output_dir, the same settings, or resume: false to start over")

    def status(self) -> dict:
        """Whether a drafter of these data and settings is exported already, and where a run would start."""
        complete, reason = False, "no finished run in the output directory"
        record = _read_json(self.out_dir / TRAINING_FILE)
        if record is not None:
            if record.get("fingerprint") != self.fingerprint:
                reason = "the output directory's finished run used other data or settings"
            elif not (self.drafter_dir / "model.safetensors").is_file():
                reason = f"{self.drafter_dir} is missing"
            else:
                complete, reason = True, "a drafter for these data and settings is already exported"
        newest = next(iter(checkpoint_dirs(self.out_dir)), None) if self.cfg.resume else None
        if newest is not None and not complete:
            document = _read_json(newest / STATE_FILE)
            if document is not None:
                self.check_resumable(newest, document)
        return {"complete": complete, "reason": reason, "output_dir": str(self.out_dir),
                "drafter_dir": str(self.drafter_dir), "total_steps": self.total, "limit_steps": self.limit,
                "resume_step": int(newest.name.removeprefix("step-")) if newest else None,
                "world": self.world, "device": str(self.device), "dtype": self.dtype,
                "draft_vocab_size": self.drafter_config.draft_vocab_size, "vocab_size": self.drafter_config.vocab_size,
                "train_samples": len(self.train_samples), "eval_samples": len(self.held),
                "train_tokens": sum(sample.tokens for sample in self.train_samples)}


def _read_json(path: Path) -> dict | None:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def _file_digest(path: Path) -> str:
    return file_sha256(path) if path.is_file() else ""


def auto_batch_tokens(hidden_size: int) -> int:
    """Tokens per batch and process for a drafter of ``hidden_size`` when none is set.

    A step's fixed cost (kernel launches, the optimizer) dominates small drafters: on an H200 a
    576-wide drafter (SmolLM2-135M's) trained 42,398 tokens/s at 2,048 tokens a step, 115,386 at 8,192
    and 209,119 at 32,768 (192,719 at 65,536), while a 4096-wide one (Llama-3.1-8B's) is already
    compute-bound at 2,048 (docs/benchmarks.md). So the batch grows with the square of how much
    narrower than 4096 the drafter is: 2,048 at 4096 and wider, 8,192 at 2048, 32,768 at 1024 and below.
    """
    return max(2048, min(32768, 2048 * (4096 // max(1, int(hidden_size))) ** 2))


def make_plan(cfg: TrainConfig, world: int | None = None) -> Plan:
    """Open and check the data, the target and the settings; raise a clear error on the first problem.

    ``world``: the number of processes the run will have (``train --check`` before torchrun
    starts them); default: this process group's size.
    """
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed() else (0, world or 1)
    device = resolve_device(cfg.device)
    dtype = cfg.dtype if cfg.dtype != "auto" else ("bfloat16" if device.type == "cuda" else "float32")
    data = open_dataset(cfg.data_dir)
    train_samples, held = data.split(cfg.eval_ratio)
    if cfg.max_train_samples is not None:
        if cfg.max_train_samples >= len(train_samples) and rank == 0:
            print(f"eagle3 train: max_train_samples {cfg.max_train_samples}: the training split of {data.root} has "
                  f"{len(train_samples)} samples; training on all of them", flush=True)
        train_samples = train_samples[:cfg.max_train_samples]
    target_path = Path(cfg.target_model_path or data.manifest.get("target_model_path") or "")
    if not str(target_path) or str(target_path) == ".":
        raise TrainConfigError("target_model_path is not set and the manifest names none")
    if not (target_path / "config.json").is_file():
        raise TrainConfigError(f"target_model_path {target_path}: no config.json (is it a Hugging Face model "
                               "directory?); set eagle_training_target_model_path / --target-model-path")
    target_config = read_text_config(target_path)
    vocab_size = int(target_config["vocab_size"])
    if int(target_config["hidden_size"]) != data.hidden_size or vocab_size != int(data.manifest.get("vocab_size",
                                                                                                     vocab_size)):
        raise DataError(f"{cfg.data_dir}: extracted from another model than target_model_path {target_path} "
                        f"(hidden {data.hidden_size} vs {target_config['hidden_size']}, vocab "
                        f"{data.manifest.get('vocab_size')} vs {vocab_size})")
    draft_size = resolve_draft_vocab_size(vocab_size, cfg.draft_vocab_size)
    counts = load_token_counts(cfg.data_dir)
    if cfg.max_train_samples is not None:  # the vocabulary of the samples trained on, not of the whole extraction
        counts = count_tokens(data.root, (sample.file for sample in train_samples), counts.numel())
    if counts.numel() != vocab_size:
        raise VocabError(f"token counts cover {counts.numel()} ids, the target's vocabulary has {vocab_size}")
    vocab = build_draft_vocab(counts, draft_size)
    overrides = {name: getattr(cfg, name) for name in SHAPE_OVERRIDES if getattr(cfg, name) is not None}
    drafter_config = DrafterConfig.from_target(target_config, data.n_aux, draft_size, variant=cfg.variant,
                                               norm_before_fc=cfg.norm_before_fc, layout=cfg.layout, **overrides)
    if cfg.batch_tokens is None:
        cfg.batch_tokens = auto_batch_tokens(drafter_config.hidden_size)
    accumulate = 1
    if cfg.global_batch_tokens is not None:
        per_step = cfg.batch_tokens * world
        if cfg.global_batch_tokens % per_step:
            raise TrainConfigError(f"global_batch_tokens {cfg.global_batch_tokens} is not a multiple of batch_tokens "
                                   f"{cfg.batch_tokens} x {world} process(es) = {per_step}: each process accumulates "
                                   "a whole number of its batches per step; change either, or the number of GPUs")
        accumulate = cfg.global_batch_tokens // per_step
    per_epoch = [len(shard(pack(train_samples, cfg.batch_tokens, cfg.seed, e), rank, world, accumulate)) // accumulate
                 for e in range(cfg.epochs)]
    total = sum(per_epoch)
    if total == 0:
        raise DataError(f"{len(train_samples)} training samples of {data.root} make no batch of "
                        f"{cfg.batch_tokens} tokens for each of {world} processes; lower batch_tokens or the "
                        "number of processes, or extract more data")
    limit = min(total, cfg.max_steps) if cfg.max_steps is not None else total
    # Settings a resumed run must share with the checkpoint, or its data order / model / loss's weighing differ (the
    # step decay is among them since its default changed: a run begun at 0.8 is not finished at 0.5 without a word).
    fixed = {"seed": cfg.seed, "batch_tokens": cfg.batch_tokens, "eval_ratio": cfg.eval_ratio,
             "ttt_length": cfg.ttt_length, "draft_vocab_size": draft_size, "world": world, "variant": cfg.variant,
             "norm_before_fc": cfg.norm_before_fc, "layout": drafter_config.layout, "head_init": cfg.head_init,
             "accumulate": accumulate, "max_train_samples": cfg.max_train_samples, "step_decay": cfg.step_decay}
    settings = {name: getattr(cfg, name) for name in FINGERPRINT_FIELDS}
    for name, default in (("head_init", DEFAULT_HEAD_INIT), ("teacher_temperature", DEFAULT_TEACHER_TEMPERATURE),
                          ("step_decay", EAGLE3_STEP_DECAY),
                          ("global_batch_tokens", None), ("max_train_samples", None)):
        if settings[name] == default:  # EAGLE-3's recipe keeps the fingerprint it had before these options existed
            del settings[name]
    settings.update(target_model_path=str(target_path.resolve()), draft_vocab_size=draft_size, dtype=dtype,
                    world=world, data=_file_digest(Path(cfg.data_dir) / "data_config.json"))
    fingerprint = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()
    return Plan(cfg, device, dtype, rank, world, data, train_samples, held, target_path, target_config,
                drafter_config, vocab, total, limit, fixed, fingerprint, accumulate)


class _Progress:
    """``<out>/progress.json`` (rank 0), rewritten atomically at most once a second and at the end."""

    def __init__(self, path: Path | None, total: int, limit: int, start_step: int):
        self.path, self.total, self.limit, self.start_step = path, total, limit, start_step
        self.started = time.monotonic()
        self.written = 0.0
        self.fields: dict = {"step": start_step, "total_steps": total, "limit_steps": limit, "epoch": 1, "epochs": 1,
                             "loss": None, "acc_k": [], "acceptance_length": None, "tokens_per_s": None,
                             "eval": None}

    def update(self, state: str = "running", message: str = "", force: bool = False, **fields) -> None:
        self.fields.update(fields)
        if self.path is None or (not force and time.monotonic() - self.written < 1.0):
            return
        self.written = time.monotonic()
        elapsed = time.monotonic() - self.started
        done = self.fields["step"] - self.start_step
        eta = elapsed / done * (self.limit - self.fields["step"]) if done > 0 and state == "running" else None
        document = {"state": state, **self.fields, "elapsed_s": round(elapsed, 3),
                    "eta_s": None if eta is None else round(eta, 1), "message": message, "pid": os.getpid(),
                    "updated": time.time()}
        atomic_write_text(self.path, json.dumps(document) + "\n")


class _MetricsLog:
    """metrics.jsonl (always) and TensorBoard (when installed and wanted), rank 0 only."""

    def __init__(self, out_dir: Path, resume_step: int, enabled: bool, tensorboard: bool):
        self.handle = open(out_dir / METRICS_FILE, "a") if enabled else None  # noqa: SIM115
        self.board = None
        if enabled and tensorboard:
            try:
                from eagle3_pipeline.train.tensorboard import TensorBoardLog  # noqa: PLC0415

                available = TensorBoardLog.available()
            except ImportError:
                available = False
            if available:
                self.board = TensorBoardLog(out_dir / TENSORBOARD_DIR, purge_step=resume_step + 1)
            else:
                print("eagle3 train: tensorboard is not installed; metrics go to metrics.jsonl only "
                      "(pip install tensorboard for the event files)", flush=True)

    def write(self, record: dict) -> None:
        if self.handle is None:
            return
        self.handle.write(json.dumps(record) + "\n")
        self.handle.flush()
        if self.board is not None:
            self.board.write(record)

    def flush(self) -> None:
        if self.board is not None:
            self.board.flush()

    def close(self) -> None:
        if self.handle is not None:
            self.handle.close()
        if self.board is not None:
            self.board.close()


def write_charts(out_dir: Path) -> list[str]:
    """The PNG charts of ``metrics.jsonl`` in ``<out>/charts``; [] with a note when matplotlib is missing."""
    try:
        from eagle3_pipeline.train.charts import write_charts as draw  # noqa: PLC0415

        return [str(path) for path in draw(out_dir / METRICS_FILE, out_dir / CHARTS_DIR)]
    except ImportError as exc:
        print(f"eagle3 train: no charts ({exc}); pip install matplotlib, then eagle3-pipeline train-charts",
              flush=True)
    except ValueError as exc:
        print(f"eagle3 train: no charts: {exc}", flush=True)
    return []


def discard_run(out_dir: Path) -> None:
    """What ``resume: false`` starts over from: checkpoints, metrics, events, charts, progress, the record."""
    for name in (CHECKPOINTS_DIR, TENSORBOARD_DIR, CHARTS_DIR):
        shutil.rmtree(out_dir / name, ignore_errors=True)
    for name in (METRICS_FILE, PROGRESS_FILE, TRAINING_FILE):
        (out_dir / name).unlink(missing_ok=True)


def _install_stop_handlers() -> dict:
    """SIGTERM/SIGINT set a flag that the loop reads between steps (main thread only)."""
    flag = {"stop": False}
    if threading.current_thread() is not threading.main_thread():
        return flag

    def request(signum, _frame):
        flag["stop"] = True
        print(f"eagle3 train: {signal.Signals(signum).name}: stopping after this step, with a checkpoint",
              flush=True)

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, request)
    return flag


def train(cfg: TrainConfig) -> dict:
    """Train (or resume) to ``max_steps`` / the end of ``epochs``, checkpoint, export; a summary dict.

    Under torchrun, call it in every process after ``init_process_group``; rank 0 writes the files.
    Raises StopRequested after checkpointing when SIGTERM/SIGINT arrived.
    """
    plan = make_plan(cfg)
    out_dir, rank, world, device = plan.out_dir, plan.rank, plan.world, plan.device
    status = plan.status()
    if status["complete"]:
        record = _read_json(out_dir / TRAINING_FILE) or {}
        return {**record, "already_complete": True}
    if rank == 0:
        out_dir.mkdir(parents=True, exist_ok=True)
        if not cfg.resume:
            discard_run(out_dir)
        (out_dir / TRAINING_FILE).unlink(missing_ok=True)
    if distributed():
        dist.barrier()
    stop = _install_stop_handlers()
    stop_file = os.environ.get(STOP_FILE_ENV)  # set by the torchrun launcher (train/command.py)

    torch.manual_seed(cfg.seed)
    vocab, drafter_config = plan.vocab, plan.drafter_config
    model = Eagle3Drafter(drafter_config, vocab.d2t, vocab.t2d)
    own_embeddings = drafter_config.hidden_size != drafter_config.target_hidden_size
    if own_embeddings:  # the target's [V, H_target] cannot serve: the drafter learns its own, and exports them
        model.embed_tokens.weight.requires_grad_(True)
        if rank == 0:
            print(f"eagle3 train: drafter hidden size {drafter_config.hidden_size} != the target's "
                  f"{drafter_config.target_hidden_size}: embed_tokens is trained and exported", flush=True)
    else:
        model.load_target_embeddings(load_target_embeddings(plan.target_path))
    frozen = [] if own_embeddings else ["embed_tokens.weight"]
    # The teacher's lm_head (the target's), read once: it also starts the drafter's head (head_init: target).
    lm_head = load_lm_head(plan.target_path, "cpu" if device.type == "cpu" else str(device))
    if cfg.head_init == "target":
        if own_embeddings:
            if rank == 0:
                print("eagle3 train: head_init target needs the drafter as wide as the target; its lm_head and norm "
                      "start at random", flush=True)
        else:
            model.load_target_head(lm_head, load_target_final_norm(plan.target_path, plan.target_config))
    step, data_state, resumed_from, optimizer_state = 0, DataState(), None, None
    found = newest_checkpoint(out_dir) if cfg.resume else None
    if found is not None:
        path, (document, model_state, optimizer_state, rng) = found
        plan.check_resumable(path, document)
        if not torch.equal(model_state["d2t"], vocab.d2t):
            raise VocabError(f"{path}: its draft vocabulary differs from the one the data's token counts give now; "
                             "use another output_dir or resume: false")
        missing, unexpected = model.load_state_dict(model_state, strict=False)
        if set(missing) != set(frozen) or unexpected:
            raise TrainConfigError(f"{path}: model tensors do not match this drafter's (missing {missing}, "
                                   f"unexpected {unexpected}); the shape settings changed?")
        torch.set_rng_state(rng["torch"])
        step, data_state, resumed_from = int(document["step"]), DataState.from_dict(document["data"]), path
        if rank == 0:
            print(f"eagle3 train: resuming from {path} (step {step} of {plan.limit})", flush=True)
    if distributed():  # every process must resume from the same checkpoint: a shared output_dir
        seen = torch.tensor([step, -step], dtype=torch.int64, device=device)
        dist.all_reduce(seen, op=dist.ReduceOp.MAX)
        if int(seen[0]) != -int(seen[1]):
            raise TrainConfigError(f"the processes found different checkpoints in {out_dir} (steps {-int(seen[1])} "
                                   f"to {int(seen[0])}): output_dir must be one directory shared by every node")
    model.to(device)
    runner = StepRunner(model, lm_head, ttt_length=cfg.ttt_length, device=device, dtype=plan.dtype,
                        parallel=cfg.parallel, teacher_temperature=cfg.teacher_temperature,
                        step_decay=cfg.step_decay)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    if optimizer_state is not None:
        set_optimizer_state_dict(runner.module, optimizer, optimizer_state,
                                 options=StateDictOptions(full_state_dict=True))
        if "cuda" in rng and device.type == "cuda":
            torch.cuda.set_rng_state(rng["cuda"], device)
    run = _Run(cfg, plan.data, runner, rank, world)

    metrics_path = out_dir / METRICS_FILE
    if rank == 0:
        _cut_metrics(metrics_path, step)
    progress = _Progress(out_dir / PROGRESS_FILE if rank == 0 else None, plan.total, plan.limit, step)
    log = _MetricsLog(out_dir, step, rank == 0, cfg.tensorboard)
    evaluation = None

    def checkpoint(at_step: int, state: DataState) -> None:
        nonlocal evaluation
        evaluation = run.evaluate(plan.held)
        model_state, opt_state = full_state(runner.module, optimizer)
        if rank == 0:
            save_checkpoint(out_dir, at_step, model_state, opt_state,
                            {"fixed": plan.fixed, "frozen": frozen, "data": state.to_dict(),
                             "schedule": {"total": plan.total, "step": at_step}, "config": asdict(cfg)})
            if evaluation is not None:
                log.write({"kind": "eval", "step": at_step, **evaluation})
                progress.update(eval=evaluation)
            log.flush()
            if cfg.charts:
                write_charts(out_dir)

    last = None
    model.train()
    try:
        progress.update(message=f"resumed from step {step}" if resumed_from else "started", force=True)
        if step < plan.limit:
            # Float8 states stay float8 until the device: half the bytes to read and to copy there. Read ahead in
            # a thread, pinned for the GPU: the host queues each step while the GPU still runs the one before.
            stream = prefetch(batches(plan.data, cfg.batch_tokens, cfg.seed, rank, world, data_state,
                                      samples=plan.train_samples, epochs=cfg.epochs, dequantize=False,
                                      group=plan.accumulate), pin=device.type == "cuda")
            epoch = data_state.epoch
            queued = None  # the last step's figures, still on the device: read once the next step is queued too
            stop_flag = None  # several processes: the last step's stop request, summed over them on the device

            def read_figures(figures: dict, until: float | None = None) -> None:
                """Log a step's figures. Reading them waits for that step's kernels, not for the one queued after it.
                Its tokens/s counts from its own start to ``until``, the next step's start, or when not given (the
                last step, a checkpoint's) to the end of its kernels. Not from the read before: the last step,
                read right after the one before it, would count a few microseconds (millions of tokens/s)."""
                nonlocal last
                fields_ = {"loss": float(figures["loss"]), **_metric_fields(figures["parts"], figures["metrics"]),
                           "tokens": int(figures["tokens"])}
                elapsed = max((time.perf_counter() if until is None else until) - figures["began"], 1e-9)
                last = {"kind": "train", "step": figures["step"], "epoch": figures["epoch"], **fields_,
                        "tokens_per_s": fields_["tokens"] / elapsed, "lr": figures["lr"]}
                log.write(last)
                progress.update(step=last["step"], epoch=last["epoch"], epochs=cfg.epochs, loss=last["loss"],
                                acc_k=last["acc_k"], acceptance_length=last["acceptance_length"],
                                tokens_per_s=last["tokens_per_s"])

            try:
                for after, group in _steps(stream, plan.accumulate):
                    began = time.perf_counter()
                    lr = lr_at(step, cfg, plan.total)
                    loss, metrics = runner.train_step(group[0] if len(group) == 1 else group, optimizer, lr,
                                                      cfg.grad_clip)
                    step += 1
                    for name in METRIC_COUNTS:
                        all_reduce(getattr(metrics, name))
                    tokens = sum(batch.num_tokens for batch in group)
                    figures = {"step": step, "epoch": epoch + 1, "lr": lr, "metrics": metrics, "began": began,
                               "loss": all_reduce(loss.loss.detach().clone()) / world,
                               "parts": all_reduce(loss.step_losses.clone()) / world,
                               "tokens": all_reduce(torch.full((), tokens, device=device)) if world > 1 else tokens}
                    if queued is not None:
                        read_figures(queued, until=began)
                    queued = figures
                    epoch, data_state = after.epoch, after
                    asked = stop["stop"] or bool(stop_file and os.path.exists(stop_file))
                    if world > 1:  # every process stops at the same step: the request summed, read a step later
                        stopping = stop_flag is not None and int(stop_flag) > 0
                        stop_flag = all_reduce(torch.full((), int(asked), device=device))
                    else:
                        stopping = asked
                    if step >= plan.limit:
                        break
                    if stopping or (cfg.checkpoint_every and step % cfg.checkpoint_every == 0):
                        read_figures(queued)
                        queued = None
                    if stopping:
                        checkpoint(step, data_state)
                        progress.update("stopped", f"stopped on request at step {step}; rerun to continue",
                                        force=True)
                        raise StopRequested(f"stopped on request at step {step} of {plan.limit}; checkpoint saved, "
                                            "rerun to continue")
                    if cfg.checkpoint_every and step % cfg.checkpoint_every == 0:
                        checkpoint(step, data_state)
                if queued is not None:
                    read_figures(queued)
            finally:
                stream.close()
            checkpoint(step, data_state)

        final_state, _ = full_state(runner.module, optimizer)
        summary = {"steps": step, "total_steps": plan.total, "limit_steps": plan.limit,
                   "resumed_from": str(resumed_from) if resumed_from else None, "last": last, "eval": evaluation,
                   "drafter_dir": str(plan.drafter_dir), "draft_vocab_size": drafter_config.draft_vocab_size,
                   "draft_vocab_coverage": vocab.coverage, "world": world, "device": str(device),
                   "dtype": plan.dtype, "fingerprint": plan.fingerprint,
                   "train_samples": len(plan.train_samples), "eval_samples": len(plan.held),
                   "train_tokens": sum(sample.tokens for sample in plan.train_samples),
                   "config": {f.name: getattr(cfg, f.name) for f in fields(cfg)}}
        if rank == 0:
            summary.update(_export(plan, final_state))
            if cfg.charts:
                summary["charts"] = write_charts(out_dir)
            atomic_write_text(out_dir / TRAINING_FILE, json.dumps(summary, indent=1) + "\n")
            progress.update("done", f"drafter exported to {plan.drafter_dir}", force=True, step=step)
        return summary
    except StopRequested:
        raise
    except Exception as exc:
        progress.update("failed", f"{type(exc).__name__}: {exc}", force=True)
        raise
    finally:
        log.close()


def _steps(stream, accumulate: int):
    """(state after the step's last batch, the step's batches) from ``batches``' stream (``group=accumulate``,
    so every epoch ends on a whole step)."""
    group = []
    for after, batch in stream:
        group.append(batch)
        if len(group) == accumulate:
            yield after, group
            group = []


def _export(plan: Plan, model_state: dict) -> dict:
    """The SGLang export, and the speculators form when the drafter fits it; what was written."""
    state_dict = {k: v.detach().cpu() for k, v in model_state.items()}
    if plan.drafter_config.target_hidden_size == plan.drafter_config.hidden_size:
        state_dict.pop("embed_tokens.weight", None)  # SGLang takes the target's own
    export_cfg = {**asdict(plan.drafter_config), "dtype": plan.dtype}
    model_type = plan.target_config.get("model_type")
    drafter = export.export_sglang(state_dict, export_cfg, plan.data.manifest, plan.drafter_dir,
                                   target_model_type_override=model_type)
    result = {"drafter_dir": str(drafter), "speculators_dir": None, "speculators_note": None}
    speculators_dir = plan.drafter_dir.with_name(plan.drafter_dir.name + "-speculators")
    try:
        result["speculators_dir"] = str(export.export_speculators(
            state_dict, export_cfg, plan.data.manifest, speculators_dir, target_model_type_override=model_type))
    except export.ExportError as exc:
        result["speculators_note"] = f"no speculators form: {exc}"
        # An earlier run's speculators form is another drafter's: left there, it would be served as this one.
        if export.remove_export(speculators_dir):
            result["speculators_note"] += f" (the earlier run's {speculators_dir} was removed)"
        print(f"eagle3 train: {result['speculators_note']}", flush=True)
    return result
