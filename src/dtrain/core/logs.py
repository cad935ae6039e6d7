"""Where log lines go: the console (rank 0, or every rank when asked) and one file per rank in
the run directory, kept in memory until that directory is known to be the run's own."""

from __future__ import annotations

import logging
import logging.handlers
import sys
from typing import Protocol, TextIO

from dtrain.core.columns import fitted

log = logging.getLogger("dtrain")


def setup_logging(rank: int, all_ranks: bool) -> None:
    """Rank 0 logs to the console and log.txt; rank N to log.rankN.txt (and the console if asked).
    Lines are kept until `attach_log_files` names the run directory: a run writes nothing there
    before the directory is known to be its own."""
    log.handlers.clear()
    log.setLevel(logging.INFO)
    log.propagate = False
    prefix = "" if rank == 0 else f"[rank {rank}] "
    fmt = logging.Formatter(f"%(asctime)s {prefix}%(message)s", datefmt="%Y-%m-%d %H:%M:%S")
    if rank == 0 or all_ranks:
        console = ConsoleHandler(sys.stderr)
        console.setFormatter(fmt)
        log.addHandler(console)
    early = logging.handlers.MemoryHandler(capacity=1_000_000, flushLevel=logging.CRITICAL + 1)
    early.setFormatter(fmt)
    log.addHandler(early)


def log_fitted(text: str) -> None:
    """Log `text` as the lines `fitted` cuts it into."""
    for line in fitted(text):
        log.info(line)


def attach_log_files(path: str) -> None:
    """Log into the file at `path` (this rank's in the run directory) from now on, the lines
    logged so far first."""
    handler = RunLogFile(path)
    for early in [h for h in log.handlers if isinstance(h, logging.handlers.MemoryHandler)]:
        handler.setFormatter(early.formatter)
        early.setTarget(handler)
        early.flush()
        log.removeHandler(early)
    log.addHandler(handler)


class RunLogFile(logging.FileHandler):
    """A rank's log file. A line it cannot write (a full disk, a quota) is one warning on the
    console, once until it can write again, never logging's traceback per line: the run goes
    on, and its console still has every line."""

    def __init__(self, path: str) -> None:
        super().__init__(path, encoding="utf-8")
        self.failing = False  # since the last line written
        self._failed = False  # the line being written

    def emit(self, record: logging.LogRecord) -> None:
        self._failed = False
        super().emit(record)
        self.failing = self._failed

    def handleError(self, record: logging.LogRecord) -> None:
        error = sys.exc_info()[1]
        if not isinstance(error, OSError):
            super().handleError(record)
            return
        self._failed = True
        if not self.failing:
            sys.stderr.write(
                f"dtrain: warning: cannot write {self.baseFilename} ({error.strerror or error}); "
                "the lines it misses are on the console\n"
            )


class LiveLine(Protocol):
    """A line redrawn in place on the console (the training's progress bar)."""

    def erase(self) -> None:
        """Take the line off the screen."""

    def redraw(self) -> None:
        """Put it back."""


class ConsoleHandler(logging.StreamHandler):
    """The console handler. A log line first erases a live progress bar on the same terminal and
    redraws it below, so that lines and bar never run into each other."""

    def __init__(self, stream: TextIO) -> None:
        super().__init__(stream)
        self.bar: LiveLine | None = None

    def emit(self, record: logging.LogRecord) -> None:
        bar = self.bar
        if bar is not None:
            bar.erase()
        super().emit(record)
        if bar is not None:
            bar.redraw()
