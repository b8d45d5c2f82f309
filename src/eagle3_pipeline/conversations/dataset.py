"""Reading a conversation dataset (JSON Lines or a JSON array) into samples, or skips that say what is wrong and where.

Datasets come from the field: ShareGPT dumps (``conversations`` of ``{from, value}``, sometimes
``{role, content}``) and OpenAI-style ``messages``, scraped, converted and concatenated by
hand. They hold broken lines, image parts, tool turns, empty and assistant-less records, the
same id twice, and bytes that are not UTF-8. A run of hours must neither die on line 81,233
nor silently train on garbage, so every record becomes exactly one of:

- a :class:`Sample`: messages normalised to ``system``/``user``/``assistant`` with text
  content, ready for the chat template; or
- a :class:`Skip`: a short reason code (for counting and for the manifest), the 1-based line
  number and byte offset, and a sentence for the operator naming the field and the fix.

The job decides, from the share of skips, whether to go on (``--max-skip-ratio``).

Tables are read too, through pyarrow (the ``parquet`` extra): Parquet files (``*.parquet``, as
dataset hubs publish them, one row group at a time) and Arrow files (``*.arrow``, as Hugging
Face's ``save_to_disk`` writes them, one record batch at a time), a row a record, with the
same fields. A row group that cannot be read is one skip per row (its rows keep their
ordinals); a file whose footer is gone (cut short by a download) is an error naming it. A
folder is read as one dataset: a ``save_to_disk`` folder in the order of its ``state.json``,
any other folder as its ``.parquet``, ``.arrow``, ``.jsonl`` and ``.json`` files in name order
(``train-00000-of-00004.parquet``, ...), the ordinals running on from file to file.

Two text layouts are read, told apart by the content, not the file name: a file whose first
non-blank byte is ``[`` is one JSON array of records (how ShareGPT is distributed, often
pretty-printed and often cut off inside its last record by a size limit); any other file is
JSON Lines, one record per line.

JSON Lines are read line by line as bytes and decoded strictly, so one bad byte costs one line
(named by its number). An array is streamed: read in chunks, decoded incrementally, and decoded
one element at a time with ``json.JSONDecoder.raw_decode``, so memory is bounded by the largest
record, never the file. Bytes that are not UTF-8 are carried through the decoder as surrogate
escapes and cost the one record they sit in. A malformed element is skipped, and reading goes
on at the next element when its end can be found from the brackets and quotes and the element
after it reads as an object; otherwise one skip covers the rest of the file. A file cut off
inside its last record (or before the closing ``]``) and bytes after the ``]`` are one skip
each; every record before them is kept.

Records are numbered by ``ordinal`` (0-based among the non-blank lines, or among the array's
elements): that number places a sample in its shard and in a host's share, so it must not
depend on which records were skipped. The same records as JSON Lines or as an array get the
same ordinals and messages, and the same ids where they have their own.

Sample files are named after the sample id, so an id is used as a file name stem only when it
is plainly safe (no ``/``, no ``..``, no leading dot, not a ``.tmp`` name); any other id gets a
stem derived from its hash. A record without an id gets one made from where it is (``line-N`` in
JSON Lines, ``record-N`` with its ordinal in an array; ``Sample.id_generated`` says so). Two
records whose ids, or whose stems, are equal would overwrite each other's file: the later one
is skipped.
"""

from __future__ import annotations

import codecs
import hashlib
import itertools
import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

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

    ordinal: int  # 0-based index of the record among the file's non-blank lines, or the array's elements
    line: int  # 1-based line number in the file where the record starts
    sample_id: str  # the record's id (str, or int as str), else one made from its place (see id_generated)
    file_stem: str  # safe file name stem: the id itself, or "id-<sha256(id)[:16]>"
    messages: tuple  # ({"role": "system"|"user"|"assistant", "content": str}, ...)
    offset: int | None = None  # byte offset in the file where the record starts
    id_generated: bool = False  # the record had no usable id: sample_id is "line-<line>" or "record-<ordinal>"
    source: str | None = None  # in a mixture: the name of the source it came from (its id starts "<name>.")


@dataclass(frozen=True)
class Skip:
    """One record left out, with the reason (a short code) and a sentence saying why."""

    ordinal: int
    line: int
    sample_id: str | None  # None where the record could not be read far enough to know it
    reason: str
    detail: str
    offset: int | None = None  # byte offset in the file where the record (or the unreadable part) starts
    source: str | None = None  # in a mixture: the source it came from


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


def _given_id(record: dict) -> str | None:
    """The record's own id as a string, or None when it has no usable one."""
    value = record.get("id")
    if isinstance(value, str) and value:
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    return None


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


# JSON's whitespace, the only bytes allowed between the elements of an array.
JSON_WHITESPACE = b" \t\r\n"
_NOT_WHITESPACE = re.compile(r"[^ \t\r\n]")
# Outside a string: what opens, closes or separates values; inside one: its end, or an escape.
_STRUCTURE = re.compile(r'[][{}",]')
_IN_STRING = re.compile(r'["\\]')
# The "surrogateescape" decoder turns each byte that is not UTF-8 into U+DC80..U+DCFF, which no
# decoded UTF-8 text holds (an escape such as "\udc80" in the JSON is six ASCII characters).
_ESCAPED_BYTE = re.compile("[\udc80-\udcff]")
# Bytes read at a time from an array (more while one record is longer than what is held).
READ_CHUNK = 1 << 20
# A decode error this close to the end of the text read so far may be the text running out, not
# bad JSON: the decoder reports a literal cut short ("-Infinit") at its start, 9 characters back,
# and a "\u" escape with fewer than its four hex digits at its backslash, 6 characters back.
_END_SLACK = 16
_PREVIEW = 40


@dataclass(frozen=True)
class _Raw:
    """One record as read from the file: where it starts, and its object or why there is none."""

    line: int  # a table's row number (1-based) in its file
    offset: int | None
    value: dict | None = None
    reason: str | None = None
    detail: str = ""
    where: str | None = None  # a table's row: "<file> row N"


class DatasetError(ValueError):
    """The dataset cannot be read at all; the message names the file and the fix."""


def _line_record(line: int, offset: int, raw: bytes) -> _Raw:
    """One non-blank line of a JSON Lines file, decoded."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        return _Raw(
            line,
            offset,
            reason="undecodable_bytes",
            detail=f"byte 0x{raw[exc.start]:02x} at byte {exc.start + 1} of the line is not UTF-8; "
            "re-encode the file as UTF-8 (e.g. iconv -f <encoding> -t UTF-8)",
        )
    try:
        record = json.loads(text)
    except json.JSONDecodeError as exc:
        where = f"column {exc.colno}" if exc.lineno == 1 else "the end of the line"
        return _Raw(
            line,
            offset,
            reason="malformed_json",
            detail=f"not valid JSON: {exc.msg} at {where}; each line must be one object",
        )
    except RecursionError:
        return _Raw(
            line, offset, reason="malformed_json", detail="JSON nested too deeply to read; each line must be one object"
        )
    if not isinstance(record, dict):
        detail = f"the line is {_type_name(record)}; each line must be one object"
        return _Raw(line, offset, reason="not_an_object", detail=detail)
    return _Raw(line, offset, record)


def _lines(stream: BinaryIO) -> Iterator[_Raw]:
    """Each non-blank line of a JSON Lines file, a UTF-8 BOM at the start of the file removed."""
    offset = 0
    first = True
    for line, read in enumerate(stream, 1):
        raw, start, offset = read, offset, offset + len(read)
        if line == 1 and read.startswith(codecs.BOM_UTF8):
            raw, start = read[len(codecs.BOM_UTF8) :], start + len(codecs.BOM_UTF8)
        if not raw.strip():
            continue
        if first and raw.strip() == b"{":
            # No JSON Lines record is a lone "{": this is one pretty-printed object, and reading
            # its lines one by one would only add a skip per line.
            yield _Raw(
                line,
                start,
                reason="malformed_json",
                detail="the line is a lone '{': the file holds JSON objects spread over many lines, which is neither "
                "JSON Lines (one object per line) nor a JSON array of records, so nothing more is read; write the "
                "records one per line (jq -c . FILE > records.jsonl, for objects one after another) or as an array "
                "(jq .FIELD FILE > records.json, for one object holding them in a field)",
            )
            return
        first = False
        yield _line_record(line, start, raw)


class _Text:
    """The text of a binary stream, decoded chunk by chunk as it is needed, and where each place of it is.

    ``buf`` holds the text read and not yet dropped. An index into it stays valid until ``more``
    drops the text before its ``keep_from``; indices then move down by what ``more`` returns.
    """

    def __init__(self, stream: BinaryIO, offset: int):
        self._stream = stream
        self._decoder = codecs.getincrementaldecoder("utf-8")("surrogateescape")
        self.buf = ""
        self.eof = False
        # Lines and bytes are counted from the mark on, so each character is counted once.
        self._mark, self._mark_line, self._mark_offset = 0, 1, offset

    def place(self, index: int) -> tuple[int, int]:
        """(1-based line, byte offset in the file) of ``buf[index]``; ``index`` is not before the last mark."""
        line = self._mark_line + self.buf.count("\n", self._mark, index)
        if self.buf.isascii():
            size = index - self._mark
        else:
            size = len(self.buf[self._mark : index].encode("utf-8", "surrogateescape"))
        return line, self._mark_offset + size

    def mark(self, index: int) -> tuple[int, int]:
        """``place(index)``, counting on from there next time."""
        self._mark_line, self._mark_offset = self.place(index)
        self._mark = index
        return self._mark_line, self._mark_offset

    def more(self, keep_from: int) -> int:
        """Drop the text before ``keep_from`` and read on; returns how far indices moved down.

        Each read is at least as long as the text kept, so a record far longer than a chunk
        still costs time linear in its length.
        """
        if self.eof:
            return 0
        self.mark(keep_from)
        self.buf, self._mark = self.buf[keep_from:], 0
        data = self._stream.read(max(READ_CHUNK, len(self.buf)))
        self.buf += self._decoder.decode(data, final=not data)
        self.eof = not data
        return keep_from


class _ArrayRecords:
    """The elements of a file that holds one JSON array, one at a time (see the module docstring)."""

    def __init__(self, stream: BinaryIO, offset: int, size: int):
        self.text = _Text(stream, offset)
        self.size = size
        self.decoder = json.JSONDecoder()
        self.count = 0

    def __iter__(self) -> Iterator[_Raw]:
        for raw in self._records():
            self.count += 1
            yield raw

    def _records(self) -> Iterator[_Raw]:
        text = self.text
        index = self.blank(0) + 1  # past the "[" the layout was told by
        after_element = False
        while True:
            index = self.blank(index)
            if index == len(text.buf):
                yield self.unclosed(index)
                return
            char = text.buf[index]
            if char == "]":
                yield from self.after_array(index)
                return
            if char == "," and after_element:
                index, after_element = index + 1, False
                continue
            # An element: after "[" or ",", or right after the previous one where a comma is
            # missing (the records are whole either way).
            line, offset = text.mark(index)
            index, value, end, error = self.decode(index)
            if error is None:
                yield self.element(line, offset, value, index, end)
                index, after_element = end, True
                continue
            if text.eof and self.runs_out(error):
                yield self.truncated(line, offset)
                return
            index = yield from self.skip_bad(line, offset, index, error)
            if index is None:
                return
            after_element = True

    def blank(self, index: int) -> int:
        """Index of the first character at or after ``index`` that is not blank; ``len(buf)`` at the file's end."""
        text = self.text
        while True:
            found = _NOT_WHITESPACE.search(text.buf, index)
            if found:
                return found.start()
            if text.eof:
                return len(text.buf)
            text.more(len(text.buf))
            index = 0

    def decode(self, index: int) -> tuple[int, object, int, Exception | None]:
        """(start, value, end, None) of the JSON value at ``index``, or (start, None, 0, error) when it is not one.

        While the text runs out inside the value, more is read (``start`` is the value's index
        after that). A value that is a number or a literal may go on in the next chunk, so it is
        read again once more text is there.
        """
        text = self.text
        while True:
            buf = text.buf
            try:
                value, end = self.decoder.raw_decode(buf, index)
            except json.JSONDecodeError as exc:
                if not text.eof and (exc.pos >= len(buf) - _END_SLACK or exc.msg.startswith("Unterminated string")):
                    index -= text.more(index)
                    continue
                return index, None, 0, exc
            except RecursionError as exc:
                return index, None, 0, exc
            if not text.eof and end >= len(buf) - _END_SLACK and not isinstance(value, (dict, list, str)):
                index -= text.more(index)
                continue
            return index, value, end, None

    def runs_out(self, error: Exception) -> bool:
        """Whether a decode error at the end of the file is the file ending inside the value (a cut), not bad JSON."""
        if not isinstance(error, json.JSONDecodeError):
            return False
        if error.msg.startswith("Unterminated string"):
            return True
        buf = self.text.buf
        # Only a token cut short may stand between the error and the end: nothing that closes or separates.
        return len(buf) - error.pos <= _END_SLACK and not _STRUCTURE.search(buf, error.pos)

    def element(self, line: int, offset: int, value, start: int, end: int) -> _Raw:
        """The element decoded from ``buf[start:end]``: a record, or a skip when it holds bytes that are not
        UTF-8 or is not an object."""
        escaped = _ESCAPED_BYTE.search(self.text.buf, start, end)
        if escaped:
            detail = self.undecodable(escaped.group(), *self.text.place(escaped.start()))
            return _Raw(line, offset, reason="undecodable_bytes", detail=detail)
        if not isinstance(value, dict):
            return _Raw(
                line,
                offset,
                reason="not_an_object",
                detail=f"the record at byte {offset} is {_type_name(value)}; each element of the array must be one "
                "object",
            )
        return _Raw(line, offset, value)

    @staticmethod
    def undecodable(char: str, line: int, offset: int) -> str:
        """The sentence for a byte that is not UTF-8, from its surrogate escape and its place."""
        return (
            f"byte 0x{ord(char) - 0xDC00:02x} at byte {offset} (line {line}) is not UTF-8; "
            "re-encode the file as UTF-8 (e.g. iconv -f <encoding> -t UTF-8)"
        )

    def skip_bad(self, line: int, offset: int, index: int, error: Exception):
        """Yield the skip(s) for the unreadable element at ``index``; return where reading goes on, None to stop.

        The element's end is found from its brackets and quotes alone. Reading goes on after it
        only when the next element decodes as an object: a stray quote turns strings and
        structure inside out, and then no bracket can be trusted, so one skip covers the rest.
        """
        text = self.text
        if isinstance(error, json.JSONDecodeError):
            bad_line, bad_offset = text.place(error.pos)
            if error.pos < len(text.buf) and _ESCAPED_BYTE.match(text.buf, error.pos):
                reason, what = "undecodable_bytes", self.undecodable(text.buf[error.pos], bad_line, bad_offset)
            else:
                reason, what = "malformed_json", f"not valid JSON: {error.msg} at line {bad_line}, byte {bad_offset}"
        else:
            reason, what = "malformed_json", f"the record at byte {offset} is JSON nested too deeply to read"
        end, quoted = self.element_end(index)
        if end is None:
            yield self.rest(line, offset, reason, what)
            return None
        _, end_offset = text.mark(end)
        skip = _Raw(
            line,
            offset,
            reason=reason,
            detail=f"{what}; the record from byte {offset} to byte {end_offset} is left out and reading goes on "
            "after it: fix or remove it",
        )
        if not quoted:
            # No quote, so no string whose end could be misread: its end is certain.
            yield skip
            return end
        following = end if text.buf[end] == "]" else self.blank(end + 1)
        if following == len(text.buf) or text.buf[following] == "]":
            yield skip
            return following
        next_line, next_offset = text.mark(following)
        following, value, next_end, next_error = self.decode(following)
        if next_error is None and isinstance(value, dict):
            yield skip
            yield self.element(next_line, next_offset, value, following, next_end)
            return next_end
        if next_error is not None and text.eof and self.runs_out(next_error):
            yield skip
            yield self.truncated(next_line, next_offset)
            return None
        yield self.rest(line, offset, reason, what)
        return None

    def element_end(self, index: int) -> tuple[int | None, bool]:
        """(index of the "," or "]" that ends the element starting at ``index``, whether it holds a quote), from its
        brackets and quotes alone; the index is None when the file ends first or a bracket closes what the element
        never opened."""
        text = self.text
        depth, in_string, quoted = 0, False, False
        while True:
            buf = text.buf
            found = (_IN_STRING if in_string else _STRUCTURE).search(buf, index)
            if found is None or (found.group() == "\\" and found.end() == len(buf)):
                if text.eof:
                    return None, quoted
                keep = found.start() if found else len(buf)
                index = keep - text.more(keep)
                continue
            char, index = found.group(), found.end()
            if in_string:
                if char == "\\":
                    index += 1  # the escaped character, whatever it is
                else:
                    in_string = False
            elif char == '"':
                in_string = quoted = True
            elif char in "[{":
                depth += 1
            elif char == ",":
                if depth == 0:
                    return found.start(), quoted
            elif char == "]" and depth == 0:
                return found.start(), quoted
            else:
                depth -= 1
                if depth < 0:
                    return None, quoted

    def rest(self, line: int, offset: int, reason: str, what: str) -> _Raw:
        return _Raw(
            line,
            offset,
            reason=reason,
            detail=f"{what}; where the next record starts cannot be told safely from there, so the rest of the file, "
            f"{self.size - offset} bytes from byte {offset} on, is left out (the records before are kept): fix the "
            "JSON there (python -m json.tool FILE names the first error)",
        )

    def truncated(self, line: int, offset: int) -> _Raw:
        return _Raw(
            line,
            offset,
            reason="truncated",
            detail=f"the file ends inside the record that starts at byte {offset}, {self.size - offset} bytes into it: "
            "the file was cut off (the records before it are kept, this one is left out); use a complete copy of "
            f"the file, or, to keep it as it is without this skip, cut it at byte {offset} (head -c {offset}), "
            "remove the last ',' and close the array with ']'",
        )

    def unclosed(self, index: int) -> _Raw:
        line, offset = self.text.mark(index)
        return _Raw(
            line,
            offset,
            reason="truncated",
            detail=f"the file ends at byte {offset} without the ']' that closes the array, after {self.count} "
            "records: it was cut off, and any records after the cut are missing; use a complete copy of the file "
            "(or, when nothing is missing, end it with ']')",
        )

    def after_array(self, index: int) -> Iterator[_Raw]:
        """Nothing, or one skip for what follows the array's closing "]" (which is not read)."""
        text = self.text
        close_line, close_offset = text.mark(index)
        after = self.blank(index + 1)
        if after == len(text.buf):
            return
        line, offset = text.mark(after)
        yield _Raw(
            line,
            offset,
            reason="trailing_data",
            detail=f"the array closes at line {close_line}, byte {close_offset}, but {self.size - offset} more bytes "
            f"follow from byte {offset} ({text.buf[after : after + _PREVIEW]!r}...), which are not read: a file holds "
            "one JSON array of records (or JSON Lines); remove what follows the ']', or move its records into the "
            "array or into a file of their own",
        )


def _layout(stream: BinaryIO) -> tuple[str, int]:
    """("array" or "lines", the length of a leading UTF-8 BOM) of an open file, told by its first non-blank byte."""
    bom = len(codecs.BOM_UTF8) if stream.read(len(codecs.BOM_UTF8)) == codecs.BOM_UTF8 else 0
    stream.seek(bom)
    while chunk := stream.read(READ_CHUNK):
        chunk = chunk.lstrip(JSON_WHITESPACE)
        if chunk:
            return ("array" if chunk.startswith(b"[") else "lines"), bom
    return "lines", bom


TABLE_SUFFIXES = (".parquet", ".arrow")
TEXT_SUFFIXES = (".jsonl", ".json")


def dataset_files(path: str | os.PathLike) -> list[Path]:
    """The files of the dataset at ``path``, in reading order: the file itself, or a folder's files."""
    root = Path(path)
    if not root.is_dir():
        return [root]
    state = root / "state.json"
    if state.is_file():  # datasets.save_to_disk: its Arrow files, in its order
        try:
            files = [root / entry["filename"] for entry in json.loads(state.read_text())["_data_files"]]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise DatasetError(f"{state}: not a Hugging Face dataset state ({exc}); save the dataset again") from None
    elif (root / "dataset_dict.json").is_file():
        splits = ", ".join(sorted(p.name for p in root.iterdir() if p.is_dir()))
        raise DatasetError(f"{root} holds a dataset with splits ({splits}): point at one split's folder, e.g. "
                           f"{root}/train")
    else:
        files = sorted(p for p in root.iterdir() if p.suffix in TABLE_SUFFIXES + TEXT_SUFFIXES and p.is_file())
    if not files:
        raise DatasetError(f"{root}: no dataset files there (.parquet, .arrow, .jsonl, .json, or a Hugging Face "
                           "dataset folder with state.json); point at the file, or at the folder that holds them")
    return files


def dataset_facts(path) -> dict:
    """What the manifests record of the dataset read: its name and checksum (a folder: each file's; a
    mixture: each source's, with its name and its count or weight)."""
    from eagle3_pipeline.checksum import file_sha256  # noqa: PLC0415

    if isinstance(path, (list, tuple)):
        return {"name": "+".join(s.name for s in path),
                "sources": [{**dataset_facts(s.path), "source": s.name, "path": str(s.path),
                             **({"count": s.count} if s.count is not None else {}),
                             **({"weight": s.weight} if s.weight is not None else {})} for s in path]}
    root = Path(path)
    if not root.is_dir():
        return {"name": root.name, "sha256": file_sha256(root)}
    return {"name": root.name, "files": [{"name": f.name, "sha256": file_sha256(f)} for f in dataset_files(root)]}


def _pyarrow():
    try:
        import pyarrow  # noqa: PLC0415
        import pyarrow.parquet  # noqa: F401, PLC0415
    except ImportError:
        raise DatasetError("reading Parquet and Arrow datasets needs pyarrow: install eagle3-pipeline[parquet] "
                           "(the hosts' install has it unless eagle3_parquet is false)") from None
    return pyarrow


def _without_nulls(value):
    """A table row as the JSON record it came from: a struct column has every key of every row,
    null where a row has none (ShareGPT turns of ``from``/``value`` beside ``role``/``content``)."""
    if isinstance(value, dict):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_nulls(v) for v in value]
    return value


def _row(name: str, row: int, value) -> _Raw:
    where = f"{name} row {row}"
    if not isinstance(value, dict):
        return _Raw(row, None, None, "not_an_object", f"{where} is {_type_name(value)}", where)
    return _Raw(row, None, _without_nulls(value), where=where)


def _parquet_rows(path: Path) -> Iterator[_Raw]:
    pa = _pyarrow()
    try:
        table = pa.parquet.ParquetFile(path)
    except (pa.ArrowException, OSError) as exc:
        raise DatasetError(f"{path}: not a readable Parquet file ({exc}); a file cut short (an interrupted download) "
                           "loses its footer, which holds the schema: fetch it again") from None
    row = 0
    for group in range(table.num_row_groups):
        count = table.metadata.row_group(group).num_rows
        try:
            values = table.read_row_group(group).to_pylist()
        except (pa.ArrowException, OSError) as exc:
            for k in range(1, count + 1):
                where = f"{path.name} row {row + k}"
                yield _Raw(row + k, None, None, "unreadable_row_group",
                           f"{where}: its row group {group} cannot be read ({exc}); fetch the file again", where)
            row += count
            continue
        for value in values:
            row += 1
            yield _row(path.name, row, value)


def _arrow_rows(path: Path) -> Iterator[_Raw]:
    pa = _pyarrow()
    try:
        source = pa.memory_map(str(path))
        try:
            batches = iter(pa.ipc.open_stream(source))  # save_to_disk writes the stream format
        except pa.ArrowInvalid:
            reader = pa.ipc.open_file(source)
            batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
    except (pa.ArrowException, OSError) as exc:
        raise DatasetError(f"{path}: not a readable Arrow file ({exc}); save or fetch it again") from None
    row = 0
    while True:
        try:
            batch = next(batches)
        except StopIteration:
            return
        except (pa.ArrowException, OSError) as exc:  # cut short: the rest is one skip, as in a JSON array
            where = f"{path.name} row {row + 1}"
            yield _Raw(row + 1, None, None, "truncated",
                       f"{where} and after: the file ends inside a record batch ({exc}); every row before it is "
                       "kept: save or fetch the file again for the rest", where)
            return
        for value in batch.to_pylist():
            row += 1
            yield _row(path.name, row, value)


def _text_rows(path: Path) -> Iterator[_Raw]:
    with open(path, "rb") as stream:
        layout, bom = _layout(stream)
        if layout == "array":
            stream.seek(bom)
            yield from _ArrayRecords(stream, bom, os.fstat(stream.fileno()).st_size)
        else:
            stream.seek(0)
            yield from _lines(stream)


def _is_array(path: Path) -> bool:
    with open(path, "rb") as stream:
        return _layout(stream)[0] == "array"


def _read(path, num_samples: int | None) -> Iterator[Sample | Skip]:
    files = dataset_files(path)
    readers = {".parquet": _parquet_rows, ".arrow": _arrow_rows}
    # Ids made from the place are "record-<ordinal>" unless the dataset is one JSON Lines file ("line-<line>").
    numbered = len(files) > 1 or files[0].suffix in readers or _is_array(files[0])
    raws = itertools.chain.from_iterable(readers.get(f.suffix, _text_rows)(f) for f in files)
    yield from _checked(raws, numbered, num_samples)


def _checked(raws: Iterator[_Raw], in_array: bool, num_samples: int | None) -> Iterator[Sample | Skip]:
    """The records read, in order, as Samples or Skips: turns normalised, ids given and checked for repeats."""
    first_place_of_id: dict[str, str] = {}
    first_of_stem: dict[str, tuple[str, str]] = {}
    # islice stops before pulling the record past the limit, so the rest of the file is not read.
    for ordinal, raw in enumerate(itertools.islice(raws, num_samples)):
        line, offset = raw.line, raw.offset
        if raw.value is None:
            yield Skip(ordinal, line, None, raw.reason or "malformed_json", raw.detail, offset)
            continue
        given = _given_id(raw.value)
        # A made-up id must be unique in the file: a line holds one record of JSON Lines, but a
        # line of an array (a compact one is a single line) may hold many.
        sample_id = given if given is not None else f"record-{ordinal}" if in_array else f"line-{line}"
        # In an array the byte offset finds the record where line numbers cannot; a table's row is named.
        if raw.where:
            place, prefix = raw.where, f"{raw.where}: "
        elif offset is not None and in_array:
            place, prefix = f"line {line} (byte {offset})", f"record at byte {offset}: "
        else:
            place, prefix = f"line {line}", ""
        try:
            messages = _messages(raw.value)
        except _Bad as bad:
            yield Skip(ordinal, line, sample_id, bad.reason, prefix + bad.detail, offset)
            continue
        stem = file_stem_for(sample_id)
        if sample_id in first_place_of_id:
            yield Skip(
                ordinal,
                line,
                sample_id,
                "duplicate_id",
                f"{prefix}'id' {sample_id!r} was already used on {first_place_of_id[sample_id]}; "
                "ids name the sample files, so each must be unique",
                offset,
            )
            continue
        if stem in first_of_stem:
            other_place, other_id = first_of_stem[stem]
            yield Skip(
                ordinal,
                line,
                sample_id,
                "duplicate_id",
                f"{prefix}'id' {sample_id!r} gets the file name {stem!r}, as 'id' {other_id!r} on {other_place} "
                "does; ids name the sample files, so give one of them another id",
                offset,
            )
            continue
        first_place_of_id[sample_id] = place
        first_of_stem[stem] = (place, sample_id)
        yield Sample(ordinal, line, sample_id, stem, messages, offset, given is None)


# -- mixtures ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Source:
    """One dataset of a mixture: where it is, its name, and how many of its records to take."""

    path: Path
    name: str
    count: int | None = None  # its first N records (skips included); None with no weight: all of them
    weight: float | None = None  # its share of num_samples


def parse_sources(value) -> list[Source]:
    """A mixture from its description: a list of ``{path, name?, count? | weight?}`` (or its JSON text).

    Every source takes a count, or every one a weight (shares of ``num_samples``), or none does
    (all of each). Names (default: the file's or folder's stem) must differ: they prefix the ids
    (``<name>.<id>``) so that two sources' ids never meet. Raises ValueError naming what is wrong.
    """
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise ValueError(f"dataset sources: not a JSON list ({exc})") from None
    if not isinstance(value, list) or not value:
        raise ValueError("dataset sources: expected a non-empty list of {path, count or weight}")
    sources = []
    for k, entry in enumerate(value):
        if not isinstance(entry, dict) or not isinstance(entry.get("path"), str) or not entry["path"].strip():
            raise ValueError(f"dataset source {k}: expected an object with a 'path', got {entry!r}")
        unknown = sorted(set(entry) - {"path", "name", "count", "weight"})
        if unknown:
            raise ValueError(f"dataset source {k} ({entry['path']}): unknown key(s) {', '.join(unknown)}; a source "
                             "takes path, name, and count or weight")
        count, weight = entry.get("count"), entry.get("weight")
        if count is not None and (isinstance(count, bool) or not isinstance(count, int) or count < 1):
            raise ValueError(f"dataset source {k} ({entry['path']}): count must be a whole number >= 1, got {count!r}")
        if weight is not None and (isinstance(weight, bool) or not isinstance(weight, (int, float)) or weight <= 0):
            raise ValueError(f"dataset source {k} ({entry['path']}): weight must be a number > 0, got {weight!r}")
        if count is not None and weight is not None:
            raise ValueError(f"dataset source {k} ({entry['path']}): give a count or a weight, not both")
        path = Path(entry["path"])
        name = str(entry.get("name") or path.name.split(".")[0])
        if not SAFE_STEM.fullmatch(name):
            raise ValueError(f"dataset source {k}: name {name!r} must be letters, digits, '.', '_' or '-'")
        sources.append(Source(path, name, count, None if weight is None else float(weight)))
    names = [s.name for s in sources]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(f"dataset sources: the name(s) {', '.join(twice)} stand for more than one source; give "
                         "each its own name")
    weighted = [s.weight is not None for s in sources]
    if any(weighted) and not all(weighted):
        raise ValueError("dataset sources: give every source a weight, or none (counts, or all of each)")
    return sources


def shares(sources: list[Source], num_samples: int | None) -> list[int | None]:
    """How many records each source gives: its count, its share of ``num_samples`` by weight (the
    largest remainders rounded up, so that the shares add up), or None (all of it)."""
    if not sources or sources[0].weight is None:
        return [s.count for s in sources]
    if num_samples is None:
        raise ValueError("dataset sources with weights share num_samples (extraction_num_samples): set it, or give "
                         "each source a count")
    total = sum(s.weight for s in sources)
    exact = [num_samples * s.weight / total for s in sources]
    taken = [int(x) for x in exact]
    for k in sorted(range(len(sources)), key=lambda k: taken[k] - exact[k])[:num_samples - sum(taken)]:
        taken[k] += 1
    return taken


def _mixture(sources: list[Source], num_samples: int | None) -> Iterator[Sample | Skip]:
    """The sources one after another, each its share; ordinals run on, ids take the source's name."""
    counts = shares(sources, num_samples)
    offset = 0
    for source, count in zip(sources, counts):
        if count == 0:
            continue
        read = 0
        for item in _read(source.path, count):
            read += 1
            ordinal = offset + item.ordinal
            if isinstance(item, Skip):
                sample_id = None if item.sample_id is None else f"{source.name}.{item.sample_id}"
                yield Skip(ordinal, item.line, sample_id, item.reason, f"{source.name}: {item.detail}", item.offset,
                           source.name)
                continue
            sample_id = f"{source.name}.{item.sample_id}"
            yield Sample(ordinal, item.line, sample_id, file_stem_for(sample_id), item.messages, item.offset,
                         item.id_generated, source.name)
        offset += read


def dataset_paths(dataset) -> list[Path]:
    """The paths a dataset (a path, or a mixture's sources) reads."""
    return [s.path for s in dataset] if isinstance(dataset, (list, tuple)) else [Path(dataset)]


def read_dataset(path: str | os.PathLike, num_samples: int | None = None) -> Iterator[Sample | Skip]:
    """Each record of the dataset at ``path`` (JSON Lines, one JSON array, Parquet, Arrow, or a folder of
    them), in order, as a Sample or a Skip.

    The layout is told by the content: a first non-blank byte ``[`` is an array, anything else
    JSON Lines. ``num_samples`` keeps the first N records (non-blank lines or array elements,
    skipped ones included); the rest of the file is not read. Raises ValueError for a negative
    ``num_samples`` at once, and OSError (FileNotFoundError, ...) when the file cannot be
    opened, at the first record.
    """
    if num_samples is not None and (isinstance(num_samples, bool) or not isinstance(num_samples, int)):
        raise TypeError(f"num_samples must be an int or None, got {num_samples!r}")
    if num_samples is not None and num_samples < 0:
        raise ValueError(f"num_samples must be >= 0 (or None for the whole file), got {num_samples}")
    if isinstance(path, (list, tuple)):  # a mixture: a list of Source
        weighted = bool(path) and path[0].weight is not None
        mixed = _mixture(list(path), num_samples)
        return mixed if weighted else itertools.islice(mixed, num_samples)
    return _read(path, num_samples)
