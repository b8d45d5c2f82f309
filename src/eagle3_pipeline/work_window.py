"""A job's items through a thread pool with a bounded window, each result journaled on the calling thread.

The extraction (samples) and the regeneration (conversations) run the same loop: at most ``window``
items in flight, each finished one appended to the part's journal before it counts, the first error
(the work's own, or a journal that cannot be written) ending the submissions while the items in
flight finish, and SIGTERM/SIGINT (the supervisor's stop, Ctrl-C) doing the same so that a rerun
continues where this one stopped. What a result means (counters, messages) is the caller's
``count``; what the run's end means (exit codes, messages) is the caller's too.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass


@dataclass
class WindowOutcome:
    """How the loop ended: ``fatal`` the first error (None when none), ``stopped`` a stop was asked for."""

    fatal: BaseException | None
    stopped: bool


def run_window(items: Iterable, work: Callable[[object], dict | None], window: int, journal,
               count: Callable[[dict], None], stopping: threading.Event, tick: Callable[[], None],
               thread_name_prefix: str) -> WindowOutcome:
    """Run ``work(item)`` for every item, ``window`` at most at once.

    Each result (None: the item was left undone because the run stops) is appended to ``journal``
    (``.append(record)``) and then passed to ``count``; ``stopping`` is set for the workers once the run
    stops (they leave the items they have not started); ``tick`` runs about once a second (progress).
    """
    stop = threading.Event()
    previous = {}
    if threading.current_thread() is threading.main_thread():
        for signum in (signal.SIGTERM, signal.SIGINT):
            previous[signum] = signal.signal(signum, lambda *_: stop.set())
    fatal: BaseException | None = None
    pending: set[Future] = set()
    todo = iter(items)

    def handle(future: Future) -> None:
        nonlocal fatal
        try:
            record = future.result()
        except BaseException as exc:  # noqa: BLE001 - the first fatal error stops the run
            fatal = fatal or exc
            return
        if record is None:  # not done: the rerun does it
            return
        try:
            journal.append(record)
        except OSError as exc:  # not journaled: the rerun redoes it
            fatal = fatal or exc
            return
        count(record)

    try:
        with ThreadPoolExecutor(max_workers=window, thread_name_prefix=thread_name_prefix) as pool:
            exhausted = False
            while True:
                while not exhausted and fatal is None and not stop.is_set() and len(pending) < window:
                    item = next(todo, None)
                    if item is None:
                        exhausted = True
                        break
                    pending.add(pool.submit(work, item))
                if not pending:
                    break
                finished, pending = wait(pending, timeout=1.0, return_when=FIRST_COMPLETED)
                for future in finished:
                    handle(future)
                if fatal is not None or stop.is_set():
                    stopping.set()
                tick()
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    return WindowOutcome(fatal, stop.is_set())
