"""Preemption signals. The handler only records the signal: no I/O and no collectives inside a
handler. The loop reads the flag at each step boundary, and all ranks agree on it through the
step's all-reduce before saving and stopping together. A command with nothing to save (tokenize)
has the signals raise `Stopped` instead, to remove what it had begun writing and exit."""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from collections.abc import Iterator

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


class Stopped(BaseException):
    """A command without checkpoints (tokenize) stopped by a signal. A BaseException, like
    KeyboardInterrupt, so that no `except Exception` on the way (a chat template's own, a
    library's) takes it for an error of the input; its exit code is the shell's, 128 + the
    signal's number (130 for Ctrl-C, 143 for SIGTERM)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.name = signal.Signals(signum).name
        self.exit_code = 128 + signum


_COMMAND_STOPS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def _stop(signum: int, frame: object) -> None:
    for sig in _COMMAND_STOPS:  # a second signal must not cut the cleanup short
        signal.signal(sig, signal.SIG_IGN)
    raise Stopped(signum)


@contextlib.contextmanager
def stops_raise() -> Iterator[None]:
    """Within: SIGTERM, SIGINT and SIGHUP raise Stopped in the main thread, where the command's
    cleanup (an `except BaseException` or `finally`) then runs; the default actions are back
    after. Outside the main thread (signals go to it alone) nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = {sig: signal.signal(sig, _stop) for sig in _COMMAND_STOPS}
    try:
        yield
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


# A wait for a server (a request to an object store) goes on this long after a stop signal:
# what a store that answers needs to finish a request (a part of an upload), and no more.
STOP_GRACE_S = 5.0


def ends_wait(began: float) -> int | None:
    """The stop signal that ends a wait begun at `began` (time.monotonic()) now, or None: one
    received, and STOP_GRACE_S passed since it came (or since the wait began, when later)."""
    if _received is None or time.monotonic() - max(began, _received_at) < STOP_GRACE_S:
        return None
    return _received
