"""TensorBoard events for the drafter trainer: the records of ``metrics.jsonl`` as scalars.

Each record becomes scalars under its kind, at ``global_step = record["step"]``:

    train/loss  train/loss_k/<k>  train/acc_k/<k>  train/cond_acc_k/<k>
    train/acceptance_length  train/tokens_per_s  train/lr
    eval/...                    the same for held-out evaluations (those fields they have)

``k`` counts TTT positions from 0, as the lists in the record do. A resumed run opens the log
with ``purge_step`` = the step it resumes from: TensorBoard then drops the events that the
killed run wrote at that step and past it, as ``metrics.jsonl`` is cut back.

``tensorboard`` is an optional package (the ``train`` extra): this module imports it only when a
log is opened, and ``TensorBoardLog.available()`` tells the trainer whether it can.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from numbers import Real

INSTALL_HINT = "pip install tensorboard (or pip install -e '.[train]')"
KINDS = ("train", "eval")
# Fields logged as one scalar each, and fields holding one value per TTT position.
SCALAR_FIELDS = ("loss", "acceptance_length", "tokens_per_s", "lr")
PER_POSITION_FIELDS = ("loss_k", "acc_k", "cond_acc_k")


class TensorBoardUnavailable(ImportError):
    """The ``tensorboard`` package is missing; the message names the fix."""


def _summary_writer_class():
    """torch's ``SummaryWriter``, or ``TensorBoardUnavailable`` naming the package to install."""
    try:
        # torch.utils.tensorboard imports this lazily too; importing it first gives a plain answer.
        import tensorboard  # noqa: F401, PLC0415
        from torch.utils.tensorboard import SummaryWriter  # noqa: PLC0415
    except ImportError as exc:
        raise TensorBoardUnavailable(
            f"TensorBoard logging needs the tensorboard package ({exc}); fix: {INSTALL_HINT}"
        ) from exc
    return SummaryWriter


def scalars(record: dict) -> Iterator[tuple[str, float]]:
    """The ``(tag, value)`` pairs that one ``metrics.jsonl`` record logs; none for other kinds.

    A field the record lacks is skipped (eval records carry no ``lr``); a field that is not a
    number (or list of numbers) raises ``ValueError`` naming the field and the step.
    """
    kind = record.get("kind")
    if kind not in KINDS:
        return
    step = record.get("step")
    for name in SCALAR_FIELDS:
        if name in record:
            yield f"{kind}/{name}", _number(record[name], kind, name, step)
    for name in PER_POSITION_FIELDS:
        values = record.get(name)
        if values is None:
            continue
        if not isinstance(values, list):
            raise ValueError(f"{kind} record at step {step}: {name} must be a list of numbers, got {values!r}")
        for k, value in enumerate(values):
            yield f"{kind}/{name}/{k}", _number(value, kind, f"{name}[{k}]", step)


def _number(value, kind: str, name: str, step) -> float:
    if isinstance(value, bool) or not isinstance(value, Real):
        raise ValueError(f"{kind} record at step {step}: {name} must be a number, got {value!r}")
    return float(value)


class TensorBoardLog:
    """A TensorBoard event log in ``log_dir`` fed with ``metrics.jsonl`` records."""

    @staticmethod
    def available() -> bool:
        """Whether the ``tensorboard`` package can be imported here."""
        try:
            _summary_writer_class()
        except TensorBoardUnavailable:
            return False
        return True

    def __init__(self, log_dir: str | os.PathLike, purge_step: int | None = None):
        """Open (or add to) the event log in ``log_dir``.

        ``purge_step``: the step a resumed run starts from; TensorBoard hides the events of earlier
        runs at that step and past it. Raises ``TensorBoardUnavailable`` without ``tensorboard``.
        """
        if purge_step is not None and (isinstance(purge_step, bool) or not isinstance(purge_step, int)
                                       or purge_step < 0):
            raise ValueError(f"purge_step must be a step number >= 0 or None, got {purge_step!r}")
        writer_class = _summary_writer_class()
        self.log_dir = os.fspath(log_dir)
        self._writer = writer_class(log_dir=self.log_dir, purge_step=purge_step)

    def write(self, record: dict) -> None:
        """Log one record's scalars at its step (records of other kinds are ignored)."""
        if record.get("kind") not in KINDS:
            return
        step = record.get("step")
        if isinstance(step, bool) or not isinstance(step, int):
            raise ValueError(f"{record.get('kind')} record: step must be an integer, got {step!r}")
        for tag, value in scalars(record):
            # NaN and inf go in as they are: TensorBoard shows them, and a diverged loss should show.
            self._writer.add_scalar(tag, value, global_step=step)

    def flush(self) -> None:
        """Write pending events to disk (the writer also does every two minutes)."""
        self._writer.flush()

    def close(self) -> None:
        """Flush and close the event file."""
        self._writer.close()

    def __enter__(self) -> TensorBoardLog:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

