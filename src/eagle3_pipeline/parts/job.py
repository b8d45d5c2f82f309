"""One part of a job over a dataset's records: the run that the extraction and the regeneration share.

A run is one part (``--part K/N``, default 0/1) of the dataset: the records whose 0-based ordinal
``i`` has ``i % N == K``, so N hosts, each with its own server, split the work with no
coordination and write into one shared output directory. The steps, the same for every stage:

1. plan (the stage's ``make_plan``): read this part's records (``read_part``: a bad record is a
   skip with the reader's reason), key each one (a hash of the settings, the id and the record),
   and drop those the journal already holds; the settings are compared with the recorded ones;
2. refuse what cannot go well, with the numbers (the stage's ``refusal`` and ``check_room``);
   then create the directory, lock the part (``files.lock_part``) and claim the settings (a
   refused run locks and writes nothing);
3. the rest through a pool of workers (``work_window.run_window``): at most ``window()`` records
   in hand, each finished one appended to the part's journal before it counts, progress in
   ``parts/part-K-of-N.progress.json`` and on the terminal;
4. the stage's ``finish``: the part's output written, and with one part (and without
   ``--no-merge``) merged.

SIGTERM (the supervisor's stop) and SIGINT stop taking records: the workers finish what they
hold, it is journaled, and the run exits; a rerun continues. A kill -9 loses at most the records
in flight. The exit codes, the same for every stage: 0 done, 1 failed, 2 bad input or settings,
3 server unreachable, 4 stopped.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from eagle3_pipeline.cli_args import dataset_arg, path_arg, path_str
from eagle3_pipeline.parts import files
from eagle3_pipeline.progress_file import ProgressReporter
from eagle3_pipeline.work_window import run_window

EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT, EXIT_UNREACHABLE, EXIT_STOPPED = 0, 1, 2, 3, 4
DEFAULT_MAX_LENGTH = 2048


@dataclass
class PartConfig:
    """What every part job's run needs (the options both commands share)."""

    dataset: Path | tuple  # a path, or a mixture's sources (conversations.dataset.Source)
    output_dir: Path
    server_url: str
    api_key: str | None = None
    model_path: str | None = None
    chat_template: Path | None = None
    num_samples: int | None = None
    part: tuple[int, int] = (0, 1)
    max_length: int = DEFAULT_MAX_LENGTH
    concurrency: int = 8
    retries: int = 5
    request_timeout_s: float = 600.0
    merge: bool = True
    quiet: bool = False
    trust_remote_code: bool = False


@dataclass
class PartPlan:
    """What a run found before sending anything."""

    settings: dict
    records: int  # records of this part (items + skips)
    items: list  # this part's usable records, in dataset order; each has ``.key``
    skipped: list[dict]  # records left out before any request: {"line", "id", "reason", "detail"}
    journal: files.Journal
    done: dict[str, dict]  # key -> journal record, for this selection
    todo: list = field(default_factory=list)


def skip_record(line: int, sample_id: str | None, reason: str, detail: str) -> dict:
    """A record left out, as the part's summary lists it."""
    return {"line": line, "id": sample_id, "reason": reason, "detail": detail}


# ``read_part`` in several processes: the most it starts by itself, the records a batch of work holds, and the
# records below which one process does it all (a pool's start costs more than it saves).
READ_PROCESSES_MAX = 8
READ_CHUNK = 64
READ_PARALLEL_MIN_RECORDS = 512
_MAKE: Callable | None = None  # the ``make`` of the ``read_part`` whose processes are forked (inherited, not sent)


def read_processes(requested: int, num_samples: int | None) -> int:
    """How many processes ``read_part`` makes its items in: ``requested`` when positive; otherwise, for a dataset
    not cut below ``READ_PARALLEL_MIN_RECORDS`` records, up to ``READ_PROCESSES_MAX`` of the CPUs this process may
    use. One wherever processes cannot be forked."""
    import multiprocessing  # noqa: PLC0415

    if "fork" not in multiprocessing.get_all_start_methods():
        return 1
    if requested > 0:
        return requested
    if num_samples is not None and num_samples < READ_PARALLEL_MIN_RECORDS:
        return 1
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(READ_PROCESSES_MAX, usable))


def _make_chunk(chunk: list) -> list:
    return [_MAKE(item) for item in chunk]


def _made_in_processes(make: Callable, usable, processes: int):
    """``make(item)`` of each of ``usable``'s items, in their order, in ``processes`` forked processes.

    The forked processes inherit ``make`` (a tokenizer, a template: nothing is sent but the records and what
    ``make`` returns), and at most two chunks a process are in hand at once, so a large dataset is never held
    whole. The tokenizers library is told not to start threads of its own in them (forked after its threads ran,
    it would warn and turn them off anyway)."""
    import multiprocessing  # noqa: PLC0415
    from collections import deque  # noqa: PLC0415
    from concurrent.futures import ProcessPoolExecutor  # noqa: PLC0415
    from concurrent.futures.process import BrokenProcessPool  # noqa: PLC0415
    from itertools import islice  # noqa: PLC0415

    global _MAKE  # noqa: PLW0603 - what the forked processes inherit
    saved_make, saved_env = _MAKE, os.environ.get("TOKENIZERS_PARALLELISM")
    _MAKE = make
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        with ProcessPoolExecutor(processes, mp_context=multiprocessing.get_context("fork")) as pool:
            pending: deque = deque()
            chunks = iter(lambda: list(islice(usable, READ_CHUNK)), [])
            for chunk in chunks:
                pending.append(pool.submit(_make_chunk, chunk))
                if len(pending) >= 2 * processes:
                    yield from pending.popleft().result()
            while pending:
                yield from pending.popleft().result()
    except BrokenProcessPool as exc:  # a process killed (out of memory, say): nothing was done yet, nothing is lost
        raise OSError(f"a process rendering the conversations died ({exc}); rerun with fewer processes "
                      "(--render-processes 1 renders them in the command's own process)") from None
    finally:
        _MAKE = saved_make
        if saved_env is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = saved_env


def read_part(cfg: PartConfig, make: Callable[[object], object], processes: int = 1) -> tuple[int, list, list[dict]]:
    """(records of this part, their items, their skips): ``make(sample)`` turns a usable record into
    an item, or into a skip (a dict from ``skip_record``) when the stage cannot use it.

    ``processes`` above 1 (``read_processes``) makes the items in that many forked processes: rendering and
    tokenizing a conversation takes Python a few milliseconds, so the plan of a large dataset takes minutes in one
    process. The result is the same, in the same order."""
    from eagle3_pipeline.conversations.dataset import Skip, read_dataset  # noqa: PLC0415

    index, count = cfg.part
    records, items, skipped = 0, [], []
    order: list[dict | None] = []  # the reader's skips in place, None where a made item or skip comes

    def usable():
        nonlocal records
        for item in read_dataset(cfg.dataset, cfg.num_samples):
            if item.ordinal % count != index:
                continue
            records += 1
            if isinstance(item, Skip):
                order.append(skip_record(item.line, item.sample_id, item.reason, item.detail))
                continue
            order.append(None)
            yield item

    made = _made_in_processes(make, usable(), processes) if processes > 1 else map(make, usable())
    made_in_order = iter(list(made))
    for entry in order:
        result = next(made_in_order) if entry is None else entry
        (skipped if isinstance(result, dict) else items).append(result)
    return records, items, skipped


def open_journal(cfg: PartConfig, done_what: str, dry: bool) -> tuple[files.Journal, dict[str, dict]]:
    """The part's journal and its records by key, after refusing a directory split over other hosts.

    ``dry``: leave the journal as it is, even a torn last line (a live run may be appending to it).
    """
    index, count = cfg.part
    files.refuse_other_split(cfg.output_dir, index, count, done_what)
    journal = files.Journal(files.part_path(cfg.output_dir, index, count, ".journal.jsonl"))
    return journal, journal.load(repair=not dry)


def gib(n: float) -> str:
    return f"{n / 2**30:,.1f} GiB"


class PartProgress(ProgressReporter):
    """The part's progress file (rewritten at most once a second) and the terminal's progress line.

    A stage says what else its file holds (``extra``), how the time left is estimated (``eta_s``)
    and which counts the line shows (``counts``).
    """

    unit = "records"

    def __init__(self, cfg: PartConfig, label: str, plan: PartPlan, tokens_before: int):
        index, count = cfg.part
        super().__init__(files.part_path(cfg.output_dir, index, count, ".progress.json"), cfg.quiet, label)
        self.part = f"{index}/{count}"
        self.total = len(plan.items)
        self.done = len(plan.done)
        self.skipped = len(plan.skipped)
        self.failed = 0
        self.tokens_before = tokens_before
        self.tokens_now = 0
        self.done_now = 0
        self.started = time.time()
        self._clock = time.monotonic()
        self.state = "running"
        self.message = ""

    def restart_clock(self) -> None:
        self._clock = time.monotonic()

    def elapsed(self) -> float:
        return max(time.monotonic() - self._clock, 1e-9)

    @abstractmethod
    def eta_s(self) -> float | None:
        """Seconds left, 0.0 when nothing is, None when not known yet."""

    def extra(self) -> dict:
        """What the stage's progress file holds beyond the shared fields."""
        return {}

    @abstractmethod
    def counts(self) -> str:
        """The line's counts after ``done/total unit``, e.g. ``3 failed``."""

    def document(self) -> dict:
        return {
            "state": self.state, "part": self.part, "pid": os.getpid(), "total": self.total, "done": self.done,
            "skipped": self.skipped, "failed": self.failed, "tokens": self.tokens_before + self.tokens_now,
            "tokens_per_s": round(self.tokens_now / self.elapsed(), 1), "eta_s": self.eta_s(),
            "started": self.started, "updated": time.time(), "message": self.message, **self.extra(),
        }

    def line(self) -> str:
        doc = self.document()
        width = 30
        filled = int(width * doc["done"] / self.total) if self.total else width
        eta = doc["eta_s"]
        eta_text = "?" if eta is None else time.strftime("%H:%M:%S", time.gmtime(eta))
        return (f"[{self.label} {self.part}] [{'#' * filled}{'.' * (width - filled)}] {doc['done']}/{self.total} "
                f"{self.unit}, {self.counts()}, {doc['tokens_per_s']:,.0f} tokens/s, {eta_text} left")


class PartJob(ABC):
    """A stage's part of a dataset job: the shared run (``run``) over what the stage gives."""

    label = "job"  # the log prefix: [extract] ...
    what = "job"  # names the job in messages: another extraction of part ...
    done_what = "processed"  # a dataset is <done_what> by one set of hosts
    unit = "record"  # what one record is to this stage: sample, conversation
    check_finished_first = False  # plan dry first, and do nothing at all when ``finished`` says so

    def __init__(self, cfg: PartConfig):
        from eagle3_pipeline.server_client import EngineClient  # noqa: PLC0415

        self.cfg = cfg
        self.client = EngineClient(cfg.server_url, cfg.api_key, cfg.request_timeout_s, cfg.retries)

    def log(self, message: str) -> None:
        if not self.cfg.quiet:
            print(f"[{self.label}] {message}", file=sys.stderr, flush=True)

    # -- what a stage gives -------------------------------------------------------------
    @abstractmethod
    def make_plan(self, dry: bool = False) -> PartPlan:
        """Step 1; raises ``ValueError`` subclasses (and ``OSError``) on bad input or settings."""

    @abstractmethod
    def claim_settings(self, settings: dict, create: bool = True) -> bool:
        """``files.claim_settings`` with the stage's settings file."""

    @abstractmethod
    def describe(self, plan: PartPlan) -> str:
        """The run's first line: what the plan holds and what will be done."""

    def finished(self, plan: PartPlan) -> str | None:
        """With ``check_finished_first``: why there is nothing to do, or None."""
        return None

    def refusal(self, plan: PartPlan) -> str | None:
        """Why the run must not start (bad input), before anything is written; None to go on."""
        return None

    def check_room(self, plan: PartPlan) -> None:
        """Raise ``StoreError`` with the numbers when the disk cannot hold what is left."""
        return

    @abstractmethod
    def progress(self, plan: PartPlan) -> PartProgress:
        """The part's progress reporter."""

    @abstractmethod
    def start_work(self, plan: PartPlan, progress: PartProgress):
        """The worker for ``plan.todo``: ``worker(item)`` gives the item's journal record (None when
        the run stopped before it), safe in many threads, with a ``stopping`` event."""

    def end_work(self, worker) -> None:
        """After the pool, whatever the outcome (clean up, report)."""
        return

    @abstractmethod
    def count(self, plan: PartPlan, progress: PartProgress, record: dict) -> None:
        """A journaled record counted into the plan and the progress."""

    def window(self) -> int:
        """Records in hand at once."""
        return self.cfg.concurrency

    @abstractmethod
    def finish(self, plan: PartPlan, progress: PartProgress) -> tuple[int, str]:
        """Step 4, once every record is done: the part's output written; (exit code, the message for
        the log or the error)."""

    @abstractmethod
    def merge(self) -> str:
        """Merge every part's output (the run's only part, here) and say what the merged file holds."""

    # -- the run ------------------------------------------------------------------------
    def lock(self):
        return files.lock_part(self.cfg.output_dir, self.cfg.part, self.what)

    def run(self) -> int:  # noqa: PLR0911 - one exit per outcome
        """The whole run; returns an exit code (see the module docstring), messages on stderr."""
        from eagle3_pipeline.server_client import EngineError, ServerUnreachable  # noqa: PLC0415

        cfg = self.cfg
        try:
            if self.check_finished_first:
                why = self.finished(self.make_plan(dry=True))
                if why:  # nothing to do: nothing is written, not even the lock or the progress
                    self.log(why)
                    return EXIT_OK
            # Held until the run ends. A directory that does not exist yet has no run on it: it is
            # locked once created, after the checks (a refused run leaves nothing behind). The plan
            # is made under the lock, which may repair a journal line torn by a kill.
            lock = self.lock() if cfg.output_dir.exists() else None
            plan = self.make_plan()
        except ServerUnreachable as exc:
            print(f"error: {exc}", file=sys.stderr)
            return EXIT_UNREACHABLE
        except (OSError, ValueError, EngineError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return EXIT_BAD_INPUT
        self.log(self.describe(plan))
        if plan.skipped:
            reasons = Counter(s["reason"] for s in plan.skipped)
            self.log("skipped: " + ", ".join(f"{n} {r}" for r, n in reasons.most_common()))
        refusal = self.refusal(plan)
        if refusal:
            print(f"error: {refusal}", file=sys.stderr)
            return EXIT_BAD_INPUT
        try:
            cfg.output_dir.mkdir(parents=True, exist_ok=True)
            self.check_room(plan)
            lock = lock or self.lock()
            self.claim_settings(plan.settings)
        except (OSError, ValueError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return EXIT_BAD_INPUT
        progress = self.progress(plan)
        progress.update(force=True)
        outcome = EXIT_OK
        if plan.todo:
            worker = self.start_work(plan, progress)
            try:
                outcome = self._work(plan, worker, progress)
            finally:
                self.end_work(worker)
        plan.journal.close()
        del lock
        if outcome != EXIT_OK:
            return outcome
        code, message = self.finish(plan, progress)
        if code == EXIT_OK and cfg.part[1] == 1 and cfg.merge:
            message += "; " + self.merge()
        progress.state, progress.message = ("done" if code == EXIT_OK else "failed"), message
        progress.update(force=True)
        if code == EXIT_OK:
            self.log(message)
        else:
            print(f"error: {message}", file=sys.stderr)
        return code

    def _work(self, plan: PartPlan, worker, progress: PartProgress) -> int:
        """Step 3: the records through the pool; journal and progress on this thread."""
        from eagle3_pipeline.server_client import ServerUnreachable  # noqa: PLC0415

        outcome = run_window(plan.todo, worker, self.window(), plan.journal,
                             lambda record: self.count(plan, progress, record), worker.stopping, progress.update,
                             self.unit)
        fatal = outcome.fatal
        units = f"{self.unit}s"
        if fatal is not None:
            progress.state = "failed"
            if isinstance(fatal, ServerUnreachable):
                code, progress.message = EXIT_UNREACHABLE, str(fatal)
            elif isinstance(fatal, OSError):
                free = shutil.disk_usage(self.cfg.output_dir).free
                code, progress.message = EXIT_FAILED, (
                    f"cannot store a {self.unit}: {fatal} ({gib(free)} free in {self.cfg.output_dir}); the "
                    f"{progress.done} {units} done are kept: free space there (or fix the cause) and rerun to continue")
            else:
                code, progress.message = EXIT_FAILED, (
                    f"{type(fatal).__name__}: {fatal}; the {progress.done} {units} done are kept: fix the cause and "
                    "rerun to continue")
            progress.update(force=True)
            print(f"error: {progress.message}", file=sys.stderr)
            return code
        if outcome.stopped:
            progress.state = "stopped"
            progress.message = (f"stopped on request after {progress.done} of {progress.total} {units}; rerun to "
                                "continue")
            progress.update(force=True)
            self.log(progress.message)
            return EXIT_STOPPED
        return EXIT_OK


# -- the command line ---------------------------------------------------------------------
def check_dataset(dataset) -> None:
    """FileNotFoundError naming the first path of ``dataset`` (a path or a mixture) that is not there."""
    from eagle3_pipeline.conversations.dataset import dataset_paths  # noqa: PLC0415

    for path in dataset_paths(dataset):
        if not path.exists():
            raise FileNotFoundError(f"dataset {path} does not exist")


def add_options(parser: argparse.ArgumentParser, *, server: str, concurrency: int, concurrency_help: str,
                check_help: str, merged_file: str) -> None:
    """The options every part job's command has; ``server`` says which server it talks to."""
    parser.add_argument("--dataset", type=dataset_arg, required=True,
                        help="ShareGPT conversations or OpenAI messages: JSON Lines, one JSON array, Parquet, Arrow, "
                        "or a folder of them; or a mixture, as a JSON list of {path, name, count or weight}")
    parser.add_argument("--output-dir", type=path_arg, required=True)
    parser.add_argument("--server-url", required=True, help=f"http://HOST:PORT of the {server} server")
    parser.add_argument("--part", default="0/1", help="K/N: this host's share (records with ordinal %% N == K)")
    parser.add_argument("--num-samples", type=int, help="only the first N records (default: all)")
    parser.add_argument("--concurrency", type=int, default=concurrency, help=concurrency_help)
    parser.add_argument("--chat-template", type=path_arg, help="a Jinja chat template file instead of the tokenizer's")
    parser.add_argument("--trust-remote-code", action="store_true",
                        help="allow the tokenizer's own code (Kimi's tiktoken tokenizer needs it)")
    parser.add_argument("--retries", type=int, default=5, help="retries of a request on transient failures")
    parser.add_argument("--request-timeout-s", type=float, default=600.0)
    parser.add_argument("--check", action="store_true", help=check_help)
    parser.add_argument("--no-merge", action="store_true", help=f"do not merge into {merged_file} at the end")
    parser.add_argument("--quiet", action="store_true")


def model_path_option(parser: argparse.ArgumentParser, what: str) -> None:
    parser.add_argument("--model-path", type=path_str,
                        help=f"the target model directory here, for {what} (default: the server's model_path)")


def config_fields(args: argparse.Namespace, api_key: str | None) -> dict:
    """The ``PartConfig`` fields from the shared options; ValueError naming the option that is wrong."""
    for name in ("max_length", "concurrency"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1")
    if args.retries < 0:
        raise ValueError("--retries must not be negative")
    if args.num_samples is not None and args.num_samples < 1:
        raise ValueError("--num-samples must be at least 1")
    return {
        "dataset": args.dataset, "output_dir": args.output_dir, "server_url": args.server_url, "api_key": api_key,
        "model_path": args.model_path, "chat_template": args.chat_template, "num_samples": args.num_samples,
        "part": files.parse_part(args.part), "max_length": args.max_length, "concurrency": args.concurrency,
        "retries": args.retries, "request_timeout_s": args.request_timeout_s, "merge": not args.no_merge,
        "quiet": args.quiet, "trust_remote_code": args.trust_remote_code,
    }


def main(args: argparse.Namespace, config_from_args: Callable, check_status: Callable[[object], dict],
         job: Callable[[object], PartJob]) -> int:
    """A part job's command: its settings, then ``--check`` (what a run would do, as JSON) or the run."""
    from eagle3_pipeline.server_client import ServerUnreachable  # noqa: PLC0415

    try:
        cfg = config_from_args(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    if not args.check:
        return job(cfg).run()
    try:
        print(json.dumps(check_status(cfg), sort_keys=True))
    except ServerUnreachable as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_UNREACHABLE
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    return EXIT_OK
