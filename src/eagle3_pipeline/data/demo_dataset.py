"""The demo conversations: questions about the standard library, answered from its docstrings.

ShareGPT form, one JSON object per line::

    {"id": "demo-00000", "conversations": [{"from": "system"|"human"|"gpt", "value": "..."}]}

Deterministic for a given seed and Python: the same bytes on every run. The held-out file is
built from documented objects that the training file never mentions, so no conversation and no
human turn is shared between the two.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
from pathlib import Path

from eagle3_pipeline.atomic import atomic_write_text
from eagle3_pipeline.cli_args import path_arg
from eagle3_pipeline.data.stdlib_corpus import DocEntry, extract_entries

SYSTEM_PROMPTS = (
    "You are a helpful assistant who explains the Python standard library.",
    "You answer questions about Python modules briefly and precisely.",
    "You are a Python expert. Quote the documentation when you can.",
)
SYSTEM_PROMPT_RATE = 0.3
MULTI_TURN_RATE = 0.3
MAX_ANSWER_CHARS = 600
ROLE_OF = {"system": "system", "human": "user", "gpt": "assistant"}


def is_demo_subject(entry: DocEntry) -> bool:
    """Whether a docstring makes a useful answer: a summary of a sentence or more, not a wall of text."""
    return 20 <= len(entry.summary) <= MAX_ANSWER_CHARS


def _clip(paragraphs: list[str]) -> str:
    """Whole paragraphs up to MAX_ANSWER_CHARS (at least one, cut at a word if it alone is longer)."""
    out: list[str] = []
    for paragraph in paragraphs:
        if out and len("\n\n".join([*out, paragraph])) > MAX_ANSWER_CHARS:
            break
        out.append(paragraph)
    text = "\n\n".join(out)
    if len(text) > MAX_ANSWER_CHARS:
        text = text[:MAX_ANSWER_CHARS].rsplit(" ", 1)[0] + " ..."
    return text


def _first_exchange(entry: DocEntry, rng: random.Random) -> tuple[str, str]:
    name = entry.name
    if entry.kind == "module":
        question = rng.choice((f"What is the {name} module for?", f"Explain the Python module {name}."))
        return question, entry.summary
    if entry.kind == "class":
        question = rng.choice((f"What is {name}?", f"What is the class {name} used for?"))
        return question, entry.summary
    if entry.signature and rng.random() < 0.3:
        return f"How do I call {name}?", f"Call it as `{name}{entry.signature}`. {entry.summary}"
    question = rng.choice((f"What does {name} do?", f"Explain {name}.", f"What is {name} for?"))
    return question, entry.summary


def build_conversation(entry: DocEntry, rng: random.Random, conversation_id: str) -> dict:
    """One ShareGPT conversation about ``entry``; every human turn names the entry.

    Some get a system prompt, and those whose docstring says more than its summary a second turn.
    """
    turns = []
    if rng.random() < SYSTEM_PROMPT_RATE:
        turns.append({"from": "system", "value": rng.choice(SYSTEM_PROMPTS)})
    question, answer = _first_exchange(entry, rng)
    turns += [{"from": "human", "value": question}, {"from": "gpt", "value": answer}]
    rest = entry.paragraphs[1:]
    if rest and rng.random() < MULTI_TURN_RATE:
        turns += [
            {"from": "human", "value": f"Tell me more about {entry.name}."},
            {"from": "gpt", "value": _clip(rest)},
        ]
    return {"id": conversation_id, "conversations": turns}


def sharegpt_to_messages(conversation: dict) -> list[dict]:
    """A ShareGPT record's turns as chat-template messages (``role``/``content``)."""
    try:
        return [{"role": ROLE_OF[turn["from"]], "content": turn["value"]} for turn in conversation["conversations"]]
    except KeyError as exc:
        raise ValueError(
            f"conversation {conversation.get('id')!r}: unknown speaker or missing field {exc}; "
            f"turns need 'from' (one of {sorted(ROLE_OF)}) and 'value'"
        ) from None


def demo_conversations(
    num_samples: int, held_out_fraction: float, seed: int, entries: list[DocEntry] | None = None
) -> tuple[list[dict], list[dict]]:
    """(training, held-out) conversations: ``num_samples`` and ``ceil(num_samples * held_out_fraction)``.

    Subjects are drawn without replacement from the shuffled documented objects, so the two
    splits never talk about the same object.
    """
    if num_samples < 1 or not 0 <= held_out_fraction < 1:
        raise ValueError(
            f"need num_samples >= 1 and 0 <= held_out_fraction < 1, got {num_samples} and {held_out_fraction}"
        )
    subjects = [entry for entry in (entries if entries is not None else extract_entries()) if is_demo_subject(entry)]
    num_held_out = math.ceil(num_samples * held_out_fraction)
    if num_samples + num_held_out > len(subjects):
        raise ValueError(
            f"asked for {num_samples} + {num_held_out} held-out conversations, but this Python's standard "
            f"library documents only {len(subjects)} usable objects; lower --num-samples"
        )
    rng = random.Random(seed)
    rng.shuffle(subjects)
    held_out_subjects, train_subjects = subjects[:num_held_out], subjects[num_held_out : num_held_out + num_samples]
    train = [build_conversation(entry, rng, f"demo-{i:05d}") for i, entry in enumerate(train_subjects)]
    held_out = [build_conversation(entry, rng, f"demo-heldout-{i:05d}") for i, entry in enumerate(held_out_subjects)]
    return train, held_out


def write_jsonl(path: Path, records: list[dict]) -> None:
    """Write one JSON object per line, atomically (temp file in the same folder, then rename)."""
    lines = (json.dumps(record, ensure_ascii=False, sort_keys=True) + "\n" for record in records)
    atomic_write_text(path, "".join(lines))


def default_held_out_path(output: Path) -> Path:
    """``<dir>/<stem>.heldout.jsonl`` beside the training file."""
    return output.with_name(f"{output.stem}.heldout.jsonl")


def write_demo_dataset(
    output: Path,
    held_out_output: Path | None = None,
    *,
    num_samples: int = 400,
    held_out_fraction: float = 0.1,
    seed: int = 0,
) -> tuple[Path, Path]:
    """Write the training and held-out demo conversations; return both paths."""
    output = Path(output)
    held_out_output = Path(held_out_output) if held_out_output else default_held_out_path(output)
    if output.resolve() == held_out_output.resolve():
        raise ValueError(f"the training and held-out files must differ, both are {output}")
    train, held_out = demo_conversations(num_samples, held_out_fraction, seed)
    write_jsonl(output, train)
    write_jsonl(held_out_output, held_out)
    return output, held_out_output


def configure_parser(parser: argparse.ArgumentParser) -> None:
    """Options of ``eagle3-pipeline demo-dataset``."""
    parser.add_argument("--output", type=path_arg, required=True, metavar="FILE", help="training conversations (JSONL)")
    parser.add_argument(
        "--held-out-output", type=path_arg,
            metavar="FILE", help="held-out conversations (default: <stem>.heldout.jsonl)"
    )
    parser.add_argument("--num-samples", type=int, default=400, help="training conversations (default: 400)")
    parser.add_argument(
        "--held-out-fraction",
        type=float,
        default=0.1,
        help="held-out conversations, as a fraction of --num-samples (default: 0.1)",
    )
    parser.add_argument("--seed", type=int, default=0)


def run(args: argparse.Namespace) -> int:
    """Write the files and print their paths, training first."""
    try:
        paths = write_demo_dataset(
            args.output,
            args.held_out_output,
            num_samples=args.num_samples,
            held_out_fraction=args.held_out_fraction,
            seed=args.seed,
        )
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for path in paths:
        print(path)
    return 0
