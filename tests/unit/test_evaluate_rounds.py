"""Verify rounds counted from which drafts are right: serving's rounds against the per-token score of the same
tokens, on a hand-built answer whose figures follow from the definitions."""

from __future__ import annotations

import pytest

from eagle3_pipeline.evaluate.rounds import AcceptanceStats, Round, answer_rounds, token_counts
from eagle3_pipeline.train.loss import acceptance_length

# o_0..o_8: o_1..o_4 an easy stretch (the drafter gets the rest of it right from each of them), o_5..o_8 hard.
EASY_THEN_HARD = [4, 3, 2, 1, 0, 0, 0, 0]
LENGTH = 9


def test_rounds_skip_the_tokens_accepted_as_drafts():
    rounds = answer_rounds(EASY_THEN_HARD, LENGTH, chain=3, max_new_tokens=128)
    # One round takes o_1..o_3 as drafts and o_4 from the verify; then a round per hard token.
    assert rounds == [Round(3, 3, 4), Round(3, 0, 1), Round(3, 0, 1), Round(3, 0, 1), Round(3, 0, 1)]
    stats = AcceptanceStats(3)
    stats.add_walk(rounds)
    assert (stats.rounds, stats.produced, stats.completion_tokens) == (5, 8, LENGTH)
    assert stats.tau == pytest.approx(8 / 5)
    assert stats.conditional_acceptance == pytest.approx([1 / 5, 1.0, 1.0])


def test_the_per_token_score_of_the_same_tokens_predicts_more_than_the_rounds_give():
    hits, tried = token_counts(EASY_THEN_HARD, LENGTH, steps=3)
    # Every token a round's start: step 0 at o_1..o_8, step 1 where step 0 was right (o_1..o_4), step 2 at o_1..o_3.
    assert (hits, tried) == ([4, 3, 2], [8, 4, 3])
    per_token = [h / t for h, t in zip(hits, tried)]
    assert 1 + acceptance_length(per_token) == pytest.approx(1 + 0.5 + 0.5 * 0.75 + 0.5 * 0.75 * 2 / 3)  # 2.125
    walked = answer_rounds(EASY_THEN_HARD, LENGTH, chain=3, max_new_tokens=128)
    assert 1 + acceptance_length(per_token) > sum(r.produced for r in walked) / len(walked)  # 2.125 > 1.6


def test_hits_that_alternate_bias_the_per_token_score_the_other_way():
    """Right at every other token: each round lands on a right one (its bonus token is the wrong one), so every
    round accepts while half the tokens say it would not. Only the walk counts what serving counts."""
    leads = [1, 0] * 20
    rounds = answer_rounds(leads, 41, chain=1, max_new_tokens=128)
    hits, tried = token_counts(leads, 41, steps=1)
    assert [r.accepted for r in rounds] == [1] * 20 and hits[0] / tried[0] == 0.5
    assert answer_rounds([0] * 40, 41, chain=1, max_new_tokens=128) == [Round(1, 0, 1)] * 40


def test_the_budget_and_the_answers_end_cut_the_last_rounds():
    # A budget of 6 tokens: the round at o_5 may draft nothing (6 - 5 - 1 = 0) and produces o_5 alone.
    assert answer_rounds([3, 2, 1, 0, 0, 0, 0, 0], LENGTH, chain=3, max_new_tokens=6) == [
        Round(3, 3, 4), Round(0, 0, 1)]
    # An answer that ends on a right draft: the round produces what is left of it, no bonus token after its end.
    assert answer_rounds([2, 1], 3, chain=3, max_new_tokens=128) == [Round(3, 2, 2)]
    assert answer_rounds([], 1, chain=3, max_new_tokens=128) == []  # the prefill's token only: no round


def test_counts_survive_a_round_trip_for_summing_over_processes():
    stats = AcceptanceStats(3)
    stats.add_answer(LENGTH, answer_rounds(EASY_THEN_HARD, LENGTH, 3, 128))
    again = AcceptanceStats.from_counts(3, stats.counts())
    assert again.as_dict() == stats.as_dict() and (again.reached, again.accepted) == (stats.reached, stats.accepted)
