"""The verdict: a drafter measured far below what its training predicts fails, with the likely causes."""

from __future__ import annotations

import pytest

from eagle3_pipeline.evaluate.verdict import (
    MIN_ROUNDS,
    judge,
    predict,
    predicted_rates,
    predicted_tau,
    wilson_interval,
    wilson_upper,
)

PREDICTED = [0.38, 0.34, 0.33, 0.32, 0.31, 0.30, 0.29]


def _run(draft_tokens, accepted, reached):
    return {"draft_tokens": draft_tokens, "accepted": accepted, "reached": reached}


def test_wilson_upper_bound_matches_the_closed_form_and_brackets_the_rate():
    z = 2.5758
    assert wilson_upper(0, 100) == pytest.approx((z * z / 200 + z * (z * z / 40000) ** 0.5) / (1 + z * z / 100))
    for successes, trials in [(1, 10), (50, 100), (380, 1000), (999, 1000)]:
        assert successes / trials < wilson_upper(successes, trials) <= 1.0
    assert wilson_upper(38, 100) > wilson_upper(380, 1000)  # more rounds, a tighter bound
    assert wilson_upper(0, 0) == 1.0


def test_the_issue_case_fails_naming_the_position_and_the_causes():
    """0.6 % accepted at position 1 over 2,263 rounds against 38 % predicted: the silent failure, now loud."""
    verdict = judge([_run(3, [14, 2, 2], [2263, 14, 2])], PREDICTED, "the training's held-out split", 0)
    assert not verdict["passed"] and verdict["judged"]
    assert "draft position 1: accepted in 14 of 2263 rounds" in verdict["problems"][0]
    assert "0.380" in verdict["problems"][0]
    assert len(verdict["problems"]) == 1  # positions 2 and 3 were reached too rarely to judge
    assert any("KV cache" in cause for cause in verdict["likely_causes"])
    assert [p["judged"] for p in verdict["positions"]] == [True, False, False]


def test_a_drafter_that_serves_as_trained_passes_at_both_chain_lengths():
    runs = [_run(3, [400, 150, 60], [1000, 400, 150]), _run(7, [380, 140, 50, 15, 5, 2, 1],
                                                          [1000, 380, 140, 50, 15, 5, 2])]
    verdict = judge(runs, PREDICTED, "the training's held-out split", 0)
    assert verdict["passed"] and verdict["problems"] == [] and verdict["likely_causes"] == []


def test_a_measurement_below_the_prediction_but_within_the_ratio_passes():
    # 0.16 measured against 0.23 predicted (what transformers 5.24 gave on the CPU in the issue): weak, not broken.
    verdict = judge([_run(3, [160, 3, 0], [1000, 160, 3])], [0.23, 0.1, 0.05], "x", 0)
    assert verdict["passed"]


def test_too_few_rounds_are_not_judged_and_the_check_can_be_turned_off():
    few = [_run(3, [0, 0, 0], [MIN_ROUNDS - 1, 0, 0])]
    assert judge(few, PREDICTED, "x", 0)["passed"] and not judge(few, PREDICTED, "x", 0)["judged"]
    many = [_run(3, [0, 0, 0], [500, 0, 0])]
    assert not judge(many, PREDICTED, "x", 0)["passed"]
    assert judge(many, PREDICTED, "x", 0, min_ratio=0)["passed"]
    assert judge(many, None, None, 0)["passed"]  # no prediction: nothing to compare with


def test_outputs_that_differ_from_the_target_fail_the_verdict():
    verdict = judge([_run(3, [400, 150, 60], [1000, 400, 150])], PREDICTED, "x", reference_faults=2)
    assert not verdict["passed"] and "2 output(s) differ" in verdict["problems"][0]


def test_predictions_come_from_the_held_out_split_first():
    training = {"eval": {"cond_acc_k": [0.5, 0.4]}, "last": {"cond_acc_k": [0.9, 0.9]}}
    assert predicted_rates(training) == ([0.5, 0.4], "the training's held-out split")
    assert predicted_rates({"last": {"cond_acc_k": [0.9]}}) == ([0.9], "the training's last batch")
    assert predicted_rates({}) == (None, None)
    assert predicted_tau([0.5, 0.4], 2) == pytest.approx(1 + 0.5 + 0.5 * 0.4)
    assert predicted_tau([0.5, 0.4], 3) is None


def test_the_prediction_comes_from_served_first_answers_when_the_training_scored_them():
    opening = {"tokens": 128, "cond_acc_k": [0.3, 0.2], "rows": MIN_ROUNDS}
    training = {"eval": {"cond_acc_k": [0.5, 0.4], "opening": opening}}
    rates, source = predicted_rates(training, 128)
    assert rates == [0.3, 0.2] and "first answers of 128 tokens" in source
    # Scored for another length, over too few rows, or no length asked: the whole held-out split.
    for other, asked in (({**opening, "tokens": 64}, 128), ({**opening, "rows": MIN_ROUNDS - 1}, 128), (opening, None)):
        assert predicted_rates({"eval": {"cond_acc_k": [0.5, 0.4], "opening": other}}, asked) == \
            ([0.5, 0.4], "the training's held-out split")


def _walked(chain, tau, conditional, rounds=MIN_ROUNDS):
    return {"tau": tau, "conditional_acceptance_per_position": conditional, "target_forwards": rounds}


def test_the_prediction_is_the_walk_of_the_served_first_answers_when_the_training_walked_them():
    """Walked round by round (what serving counts): that chain's tau and rates; the per-token figure beside it."""
    opening = {"tokens": 128, "cond_acc_k": [0.45, 0.49, 0.56], "rows": 20000,
               "rounds": {"3": _walked(3, 1.79, [0.37, 0.38, 0.46]), "1": _walked(1, 1.36, [0.36])}}
    training = {"eval": {"cond_acc_k": [0.5, 0.52, 0.6], "opening": opening}}
    walked = predict(training, 128, 3)
    assert (walked.rates, walked.tau) == ([0.37, 0.38, 0.46], 1.79) and "walked round by round" in walked.source
    assert walked.per_token_tau == pytest.approx(1 + 0.45 + 0.45 * 0.49 + 0.45 * 0.49 * 0.56)
    assert predict(training, 128, 1).rates == [0.36]
    # No walk for that chain, a walk of too few rounds, or another length: the per-token rates.
    for chain, other, asked in ((2, opening, 128),
                                (3, {**opening, "rounds": {"3": _walked(3, 1.8, [0.4] * 3, MIN_ROUNDS - 1)}}, 128),
                                (3, opening, 64)):
        fallback = predict({"eval": {**training["eval"], "opening": other}}, asked, chain)
        assert "walked" not in fallback.source and fallback.tau == fallback.per_token_tau
        assert fallback.rates == (opening["cond_acc_k"] if asked == 128 else training["eval"]["cond_acc_k"])[:chain]
    assert predict({}, 128, 3) == predict({}, None, 3) and predict({}, 128, 3).tau is None


def test_each_chain_is_judged_against_its_own_prediction():
    runs = [_run(3, [370, 140, 60], [1000, 370, 140]), _run(7, [360, 130, 55, 20, 10, 5, 3],
                                                             [1000, 360, 130, 55, 20, 10, 5])]
    verdict = judge(runs, {3: [0.37, 0.38, 0.46], 7: [0.9] * 7}, "x", 0)
    failed = {(p["draft_tokens"], p["position"]) for p in verdict["positions"] if not p["ok"]}
    assert failed and all(chain == 7 for chain, _ in failed)
    assert judge(runs, {3: [0.37, 0.38, 0.46], 7: None}, "x", 0)["passed"]


def test_a_prediction_counted_over_few_rounds_is_not_judged_and_a_judged_one_counts_its_own_noise():
    """The H200 run on 500 ShareGPT records: the walk predicted 0.5 at position 4 of a chain of 7 from 15 of 30
    held-out rounds, and serving accepted 22 of 155 there (its other positions near the prediction). The noise of
    the prediction's own count, not the drafter, failed that run; a shortfall over counts of thousands still
    fails."""
    walk = {"tau": 1.305, "target_forwards": 2287, "conditional_acceptance_per_position": [0.2313, 0.1747, 1 / 3, 0.5],
            "accepted_per_position": [0.22955837341495408, 0.03979011805859204, 0.013117621337997376,
                                      0.006558810668998688]}  # an older record: shares, no counts
    training = {"eval": {"opening": {"tokens": 128, "cond_acc_k": [0.25, 0.26, 0.59, 0.86], "rows": 2984,
                                     "rounds": {"4": walk}}}}
    prediction = predict(training, 128, 4)
    assert prediction.support == [2287, 525, 91, 30]
    served = [_run(4, [3637, 477, 158, 22], [18161, 3637, 477, 155])]
    assert not judge(served, {4: prediction.rates}, "x", 0)["passed"]  # the point estimate alone: the false alarm
    verdict = judge(served, {4: prediction.rates}, "x", 0, support={4: prediction.support})
    assert verdict["passed"], verdict["problems"]
    assert all(p["judged"] for p in verdict["positions"])
    assert verdict["positions"][0]["predicted_lower_99"] == pytest.approx(wilson_interval(0.2313, 2287)[0])
    fewer = judge(served, {4: prediction.rates}, "x", 0, support={4: [2287, 525, 91, MIN_ROUNDS - 1]})
    assert [p["judged"] for p in fewer["positions"]] == [True, True, True, False]
    # A walk that counted its rounds: those counts; the issue's failure (0.6 % against 38 %) still fails.
    counted = predict({"eval": {"opening": {"tokens": 128, "cond_acc_k": [0.38], "rows": 3000, "rounds": {
        "1": {"tau": 1.38, "target_forwards": 2263, "conditional_acceptance_per_position": [0.38],
              "reached": [2263], "accepted": [860]}}}}}, 128, 1)
    assert counted.support == [2263]
    failing = judge([_run(1, [14], [2263])], {1: counted.rates}, "x", 0, support={1: counted.support})
    assert not failing["passed"] and "over 2263 rounds (99 % lower bound" in failing["problems"][0]


def test_wilson_interval_brackets_the_rate_and_narrows_with_more_trials():
    for rate, trials in [(0.1, 10), (0.5, 100), (0.38, 1000), (0.0, 50), (1.0, 50)]:
        lower, upper = wilson_interval(rate, trials)
        assert 0.0 <= lower <= rate <= upper <= 1.0
    assert wilson_interval(0.4, 1000)[0] > wilson_interval(0.4, 30)[0]
    assert wilson_interval(0.4, 0) == (0.0, 1.0)


def _replayed_run(draft_tokens, accepted, reached, replay_accepted, rounds=1000, predicted_tau=None):
    """A run with the figures judge_replay and diagnose read: the measured and the replayed accepted drafts."""
    return {**_run(draft_tokens, accepted, reached), "target_forwards": rounds, "mean_accepted": sum(accepted) / rounds,
            "tau": 1 + sum(accepted) / rounds, "predicted_tau": predicted_tau,
            "replayed": {"mean_accepted": sum(replay_accepted) / rounds}}


def test_serving_below_the_replay_fails_as_a_serving_fault_even_within_the_training_ratio():
    """0.20 accepted per verify against 0.57 replayed: within half of a training prediction of 0.38 at position 1,
    but the same drafter on the same prompts does far better from full forwards: the serving path is at fault."""
    run = _replayed_run(3, [200, 0, 0], [1000, 200, 0], [370, 140, 60], predicted_tau=1.91)
    verdict = judge([run], PREDICTED, "the training's held-out split", 0)
    assert not verdict["passed"]
    assert "replayed from full forwards of the same prompts accepts 0.570" in verdict["problems"][0]
    assert verdict["replay"] == [{"draft_tokens": 3, "measured": 0.2, "replayed": 0.57, "judged": True, "ok": False}]
    assert "KV cache" in verdict["likely_causes"][0] and "serving accepts less than the replay" in verdict["diagnosis"]


def test_serving_as_replayed_but_below_training_says_the_prompts_differ_and_drops_the_serving_causes():
    # What the H200 run measured: 0.37 at position 1 against 0.50 predicted; suppose the replay agrees.
    run = _replayed_run(3, [366, 135, 64], [1000, 366, 135], [370, 137, 62], predicted_tau=1.91)
    verdict = judge([run], [0.50, 0.52, 0.59], "the training's held-out split", 0)
    assert verdict["passed"] and verdict["replay"][0]["ok"]
    assert "these prompts are harder for it than its training data" in verdict["diagnosis"]
    failing = judge([run], [0.9, 0.9, 0.9], "the training's held-out split", 0)
    assert not failing["passed"]
    assert failing["likely_causes"] and not any("KV cache" in cause for cause in failing["likely_causes"])


def test_a_replay_that_accepts_almost_nothing_or_too_few_rounds_is_not_judged():
    assert judge([_replayed_run(3, [0, 0, 0], [1000, 0, 0], [30, 0, 0])], None, None, 0)["replay"][0]["judged"] \
        is False
    few = _replayed_run(3, [0, 0, 0], [MIN_ROUNDS - 1, 0, 0], [20, 5, 1], rounds=MIN_ROUNDS - 1)
    assert judge([few], None, None, 0)["passed"]


def test_the_diagnosis_gives_the_replays_tau_the_quantity_measured_beside_it():
    """Rounds that end at the end token make fewer tokens than 1 + their accepted drafts: the diagnosis
    compares the measured tau with the replay's tau (evaluation.json's replayed_tau), not 1 + its mean."""
    run = _replayed_run(3, [366, 135, 64], [1000, 366, 135], [370, 137, 62], predicted_tau=1.91)
    run["replayed"]["tau"] = 1.49  # 1 + 0.569 would be 1.569
    verdict = judge([run], [0.50, 0.52, 0.59], "the training's held-out split", 0)
    assert f"tau measured {run['tau']:.3f}, replayed from full forwards 1.490," in verdict["diagnosis"]
