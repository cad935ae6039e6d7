"""`dtrain lighthouse`: the server that keeps the quorum of a run's replica groups
(parallel.replicas), torchft's lighthouse, in the foreground until it is stopped.

Start it once a job, on a host every group reaches (the first host of a SLURM allocation; beside
the first group's torchrun), before or with the groups; give each group its address
(parallel.replicas.lighthouse). It holds no state of the run: one restarted at the same address
takes the groups back at their next quorum. With --exit-when-idle-s it stops once no group has
sent a heartbeat for that long, as the one a launch starts (parallel.replicas.start_lighthouse)
does after a minute; it reads that from the lighthouse's own status page.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import sys
import threading
import time
import urllib.request

from dtrain.core.errors import UserError
from dtrain.core.imports import require


def main(args: argparse.Namespace) -> int:
    os.environ.setdefault("RUST_LOG", "warn")  # not a line per quorum tick (RUST_LOG=info: all)
    require("torchft", "replicas", "dtrain lighthouse")
    from torchft._torchft import LighthouseServer

    if not 0 <= args.port < 65536:
        raise UserError(f"lighthouse error: --port {args.port}: expected 0 to 65535")
    if args.exit_when_idle_s < 0:
        raise UserError("lighthouse error: --exit-when-idle-s must be 0 (never) or more")
    try:
        server = LighthouseServer(
            bind=f"[::]:{args.port}",
            min_replicas=args.min_groups,
            join_timeout_ms=int(args.join_timeout_s * 1000),
            heartbeat_timeout_ms=int(args.heartbeat_timeout_s * 1000),
        )
    except Exception as e:  # noqa: BLE001 - the port taken, an address not ours: one line
        raise UserError(f"lighthouse error: cannot listen on port {args.port}: {e}") from None
    address = server.address()
    print(
        f"lighthouse listening on {address} (min groups {args.min_groups}, a group is lost after "
        f"{args.heartbeat_timeout_s:g} s without a heartbeat); set "
        f"parallel.replicas.lighthouse={address}",
        flush=True,
    )
    stopped = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stopped.set())
    idle = Idle(int(address.rsplit(":", 1)[1]), args.exit_when_idle_s)
    while not stopped.wait(POLL_S if idle.seconds else None) and not idle.expired():
        pass
    why = f": no group for {idle.seconds:g} s" if not stopped.is_set() else ""
    server.shutdown()
    print(f"lighthouse stopped{why}", file=sys.stderr, flush=True)
    return 0


# The lighthouse's status page counts the groups whose heartbeats are current.
HEARTBEATING = re.compile(r"\[(\d+) heartbeating\]")
POLL_S = 1.0
FIRST_GROUP_S = 300.0


class Idle:
    """Whether no group has sent a heartbeat for `seconds` (0: never idle), from the
    lighthouse's own status page. Until a first group is heard, FIRST_GROUP_S at least: the
    groups may take that long to start, and a lighthouse no group reaches stops all the same."""

    def __init__(self, port: int, seconds: float) -> None:
        self.port, self.seconds = port, seconds
        self.started = self.heard = time.monotonic()
        self.any = False  # a group heard yet

    def expired(self) -> bool:
        url = f"http://127.0.0.1:{self.port}/status"
        try:
            with urllib.request.urlopen(url, timeout=POLL_S) as page:
                found = HEARTBEATING.search(page.read().decode("utf-8", "replace"))
        except OSError:
            found = None
        now = time.monotonic()
        if found is None or int(found.group(1)) > 0:  # (a page it cannot read: not idle)
            self.heard, self.any = now, self.any or found is not None
        if not self.any:
            return now - self.started >= max(self.seconds, FIRST_GROUP_S)
        return now - self.heard >= self.seconds
