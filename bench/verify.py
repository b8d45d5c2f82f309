"""Benchmark: the deep verify of a float8 dataset (``eagle3-pipeline verify``, the extraction role's last check).

One dataset of random states stored as float8_e4m3 with per-token scales (``--hidden``, ``--aux``
layers, ``--samples`` of ``--tokens`` tokens; SmolLM2's shape and ShareGPT's mean sample length by
default) is verified deep (checksums, shapes, dtypes, finite values of every file) in rounds that
alternate two ways of checking the float8 values for NaN: over their bits (``storage.all_finite``,
what the verify does) and by converting every value to float32 first (what it did before). Printed:
the tokens per second of each, and their ratio. The files are read once before the rounds, so the
page cache holds them and the disk does not decide.

On all of ShareGPT (11.4 M tokens, 26 G stored values) the deep verify ran on the GPU machine's CPU
between the extraction and the training; run it there or here: python3 bench/verify.py
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
from storage_read import write_dataset  # noqa: E402 - this folder's own module

from eagle3_pipeline.extract import storage, store  # noqa: E402


def by_conversion(tensor: torch.Tensor) -> bool:
    """The check as it was: every float8 value converted to float32, then isfinite."""
    values = tensor.float() if tensor.dtype == storage.FLOAT8_TORCH else tensor
    return bool(torch.isfinite(values).all())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=576, help="H (SmolLM2-135M: 576)")
    parser.add_argument("--aux", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=711, help="tokens per sample (ShareGPT regenerated: 711)")
    parser.add_argument("--samples", type=int, default=400)
    parser.add_argument("--threads", type=int, default=4, help="the verify's threads (its default: 4)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dir", type=Path, help="where the dataset goes (default: a temp dir)")
    args = parser.parse_args()
    root = args.dir or Path(tempfile.mkdtemp(prefix="verify-"))
    data = write_dataset(root / "float8", args, "float8_e4m3")
    bits = storage.all_finite
    ways = {"bits": bits, "conversion": by_conversion}
    times: dict[str, list[float]] = {name: [] for name in ways}
    store.verify_dataset(data, deep=True, threads=args.threads)  # warm the page cache
    try:
        for _ in range(args.rounds):
            for name, check in ways.items():
                storage.all_finite = check
                started = time.perf_counter()
                report = store.verify_dataset(data, deep=True, threads=args.threads)
                times[name].append(time.perf_counter() - started)
                assert report["ok"] and report["checked"] == args.samples, report
    finally:
        storage.all_finite = bits
    tokens = args.samples * args.tokens
    result = {name: {"tokens_per_s": tokens / statistics.median(seconds), "seconds": seconds}
              for name, seconds in times.items()}
    result["bits_over_conversion_tokens_per_s"] = result["bits"]["tokens_per_s"] / result["conversion"]["tokens_per_s"]
    result["shape"] = {"hidden": args.hidden, "aux": args.aux, "tokens": args.tokens, "samples": args.samples,
                       "threads": args.threads, "torch_threads": torch.get_num_threads()}
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
