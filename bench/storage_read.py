"""Benchmark: the training's read path, hidden states stored in bf16 against float8 with per-token scales.

Two datasets of the same random states (``--hidden``, ``--aux`` layers, ``--samples`` of
``--tokens`` tokens) are written with the extraction's store, once unquantized (bf16) and once
as float8_e4m3. Then, rounds alternating between the two, every batch is read as the trainer
reads it (``load_batch(..., dequantize=False)``), moved to the device and dequantized there
(``PackedBatch.to``), ending with a device sync. Printed: tokens per second of each, their
ratio (issue 13: float8 at least as fast), the bytes of states moved per token, and the largest
difference between the states dequantized on the device and on the CPU (0: the same numbers).

Run on the GPU machine: python3 bench/storage_read.py (``--device cpu`` runs it here).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

import torch  # noqa: E402

from eagle3_pipeline.extract import store  # noqa: E402
from eagle3_pipeline.train.data import load_batch, open_dataset  # noqa: E402

RUN = {"dataset": {"name": "random", "sha256": "0" * 64, "num_samples_limit": None},
       "verification": {"positions": "all", "checks": []}}


def write_dataset(out: Path, args: argparse.Namespace, storage_dtype: str | None) -> Path:
    """A merged dataset of ``args.samples`` random samples of ``args.tokens`` tokens each, as the extraction stores
    them."""
    return write_random_dataset(out, hidden=args.hidden, aux=args.aux, lengths=[args.tokens] * args.samples,
                                storage_dtype=storage_dtype)


def write_random_dataset(out: Path, *, hidden: int, aux: int, lengths: list[int], storage_dtype: str | None,
                         target: str = "random", vocab: int = 1000, prompt_divisor: int | None = None,
                         seed: int = 0) -> Path:
    """A merged dataset of random bf16 states as the extraction stores them: one sample of each of ``lengths``
    tokens (seeded by ``seed`` and its index), the first ``tokens // prompt_divisor`` of each out of the loss as a
    prompt's would be (none without it), extracted from ``target`` with its ``vocab``."""
    settings = {"target_model_path": target, "aux_layers": list(range(aux)), "hidden_size": hidden,
                "num_hidden_layers": aux + 1, "vocab_size": vocab, "dtype": "bfloat16", "max_length": max(lengths),
                "overflow": "truncate", "shard_size": len(lengths)}
    if storage_dtype:
        settings["storage_dtype"] = storage_dtype
    store.claim_settings(out, settings)
    samples = []
    for index, tokens in enumerate(lengths):
        generator = torch.Generator().manual_seed(seed * 1_000_003 + index)
        aux_states = torch.randn(tokens, aux * hidden, generator=generator).to(torch.bfloat16)
        last = torch.randn(tokens, hidden, generator=generator).to(torch.bfloat16)
        ids = torch.randint(0, vocab, (tokens,), generator=generator, dtype=torch.int32)
        mask = torch.ones(tokens, dtype=torch.uint8)
        if prompt_divisor:
            mask[: tokens // prompt_divisor] = 0
        file = f"{store.shard_dir_name(index, len(lengths))}/s-{index}{store.SAMPLE_SUFFIX}"
        size, sha = store.write_sample(out / file, ids, mask, aux_states, last,
                                       {"format": store.FORMAT, "id": f"s-{index}"}, storage_dtype)
        samples.append({"key": str(index), "status": "ok", "ordinal": index, "line": index + 1, "id": f"s-{index}",
                        "file": file, "tokens": tokens, "loss_tokens": int(mask.sum()), "bytes": size,
                        "sha256": sha})
    store.write_part_manifest(out, 0, 1, samples, [], [], len(lengths), RUN)
    store.merge(out)
    return out


def read_all(data, device: torch.device, per_batch: int) -> tuple[float, int]:
    """(seconds, bytes of states moved) to read every batch, move it and dequantize it on ``device``."""
    moved = 0
    started = time.perf_counter()
    for first in range(0, len(data.samples), per_batch):
        batch = load_batch(data, list(range(first, min(first + per_batch, len(data.samples)))), dequantize=False)
        moved += sum(t.nbytes for t in (batch.aux_hidden, batch.last_hidden, batch.aux_scales, batch.last_scales)
                     if t is not None)
        ready = batch.to(device, non_blocking=True)
        assert ready.aux_hidden.dtype == torch.bfloat16
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - started, moved


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=7168, help="H (Kimi-K2.5: 7168)")
    parser.add_argument("--aux", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=2048, help="tokens per sample")
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--per-batch", type=int, default=1, help="samples per batch (2048-token batches: 1)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dir", type=Path, help="where the two datasets go (default: a temp dir)")
    args = parser.parse_args()
    device = torch.device(args.device)
    root = args.dir or Path(tempfile.mkdtemp(prefix="storage-read-"))
    data = {name: open_dataset(write_dataset(root / name, args, dtype))
            for name, dtype in (("bfloat16", None), ("float8_e4m3", "float8_e4m3"))}
    for dataset in data.values():  # warm: the page cache holds both, so the disk does not decide
        read_all(dataset, device, args.per_batch)
    times: dict[str, list[float]] = {name: [] for name in data}
    moved = {}
    for _ in range(args.rounds):
        for name, dataset in data.items():
            seconds, moved[name] = read_all(dataset, device, args.per_batch)
            times[name].append(seconds)
    tokens = args.samples * args.tokens
    raw = load_batch(data["float8_e4m3"], [0], dequantize=False)
    difference = (raw.to(device).aux_hidden.float().cpu() - raw.dequantized().aux_hidden.float()).abs().max()
    result = {name: {"tokens_per_s": tokens / statistics.median(times[name]),
                     "bytes_moved_per_token": moved[name] / tokens,
                     "file_bytes": sum((data[name].root / s.file).stat().st_size for s in data[name].samples)}
              for name in data}
    result["float8_over_bf16_tokens_per_s"] = (result["float8_e4m3"]["tokens_per_s"]
                                               / result["bfloat16"]["tokens_per_s"])
    result["device_vs_cpu_dequantize_max_difference"] = float(difference)
    result["shape"] = {"hidden": args.hidden, "aux": args.aux, "tokens": args.tokens, "samples": args.samples,
                       "device": str(device)}
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
