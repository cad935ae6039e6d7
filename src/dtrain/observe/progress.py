"""Rank 0's console view of training: a progress bar on a terminal, timestamped lines elsewhere."""

from __future__ import annotations

import os
import time
from typing import Any, TextIO

from dtrain.core.logs import ConsoleHandler, log


class Progress:
    """Rank 0's console view of training.

    On a terminal: one bar per epoch with loss, lr, samples/s and the time left, redrawn in place
    at most `REDRAW_S` apart. Anywhere else (a SLURM log, CI, `| tee`): no carriage returns, only
    timestamped lines, one every `train.log_every` steps and one whenever `every_s` seconds pass
    without a line, so that a slow job still shows signs of life and a fast one does not flood
    the file. Logged steps also go to log.txt in both cases.
    """

    REDRAW_S = 0.1
    BAR_WIDTH = 24

    def __init__(self, stream: TextIO, style: str, every_s: float, shown: bool = True) -> None:
        """`shown`: False where this process shows nothing of training (ranks but 0, whose
        console is often rank 0's terminal: a bar of theirs there is one that rank 0's lines
        do not erase)."""
        self.stream = stream
        self.shown = shown
        self.bar = shown and (style == "bar" or (style == "auto" and stream.isatty()))
        self.every_s = every_s
        self.last_line = time.monotonic()
        self.last_draw = 0.0
        self.text = ""  # the bar as it is on screen; "" when none is
        self.epoch, self.epoch_steps = 0, 0
        self.epoch_started = 0.0
        self.first_done: int | None = None  # the step before this attempt's first, once known
        self.latest: tuple[int, dict[str, Any]] | None = None  # the last update, drawn or not
        self.figures: dict[str, Any] = {}  # the last record's figures, kept across epochs
        self.shown_done = 0
        self.linked = False  # whether the console handler redraws the bar after each log line
        if self.bar:
            for handler in log.handlers:
                if isinstance(handler, ConsoleHandler) and handler.stream is stream:
                    handler.bar, self.linked = self, True

    def start_epoch(self, epoch: int, steps: int) -> None:
        self.epoch, self.epoch_steps = epoch, steps
        self.epoch_started, self.first_done, self.latest = time.monotonic(), None, None

    def update(self, done: int, record: dict[str, Any], at_log_step: bool) -> None:
        now = time.monotonic()
        # A resumed epoch starts part-way: time only this attempt's steps.
        if self.first_done is None:
            self.first_done = done - 1
        self.latest = (done, record)
        self.figures = record
        render = self.bar and (
            at_log_step or done >= self.epoch_steps or now - self.last_draw >= self.REDRAW_S
        )
        if render:
            self._render(done, record, now)
        if at_log_step or (not self.bar and now - self.last_line >= self.every_s):
            self.last_line = now
            # the console handler redraws the bar after the line
            log.info(format_record(record, CONSOLE_KEYS))
        if render and not (at_log_step and self.linked):
            self.redraw()

    def tick(self, done: int) -> None:
        """A step without a record: on a terminal the bar's counter moves (with the last
        record's figures, carried across epochs) at most every REDRAW_S; nothing else."""
        if not self.bar:
            return
        now = time.monotonic()
        if self.first_done is None:
            self.first_done = done - 1
        self.latest = (done, self.figures)
        if now - self.last_draw >= self.REDRAW_S or done >= self.epoch_steps:
            self._render(done, self.figures, now)
            self.redraw()

    def line_due(self) -> bool:
        """Whether a plain-lines console owes a line: log.every_s passed without one."""
        return self.shown and not self.bar and time.monotonic() - self.last_line >= self.every_s

    def _render(self, done: int, record: dict[str, Any], now: float) -> None:
        self.last_draw, self.shown_done = now, done
        total = max(1, self.epoch_steps)
        elapsed = now - self.epoch_started
        assert self.first_done is not None  # update and tick set it before any render
        rate = (done - self.first_done) / max(1e-9, elapsed)
        left = (total - done) / rate if rate > 0 else 0.0
        head = f"epoch {self.epoch} {100 * done // total:3d}%|"
        figures = (
            f" loss {record['loss']:.4f} lr {record['lr']:.3g} "
            f"{record['samples_per_s']:.0f} samples/s"
            if record
            else ""
        )
        tail = f"| {done}/{total} [{clock(elapsed)}<{clock(left)}]{figures}"
        # The line must never wrap, or \r no longer returns to its start: the bar gives way first.
        columns = _columns(self.stream) - 1
        width = max(5, min(self.BAR_WIDTH, columns - len(head) - len(tail)))
        filled = int(width * min(done, total) / total)
        self.text = (head + "#" * filled + "." * (width - filled) + tail)[: max(20, columns)]

    def erase(self) -> None:
        if self.text:
            self.stream.write("\r\x1b[K")
            self.stream.flush()

    def redraw(self) -> None:
        if self.text:
            self.stream.write("\r\x1b[K" + self.text)
            self.stream.flush()

    def end_epoch(self) -> None:
        """Leave the finished (or interrupted) bar on screen, up to date, and start a new line."""
        if self.bar and self.latest is not None and self.latest[0] != self.shown_done:
            self._render(*self.latest, time.monotonic())
            self.redraw()
        if self.text:
            self.stream.write("\n")
            self.stream.flush()
            self.text = ""


def _columns(stream: TextIO) -> int:
    try:
        return os.get_terminal_size(stream.fileno()).columns or 80
    except (OSError, ValueError, AttributeError):
        return 80


def clock(seconds: float, always_hours: bool = False) -> str:
    """A duration as MM:SS, or H:MM:SS once it reaches an hour (always, when asked: a column of
    durations then lines up)."""
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    if hours or always_hours:
        return f"{hours}:{minutes:02d}:{secs:02d}"
    return f"{minutes:02d}:{secs:02d}"


# What a training line on the console shows: what a person reads (the loss, the learning rate,
# the throughput) and what is abnormal (skipped steps, replaced samples). Every other figure of
# the record (step times, stragglers' figures, state sizes, ...) is in metrics.jsonl and
# TensorBoard; a straggler is named by a warning line of its own.
CONSOLE_KEYS = (
    "loss",
    "loss_step",
    "lr",
    "samples_per_s",
    "tokens_per_s",
    "mfu",
    "skipped_steps",
    "bad_samples_replaced",
)


def format_record(record: dict[str, Any], keys: tuple[str, ...] | None = None) -> str:
    """`step N | epoch E | key value | ...`: every figure of the record, or only `keys`."""
    parts = [f"step {record['step']}", f"epoch {record['epoch']}"]
    for key, value in record.items():
        if key in ("step", "epoch") or value is None or (keys is not None and key not in keys):
            continue
        parts.append(f"{key} {value:.4g}" if isinstance(value, float) else f"{key} {value}")
    return " | ".join(parts)
