"""How replica groups reach each other through torchft: the library imported quietly, the
lighthouse checked before anything starts, the address a group advertises, the store its
Manager meets in, the process group that notes who is in each exchange, and the transport that
reads a heal weights-only. `replicas.py` holds what the loop asks of the groups.
"""

from __future__ import annotations

import fcntl
import logging
import os
import socket
import subprocess
import sys
import time
import urllib.request
from datetime import timedelta
from typing import Any

from dtrain.core.errors import UserError, first_line
from dtrain.core.imports import require
from dtrain.process import compat, dist

FEATURE = "parallel.replicas"


def quiet_torchft() -> None:
    """torchft, imported with its logs kept to what a user acts on: its servers' per-step lines
    (Rust, RUST_LOG) at warnings unless the user asks for more, its Python loggers silent (a
    lost peer's traceback on every group): dtrain says what happened, in one line each."""
    os.environ.setdefault("RUST_LOG", "warn")
    require("torchft", "replicas", FEATURE)
    logging.getLogger("torchft").setLevel(logging.CRITICAL)


# A lighthouse a launch started stops once no group has sent it a heartbeat for this long.
IDLE_S = 60.0
WAIT_POLL_S = 0.2


def reach_lighthouse(address: str, timeout_s: float, start: bool, log_path: str) -> str | None:
    """The lighthouse answers at `address` before anything starts, or one line says it does
    not. With parallel.replicas.start_lighthouse, the launch on the host the address names
    starts one there when none answers (its first process: the others wait for it), in a
    session of its own so that it outlives the launch (a group's restart included) until no
    group has been heard for IDLE_S; a launch on another host waits for it up to
    2 x timeout_s (the group that starts it may come later). Returns the line that says it
    started one (to log once the console is set up), if it did."""
    started = None
    if start:
        host, port = _host_port(address)
        deadline = time.monotonic() + 2 * timeout_s
        if _is_this_host(host) and _first_process():
            started = _start_unless_answering(host, port, log_path, deadline)
        while _connect_error(host, port, timeout_s) and time.monotonic() < deadline:
            time.sleep(WAIT_POLL_S)
    check_lighthouse(address, timeout_s)
    return started


def _host_port(address: str) -> tuple[str, int]:
    from urllib.parse import urlsplit

    parts = urlsplit(address)
    return parts.hostname or "", parts.port or 80


def _connect_error(host: str, port: int, timeout_s: float) -> OSError | None:
    """Why nothing answers at host:port, or None where something does."""
    try:
        with socket.create_connection((host, port), timeout_s):
            return None
    except OSError as e:
        return e


def _is_this_host(host: str) -> bool:
    """Whether `host` names an address of this machine (one it can bind)."""
    try:
        found = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError:
        return False
    for family, kind, _, _, where in found:
        with socket.socket(family, kind) as probe:
            try:
                probe.bind((where[0], 0))
                return True
            except OSError:
                continue
    return False


def _first_process() -> bool:
    """The launch's first process on this host (a plain process; torchrun's local rank 0; an
    srun step's task 0 on the node)."""
    return os.environ.get("LOCAL_RANK", os.environ.get("SLURM_LOCALID", "0")) == "0"


def _start_unless_answering(host: str, port: int, log_path: str, deadline: float) -> str | None:
    """Start a lighthouse where none answers yet, one launch at a time: groups of one run
    directory started together on this host take a lock on its log in turn, so that the
    second finds the first one's lighthouse answering rather than starting one that exits at
    once on the taken port (and saying that it started it). The line that says it started
    one, where this launch's lighthouse is the one that answers."""
    os.makedirs(os.path.dirname(log_path), exist_ok=True)
    with open(log_path, "a", encoding="utf-8") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # (released as the file closes)
        if not _connect_error(host, port, WAIT_POLL_S):
            return None
        server = _start_lighthouse(port, log_path)
        while (
            _connect_error(host, port, WAIT_POLL_S)
            and server.poll() is None
            and time.monotonic() < deadline
        ):
            time.sleep(WAIT_POLL_S)
        if server.poll() is not None:  # (it could not listen: its log says why)
            return None
    return (
        f"started a lighthouse (pid {server.pid}) on port {port} of this host "
        f"(parallel.replicas.start_lighthouse; its log: {log_path}): it stops once no group "
        f"has been heard for {IDLE_S:g} s"
    )


def _start_lighthouse(port: int, log_path: str) -> subprocess.Popen[bytes]:
    command = [sys.executable, "-m", "dtrain", "lighthouse", f"--port={port}"]
    with open(log_path, "a", encoding="utf-8") as out:
        return subprocess.Popen(
            [*command, f"--exit-when-idle-s={IDLE_S:g}"],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # (not stopped with the launch, nor by its restart)
        )


def check_lighthouse(address: str, timeout_s: float) -> None:
    """One line, before anything is written, where no lighthouse answers at `address`."""
    error = _connect_error(*_host_port(address), timeout_s)
    if error:
        raise UserError(
            f"replica groups: no lighthouse answers at {address} ({error.strerror or error}); "
            f"start one there with `dtrain lighthouse` before the groups, or set "
            f"parallel.replicas.lighthouse to where it listens"
        )


def recording_members(process_group: Any, replicas: Any, group_size: int) -> Any:
    """torchft's process group for the exchange between groups, noting which groups each new
    quorum sets it up with: the global ranks it is given are group x group size + rank, as
    the groups' ids ("group_<g>") number them."""

    class Recording(process_group):
        def configure(self, *args: Any, **kwargs: Any) -> None:
            ranks = kwargs.get("global_ranks", args[7] if len(args) > 7 else None)
            if ranks is not None:
                replicas.members = {int(r) // group_size for r in ranks}
            super().configure(*args, **kwargs)

    return Recording


def advertised_host(lighthouse: str) -> str:
    """The address the other groups reach this host at: the one of the interface that routes to
    the lighthouse (which every group reaches), not the host's name, which hosts in containers
    or network namespaces may share."""
    host, port = _host_port(lighthouse)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect((host, port))  # (a route, no packet sent)
        return str(probe.getsockname()[0])


def group_store(group_rank: int, host: str) -> int:
    """The port of the TCP store this group's Manager keeps its rendezvous in, at `host`: one
    started here on the group's first rank, its port shared with the group's other ranks; the
    other groups connect to it when the quorum changes."""
    from torch.distributed import TCPStore

    port = 0
    if group_rank == 0:
        store = TCPStore(host, 0, is_master=True, wait_for_workers=False)
        _STORES.append(store)  # kept for the process's lifetime, as the Manager holds a client
        port = store.port
    return int(dist.broadcast_object(port))


_STORES: list[Any] = []


def weights_only_transport(timeout: timedelta, host: str) -> Any:
    """torchft's HTTP checkpoint transport, reading a peer's state with torch's weights-only
    loader: a heal receives tensors and plain values, never code to run (torchft's own reader
    unpickles whatever the address serves); its address names `host`, not the host's name."""
    from torchft.checkpointing.http_transport import HTTPTransport

    class WeightsOnly(HTTPTransport):
        @classmethod
        def _load_from_address(cls, address: str, timeout: timedelta) -> object:
            try:
                with urllib.request.urlopen(address, timeout=timeout.total_seconds()) as f:
                    return compat.stream_load_weights_only(f)
            except Exception as e:  # noqa: BLE001 - a peer lost mid-copy: said in a line
                raise RuntimeError(f"the heal from {address} broke off: {first_line(e)}") from None

        def address(self) -> str:
            port = self._server.socket.getsockname()[1]
            shown = f"[{host}]" if ":" in host else host
            return f"http://{shown}:{port}/checkpoint/"

    return WeightsOnly(timeout=timeout, num_chunks=0)
