"""Is the measured acceptance what the training predicts? The check that fails a useless drafter loudly.

The training measures, on its held-out split, the drafter's conditional top-1 agreement with the
target at each draft position (``cond_acc_k``: right at position k given positions 0..k-1 right).
Speculative decoding measures the same thing for real: among the verify rounds that reached draft
position k (every earlier draft accepted), the share that accepted it. A drafter that serves with
far less than its training promises is the silent failure EAGLE users report most (aux layers,
vocabulary mapping, chat template or KV cache that differ between training and serving), so the
evaluation FAILS when, at some position, even the upper end of the 99 % confidence interval of the
measured rate (Wilson's) is below ``min_ratio`` times the lower end of the prediction's own interval
(the prediction is a count over the held-out split's rounds too: deep positions rest on a few dozen).
Positions reached fewer than ``MIN_ROUNDS`` times, in the measurement or in the rounds behind the
prediction, are not judged (too few to tell). Outputs that differ from the target's own greedy
decode other than by numerical near-ties fail it too: the decode itself is wrong then.

The replay (``speculative.replay_chains``) tells the two kinds of shortfall apart: the same drafter
on the same prompts, every state from full forwards. The measured drafts accepted per verify below
``REPLAY_MIN_RATIO`` of the replay's fail the run as a serving fault (a cache, position or row
misread); both below the training's prediction, close to each other, is the drafter meeting prompts
unlike its training data (the verdict's ``diagnosis`` says which).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from eagle3_pipeline.train.loss import acceptance_length

MIN_ROUNDS = 30
Z_99 = 2.5758  # two-sided 99 %
DEFAULT_MIN_RATIO = 0.5

REPLAY_MIN_RATIO = 0.8  # measured accepted drafts per verify, at least this share of the replay's
REPLAY_MIN_ACCEPTED = 0.05  # a replay accepting fewer per verify is not judged (too little to compare)

CACHED_FORWARD_CAUSE = (
    "the target's forward with a KV cache differs from a full forward (a transformers version that takes the cache "
    "under another name; the reference engine checks this at start, so look at which engine and version served)")
# Causes a shortfall against the replay points to (the replay reads the same drafter, prompts and mapping).
SERVING_CAUSES = [
    CACHED_FORWARD_CAUSE,
    "the drafter's own KV cache, positions or verified rows at serving differ from its training forward (the "
    "replay feeds it exactly what training did)",
]
# Causes of a shortfall against the training's prediction; all but the first remain when the replay matched.
LIKELY_CAUSES = [
    CACHED_FORWARD_CAUSE,
    "the drafter was trained on other aux layers, or another layer convention, than the serving target captures "
    "(config.json eagle_config.eagle_aux_hidden_state_layer_ids against the extraction's data_config.json)",
    "a draft vocabulary mapping (d2t/t2d) that does not fit the target's vocabulary, or another target model or "
    "tokenizer than the one the data was extracted with",
    "a chat template at serving that differs from the extraction's (the prompts would not be the training "
    "distribution)",
    "held-out prompts unlike the training data (another language or domain), or answers in the training data that "
    "are not the target's own: regenerate them with the target (playbooks/regenerate.yml)",
]


def wilson_interval(rate: float, trials: int, z: float = Z_99) -> tuple[float, float]:
    """Wilson's score interval for a binomial ``rate`` observed over ``trials`` (0 to 1 without trials)."""
    if trials <= 0:
        return 0.0, 1.0
    centre = rate + z * z / (2 * trials)
    spread = z * math.sqrt(max(rate * (1 - rate), 0.0) / trials + z * z / (4 * trials * trials))
    scale = 1 + z * z / trials
    return max(0.0, (centre - spread) / scale), min(1.0, (centre + spread) / scale)


def wilson_upper(successes: int, trials: int, z: float = Z_99) -> float:
    """Upper end of Wilson's score interval for a binomial rate."""
    return wilson_interval(successes / trials if trials > 0 else 0.0, trials, z)[1]


def _rates(record) -> list[float] | None:
    rates = record.get("cond_acc_k") if isinstance(record, dict) else None
    if isinstance(rates, list) and rates and all(isinstance(r, (int, float)) for r in rates):
        return [float(r) for r in rates]
    return None


def prediction_record(training: dict, max_new_tokens: int | None = None) -> tuple[dict | None, str | None]:
    """The training's record to predict from, the most like the measurement first, and where it comes from.

    First the held-out split scored over the tokens that serving first answers of ``max_new_tokens``
    drafts (``eval.opening``, when the training scored it for that many tokens over at least
    MIN_ROUNDS rows): the evaluation decodes exactly such answers. Else the whole held-out split
    (every assistant token: later turns and the tails of long answers too), else the last batch.
    """
    held_out = training.get("eval") or {}
    opening = held_out.get("opening")
    if isinstance(opening, dict) and max_new_tokens is not None and opening.get("tokens") == max_new_tokens \
            and int(opening.get("rows") or 0) >= MIN_ROUNDS and _rates(opening):
        return opening, (f"the training's held-out split, over what serving first answers of {max_new_tokens} "
                         "tokens drafts")
    for record, where in ((held_out, "the training's held-out split"),
                          (training.get("last"), "the training's last batch")):
        if _rates(record):
            return record, where
    return None, None


def predicted_rates(training: dict, max_new_tokens: int | None = None) -> tuple[list[float] | None, str | None]:
    """The conditional acceptance per position of ``prediction_record``, and where it comes from."""
    record, source = prediction_record(training, max_new_tokens)
    return (_rates(record) if record else None), source


def predicted_tau(rates: list[float] | None, draft_tokens: int) -> float | None:
    """1 + the simulated accepted drafts of a chain of ``draft_tokens`` (None past what the training measured)."""
    if not rates or draft_tokens > len(rates):
        return None
    return 1.0 + acceptance_length(rates[:draft_tokens])


WALKED = "walked round by round"


@dataclass(frozen=True)
class Prediction:
    """What the training predicts for one chain length: conditional acceptance per draft position, tau, and
    where it comes from."""

    rates: list[float] | None
    tau: float | None
    source: str | None
    per_token_tau: float | None = None  # the same tokens scored per token (1 + sum_k prod_{i<=k} cond_acc_i)
    support: list[int] | None = None  # rounds (or rows) behind each rate; None: not known (not judged on it)


def _support(record: dict, chain: int) -> list[int] | None:
    """How many rounds (rows, scored per token) each conditional rate of ``record`` was counted over: a walk's
    ``reached`` counts; else rows (or rounds) times the share that got every earlier position right."""
    reached = record.get("reached")
    if isinstance(reached, list) and len(reached) >= chain:
        return [int(r) for r in reached[:chain]]
    total = record.get("target_forwards", record.get("rows"))
    shares = record.get("accepted_per_position", record.get("acc_k"))
    if not isinstance(total, (int, float)) or not isinstance(shares, list) or len(shares) < chain - 1:
        return None
    return [int(total)] + [round(float(share) * total) for share in shares[:chain - 1]]


def predict(training: dict, max_new_tokens: int | None, chain: int) -> Prediction:
    """The training's prediction for chains of ``chain`` drafts, the most like the measurement first.

    When the training walked its held-out first answers round by round for this chain (``eval.opening.rounds``,
    ``train.trainer``: the rounds serving goes through, ``evaluate.rounds.answer_rounds``) over at least
    MIN_ROUNDS rounds, that walk's conditional acceptance and tau: the same quantities the measurement counts,
    with no inspection bias. Else ``prediction_record``'s per-token rates and 1 + sum_k prod_{i<=k} cond_acc_i.
    """
    record, source = prediction_record(training, max_new_tokens)
    rates = _rates(record) if record else None
    per_token = predicted_tau(rates, chain)
    walked = ((record or {}).get("rounds") or {}).get(str(chain))  # only the opening score has rounds
    if isinstance(walked, dict) and int(walked.get("target_forwards") or 0) >= MIN_ROUNDS \
            and isinstance(walked.get("conditional_acceptance_per_position"), list):
        return Prediction([float(r) for r in walked["conditional_acceptance_per_position"]], float(walked["tau"]),
                          f"{source}, {WALKED}", per_token, _support(walked, chain))
    return Prediction(rates[:chain] if rates else None, per_token, source, per_token,
                      _support(record, chain) if rates and "rows" in record else None)


def judge_replay(runs: list[dict]) -> tuple[list[dict], list[str]]:
    """Each run with a ``replayed`` record: its accepted drafts per verify against the replay's."""
    checks, problems = [], []
    for run in runs:
        replayed = run.get("replayed")
        if not replayed:
            continue
        measured, wanted = run["mean_accepted"], replayed["mean_accepted"]
        judged = run["target_forwards"] >= MIN_ROUNDS and wanted >= REPLAY_MIN_ACCEPTED
        ok = not judged or measured >= REPLAY_MIN_RATIO * wanted
        checks.append({"draft_tokens": run["draft_tokens"], "measured": measured, "replayed": wanted,
                       "judged": judged, "ok": ok})
        if not ok:
            problems.append(
                f"chain of {run['draft_tokens']}: {measured:.3f} drafts accepted per verify, while the same drafter "
                f"replayed from full forwards of the same prompts accepts {wanted:.3f} (the check asks for at least "
                f"{REPLAY_MIN_RATIO:g} of that): the serving path loses what the drafter can do")
    return checks, problems


def diagnose(runs: list[dict], replay_checks: list[dict], source: str | None) -> str | None:
    """One sentence on where the measured acceptance stands between the replay and the training's prediction
    (the first chain with both; ``replay_checks`` from ``judge_replay``)."""
    run = next((r for r in runs if r.get("replayed") and r.get("predicted_tau")), None)
    if run is None:
        return None
    # The replay's tau, the measured one's quantity (tokens per verify forward: a round that ends at the end
    # token or the budget makes fewer than 1 + its accepted drafts), as evaluation.json's replayed_tau.
    replay = run["replayed"]
    replayed = replay.get("tau", 1 + replay["mean_accepted"])
    predicted, measured = run["predicted_tau"], run["tau"]
    text = (f"chain of {run['draft_tokens']}: tau measured {measured:.3f}, replayed from full forwards "
            f"{replayed:.3f}, predicted by {source} {predicted:.3f}")
    if any(check["draft_tokens"] == run["draft_tokens"] and not check["ok"] for check in replay_checks):
        return text + ": serving accepts less than the replay (see the problems)"
    if replayed < 0.9 * predicted:
        return (text + ": serving does what the drafter can do on these prompts; these prompts are harder for it "
                "than its training data (another distribution: their first answers, other lengths or topics)")
    return text + ": serving does what the drafter can do, as its training predicts"


def judge(runs: list[dict], rates: list[float] | dict[int, list[float] | None] | None, source: str | None,
          reference_faults: int, min_ratio: float = DEFAULT_MIN_RATIO,
          support: dict[int, list[int] | None] | None = None) -> dict:
    """The verdict over every measured chain length.

    ``runs``: per chain length ``draft_tokens``, ``accepted`` and ``reached`` counts per position
    (``AcceptanceStats``), and ``replayed`` (``AcceptanceStats.as_dict`` of the replay) when one was made.
    ``rates``: the predicted conditional acceptance per position, one list for every chain or per chain length
    (``predict``). ``reference_faults``: outputs that differ from the full-forward decode other than by near-ties.
    ``support``: per chain length, the rounds behind each predicted rate (``Prediction.support``); a position
    whose prediction rests on fewer than MIN_ROUNDS is not judged, and one that is judged is compared with the
    lower end of the prediction's interval, so that the noise of either count alone never fails a run.
    """
    replay_checks, problems = judge_replay(runs)
    positions = []
    predicted_problem = False
    by_chain = rates if isinstance(rates, dict) else None
    for run in runs:
        if by_chain is not None:
            rates = by_chain.get(run["draft_tokens"])
        for index, (accepted, reached) in enumerate(zip(run["accepted"], run["reached"])):
            if rates is None or index >= len(rates) or min_ratio <= 0:
                continue
            measured = accepted / reached if reached else None
            upper = wilson_upper(accepted, reached)
            counts = (support or {}).get(run["draft_tokens"])
            behind = counts[index] if counts and index < len(counts) else None
            lower = rates[index] if behind is None else wilson_interval(rates[index], behind)[0]
            judged = reached >= MIN_ROUNDS and (behind is None or behind >= MIN_ROUNDS)
            ok = not judged or upper >= min_ratio * lower
            positions.append({"draft_tokens": run["draft_tokens"], "position": index + 1, "measured": measured,
                              "rounds": reached, "upper_99": upper, "predicted": rates[index],
                              "predicted_rounds": behind, "predicted_lower_99": lower, "judged": judged, "ok": ok})
            if not ok:
                predicted_problem = True
                over = "" if behind is None else f" over {behind} rounds (99 % lower bound {lower:.3f})"
                problems.append(
                    f"chain of {run['draft_tokens']}, draft position {index + 1}: accepted in {accepted} of {reached} "
                    f"rounds that reached it ({measured:.3f}; 99 % upper bound {upper:.3f}), while {source} predicts "
                    f"{rates[index]:.3f}{over} (the check asks for at least {min_ratio:g} of that)")
    if reference_faults:
        problems.append(f"{reference_faults} output(s) differ from the target's own greedy decode by full forwards, "
                        "other than by numerical near-ties: the speculative decode itself reads wrong states")
    serving = reference_faults or any(not check["ok"] for check in replay_checks)
    # A replay that serving matched rules the serving path out of the causes of a shortfall against training.
    replay_cleared = any(check["judged"] for check in replay_checks) and not serving
    causes = [*(SERVING_CAUSES if serving else []),
              *((LIKELY_CAUSES[1:] if replay_cleared else LIKELY_CAUSES) if predicted_problem else [])]
    return {"passed": not problems, "min_ratio": min_ratio, "min_rounds": MIN_ROUNDS, "predicted_from": source,
            "positions": positions, "replay": replay_checks, "replay_min_ratio": REPLAY_MIN_RATIO,
            "diagnosis": diagnose(runs, replay_checks, source), "problems": problems,
            "likely_causes": (causes or LIKELY_CAUSES) if problems else [],
            "judged": any(p["judged"] for p in positions) or any(c["judged"] for c in replay_checks)
            or bool(reference_faults)}
