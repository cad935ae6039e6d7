"""The process group and the few collectives the loop needs; each helper is a no-op at world size 1.

The loop never calls torch.distributed itself: it asks `is_main()`, `all_reduce_sum()` and so on,
so the same code runs as one process or many.
"""

from __future__ import annotations

import datetime
import os
import signal
import socket
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.distributed as torch_dist

from dtrain.config import DistConfig
from dtrain.core.errors import UserError
from dtrain.core.logs import log
from dtrain.process import compat, whereabouts
from dtrain.process.env import Env
from dtrain.process.layout import Layout

T = TypeVar("T")


def init(layout: Layout, cfg: DistConfig) -> None:
    """Set the layout's device and, for a distributed launch, create the default process group
    with the layout's backend."""
    env = layout.env
    if env.launcher == "torchrun":
        _die_with_agent()
    if layout.device.type == "cuda":
        torch.cuda.set_device(layout.device)
    if not env.distributed:
        return
    # env:// reads these; srun does not set them, torchrun does (setdefault keeps torchrun's).
    for name, value in (
        ("MASTER_ADDR", env.master_addr),
        ("MASTER_PORT", str(env.master_port)),
        ("RANK", str(env.rank)),
        ("WORLD_SIZE", str(env.world_size)),
        ("LOCAL_RANK", str(env.local_rank)),
    ):
        os.environ.setdefault(name, value)
    init_timeout = datetime.timedelta(seconds=cfg.init_timeout_s)
    torch_dist.init_process_group(
        backend=layout.backend,
        timeout=init_timeout,
        device_id=layout.device if layout.device.type == "cuda" else None,
        **_store_of_this_attempt(env, init_timeout),
    )
    # The rendezvous may be slow (nodes starting at different times); the first collective
    # proves every rank arrived, after which the training timeout applies.
    barrier()
    compat.set_default_timeout(datetime.timedelta(seconds=cfg.timeout_s))


def _store_of_this_attempt(env: Env, timeout: datetime.timedelta) -> dict[str, Any]:
    """torchrun keeps one rendezvous store for all restarts of a job, and the process group's
    keys (each rank's address) carry no attempt number: after `--max-restarts` a worker can read
    the address of a dead worker of the previous attempt and fail to connect. Keys under a prefix
    of their own per attempt avoid that. Elsewhere env:// is used as it is."""
    if env.launcher != "torchrun":
        return {}
    agent_hosts_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = torch_dist.TCPStore(
        env.master_addr,
        env.master_port,
        world_size=env.world_size,
        is_master=env.rank == 0 and not agent_hosts_store,
        timeout=timeout,
    )
    # The agent's store outlives attempts: a prefix per attempt. A store of rank 0's own
    # (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, which elastic joins need) is new every attempt, and
    # the agents' restart counts differ once a node has (re)joined: one prefix for all of them.
    attempt = env.restart_count if agent_hosts_store else 0
    prefixed = torch_dist.PrefixStore(f"dtrain/attempt_{attempt}", store)
    return {"store": prefixed, "rank": env.rank, "world_size": env.world_size}


def _die_with_agent() -> None:
    """torchrun starts each worker in a session of its own, so a worker outlives an agent that is
    killed outright and would go on writing checkpoints beside the run that replaces it. A
    watchdog thread ends this worker once it is orphaned. (The kernel's parent-death signal does
    not fit: it fires when the agent's *thread* that started the worker ends, which torchrun's
    restarts do.)"""
    agent = os.getppid()

    def watch() -> None:
        while os.getppid() == agent:
            time.sleep(1.0)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="dtrain-agent-watchdog", daemon=True).start()


def shutdown() -> None:
    if is_distributed():
        torch_dist.destroy_process_group()


def is_distributed() -> bool:
    return torch_dist.is_available() and torch_dist.is_initialized()


def rank() -> int:
    return torch_dist.get_rank() if is_distributed() else 0


def world_size() -> int:
    return torch_dist.get_world_size() if is_distributed() else 1


def is_main() -> bool:
    return rank() == 0


def barrier(group: Any = None) -> None:
    if is_distributed():
        torch_dist.barrier(group=group)


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """Sum over ranks, in place and returned."""
    if is_distributed():
        torch_dist.all_reduce(tensor, op=torch_dist.ReduceOp.SUM)
    return tensor


def all_reduce_mean(tensor: torch.Tensor) -> torch.Tensor:
    return all_reduce_sum(tensor).div_(world_size())


def all_reduce_max(tensor: torch.Tensor) -> torch.Tensor:
    if is_distributed():
        torch_dist.all_reduce(tensor, op=torch_dist.ReduceOp.MAX)
    return tensor


def any_rank(flag: bool, device: torch.device, group: Any = None) -> bool:
    """True on every rank when `flag` is true on any rank: the way ranks agree on a decision."""
    value = torch.tensor([float(flag)], device=device)
    if is_distributed():
        torch_dist.all_reduce(value, op=torch_dist.ReduceOp.MAX, group=group)
    return bool(value.item())


def broadcast_object(obj: Any, source: int = 0) -> Any:
    """Rank `source`'s `obj` on every rank."""
    if not is_distributed():
        return obj
    box = [obj]
    torch_dist.broadcast_object_list(box, src=source)
    return box[0]


def on_main(fn: Callable[[], T]) -> T:
    """Run `fn` on rank 0 alone and give every rank its result, or its UserError: one rank looks
    at shared files and decides, and every rank acts on the same decision."""
    result: Any = None
    error: UserError | None = None
    if is_main():
        try:
            result = fn()
        except UserError as e:
            error = e
    result, error = broadcast_object((result, error))
    if error is not None:
        raise error
    return result


# torch's typed failures of a collective or of the rendezvous store: NCCL's errors and timeouts,
# a broken connection to the store, a store that does not answer.
_TYPED_FAILURES = (
    torch_dist.DistBackendError,
    torch_dist.DistNetworkError,
    torch_dist.DistStoreError,
)
# gloo raises a plain RuntimeError (torch 2.14): for a lost peer "[.../gloo/transport/tcp/pair.cc]
# Connection closed by peer", for a stalled one "Timed out waiting 10000ms for recv operation to
# complete", and on the next collective after a timeout "Application timeout caused pair closure".
_GLOO_FAILURE_SIGNS = (
    "gloo/transport/",
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "Timed out waiting",
    "caused pair closure",
)


def is_collective_failure(error: BaseException) -> bool:
    """Whether `error` is a collective that failed because of another rank (a timeout, a closed
    connection), as opposed to a bug of this rank's own."""
    if isinstance(error, _TYPED_FAILURES):
        return True
    return isinstance(error, RuntimeError) and any(s in str(error) for s in _GLOO_FAILURE_SIGNS)


def ranks_not_arriving(tag: str, wait_s: float = 3.0) -> list[int] | None:
    """After a failed collective: the ranks that do not report back through the rendezvous store
    within `wait_s` (the stalled or dead ones). Every rank whose collective failed reports itself.
    None when the store itself is gone (its host, rank 0's agent, died).

    Each missing rank is then asked for its Python stack (dumped into its own log) and logged
    here with its host, last completed step and phase (`whereabouts.report`)."""
    try:
        store = compat.default_store()
        store.set(f"dtrain/alive/{tag}/{rank()}", "1")
        deadline = time.monotonic() + wait_s
        missing = list(range(world_size()))
        while missing and time.monotonic() < deadline:
            missing = [r for r in missing if not store.check([f"dtrain/alive/{tag}/{r}"])]
            if missing:
                time.sleep(0.1)
    except Exception:  # noqa: BLE001 - the store is best effort here
        return None
    try:
        for line in whereabouts.report(store, missing):
            log.error(line)
    except Exception:  # noqa: BLE001 - the names above are what matters; this is detail
        pass
    return missing


def publish_whereabouts(where: whereabouts.Whereabouts) -> None:
    """Keep this rank's step and phase in the rendezvous store while the process group lives,
    for the ranks that may wait on it (no-op at world size 1)."""
    if is_distributed():
        where.publish(compat.default_store(), rank(), alive=is_distributed)


def host_of(of_rank: int) -> str:
    """The host that rank `of_rank` runs on, as it named it at start (`publish_whereabouts`)."""
    if not is_distributed():
        return socket.gethostname()
    try:
        return whereabouts.host_of(compat.default_store(), of_rank)
    except Exception:  # noqa: BLE001 - a name in a log line: never worth failing for
        return "?"


_ABORT_KEY = "dtrain/abort"


def announce_abort(message: str) -> None:
    """A rank that stops on bad input (an unreadable image, say) leaves its message in the
    rendezvous store before it exits, so that the ranks it leaves waiting in a collective can
    stop with the same line instead of a lost-peer error. Best effort."""
    if not is_distributed():
        return
    try:
        compat.default_store().set(_ABORT_KEY, message)
    except Exception:  # noqa: BLE001 - the store may be gone already
        pass


def abort_message(wait_s: float = 1.0) -> str | None:
    """The message another rank announced before it stopped, if any (waiting up to `wait_s`)."""
    try:
        store = compat.default_store()
        deadline = time.monotonic() + wait_s
        while True:
            if store.check([_ABORT_KEY]):
                return store.get(_ABORT_KEY).decode()
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.05)
    except Exception:  # noqa: BLE001 - the store itself is gone
        return None


def gather_objects(obj: Any, group: Any = None) -> list[Any]:
    """Every rank's `obj`, in rank order, on every rank."""
    if not is_distributed():
        return [obj]
    out: list[Any] = [None] * world_size()
    torch_dist.all_gather_object(out, obj, group=group)
    return out


def check_shared(run_dir: str) -> None:
    """Every rank writes a probe file into the run directory and looks for everyone else's: a
    directory that is not one shared filesystem (node-local disks, a mount missing on a node)
    would make ranks resume from different checkpoints or hang, so it is refused before training,
    with the same message on every rank."""
    if world_size() == 1:
        return
    token = broadcast_object(uuid.uuid4().hex[:12])
    own = os.path.join(run_dir, f".probe-{token}-rank{rank()}")
    with open(own, "w", encoding="utf-8") as f:
        f.write(socket.gethostname())
    barrier()
    unseen = [
        r
        for r in range(world_size())
        if not os.path.exists(os.path.join(run_dir, f".probe-{token}-rank{r}"))
    ]
    reports = gather_objects((socket.gethostname(), unseen))
    barrier()  # nobody removes a probe before everyone has looked
    os.remove(own)
    problems = [(r, host, unseen) for r, (host, unseen) in enumerate(reports) if unseen]
    if problems:
        hosts = {r: host for r, (host, _) in enumerate(reports)}
        who, host, missing = problems[0]
        missing_text = ", ".join(f"{r} (host {hosts[r]})" for r in missing)
        raise UserError(
            f"storage error: the run directory {run_dir} is not shared by all ranks: "
            f"rank {who} (host {host}) does not see the files written there by rank(s) "
            f"{missing_text}; put run.out_dir on a filesystem that every node mounts, or put "
            f"the run in an object store (run.out_dir=s3://...)"
        )
