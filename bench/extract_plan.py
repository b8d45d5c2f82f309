"""Benchmark: the extraction's plan (every conversation rendered and tokenized before anything is sent) in one
process against several, side by side.

Before its first request the extraction renders every conversation of its part with the chat template,
tokenizes it, fits it to the max length and keys it (``extract/job.py``'s ``make_plan``); the role's status check
does the same once before the run. This benchmark calls ``make_plan`` itself, as ``--check`` does, with the
server's facts given instead of asked (no server), over ``--dataset`` with the tokenizer and template of
``--model-path``, in rounds that alternate ``--render-processes 1`` and each count of ``--processes``. Printed:
records per second of each, the ratio to one process, and whether every plan keyed the same samples and skips
in the same order (it must).

On a GPU host (its CPUs are what count), from the repository root, with SmolLM2 imported from its GGUF and
ShareGPT as distributed:

    python3 bench/extract_plan.py --model-path /var/tmp/smollm2 --dataset ShareGPT_V3_unfiltered_cleaned_split.json \\
        --num-samples 4000 --processes 8

Here, with the tiny model and the demo conversations (a smoke run): ``.venv/bin/python bench/extract_plan.py
--model-path .cache/models/tiny-llama --dataset demo.jsonl --num-samples 600 --processes 2``.
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

from eagle3_pipeline.extract.job import ExtractConfig, make_plan  # noqa: E402
from eagle3_pipeline.models.config import read_text_config  # noqa: E402
from eagle3_pipeline.server_client import EngineFacts  # noqa: E402


def plan_once(args, processes: int, out: Path) -> tuple[float, object]:
    """One plan of the dataset in ``processes`` processes: (its seconds, the plan)."""
    layers = int(read_text_config(args.model_path)["num_hidden_layers"])
    facts = EngineFacts("reference", "bench", str(args.model_path), [1, layers // 2 - 1, layers - 4], None, None,
                        "bfloat16")
    cfg = ExtractConfig(dataset=args.dataset, output_dir=out, server_url="http://127.0.0.1:9",
                        model_path=str(args.model_path), num_samples=args.num_samples, max_length=args.max_length,
                        render_processes=processes, quiet=True)
    started = time.perf_counter()
    plan = make_plan(cfg, client=None, dry=True, facts=facts)
    return time.perf_counter() - started, plan


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-path", type=Path, required=True, help="the target: its tokenizer and template")
    parser.add_argument("--dataset", type=Path, required=True, help="conversations (ShareGPT, JSON Lines, ...)")
    parser.add_argument("--num-samples", type=int, default=4000)
    parser.add_argument("--max-length", type=int, default=1024)
    parser.add_argument("--processes", type=lambda text: [int(t) for t in text.split(",")], default=[8],
                        help="the counts of processes to compare with one, comma-separated")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", type=Path, help="also write the result here")
    args = parser.parse_args(argv)
    counts = [1, *[n for n in args.processes if n != 1]]
    seconds: dict[int, list[float]] = {n: [] for n in counts}
    first = None
    same = True
    with tempfile.TemporaryDirectory(prefix="e3p-plan-") as work:
        for round_index in range(args.rounds):
            for n in counts:
                took, plan = plan_once(args, n, Path(work) / "out")
                seconds[n].append(took)
                keyed = ([(p.key, p.line) for p in plan.items], plan.skipped, plan.records)
                first = first or keyed
                same = same and keyed == first
                print(f"round {round_index + 1}, {n} process(es): {plan.records:,} records ({len(plan.items):,} "
                      f"samples, {len(plan.skipped):,} skipped) in {took:.2f} s, {plan.records / took:,.0f} "
                      "records/s", flush=True)
    base = statistics.median(seconds[1])
    print("\n| processes | median s | records/s | x one process |")
    print("|---|---|---|---|")
    rows = []
    for n in counts:
        median = statistics.median(seconds[n])
        rows.append({"processes": n, "seconds": seconds[n], "median_s": median, "ratio": base / median})
        print(f"| {n} | {median:.2f} | {first[2] / median:,.0f} | {base / median:.2f} |")
    print(f"\nevery plan the same samples, keys and skips, in the same order: {'yes' if same else 'NO'}")
    result = {"records": first[2], "samples": len(first[0]), "skipped": len(first[1]), "same": same, "rows": rows}
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
