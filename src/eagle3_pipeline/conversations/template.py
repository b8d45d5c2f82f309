"""Rendering a conversation with the target's chat template: token ids and the assistant loss mask.

The ids must be exactly what the served model sees for the conversation, so they come from the
target tokenizer and its chat template (``tokenizer.apply_chat_template``), or from a template
file the operator gives. The drafter is trained only where the target itself would be
generating: ``loss_mask`` is 1 on the tokens of each assistant turn, its content and the
template's end-of-turn marker (``<|end|>``, ``<|im_end|>``, ``<|eot_id|>``: the drafter must
learn to stop), and 0 on everything else: system and user turns, the assistant's role header,
and the newline some templates put after the end-of-turn marker.

Templates differ in the text they put around turns (headers, blank lines, default system
prompts, think blocks), so the spans are not found by looking for particular tokens. They are
found by rendering prefixes of the conversation, the way the served model would meet them:

- where assistant turn ``i`` starts: the rendering of ``messages[:i]`` with the generation
  prompt (everything up to the point where the model starts to write);
- where it ends: the rendering of ``messages[:i + 1]``, trailing whitespace left out.

Both must be prefixes of the full rendering. A template that renders earlier turns differently
once later ones follow (Qwen3 drops the reasoning of earlier assistant turns, for instance)
has no single "what the model saw" for those turns; its samples fail with ``template_error``
and a detail that shows where the renderings part, rather than being trained on a guess.
Character spans become token spans through the fast tokenizer's offsets (a token is masked
when any of its characters is); tokenizers without offsets are measured by decoding.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

OVERFLOW_MODES = ("truncate", "skip")
# Stands in for the content of a first assistant turn, to find where that turn's text starts.
_SENTINEL = "EAGLE3SENTINELf3a9c1"


class SampleError(ValueError):
    """A sample that cannot be extracted: ``reason`` (a short code) and ``detail`` (a sentence)."""

    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason = reason
        self.detail = detail


def _first_difference(shorter: str, longer: str) -> str:
    """Where ``shorter`` stops being a prefix of ``longer``, with the text of both there."""
    at = len(os.path.commonprefix([shorter, longer]))
    return f"at character {at}: {shorter[at : at + 40]!r} versus {longer[at : at + 40]!r}"


class ChatRenderer:
    """Renders conversations with one tokenizer and one chat template (the tokenizer's, or ``chat_template``)."""

    def __init__(self, tokenizer, chat_template: str | None = None):
        if chat_template is None:
            try:
                chat_template = tokenizer.get_chat_template()
            except ValueError as exc:
                raise ValueError(
                    f"the tokenizer ({getattr(tokenizer, 'name_or_path', type(tokenizer).__name__)}) has no chat "
                    "template; give one with --chat-template FILE"
                ) from exc
        if not isinstance(chat_template, str) or not chat_template.strip():
            raise ValueError(f"the chat template must be a non-empty Jinja template string, got {chat_template!r:.60}")
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.template_hash = hashlib.sha256(chat_template.encode("utf-8")).hexdigest()
        self._use_offsets = bool(getattr(tokenizer, "is_fast", False))

    def _text(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        try:
            return self.tokenizer.apply_chat_template(
                messages, chat_template=self.chat_template, add_generation_prompt=add_generation_prompt, tokenize=False
            )
        except Exception as exc:  # a template is code: it raises whatever its author wrote (raise_exception, ...)
            raise SampleError(
                "template_error",
                f"the chat template fails on the first {len(messages)} turn(s): {type(exc).__name__}: {exc}",
            ) from exc

    def _turn_start(self, messages: list[dict], i: int) -> str:
        """The text before assistant turn ``i``'s own text: what the model reads before writing it."""
        if i > 0:
            return self._text(messages[:i], add_generation_prompt=True)
        # Nothing before it to render with a generation prompt: find where a stand-in content lands.
        probe = self._text([{**messages[0], "content": _SENTINEL}])
        at = probe.find(_SENTINEL)
        if at < 0:
            raise SampleError(
                "template_error",
                "the conversation starts with an assistant turn and the template alters that turn's text, "
                "so where the turn starts cannot be found; start the conversation with a user turn",
            )
        return probe[:at]

    def _char_spans(self, messages: list[dict], full: str) -> list[tuple[int, int]]:
        """``[start, stop)`` characters of each assistant turn in ``full``."""
        spans = []
        last = len(messages) - 1
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            start_text = self._turn_start(messages, i)
            through = full if i == last else self._text(messages[: i + 1])
            if not through.startswith(start_text):
                raise SampleError(
                    "template_error",
                    f"the template's generation prompt is not how it starts assistant turn {i} (the renderings "
                    f"differ {_first_difference(start_text, through)}); the mask cannot be placed",
                )
            if not full.startswith(through):
                raise SampleError(
                    "template_error",
                    f"the template renders turns 0..{i} differently once later turns follow (they differ "
                    f"{_first_difference(through, full)}); such a template (e.g. one that drops earlier reasoning) "
                    "shows the model a different text at each turn: give a prefix-stable one with --chat-template",
                )
            start = len(start_text)
            spans.append((start, start + len(through[start:].rstrip())))
        return spans

    def generation_prompt_ids(self, messages) -> list[int]:
        """Token ids of ``messages`` rendered with the generation prompt: what the model reads before it
        writes the next assistant turn, tokenized as ``render`` tokenizes (no added special tokens).

        Raises SampleError("template_error") when the template fails on these messages.
        """
        text = self._text([dict(message) for message in messages], add_generation_prompt=True)
        return list(self.tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"])

    def render(self, messages) -> tuple[list[int], list[int]]:
        """``(input_ids, loss_mask)`` of a conversation of ``{"role", "content"}`` dicts; same length.

        Raises SampleError("template_error") when the template fails on it or is not prefix-stable.
        """
        messages = [dict(message) for message in messages]
        if not messages:
            raise SampleError("template_error", "no messages to render")
        full = self._text(messages)
        spans = [span for span in self._char_spans(messages, full) if span[1] > span[0]]
        if self._use_offsets:
            # As apply_chat_template(tokenize=True) does it: the rendered text, no added special tokens.
            encoding = self.tokenizer(full, add_special_tokens=False, return_offsets_mapping=True, verbose=False)
            input_ids = list(encoding["input_ids"])
            mask = _mask_from_offsets(encoding["offset_mapping"], spans)
        else:
            input_ids = list(self.tokenizer(full, add_special_tokens=False, verbose=False)["input_ids"])
            mask = _mask_by_decoding(self.tokenizer, input_ids, full, spans)
        return input_ids, mask


def _mask_from_offsets(offsets, spans: list[tuple[int, int]]) -> list[int]:
    """1 for each token whose characters overlap a span (both in order: one pass)."""
    mask = [0] * len(offsets)
    k = 0
    for t, (token_start, token_stop) in enumerate(offsets):
        while k < len(spans) and token_start >= spans[k][1]:
            k += 1
        if k == len(spans):
            break
        if token_stop > spans[k][0]:
            mask[t] = 1
    return mask


def _mask_by_decoding(tokenizer, input_ids: list[int], text: str, spans: list[tuple[int, int]]) -> list[int]:
    """The offsets approach for tokenizers without offsets: token k starts where decoding ids[:k] stops
    agreeing with ``text``; found by bisection, a few decodes per span."""
    decoded = tokenizer.decode(input_ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
    if decoded != text:
        raise SampleError(
            "template_error",
            f"the tokenizer has no character offsets and decoding its tokens does not give back the rendered text "
            f"(they differ {_first_difference(decoded, text)}); use a fast tokenizer (tokenizer.json)",
        )
    cache: dict[int, int] = {0: 0, len(input_ids): len(text)}

    def position(k: int) -> int:  # characters of ``text`` covered by the first k tokens
        if k not in cache:
            piece = tokenizer.decode(input_ids[:k], skip_special_tokens=False, clean_up_tokenization_spaces=False)
            cache[k] = len(os.path.commonprefix([piece, text]))
        return cache[k]

    def first(predicate) -> int:  # smallest k in [0, n] with predicate(k); predicate is monotone
        low, high = 0, len(input_ids)
        while low < high:
            middle = (low + high) // 2
            if predicate(middle):
                high = middle
            else:
                low = middle + 1
        return low

    mask = [0] * len(input_ids)
    for start, stop in spans:
        first_token = first(lambda k, start=start: k == len(input_ids) or position(k + 1) > start)
        end_token = first(lambda k, stop=stop: position(k) >= stop)  # first token starting at or after stop
        for t in range(first_token, end_token):
            mask[t] = 1
    return mask


def fit_length(input_ids, loss_mask, max_length: int, overflow: str) -> tuple[list[int], list[int], bool]:
    """``(input_ids, loss_mask, truncated)`` within ``max_length`` tokens.

    ``overflow`` "truncate" cuts a longer sample to its first ``max_length`` tokens; "skip" refuses
    it with SampleError("too_long"). Either way a sample left without any assistant token is
    refused with SampleError("no_assistant_tokens"): it would teach the drafter nothing.
    """
    if overflow not in OVERFLOW_MODES:
        raise ValueError(f"overflow must be one of {', '.join(OVERFLOW_MODES)}, got {overflow!r}")
    if isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 1:
        raise ValueError(f"max_length must be a positive int, got {max_length!r}")
    if len(input_ids) != len(loss_mask):
        raise ValueError(f"input_ids and loss_mask differ in length: {len(input_ids)} and {len(loss_mask)}")
    truncated = len(input_ids) > max_length
    if truncated and overflow == "skip":
        raise SampleError(
            "too_long",
            f"{len(input_ids)} tokens, more than the maximum of {max_length}; raise --max-length, "
            "or keep the first tokens with --overflow truncate",
        )
    input_ids, loss_mask = list(input_ids[:max_length]), list(loss_mask[:max_length])
    if not any(loss_mask):
        if truncated:
            detail = f"no assistant token within the first {max_length} tokens; raise --max-length"
        else:
            detail = "no token of an assistant turn after rendering (the template drops the assistant's text?)"
        raise SampleError("no_assistant_tokens", detail)
    return input_ids, loss_mask, truncated


def load_renderer(
    model_path: str | os.PathLike, chat_template_file: str | os.PathLike | None = None, *, trust_remote_code=False
) -> ChatRenderer:
    """A ChatRenderer for the tokenizer in the local directory ``model_path`` (nothing is downloaded).

    ``chat_template_file`` (a Jinja template) replaces the tokenizer's own template.
    ``trust_remote_code`` lets tokenizers that ship their own Python code load (Kimi's does);
    only for model directories whose code you trust.
    """
    from transformers import AutoTokenizer  # noqa: PLC0415 - keep `eagle3-pipeline --help` fast

    template = None
    if chat_template_file is not None:
        try:
            template = Path(chat_template_file).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"cannot read the chat template file {chat_template_file}: {exc}") from exc
    try:
        tokenizer = AutoTokenizer.from_pretrained(
            str(model_path), local_files_only=True, trust_remote_code=trust_remote_code
        )
    except (OSError, ValueError) as exc:
        raise ValueError(
            f"cannot load the tokenizer from {model_path}: {exc}; --model-path must be a local model directory "
            "holding the target's tokenizer files (tokenizer.json, tokenizer_config.json)"
        ) from exc
    return ChatRenderer(tokenizer, template)
