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


# A wait for a server (a request to an object store) goes on this long after a stop signal:
# what a store that answers needs to finish a request (a part of an upload), and no more.
STOP_GRACE_S = 5.0


def ends_wait(began: float) -> int | None:
    """The stop signal that ends a wait begun at `began` (time.monotonic()) now, or None: one
    received, and STOP_GRACE_S passed since it came (or since the wait began, when later)."""
    if _received is None or time.monotonic() - max(began, _received_at) < STOP_GRACE_S:
        return None
    return _received
