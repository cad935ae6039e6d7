"""How replica groups reach each other through torchft: the library imported quietly, the
lighthouse checked before anything starts, the address a group advertises, the store its
Manager meets in, the process group that notes who is in each exchange, and the transport that
reads a heal weights-only. `replicas.py` holds what the loop asks of the groups.
"""

from __future__ import annotations

import logging
import os
import socket
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


def check_lighthouse(address: str, timeout_s: float) -> None:
    """One line, before anything is written, where no lighthouse answers at `address`."""
    from urllib.parse import urlsplit

    parts = urlsplit(address)
    try:
        with socket.create_connection((parts.hostname or "", parts.port or 80), timeout_s):
            pass
    except OSError as e:
        raise UserError(
            f"replica groups: no lighthouse answers at {address} ({e.strerror or e}); start "
            f"one there with `dtrain lighthouse` before the groups, or set "
            f"parallel.replicas.lighthouse to where it listens"
        ) from None


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
    from urllib.parse import urlsplit

    parts = urlsplit(lighthouse)
    family = socket.AF_INET6 if ":" in (parts.hostname or "") else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect((parts.hostname or "", parts.port or 80))  # (a route, no packet sent)
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
