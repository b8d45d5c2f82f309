"""Verify rounds of greedy chain speculative decoding, counted from which drafts are right (no torch here).

One answer of ``length`` tokens o_0..o_{length-1} (o_0 comes from the prefill). A round whose first draft
proposes o_i drafts ``min(chain, max_new_tokens - i - 1)`` tokens, accepts the leading ones that equal
o_i, o_{i+1}, ... and produces them plus the target's next token, so the next round's first draft proposes
o_{i + accepted + 1}. ``leads[i - 1]`` is how many drafts in a row the drafter gets right from o_i on
(every draft's inputs are the answer's own tokens while the chain is right, so this is what the drafter
proposes at serving as well as in a teacher-forced training forward).

Two ways to score the same ``leads``:

- ``answer_rounds``: the rounds serving goes through. Rounds start where the previous one stopped, so
  they skip the tokens accepted as drafts: easy stretches take few rounds, hard ones a round per token.
- ``token_counts``: every token as a round's start (the training's conditional ``acc_k``): draft k counted
  at every token whose chain was right up to it. It weighs easy stretches by their tokens, not their
  rounds, so it predicts more acceptance per round than serving gets whenever the drafter's hits cluster
  (an inspection bias: the measured rate is per round; hits that alternate bias it the other way).
  ``answer_rounds`` over the same tokens has no such bias: with the same drafter and tokens it counts
  exactly what serving counts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass
class Round:
    """One verify forward: drafts proposed, drafts accepted, tokens it added to the output."""

    drafted: int
    accepted: int
    produced: int


@dataclass
class AcceptanceStats:
    """Acceptance summed over requests and rounds.

    Per draft position j (0-based): ``reached[j]`` rounds drafted j with all earlier drafts
    accepted, ``accepted[j]`` rounds accepted draft j.
    """

    draft_tokens: int
    rounds: int = 0
    produced: int = 0  # tokens from verify forwards
    completion_tokens: int = 0  # every output token, the prefill's first one included
    requests: int = 0
    reached: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)

    def __post_init__(self):
        self.reached = self.reached or [0] * self.draft_tokens
        self.accepted = self.accepted or [0] * self.draft_tokens

    def add_round(self, drafted: int, accepted: int, produced: int) -> None:
        """Count one verify forward."""
        self.rounds += 1
        self.produced += produced
        for position in range(min(accepted + 1, drafted)):
            self.reached[position] += 1
        for position in range(accepted):
            self.accepted[position] += 1

    def add_answer(self, completion_tokens: int, rounds: Sequence[Round]) -> None:
        """Count one request: its output tokens and its rounds."""
        self.requests += 1
        self.completion_tokens += completion_tokens
        for one in rounds:
            self.add_round(one.drafted, one.accepted, one.produced)

    def add_walk(self, rounds: Sequence[Round]) -> None:
        """Count one answer walked by ``answer_rounds``: the prefill's token and what its rounds produced."""
        self.add_answer(1 + sum(one.produced for one in rounds), rounds)

    def add(self, result) -> None:
        """Count one request (a ``speculative.SpeculativeOutput``)."""
        self.add_answer(len(result.output_ids), result.rounds)

    def counts(self) -> list[int]:
        """The counts as one flat list (``from_counts`` reads it back): to sum over processes."""
        return [self.rounds, self.produced, self.completion_tokens, self.requests, *self.reached, *self.accepted]

    @classmethod
    def from_counts(cls, draft_tokens: int, counts: Sequence[int]) -> AcceptanceStats:
        values = [int(v) for v in counts]
        return cls(draft_tokens, *values[:4], reached=values[4:4 + draft_tokens],
                   accepted=values[4 + draft_tokens:4 + 2 * draft_tokens])

    @property
    def tau(self) -> float:
        """Tokens produced per verify forward (1 + mean drafts accepted when no round is cut by an end token)."""
        return self.produced / self.rounds if self.rounds else 0.0

    @property
    def sglang_accept_length(self) -> float:
        """SGLang's spec_accept_length over all requests: completion tokens / verify forwards."""
        return self.completion_tokens / self.rounds if self.rounds else 0.0

    @property
    def mean_accepted(self) -> float:
        """Drafts accepted per verify forward."""
        return sum(self.accepted) / self.rounds if self.rounds else 0.0

    @property
    def accepted_per_position(self) -> list[float]:
        """Share of rounds whose draft j was accepted (they sum to the mean accepted per round)."""
        return [a / self.rounds if self.rounds else 0.0 for a in self.accepted]

    @property
    def conditional_acceptance(self) -> list[float]:
        """Draft j accepted among rounds that reached it (every earlier draft accepted): the measured
        counterpart of training's conditional acc_k."""
        return [a / r if r else 0.0 for a, r in zip(self.accepted, self.reached)]

    def as_dict(self) -> dict:
        """The figures for evaluation.json."""
        return {
            "tau": self.tau, "sglang_accept_length": self.sglang_accept_length, "mean_accepted": self.mean_accepted,
            "accepted_per_position": self.accepted_per_position,
            "conditional_acceptance_per_position": self.conditional_acceptance,
            "target_forwards": self.rounds, "tokens_from_verify": self.produced,
            "tokens_generated": self.completion_tokens, "requests": self.requests,
            "accepted": list(self.accepted), "reached": list(self.reached),
        }  # fmt: skip


def answer_rounds(leads: Sequence[int], length: int, chain: int, max_new_tokens: int) -> list[Round]:
    """The rounds of one answer of ``length`` tokens (at most ``max_new_tokens``), chains of ``chain`` drafts.

    ``leads[i - 1]`` (i = 1..length-1): drafts right in a row from o_i on, at most ``length - i`` (the answer
    ends there). A round that accepts the answer's last token produces nothing after it: the answer ended
    (its end token) or its budget did.
    """
    rounds: list[Round] = []
    done = 1  # o_0, the prefill's
    limit = min(length, max_new_tokens)
    while done < limit:
        drafted = min(chain, max_new_tokens - done - 1)
        accepted = min(int(leads[done - 1]), drafted)
        produced = min(accepted + 1, limit - done)
        rounds.append(Round(drafted, accepted, produced))
        done += produced
    return rounds


def token_counts(leads: Sequence[int], length: int, steps: int) -> tuple[list[int], list[int]]:
    """Per draft step k: (hits, tried) with every token o_i (i = 1..length-1) as a round's first draft, a draft
    tried when the chain was right before it and its token exists: the conditional acc_k of the training's
    metrics (``train.loss.ttt_metrics_from_argmax``) over the same tokens."""
    hits, tried = [0] * steps, [0] * steps
    for i in range(1, length):
        lead = int(leads[i - 1])
        for step in range(min(steps, length - i, lead + 1)):
            tried[step] += 1
            hits[step] += step < lead
    return hits, tried
