"""Benchmark: what share of the target's greedy tokens a draft vocabulary cannot draft at all (issue 30).

The drafter proposes only tokens of its draft vocabulary (the D most frequent loss tokens of its training
data, ``train/vocab.py``); a target token outside it ends every chain that reaches it. This measures that
share where serving meets it: the target's own greedy answers (``--new-tokens``, to its end of turn) to
held-out prompts, the records after the training ones (``evaluate/heldout.py``'s selection: rendered by the
chat template through the first assistant turn, at most ``--max-length`` minus the new tokens long).

The vocabularies are counted as the training counts them, over the loss tokens (assistant turns) of the
first N records of the same file, for each ``--records`` N, and chosen by ``train.vocab.build_draft_vocab``
for each ``--draft-sizes`` D. The tokens counted are the answers' second to last (the first comes from the
prefill, before any draft). Prints one line per N and D, and writes ``--json``. (The evaluation reports the
same share for the one drafter it measures, ``draft_vocabulary`` in evaluation.json; this asks it of other
sizes and record counts, before any training.)

    .venv/bin/python bench/draft_vocab.py --model-path SMOLLM2_DIR --dataset ShareGPT.json \\
        --records 1000 4000 8000 17300 --heldout 200          # the CPU does; a GPU with --device cuda
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from eagle3_pipeline.conversations.dataset import Sample, read_dataset  # noqa: E402
from eagle3_pipeline.conversations.template import ChatRenderer, SampleError  # noqa: E402
from eagle3_pipeline.evaluate.heldout import HeldoutPrompt, iter_heldout_prompts  # noqa: E402
from eagle3_pipeline.train.vocab import build_draft_vocab  # noqa: E402


def say(message: str) -> None:
    print(f"[draft-vocab] {message}", flush=True)


def loss_token_counts(dataset: Path, renderer: ChatRenderer, vocab_size: int,
                      records: list[int]) -> tuple[dict, frozenset[str]]:
    """({N: [V] int64 counts of the loss tokens of the first N records}, the ids of the records counted), one pass
    over the largest N."""
    wanted = sorted(set(records))
    counts, cumulative, done, known = {}, torch.zeros(vocab_size, dtype=torch.int64), 0, set()
    for record in read_dataset(dataset, wanted[-1]):
        done = record.ordinal + 1
        if isinstance(record, Sample):
            if not record.id_generated:
                known.add(record.sample_id)
            try:
                ids, mask = renderer.render(record.messages)
            except SampleError:
                continue  # the extraction skips it too
            ids = torch.tensor(ids, dtype=torch.int64)[torch.tensor(mask, dtype=torch.bool)]
            cumulative += torch.bincount(ids, minlength=vocab_size)[:vocab_size]
        while wanted and done >= wanted[0]:
            counts[wanted.pop(0)] = cumulative.clone()
    for left in wanted:  # the file ended first
        counts[left] = cumulative.clone()
    return counts, frozenset(known)


def heldout_prompts(dataset: Path, renderer: ChatRenderer, after: int, count: int, longest: int,
                    known: frozenset[str]) -> list[list[int]]:
    """The first ``count`` prompts of the records from ordinal ``after`` on, at most ``longest`` tokens each; a
    record with a counted record's id is left out unrendered (as the evaluation leaves out the training's ids)."""
    first_line = next((r.line for r in read_dataset(dataset) if r.ordinal >= after), None)
    if first_line is None:
        return []
    prompts = []
    for item in iter_heldout_prompts(dataset, renderer, known):
        if isinstance(item, HeldoutPrompt) and item.line >= first_line and len(item.input_ids) <= longest:
            prompts.append(list(item.input_ids))
            if len(prompts) == count:
                break
    return prompts


def greedy_answers(model, tokenizer, prompts: list[list[int]], new_tokens: int, batch: int) -> list[list[int]]:
    """Each prompt's greedy answer, up to and with its end of turn (batches of similar lengths, left-padded)."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    configured = getattr(model.generation_config, "eos_token_id", None)
    stops = {tokenizer.eos_token_id, *(configured if isinstance(configured, list) else [configured])} - {None}
    answers: dict[int, list[int]] = {}
    order = sorted(range(len(prompts)), key=lambda k: len(prompts[k]))
    started = time.monotonic()
    for at in range(0, len(order), batch):
        rows = [prompts[k] for k in order[at:at + batch]]
        width = max(map(len, rows))
        ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows], device=model.device)
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], device=model.device)
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False,
                                 pad_token_id=pad)
        for k, row in zip(order[at:at + batch], out[:, width:].tolist()):
            end = next((i for i, t in enumerate(row) if t in stops), len(row) - 1)
            answers[k] = row[:end + 1]
        say(f"greedy answers: {len(answers)}/{len(prompts)} ({time.monotonic() - started:.0f} s)")
    return [answers[k] for k in range(len(prompts))]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-path", type=Path, required=True, help="the target (a Hugging Face directory)")
    parser.add_argument("--dataset", type=Path, required=True, help="ShareGPT/OpenAI records: training, then held out")
    parser.add_argument("--records", type=int, nargs="+", default=[1000, 4000, 8000],
                        help="vocabularies counted over the first N records; held-out prompts come after the largest")
    parser.add_argument("--draft-sizes", type=int, nargs="+", default=[8000, 16000, 32000])
    parser.add_argument("--heldout", type=int, default=200)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--max-length", type=int, default=1024, help="the training's: longer prompts are not served")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    if min(args.records) < 1 or min(args.draft_sizes) < 1 or args.heldout < 1 or args.new_tokens < 2:
        parser.error("--records, --draft-sizes and --heldout need at least 1, --new-tokens at least 2")

    from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: PLC0415

    tokenizer = AutoTokenizer.from_pretrained(args.model_path)
    renderer = ChatRenderer(tokenizer)
    model = AutoModelForCausalLM.from_pretrained(args.model_path, dtype=getattr(torch, args.dtype))
    model = model.to(args.device).eval()
    vocab_size = int(model.get_output_embeddings().weight.shape[0])
    started = time.monotonic()
    counts, known = loss_token_counts(args.dataset, renderer, vocab_size, args.records)
    say(f"loss tokens of the first {max(args.records)} records counted ({time.monotonic() - started:.0f} s)")
    prompts = heldout_prompts(args.dataset, renderer, max(args.records), args.heldout,
                              args.max_length - args.new_tokens, known)
    if not prompts:
        raise SystemExit(f"[draft-vocab] {args.dataset}: no held-out prompt after record {max(args.records)}")
    answers = greedy_answers(model, tokenizer, prompts, args.new_tokens, args.batch)
    drafted = torch.tensor([t for answer in answers for t in answer[1:]], dtype=torch.int64)
    result = {"model": str(args.model_path), "dataset": str(args.dataset), "heldout_prompts": len(prompts),
              "new_tokens": args.new_tokens, "drafted_tokens": int(drafted.numel()), "vocab_size": vocab_size,
              "answers": answers, "by_records": {}}
    for records, count in sorted(counts.items()):
        for size in sorted(s for s in args.draft_sizes if s <= vocab_size):
            vocab = build_draft_vocab(count, size)
            outside = int((~vocab.t2d[drafted]).sum()) / drafted.numel() if drafted.numel() else 0.0
            result["by_records"].setdefault(str(records), {})[str(size)] = {
                "training_coverage": vocab.coverage, "greedy_outside": outside}
            say(f"records {records:>6}, draft vocabulary {size:>6}: covers {vocab.coverage:.2%} of the training's "
                f"loss tokens; {outside:.2%} of the held-out greedy tokens cannot be drafted")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
