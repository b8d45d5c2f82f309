"""One conversation answered again by the target, turn by turn.

The system and user turns stay as they are. Each assistant turn is replaced by the target's own
answer to the conversation so far, where "so far" is the REGENERATED history: the second answer
is written after the first regenerated answer, never after the dataset's original one, so every
token the drafter trains on is one the target would have written in that very context. The
prompt of a turn is the history rendered with the target's chat template and its generation
prompt, tokenized exactly as the extraction tokenizes (``ChatRenderer.generation_prompt_ids``),
and sent as token ids; the answer comes back as token ids and is decoded without the special
tokens (the template puts the end-of-turn marker back when the extraction renders it).

An assistant turn before the first user turn has nothing to answer (ShareGPT splits long
conversations, and a later part starts with the assistant): it is left out, and the conversation
is answered from its first user turn (``leading_dropped`` counts them); with no user turn at all
the record is skipped.

Three limits end a conversation early:

- an answer that stops at ``max_new_tokens`` (finish reason ``length``): ``keep`` it and go on
  (the default), ``cut`` the conversation after it, or ``drop`` the whole conversation;
- ``max_length``: once the rendered conversation reaches it, later turns would be cut away by the
  extraction anyway, so none is asked for; the conversation ends after the last answer written
  (and is left out when no answer fits);
- the server's context: a turn's budget is cut to what the context has left.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

ON_LENGTH = ("keep", "cut", "drop")


@dataclass(frozen=True)
class Answer:
    """What the server wrote for one turn."""

    text: str
    output_ids: list[int]
    finish: str  # "stop" (an end token) or "length" (the budget ran out)


class NotAnswered(Exception):
    """The run is stopping: the conversation was left before its next request (the rerun redoes it)."""


class ConversationSkipped(Exception):
    """The conversation cannot be regenerated: ``reason`` (a short code) and ``detail`` (a sentence)."""

    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason = reason
        self.detail = detail


@dataclass
class Regenerated:
    """A conversation with every assistant turn the target's own, and what it took."""

    messages: list[dict]
    turns: int = 0  # assistant turns answered
    prompt_tokens: int = 0  # summed over the turns' requests
    generated_tokens: int = 0
    finish: Counter = field(default_factory=Counter)  # finish reason -> turns
    truncated_kept: int = 0  # answers that hit max_new_tokens and were kept (on_length keep)
    cut: bool = False  # ended after an answer that hit max_new_tokens (on_length cut)
    limited: bool = False  # ended because the rendered length reached max_length (or the context)
    turns_left_out: int = 0  # assistant turns of the dataset not answered because of cut or limit
    leading_dropped: int = 0  # assistant turns before the first user turn, left out

    def record(self) -> dict:
        """The journal's view of it (JSON-ready)."""
        return {"messages": self.messages, "turns": self.turns, "prompt_tokens": self.prompt_tokens,
                "generated_tokens": self.generated_tokens, "finish": dict(sorted(self.finish.items())),
                "truncated_kept": self.truncated_kept, "cut": self.cut, "limited": self.limited,
                "turns_left_out": self.turns_left_out, "leading_dropped": self.leading_dropped}


def regenerate_conversation(messages, renderer, generate: Callable[[list[int], int], Answer], *,
                            max_new_tokens: int, max_length: int, context_length: int | None = None,
                            on_length: str = "keep", stopping: Callable[[], bool] = lambda: False) -> Regenerated:
    """The conversation ``messages`` (normalised ``{"role", "content"}`` dicts) with every assistant turn
    answered again through ``generate(prompt_ids, max_new_tokens) -> Answer``.

    Raises ``ConversationSkipped`` (answer_truncated with ``on_length`` drop; too_long when not
    even the first answer fits in ``max_length``; template_error), and ``NotAnswered`` when
    ``stopping()`` turns true before a request.
    """
    from eagle3_pipeline.conversations.template import SampleError  # noqa: PLC0415

    if on_length not in ON_LENGTH:
        raise ValueError(f"on_length must be one of {', '.join(ON_LENGTH)}, got {on_length!r}")
    history: list[dict] = []
    result = Regenerated(messages=history)
    assistant_turns = sum(1 for message in messages if message["role"] == "assistant")
    answered_through = 0  # len(history) after the last answer: where the conversation ends if stopped early
    ended = None  # "cut" or "limited" when the loop stopped before the end
    for message in messages:
        if message["role"] != "assistant":
            history.append({"role": message["role"], "content": message["content"]})
            continue
        if not any(turn["role"] == "user" for turn in history):
            result.leading_dropped += 1  # nothing asked yet: nothing to answer
            assistant_turns -= 1
            continue
        try:
            prompt = renderer.generation_prompt_ids(history)
        except SampleError as exc:
            raise ConversationSkipped(exc.reason, f"assistant turn {result.turns + 1}: {exc.detail}") from None
        budget = max_new_tokens if context_length is None else min(max_new_tokens, context_length - len(prompt))
        if len(prompt) >= max_length or budget < 1:
            ended = "limited"
            break
        if stopping():
            raise NotAnswered
        answer = generate(prompt, budget)
        history.append({"role": "assistant", "content": answer.text})
        answered_through = len(history)
        result.turns += 1
        result.prompt_tokens += len(prompt)
        result.generated_tokens += len(answer.output_ids)
        result.finish[answer.finish] += 1
        if answer.finish == "length":
            if on_length == "drop":
                raise ConversationSkipped(
                    "answer_truncated",
                    f"assistant turn {result.turns} stopped at max_new_tokens ({budget} tokens) and --on-length is "
                    "drop; raise --max-new-tokens, or keep such answers with --on-length keep",
                )
            if on_length == "cut" and result.turns < assistant_turns:
                ended = "cut"
                break
            result.truncated_kept += 1
        if len(prompt) + len(answer.output_ids) >= max_length and result.turns < assistant_turns:
            ended = "limited"  # later turns would be cut away by the extraction anyway
            break
    if result.turns == 0 and assistant_turns == 0:
        raise ConversationSkipped("no_user_turn", "no assistant turn comes after a user turn: nothing to answer")
    if result.turns == 0:
        raise ConversationSkipped(
            "too_long",
            f"the prompt of the first assistant turn already has {max_length} tokens or more (--max-length), "
            "or the server's context is full: the extraction would keep no token of an answer",
        )
    if ended is not None:
        del history[answered_through:]  # the user turns after the last answer have no answer
        result.cut, result.limited = ended == "cut", ended == "limited"
    result.turns_left_out = assistant_turns - result.turns
    return result
