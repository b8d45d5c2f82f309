"""The training loop: one process here; written so that DDP can wrap it (``rank``/``world``).

``train(cfg)`` opens the extraction output, builds the draft vocabulary from its token counts,
the drafter from the target's ``config.json`` (embeddings copied from the target and frozen),
and trains it with AdamW, a cosine schedule with linear warmup and gradient clipping against
the teacher (the target's ``lm_head`` over the stored last hidden states). It writes:

    <out>/metrics.jsonl                 one JSON line per step ("kind": "train") and per checkpoint ("kind": "eval")
    <out>/checkpoints/step-N/           model.safetensors, optimizer.safetensors, rng.safetensors, state.json
    <out>/drafter/                      the SGLang export (``export.export_sglang``)

Checkpoints hold no pickle: tensors go into safetensors (the optimizer state flattened to
``state.<param index>.<key>``), everything else (param groups, schedule, data position, the
SHA-256 of every file) into ``state.json``, written last. A checkpoint is built in a temp dir
and renamed into place; on resume the newest one whose files all match their recorded
SHA-256 is used (a partial or damaged one is skipped), and ``metrics.jsonl`` is cut back to
its step, so a run killed at any point and restarted gives the same per-step losses as an
uninterrupted one (on the CPU with a fixed seed; the last two checkpoints are kept).

The schedule's length is ``epochs`` x batches per epoch, NOT ``max_steps``: ``max_steps`` only
stops the run, so stopping at N and continuing with a larger limit follows the same curve.

DDP (later): the loss of each TTT step is divided by ``denominators`` = the global count of
masked rows (all-reduced) / world, so that DDP's gradient average equals the global mean;
metric counts are all-reduced; only rank 0 writes files.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from eagle3_pipeline.atomic import atomic_write_text
from eagle3_pipeline.extract.store import file_sha256
from eagle3_pipeline.extract.verify import load_lm_head
from eagle3_pipeline.train import export
from eagle3_pipeline.train.data import DataError, DataState, TrainData, batches, open_dataset, pack, shard
from eagle3_pipeline.train.model import (
    DrafterConfig,
    Eagle3Drafter,
    TTTMetrics,
    teacher_targets,
    ttt_loss,
    ttt_metrics,
)
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
# Settings a resumed run must share with the checkpoint, or its data order / model differ.
RESUME_FIXED = ("seed", "batch_tokens", "eval_ratio", "ttt_length", "draft_vocab_size", "world")


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
    batch_tokens: int = 2048
    eval_ratio: float = 0.0
    seed: int = 0
    checkpoint_every: int = 0  # 0: only at the end
    device: str = "cpu"
    dtype: str = "float32"  # bfloat16: autocast with fp32 master weights

    def __post_init__(self) -> None:
        for name in ("data_dir", "output_dir"):
            if not getattr(self, name):
                raise TrainConfigError(f"{name} must be a directory path, got {getattr(self, name)!r}")
        positive = ["ttt_length", "epochs", "batch_tokens"] + [n for n in ("max_steps", "draft_vocab_size")
                                                               if getattr(self, n) is not None]
        for name in positive:
            _check_int(name, getattr(self, name), 1)
        for name in ("warmup_steps", "seed", "checkpoint_every"):
            _check_int(name, getattr(self, name), 0)
        for name, low in (("lr", None), ("weight_decay", 0.0), ("grad_clip", 0.0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) \
                    or (value <= 0 if low is None else value < low):
                raise TrainConfigError(f"{name} must be a {'positive' if low is None else 'non-negative'} number, "
                                       f"got {value!r}")
        if isinstance(self.eval_ratio, bool) or not isinstance(self.eval_ratio, int | float) \
                or not 0.0 <= self.eval_ratio < 1.0:
            raise TrainConfigError(f"eval_ratio must be in [0, 1), got {self.eval_ratio!r}")
        if self.dtype not in DTYPES:
            raise TrainConfigError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        try:
            torch.device(self.device)
        except (RuntimeError, TypeError):
            raise TrainConfigError(f"device {self.device!r} is not a torch device") from None


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


def _all_reduce(tensor: torch.Tensor, world: int) -> torch.Tensor:
    if world > 1 and dist.is_available() and dist.is_initialized():
        dist.all_reduce(tensor)
    return tensor


def _step_counts(teacher, steps: int) -> torch.Tensor:
    """Masked rows per TTT step, as ``ttt_loss`` counts them."""
    length = teacher.probs.shape[1]
    return torch.stack([teacher.position_mask(k)[:, :max(length - 1 - k, 0)].sum() for k in range(steps)])


def _flatten_optimizer(state: dict) -> tuple[dict[str, torch.Tensor], dict]:
    tensors, scalars = {}, {}
    for index, entry in state["state"].items():
        for key, value in entry.items():
            if torch.is_tensor(value):
                tensors[f"state.{index}.{key}"] = value.detach().cpu().contiguous()
            else:
                scalars.setdefault(str(index), {})[key] = value
    return tensors, {"param_groups": state["param_groups"], "scalars": scalars}


def _unflatten_optimizer(tensors: dict[str, torch.Tensor], meta: dict) -> dict:
    state: dict[int, dict] = {}
    for name, value in tensors.items():
        _, index, key = name.split(".", 2)
        state.setdefault(int(index), {})[key] = value
    for index, entry in meta["scalars"].items():
        state.setdefault(int(index), {}).update(entry)
    groups = [{**g, "betas": tuple(g["betas"])} if "betas" in g else g for g in meta["param_groups"]]
    return {"state": state, "param_groups": groups}


def checkpoint_dirs(out_dir: Path) -> list[Path]:
    """``step-N`` dirs under ``<out>/checkpoints``, newest (largest N) first."""
    root = out_dir / CHECKPOINTS_DIR
    found = []
    for path in root.glob("step-*") if root.is_dir() else []:
        suffix = path.name.removeprefix("step-")
        if path.is_dir() and suffix.isdigit():
            found.append((int(suffix), path))
    return [path for _, path in sorted(found, reverse=True)]


def save_checkpoint(out_dir: Path, step: int, model: Eagle3Drafter, optimizer: torch.optim.Optimizer,
                    state: dict) -> Path:
    """Write ``checkpoints/step-<step>`` atomically (temp dir + rename); keep the newest two."""
    root = out_dir / CHECKPOINTS_DIR
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".tmp-step-{step}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    model_state = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()
                   if k != "embed_tokens.weight"}
    save_file(model_state, str(tmp / MODEL_FILE))
    opt_tensors, opt_meta = _flatten_optimizer(optimizer.state_dict())
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


def _sum_metrics(total: TTTMetrics | None, new: TTTMetrics) -> TTTMetrics:
    if total is None:
        return new
    return TTTMetrics(total.hits + new.hits, total.rows + new.rows, total.chain_hits + new.chain_hits,
                      total.chain_rows + new.chain_rows)


# -- the loop ------------------------------------------------------------------------------
@dataclass
class _Run:
    cfg: TrainConfig
    data: TrainData
    model: Eagle3Drafter
    lm_head: torch.Tensor
    device: torch.device
    rank: int
    world: int

    def autocast(self):
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.cfg.dtype == "bfloat16")

    def forward(self, batch, denominators=None):
        """(TTTLoss, TTTMetrics) of one packed batch, on the device."""
        batch = batch.to(self.device)
        d2t, t2d = self.model.d2t, self.model.t2d
        teacher = teacher_targets(batch.last_hidden[None], self.lm_head, t2d, d2t, batch.loss_mask[None],
                                  batch.doc_ids[None])
        counts = _step_counts(teacher, self.cfg.ttt_length)
        if denominators is None:
            global_counts = _all_reduce(counts.clone(), self.world)
            denominators = global_counts if self.world == 1 else global_counts.float() / self.world
        with self.autocast():
            logits = self.model.forward_ttt(batch.input_ids[None], batch.aux_hidden[None], batch.position_ids[None],
                                            self.cfg.ttt_length, batch.doc_ids[None])
        loss = ttt_loss(logits, teacher, denominators=denominators)
        return loss, ttt_metrics(logits, teacher)

    @torch.no_grad()
    def evaluate(self, held) -> dict | None:
        if not held:
            return None
        self.model.eval()
        sums = torch.zeros(self.cfg.ttt_length, dtype=torch.float64)
        counts = torch.zeros(self.cfg.ttt_length, dtype=torch.float64)
        metrics = None
        try:
            stream = list(batches(self.data, self.cfg.batch_tokens, self.cfg.seed, self.rank, self.world,
                                  samples=held, epochs=1))
        except DataError:
            return None
        for _, batch in stream:
            loss, batch_metrics = self.forward(batch, denominators=torch.ones(self.cfg.ttt_length))
            sums += loss.step_losses.double().cpu()  # summed CE per step (denominator 1)
            counts += loss.step_counts.double().cpu()
            metrics = _sum_metrics(metrics, batch_metrics)
        self.model.train()
        if metrics is None:
            return None
        sums, counts = _all_reduce(sums, self.world), _all_reduce(counts, self.world)
        for name in ("hits", "rows", "chain_hits", "chain_rows"):
            _all_reduce(getattr(metrics, name), self.world)
        parts = sums / counts.clamp(min=1)
        weighted = sum(0.8**k * float(p) for k, p in enumerate(parts))
        return {"loss": weighted, **_metric_fields(parts, metrics), "samples": len(held)}


def _target_config(path: Path) -> dict:
    config_file = path / "config.json"
    if not config_file.is_file():
        raise TrainConfigError(f"target_model_path {path}: no config.json (is it a Hugging Face model directory?)")
    config = json.loads(config_file.read_text())
    return config if "hidden_size" in config else config.get("text_config", config)


def train(cfg: TrainConfig, rank: int = 0, world: int = 1) -> dict:
    """Train (or resume) to ``max_steps`` / the end of ``epochs``, checkpoint, export; a summary dict."""
    out_dir = Path(cfg.output_dir)
    data = open_dataset(cfg.data_dir)
    train_samples, held = data.split(cfg.eval_ratio)
    target_path = Path(cfg.target_model_path or data.manifest.get("target_model_path") or "")
    if not str(target_path) or str(target_path) == ".":
        raise TrainConfigError("target_model_path is not set and the manifest names none")
    target_config = _target_config(target_path)
    vocab_size = int(target_config["vocab_size"])
    if int(target_config["hidden_size"]) != data.hidden_size or vocab_size != int(data.manifest.get("vocab_size",
                                                                                                     vocab_size)):
        raise DataError(f"{cfg.data_dir}: extracted from another model than target_model_path {target_path} "
                        f"(hidden {data.hidden_size} vs {target_config['hidden_size']}, vocab "
                        f"{data.manifest.get('vocab_size')} vs {vocab_size})")
    draft_size = resolve_draft_vocab_size(vocab_size, cfg.draft_vocab_size)
    counts = load_token_counts(cfg.data_dir)
    if counts.numel() != vocab_size:
        raise VocabError(f"token counts cover {counts.numel()} ids, the target's vocabulary has {vocab_size}")
    vocab = build_draft_vocab(counts, draft_size)

    device = torch.device(cfg.device)
    torch.manual_seed(cfg.seed)
    drafter_config = DrafterConfig.from_target(target_config, data.n_aux, draft_size)
    model = Eagle3Drafter(drafter_config, vocab.d2t, vocab.t2d)
    model.load_target_embeddings(load_target_embeddings(target_path))
    model.to(device)
    lm_head = load_lm_head(target_path, "cpu" if device.type == "cpu" else str(device))
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    run = _Run(cfg, data, model, lm_head, device, rank, world)

    per_epoch = [len(shard(pack(train_samples, cfg.batch_tokens, cfg.seed, e), rank, world))
                 for e in range(cfg.epochs)]
    total = sum(per_epoch)
    if total == 0:
        raise DataError(f"{len(train_samples)} training samples make no batch for each of {world} processes")
    limit = min(total, cfg.max_steps) if cfg.max_steps is not None else total
    fixed = {"seed": cfg.seed, "batch_tokens": cfg.batch_tokens, "eval_ratio": cfg.eval_ratio,
             "ttt_length": cfg.ttt_length, "draft_vocab_size": draft_size, "world": world}

    step, data_state, resumed_from = 0, DataState(), None
    metrics_path = out_dir / METRICS_FILE
    found = newest_checkpoint(out_dir)
    if found is not None:
        path, (document, model_state, optimizer_state, rng) = found
        changed = [f"{k} {document['fixed'].get(k)!r} -> {v!r}" for k, v in fixed.items()
                   if document["fixed"].get(k) != v]
        if changed:
            raise TrainConfigError(f"{path} was written with other settings ({'; '.join(changed)}); use another "
                                   "output_dir or the same settings to resume")
        if not torch.equal(model_state["d2t"], vocab.d2t):
            raise VocabError(f"{path}: its draft vocabulary differs from the one the data's token counts give now")
        missing, unexpected = model.load_state_dict(model_state, strict=False)
        if set(missing) != {"embed_tokens.weight"} or unexpected:
            raise ValueError(f"{path}: model tensors do not match (missing {missing}, unexpected {unexpected})")
        optimizer.load_state_dict(optimizer_state)
        torch.set_rng_state(rng["torch"])
        if "cuda" in rng and device.type == "cuda":
            torch.cuda.set_rng_state(rng["cuda"])
        step, data_state, resumed_from = int(document["step"]), DataState.from_dict(document["data"]), path
    if rank == 0:
        out_dir.mkdir(parents=True, exist_ok=True)
        _cut_metrics(metrics_path, step)

    def checkpoint(at_step: int, state: DataState) -> None:
        evaluation = run.evaluate(held)
        if rank != 0:
            return
        save_checkpoint(out_dir, at_step, model, optimizer,
                        {"fixed": fixed, "data": state.to_dict(), "schedule": {"total": total, "step": at_step},
                         "config": asdict(cfg)})
        if evaluation is not None:
            with open(metrics_path, "a") as handle:
                handle.write(json.dumps({"kind": "eval", "step": at_step, **evaluation}) + "\n")

    last = None
    model.train()
    if step < limit:
        stream = batches(data, cfg.batch_tokens, cfg.seed, rank, world, data_state, samples=train_samples,
                         epochs=cfg.epochs)
        epoch = data_state.epoch
        with open(metrics_path, "a") if rank == 0 else open(os.devnull, "w") as log:
            for after, batch in stream:
                started = time.perf_counter()
                lr = lr_at(step, cfg, total)
                for group in optimizer.param_groups:
                    group["lr"] = lr
                loss, metrics = run.forward(batch)
                optimizer.zero_grad(set_to_none=True)
                loss.loss.backward()
                if cfg.grad_clip > 0:
                    torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
                optimizer.step()
                step += 1
                reduced = _all_reduce(loss.loss.detach().clone(), world)
                parts = _all_reduce(loss.step_losses.clone(), world)
                for name in ("hits", "rows", "chain_hits", "chain_rows"):
                    _all_reduce(getattr(metrics, name), world)
                tokens = _all_reduce(torch.tensor(batch.num_tokens), world)
                elapsed = max(time.perf_counter() - started, 1e-9)
                last = {"kind": "train", "step": step, "epoch": epoch, "loss": float(reduced),
                        **_metric_fields(parts, metrics), "tokens": int(tokens),
                        "tokens_per_s": int(tokens) / elapsed, "lr": lr}
                log.write(json.dumps(last) + "\n")
                log.flush()
                epoch = after.epoch
                data_state = after
                if step >= limit:
                    break
                if cfg.checkpoint_every and step % cfg.checkpoint_every == 0:
                    checkpoint(step, after)
        checkpoint(step, data_state)

    drafter_dir = out_dir / DRAFTER_DIR
    if rank == 0:
        state_dict = {k: v.detach().cpu() for k, v in model.state_dict().items()}
        if drafter_config.target_hidden_size == drafter_config.hidden_size:
            state_dict.pop("embed_tokens.weight")
        export_cfg = {**asdict(drafter_config), "dtype": cfg.dtype}
        export.export_sglang(state_dict, export_cfg, data.manifest, drafter_dir,
                             target_model_type_override=target_config.get("model_type"))
    return {"steps": step, "total_steps": total, "resumed_from": str(resumed_from) if resumed_from else None,
            "last": last, "drafter_dir": str(drafter_dir), "draft_vocab_size": draft_size,
            "draft_vocab_coverage": vocab.coverage, "config": {f.name: getattr(cfg, f.name) for f in fields(cfg)}}
