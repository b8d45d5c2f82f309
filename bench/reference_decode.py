"""Benchmark: the reference engine's decode tokens/s, over the slot cache against transformers' cache, side by side.

The engine's model side (``ModelRunner.run_batch``) decodes greedily for each of ``--batches``
prompts (``--prompt-tokens LO,HI`` token ids, deterministic), ``ignore_eos`` so that every request
runs its whole budget, in two workloads: ``same``, every request ``--new-tokens`` tokens; ``mixed``,
budgets spread over 1/8..1 of that (answers that end at different lengths). Each batch runs once per
decode path of ``--decode`` (``both``: the slot cache, ``engine/slots.py``, and transformers'
``DynamicCache``, the same runner and the same jobs) and reports generated tokens per second over the
whole call (prefill included, as a client sees it), the median of ``--rounds`` rounds after one
warm-up round (which also captures the CUDA graphs), and the ratio slots / transformers. No HTTP:
this measures the decode loop, which is what regeneration spends its time in.

    .venv/bin/python bench/reference_decode.py --threads 1          # the tiny model in .cache/, CPU
    python3 bench/reference_decode.py --device cuda --dtype bfloat16 --random-shape smollm2 \
        --batches 1,64,512 --prompt-tokens 200,1200 --new-tokens 256 --rounds 1

Measured figures: docs/regeneration.md ("Measured") and docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def prompts(count: int, vocab_size: int, low: int = 16, high: int = 80) -> list[list[int]]:
    """``count`` prompts of ``low``..``high`` token ids (deterministic), different lengths where possible."""
    out = []
    for i in range(count):
        length = low + (i * 37) % (high - low + 1)
        out.append([(7 + 131 * (i + j)) % (vocab_size - 8) + 8 for j in range(length)])
    return out


def random_model(shape: str, path: Path) -> Path:
    """A Llama of a known shape with random weights, built once under ``path`` (bf16, tied embeddings)."""
    import torch  # noqa: PLC0415
    from transformers import LlamaConfig, LlamaForCausalLM  # noqa: PLC0415

    shapes = {"smollm2": {"hidden_size": 576, "num_hidden_layers": 30, "num_attention_heads": 9,
                          "num_key_value_heads": 3, "intermediate_size": 1536, "vocab_size": 49152,
                          "max_position_embeddings": 8192, "tie_word_embeddings": True}}
    target = path / f"random-{shape}"
    if not (target / "config.json").is_file():
        torch.manual_seed(0)
        LlamaForCausalLM(LlamaConfig(**shapes[shape])).to(torch.bfloat16).save_pretrained(target)
    return target


def time_prefills(decoder, counts: list[int], vocab_size: int, low: int, high: int, rounds: int, device: str) -> dict:
    """The slot cache's prefill of each count of prompts, alone: median ms in all, and ms until the host had
    issued it (the call's return, before the device is waited for)."""
    import torch  # noqa: PLC0415

    def sync() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    out = {}
    for count in counts:
        issued, whole = [], []
        batch = prompts(count, vocab_size, low, high)
        for round_ in range(rounds + 1):
            slots = decoder.take(count)
            sync()
            started = time.perf_counter()
            with torch.inference_mode():
                decoder.prefill(slots, batch)
            returned = time.perf_counter()
            sync()
            ended = time.perf_counter()
            decoder.release(slots)
            if round_:  # the first round warms up
                issued.append(1000 * (returned - started))
                whole.append(1000 * (ended - started))
        tokens = sum(len(p) for p in batch)
        out[str(count)] = {"tokens": tokens, "ms": round(statistics.median(whole), 2),
                           "host_ms": round(statistics.median(issued), 2)}
        print(f"prefill of {count:>3} prompts ({tokens:,} tokens): {out[str(count)]['ms']:.1f} ms, issued by the host "
              f"in {out[str(count)]['host_ms']:.1f} ms", flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    """Print one line per batch, workload and decode path, and the result as JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-path", type=Path, default=ROOT / ".cache" / "models" / "tiny-llama")
    parser.add_argument("--random-shape", choices=["smollm2"], help="a random-weight model of this shape instead")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--batches", default="1,32", help="comma-separated batch sizes")
    parser.add_argument("--prompt-tokens", default="16,80", help="LO,HI: prompt lengths")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workloads", default="same,mixed", help="comma-separated: same, mixed")
    parser.add_argument("--decode", choices=["both", "slots", "transformers"], default="both")
    parser.add_argument("--slot-tokens", type=int, default=4096)
    parser.add_argument("--no-cuda-graphs", dest="cuda_graphs", action="store_false")
    parser.add_argument("--prefill-graphs", choices=["on", "off", "both"], default="on",
                        help="--prefill: the slot cache's prefills replayed as CUDA graphs, eager, or both side by "
                        "side (the same prompts)")
    parser.add_argument("--threads", type=int, default=0,
                        help="torch CPU threads (0: torch's default); on a busy 2-core machine 1 is steadier")
    parser.add_argument("--prefill", default="",
                        help="N,N,...: also time the slot cache's prefill alone of N prompts (what admitting N "
                        "requests into a running batch pauses it for): its whole time, and the host's time to issue "
                        "it (near the whole: bound by the host, not the GPU)")
    parser.add_argument("--json", type=Path, help="also write the result here")
    args = parser.parse_args(argv)

    import torch  # noqa: PLC0415

    from eagle3_pipeline.engine.batcher import GenerateJob, ModelRunner, SamplingConfig  # noqa: PLC0415

    torch.manual_seed(0)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.random_shape:
        args.model_path = random_model(args.random_shape, ROOT / ".cache" / "models")
    low, high = (int(v) for v in args.prompt_tokens.split(","))
    sizes = [int(b) for b in args.batches.split(",")]
    prefills = [int(n) for n in args.prefill.split(",") if n.strip()]
    runner = ModelRunner(str(args.model_path), device=args.device, dtype=args.dtype)
    paths = ["slots", "transformers"] if args.decode == "both" else [args.decode]
    decoder = None
    if "slots" in paths:
        if not runner.enable_slots(max(sizes + prefills), args.slot_tokens, args.cuda_graphs,
                                   args.prefill_graphs != "off"):
            raise SystemExit(f"slot decoding is off for this model: {runner.decode_path}")
        decoder = runner.slot_decoder
    result = {"model_path": str(args.model_path), "device": args.device, "dtype": args.dtype,
              "new_tokens": args.new_tokens, "prompt_tokens": [low, high], "threads": torch.get_num_threads(),
              "slots": runner.decode_path, "batches": {}}
    for batch in sizes:
        for workload in args.workloads.split(","):
            budgets = [args.new_tokens if workload == "same" else max(1, args.new_tokens * (1 + i % 8) // 8)
                       for i in range(batch)]
            rates: dict[str, float] = {}
            for path in paths:
                runner.slot_decoder = decoder if path == "slots" else None
                measured = []
                for round_ in range(args.rounds + 1):
                    jobs = [GenerateJob(rid=f"bench-{batch}-{round_}-{i}", input_ids=ids, capture=False,
                                        sampling=SamplingConfig(max_new_tokens=budgets[i], temperature=0.0,
                                                                ignore_eos=True))
                            for i, ids in enumerate(prompts(batch, runner.vocab_size, low, high))]
                    if args.device == "cuda":
                        torch.cuda.synchronize()
                    started = time.perf_counter()
                    outcomes = runner.run_batch(jobs)
                    seconds = time.perf_counter() - started
                    generated = sum(len(outcome.output_ids) for outcome in outcomes)
                    if round_:  # the first round warms up
                        measured.append(generated / seconds)
                rates[path] = statistics.median(measured)
                result["batches"][f"{batch}-{workload}-{path}"] = {"tokens_per_s": round(rates[path], 1),
                                                                   "rounds": [round(r, 1) for r in measured]}
                print(f"batch {batch:>3} {workload:>5} {path:>12}: {rates[path]:,.0f} generated tokens/s "
                      f"(rounds {', '.join(f'{r:,.0f}' for r in measured)})", flush=True)
            if len(rates) == 2:
                ratio = rates["slots"] / rates["transformers"]
                result["batches"][f"{batch}-{workload}-ratio"] = round(ratio, 2)
                print(f"batch {batch:>3} {workload:>5}: slots / transformers = {ratio:.2f}x", flush=True)
    if prefills and decoder is not None:
        # "prefill": as the engine runs it (graphs where they are on); with "both", also "prefill_eager" beside it.
        modes = {"on": ["prefill"], "off": ["prefill"], "both": ["prefill_eager", "prefill"]}[args.prefill_graphs]
        graph_tokens = decoder.prefill_graph_tokens
        for mode in modes:
            decoder.prefill_graph_tokens = 0 if mode == "prefill_eager" else graph_tokens
            print(f"{mode}: prefills of up to {decoder.prefill_graph_tokens} tokens replay CUDA graphs", flush=True)
            result[mode] = time_prefills(decoder, prefills, runner.vocab_size, low, high, args.rounds, args.device)
    print(json.dumps(result, sort_keys=True))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
