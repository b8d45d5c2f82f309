"""The report's page: the values each section shows, prepared here; its markup, in ``templates/``.

The page reads in the order an operator needs it: the verdict first (the headline, measured
against simulated acceptance per chain length, what passed, what to look at), then the charts,
then each stage's details, newest result first, and the run's settings last, folded in a
``<details>`` element, their names never broken mid-word.

The markup is Jinja2 (``templates/page.html.j2``, one template per section under
``templates/sections/``, the shared table and cells in ``templates/macros.html.j2``, the style in
``templates/report.css``): another section, or an operator's own branding, is an edit of a
template. This module gives each section's template its values: text, formatted numbers, and
table rows whose cells are plain values, ``Code`` (shown as code) or ``Mark`` (a word styled as
good or bad); it writes no markup.

Safe by construction: the environment autoescapes every value (only the stylesheet, which holds
no value, is included as it is), and a Content-Security-Policy forbids scripts, remote loads and
everything but the page's own images and inline style, so a value that slipped through could
still run nothing.
"""

from __future__ import annotations

import json
import math
import shlex
import time
from dataclasses import dataclass
from typing import Any

import jinja2

from eagle3_pipeline import __version__
from eagle3_pipeline.report.checks import FAIL, FAILED, PASS, PASSED, RunVerdict, run_verdict
from eagle3_pipeline.report.figures import Figure
from eagle3_pipeline.report.inputs import GpuResetLog, ReportInputs
from eagle3_pipeline.serve.sglang_command import DEFAULT_SPECULATIVE_STEPS, speculative_launch_argv
from eagle3_pipeline.train.variants import flags_of, variant_name

# Where the serving command listens (SGLang's default port).
SERVING_HOST, SERVING_PORT = "127.0.0.1", 30000
# Rows of skipped/failed records shown in full; the rest are counted by reason.
MAX_RECORD_ROWS = 50
CSP = "default-src 'none'; img-src 'self' data:; style-src 'unsafe-inline'; base-uri 'none'; form-action 'none'"
# The page's order: the verdict and the charts first, then the stages from the result back to the
# start, the settings (long, and read least) last. Each key is a template, sections/<key>.html.j2.
SECTIONS = (
    ("verdict", "Verdict"),
    ("charts", "Charts"),
    ("acceptance", "Acceptance: measured vs simulated"),
    ("drafter", "Drafter and serving"),
    ("training", "Training"),
    ("extraction", "Extraction"),
    ("gpu-reset", "GPU reset"),
    ("settings", "Settings"),
)
SHOWN_EXCLUDED = 50  # rows of the excluded held-out prompts (evaluation.json has them all)
Section = dict[str, Any]  # what one section's template reads, as ``s``


@dataclass(frozen=True)
class Code:
    """A table cell shown as code: a path, a command line, a variable's name or value."""

    text: object


@dataclass(frozen=True)
class Mark:
    """A table cell styled by its CSS class: ``ok``, ``bad``, ``outcome ok``..."""

    text: object
    kind: str


def _autoescape(name: str | None) -> bool:
    """Every template is escaped but the stylesheet (CSS, no value in it; escaping would break its quotes)."""
    return not (name or "").endswith(".css")


ENVIRONMENT = jinja2.Environment(
    loader=jinja2.PackageLoader("eagle3_pipeline.report", "templates"), autoescape=_autoescape,
    undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True,
)
ENVIRONMENT.tests.update(code=lambda value: isinstance(value, Code), mark=lambda value: isinstance(value, Mark))


# -- formatting ---------------------------------------------------------------------------
def number(value: object, digits: int = 3) -> str:
    """An int with thousands separators, a float with ``digits`` decimals, anything else as text."""
    if isinstance(value, bool) or value is None:
        return "-" if value is None else str(value)
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        return f"{value:,.{digits}f}" if math.isfinite(value) else str(value)
    return str(value)


def size(num_bytes: object) -> str:
    """Bytes in decimal units (as the seeds count them: 924 GB), with the exact count."""
    if isinstance(num_bytes, bool) or not isinstance(num_bytes, (int, float)):
        return "-"
    value, unit = float(num_bytes), "B"
    for unit in ("B", "kB", "MB", "GB", "TB", "PB"):  # noqa: B007 - the last unit reached is kept
        if abs(value) < 1000 or unit == "PB":
            break
        value /= 1000
    return f"{value:,.0f} {unit}" if unit == "B" else f"{value:,.2f} {unit} ({int(num_bytes):,} bytes)"


def duration(seconds: object) -> str:
    """Seconds as ``12.3 s`` below a minute, else ``H:MM:SS``."""
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not math.isfinite(seconds):
        return "-"
    if seconds < 60:
        return f"{seconds:.2f} s"
    whole = round(seconds)
    return f"{whole // 3600}:{whole % 3600 // 60:02d}:{whole % 60:02d}"


def moment(epoch: float) -> str:
    """Epoch seconds as UTC time."""
    if not isinstance(epoch, (int, float)) or not math.isfinite(epoch):
        return "unknown"
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(epoch))


def as_text(value: object) -> str:
    """A setting's value: strings as they are, everything else as compact JSON."""
    return value if isinstance(value, str) else json.dumps(value, sort_keys=True, default=str)


def per_position(values: object, digits: int = 3) -> str:
    """A per-position list as ``0.325 / 0.289 / ...``."""
    if not isinstance(values, list):
        return "-"
    return " / ".join(number(float(v), digits) if isinstance(v, (int, float)) else str(v) for v in values)


def cell(values: object, k: int) -> str:
    """Position ``k`` of a per-position list, formatted, or ``-``."""
    if isinstance(values, list) and k < len(values) and isinstance(values[k], (int, float)):
        return number(float(values[k]))
    return "-"



# -- sections: each one's values for its template ------------------------------------------
@dataclass
class Page:
    """What the page shows beyond the inputs: the figures drawn and when."""

    training_figures: list[Figure]
    acceptance_figure: Figure | None
    generated_at: float


def figure_item(figure: Figure, alt: str) -> dict:
    """An image beside the page with its caption, or why it is missing (``reason``)."""
    return {"reason": figure.reason, "name": figure.name, "caption": figure.caption, "alt": alt}


def settings_section(inputs: ReportInputs) -> Section:
    """The run's variables, secrets withheld; the template folds them in a closed ``<details>``."""
    settings = inputs.settings
    values = settings.values
    rows = [(Code(key), Code(as_text(value))) for key, value in sorted((values or {}).items())]
    return {"reason": None if values is not None else settings.reason, "source": settings.source, "rows": rows,
            "withheld": list(settings.withheld)}


def _gpu_log(log: GpuResetLog) -> Section:
    """One host's gpu_reset report: its GPUs before and after, what it stopped, left, or would stop."""
    r = log.record
    entry: Section = {"title": log.host if log.label == log.host else f"{log.host} ({log.label})",
                      "check_mode": bool(r.get("check_mode")), "error": log.error}
    if log.error:
        return entry
    timing = []
    if isinstance(r.get("seconds_to_free"), (int, float)):
        timing.append(f"first signal to verified free: {duration(r['seconds_to_free'])}")
    if isinstance(r.get("stop_seconds"), (int, float)):
        timing.append(f"stopping took {duration(r['stop_seconds'])}")
    if isinstance(r.get("wait_seconds"), (int, float)):
        timing.append(f"waiting for free memory took {duration(r['wait_seconds'])}")
    after = {g.get("index"): g for g in r.get("gpus_after") or [] if isinstance(g, dict)}
    gpus = [(g.get("index"), g.get("name", "-"), number(g.get("memory_used_mib")),
             number(after.get(g.get("index"), {}).get("memory_used_mib")),
             {True: "yes", False: "no"}.get(after.get(g.get("index"), {}).get("free"), "-"))
            for g in r.get("gpus_before") or [] if isinstance(g, dict)]
    stopped = [(p.get("pid"), Code(p.get("cmdline", "")), p.get("unit", "-"),
                p.get("signal") or "exited before any signal", duration(p.get("seconds")),
                ", ".join(str(g) for g in p.get("gpus") or []) or "-")
               for p in r.get("stopped") or [] if isinstance(p, dict)]
    would = [(p.get("pid"), Code(p.get("cmdline", "")), p.get("unit", "-"))
             for p in r.get("would_stop") or [] if isinstance(p, dict)]
    left = [(p.get("pid"), Code(p.get("cmdline", "")), p.get("reason", "-"))
            for p in r.get("left") or [] if isinstance(p, dict)]
    nvml = (f"NVML: driver {r.get('driver_version')}" if r.get("nvml_available")
            else f"NVML unavailable: {r.get('nvml_reason') or 'no reason recorded'}")
    return {**entry, "nvml": nvml, "written": moment(log.written_at), "file": log.path.name,
            "timing": "; ".join(timing), "gpus": gpus, "stopped": stopped, "would": would, "left": left,
            "problems": [str(p) for p in r.get("health_problems") or []]}


def gpu_reset_section(inputs: ReportInputs) -> Section:
    """Per host: what was stopped, how long until the GPUs were free."""
    return {"reason": inputs.gpu_reset_reason, "count": len(inputs.gpu_reset), "directory": inputs.gpu_reset_dir,
            "logs": [] if inputs.gpu_reset_reason else [_gpu_log(log) for log in inputs.gpu_reset]}


def _records_rows(records: object) -> list[tuple]:
    return [(r.get("line", "-"), Code(r.get("id", "-")), r.get("reason", "-"), r.get("detail", ""))
            for r in (records if isinstance(records, list) else [])[:MAX_RECORD_ROWS] if isinstance(r, dict)]


def _storage(manifest: dict) -> str:
    """The manifest's storage dtype, with its scales when quantized (extract/storage.py)."""
    stored = manifest.get("storage_dtype") or manifest.get("dtype", "-")
    storage = manifest.get("storage") if isinstance(manifest.get("storage"), dict) else {}
    if not storage.get("quantized"):
        return f"{stored} (as captured)"
    scales = storage.get("scales") if isinstance(storage.get("scales"), dict) else {}
    return (f"{stored}, one {scales.get('dtype', '-')} scale per token and captured layer; read back as "
            f"{storage.get('read_as', '-')}")


def extraction_section(inputs: ReportInputs) -> Section:
    """Samples, tokens, bytes, skipped and failed records with reasons, throughput."""
    stats = inputs.extraction
    m = stats.manifest
    if m is None:
        return {"reason": stats.reason or "not measured"}
    tokens, stored = m.get("num_tokens"), m.get("bytes")
    per_token = stored / tokens if isinstance(stored, (int, float)) and isinstance(tokens, int) and tokens else None
    dataset = m.get("dataset") if isinstance(m.get("dataset"), dict) else {}
    skipped = m.get("skipped") if isinstance(m.get("skipped"), list) else []
    failed = m.get("failed") if isinstance(m.get("failed"), list) else []
    rows = [
        ("data directory", Code(stats.data_dir)),
        ("dataset", f"{dataset.get('name', '-')} (sha256 {str(dataset.get('sha256', '-'))[:16]}...)"),
        ("engine", f"{m.get('engine', '-')} {m.get('engine_version', '')}".strip()),
        ("target model", Code(m.get("target_model_path", "-"))),
        ("aux layers (0-based, output of the layer)", as_text(m.get("aux_layers"))),
        ("hidden size / layers / vocabulary",
         f"{number(m.get('hidden_size'))} / {number(m.get('num_hidden_layers'))} / {number(m.get('vocab_size'))}"),
        ("dtype, max length", f"{m.get('dtype', '-')}, {number(m.get('max_length'))} ({m.get('overflow', '-')})"),
        ("hidden states stored as", _storage(m)),
        ("records in the dataset", number(m.get("num_records"))),
        ("samples stored (verified)", number(m.get("num_samples"))),
        ("tokens", number(tokens)),
        ("loss tokens (assistant turns)", number(m.get("num_loss_tokens"))),
        ("bytes on disk", size(stored)),
        ("bytes per token", number(per_token, 0) if per_token else "-"),
        ("skipped records", number(len(skipped))),
        ("failed samples", number(len(failed))),
    ]
    throughput = [(t.part, t.state, number(t.done), number(t.tokens), number(t.tokens_per_s, 1),
                   duration(t.elapsed_s)) for t in stats.throughput]
    kinds = [{"label": label, "count": len(records), "reasons": stats.reasons(kind), "rows": _records_rows(records),
              "shown": f" (first {MAX_RECORD_ROWS} of {len(records)})" if len(records) > MAX_RECORD_ROWS else ""}
             for kind, records, label in (("skipped", skipped, "Skipped records"), ("failed", failed, "Failed samples"))
             if records]
    return {"reason": None, "rows": rows, "throughput": throughput, "data_dir": stats.data_dir, "kinds": kinds}


def training_section(inputs: ReportInputs, page: Page) -> Section:
    """The training's figures, per-position accuracy and charts."""
    training = inputs.training
    if training.metrics is None:
        return {"reason": training.reason or "not measured"}
    record = training.record or {}
    last_train, last_eval = training.last("train"), training.last("eval")
    steps = f"{number(record.get('steps', last_train and last_train['step']))} of {number(record.get('total_steps'))}"
    rows = [
        ("training directory", Code(training.directory)),
        ("state", "finished (training.json written)" if training.record else "not finished: no training.json yet"),
        ("steps", steps),
        ("device, processes, dtype",
         f"{record.get('device', '-')}, {record.get('world', '-')}, {record.get('dtype', '-')}"),
        ("draft vocabulary", f"{number(record.get('draft_vocab_size'))} tokens, covering "
                             f"{number(record.get('draft_vocab_coverage'))} of the loss tokens"),
    ]
    if last_train:
        rows += [("last training step", f"step {last_train['step']}: loss {number(last_train.get('loss'))}, "
                                        f"simulated acceptance length {number(last_train.get('acceptance_length'))}, "
                                        f"{number(last_train.get('tokens_per_s'), 0)} tokens/s")]
    if last_eval:
        rows += [("held-out evaluation", f"step {last_eval['step']} ({number(last_eval.get('samples'))} samples): "
                                         f"loss {number(last_eval.get('loss'))}, simulated acceptance length "
                                         f"{number(last_eval.get('acceptance_length'))}")]
        opening = last_eval.get("opening")
        if isinstance(opening, dict):
            walked = opening.get("rounds") if isinstance(opening.get("rounds"), dict) else {}
            chains = sorted((int(chain), figures) for chain, figures in walked.items()
                            if str(chain).isdigit() and isinstance(figures, dict))
            walk = "; walked round by round as serving drafts them: tau " + ", ".join(
                f"{number(figures.get('tau'))} at {chain}" for chain, figures in chains) if chains else ""
            rows += [("held-out, served first answers",
                      f"what serving first answers of {number(opening.get('tokens'), 0)} tokens drafts "
                      f"({number(opening.get('rows'), 0)} tokens): simulated acceptance length "
                      f"{number(opening.get('acceptance_length'))} (per token){walk}")]
    if training.metrics.skipped_lines:
        rows.append(("metrics lines skipped", f"{training.metrics.skipped_lines} (torn or not a record)"))
    opening = last_eval.get("opening") if last_eval else None
    opening = {**opening, "step": last_eval["step"]} if isinstance(opening, dict) else None
    sources = [(label, r) for label, r in (("held-out", last_eval), ("held-out, served first answers", opening),
                                           ("train", last_train)) if r]
    positions = max((len(r.get("acc_k") or []) for _, r in sources), default=0)
    headers = ["position k"]
    for label, r in sources:
        headers += [f"acc_k ({label}, step {r['step']})", f"cond_acc_k ({label})"]
    accuracy = []
    for k in range(positions):
        row: list[object] = [k]
        for _, r in sources:
            row += [cell(r.get("acc_k"), k), cell(r.get("cond_acc_k"), k)]
        accuracy.append(row)
    return {"reason": None, "rows": rows, "headers": headers, "accuracy": accuracy,
            "charts": bool(page.training_figures)}


def _recorded_simulated_tau(record: dict) -> str:
    """evaluation.json's own simulated tau (1 + the training's acceptance length), with its source."""
    tau = record.get("simulated_tau")
    length = record.get("simulated_acceptance_length")
    if not isinstance(tau, (int, float)) and isinstance(length, (int, float)) and not isinstance(length, bool):
        tau = 1 + length
    if not isinstance(tau, (int, float)) or isinstance(tau, bool):
        return "-"
    source = record.get("simulated_from")
    return f"{number(float(tau))}" + (f" ({source})" if isinstance(source, str) and source else "")


def positions_view(record: dict) -> Section | None:
    """How the evaluation's verdict judged each draft position: rounds, measured, its 99 % bound, predicted."""
    verdict = record.get("verdict") if isinstance(record.get("verdict"), dict) else {}
    positions = [p for p in verdict.get("positions") or [] if isinstance(p, dict)]
    if not positions:
        return None
    rows = [(number(p.get("draft_tokens")), number(p.get("position")), number(p.get("rounds")),
             number(p.get("measured")), number(p.get("upper_99")), number(p.get("predicted")),
             number(p.get("predicted_rounds")), number(p.get("predicted_lower_99")),
             "yes" if p.get("judged") else "no: too few rounds",
             Mark("yes", "ok") if p.get("ok") and p.get("judged") else
             Mark("BELOW", "bad") if p.get("ok") is False else "-") for p in positions]
    ratio = verdict.get("min_ratio")
    return {"rows": rows, "min_rounds": verdict.get("min_rounds", "-"),
            "min_ratio": number(ratio) if isinstance(ratio, (int, float)) else "-",
            "predicted_from": verdict.get("predicted_from") or "source not recorded"}


def chain_runs(record: dict) -> list[tuple]:
    """Measured against predicted at every chain length the evaluation ran (SpecForge's 3-1-4 and 7-1-8)."""
    return [(number(run.get("draft_tokens")), number(run.get("tau")), number(run.get("predicted_tau")),
             per_position(run.get("conditional_acceptance_per_position")),
             per_position(run.get("predicted_conditional_acceptance")), number(run.get("tokens_per_s"), 1),
             f"{number(run.get('speedup'), 2)}x" if isinstance(run.get("speedup"), (int, float)) else "-")
            for run in record.get("runs") or [] if isinstance(run, dict)]


def excluded_view(record: dict) -> Section | None:
    """Held-out prompts left out because the training data has them, they repeat one, or they are longer than the
    training's samples."""
    excluded = [e for e in record.get("excluded_prompts") or [] if isinstance(e, dict)]
    if not excluded:
        return None
    rows = [(as_text(e.get("id")), number(e.get("line")), as_text(e.get("reason")), as_text(e.get("other")))
            for e in excluded[:SHOWN_EXCLUDED]]
    return {"count": len(excluded), "rows": rows, "more": max(len(excluded) - SHOWN_EXCLUDED, 0)}


def _reference_check(record: dict) -> tuple[str, object] | None:
    """The row that says whether the drafted outputs equal the target's own greedy decode."""
    check = record.get("reference_check") if isinstance(record.get("reference_check"), dict) else None
    if check is not None and check.get("checked"):
        mismatches = [m for m in check.get("mismatches") or [] if isinstance(m, dict)]
        faults = [m for m in mismatches if not m.get("near_tie")]
        text = "yes, every output" if not mismatches else (
            f"{len(mismatches) - len(faults)} differ at a numerical near-tie (logit gaps "
            f"{', '.join(number(m.get('logit_gap'), 3) for m in mismatches if m.get('near_tie'))}), "
            f"{len(faults)} differ otherwise")
        return (f"output equals the target's own greedy decode ({as_text(check.get('method'))})",
                Mark(text, "bad" if faults else "ok"))
    if "outputs_match_target" in record:
        match = record["outputs_match_target"]
        mismatches = record.get("output_mismatches")
        return ("output equals the target's own greedy decode",
                Mark("yes", "ok") if match is True
                else Mark(f"no: {as_text(mismatches)}", "bad") if match is False else "not checked")
    return None


def acceptance_section(inputs: ReportInputs, page: Page) -> Section:
    """Measured tau and acceptance per position beside the training's simulation."""
    acceptance, evaluation = inputs.acceptance, inputs.evaluation
    simulated_line = None
    if acceptance.simulated_rates is not None:
        simulated_line = (f"Simulated by the training ({acceptance.simulated_source}): P(draft position k "
                          f"accepted) {per_position(acceptance.simulated_rates)}.")
    if acceptance.reason:
        return {"reason": acceptance.reason, "simulated_line": simulated_line}
    record = evaluation.record or {}
    measured = acceptance.measured_rates or []
    rows: list[tuple[object, object]] = [
        ("measured acceptance length tau (tokens per target forward)", number(acceptance.measured_tau)),
        (f"simulated tau over the same {len(measured) or '-'} draft positions (1 + the sum of the training's "
         "P(accepted) per position)", number(acceptance.simulated_tau)),
        ("simulated tau as evaluation.json records it (1 + the training's acceptance length over all its "
         "positions)", _recorded_simulated_tau(record)),
        ("engine", as_text(record.get("engine", "-"))),
        ("held-out prompts, draft tokens per forward", f"{number(record.get('prompts'))}, "
                                                       f"{number(record.get('draft_tokens'))}"),
    ]
    if "target_forwards" in record:
        rows.append(("target forwards (verify), tokens generated",
                     f"{number(record.get('target_forwards'))}, {number(record.get('tokens_generated'))}"))
    if isinstance(record.get("sglang_accept_length"), (int, float)) and record.get("engine") == "sglang":
        rows.append(("SGLang's accept length (completion tokens / verify forwards)",
                     number(record["sglang_accept_length"])))
    if "tokens_per_s" in record:
        rows.append(("tokens/s with drafting", number(record.get("tokens_per_s"), 1)))
    reach = record.get("draft_vocabulary")
    if isinstance(reach, dict) and isinstance(reach.get("share_outside"), (int, float)):
        size = number(reach.get("draft_vocab_size"))
        rows.append((f"the target's answer tokens outside the draft vocabulary of {size} (never draftable)",
                     f"{number(reach.get('outside'))} of {number(reach.get('answer_tokens'))} "
                     f"({reach['share_outside']:.1%})"))
    alone = record.get("target_alone")
    if isinstance(alone, dict):
        rows.append(("tokens/s of the target alone (same engine, prompts and batches, greedy, no drafter)",
                     number(alone.get("tokens_per_s"), 1)))
    check = _reference_check(record)
    if check is not None:
        rows.append(check)
    rows.append(("record", Code(evaluation.path)))
    simulated = acceptance.simulated_rates or []
    conditional = record.get("conditional_acceptance_per_position")
    per_k = [(k, number(measured[k]), cell(conditional, k), number(simulated[k]) if k < len(simulated) else "-")
             for k in range(len(measured))]
    return {"reason": None, "simulated_line": simulated_line, "rows": rows, "runs": chain_runs(record),
            "positions": positions_view(record), "excluded": excluded_view(record), "per_k": per_k,
            "notes": [note for note in (acceptance.note, record.get("note")) if isinstance(note, str) and note],
            "chart": page.acceptance_figure is not None}


def serving_argv(inputs: ReportInputs) -> list[str]:
    """SGLang serving the target with the drafter (``serve.sglang_command.speculative_launch_argv``).

    The chain length is the one the evaluation measured (its ``draft_tokens``), else SGLang's
    default; the tensor-parallel size is the run's ``sglang_server_tp_size``, else 1.
    """
    steps = (inputs.evaluation.record or {}).get("draft_tokens")
    tp_size = (inputs.settings.values or {}).get("sglang_server_tp_size")
    return speculative_launch_argv(
        "python", inputs.target_model_path or "<target model path>", str(inputs.drafter.directory), SERVING_PORT,
        tp_size=tp_size if _positive_int(tp_size) else 1,
        num_steps=steps if _positive_int(steps) else DEFAULT_SPECULATIVE_STEPS, host=SERVING_HOST,
    )


def _positive_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def drafter_section(inputs: ReportInputs) -> Section:
    """Where the drafter is, what it is, and the SGLang command that serves it."""
    drafter = inputs.drafter
    rows = None
    if drafter.config is not None:
        config = drafter.config
        eagle = config.get("eagle_config") if isinstance(config.get("eagle_config"), dict) else {}
        rows = [
            ("directory", Code(drafter.directory)),
            ("architecture", as_text(config.get("architectures", "-"))),
            ("variant (SGLang's flags)", _variant(config)),
            ("draft vocabulary", number(config.get("draft_vocab_size"))),
            ("target hidden size", number(config.get("target_hidden_size"))),
            ("aux layers it reads", as_text(eagle.get("eagle_aux_hidden_state_layer_ids", "-"))),
            ("weights (model.safetensors)", size(drafter.weights_bytes)),
        ]
    return {"reason": drafter.reason or "no drafter", "rows": rows, "command": shlex.join(serving_argv(inputs)),
            "target_known": inputs.target_model_path is not None}


def _variant(config: dict) -> str:
    """eagle3 or eagle3.1, with the EAGLE 3.1 flags the config sets (train/variants.py)."""
    flags = flags_of(config)
    set_flags = [key for key, value in sorted(flags.items()) if value]
    return variant_name(flags) + (f" ({', '.join(set_flags)})" if set_flags else "")


def _chain_of(inputs: ReportInputs) -> str:
    """`` at N drafts``: the chain length the headline taus are for, or nothing when unknown."""
    chain = (inputs.evaluation.record or {}).get("draft_tokens")
    return f" at {chain} drafts" if isinstance(chain, int) and not isinstance(chain, bool) else ""


def summary_cards(inputs: ReportInputs) -> list[tuple[str, str]]:
    """The run at a glance: (label, value)."""
    m = inputs.extraction.manifest or {}
    acceptance = inputs.acceptance
    verdict = (inputs.evaluation.record or {}).get("verdict")
    return [
        ("measured acceptance length tau" + _chain_of(inputs), number(acceptance.measured_tau, 2)
         if not acceptance.reason else "not measured"),
        ("evaluation verdict", "-" if not isinstance(verdict, dict) else
         "passed" if verdict.get("passed", True) else "FAILED"),
        ("simulated tau (training)" + _chain_of(inputs), number(acceptance.simulated_tau, 2)
         if acceptance.simulated_tau else "-"),
        ("samples", number(m.get("num_samples"))),
        ("tokens", number(m.get("num_tokens"))),
        ("hidden states on disk", size(m.get("bytes")).split(" (")[0]),
        ("training steps", number((inputs.training.record or {}).get("steps"))),
    ]


def chains_rows(verdict: RunVerdict) -> list[tuple]:
    """Measured tau against the training's simulated tau at each chain length the evaluation ran."""
    rows = []
    for chain in verdict.chains:
        simulated = number(chain.simulated_tau, 2) if chain.simulated_tau is not None else \
            f"- ({chain.why_not_simulated})"
        ratio = (f"{chain.measured_tau / chain.simulated_tau:.0%}" if chain.measured_tau is not None
                 and chain.simulated_tau else "-")
        judged = ("none (too few rounds)" if not chain.judged else
                  Mark(f"{chain.judged} judged, all within", "ok") if not chain.below else
                  Mark(f"{chain.judged} judged, {chain.below} below", "bad"))
        replayed = number(chain.replayed_tau, 2) if chain.replayed_tau is not None else "-"
        rows.append((number(chain.draft_tokens), number(chain.measured_tau, 2), replayed, simulated, ratio, judged))
    return rows


def _outcome(outcome: str, shown: str) -> Mark:
    return Mark(shown, "outcome " + ("ok" if outcome == PASS else "bad" if outcome == FAIL else "muted"))


def verdict_section(inputs: ReportInputs, verdict: RunVerdict) -> Section:
    """The page's first section: the headline, measured against simulated, what passed, what to look at."""
    rates = inputs.acceptance.simulated_rates
    return {
        "kind": {PASSED: "passed", FAILED: "failed"}.get(verdict.word, "pending"), "word": verdict.word,
        "sentence": verdict.sentence, "cards": summary_cards(inputs), "chains": chains_rows(verdict),
        "simulated_from": verdict.simulated_from, "diagnosis": verdict.diagnosis,
        "simulated_source": inputs.acceptance.simulated_source,
        "simulated_alone": number(1 + sum(rates), 2) if rates else None, "positions": len(rates or []),
        "checks": [(c.name, _outcome(c.outcome, c.shown), c.detail) for c in verdict.checks],
        "look_at": verdict.look_at,
    }


def charts_section(inputs: ReportInputs, page: Page) -> Section:
    """Every chart: the measured acceptance first, then the training's; why one is missing in its place."""
    figures = []
    if page.acceptance_figure is not None:
        figures.append(figure_item(page.acceptance_figure, "acceptance per draft position, measured vs simulated"))
    else:
        figures.append({"reason": f"acceptance chart not drawn: {inputs.acceptance.reason or 'nothing measured'}"})
    if page.training_figures:
        figures += [figure_item(f, f"training chart {f.name}") for f in page.training_figures]
    else:
        figures.append({"reason": f"training charts not drawn: {inputs.training.reason or 'no training metrics'}"})
    return {"figures": figures}


def render_page(inputs: ReportInputs, page: Page) -> str:
    """The whole ``index.html``: ``templates/page.html.j2`` with each section's values."""
    name = inputs.output_dir.resolve().name or str(inputs.output_dir)
    sections = {
        "verdict": verdict_section(inputs, run_verdict(inputs)),
        "charts": charts_section(inputs, page),
        "acceptance": acceptance_section(inputs, page),
        "drafter": drafter_section(inputs),
        "training": training_section(inputs, page),
        "extraction": extraction_section(inputs),
        "gpu-reset": gpu_reset_section(inputs),
        "settings": settings_section(inputs),
    }
    return ENVIRONMENT.get_template("page.html.j2").render(
        name=name, csp=CSP, version=__version__, order=SECTIONS, sections=sections,
        where=f"Run output {inputs.output_dir.resolve()}; report generated {moment(page.generated_at)}.",
    )
