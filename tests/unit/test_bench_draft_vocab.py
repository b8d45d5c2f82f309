"""bench/draft_vocab.py on the CPU with the tiny model: the shares it prints are the ones its own answers give."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

from tiny_target import built_tiny_model

from eagle3_pipeline.conversations.template import ChatRenderer
from eagle3_pipeline.data.demo_dataset import demo_conversations, write_jsonl

ROOT = Path(__file__).resolve().parents[2]


def test_greedy_tokens_outside_each_draft_vocabulary(tmp_path):
    from transformers import AutoTokenizer  # noqa: PLC0415

    model = built_tiny_model()
    records, _ = demo_conversations(14, 0.0, 0)
    dataset = tmp_path / "demo.jsonl"
    write_jsonl(dataset, records)
    out = tmp_path / "vocab.json"
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "draft_vocab.py"), "--model-path", str(model), "--dataset", str(dataset),
         "--records", "4", "10", "--draft-sizes", "64", "512", "4096", "--heldout", "3", "--new-tokens", "12",
         "--batch", "2", "--json", str(out)],
        capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["heldout_prompts"] == 3 and len(result["answers"]) == 3
    drafted = [t for answer in result["answers"] for t in answer[1:]]
    assert result["drafted_tokens"] == len(drafted) > 0
    # The vocabularies recounted here from the first N records' assistant tokens, as the training counts them.
    renderer = ChatRenderer(AutoTokenizer.from_pretrained(model))
    for records in (4, 10):
        counts = Counter()
        for record in records_of(records, dataset):
            ids, mask = renderer.render(record)
            counts.update(t for t, m in zip(ids, mask) if m)
        for size in (64, 512, 4096):
            ranked = sorted(range(result["vocab_size"]), key=lambda t: (-counts[t], t))[:size]
            outside = sum(t not in set(ranked) for t in drafted) / len(drafted)
            row = result["by_records"][str(records)][str(size)]
            assert abs(row["greedy_outside"] - outside) < 1e-9, (records, size, row, outside)
            assert f"records {records:>6}, draft vocabulary {size:>6}" in done.stdout
    # The whole vocabulary drafts every token; a vocabulary of 64 tokens cannot draft all of them.
    assert result["by_records"]["10"]["4096"]["greedy_outside"] == 0.0
    assert result["by_records"]["10"]["64"]["greedy_outside"] > 0.0


def records_of(count: int, dataset: Path):
    from eagle3_pipeline.conversations.dataset import Sample, read_dataset  # noqa: PLC0415

    return [r.messages for r in read_dataset(dataset, count) if isinstance(r, Sample)]
