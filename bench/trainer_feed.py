"""Benchmark: the trainer as it runs against its bare step, on the same stored states, side by side.

``bench/training.py`` times ``StepRunner.train_step`` alone over batches already in pinned memory. The trainer
(``train.trainer.train``, what ``eagle3-pipeline train`` and the role run) does more around each step: it reads
the batches from disk in a thread (``data.prefetch``: ``load_batch`` of float8 states, then pinned), logs every
step's figures and keeps its progress file. This benchmark measures both on one dataset in one process:

1. a synthetic extraction in ``--dir`` (made once, reused): a target of the drafter's shape whose only weights
   are its embeddings (tied to its head, as SmolLM2's are), and ``--samples`` samples of random states stored as
   the extraction stores them (float8 with per-token scales by default), of ``--min-tokens``..``--max-tokens``
   tokens each (seeded), the first third of each out of the loss as a prompt would be;
2. **trainer**: ``train(TrainConfig(...))`` for ``--steps`` steps of ``--batch-tokens`` tokens (``--lr``, warm-up
   20 as in the SmolLM2 example inventory, no held-out split, no charts), its tokens/s over the steps after
   ``--warmup`` from its own ``metrics.jsonl`` (each step from its start to the next one's: the loop's whole cost);
3. **bare step**: the same drafter shape's ``train_step`` (``bench/training.py``'s ``run_ours``) over the first
   batches of the trainer's first epoch, read and pinned beforehand, ``--warmup`` untimed steps then ``--steps``;
4. **read**: ``load_batch`` + ``pinned`` of those batches, alone (what the prefetch thread does a step).

``--feeds thread,inline,thread-switch-0.5ms`` runs the trainer once per way of getting its batches (``FEEDS``).
Printed: tokens/s and ms a step of each, the ratio trainer / bare step (1.00: the loop costs nothing over its
step) and the read's ms a batch. The shape defaults to SmolLM2-135M's drafter (``--shape smollm2``).

    python3 bench/trainer_feed.py --dir /var/tmp/feed                      # on the GPU host
    python3 bench/trainer_feed.py --shape tiny --device cpu --samples 24 --steps 3 --warmup 1 --batch-tokens 512
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))

import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from storage_read import write_random_dataset  # noqa: E402
from training import SHAPES, TINY, run_ours  # noqa: E402

from eagle3_pipeline.train import trainer as trainer_module  # noqa: E402
from eagle3_pipeline.train.data import load_batch, open_dataset, pack  # noqa: E402
from eagle3_pipeline.train.step import DEFAULT_MLP_RECOMPUTE  # noqa: E402
from eagle3_pipeline.train.trainer import METRICS_FILE, TrainConfig, train  # noqa: E402

SHAPE_CHOICES = {**SHAPES, "tiny": TINY}


def make_target(path: Path, shape) -> Path:
    """A target directory of ``shape``: config.json and its embeddings only (tied head), bf16, seeded."""
    path.mkdir(parents=True, exist_ok=True)
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": shape.hidden,
              "intermediate_size": shape.intermediate, "num_attention_heads": shape.heads,
              "num_key_value_heads": shape.kv_heads, "head_dim": shape.head_dim, "num_hidden_layers": shape.n_aux + 1,
              "vocab_size": shape.vocab, "rms_norm_eps": 1e-5, "rope_theta": shape.rope_theta,
              "max_position_embeddings": 8192, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
              "hidden_act": "silu"}
    (path / "config.json").write_text(json.dumps(config, indent=1) + "\n")
    generator = torch.Generator().manual_seed(0)
    embed = (torch.randn(shape.vocab, shape.hidden, generator=generator) * 0.02).to(torch.bfloat16)
    save_file({"model.embed_tokens.weight": embed, "model.norm.weight": torch.ones(shape.hidden,
                                                                                      dtype=torch.bfloat16)},
              str(path / "model.safetensors"))
    return path


def make_data(out: Path, target: Path, shape, args: argparse.Namespace) -> Path:
    """A merged extraction of ``args.samples`` random samples of seeded lengths, stored as ``args.storage_dtype``."""
    lengths = torch.randint(args.min_tokens, args.max_tokens + 1, (args.samples,),
                            generator=torch.Generator().manual_seed(args.seed)).tolist()
    return write_random_dataset(out, hidden=shape.hidden, aux=shape.n_aux, lengths=lengths,
                                storage_dtype=None if args.storage_dtype == "bfloat16" else args.storage_dtype,
                                target=str(target), vocab=shape.vocab, prompt_divisor=3, seed=args.seed)


def dataset(args: argparse.Namespace, shape) -> tuple[Path, Path]:
    """(target dir, data dir) under ``args.dir``, made unless a finished one of the same request is there."""
    request = {name: getattr(args, name) for name in ("shape", "samples", "min_tokens", "max_tokens", "seed",
                                                      "storage_dtype")}
    stamp = args.dir / "request.json"
    target, data = args.dir / "target", args.dir / "data"
    if stamp.is_file() and json.loads(stamp.read_text()) == request and (data / "data_config.json").is_file():
        print(f"[trainer_feed] reusing the dataset in {args.dir}", flush=True)
        return target, data
    started = time.perf_counter()
    make_target(target, shape)
    make_data(data, target, shape, args)
    stamp.write_text(json.dumps(request) + "\n")
    print(f"[trainer_feed] dataset: {args.samples} samples written in {time.perf_counter() - started:.1f} s",
          flush=True)
    return target, data


# How the trainer gets its batches (``--feeds``): as it does (``thread``: read ahead in a thread, pinned there),
# read in the main thread between the steps (``inline``), or read ahead with the interpreter switching threads
# every 0.5 ms instead of Python's 5 ms (``thread-switch-0.5ms``). If the reader's thread holding the interpreter
# lock is what slows the step's launches, ``inline`` and the short switch interval gain on ``thread``.
FEEDS = ("thread", "inline", "thread-switch-0.5ms")


def _inline(stream, depth: int = 2, pin: bool = False):
    for state, batch in stream:
        yield state, batch.pinned() if pin else batch


@contextlib.contextmanager
def feed(name: str):
    """The trainer's batch feed set to ``name`` (one of ``FEEDS``) for the duration."""
    prefetch, interval = trainer_module.prefetch, sys.getswitchinterval()
    if name == "inline":
        trainer_module.prefetch = _inline
    elif name == "thread-switch-0.5ms":
        sys.setswitchinterval(0.0005)
    try:
        yield
    finally:
        trainer_module.prefetch = prefetch
        sys.setswitchinterval(interval)


def run_trainer(args: argparse.Namespace, target: Path, data: Path, out: Path, feed_name: str = "thread") -> dict:
    """The trainer for ``warmup + steps`` steps, fed by ``feed_name``; its steady tokens/s from its own metrics."""
    cfg = TrainConfig(data_dir=str(data), output_dir=str(out), target_model_path=str(target), epochs=args.epochs,
                      draft_vocab_size=SHAPE_CHOICES[args.shape].draft_vocab,
                      max_steps=args.warmup + args.steps, lr=args.lr, warmup_steps=20, batch_tokens=args.batch_tokens,
                      device=args.device, resume=False, tensorboard=False, charts=False, seed=1)
    started = time.perf_counter()
    with feed(feed_name):
        summary = train(cfg)
    wall = time.perf_counter() - started
    records = [json.loads(line) for line in (out / METRICS_FILE).read_text().splitlines() if line.strip()]
    steps = [r for r in records if r.get("kind") == "train"]
    timed = [r for r in steps if r["step"] > args.warmup]
    if not timed:
        raise SystemExit(f"trainer_feed: the trainer logged {len(steps)} steps, none after the {args.warmup} "
                         "warm-up ones; raise --steps or --epochs")
    seconds = sum(r["tokens"] / r["tokens_per_s"] for r in timed)
    tokens = sum(r["tokens"] for r in timed)
    return {"impl": f"trainer ({feed_name})", "feed": feed_name, "steps": len(timed), "tokens_per_s": tokens / seconds,
            "step_ms": 1000 * seconds / len(timed),
            "step_ms_median": 1000 * statistics.median(r["tokens"] / r["tokens_per_s"] for r in timed),
            "tokens_per_step": tokens / len(timed), "wall_s": wall, "steps_logged": len(steps),
            "trained_steps": (summary.get("last") or {}).get("step")}


def epoch_batches(data_dir: Path, args: argparse.Namespace, count: int, pin: bool):
    """The trainer's first ``count`` batches of its first epoch (its packing, its seed), read and pinned; the read's
    seconds a batch."""
    data = open_dataset(data_dir)
    order = pack(data.samples, args.batch_tokens, 1, 0)[:count]
    started = time.perf_counter()
    batches = [load_batch(data, indices, max_tokens=args.batch_tokens, dequantize=False) for indices in order]
    batches = [batch.pinned() for batch in batches] if pin else batches
    return batches, (time.perf_counter() - started) / max(1, len(order))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dir", type=Path, help="where the dataset and the trainer's output go (default: a temp dir)")
    parser.add_argument("--shape", choices=sorted(SHAPE_CHOICES), default="smollm2")
    parser.add_argument("--samples", type=int, default=1200)
    parser.add_argument("--min-tokens", type=int, default=200)
    parser.add_argument("--max-tokens", type=int, default=1024)
    parser.add_argument("--storage-dtype", choices=("bfloat16", "float8_e4m3"), default="float8_e4m3")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--batch-tokens", type=int, default=8192, help="the SmolLM2 example inventory's")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--epochs", type=int, default=3, help="the trainer's schedule (it stops after its steps)")
    parser.add_argument("--steps", type=int, default=150, help="timed steps of each")
    parser.add_argument("--warmup", type=int, default=10, help="untimed steps first (compilation happens there)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--feeds", default="thread", help=f"comma-separated, of {', '.join(FEEDS)}: the trainer once "
                        "with each way of getting its batches (the first is the ratio's)")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    feeds = [name.strip() for name in args.feeds.split(",") if name.strip()]
    if not feeds or any(name not in FEEDS for name in feeds):
        parser.error(f"--feeds {args.feeds!r}: each of {', '.join(FEEDS)}")
    shape = SHAPE_CHOICES[args.shape]
    device = torch.device(args.device)
    with tempfile.TemporaryDirectory() as scratch:
        args.dir = args.dir or Path(scratch)
        args.dir.mkdir(parents=True, exist_ok=True)
        target, data = dataset(args, shape)
        trainers = []
        for name in feeds:
            trainers.append(run_trainer(args, target, data, args.dir / f"training-{name}", name))
            one = trainers[-1]
            print(f"trainer, {name:<19} {one['tokens_per_s']:>10,.0f} tokens/s  {one['step_ms']:7.1f} ms a step "
                  f"(median {one['step_ms_median']:.1f}) over {one['steps']} steps of {one['tokens_per_step']:,.0f} "
                  "tokens", flush=True)
        trainer = trainers[0]
        batches, read_s = epoch_batches(data, args, args.warmup + args.steps, pin=device.type == "cuda")
        options = argparse.Namespace(warmup=args.warmup, steps=args.steps, no_compile=False, profile=0)
        bare = run_ours(shape, batches, options, device, DEFAULT_MLP_RECOMPUTE, "auto")
        print(f"bare step  {bare['tokens_per_s']:>10,.0f} tokens/s  {bare['step_ms']:7.1f} ms a step over "
              f"{bare['steps']} steps ({len(batches)} batches, cycled)", flush=True)
        ratio = trainer["tokens_per_s"] / bare["tokens_per_s"]
        print(f"read       {1000 * read_s:7.1f} ms a batch (load_batch{' + pinned' if device.type == 'cuda' else ''})",
              flush=True)
        print(f"trainer / bare step: {ratio:.2f}x tokens/s ({trainer['step_ms'] - bare['step_ms']:+.1f} ms a step)",
              flush=True)
        for one in trainers[1:]:
            print(f"trainer, {one['feed']} / {trainer['feed']}: {one['tokens_per_s'] / trainer['tokens_per_s']:.2f}x "
                  "tokens/s", flush=True)
        result = {"trainer": trainer, "trainers": trainers, "bare_step": bare, "read_ms_per_batch": 1000 * read_s,
                  "trainer_over_bare": ratio, "shape": args.shape, "batch_tokens": args.batch_tokens,
                  "samples": args.samples, "storage_dtype": args.storage_dtype, "device": str(device),
                  "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
                  "torch": torch.__version__}
        print(json.dumps(result, indent=1), flush=True)
        if args.json:
            args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
