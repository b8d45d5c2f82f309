"""The regenerated dataset on disk: the settings lock, each part's conversations and summary, the merge.

Layout of an output directory ``D``::

    D/regeneration-settings.json       what shapes the answers (model, tokenizer, template, sampling,
                                       limits); written by the first run, every later run and host must match
    D/parts/part-K-of-N.journal.jsonl  one line per conversation finished by part K of N (regenerated,
                                       or left out with its reason): the resume point
    D/parts/part-K-of-N.progress.json  progress of the running part (for the role and the terminal)
    D/parts/part-K-of-N.jsonl          the part's regenerated conversations, written when the part is done
    D/parts/part-K-of-N.json           the part's summary (counts, the records left out, the ordinals)
    D/regenerated.jsonl                every part's conversations in the dataset's record order
    D/regeneration.json                the summary: counts, turns, tokens, finish reasons, settings

The conversations are written in the OpenAI form the extraction reads, one JSON object a line:
``{"id": ..., "messages": [{"role": "system"|"user"|"assistant", "content": ...}, ...]}``, the
record's id kept (a record without one gets the id the reader gives it: ``line-<N>``, its line
in the input, or ``record-<N>`` in a JSON array). Every file appears whole or not at all
(written beside, then renamed), and a file already holding the same bytes is left alone, so a
rerun over a finished regeneration changes nothing.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

from eagle3_pipeline.checksum import file_sha256
from eagle3_pipeline.parts.files import PARTS_DIR, part_path, write_if_changed

FORMAT = "eagle3-pipeline/regenerated-conversations"
SETTINGS_FILE = "regeneration-settings.json"
OUTPUT_FILE = "regenerated.jsonl"
SUMMARY_FILE = "regeneration.json"
COUNTS = ("turns", "turns_left_out", "leading_dropped", "prompt_tokens", "generated_tokens", "truncated_kept")


class OutputError(ValueError):
    """The output directory cannot be merged as it is; the message says why and what to do."""


def conversation_line(sample_id: str, messages: list[dict]) -> str:
    """One output line (no newline): the record in the OpenAI ``messages`` form."""
    # Keys in one order however the record was read (the journal stores its records with sorted keys).
    turns = [{"role": message["role"], "content": message["content"]} for message in messages]
    return json.dumps({"id": sample_id, "messages": turns}, ensure_ascii=False, separators=(",", ":"))


def part_documents(index: int, count: int, records: int, finished: list[dict], reader_skips: list[dict],
                   dataset: dict) -> tuple[str, str]:
    """(the part's JSONL text, its summary JSON text) from its journal records (one per conversation,
    any order) and the records the reader skipped."""
    ordered = sorted(finished, key=lambda r: r["ordinal"])
    written = [r for r in ordered if r["status"] == "ok"]
    left_out = [{key: r[key] for key in ("line", "id", "reason", "detail")} for r in ordered if r["status"] != "ok"]
    skipped = sorted([*reader_skips, *left_out], key=lambda s: s["line"])
    summary = {
        "part": f"{index}/{count}",
        "dataset": dataset,
        "num_records": records,
        "num_conversations": len(written),
        "num_skipped": len(skipped),
        **{key: sum(r.get(key, 0) for r in written) for key in COUNTS},  # get: journals of earlier versions
        "finish_reasons": dict(sorted(sum((Counter(r["finish"]) for r in written), Counter()).items())),
        "cut": sum(1 for r in written if r["cut"]),
        "limited": sum(1 for r in written if r["limited"]),
        "engines": dict(sorted(Counter(r["engine"] for r in written).items())),
        "skipped": skipped,
        "ordinals": [r["ordinal"] for r in written],
        **({"sources": dict(sorted(Counter(r["source"] for r in written if "source" in r).items()))}
           if any("source" in r for r in written) else {}),
    }
    text = "".join(conversation_line(r["id"], r["messages"]) + "\n" for r in written)
    return text, json.dumps(summary, indent=1, sort_keys=True) + "\n"


def write_part(out_dir: Path, index: int, count: int, texts: tuple[str, str]) -> bool:
    """Write the part's conversations, then its summary (the summary marks the part done); True when written."""

    changed = write_if_changed(part_path(out_dir, index, count, ".jsonl"), texts[0])
    return write_if_changed(part_path(out_dir, index, count, ".json"), texts[1]) or changed


def part_is_written(out_dir: Path, index: int, count: int, texts: tuple[str, str]) -> bool:
    """Whether the part's files hold exactly ``texts``."""
    try:
        return (part_path(out_dir, index, count, ".jsonl").read_text(encoding="utf-8") == texts[0]
                and part_path(out_dir, index, count, ".json").read_text(encoding="utf-8") == texts[1])
    except OSError:
        return False


def _parts(out_dir: Path) -> tuple[int, dict[int, dict]]:
    parts_dir = out_dir / PARTS_DIR
    found = [p for p in sorted(parts_dir.glob("part-*-of-*.json")) if not p.name.endswith(".progress.json")]
    counts = {int(p.name.split("-of-")[1][: -len(".json")]) for p in found}
    if len(counts) != 1:
        raise OutputError(f"{parts_dir}: " + ("no part is done yet" if not counts else
                                              f"parts of different splits {sorted(counts)}")
                          + "; run the regeneration (every part) first")
    count = counts.pop()
    parts = {int(p.name.split("-")[1]): json.loads(p.read_text()) for p in found}
    missing = [k for k in range(count) if k not in parts]
    if missing:
        raise OutputError(f"{parts_dir}: parts {missing} of {count} are not done yet; wait for them, or rerun them")
    return count, parts


def merged_documents(out_dir: Path) -> tuple[str, dict]:
    """(the merged JSONL text, the summary without the output's checksum) of every done part."""
    settings = json.loads((out_dir / SETTINGS_FILE).read_text())
    count, parts = _parts(out_dir)
    lines: list[tuple[int, str]] = []
    for index in range(count):
        path = part_path(out_dir, index, count, ".jsonl")
        own = path.read_text(encoding="utf-8").split("\n")[:-1]  # not splitlines: answers may hold U+2028
        ordinals = parts[index]["ordinals"]
        if len(own) != len(ordinals):
            raise OutputError(f"{path} has {len(own)} conversations, its summary lists {len(ordinals)}: the part was "
                              "changed by hand; delete both files and rerun that part (its journal rebuilds them)")
        lines += zip(ordinals, own)
    lines.sort(key=lambda item: item[0])
    summary = {
        "format": FORMAT,
        "output": OUTPUT_FILE,
        "settings": settings,
        "dataset": parts[0]["dataset"],
        "parts": count,
        **{key: sum(part[key] for part in parts.values())
           for key in ("num_records", "num_conversations", "num_skipped", "cut", "limited", *COUNTS)},
        "finish_reasons": dict(sorted(sum((Counter(p["finish_reasons"]) for p in parts.values()), Counter()).items())),
        "engines": dict(sorted(sum((Counter(p["engines"]) for p in parts.values()), Counter()).items())),
        **({"sources": dict(sorted(sum((Counter(p["sources"]) for p in parts.values()), Counter()).items()))}
           if any("sources" in p for p in parts.values()) else {}),
        "skipped_reasons": dict(sorted(Counter(s["reason"] for p in parts.values() for s in p["skipped"]).items())),
        "skipped": sorted((s for p in parts.values() for s in p["skipped"]), key=lambda s: s["line"]),
    }
    return "".join(text + "\n" for _, text in lines), summary


def merge(out_dir: Path) -> tuple[dict, bool]:
    """Write ``regenerated.jsonl`` and ``regeneration.json`` from the done parts; (summary, changed).

    Every part 0..N-1 of one N must be done; over unchanged parts nothing is rewritten.
    """

    if not (out_dir / SETTINGS_FILE).is_file():
        raise OutputError(f"{out_dir}: no {SETTINGS_FILE}: not a regeneration output directory (or nothing ran yet)")
    text, summary = merged_documents(out_dir)
    changed = write_if_changed(out_dir / OUTPUT_FILE, text)
    summary["sha256"] = file_sha256(out_dir / OUTPUT_FILE)
    changed = write_if_changed(out_dir / SUMMARY_FILE, json.dumps(summary, indent=1, sort_keys=True) + "\n") or changed
    return summary, changed


def is_merged(out_dir: Path) -> bool:
    """Whether ``regenerated.jsonl`` and ``regeneration.json`` hold what a merge of the parts would write."""
    try:
        text, summary = merged_documents(out_dir)
        written = (out_dir / OUTPUT_FILE).read_text(encoding="utf-8")
        recorded = json.loads((out_dir / SUMMARY_FILE).read_text())
    except (OSError, ValueError):
        return False
    return written == text and {**summary, "sha256": recorded.get("sha256")} == recorded and \
        recorded.get("sha256") == file_sha256(out_dir / OUTPUT_FILE)
