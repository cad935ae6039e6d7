"""Preemption signals. The handler only records the signal: no I/O and no collectives inside a
handler. The loop reads the flag at each step boundary, and all ranks agree on it through the
step's all-reduce before saving and stopping together."""

from __future__ import annotations

import signal
import time

STOP_SIGNALS = (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT, signal.SIGHUP)

_received: int | None = None
_received_at: float = 0.0


def _handler(signum: int, frame: object) -> None:
    global _received, _received_at
    if _received is None:
        _received, _received_at = signum, time.monotonic()
    elif signum == signal.SIGINT:  # a second Ctrl-C means "now", not "at the next step"
        raise KeyboardInterrupt


def install() -> None:
    for sig in STOP_SIGNALS:
        signal.signal(sig, _handler)


def uninstall() -> None:
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_DFL)


def received() -> str | None:
    """The name of the first stop signal received, or None."""
    return signal.Signals(_received).name if _received is not None else None


def seconds_since() -> float:
    return time.monotonic() - _received_at if _received is not None else 0.0
