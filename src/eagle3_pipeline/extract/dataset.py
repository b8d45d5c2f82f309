"""Reading a conversation dataset (JSONL) into samples, or skips that say what is wrong and where.

Datasets come from the field: ShareGPT dumps (``conversations`` of ``{from, value}``, sometimes
``{role, content}``) and OpenAI-style ``messages``, scraped, converted and concatenated by
hand. They hold broken lines, image parts, tool turns, empty and assistant-less records, the
same id twice, and bytes that are not UTF-8. A run of hours must neither die on line 81,233
nor silently train on garbage, so every record becomes exactly one of:

- a :class:`Sample`: messages normalised to ``system``/``user``/``assistant`` with text
  content, ready for the chat template; or
- a :class:`Skip`: a short reason code (for counting and for the manifest), the 1-based line
  number, and a sentence for the operator naming the field and the fix.

The job decides, from the share of skips, whether to go on (``--max-skip-ratio``).

The file is read line by line as bytes and decoded strictly, so one bad byte costs one line
(named by its number) and a dataset larger than memory is fine. Records are numbered by
``ordinal`` (0-based among the non-blank lines): that number places a sample in its shard and
in a host's share, so it must not depend on which records were skipped.

Sample files are named after the sample id, so an id is used as a file name stem only when it
is plainly safe (no ``/``, no ``..``, no leading dot, not a ``.tmp`` name); any other id gets a
stem derived from its hash. Two records whose ids, or whose stems, are equal would overwrite
each other's file: the later one is skipped.
"""

from __future__ import annotations

import codecs
import hashlib
import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass

SAFE_STEM = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")

# Speaker names of the ShareGPT variants in the wild, and OpenAI's roles, to the three roles
# every chat template knows. "developer" is OpenAI's newer name for the system role.
ROLES = {
    "system": "system",
    "developer": "system",
    "user": "user",
    "human": "user",
    "assistant": "assistant",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "model": "assistant",
}

# vLLM joins the text parts of a message with a newline before applying the chat template;
# doing the same here trains the drafter on the tokens the served model actually sees.
TEXT_PART_SEPARATOR = "\n"


@dataclass(frozen=True)
class Sample:
    """One usable conversation of the dataset."""

    ordinal: int  # 0-based index of the record among the file's non-blank lines
    line: int  # 1-based line number in the file
    sample_id: str  # the record's id (str, or int as str), else "line-<line>"
    file_stem: str  # safe file name stem: the id itself, or "id-<sha256(id)[:16]>"
    messages: tuple  # ({"role": "system"|"user"|"assistant", "content": str}, ...)


@dataclass(frozen=True)
class Skip:
    """One record left out, with the reason (a short code) and a sentence saying why."""

    ordinal: int
    line: int
    sample_id: str | None  # None where the record could not be read far enough to know it
    reason: str
    detail: str


class _Bad(Exception):
    """A record is unusable: ``reason`` code and ``detail`` sentence, raised while normalising it."""

    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason = reason
        self.detail = detail


def file_stem_for(sample_id: str) -> str:
    """The file name stem of a sample: its id when that is a plainly safe name, else a hash of the id."""
    if SAFE_STEM.fullmatch(sample_id) and not sample_id.endswith(".tmp"):
        return sample_id
    return "id-" + hashlib.sha256(sample_id.encode("utf-8", "surrogatepass")).hexdigest()[:16]


def _sample_id(record: dict, line: int) -> str:
    value = record.get("id")
    if isinstance(value, str) and value:
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    return f"line-{line}"


def _type_name(value) -> str:
    if value is None:
        return "null"
    return {dict: "an object", list: "an array", str: "a string", bool: "a boolean"}.get(type(value), "a number")


def _text_of(content, where: str, content_key: str) -> str:
    """A turn's content as one string: a string, or the text parts of a list joined."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for k, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text" or not isinstance(part.get("text"), str):
                what = f"of type {kind!r}" if kind else _type_name(part)
                raise _Bad(
                    "non_text_content",
                    f"{where}: '{content_key}' part {k} is {what}; only text parts "
                    '({"type": "text", "text": "..."}) can be extracted, so drop this record or its other parts',
                )
            texts.append(part["text"])
        return TEXT_PART_SEPARATOR.join(texts)
    raise _Bad(
        "non_text_content",
        f"{where}: '{content_key}' is {_type_name(content)}; it must be a string or a list of text parts",
    )


def _normalise_turn(turn, where: str) -> dict:
    if not isinstance(turn, dict):
        raise _Bad("not_an_object", f"{where} is {_type_name(turn)}; each turn must be an object")
    # ShareGPT's keys, or OpenAI's: some ShareGPT files use role/content inside "conversations".
    role_key, content_key = ("from", "value") if "from" in turn else ("role", "content")
    if role_key not in turn:
        raise _Bad("unknown_role", f"{where} has neither 'from' nor 'role': every turn needs its speaker")
    role = turn[role_key]
    if not isinstance(role, str) or role.lower() not in ROLES:
        shown = repr(role) if isinstance(role, str) else _type_name(role)
        raise _Bad(
            "unknown_role",
            f"{where}: '{role_key}' is {shown}; expected one of {', '.join(sorted(ROLES))} "
            "(tool and function turns cannot be extracted: drop the record or those turns)",
        )
    if content_key not in turn:
        raise _Bad("non_text_content", f"{where} has no '{content_key}': every turn needs its text")
    content = _text_of(turn[content_key], where, content_key)
    try:
        content.encode("utf-8")
    except UnicodeEncodeError as exc:
        # JSON can spell a lone surrogate (\ud800) that no UTF-8 text, and no tokenizer, can hold.
        raise _Bad(
            "undecodable_bytes",
            f"{where}: '{content_key}' holds an unpaired surrogate escape (\\u{ord(content[exc.start]):04x}) "
            f"at character {exc.start}, which is not a character; fix the text's encoding",
        ) from None
    return {"role": ROLES[role.lower()], "content": content}


def _messages(record: dict) -> tuple:
    """The record's turns as normalised messages; raises _Bad with the reason when unusable."""
    key = "conversations" if "conversations" in record else "messages" if "messages" in record else None
    if key is None:
        fields = ", ".join(repr(name) for name in list(record)[:8]) or "none"
        raise _Bad("no_turns", f"no 'conversations' or 'messages' field (fields: {fields})")
    turns = record[key]
    if not isinstance(turns, list):
        raise _Bad("no_turns", f"'{key}' is {_type_name(turns)}; it must be a list of turns")
    if not turns:
        raise _Bad("empty_conversation", f"'{key}' is an empty list")
    messages = tuple(_normalise_turn(turn, f"'{key}' turn {k}") for k, turn in enumerate(turns))
    if not any(message["content"].strip() for message in messages):
        raise _Bad("empty_conversation", f"every turn of '{key}' has empty text")
    if not any(message["role"] == "assistant" for message in messages):
        raise _Bad(
            "no_assistant_turn",
            f"'{key}' has no assistant turn (gpt/assistant): there is nothing for the drafter to learn",
        )
    return messages


def _records(path: str | os.PathLike) -> Iterator[tuple[int, bytes]]:
    """(line number, bytes) of each non-blank line, a UTF-8 BOM at the start of the file removed."""
    with open(path, "rb") as stream:
        for line, raw in enumerate(stream, 1):
            data = raw[len(codecs.BOM_UTF8) :] if line == 1 and raw.startswith(codecs.BOM_UTF8) else raw
            if data.strip():
                yield line, data


def _read(path, num_samples: int | None) -> Iterator[Sample | Skip]:
    first_line_of_id: dict[str, int] = {}
    first_of_stem: dict[str, tuple[int, str]] = {}
    for ordinal, (line, raw) in enumerate(_records(path)):
        if num_samples is not None and ordinal >= num_samples:
            return
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            yield Skip(
                ordinal,
                line,
                None,
                "undecodable_bytes",
                f"byte 0x{raw[exc.start]:02x} at byte {exc.start + 1} of the line is not UTF-8; "
                "re-encode the file as UTF-8 (e.g. iconv -f <encoding> -t UTF-8)",
            )
            continue
        try:
            record = json.loads(text)
        except json.JSONDecodeError as exc:
            where = f"column {exc.colno}" if exc.lineno == 1 else "the end of the line"
            yield Skip(
                ordinal,
                line,
                None,
                "malformed_json",
                f"not valid JSON: {exc.msg} at {where}; each line must be one object",
            )
            continue
        except RecursionError:
            yield Skip(
                ordinal, line, None, "malformed_json", "JSON nested too deeply to read; each line must be one object"
            )
            continue
        if not isinstance(record, dict):
            yield Skip(
                ordinal, line, None, "not_an_object", f"the line is {_type_name(record)}; each line must be one object"
            )
            continue
        sample_id = _sample_id(record, line)
        try:
            messages = _messages(record)
        except _Bad as bad:
            yield Skip(ordinal, line, sample_id, bad.reason, bad.detail)
            continue
        stem = file_stem_for(sample_id)
        if sample_id in first_line_of_id:
            yield Skip(
                ordinal,
                line,
                sample_id,
                "duplicate_id",
                f"'id' {sample_id!r} was already used on line {first_line_of_id[sample_id]}; "
                "ids name the sample files, so each must be unique",
            )
            continue
        if stem in first_of_stem:
            other_line, other_id = first_of_stem[stem]
            yield Skip(
                ordinal,
                line,
                sample_id,
                "duplicate_id",
                f"'id' {sample_id!r} gets the file name {stem!r}, as 'id' {other_id!r} on line {other_line} does; "
                "ids name the sample files, so give one of them another id",
            )
            continue
        first_line_of_id[sample_id] = line
        first_of_stem[stem] = (line, sample_id)
        yield Sample(ordinal, line, sample_id, stem, messages)


def read_dataset(path: str | os.PathLike, num_samples: int | None = None) -> Iterator[Sample | Skip]:
    """Each record of the JSONL file at ``path``, in file order, as a Sample or a Skip.

    ``num_samples`` keeps the first N records (non-blank lines, skipped ones included); the rest
    of the file is not read. Raises ValueError for a negative ``num_samples`` at once, and
    OSError (FileNotFoundError, ...) when the file cannot be opened, at the first record.
    """
    if num_samples is not None and (isinstance(num_samples, bool) or not isinstance(num_samples, int)):
        raise TypeError(f"num_samples must be an int or None, got {num_samples!r}")
    if num_samples is not None and num_samples < 0:
        raise ValueError(f"num_samples must be >= 0 (or None for the whole file), got {num_samples}")
    return _read(path, num_samples)
