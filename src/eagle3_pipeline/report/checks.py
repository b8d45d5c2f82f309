"""The report's verdict: a headline, the run's checks one by one, and what to look at.

Read from the inputs (``inputs.ReportInputs``) and nothing else: a check whose record is missing
says "not measured" and why, and never passes by default. The headline is FAILED when any check
failed, PASSED when the evaluation's verdict passed having judged something (and nothing failed),
NOT JUDGED when the evaluation ran but judged nothing, NOT MEASURED when there is no evaluation
to judge. ``render`` turns these records into the page's first section.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from eagle3_pipeline.report.inputs import ReportInputs

PASS, FAIL, NOT_RUN = "passed", "failed", "not measured"
PASSED, FAILED, NOT_JUDGED, NOT_MEASURED = "PASSED", "FAILED", "NOT JUDGED", "NOT MEASURED"


@dataclass
class Check:
    """One line of "what passed": what was checked, its outcome, and the figures behind it."""

    name: str
    outcome: str  # PASS, FAIL or NOT_RUN
    detail: str
    label: str | None = None  # the word shown for a NOT_RUN that "not measured" would misname

    @property
    def shown(self) -> str:
        """The outcome as the page prints it."""
        return self.label or ("FAILED" if self.outcome == FAIL else self.outcome)


@dataclass
class LookAt:
    """One item of "what to look at": a sentence, the section with its details, a list under it."""

    text: str
    section: str
    bad: bool = False
    items: list[str] = field(default_factory=list)


@dataclass
class ChainComparison:
    """Measured tau against the one the training simulates, at one chain length."""

    draft_tokens: int | None
    measured_tau: float | None
    simulated_tau: float | None
    judged: int  # draft positions the evaluation's verdict judged at this chain length
    below: int  # of those, the ones below what the training predicts
    why_not_simulated: str | None = None
    replayed_tau: float | None = None  # the same drafter and prompts replayed from full forwards (no cache)


@dataclass
class RunVerdict:
    """The page's first section, as data."""

    word: str  # PASSED, FAILED, NOT_JUDGED or NOT_MEASURED
    sentence: str
    chains: list[ChainComparison]
    simulated_from: str | None
    min_ratio: float | None
    checks: list[Check]
    look_at: list[LookAt]
    diagnosis: str | None = None  # measured against the replay and the training (the evaluation's verdict)


def _num(value: object) -> float | None:
    """A finite number (not a bool), else None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def _count(value: object) -> int | None:
    number = _num(value)
    return int(number) if number is not None else None


def _dicts(value: object) -> list[dict]:
    return [item for item in value if isinstance(item, dict)] if isinstance(value, list) else []


def _strings(value: object) -> list[str]:
    """A list's items as text; anything else (a stray string or number) as no items, not its characters."""
    return [str(item) for item in value] if isinstance(value, list) else []


def _plural(count: int, word: str, plural: str | None = None) -> str:
    return f"{count:,} {word if count == 1 else plural or word + 's'}"


def _record(inputs: ReportInputs) -> dict:
    return inputs.evaluation.record or {}


def _verdict(inputs: ReportInputs) -> dict | None:
    verdict = _record(inputs).get("verdict")
    return verdict if isinstance(verdict, dict) else None


# -- the checks ---------------------------------------------------------------------------
def gpu_check(inputs: ReportInputs) -> Check:
    """The GPUs verified free by the gpu_reset role, on every host whose report says so."""
    name = "GPUs freed before the run (gpu_reset)"
    if inputs.gpu_reset_reason:
        return Check(name, NOT_RUN, inputs.gpu_reset_reason)
    busy, verified, unverified, hosts = [], 0, [], set()
    for log in inputs.gpu_reset:
        record = log.record
        if log.error or record.get("check_mode"):
            continue  # unreadable, or a check run that signalled nothing: listed under what to look at
        after = _dicts(record.get("gpus_after"))
        if not after:
            unverified.append(log.host)
        busy += [f"{log.host} GPU {gpu.get('index', '?')}" for gpu in after if gpu.get("free") is False]
        free = sum(1 for gpu in after if gpu.get("free") is True)
        verified += free
        if free:
            hosts.add(log.host)
    if busy:
        return Check(name, FAIL, "still in use after the reset: " + ", ".join(busy))
    if not verified:
        return Check(name, NOT_RUN, "no report verifies a GPU free (check mode, NVML unavailable or unreadable "
                                    "reports: see the GPU reset section)", label="not verified")
    detail = f"{_plural(verified, 'GPU')} on {_plural(len(hosts), 'host')} verified free by NVML"
    if unverified:
        detail += f"; not verified on {', '.join(unverified)}"
    return Check(name, PASS, detail)


def extraction_check(inputs: ReportInputs) -> Check:
    """The extraction's manifest: verified samples stored, and how many records it left out."""
    name = "Hidden states extracted and verified (extraction)"
    manifest = inputs.extraction.manifest
    if manifest is None:
        return Check(name, NOT_RUN, inputs.extraction.reason or "not measured")
    samples, tokens = _count(manifest.get("num_samples")), _count(manifest.get("num_tokens"))
    skipped, failed = len(_dicts(manifest.get("skipped"))), len(_dicts(manifest.get("failed")))
    detail = (f"{'-' if samples is None else f'{samples:,}'} samples ({'-' if tokens is None else f'{tokens:,}'} "
              f"tokens) stored, each checked against the engine's own top-1; {_plural(skipped, 'record')} skipped, "
              f"{_plural(failed, 'sample')} failed the check and not stored")
    return Check(name, PASS, detail)


def training_check(inputs: ReportInputs) -> Check:
    """The training finished (training.json written), with its steps."""
    name = "Training finished (training.json)"
    training = inputs.training
    last = training.last("train")
    if training.record is None:
        if training.metrics is None:
            return Check(name, NOT_RUN, training.reason or "not measured")
        return Check(name, NOT_RUN, f"no training.json yet; metrics.jsonl reaches step {last['step'] if last else '-'}",
                     label="not finished")
    steps, total = _count(training.record.get("steps")), _count(training.record.get("total_steps"))
    detail = f"{'-' if steps is None else f'{steps:,}'} of {'-' if total is None else f'{total:,}'} steps"
    held_out = training.last("eval")
    if held_out and _num(held_out.get("acceptance_length")) is not None:
        detail += (f"; simulated acceptance length on the held-out split {held_out['acceptance_length']:.3f} "
                   f"(step {held_out.get('step', '-')})")
    return Check(name, PASS, detail)


def drafter_check(inputs: ReportInputs) -> Check:
    """The exported drafter: config.json and its weights."""
    name = "Drafter exported (config.json, model.safetensors)"
    drafter = inputs.drafter
    if drafter.config is None:
        return Check(name, NOT_RUN, drafter.reason or "no drafter")
    if drafter.weights_bytes is None:
        return Check(name, FAIL, f"{drafter.directory / 'model.safetensors'} is missing: the export is incomplete "
                                 "(train again to export it)")
    return Check(name, PASS, f"{drafter.directory}")


def evaluation_checks(inputs: ReportInputs) -> list[Check]:
    """The evaluation's verdict, its output check and its held-out check; one line when it did not run."""
    name = "Measured acceptance against the training's simulation (evaluation verdict)"
    acceptance = inputs.acceptance
    if acceptance.reason:
        return [Check(name, NOT_RUN, acceptance.reason)]
    record, verdict = _record(inputs), _verdict(inputs)
    if verdict is None:
        checks = [Check(name, NOT_RUN, f"{inputs.evaluation.path} holds no verdict (an evaluate older than the "
                                       "verdict wrote it): evaluate again with --force to judge it",
                        label="not judged")]
    else:
        positions = _dicts(verdict.get("positions"))
        judged = [p for p in positions if p.get("judged")]
        below = [p for p in judged if p.get("ok") is False]
        ratio = _num(verdict.get("min_ratio"))
        share = f"{ratio:g} of " if ratio is not None else ""
        if not verdict.get("passed", True):
            if below:
                detail = (f"{_plural(len(below), 'draft position')} of {len(judged)} judged below {share}what "
                          f"{verdict.get('predicted_from') or 'the training'} predicts")
            elif output_check(record).outcome == FAIL:
                detail = "the outputs are not the target's own (the reference check, below)"
            else:  # a verdict that failed without saying where: say so rather than guess
                detail = "failed, naming no draft position below its prediction (see what to look at)"
            checks = [Check(name, FAIL, detail)]
        elif verdict.get("judged") and judged:
            checks = [Check(name, PASS, f"each of the {_plural(len(judged), 'draft position')} judged (reached "
                                        f"{verdict.get('min_rounds', '-')} times or more) within {share}what "
                                        f"{verdict.get('predicted_from') or 'the training'} predicts, "
                                        "99 % confidence")]
        elif verdict.get("judged"):
            checks = [Check(name, PASS, "passed (evaluation.json records no judgement per draft position)")]
        else:
            checks = [Check(name, NOT_RUN, f"too few rounds: no draft position was reached "
                                           f"{verdict.get('min_rounds', '-')} times", label="not judged")]
    checks.append(output_check(record))
    overlap = record.get("overlap_check")
    held_out = "Held-out prompts never seen in training (overlap check)"
    if isinstance(overlap, dict):
        checks.append(Check(held_out, PASS, f"{_count(overlap.get('usable_prompts')) or 0:,} prompts measured, "
                                            f"checked against {_count(overlap.get('training_samples')) or 0:,} "
                                            f"training samples; {_count(overlap.get('excluded')) or 0:,} excluded"))
    else:
        checks.append(Check(held_out, NOT_RUN, "evaluation.json records no overlap check", label="not recorded"))
    return checks


def output_check(record: dict) -> Check:
    """Every output against the target's own greedy decode (near-ties are rounding, not faults)."""
    name = "Outputs equal the target's own greedy decode (reference check)"
    check = record.get("reference_check")
    if isinstance(check, dict) and check.get("checked"):
        mismatches = _dicts(check.get("mismatches"))
        faults = [m for m in mismatches if not m.get("near_tie")]
        if faults:
            return Check(name, FAIL, f"{_plural(len(faults), 'output')} differ other than by a numerical near-tie: "
                                     + ", ".join(str(m.get("id", "?")) for m in faults[:10]))
        ties = f", but {_plural(len(mismatches), 'output')} at a numerical near-tie" if mismatches else ""
        return Check(name, PASS, f"every output{ties} ({check.get('method') or 'method not recorded'})")
    match = record.get("outputs_match_target")
    if match is True:
        return Check(name, PASS, "every output")
    if match is False:
        return Check(name, FAIL, f"outputs differ: {record.get('output_mismatches')}")
    return Check(name, NOT_RUN, "not checked (the sglang engine measures without it; so does --no-check-outputs)",
                 label="not checked")


# -- measured against simulated, per chain ----------------------------------------------------
def chain_comparisons(inputs: ReportInputs) -> list[ChainComparison]:
    """Every chain length the evaluation measured, its tau beside the training's; [] when none was."""
    acceptance = inputs.acceptance
    if acceptance.reason:
        return []
    record, verdict = _record(inputs), _verdict(inputs) or {}
    positions = _dicts(verdict.get("positions"))
    simulated_positions = len(acceptance.simulated_rates or [])
    runs = _dicts(record.get("runs"))
    if not runs:  # one chain, from the top-level figures; the simulation is the report's own
        runs = [{"draft_tokens": record.get("draft_tokens"), "tau": acceptance.measured_tau,
                 "predicted_tau": acceptance.simulated_tau}]
    chains = []
    for run in runs:
        chain = _count(run.get("draft_tokens"))
        judged = [p for p in positions if p.get("draft_tokens") == chain and p.get("judged")]
        simulated = _num(run.get("predicted_tau"))
        why = None
        if simulated is None:
            why = (f"the training simulates {_plural(simulated_positions, 'draft position')}"
                   if simulated_positions and chain and chain > simulated_positions else "no simulation recorded")
        replayed = run.get("replayed") if isinstance(run.get("replayed"), dict) else {}
        chains.append(ChainComparison(chain, _num(run.get("tau")), simulated, len(judged),
                                      sum(1 for p in judged if p.get("ok") is False), why,
                                      _num(replayed.get("tau"))))
    return chains


# -- what to look at ------------------------------------------------------------------------
def look_at(inputs: ReportInputs) -> list[LookAt]:
    """What an operator should read further: problems first, then what the stages left out."""
    items: list[LookAt] = []
    record, verdict = _record(inputs), _verdict(inputs) or {}
    for problem in _strings(verdict.get("problems")):
        items.append(LookAt(problem, "acceptance", bad=True))
    causes = _strings(verdict.get("likely_causes"))
    if causes:
        items.append(LookAt("Likely causes, most frequent first:", "acceptance", bad=True, items=causes))
    check = record.get("reference_check") if isinstance(record.get("reference_check"), dict) else {}
    ties = [m for m in _dicts(check.get("mismatches")) if m.get("near_tie")]
    if ties:
        items.append(LookAt(f"{_plural(len(ties), 'output')} differ from the target's greedy decode at a numerical "
                            "near-tie (rounding, not a fault)", "acceptance"))
    excluded = _dicts(record.get("excluded_prompts"))
    if excluded:
        items.append(LookAt(f"{_plural(len(excluded), 'held-out prompt')} excluded: seen in training, repeated or "
                            "longer than the training's samples (the next ones of the file were measured instead)",
                            "acceptance"))
    if inputs.acceptance.note:
        items.append(LookAt(inputs.acceptance.note, "acceptance"))
    extraction = inputs.extraction
    for kind, what, how in (("skipped", "dataset record", "skipped"),
                            ("failed", "sample", "failed the check, not stored")):
        reasons = extraction.reasons(kind)
        if reasons:
            total = sum(count for _, count in reasons)
            items.append(LookAt(f"{_plural(total, what)} {how}: " + ", ".join(
                f"{reason} ({count:,})" for reason, count in reasons), "extraction"))
    if inputs.training.metrics is not None and inputs.training.metrics.skipped_lines:
        items.append(LookAt(f"metrics.jsonl: {_plural(inputs.training.metrics.skipped_lines, 'line')} skipped (torn "
                            "or not a record)", "training"))
    for log in inputs.gpu_reset:
        if log.error:
            items.append(LookAt(f"{log.host}: GPU reset report unreadable: {log.error}", "gpu-reset", bad=True))
            continue
        for problem in _strings(log.record.get("health_problems")):
            items.append(LookAt(f"{log.host}: {problem}", "gpu-reset", bad=True))
        left = _dicts(log.record.get("left"))
        if left:
            items.append(LookAt(f"{log.host}: {_plural(len(left), 'process', 'processes')} left running: " + ", ".join(
                f"{p.get('pid', '?')} ({p.get('reason', 'no reason recorded')})" for p in left), "gpu-reset"))
        if log.record.get("check_mode"):
            items.append(LookAt(f"{log.host}: the GPU reset ran in check mode, nothing was signalled", "gpu-reset"))
    if inputs.target_model_path is None:
        items.append(LookAt("target model unknown: no manifest names it, the serving command has a placeholder "
                            "(pass --target-model-path)", "drafter"))
    return items


# -- the headline ---------------------------------------------------------------------------
def _sentence(text: str) -> str:
    return text[:1].upper() + text[1:] + ("" if text.endswith(".") else ".")


def run_verdict(inputs: ReportInputs) -> RunVerdict:
    """The headline, the comparison per chain, the checks and what to look at."""
    checks = [gpu_check(inputs), extraction_check(inputs), training_check(inputs), drafter_check(inputs),
              *evaluation_checks(inputs)]
    verdict = _verdict(inputs)
    chains = chain_comparisons(inputs)
    failed = [c for c in checks if c.outcome == FAIL]
    if failed:
        word = FAILED
        sentence = "Failed: " + "; ".join(c.name for c in failed) + "."
        if verdict is not None and not verdict.get("passed", True):
            sentence += (" The drafter serves far below what its training predicts, or its outputs are not the "
                         "target's own: see what to look at below.")
    elif inputs.acceptance.reason:
        word, sentence = NOT_MEASURED, _sentence(inputs.acceptance.reason)
    elif verdict is None or not verdict.get("judged"):
        word = NOT_JUDGED
        sentence = _sentence(next(c.detail for c in checks if c.label == "not judged"))
    else:
        word = PASSED
        sentence = "Measured acceptance within what the training predicts"
        outputs = next((c for c in checks if c.name.startswith("Outputs equal")), None)
        sentence += (", and the outputs equal the target's own greedy decode." if outputs and outputs.outcome == PASS
                     else "; the outputs were not checked against the target's own greedy decode.")
    simulated_from = (verdict or {}).get("predicted_from") or _record(inputs).get("simulated_from") or \
        inputs.acceptance.simulated_source
    min_ratio = _num((verdict or {}).get("min_ratio"))
    diagnosis = (verdict or {}).get("diagnosis")
    return RunVerdict(word, sentence, chains, simulated_from if isinstance(simulated_from, str) else None, min_ratio,
                      checks, look_at(inputs), _sentence(diagnosis) if isinstance(diagnosis, str) and diagnosis
                      else None)
