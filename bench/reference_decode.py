"""Benchmark: the reference engine's decode tokens/s at batch 1 and batch 32 (greedy, on the CPU by default).

The engine's model side (``ModelRunner.run_batch``) decodes greedily for each of ``--batches``
prompts of 16..80 token ids, ``ignore_eos`` so that every request runs its whole budget, in two
workloads: ``same``, every request ``--new-tokens`` tokens; ``mixed``, budgets spread over
1/8..1 of that (as answers that end at different lengths, where finished rows cost nothing
any more). It reports generated tokens per second over the whole call (prefill included, as a
client sees it), the median of ``--rounds`` rounds after one warm-up round. No HTTP: this
measures the decode loop, which is what regeneration spends its time in.

    .venv/bin/python bench/reference_decode.py            # the tiny model in .cache/, CPU
    .venv/bin/python bench/reference_decode.py --device cuda --model-path DIR

Measured figures: docs/regeneration.md ("Measured").
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def prompts(count: int, vocab_size: int) -> list[list[int]]:
    """``count`` prompts of 16..80 token ids (deterministic), all different lengths where possible."""
    out = []
    for i in range(count):
        length = 16 + (i * 37) % 65
        out.append([(7 + 131 * (i + j)) % (vocab_size - 8) + 8 for j in range(length)])
    return out


def main(argv: list[str] | None = None) -> int:
    """Print one line per batch size and the result as JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-path", type=Path, default=ROOT / ".cache" / "models" / "tiny-llama")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--batches", default="1,32", help="comma-separated batch sizes")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0,
                        help="torch CPU threads (0: torch's default); on a busy 2-core machine 1 is steadier")
    parser.add_argument("--json", type=Path, help="also write the result here")
    args = parser.parse_args(argv)

    import torch  # noqa: PLC0415

    from eagle3_pipeline.engine.batcher import GenerateJob, ModelRunner, SamplingConfig  # noqa: PLC0415

    torch.manual_seed(0)
    if args.threads:
        torch.set_num_threads(args.threads)
    runner = ModelRunner(str(args.model_path), device=args.device, dtype=args.dtype)
    result = {"model_path": str(args.model_path), "device": args.device, "dtype": args.dtype,
              "new_tokens": args.new_tokens, "threads": torch.get_num_threads(), "batches": {}}
    for batch in (int(b) for b in args.batches.split(",")):
        for workload in ("same", "mixed"):
            budgets = [args.new_tokens if workload == "same" else max(1, args.new_tokens * (1 + i % 8) // 8)
                       for i in range(batch)]
            rates = []
            for round_ in range(args.rounds + 1):
                jobs = [GenerateJob(rid=f"bench-{batch}-{round_}-{i}", input_ids=ids, capture=False,
                                    sampling=SamplingConfig(max_new_tokens=budgets[i], temperature=0.0,
                                                            ignore_eos=True))
                        for i, ids in enumerate(prompts(batch, runner.vocab_size))]
                started = time.perf_counter()
                outcomes = runner.run_batch(jobs)
                seconds = time.perf_counter() - started
                generated = sum(len(outcome.output_ids) for outcome in outcomes)
                if round_:  # the first round warms up
                    rates.append(generated / seconds)
            result["batches"][f"{batch}-{workload}"] = {"tokens_per_s": round(statistics.median(rates), 1),
                                                        "rounds": [round(r, 1) for r in rates]}
            print(f"batch {batch:>3} {workload:>5}: {statistics.median(rates):,.0f} generated tokens/s "
                  f"(rounds {', '.join(f'{r:,.0f}' for r in rates)})", flush=True)
    print(json.dumps(result, sort_keys=True))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
