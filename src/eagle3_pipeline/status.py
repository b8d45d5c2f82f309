"""Where a pipeline run stands, read from its output directory alone (``eagle3-pipeline status``).

Each stage leaves files behind that say whether it is done, running or failed; this module reads
them, without Ansible and without the hosts, so it works while a run goes on, after it ended,
or on a copy of the directory:

- gpu_reset: ``gpu_reset/<host>.json``, one report per host;
- serve: the capture server's supervisor state, ``servers/*.json``;
- extract: ``<data>/data_config.json`` (the merged manifest) and, while it runs, the parts'
  ``<data>/parts/part-*.progress.json``;
- train: ``<training>/progress.json`` and ``training.json`` in ``training/`` or any subdirectory
  holding them (``drafter-run/`` in the embedded default);
- evaluate: ``evaluation/evaluation.json``;
- report: ``report/index.html``.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

DONE, RUNNING, FAILED, NOT_STARTED = "done", "running", "failed", "not started"
# A running job whose progress file has not changed for this long is probably gone.
STALE_S = 120


@dataclass
class StageStatus:
    """One stage's state, a one-line summary and its key figures."""

    stage: str
    state: str  # done | running | failed | not started
    summary: str = ""
    message: str | None = None
    figures: dict = field(default_factory=dict)
    paths: dict = field(default_factory=dict)


def _read_json(path: Path) -> dict | None:
    try:
        document = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return document if isinstance(document, dict) else None


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    return time.strftime("%H:%M:%S", time.gmtime(max(seconds, 0)))


def _stale_note(document: dict, now: float) -> str:
    updated = document.get("updated")
    if isinstance(updated, (int, float)) and now - updated > STALE_S:
        return f" (no update for {now - updated:.0f} s: is the job still alive?)"
    return ""


def gpu_reset_status(output_dir: Path) -> StageStatus:
    """The GPU reset from its per-host reports."""
    # One JSON per host; a run that keeps one directory per reset has them in subdirectories.
    base = output_dir / "gpu_reset"
    reports = {path.relative_to(base).with_suffix("").as_posix(): _read_json(path)
               for path in sorted(base.rglob("*.json")) if not path.name.endswith(".check.json")}
    reports = {host: doc for host, doc in reports.items() if doc is not None}
    status = StageStatus("gpu_reset", NOT_STARTED)
    if not reports:
        return status
    status.paths["reports"] = str(output_dir / "gpu_reset")
    problems, parts = [], []
    for host, doc in reports.items():
        stopped = len(doc.get("stopped") or [])
        left = doc.get("left") or []
        health = doc.get("health_problems") or []
        if left:
            problems.append(f"{host}: {len(left)} holder(s) left running")
        problems += [f"{host}: {problem}" for problem in health]
        freed = doc.get("seconds_to_free")
        nvml = "" if doc.get("nvml_available") else ", no NVML"
        check = " (check mode)" if doc.get("check_mode") else ""
        parts.append(f"{host}: {len(doc.get('gpus_before') or [])} GPU(s), {stopped} process(es) stopped"
                     + (f", free in {freed} s" if freed is not None else "") + nvml + check)
        status.figures[host] = {"gpus": len(doc.get("gpus_before") or []), "stopped": stopped, "left": len(left),
                                "seconds_to_free": freed, "health_problems": health,
                                "check_mode": bool(doc.get("check_mode"))}
    status.state = FAILED if problems else DONE
    if all(doc.get("check_mode") for doc in reports.values()):
        # The role writes its record in check mode too: what it would stop, with nothing stopped.
        status.state = NOT_STARTED
    status.summary = "; ".join(parts)
    status.message = "; ".join(problems) or None
    return status


def server_status(output_dir: Path) -> StageStatus:
    """The capture server from its supervisor state files (running, or stopped after serving)."""
    states = [doc for path in sorted((output_dir / "servers").glob("*.json")) if (doc := _read_json(path))]
    status = StageStatus("serve", NOT_STARTED)
    if not states:
        return status
    lines = []
    for doc in states:
        name = doc.get("name", "server")
        alive = doc.get("ended_at") is None and _pid_alive(doc.get("pid"))
        if alive:
            status.state = RUNNING
            lines.append(f"{name} running (PID {doc.get('pid')})")
        else:
            lines.append(f"{name} stopped (exit {doc.get('exit_code')})")
        if doc.get("log_file"):
            status.paths[f"{name} log"] = os.path.normpath(doc["log_file"])
    if status.state != RUNNING:
        status.state = DONE
    status.summary = "; ".join(lines)
    return status


def _pid_alive(pid) -> bool:
    if not isinstance(pid, int) or pid <= 0:
        return False
    return Path(f"/proc/{pid}").exists()


# Directories of the other stages, never taken for the data or the training directory.
OTHER_STAGE_DIRS = {"gpu_reset", "servers", "capture", "jobs", "dataset", "evaluation", "report"}


def _find_dir(output_dir: Path, preferred: str, markers: tuple[str, ...]) -> Path | None:
    """``output_dir/preferred`` when it holds one of ``markers``, else the first subdirectory that does."""
    candidates = [output_dir / preferred] + sorted(p for p in output_dir.iterdir() if p.is_dir()
                                                    and p.name != preferred and p.name not in OTHER_STAGE_DIRS)
    for candidate in candidates:
        if any((candidate / marker).exists() for marker in markers):
            return candidate
    return None


def extraction_status(output_dir: Path, now: float) -> StageStatus:
    """The extraction from the manifest and the parts' progress files."""
    status = StageStatus("extract", NOT_STARTED)
    data_dir = _find_dir(output_dir, "data", ("data_config.json", "parts"))
    if data_dir is None:
        return status
    status.paths["data_dir"] = str(data_dir)
    parts = [doc for path in sorted((data_dir / "parts").glob("part-*.progress.json")) if (doc := _read_json(path))]
    running = [doc for doc in parts if doc.get("state") == "running"]
    failed = [doc for doc in parts if doc.get("state") in ("failed", "stopped")]
    manifest = _read_json(data_dir / "data_config.json")
    if running or (failed and manifest is None):
        done = sum(int(doc.get("done") or 0) for doc in parts)
        total = sum(int(doc.get("total") or 0) for doc in parts)
        rate = sum(float(doc.get("tokens_per_s") or 0) for doc in running)
        etas = [doc.get("eta_s") for doc in running if doc.get("eta_s") is not None]
        status.figures = {"done": done, "total": total, "parts": len(parts), "parts_running": len(running),
                          "tokens_per_s": rate, "eta_s": max(etas) if etas else None,
                          "failed": sum(int(doc.get("failed") or 0) for doc in parts),
                          "skipped": sum(int(doc.get("skipped") or 0) for doc in parts)}
        status.summary = (f"{done}/{total} samples ({100 * done / max(total, 1):.0f} %), {len(running)} of "
                          f"{len(parts)} part(s) running, {rate:,.0f} tokens/s, {_duration(status.figures['eta_s'])}"
                          " left" + "".join(_stale_note(doc, now) for doc in running[:1]))
        if failed:
            status.state = FAILED if not running else RUNNING
            status.message = "; ".join(f"part {doc.get('part')}: {doc.get('message') or doc.get('state')}"
                                       for doc in failed)
        else:
            status.state = RUNNING
        return status
    if manifest is None:
        status.state = FAILED if failed else NOT_STARTED
        return status
    status.state = DONE
    status.paths["manifest"] = str(data_dir / "data_config.json")
    skipped, failures = manifest.get("skipped") or [], manifest.get("failed") or []
    status.figures = {key: manifest.get(key) for key in ("num_samples", "num_tokens", "num_loss_tokens", "bytes",
                                                         "parts", "engine", "hidden_size", "aux_layers")}
    status.figures.update(skipped=len(skipped), failed=len(failures))
    rate = [float(doc.get("tokens_per_s") or 0) for doc in parts]
    if rate:
        status.figures["tokens_per_s"] = sum(rate)
    status.summary = (f"{manifest.get('num_samples', 0):,} samples, {manifest.get('num_tokens', 0):,} tokens, "
                      f"{_gib(manifest.get('bytes') or 0)}, {len(skipped)} skipped, {len(failures)} failed"
                      + (f", {sum(rate):,.0f} tokens/s" if rate else ""))
    return status


def _fmt(value, spec: str = ".3f") -> str:
    return format(value, spec) if isinstance(value, (int, float)) else "?"


def training_status(output_dir: Path, now: float) -> StageStatus:
    """The training from its progress.json and training.json."""
    status = StageStatus("train", NOT_STARTED)
    train_dir = _find_dir(output_dir, "training", ("training.json", "progress.json"))
    if train_dir is None:
        return status
    status.paths["training_dir"] = str(train_dir)
    progress = _read_json(train_dir / "progress.json") or {}
    record = _read_json(train_dir / "training.json")
    state = progress.get("state")
    step, total = progress.get("step"), progress.get("limit_steps") or progress.get("total_steps")
    status.figures = {"step": step, "total_steps": total, "loss": progress.get("loss"),
                      "acceptance_length": progress.get("acceptance_length"),
                      "tokens_per_s": progress.get("tokens_per_s"), "acc_k": progress.get("acc_k")}
    if state in ("failed", "stopped"):
        status.state = FAILED
        status.message = progress.get("message") or f"the training {state}"
        status.summary = f"{state} at step {step}/{total}"
        return status
    if record is not None and state in (None, "done"):
        status.state = DONE
        evaluation = record.get("eval") or {}
        last = record.get("last") or {}
        drafter = record.get("drafter_dir")
        if drafter:
            status.paths["drafter_dir"] = os.path.normpath(drafter)
        status.figures = {"steps": record.get("steps"), "loss": last.get("loss"), "eval_loss": evaluation.get("loss"),
                          "simulated_acceptance_length": evaluation.get("acceptance_length",
                                                                        last.get("acceptance_length")),
                          "eval_acc_k": evaluation.get("acc_k"), "draft_vocab_size": record.get("draft_vocab_size"),
                          "world": record.get("world"), "device": record.get("device"),
                          "elapsed_s": progress.get("elapsed_s")}
        acc = "/".join(f"{a:.2f}" for a in (evaluation.get("acc_k") or [])[:3])
        # The chain it is for: the training's draft positions (the evaluation's chains are shorter or longer).
        positions = len(evaluation.get("acc_k") or last.get("acc_k") or [])
        status.summary = (f"{record.get('steps')} steps, eval loss {_fmt(evaluation.get('loss'))}, acc {acc or '?'}"
                          f"…, simulated acceptance length "
                          f"{_fmt(status.figures['simulated_acceptance_length'], '.2f')}"
                          + (f" over its {positions} draft positions" if positions else ""))
        return status
    if not progress:
        status.state = NOT_STARTED
        return status
    status.state = RUNNING
    status.figures["eta_s"] = progress.get("eta_s")
    status.summary = (f"step {step}/{total}, loss {_fmt(progress.get('loss'), '.3f')}, accept len "
                      f"{_fmt(progress.get('acceptance_length'), '.2f')}, "
                      f"{_fmt(progress.get('tokens_per_s'), ',.0f')} tokens/s, {_duration(progress.get('eta_s'))} left"
                      + _stale_note(progress, now))
    return status


def _find_number(document: dict, keys: tuple[str, ...]):
    """The first of ``keys`` whose value is a number (not a bool)."""
    for key in keys:
        value = document.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return value
    return None


def evaluation_status(output_dir: Path) -> StageStatus:
    """The evaluation from evaluation/evaluation.json (measured acceptance length)."""
    path = output_dir / "evaluation" / "evaluation.json"
    status = StageStatus("evaluate", NOT_STARTED)
    if not path.exists():
        return status
    status.paths["evaluation"] = str(path)
    document = _read_json(path)
    if document is None:
        status.state = FAILED
        status.message = f"{path} is not a JSON object (a write cut short?)"
        return status
    measured = _find_number(document, ("tau", "acceptance_length", "measured_acceptance_length"))
    simulated = _find_number(document, ("simulated_acceptance_length",))
    chain = _find_number(document, ("draft_tokens",))
    predicted = _find_number(document, ("simulated_tau",))
    prompts = document.get("prompts", document.get("num_prompts"))
    prompts = len(prompts) if isinstance(prompts, list) else _find_number(document, ("prompts", "num_prompts"))
    status.state = FAILED if document.get("state") == "failed" else DONE
    status.message = document.get("message") if status.state == FAILED else None
    status.figures = {"acceptance_length": measured, "simulated_acceptance_length": simulated, "prompts": prompts,
                      "draft_tokens": chain, "predicted_tau": predicted}
    if chain is not None and predicted is not None:
        # Both at the same chain: the training's simulated_acceptance_length is over all its draft positions.
        compared = f" at {chain:.0f} drafts per step (the training predicts {_fmt(predicted, '.2f')} at {chain:.0f})"
    else:  # an evaluation.json of an earlier version
        compared = f" (simulated {_fmt(simulated, '.2f')})" if simulated is not None else ""
    status.summary = (f"measured acceptance length {_fmt(measured, '.2f')}{compared}"
                      + (f" on {prompts} prompts" if prompts is not None else ""))
    return status


def report_status(output_dir: Path) -> StageStatus:
    """The report: done when report/index.html exists."""
    path = output_dir / "report" / "index.html"
    status = StageStatus("report", NOT_STARTED)
    if path.exists():
        status.state = DONE
        status.paths["report"] = str(path)
        status.summary = str(path)
    return status


def pipeline_status(output_dir: Path, now: float | None = None) -> list[StageStatus]:
    """Every stage's status, in the pipeline's order; FileNotFoundError when the directory is missing."""
    output_dir = Path(output_dir)
    if not output_dir.is_dir():
        raise FileNotFoundError(f"{output_dir} is not a directory (expected a pipeline output directory, "
                                "e.g. output/demo)")
    now = time.time() if now is None else now
    return [
        gpu_reset_status(output_dir),
        server_status(output_dir),
        extraction_status(output_dir, now),
        training_status(output_dir, now),
        evaluation_status(output_dir),
        report_status(output_dir),
    ]


def status_document(output_dir: Path, now: float | None = None) -> dict:
    """The status as JSON-ready data: ``{"output_dir": ..., "stages": [...]}``."""
    return {"output_dir": str(output_dir), "stages": [asdict(stage) for stage in pipeline_status(output_dir, now)]}


def format_status(stages: list[StageStatus]) -> str:
    """The status as text: a line per stage, the message and paths indented under it."""
    width = max(len(stage.stage) for stage in stages)
    lines = []
    for stage in stages:
        line = f"{stage.stage:<{width}}  {stage.state:<11}"
        if stage.summary:
            line += f"  {stage.summary}"
        lines.append(line.rstrip())
        if stage.message:
            lines += [f"{'':<{width}}  ! {text}" for text in stage.message.splitlines()]
        for name, path in stage.paths.items():
            if path and stage.state != NOT_STARTED and name != "report":
                lines.append(f"{'':<{width}}    {name}: {path}")
    return "\n".join(lines)
