"""The live display of ``eagle3-pipeline run``: one line per task result, the long stages' progress, a recap.

It is an ``on_event`` callback of ``eagle3_pipeline.run`` (see ``runner.simplify_event`` for the
events). On a terminal it colours the lines and redraws a task's progress line in place; into a
pipe or a file it writes plain lines, every progress line kept, so logs show the whole run.
"""

from __future__ import annotations

import time
from typing import TextIO

COLOURS = {"ok": "32", "changed": "33", "failed": "31", "unreachable": "31", "skipped": "36", "ignored": "35",
           "play": "1", "progress": "2", "warning": "35"}
LABELS = {"ok": "ok", "changed": "changed", "skipped": "skipped", "failed": "FAILED", "unreachable": "UNREACHABLE"}
LABEL_WIDTH = max(len(label) for label in LABELS.values())


class ProgressDisplay:
    """Writes a run's simplified events to ``stream`` as an operator reads them."""

    def __init__(self, stream: TextIO, tty: bool = False, verbose: bool = False):
        self.stream = stream
        self.tty = tty
        self.verbose = verbose
        self.started = time.monotonic()
        self._progress_open = False  # a progress line is on screen without its newline (tty only)

    def _paint(self, kind: str, text: str) -> str:
        colour = COLOURS.get(kind)
        return f"\x1b[{colour}m{text}\x1b[0m" if self.tty and colour else text

    def _line(self, text: str) -> None:
        if self._progress_open:
            self.stream.write("\n")
            self._progress_open = False
        self.stream.write(text + "\n")
        self.stream.flush()

    def _progress(self, text: str) -> None:
        if self.tty:
            # Redraw in place: a poll every few seconds would otherwise scroll the screen away.
            self.stream.write("\r\x1b[K" + text)
            self._progress_open = True
            self.stream.flush()
        else:
            self._line(text)

    @staticmethod
    def _task_label(event: dict) -> str:
        return f"{event['role']} : {event['task']}" if event.get("role") else str(event.get("task", ""))

    def _message(self, kind: str, message: str | None) -> None:
        for text in (message or "").strip().splitlines():
            self._line(self._paint(kind, f"{'':{LABEL_WIDTH + 2}}  {text}") if kind == "failed" else
                       f"{'':{LABEL_WIDTH + 2}}  {text}")

    def __call__(self, event: dict) -> None:
        """Show one simplified event."""
        kind = event.get("kind")
        if kind == "play":
            self._line(self._paint("play", f"PLAY {event.get('play', '')}"))
        elif kind in LABELS:
            if kind == "skipped" and not self.verbose:
                return
            shown = "ignored" if kind == "failed" and event.get("ignored") else kind
            label = LABELS[kind] + (" (ignored)" if shown == "ignored" else "")
            painted = self._paint(shown, f"{label:<{LABEL_WIDTH}}")
            self._line(f"  {painted} {event.get('host')} | {self._task_label(event)}")
            self._message("failed" if kind in ("failed", "unreachable") and shown != "ignored" else kind,
                          event.get("message"))
        elif kind == "progress":
            dots = self._paint("progress", f"{'...':<{LABEL_WIDTH}}")
            self._progress(f"  {dots} {event.get('host')} | {event.get('message')}")
        elif kind == "retry" and self.verbose:
            self._line(f"  {'retry':<{LABEL_WIDTH}} {event.get('host')} | {event.get('message')}")
        elif kind == "warning" and event.get("message"):
            self._line(self._paint("warning", event["message"]))
        elif kind == "output" and event.get("message"):
            self._line(event["message"])
        elif kind == "recap":
            self._line(self._paint("play", "RECAP"))
            for host, stats in (event.get("stats") or {}).items():
                figures = "  ".join(f"{name}={count}" for name, count in stats.items())
                failed = stats.get("failed") or stats.get("unreachable")
                self._line(f"  {self._paint('failed' if failed else 'ok', host)}: {figures}")

    def close(self) -> None:
        """End a progress line left open."""
        if self._progress_open:
            self.stream.write("\n")
            self._progress_open = False
            self.stream.flush()

    def finish(self, stage: str, status: str, check: bool, paths: dict[str, str]) -> None:
        """The closing lines: where the outputs are, and how the stage ended."""
        self.close()
        for name, path in paths.items():
            self._line(f"{name}: {path}")
        mode = " (check mode: nothing changed)" if check else ""
        self._line(f"stage {stage}: {status} in {time.monotonic() - self.started:.1f} s{mode}")
