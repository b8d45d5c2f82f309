"""The report's HTML: one page, inline CSS, images by relative file name, no script, no network.

The page reads in the order an operator needs it: the verdict first (the headline, measured
against simulated acceptance per chain length, what passed, what to look at), then the charts,
then each stage's details, newest result first, and the run's settings last, folded in a
``<details>`` element, their names never broken mid-word.

Safe by construction: every value is escaped by ``esc`` unless it is an ``Html`` fragment built
here, and a Content-Security-Policy forbids scripts, remote loads and everything but the page's
own images and inline style, so a value that slipped through could still run nothing.
"""

from __future__ import annotations

import html
import json
import math
import shlex
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from eagle3_pipeline import __version__
from eagle3_pipeline.report.checks import FAIL, FAILED, PASS, PASSED, RunVerdict, run_verdict
from eagle3_pipeline.report.figures import Figure
from eagle3_pipeline.report.inputs import GpuResetLog, ReportInputs
from eagle3_pipeline.serve.sglang_command import DEFAULT_SPECULATIVE_STEPS, speculative_launch_argv

# Where the serving command listens (SGLang's default port).
SERVING_HOST, SERVING_PORT = "127.0.0.1", 30000
# Rows of skipped/failed records shown in full; the rest are counted by reason.
MAX_RECORD_ROWS = 50
CSP = "default-src 'none'; img-src 'self' data:; style-src 'unsafe-inline'; base-uri 'none'; form-action 'none'"
# The page's order: the verdict and the charts first, then the stages from the result back to the
# start, the settings (long, and read least) last.
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
STYLE = """
:root { color-scheme: light; --fg: #1d2430; --muted: #5b6577; --line: #d8dde6; --bg: #f6f8fb; --accent: #1f6feb; }
* { box-sizing: border-box; }
body { margin: 0; font: 15px/1.5 system-ui, -apple-system, "Segoe UI", Roboto, sans-serif; color: var(--fg);
       background: var(--bg); }
header, main, footer { max-width: 1200px; margin: 0 auto; padding: 0 24px; }
header { padding-top: 24px; }
h1 { margin: 0 0 4px; font-size: 26px; }
h2 { margin: 0 0 12px; font-size: 20px; border-bottom: 1px solid var(--line); padding-bottom: 6px; }
h3 { margin: 18px 0 8px; font-size: 16px; }
a { color: var(--accent); }
nav a { margin-right: 14px; text-decoration: none; }
section { background: #fff; border: 1px solid var(--line); border-radius: 8px; padding: 16px 20px; margin: 18px 0; }
.muted, figcaption { color: var(--muted); }
.cards { display: grid; grid-template-columns: repeat(auto-fit, minmax(140px, 1fr)); gap: 12px; }
.card { background: #fff; border: 1px solid var(--line); border-radius: 8px; padding: 10px 14px; }
.card .value { font-size: 20px; font-weight: 600; overflow-wrap: anywhere; }
.card .label { color: var(--muted); font-size: 13px; }
table { border-collapse: collapse; margin: 6px 0 12px; font-size: 14px; }
th, td { border: 1px solid var(--line); padding: 4px 8px; text-align: left; vertical-align: top; }
th { background: var(--bg); font-weight: 600; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
/* Paths and command lines (code) may break anywhere, so that one cannot widen the page; prose breaks
   a word only where it cannot fit, so that a column is never narrower than its longest word. */
td.wrap { overflow-wrap: break-word; }
td code { overflow-wrap: anywhere; word-break: break-word; }
/* A variable's name is read as one word: never broken, its value wraps instead. */
td.nowrap, td.nowrap code { white-space: nowrap; overflow-wrap: normal; word-break: normal; }
table.settings { width: 100%; }
.scroll { overflow-x: auto; }
details > summary { cursor: pointer; color: var(--accent); margin: 4px 0 8px; }
.headline { display: flex; align-items: baseline; gap: 14px; flex-wrap: wrap; border-radius: 8px;
            padding: 10px 16px; margin: 0 0 14px; border: 1px solid var(--line); background: var(--bg); }
.headline .word { font-size: 28px; font-weight: 700; letter-spacing: 0.02em; }
.headline.passed { background: #e9f7ee; border-color: #9bd3ae; }
.headline.passed .word { color: #1a7f37; }
.headline.failed { background: #fdeceb; border-color: #f1a9a3; }
.headline.failed .word { color: #b42318; }
.headline.pending .word { color: #9a6700; }
.outcome { white-space: nowrap; }
.look li { margin: 2px 0; }
code, pre { font-family: ui-monospace, SFMono-Regular, Menlo, Consolas, monospace; font-size: 13px; }
pre { background: #0f1720; color: #e6edf3; padding: 12px; border-radius: 6px; overflow-x: auto; }
.missing { border-left: 4px solid #d29922; background: #fff8e6; padding: 8px 12px; margin: 8px 0; }
.bad { color: #b42318; font-weight: 600; }
.ok { color: #1a7f37; font-weight: 600; }
figure { margin: 12px 0 20px; }
figure img { max-width: 100%; height: auto; border: 1px solid var(--line); border-radius: 4px; background: #fff; }
footer { padding-bottom: 32px; font-size: 13px; }
"""


class Html(str):
    """A fragment of HTML that is already safe: built here, with every value escaped."""


def esc(value: object) -> Html:
    """Escape a value for HTML text or a double-quoted attribute; ``Html`` passes as it is."""
    if isinstance(value, Html):
        return value
    return Html(html.escape(str(value), quote=True))


def join(parts: Iterable[object], sep: str = "\n") -> Html:
    """Concatenate fragments, escaping the ones that are not ``Html``."""
    return Html(sep.join(esc(p) for p in parts))


def tag(name: str, content: object = "", **attrs: object) -> Html:
    """``<name attr="...">content</name>``; attribute values and content are escaped (``class_`` -> class)."""
    rendered = "".join(f' {key.rstrip("_").replace("_", "-")}="{esc(value)}"'
                       for key, value in attrs.items() if value is not None)
    return Html(f"<{name}{rendered}>{esc(content)}</{name}>")


def table(headers: Sequence[str] | None, rows: Iterable[Sequence[object]], numeric: Sequence[int] = (),
          nowrap: Sequence[int] = (), class_: str | None = None) -> Html:
    """A table (no header row when ``headers`` is None); cells are escaped unless ``Html``; columns in
    ``numeric`` are right-aligned, columns in ``nowrap`` never break their text (in the others a word
    breaks only where it cannot fit, and ``<code>`` anywhere, so that a long path cannot widen the page)."""
    head = tag("thead", tag("tr", join((tag("th", h) for h in headers), ""))) if headers else Html("")
    body = []
    for row in rows:
        cells = [tag("td", cell, class_="num" if i in numeric else "nowrap" if i in nowrap else "wrap")
                 for i, cell in enumerate(row)]
        body.append(tag("tr", join(cells, "")))
    return tag("table", join([head, tag("tbody", join(body))]), class_=class_)


def missing(reason: str) -> Html:
    """The box that says why a figure is not there."""
    return tag("p", reason[:1].upper() + reason[1:], class_="missing")


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


# -- sections -----------------------------------------------------------------------------
@dataclass
class Page:
    """What the page shows beyond the inputs: the figures drawn and when."""

    training_figures: list[Figure]
    acceptance_figure: Figure | None
    generated_at: float


def charts_link() -> Html:
    """A link to the Charts section, for the sections whose charts moved there."""
    return tag("a", "Charts", href="#charts")


def figure_html(figure: Figure, alt: str) -> Html:
    """An ``<img>`` of a PNG beside the page, with its caption, or why it is missing."""
    if figure.reason:
        return missing(figure.reason)
    return tag("figure", join([Html(f'<img src="{esc(figure.name)}" alt="{esc(alt)}" loading="eager">'),
                               tag("figcaption", figure.caption)]))


def settings_section(inputs: ReportInputs) -> Html:
    """The run's variables, secrets withheld, folded: a ``<details>`` closed until the reader opens it.

    The names never break (a ``nowrap`` column); the values wrap where they must.
    """
    settings = inputs.settings
    parts: list[object] = []
    if settings.values is None:
        parts.append(missing(f"settings {settings.reason}"))
    else:
        count = len(settings.values)
        parts.append(tag("p", f"{count} variables, from {settings.source}.", class_="muted"))
        rows = [(tag("code", key), tag("code", as_text(value))) for key, value in sorted(settings.values.items())]
        parts.append(tag("details", join([
            tag("summary", f"Show the {count} variables"),
            tag("div", table(["variable", "value"], rows, nowrap=(0,), class_="settings"), class_="scroll"),
        ])))
    if settings.withheld:
        parts.append(tag("p", "Withheld as secrets (never written to the report): " + ", ".join(settings.withheld),
                         class_="muted"))
    return join(parts)


def _gpu_log_html(log: GpuResetLog) -> Html:
    r = log.record
    title = log.host if log.label == log.host else f"{log.host} ({log.label})"
    parts: list[object] = [tag("h3", title + (" - check mode, nothing signalled" if r.get("check_mode") else ""))]
    if log.error:
        return join([*parts, missing(f"unreadable: {log.error}")])
    nvml = (f"NVML: driver {r.get('driver_version')}" if r.get("nvml_available")
            else f"NVML unavailable: {r.get('nvml_reason') or 'no reason recorded'}")
    parts.append(tag("p", f"{nvml}. Report written {moment(log.written_at)} ({log.path.name})."))
    free_line = []
    if isinstance(r.get("seconds_to_free"), (int, float)):
        free_line.append(f"first signal to verified free: {duration(r['seconds_to_free'])}")
    if isinstance(r.get("stop_seconds"), (int, float)):
        free_line.append(f"stopping took {duration(r['stop_seconds'])}")
    if isinstance(r.get("wait_seconds"), (int, float)):
        free_line.append(f"waiting for free memory took {duration(r['wait_seconds'])}")
    if free_line:
        parts.append(tag("p", "; ".join(free_line) + "."))
    after = {g.get("index"): g for g in r.get("gpus_after") or [] if isinstance(g, dict)}
    gpus = [g for g in r.get("gpus_before") or [] if isinstance(g, dict)]
    if gpus:
        rows = [(g.get("index"), g.get("name", "-"), number(g.get("memory_used_mib")),
                 number(after.get(g.get("index"), {}).get("memory_used_mib")),
                 {True: "yes", False: "no"}.get(after.get(g.get("index"), {}).get("free"), "-"))
                for g in gpus]
        parts.append(table(["GPU", "name", "MiB used before", "MiB used after", "free"], rows, numeric=(0, 2, 3)))
    stopped = [p for p in r.get("stopped") or [] if isinstance(p, dict)]
    if stopped:
        rows = [(p.get("pid"), tag("code", p.get("cmdline", "")), p.get("unit", "-"),
                 p.get("signal") or "exited before any signal", duration(p.get("seconds")),
                 ", ".join(str(g) for g in p.get("gpus") or []) or "-") for p in stopped]
        parts += [tag("p", f"Stopped {len(stopped)} process(es):"),
                  table(["PID", "command line", "unit", "signal", "seconds to exit", "GPUs"], rows, numeric=(0,))]
    would = [p for p in r.get("would_stop") or [] if isinstance(p, dict)]
    if would:
        rows = [(p.get("pid"), tag("code", p.get("cmdline", "")), p.get("unit", "-")) for p in would]
        parts += [tag("p", f"Would stop {len(would)} process(es):"),
                  table(["PID", "command line", "unit"], rows, numeric=(0,))]
    left = [p for p in r.get("left") or [] if isinstance(p, dict)]
    if left:
        rows = [(p.get("pid"), tag("code", p.get("cmdline", "")), p.get("reason", "-")) for p in left]
        parts += [tag("p", f"Left running ({len(left)}):"), table(["PID", "command line", "why"], rows, numeric=(0,))]
    if not stopped and not would and not left:
        parts.append(tag("p", "No process held the GPUs: nothing was stopped."))
    problems = [str(p) for p in r.get("health_problems") or []]
    if problems:
        parts.append(tag("ul", join(tag("li", p, class_="bad") for p in problems)))
    return join(parts)


def gpu_reset_section(inputs: ReportInputs) -> Html:
    """Per host: what was stopped, how long until the GPUs were free."""
    if inputs.gpu_reset_reason:
        return missing(inputs.gpu_reset_reason)
    intro = tag("p", f"{len(inputs.gpu_reset)} report(s) from {inputs.gpu_reset_dir}.", class_="muted")
    return join([intro, *(_gpu_log_html(log) for log in inputs.gpu_reset)])


def _records_table(records: object) -> Html:
    rows = [(r.get("line", "-"), tag("code", r.get("id", "-")), r.get("reason", "-"), r.get("detail", ""))
            for r in (records if isinstance(records, list) else [])[:MAX_RECORD_ROWS] if isinstance(r, dict)]
    return table(["line", "id", "reason", "detail"], rows, numeric=(0,))


def _storage(manifest: dict) -> str:
    """The manifest's storage dtype, with its scales when quantized (extract/storage.py)."""
    stored = manifest.get("storage_dtype") or manifest.get("dtype", "-")
    storage = manifest.get("storage") if isinstance(manifest.get("storage"), dict) else {}
    if not storage.get("quantized"):
        return f"{stored} (as captured)"
    scales = storage.get("scales") if isinstance(storage.get("scales"), dict) else {}
    return (f"{stored}, one {scales.get('dtype', '-')} scale per token and captured layer; read back as "
            f"{storage.get('read_as', '-')}")


def extraction_section(inputs: ReportInputs) -> Html:
    """Samples, tokens, bytes, skipped and failed records with reasons, throughput."""
    stats = inputs.extraction
    m = stats.manifest
    if m is None:
        return missing(stats.reason or "not measured")
    tokens, stored = m.get("num_tokens"), m.get("bytes")
    per_token = stored / tokens if isinstance(stored, (int, float)) and isinstance(tokens, int) and tokens else None
    dataset = m.get("dataset") if isinstance(m.get("dataset"), dict) else {}
    skipped = m.get("skipped") if isinstance(m.get("skipped"), list) else []
    failed = m.get("failed") if isinstance(m.get("failed"), list) else []
    rows = [
        ("data directory", tag("code", stats.data_dir)),
        ("dataset", f"{dataset.get('name', '-')} (sha256 {str(dataset.get('sha256', '-'))[:16]}...)"),
        ("engine", f"{m.get('engine', '-')} {m.get('engine_version', '')}".strip()),
        ("target model", tag("code", m.get("target_model_path", "-"))),
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
    parts: list[object] = [table(None, rows)]
    if stats.throughput:
        trows = [(t.part, t.state, number(t.done), number(t.tokens), number(t.tokens_per_s, 1), duration(t.elapsed_s))
                 for t in stats.throughput]
        parts += [tag("h3", "Throughput"),
                  tag("p", "Each part's last progress record (a resumed part counts from its last start).",
                      class_="muted"),
                  table(["part", "state", "samples", "tokens", "tokens/s", "elapsed"], trows, numeric=(2, 3, 4))]
    else:
        parts.append(missing(f"throughput not recorded: no {stats.data_dir}/parts/*.progress.json"))
    for kind, records, label in (("skipped", skipped, "Skipped records"), ("failed", failed, "Failed samples")):
        if not records:
            continue
        shown = f" (first {MAX_RECORD_ROWS} of {len(records)})" if len(records) > MAX_RECORD_ROWS else ""
        parts += [tag("h3", f"{label}: {len(records)}"),
                  table(["reason", "count"], stats.reasons(kind), numeric=(1,)),
                  tag("p", f"Records{shown}:", class_="muted"), _records_table(records)]
    return join(parts)


def training_section(inputs: ReportInputs, page: Page) -> Html:
    """The training's figures, per-position accuracy and charts."""
    training = inputs.training
    if training.metrics is None:
        return missing(training.reason or "not measured")
    record = training.record or {}
    last_train, last_eval = training.last("train"), training.last("eval")
    steps = f"{number(record.get('steps', last_train and last_train['step']))} of {number(record.get('total_steps'))}"
    rows = [
        ("training directory", tag("code", training.directory)),
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
    parts: list[object] = [table(None, rows), tag("h3", "Accuracy per draft position")]
    opening = last_eval.get("opening") if last_eval else None
    opening = {**opening, "step": last_eval["step"]} if isinstance(opening, dict) else None
    sources = [(label, r) for label, r in (("held-out", last_eval), ("held-out, served first answers", opening),
                                           ("train", last_train)) if r]
    positions = max((len(r.get("acc_k") or []) for _, r in sources), default=0)
    headers = ["position k"]
    for label, r in sources:
        headers += [f"acc_k ({label}, step {r['step']})", f"cond_acc_k ({label})"]
    prow = []
    for k in range(positions):
        row: list[object] = [k]
        for _, r in sources:
            row += [cell(r.get("acc_k"), k), cell(r.get("cond_acc_k"), k)]
        prow.append(row)
    parts += [tag("p", "acc_k: top-1 agreement with the target at draft position k; cond_acc_k: the same given "
                       "positions 0..k-1 right.", class_="muted"),
              table(headers, prow, numeric=tuple(range(len(headers))))]
    if page.training_figures:
        parts.append(tag("p", join(["The training charts are with the others, under ", charts_link(), "."], ""),
                         class_="muted"))
    return join(parts)


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


def positions_html(record: dict) -> list[Html]:
    """How the evaluation's verdict judged each draft position: rounds, measured, its 99 % bound, predicted."""
    verdict = record.get("verdict") if isinstance(record.get("verdict"), dict) else {}
    positions = [p for p in verdict.get("positions") or [] if isinstance(p, dict)]
    if not positions:
        return []
    rows = [(number(p.get("draft_tokens")), number(p.get("position")), number(p.get("rounds")),
             number(p.get("measured")), number(p.get("upper_99")), number(p.get("predicted")),
             number(p.get("predicted_rounds")), number(p.get("predicted_lower_99")),
             "yes" if p.get("judged") else "no: too few rounds",
             tag("span", "yes", class_="ok") if p.get("ok") and p.get("judged") else
             tag("span", "BELOW", class_="bad") if p.get("ok") is False else "-") for p in positions]
    ratio = verdict.get("min_ratio")
    return [tag("h3", "The verdict per draft position"),
            tag("p", f"A position is judged when {verdict.get('min_rounds', '-')} rounds or more reached it, in the "
                     f"measurement and in the held-out rounds behind the prediction, and fails when even the upper "
                     f"end of the 99 % interval of its measured rate is below "
                     f"{number(ratio) if isinstance(ratio, (int, float)) else '-'} times the lower end of the "
                     f"prediction's ({verdict.get('predicted_from') or 'source not recorded'}).", class_="muted"),
            table(["drafts per verify", "position", "rounds that reached it", "measured P(accepted | earlier)",
                   "99 % upper bound", "predicted", "held-out rounds behind it", "its 99 % lower bound", "judged",
                   "within"], rows, numeric=(0, 1, 2, 3, 4, 5, 6, 7))]


def chains_html(record: dict) -> list[Html]:
    """Measured against predicted at every chain length the evaluation ran (SpecForge's 3-1-4 and 7-1-8)."""
    runs = [run for run in record.get("runs") or [] if isinstance(run, dict)]
    if not runs:
        return []
    rows = [(number(run.get("draft_tokens")), number(run.get("tau")), number(run.get("predicted_tau")),
             per_position(run.get("conditional_acceptance_per_position")),
             per_position(run.get("predicted_conditional_acceptance")), number(run.get("tokens_per_s"), 1))
            for run in runs]
    return [tag("h3", "At each chain length (same prompts)"),
            table(["drafts per verify", "measured tau", "predicted tau", "measured P(accepted | earlier accepted)",
                   "predicted by the training", "tokens/s"], rows, numeric=(0, 1, 2, 5))]


def excluded_html(record: dict) -> list[Html]:
    """Held-out prompts left out because the training data has them, they repeat one, or they are longer than the
    training's samples."""
    excluded = [e for e in record.get("excluded_prompts") or [] if isinstance(e, dict)]
    if not excluded:
        return []
    rows = [(as_text(e.get("id")), number(e.get("line")), as_text(e.get("reason")), as_text(e.get("other")))
            for e in excluded[:SHOWN_EXCLUDED]]
    more = [tag("p", f"... and {len(excluded) - SHOWN_EXCLUDED} more: evaluation.json lists every one.",
                class_="muted")] if len(excluded) > SHOWN_EXCLUDED else []
    return [tag("h3", f"Prompts excluded ({len(excluded)}): seen in training, repeated or too long"),
            table(["id", "line", "reason", "matches"], rows, numeric=(1,)), *more]


def acceptance_section(inputs: ReportInputs, page: Page) -> Html:
    """Measured tau and acceptance per position beside the training's simulation."""
    acceptance, evaluation = inputs.acceptance, inputs.evaluation
    simulated_line = None
    if acceptance.simulated_rates is not None:
        simulated_line = tag("p", f"Simulated by the training ({acceptance.simulated_source}): P(draft position k "
                                  f"accepted) {per_position(acceptance.simulated_rates)}.")
    if acceptance.reason:
        return join([missing(acceptance.reason), *([simulated_line] if simulated_line else [])])
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
    check = record.get("reference_check") if isinstance(record.get("reference_check"), dict) else None
    if check is not None and check.get("checked"):
        mismatches = [m for m in check.get("mismatches") or [] if isinstance(m, dict)]
        faults = [m for m in mismatches if not m.get("near_tie")]
        text = "yes, every output" if not mismatches else (
            f"{len(mismatches) - len(faults)} differ at a numerical near-tie (logit gaps "
            f"{', '.join(number(m.get('logit_gap'), 3) for m in mismatches if m.get('near_tie'))}), "
            f"{len(faults)} differ otherwise")
        rows.append((f"output equals the target's own greedy decode ({as_text(check.get('method'))})",
                     tag("span", text, class_="bad" if faults else "ok")))
    elif "outputs_match_target" in record:
        match = record["outputs_match_target"]
        mismatches = record.get("output_mismatches")
        rows.append(("output equals the target's own greedy decode",
                     tag("span", "yes", class_="ok") if match is True
                     else tag("span", f"no: {as_text(mismatches)}", class_="bad") if match is False else "not checked"))
    rows.append(("record", tag("code", evaluation.path)))
    parts: list[object] = [table(None, rows), *chains_html(record), *positions_html(record), *excluded_html(record)]
    if measured:
        simulated = acceptance.simulated_rates or []
        conditional = record.get("conditional_acceptance_per_position")
        prow = [(k, number(measured[k]), cell(conditional, k), number(simulated[k]) if k < len(simulated) else "-")
                for k in range(len(measured))]
        parts.append(table(["draft position k", "measured P(accepted)", "measured P(accepted | 0..k-1 accepted)",
                            "simulated P(accepted)"], prow, numeric=(0, 1, 2, 3)))
    elif simulated_line is not None:
        parts.append(simulated_line)
    for note in (acceptance.note, record.get("note")):
        if isinstance(note, str) and note:
            parts.append(tag("p", note, class_="muted"))
    if page.acceptance_figure is not None:
        parts.append(tag("p", join(["The chart of these rates is under ", charts_link(), "."], ""), class_="muted"))
    return join(parts)


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


def drafter_section(inputs: ReportInputs) -> Html:
    """Where the drafter is, what it is, and the SGLang command that serves it."""
    drafter = inputs.drafter
    parts: list[object] = []
    if drafter.config is None:
        parts.append(missing(drafter.reason or "no drafter"))
    else:
        config = drafter.config
        eagle = config.get("eagle_config") if isinstance(config.get("eagle_config"), dict) else {}
        rows = [
            ("directory", tag("code", drafter.directory)),
            ("architecture", as_text(config.get("architectures", "-"))),
            ("draft vocabulary", number(config.get("draft_vocab_size"))),
            ("target hidden size", number(config.get("target_hidden_size"))),
            ("aux layers it reads", as_text(eagle.get("eagle_aux_hidden_state_layer_ids", "-"))),
            ("weights (model.safetensors)", size(drafter.weights_bytes)),
        ]
        parts.append(table(None, rows))
    parts += [
        tag("h3", "Serve it with SGLang"),
        tag("p", "On the GPU host, with the Python of SGLang's venv: a chain of draft tokens, top-1, the length the "
                 "evaluation measured (--speculative-num-draft-tokens is always --speculative-num-steps + 1):",
            class_="muted"),
        tag("pre", tag("code", shlex.join(serving_argv(inputs)))),
    ]
    if inputs.target_model_path is None:
        parts.append(missing("target model unknown: no manifest names it; pass --target-model-path"))
    return join(parts)


def _chain_of(inputs: ReportInputs) -> str:
    """`` at N drafts``: the chain length the headline taus are for, or nothing when unknown."""
    chain = (inputs.evaluation.record or {}).get("draft_tokens")
    return f" at {chain} drafts" if isinstance(chain, int) and not isinstance(chain, bool) else ""


def summary_cards(inputs: ReportInputs) -> Html:
    """The run at a glance."""
    m = inputs.extraction.manifest or {}
    acceptance = inputs.acceptance
    verdict = (inputs.evaluation.record or {}).get("verdict")
    cards = [
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
    return Html('<div class="cards">' + join(
        (Html(f'<div class="card"><div class="value">{esc(v)}</div><div class="label">{esc(k)}</div></div>')
         for k, v in cards), "") + "</div>")


def chains_table(verdict: RunVerdict, inputs: ReportInputs) -> Html:
    """Measured tau against the training's simulated tau at each chain length the evaluation ran."""
    acceptance = inputs.acceptance
    if not verdict.chains:
        rates = acceptance.simulated_rates
        if rates:
            return tag("p", f"Nothing measured to compare with: the training ({acceptance.simulated_source}) "
                            f"simulates tau {number(1 + sum(rates), 2)} over its {len(rates)} draft positions.",
                       class_="muted")
        return tag("p", "Nothing measured, and no training metrics to simulate from.", class_="muted")
    rows = []
    for chain in verdict.chains:
        simulated = number(chain.simulated_tau, 2) if chain.simulated_tau is not None else \
            f"- ({chain.why_not_simulated})"
        ratio = (f"{chain.measured_tau / chain.simulated_tau:.0%}" if chain.measured_tau is not None
                 and chain.simulated_tau else "-")
        judged = ("none (too few rounds)" if not chain.judged else
                  tag("span", f"{chain.judged} judged, all within", class_="ok") if not chain.below else
                  tag("span", f"{chain.judged} judged, {chain.below} below", class_="bad"))
        replayed = number(chain.replayed_tau, 2) if chain.replayed_tau is not None else "-"
        rows.append((number(chain.draft_tokens), number(chain.measured_tau, 2), replayed, simulated, ratio, judged))
    source = f"Simulated from {verdict.simulated_from}. " if verdict.simulated_from else ""
    return join([
        table(["drafts per verify", "measured tau", "replayed tau (full forwards)", "simulated tau (training)",
               "measured / simulated", "draft positions judged"], rows, numeric=(0, 1, 2, 4)),
        tag("p", f"tau: tokens per target forward (1 + the drafts accepted per verify). Replayed: the same drafter "
                 "on the same prompts, every state from full forwards of the target's greedy decode (what serving "
                 f"should measure). {source}Details under Acceptance below.", class_="muted"),
        *([tag("p", verdict.diagnosis)] if verdict.diagnosis else []),
    ])


def _outcome(outcome: str, shown: str) -> Html:
    return tag("span", shown, class_="outcome " + ("ok" if outcome == PASS else "bad" if outcome == FAIL else "muted"))


def verdict_section(inputs: ReportInputs, verdict: RunVerdict) -> Html:
    """The page's first section: the headline, measured against simulated, what passed, what to look at."""
    kind = {PASSED: "passed", FAILED: "failed"}.get(verdict.word, "pending")
    headline = tag("div", join([tag("span", verdict.word, class_="word"), tag("span", verdict.sentence)], " "),
                   class_=f"headline {kind}", id="headline")
    checks = table(["check", "outcome", "detail"], [(c.name, _outcome(c.outcome, c.shown), c.detail)
                                                    for c in verdict.checks])
    items = []
    for item in verdict.look_at:
        content: list[object] = [item.text, " ", tag("a", "(details)", href=f"#{item.section}")]
        if item.items:
            content.append(tag("ol", join(tag("li", text) for text in item.items)))
        items.append(tag("li", join(content, ""), class_="bad" if item.bad else None))
    look = tag("ul", join(items), class_="look") if items else \
        tag("p", "Nothing: no problem recorded, no record skipped or excluded.", class_="muted")
    return join([headline, summary_cards(inputs), tag("h3", "Measured against simulated acceptance"),
                 chains_table(verdict, inputs), tag("h3", "What passed"), checks, tag("h3", "What to look at"), look])


def charts_section(inputs: ReportInputs, page: Page) -> Html:
    """Every chart: the measured acceptance first, then the training's; why one is missing in its place."""
    parts: list[object] = []
    if page.acceptance_figure is not None:
        parts.append(figure_html(page.acceptance_figure, "acceptance per draft position, measured vs simulated"))
    else:
        parts.append(missing(f"acceptance chart not drawn: {inputs.acceptance.reason or 'nothing measured'}"))
    if page.training_figures:
        parts += [figure_html(f, f"training chart {f.name}") for f in page.training_figures]
    else:
        parts.append(missing(f"training charts not drawn: {inputs.training.reason or 'no training metrics'}"))
    return join(parts)


def render_page(inputs: ReportInputs, page: Page) -> str:
    """The whole ``index.html``, its sections in the order of ``SECTIONS``."""
    name = inputs.output_dir.resolve().name or str(inputs.output_dir)
    where = f"Run output {inputs.output_dir.resolve()}; report generated {moment(page.generated_at)}."
    bodies = {
        "verdict": verdict_section(inputs, run_verdict(inputs)),
        "charts": charts_section(inputs, page),
        "acceptance": acceptance_section(inputs, page),
        "drafter": drafter_section(inputs),
        "training": training_section(inputs, page),
        "extraction": extraction_section(inputs),
        "gpu-reset": gpu_reset_section(inputs),
        "settings": settings_section(inputs),
    }
    nav = tag("nav", join((tag("a", title, href=f"#{key}") for key, title in SECTIONS), " "))
    sections = join(tag("section", join([tag("h2", title), bodies[key]]), id=key) for key, title in SECTIONS)
    return (
        "<!doctype html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n"
        f'<meta http-equiv="Content-Security-Policy" content="{esc(CSP)}">\n'
        '<meta name="viewport" content="width=device-width, initial-scale=1">\n'
        '<link rel="icon" href="data:,">\n'
        f"<title>{esc(f'EAGLE-3 pipeline report: {name}')}</title>\n<style>{STYLE}</style>\n</head>\n<body>\n"
        f"<header>{tag('h1', f'EAGLE-3 pipeline report: {name}')}"
        f"{tag('p', where, class_='muted')}"
        f"{nav}</header>\n<main>\n{sections}\n</main>\n"
        f"<footer class=\"muted\">Written by eagle3-pipeline {esc(__version__)} (eagle3-pipeline report).</footer>\n"
        "</body>\n</html>\n"
    )
