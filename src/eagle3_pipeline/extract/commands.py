"""``eagle3-pipeline extract-merge``, ``verify`` and ``progress``: the dataset after (or during) extraction."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from eagle3_pipeline.cli_args import path_arg


def configure_merge(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("data_dir", type=path_arg, help="the extraction's output directory")


def run_merge(args: argparse.Namespace) -> int:
    """Merge every part's manifest into data_config.json; print a JSON summary."""
    from eagle3_pipeline.extract.storage import refuse_unfinished_conversion  # noqa: PLC0415
    from eagle3_pipeline.extract.store import merge  # noqa: PLC0415

    try:
        refuse_unfinished_conversion(args.data_dir)
        manifest, changed = merge(args.data_dir)
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    summary = {key: manifest[key] for key in ("num_samples", "num_tokens", "num_loss_tokens", "bytes", "parts")}
    summary.update(changed=changed, skipped=len(manifest["skipped"]), failed=len(manifest["failed"]),
                   shards=list(manifest["shards"]))
    print(json.dumps(summary, sort_keys=True))
    return 0


def configure_verify(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("data_dir", type=path_arg, help="the extraction's output directory")
    parser.add_argument("--quick", action="store_true", help="sizes only; skip checksums and tensor checks")
    parser.add_argument("--threads", type=int, default=4)
    parser.add_argument("--json", action="store_true", help="print the report as JSON")


def run_verify(args: argparse.Namespace) -> int:
    """Re-check every file against the manifest: 0 when all is well, 1 with problems."""
    from eagle3_pipeline.extract.store import StoreError, verify_dataset  # noqa: PLC0415

    try:
        report = verify_dataset(args.data_dir, deep=not args.quick, threads=args.threads)
    except (StoreError, OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(report, sort_keys=True))
    else:
        what = "checksums, shapes, dtypes, finite values" if report["deep"] else "sizes"
        print(f"{args.data_dir}: {report['checked']} files checked ({what}): "
              f"{'all good' if report['ok'] else str(len(report['problems'])) + ' problem(s)'}; "
              f"{report['num_samples']} samples, {report['num_tokens']:,} tokens, {report['bytes'] / 2**30:.2f} GiB "
              f"({report['storage_dtype']}); "
              f"{report['skipped']} skipped and {report['failed']} failed records listed in the manifest")
        for problem in report["problems"]:
            print(f"  problem: {problem}")
        if report["extra_files"]:
            print(f"  {len(report['extra_files'])} file(s) not in the manifest, e.g. {report['extra_files'][0]}")
    return 0 if report["ok"] else 1


def configure_progress(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("data_dir", type=path_arg, help="the extraction's output directory")
    parser.add_argument("--follow", action="store_true", help="redraw until every part has ended")
    parser.add_argument("--interval-s", type=float, default=2.0)


def _progress_lines(data_dir: Path) -> tuple[list[str], bool]:
    from eagle3_pipeline.extract.store import PARTS_DIR  # noqa: PLC0415

    lines, running = [], False
    for path in sorted((data_dir / PARTS_DIR).glob("part-*.progress.json")):
        try:
            doc = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        running = running or doc["state"] == "running"
        total = doc["total"] or 1
        filled = int(30 * doc["done"] / total)
        eta = doc.get("eta_s")
        eta_text = "?" if eta is None else time.strftime("%H:%M:%S", time.gmtime(eta))
        age = time.time() - doc["updated"]
        stale = f" (no update for {age:.0f} s)" if doc["state"] == "running" and age > 30 else ""
        lines.append(f"part {doc['part']} {doc['state']:>8} [{'#' * filled}{'.' * (30 - filled)}] "
                     f"{doc['done']}/{doc['total']} {doc.get('unit', 'samples')}, {doc['failed']} failed, "
                     f"{doc['skipped']} skipped, "
                     f"{doc['tokens_per_s']:,.0f} tokens/s, {eta_text} left{stale}"
                     + (f"\n    {doc['message']}" if doc.get("message") else ""))
    return lines, running


def run_progress(args: argparse.Namespace) -> int:
    """Show each part's progress; with --follow, until none runs."""
    while True:
        lines, running = _progress_lines(args.data_dir)
        if not lines:
            print(f"{args.data_dir}: no extraction (or regeneration) progress there yet", file=sys.stderr)
            return 1
        print("\n".join(lines), flush=True)
        if not (args.follow and running):
            return 0
        time.sleep(args.interval_s)
        print(flush=True)
