"""`dtrain lighthouse`: the server that keeps the quorum of a run's replica groups
(parallel.replicas), torchft's lighthouse, in the foreground until it is stopped.

Start it once a job, on a host every group reaches (the first host of a SLURM allocation; beside
the first group's torchrun), before or with the groups; give each group its address
(parallel.replicas.lighthouse). It holds no state of the run: one restarted at the same address
takes the groups back at their next quorum.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading

from dtrain.core.errors import UserError
from dtrain.core.imports import require


def main(args: argparse.Namespace) -> int:
    os.environ.setdefault("RUST_LOG", "warn")  # not a line per quorum tick (RUST_LOG=info: all)
    require("torchft", "replicas", "dtrain lighthouse")
    from torchft._torchft import LighthouseServer

    if not 0 <= args.port < 65536:
        raise UserError(f"lighthouse error: --port {args.port}: expected 0 to 65535")
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
    stopped.wait()
    server.shutdown()
    print("lighthouse stopped", file=sys.stderr, flush=True)
    return 0
