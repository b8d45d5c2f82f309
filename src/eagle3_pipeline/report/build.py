"""Write the report directory: ``index.html``, its PNGs and ``report.json``, whole or not at all.

The new report is built in a temp directory beside the target, then swapped in by two renames
(old away, new in; the old one is removed after). A crash leaves the old report or the new one,
never a mix, plus at most a ``.report.tmp-*`` / ``.report.old-*`` directory that the next build
removes.

Idempotence: ``report.json`` records two SHA-256 digests of the inputs. ``inputs_sha256``
covers everything shown; when it is unchanged nothing is written. ``results_sha256`` leaves out
the GPU reset logs: those are records of each run (the gpu_reset role rewrites them every time
and never counts that as a change), so a report rewritten only because they changed reports
``changed: false``, and a rerun of the whole pipeline stays ``changed=0``.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from eagle3_pipeline import __version__
from eagle3_pipeline.checksum import file_sha256
from eagle3_pipeline.report.checks import FAIL, run_verdict
from eagle3_pipeline.report.figures import acceptance_figure, training_figures
from eagle3_pipeline.report.inputs import ReportInputs
from eagle3_pipeline.report.render import Page, render_page

REPORT_DIR = "report"
INDEX_FILE = "index.html"
STATE_FILE = "report.json"
# Raise when the page's content changes, so that reports written by older code are redone.
RENDER_VERSION = 3


@dataclass
class BuildResult:
    """What a build did: where the report is, whether its content changed, the digests."""

    report_dir: str
    index: str
    changed: bool  # the results shown changed (the GPU reset logs alone do not count)
    written: bool  # files were (or, with check, would be) rewritten
    inputs_sha256: str
    results_sha256: str
    check: bool = False


def _digest(entries: list[tuple[str, str]]) -> str:
    digest = hashlib.sha256()
    for name, value in sorted(entries):
        digest.update(f"{name}\0{value}\n".encode())
    return digest.hexdigest()


def input_digests(inputs: ReportInputs) -> tuple[str, str]:
    """(inputs_sha256, results_sha256): every input, and every input but the GPU reset logs."""
    results = [
        ("render", f"{__version__}/{RENDER_VERSION}"),
        ("settings", json.dumps(inputs.settings.values, sort_keys=True, default=str)),
        ("target_model_path", str(inputs.target_model_path)),
        ("drafter_dir", str(inputs.drafter.directory)),
        ("drafter_weights_bytes", str(inputs.drafter.weights_bytes)),
        ("evaluation", str(inputs.evaluation.path)),
    ]
    results += [(f"file:{path}", file_sha256(path)) for path in inputs.result_files() if path.is_file()]
    logs = [(f"gpu_reset:{log.path}", file_sha256(log.path)) for log in inputs.gpu_reset if log.path.is_file()]
    return _digest(results + logs), _digest(results)


def _recorded(report_dir: Path) -> dict:
    try:
        state = json.loads((report_dir / STATE_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return state if isinstance(state, dict) and (report_dir / INDEX_FILE).is_file() else {}


def _remove_leftovers(parent: Path, name: str) -> None:
    """Temp and old directories of builds that were killed."""
    for pattern in (f".{name}.tmp-*", f".{name}.old-*"):
        for stale in parent.glob(pattern):
            shutil.rmtree(stale, ignore_errors=True)


def _swap_in(new: Path, target: Path) -> None:
    """Put the complete directory ``new`` at ``target``, replacing what is there."""
    if not target.exists():
        os.rename(new, target)
        return
    old = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}.old-"))
    os.rename(target, old / target.name)
    os.rename(new, target)
    shutil.rmtree(old, ignore_errors=True)


def summary(inputs: ReportInputs) -> dict:
    """The report's headline figures, for report.json and the role's message."""
    acceptance = inputs.acceptance
    verdict = run_verdict(inputs)
    judged = (inputs.evaluation.record or {}).get("verdict")
    problems = [str(p) for p in judged.get("problems") or []] if isinstance(judged, dict) else []
    return {
        "verdict": verdict.word,  # PASSED, FAILED, NOT JUDGED or NOT MEASURED, as the page heads it
        "sentence": verdict.sentence,
        # What failed, each with its figures: the role prints these (a run's log then says why without the page).
        "failed_checks": [f"{check.name}: {check.detail}" for check in verdict.checks if check.outcome == FAIL]
        + [f"evaluation: {problem}" for problem in problems],
        "measured_tau": acceptance.measured_tau if not acceptance.reason else None,
        "simulated_tau": acceptance.simulated_tau,
        "draft_tokens": (inputs.evaluation.record or {}).get("draft_tokens"),  # the chain of both
        "acceptance_not_measured": acceptance.reason,
        "drafter_dir": str(inputs.drafter.directory),
        "num_samples": (inputs.extraction.manifest or {}).get("num_samples"),
        "num_tokens": (inputs.extraction.manifest or {}).get("num_tokens"),
    }


def build_report(inputs: ReportInputs, report_dir: Path, check: bool = False, force: bool = False) -> BuildResult:
    """Write the report into ``report_dir`` unless its inputs are unchanged (``force``: always).

    ``check``: compute what would happen and write nothing.
    """
    report_dir = Path(os.path.abspath(report_dir))
    inputs_sha, results_sha = input_digests(inputs)
    recorded = _recorded(report_dir)
    written = force or recorded.get("inputs_sha256") != inputs_sha
    result = BuildResult(str(report_dir), str(report_dir / INDEX_FILE), changed=force or recorded.get(
        "results_sha256") != results_sha, written=written, inputs_sha256=inputs_sha, results_sha256=results_sha,
        check=check)
    if check or not written:
        return result
    parent = report_dir.parent
    parent.mkdir(parents=True, exist_ok=True)
    _remove_leftovers(parent, report_dir.name)
    work = Path(tempfile.mkdtemp(dir=parent, prefix=f".{report_dir.name}.tmp-"))
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(work, 0o777 & ~umask)  # mkdtemp makes it 0700; the report is for reading
        page = Page(training_figures(inputs.training, work), acceptance_figure(inputs.acceptance, work), time.time())
        (work / INDEX_FILE).write_text(render_page(inputs, page), encoding="utf-8")
        for png in work.glob("*.png"):
            os.chmod(png, 0o666 & ~umask)  # atomic_write's temp files are 0600
        state = {"inputs_sha256": inputs_sha, "results_sha256": results_sha, "generated_at": page.generated_at,
                 "version": __version__, "render_version": RENDER_VERSION, "summary": summary(inputs),
                 "figures": sorted(p.name for p in work.glob("*.png"))}
        (work / STATE_FILE).write_text(json.dumps(state, indent=1, sort_keys=True) + "\n", encoding="utf-8")
        _swap_in(work, report_dir)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    return result


def result_json(result: BuildResult, inputs: ReportInputs) -> str:
    """One JSON line for the role: the result and the headline figures."""
    return json.dumps({**asdict(result), **summary(inputs)}, sort_keys=True)
