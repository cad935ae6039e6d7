"""Where each rank is, for the ranks left waiting on it: its last completed step and its phase,
kept in the rendezvous store, and its Python stack on request, dumped into its own log.

The loop only assigns `Whereabouts.phase` (a Python attribute: no store round trip, no wait). A
thread publishes the step and phase about once a second, when they changed, and watches for a
request for its stack. When a collective times out, each waiting rank asks the ranks that did not
arrive for their stacks and names where they were (`report`).
"""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, Protocol

from dtrain.core.logs import log

_KEYS = "dtrain/where"


def _key(kind: str, rank: int) -> str:
    return f"{_KEYS}/{kind}/{rank}"


class _HasStep(Protocol):
    step: int


class Whereabouts:
    """This rank's last completed step (read from the loop's state) and its phase: "data",
    "forward/backward", "optimizer", "evaluation", "checkpoint", "logging/callbacks" between
    steps, "start-up" before the first."""

    def __init__(self, state: _HasStep) -> None:
        self.state = state
        self.phase = "start-up"
        self._stopped = threading.Event()

    @contextlib.contextmanager
    def doing(self, phase: str) -> Iterator[None]:
        """`phase` while the block runs, the phase before it afterwards."""
        before, self.phase = self.phase, phase
        try:
            yield
        finally:
            self.phase = before

    def publish(
        self, store: Any, rank: int, alive: Callable[[], bool], period_s: float = 1.0
    ) -> None:
        """Name this rank's host in `store` now, then publish the step and phase every
        `period_s` (when they changed) from a thread, until `alive()` is false or the store
        fails (the process group is gone)."""
        store.set(_key("host", rank), socket.gethostname())
        store.add(_key("asked", rank), 0)  # the count of requests for this rank's stack
        threading.Thread(
            target=self._publish,
            args=(store, rank, alive, period_s),
            name="dtrain-whereabouts",
            daemon=True,
        ).start()

    def stop(self) -> None:
        self._stopped.set()

    def _publish(self, store: Any, rank: int, alive: Callable[[], bool], period_s: float) -> None:
        written: tuple[int, str] | None = None
        seen, since = (self.state.step, self.phase), time.monotonic()
        answered = 0
        try:
            while not self._stopped.wait(period_s) and alive():
                now = (self.state.step, self.phase)
                if now != seen:
                    seen, since = now, time.monotonic()
                if now != written:
                    store.set(_key("at", rank), f"{now[0]}|{now[1]}|")
                    written = now
                asked = store.add(_key("asked", rank), 0)
                if asked > answered:
                    # The time in the phase goes with the stack: the waiting ranks show both.
                    seconds = time.monotonic() - since
                    store.set(_key("at", rank), f"{now[0]}|{now[1]}|{seconds:.0f}")
                    where = _dump_stack(rank, now, seconds)
                    answered = asked
                    store.set(_key("dumped", rank), f"{answered}|{where}")
        except Exception:  # noqa: BLE001 - the store is gone: nothing is waiting for this rank
            return


def _dump_stack(rank: int, at: tuple[int, str], seconds: float) -> str:
    """Every thread's Python stack into this rank's log file (stderr before there is one);
    returns the file's name."""
    log.error(
        f"rank {rank} asked for its Python stack by a rank waiting for it: last step {at[0]} "
        f"completed, in {at[1]} for {seconds:.0f} s; every thread's stack follows"
    )
    files = [h for h in log.handlers if isinstance(h, logging.FileHandler) and h.stream]
    if not files:
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        return "stderr"
    handler = files[0]
    handler.flush()
    assert handler.stream is not None
    faulthandler.dump_traceback(file=handler.stream, all_threads=True)
    return os.path.basename(handler.baseFilename)


def host_of(store: Any, rank: int) -> str:
    """The host `rank` named when it started ("?" when it did not)."""
    key = _key("host", rank)
    return store.get(key).decode() if store.check([key]) else "?"


def report(store: Any, ranks: list[int], wait_s: float = 2.5) -> list[str]:
    """One line per rank of `ranks` (the ones that did not arrive): its host, last completed
    step and phase, and where its stack went; each is asked for its stack first, and answers
    within about a second while its process is alive (waits up to `wait_s` in all)."""
    asked = {r: store.add(_key("asked", r), 1) for r in ranks}
    dumped: dict[int, str] = {}
    deadline = time.monotonic() + wait_s
    while len(dumped) < len(ranks) and time.monotonic() < deadline:
        for r in ranks:
            key = _key("dumped", r)
            if r not in dumped and store.check([key]):
                count, where = store.get(key).decode().split("|", 1)
                if int(count) >= asked[r]:
                    dumped[r] = where
        time.sleep(0.1)
    return [_line(store, r, dumped.get(r)) for r in ranks]


def _line(store: Any, rank: int, stack_in: str | None) -> str:
    line = f"rank {rank} (host {host_of(store, rank)}) did not arrive: "
    key = _key("at", rank)
    if not store.check([key]):
        return line + "it never reported a step (it stopped before training began)"
    step, phase, seconds = store.get(key).decode().split("|")
    line += f"last step {step} completed, now in {phase}"
    if seconds:
        line += f" (for {seconds} s)"
    if stack_in is not None:
        return line + f"; its Python stack is in the run directory's {stack_in}"
    return line + "; it did not answer a request for its stack (its process is gone or stuck)"
