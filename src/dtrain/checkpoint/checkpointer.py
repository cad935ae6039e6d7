"""The `Checkpointer`: saves a run's model, optimizer and named parts, and resumes them.

- A save writes into a temporary folder, every rank reports the files it wrote, rank 0 writes the
  marker into it and renames the folder into place, updates `latest`, rotates, and only then do
  the ranks go on (they agree on the outcome), so no rank can exit while the newest checkpoint is
  still being published.
- Resuming: rank 0 chooses (the newest complete checkpoint, or `ckpt.resume: PATH`) and every
  rank loads exactly that one. A checkpoint is read and checked completely before anything of it
  is applied: a failed attempt leaves the fresh model, optimizer, parts and random states
  untouched.
- A fresh start or a rewind in a directory with checkpoints moves the abandoned ones aside
  (`superseded/<time>/`) instead of mixing two histories.

What the parts are (`parts`: the loop's position, the schedule, ...) is their owner's business:
the checkpointer saves and loads them by name.
"""

from __future__ import annotations

import os
import shutil
import socket
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

import torch

import dtrain
from dtrain.checkpoint import digest
from dtrain.checkpoint import state as ckpt_state
from dtrain.checkpoint.load import (
    ConfigChanged,
    load_run,
    local_folder,
    model_state,
    state_options,
)
from dtrain.checkpoint.parts import Contents
from dtrain.checkpoint.state import (
    DCP_DIR,
    FORMAT_VERSION,
    FULL_FILE,
    META_FILE,
    META_KEYS,
    POSITION,
    Resumed,
)
from dtrain.config import CkptConfig
from dtrain.core.errors import OutsideName, UserError, first_line
from dtrain.core.logs import log
from dtrain.files.objstore import StoreUnanswered, is_url
from dtrain.files.store import (
    FETCHED_PREFIX,
    CheckpointError,
    Entry,
    checkpoint_name,
    error_of_save,
    file_sizes,
)
from dtrain.files.store_protocol import CheckpointStore
from dtrain.parallel import whole_shapes
from dtrain.process import dist, rng
from dtrain.process.layout import Layout

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup


class Checkpointer:
    """Saves and restores everything a run needs to continue exactly: its `Contents`."""

    def __init__(
        self, *, ckpt: CkptConfig, layout: Layout, store: CheckpointStore, contents: Contents
    ) -> None:
        """`ckpt` is the config's checkpoint section; `layout` says the device and the format
        (full or sharded); `store` keeps the files."""
        self.ckpt, self.store, self.contents = ckpt, store, contents
        self.device = layout.device
        self.format = layout.checkpoint_format
        self.random_rank = layout.random_rank  # whose random states this rank resumes with
        self.last_saved_step: int | None = None
        self.config_changes: list[str] = []  # training keys changed since the resumed checkpoint
        self.superseded: str | None = None  # where an abandoned history was moved
        self._thread: threading.Thread | None = None
        self._before_save: int | None = None  # the last saved step before the save under way
        self.last_error: CheckpointError | None = None  # a failed save that was let go
        self._error: BaseException | None = None
        self._resumed: Resumed | None = None
        # Background saves run their collectives on a group of their own, so that they never
        # interleave with the training collectives on the default group.
        self._save_group: ProcessGroup | None = None
        self._save_device = self.device
        if ckpt.async_ and dist.is_distributed():
            import torch.distributed as torch_dist

            # A group of all ranks: no rank gets new_group's non-member placeholder.
            self._save_group = cast("ProcessGroup", torch_dist.new_group(backend="gloo"))
            self._save_device = torch.device("cpu")
        # This node's copy of a store's checkpoint, to resume (by host: nodes may share a disk).
        self._fetched = os.path.join(store.dir, f"{FETCHED_PREFIX}{socket.gethostname()}")
        if dist.is_main():
            store.prepare()
        dist.barrier()

    # -- saving ---------------------------------------------------------------------------------
    def save(self, step: int, epoch: int, metrics: dict[str, float]) -> None:
        """Save at optimizer step `step` of epoch `epoch`, `metrics` being the run's last
        evaluation (with its "step"). With ckpt.async the write continues in the background."""
        self.wait()
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        ckpt = self.ckpt
        # Only a checkpoint of the evaluated weights carries the metric (and competes for best).
        value = metrics.get(ckpt.monitor) if metrics.get("step") == step else None
        name = checkpoint_name(step, epoch, ckpt.monitor, value)
        tmp = dist.on_main(lambda: self.store.begin(name))
        os.makedirs(tmp, exist_ok=True)  # on every node: where each rank's files go first
        contents = self.contents
        parts = contents.parts
        meta = {
            "format_version": FORMAT_VERSION,
            "format": self.format,
            POSITION: parts[POSITION].state_dict(),
            "extra": {n: part.state_dict() for n, part in parts.items() if n != POSITION},
            "world_size": dist.world_size(),
            "rng": dist.gather_objects(rng.capture(self.device)),
            "config": contents.config,
            "model_info": contents.model_info,
            "metrics": dict(metrics),
            "versions": {"dtrain": dtrain.__version__, "torch": str(torch.__version__)},
        }
        assert tuple(meta) == META_KEYS
        marker = {
            "step": step,
            "epoch": epoch,
            "format": self.format,
            "world_size": dist.world_size(),
            "metric": ckpt.monitor,
            "value": value,
        }
        full = self.format == "full"
        payload = {
            "model": model_state(contents.model, full, contents.spec),
            "optimizer": get_optimizer_state_dict(
                contents.model, contents.optimizer, options=state_options(full, contents.spec)
            ),
        }
        for part_name, part in contents.sharded.items():
            payload[part_name] = part.state_dict(full=full)
        self._before_save = self.last_saved_step
        self.last_saved_step = step
        if not ckpt.async_:
            try:
                self._write(name, tmp, payload, meta, marker, pending=None)
            except CheckpointError as e:
                self._failed(e)
            return
        pending = None
        if self.format == "full":
            payload = ckpt_state.cpu_copy(payload)  # rank 0's consolidated copy; empty elsewhere
        else:
            pending = self._start_sharded_async(name, tmp, payload)
        meta = ckpt_state.cpu_copy(meta)
        self._thread = threading.Thread(
            target=self._write_guarded,
            name="dtrain-checkpoint",
            args=(name, tmp, payload, meta, marker, pending),
            daemon=True,
        )
        self._thread.start()

    def _start_sharded_async(self, name: str, tmp: str, payload: dict) -> Any:
        """DCP's asynchronous save: the shards are copied to CPU memory now (pinned on CUDA),
        and written by DCP's own thread; returns its future and the (hashing) writer."""
        import torch.distributed.checkpoint as dcp

        writer = digest.hashing_writer(os.path.join(tmp, DCP_DIR), self._streams(name))
        future = dcp.async_save(
            payload,
            storage_writer=writer,
            process_group=self._save_group,
            no_dist=not dist.is_distributed(),
        )
        return future, writer

    def _write_guarded(self, *args: Any) -> None:
        try:
            self._write(*args)
        except BaseException as e:  # noqa: BLE001 - reported by wait() on the main thread
            self._error = e

    def _write(
        self, name: str, tmp: str, payload: dict, meta: dict, marker: dict, pending: Any
    ) -> None:
        """Write the files, publish on rank 0, and let no rank go on before it is published."""
        group = self._save_group if self.ckpt.async_ else None
        error: CheckpointError | None = None
        needed = ckpt_state.tensor_bytes(payload) + ckpt_state.tensor_bytes(meta)
        own_files: tuple[dict[str, int], dict[str, str]] = ({}, {})
        try:
            if self.format == "sharded":
                if pending is not None:
                    future, writer = pending
                    future.result()
                else:
                    writer = ckpt_state.write_sharded(tmp, payload, group, self._streams(name))
                own_files = digest.own_files(os.path.join(tmp, DCP_DIR), dist.rank(), writer)
                self.store.upload(name, tmp, list(own_files[0]))  # the store is not this disk
        except BaseException as e:  # noqa: BLE001 - DCP raises CheckpointException (BaseException)
            if isinstance(e, KeyboardInterrupt):
                raise
            error = error_of_save(e, name, self.store.dir, needed, self.store.location)
        reports = dist.gather_objects(own_files, group) if self.format == "sharded" else []
        if dist.is_main() and error is None:
            try:
                self._publish(name, tmp, payload, meta, marker, reports)
            except Exception as e:  # noqa: BLE001 - a disk's or an object store's failure
                error = error_of_save(e, name, self.store.dir, needed, self.store.location)
        if dist.any_rank(error is not None, self._save_device, group):
            if dist.is_main():
                shutil.rmtree(tmp, ignore_errors=True)
                try:
                    self.store.discard(name)
                except Exception as e:  # noqa: BLE001 - removed at the next start then
                    log.warning(f"could not remove the failed save {name}: {first_line(e)}")
            raise error or CheckpointError(
                f"checkpoint error: saving {name} failed on another "
                f"rank; the previous checkpoint is kept"
            )

    def _streams(self, name: str) -> Any:
        """DCP's files of the save `name` as they are written: each uploaded meanwhile where the
        store is not this disk (`Store.streaming`)."""
        return lambda rel: self.store.streaming(name, f"{DCP_DIR}/{rel}")

    def _publish(
        self,
        name: str,
        tmp: str,
        payload: dict,
        meta: dict,
        marker: dict,
        reports: list[tuple[dict[str, int], dict[str, str]]],
    ) -> None:
        """Rank 0, after every shard is on disk: the rest of the files, then the marker listing
        every rank's files with their sizes and digests, `latest`, and rotation."""
        own = FULL_FILE if self.format == "full" else META_FILE
        data = {**meta, **payload} if self.format == "full" else meta
        digests = {
            own: ckpt_state.torch_save(
                data, os.path.join(tmp, own), self.store.streaming(name, own)
            )
        }
        files = file_sizes(tmp)
        # Other ranks' shards, also where rank 0 cannot see them.
        for sizes, shard_digests in reports:
            files.update(sizes)
            digests.update(shard_digests)
        self.store.upload(name, tmp, [own])
        final = self.store.publish(name, tmp, marker, files, digests)
        log.info(f"saved checkpoint {final}")
        ckpt = self.ckpt
        try:  # the checkpoint is complete: a rotation that fails never undoes it
            self.store.rotate(ckpt.keep_last, ckpt.keep_best, ckpt.monitor, ckpt.monitor_mode)
        except Exception as e:  # noqa: BLE001 - the next save rotates again
            log.warning(f"could not rotate the checkpoints in {self.store.location}: {e}")

    def wait(self) -> None:
        """Block until a background save is finished; raise its error if it failed."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            if not isinstance(error, CheckpointError):
                raise error
            self._failed(error)

    def _failed(self, error: CheckpointError) -> None:
        """A failed save ends the run on a disk (full, read-only: it stays so); in an object
        store (a connection lost: it passes) it is one warning and the next save tries again.
        Every rank comes here alike: they agreed on the failure."""
        if not self.store.retries_saves:
            raise error
        self.last_error = error
        self.last_saved_step = self._before_save
        log.warning(f"{error}; training goes on, and the next save tries again")

    # -- resuming -------------------------------------------------------------------------------
    def resume(self) -> Resumed | None:
        """Load what `ckpt.resume` names into the model, optimizer, state and parts; returns
        where it came from, or None for a fresh start."""
        choice = self.ckpt.resume
        if choice == "none":
            self._supersede(lambda entries: entries, "fresh start (ckpt.resume=none)", records=True)
            log.info("fresh start (ckpt.resume=none)")
            return None
        if choice != "auto":
            return self._resume_from(choice)
        candidates = dist.on_main(lambda: [e.path for e in self.store.complete()])
        failed: list[str] = []
        for path in candidates:
            problem = self._try_load(path)
            if problem is None:
                if failed:
                    log.warning(
                        f"newest checkpoint {os.path.basename(failed[0])} is unusable; "
                        f"resumed from the previous good one, {os.path.basename(path)}"
                    )
                    self._supersede(
                        lambda entries: [e for e in entries if e.path in failed],
                        "unusable checkpoints",
                    )
                return self._resumed
            log.warning(
                f"checkpoint {os.path.basename(path)} is unusable ({problem}); trying an older one"
            )
            failed.append(path)
        if failed:
            log.warning(
                f"no usable checkpoint in {self.store.location} "
                f"({', '.join(map(os.path.basename, failed))} unusable): fresh start"
            )
            self._supersede(lambda entries: entries, "unusable checkpoints", records=True)
            # Reading an optimizer's state dict creates its state (torch takes a step with zero
            # gradients and lr 0: momentum buffers, Adam's step count). A fresh start needs none.
            self.contents.optimizer.state.clear()
        else:
            log.info(f"no checkpoint in {self.store.location}: fresh start")
        return None

    def _resume_from(self, choice: str) -> Resumed:
        """`ckpt.resume: PATH`: that checkpoint or exit 2. A checkpoint of this run directory
        that is not the newest is a rewind: the ones saved after it are moved aside; one of
        another directory starts a new history here."""
        path = choice[: -len(FULL_FILE) - 1] if choice.endswith(FULL_FILE) else choice
        if not is_url(path) and not os.path.exists(path):
            raise UserError(f"checkpoint error: ckpt.resume: {choice} not found")
        problem = self._try_load(path)
        if problem:
            raise UserError(f"checkpoint error: ckpt.resume: {problem}")
        own = dist.on_main(lambda: self.store.find(path) is not None)
        if own:

            def newer(entries: list[Entry]) -> list[Entry]:
                chosen = self.store.find(path)
                return [e for e in entries if chosen is not None and e.seq > chosen.seq]

            self._supersede(newer, f"rewound to {os.path.basename(os.path.normpath(path))}")
        else:
            self._supersede(
                lambda entries: entries,
                f"resumed from {path}, a checkpoint of another run directory",
                records=True,
            )
        assert self._resumed is not None
        return self._resumed

    def _supersede(
        self, pick: Callable[[list[Entry]], list[Entry]], reason: str, records: bool = False
    ) -> None:
        """Rank 0 moves the checkpoints `pick` chooses (and with `records` the run's records)
        aside; every rank learns where they went."""

        def move() -> str | None:
            return self.store.supersede(pick(self.store.complete()), reason, records)

        self.superseded = dist.on_main(move) or self.superseded

    def _try_load(self, path: str) -> str | None:
        """Load the checkpoint at `path` on every rank; None on success, else the reason. Every
        rank reaches the same verdict. A config or a model that trains something else (exit 2,
        a ModelMismatch too: a checkpoint that reads back whole is not damaged), a crafted name,
        or a store that does not answer (exit 1: nothing is known of the checkpoint, least of
        all that it is damaged), is not a reason to try an older checkpoint: it ends the start."""
        problem = None
        try:
            every_rank = whole_shapes(self.contents.model) is not None
            local = local_folder(
                path, self._fetched, self.store.options, self.store.timeout_s, every_rank
            )
            shown = path.rstrip("/") if is_url(path) else None
            resumed, self.config_changes = load_run(
                self.contents, local, shown, self.ckpt, self.device, self.random_rank
            )
            self._resumed, self.last_saved_step = resumed, resumed.step
        except (ConfigChanged, OutsideName, StoreUnanswered):  # every rank, or told by one
            shutil.rmtree(self._fetched, ignore_errors=True)
            raise
        except UserError as e:
            problem = str(e).removeprefix("checkpoint error: ")
        if dist.any_rank(problem is not None, self.device) and problem is None:
            problem = f"{path} failed to load on another rank"
        shutil.rmtree(self._fetched, ignore_errors=True)  # every rank is done with it now
        return problem
