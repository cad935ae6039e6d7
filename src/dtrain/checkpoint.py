"""Checkpoints that are never half-written, rotate safely, and resume a run exactly.

Layout under `<run dir>/checkpoints/`:

    step_000120-epoch_01-val_acc_0.9412/   one checkpoint
        checkpoint.pt                      format "full": everything, one file written by rank 0
        dcp/  meta.pt                      format "sharded": DCP shards from every rank + the rest
        COMPLETE                           written last: step, format and every file's size
    latest                                 the name of the newest complete checkpoint
    .tmp-step_.../                         a save in progress (never loaded; removed at start-up)

A save writes into `.tmp-<name>`, fsyncs, renames it to `<name>`, writes `COMPLETE`, then
updates `latest`, and only then deletes checkpoints that rotation no longer keeps. Loading uses
`weights_only=True` throughout: a checkpoint holds tensors, numbers and strings only.
"""

from __future__ import annotations

import errno
import json
import os
import random
import re
import shutil
import threading
from dataclasses import asdict
from typing import Any, Callable, Optional

import numpy
import torch
import torch.distributed as torch_dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict)

import dtrain
from dtrain import dist
from dtrain.config import Config, to_dict
from dtrain.errors import UserError
from dtrain.observe import log

MARKER = "COMPLETE"
FULL_FILE = "checkpoint.pt"
META_FILE = "meta.pt"
DCP_DIR = "dcp"
_NAME = re.compile(r"^step_(\d+)-epoch_(\d+)(?:-([A-Za-z_]+)_(-?[0-9.]+|nan|inf))?$")


class CheckpointError(Exception):
    """A save failed (disk full, no permission): exit 1, with the previous checkpoint kept."""

    exit_code = 1


# ---------------------------------------------------------------------------------------------
# RNG states, stored as tensors, ints and strings so that weights_only loading accepts them

def rng_state(device: torch.device) -> dict[str, Any]:
    np_state = numpy.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": {"name": np_state[0], "keys": torch.from_numpy(np_state[1].astype(numpy.int64)),
                  "pos": int(np_state[2]), "has_gauss": int(np_state[3]), "gauss": float(np_state[4])},
        "torch": torch.get_rng_state(),
    }
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    np_state = state["numpy"]
    numpy.random.set_state((np_state["name"], np_state["keys"].numpy().astype(numpy.uint32),
                            np_state["pos"], np_state["has_gauss"], np_state["gauss"]))
    torch.set_rng_state(state["torch"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


# ---------------------------------------------------------------------------------------------
# Small file-system helpers

def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_atomic(path: str, data: bytes) -> None:
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(os.path.dirname(path) or ".")


def _torch_save(obj: Any, path: str) -> None:
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def _file_sizes(root: str) -> dict[str, int]:
    sizes = {}
    for folder, _, files in os.walk(root):
        for name in files:
            full = os.path.join(folder, name)
            sizes[os.path.relpath(full, root)] = os.path.getsize(full)
    return sizes


def _tensor_bytes(obj: Any) -> int:
    if isinstance(obj, torch.Tensor):
        local = obj.to_local() if hasattr(obj, "to_local") else obj
        return local.numel() * local.element_size()
    if isinstance(obj, dict):
        return sum(_tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(v) for v in obj)
    return 0


def _clone(obj: Any) -> Any:
    """A copy of every tensor, so that a background write is not changed by training."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: _clone(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_clone(v) for v in obj]
    return obj


def checkpoint_name(step: int, epoch: int, monitor: str, value: Optional[float]) -> str:
    name = f"step_{step:06d}-epoch_{epoch:02d}"
    return name if value is None else f"{name}-{monitor}_{value:.4f}"


def parse_name(name: str) -> Optional[tuple[int, int, Optional[str], Optional[float]]]:
    match = _NAME.match(name)
    if not match:
        return None
    step, epoch, metric, value = match.groups()
    return int(step), int(epoch), metric, float(value) if value is not None else None


def read_marker(path: str) -> Optional[dict[str, Any]]:
    try:
        with open(os.path.join(path, MARKER), encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def verify_files(path: str, marker: dict[str, Any]) -> Optional[str]:
    """None when every file the marker lists is there with its size; else what is wrong."""
    for name, size in marker.get("files", {}).items():
        full = os.path.join(path, name)
        if not os.path.isfile(full):
            return f"{name} is missing"
        actual = os.path.getsize(full)
        if actual != size:
            return f"{name} has {actual} bytes, expected {size}"
    return None


def open_checkpoint(path: str) -> tuple[str, str]:
    """The folder and format of the checkpoint at `path` (its folder, or a bare checkpoint.pt),
    after checking that its save completed and that every file it lists has its size."""
    folder = path if os.path.isdir(path) else os.path.dirname(path)
    marker = read_marker(folder)
    if marker is None:
        if os.path.isdir(path):
            raise UserError(f"checkpoint error: {folder} has no {MARKER} marker (incomplete save)")
        return folder, "full"
    wrong = verify_files(folder, marker)
    if wrong:
        raise UserError(f"checkpoint error: {folder}: {wrong} (truncated or damaged)")
    return folder, marker["format"]


def load_file(path: str) -> dict[str, Any]:
    """torch.load with weights_only=True and errors a user can act on."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise UserError(f"checkpoint error: {path} not found") from None
    except Exception as e:  # noqa: BLE001 - any failure here means "not a usable checkpoint"
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        if "weights_only" in str(e) or "Unsupported global" in str(e):
            raise UserError(f"checkpoint error: {path} holds objects that need arbitrary "
                            f"unpickling; refused (weights_only=True): {first}") from None
        raise UserError(f"checkpoint error: {path} is corrupt or not a checkpoint: {first}") from None


# ---------------------------------------------------------------------------------------------

class Checkpointer:
    """Saves and restores everything a run needs to continue exactly."""

    def __init__(self, cfg: Config, run_dir: str, model: nn.Module, optimizer: torch.optim.Optimizer,
                 extra_state: Callable[[], dict[str, Any]],
                 load_extra_state: Callable[[dict[str, Any]], None],
                 device: torch.device, is_fsdp: bool, model_info: dict[str, int]) -> None:
        self.cfg, self.model, self.optimizer = cfg, model, optimizer
        self.model_info = model_info  # what rebuilding the model needs (dtrain export)
        self.extra_state, self.load_extra_state = extra_state, load_extra_state
        self.device = device
        self.dir = os.path.join(run_dir, "checkpoints")
        fmt = cfg.ckpt.format
        self.format = fmt if fmt != "auto" else ("sharded" if is_fsdp else "full")
        self.last_saved_step: Optional[int] = None
        self._resumed: Optional[dict[str, Any]] = None
        self._thread: Optional[threading.Thread] = None
        self._error: Optional[BaseException] = None
        # Background DCP saves run their collectives on a group of their own, so that they never
        # interleave with the training collectives on the default group.
        self._save_group = None
        if cfg.ckpt.async_ and self.format == "sharded" and dist.is_distributed():
            self._save_group = torch_dist.new_group(backend="gloo")
        if dist.is_main():
            os.makedirs(self.dir, exist_ok=True)
            self._remove_incomplete()
        dist.barrier()

    # -- saving ---------------------------------------------------------------------------------
    def save(self, state: Any) -> None:
        """Save at the current step. With ckpt.async the write continues in the background."""
        self.wait()
        monitor = self.cfg.ckpt.monitor
        # Only a checkpoint of the evaluated weights carries the metric (and competes for best).
        value = state.last_eval.get(monitor) if state.last_eval.get("step") == state.step else None
        name = checkpoint_name(state.step, state.epoch, monitor, value)
        tmp = os.path.join(self.dir, f".tmp-{name}")
        if dist.is_main():
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(tmp)
        dist.barrier()
        rngs = dist.gather_objects(rng_state(self.device))
        meta = {
            "format_version": 1,
            "format": self.format,
            "train_state": asdict(state),
            "extra": self.extra_state(),
            "world_size": dist.world_size(),
            "rng": rngs,
            "config": to_dict(self.cfg),
            "model_info": self.model_info,
            "metrics": dict(state.last_eval),
            "versions": {"dtrain": dtrain.__version__, "torch": str(torch.__version__)},
        }
        if self.format == "full":
            options = StateDictOptions(full_state_dict=True, cpu_offload=True)
            payload = {"model": get_model_state_dict(self.model, options=options),
                       "optimizer": get_optimizer_state_dict(self.model, self.optimizer, options=options)}
        else:
            payload = {"model": get_model_state_dict(self.model),
                       "optimizer": get_optimizer_state_dict(self.model, self.optimizer)}
            meta["model_keys"] = list(payload["model"].keys())
        self.last_saved_step = state.step
        if self.cfg.ckpt.async_:
            payload, meta = _clone(payload), _clone(meta)
            self._thread = threading.Thread(target=self._write_guarded, args=(name, tmp, payload, meta),
                                            name="dtrain-checkpoint", daemon=True)
            self._thread.start()
        else:
            self._write(name, tmp, payload, meta)

    def _write_guarded(self, name: str, tmp: str, payload: dict, meta: dict) -> None:
        try:
            self._write(name, tmp, payload, meta)
        except BaseException as e:  # noqa: BLE001 - reported by wait() on the main thread
            self._error = e

    def _write(self, name: str, tmp: str, payload: dict, meta: dict) -> None:
        try:
            if self.format == "sharded":
                writer = dcp.FileSystemWriter(os.path.join(tmp, DCP_DIR), sync_files=True)
                dcp.save(payload, storage_writer=writer, process_group=self._save_group)
            if dist.is_main():
                if self.format == "full":
                    _torch_save({**meta, **payload}, os.path.join(tmp, FULL_FILE))
                else:
                    _torch_save(meta, os.path.join(tmp, META_FILE))
                self._publish(name, tmp, meta)
        except (OSError, RuntimeError) as e:
            if dist.is_main():
                shutil.rmtree(tmp, ignore_errors=True)
            needed = _tensor_bytes(payload) + _tensor_bytes(meta)
            free = shutil.disk_usage(self.dir).free
            # torch.save reports a failed write as a RuntimeError, not as the OSError beneath it.
            out_of_space = (isinstance(e, OSError) and e.errno == errno.ENOSPC) or free < needed
            if out_of_space:
                raise CheckpointError(
                    f"checkpoint error: disk full while saving {name}: it needs about "
                    f"{needed / 2**20:.2f} MiB, {free / 2**20:.2f} MiB free in {self.dir}; "
                    f"the previous checkpoint is kept") from None
            if isinstance(e, OSError):
                raise CheckpointError(f"checkpoint error: cannot write {name} in {self.dir}: "
                                      f"{e}; the previous checkpoint is kept") from None
            raise

    def _publish(self, name: str, tmp: str, meta: dict) -> None:
        """Rank 0, after every shard is on disk: rename into place, marker, latest, rotation."""
        final = os.path.join(self.dir, name)
        if os.path.exists(final):  # a save of the same step by an attempt that died before its marker
            shutil.rmtree(final)
        _fsync_dir(tmp)
        os.replace(tmp, final)
        _fsync_dir(self.dir)
        marker = {"step": meta["train_state"]["step"], "epoch": meta["train_state"]["epoch"],
                  "format": self.format, "world_size": meta["world_size"],
                  "files": _file_sizes(final)}
        _write_atomic(os.path.join(final, MARKER), json.dumps(marker, indent=1).encode())
        _write_atomic(os.path.join(self.dir, "latest"), (name + "\n").encode())
        log.info(f"saved checkpoint {final}")
        self._rotate()

    def wait(self) -> None:
        """Block until a background save is finished; raise its error if it failed."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def _rotate(self) -> None:
        """Keep the last `keep_last` and the best `keep_best` complete checkpoints."""
        cfg = self.cfg.ckpt
        complete = self.complete_checkpoints()
        keep = set(complete[:cfg.keep_last])
        scored = [(parse_name(n)[3], n) for n in complete
                  if parse_name(n)[2] == cfg.monitor and parse_name(n)[3] is not None]
        scored.sort(key=lambda item: item[0], reverse=cfg.monitor_mode == "max")
        keep.update(n for _, n in scored[:cfg.keep_best])
        for name in complete:
            if name not in keep:
                shutil.rmtree(os.path.join(self.dir, name), ignore_errors=True)

    def _remove_incomplete(self) -> None:
        for name in os.listdir(self.dir):
            path = os.path.join(self.dir, name)
            if os.path.isdir(path) and (name.startswith(".tmp-") or read_marker(path) is None):
                log.warning(f"removing incomplete checkpoint {path}")
                shutil.rmtree(path, ignore_errors=True)

    def complete_checkpoints(self) -> list[str]:
        """Names of the checkpoints with a completion marker, newest first."""
        if not os.path.isdir(self.dir):
            return []
        names = [n for n in os.listdir(self.dir)
                 if parse_name(n) and read_marker(os.path.join(self.dir, n)) is not None]
        return sorted(names, key=lambda n: parse_name(n)[0], reverse=True)

    # -- resuming -------------------------------------------------------------------------------
    def resume(self) -> Optional[dict[str, Any]]:
        """Load what `ckpt.resume` names; returns the train state dict, or None for a fresh start."""
        choice = self.cfg.ckpt.resume
        if choice == "none":
            log.info("fresh start (ckpt.resume=none)")
            return None
        if choice != "auto":
            path = choice[:-len(FULL_FILE) - 1] if choice.endswith(FULL_FILE) else choice
            if not os.path.exists(path):
                raise UserError(f"checkpoint error: ckpt.resume: {choice} not found")
            problem = self._try_load(path)
            if problem:
                raise UserError(f"checkpoint error: ckpt.resume: {problem}")
            return self._resumed
        candidates = self.complete_checkpoints()
        failed: list[str] = []
        for name in candidates:
            problem = self._try_load(os.path.join(self.dir, name))
            if problem is None:
                if failed:
                    log.warning(f"newest checkpoint {failed[0]} is unusable; resumed from the "
                                f"previous good one, {name}")
                return self._resumed
            log.warning(f"checkpoint {name} is unusable ({problem}); trying an older one")
            failed.append(name)
        if failed:
            log.warning(f"no usable checkpoint in {self.dir} ({', '.join(failed)} unusable): fresh start")
        else:
            log.info(f"no checkpoint in {self.dir}: fresh start")
        return None

    def _try_load(self, path: str) -> Optional[str]:
        """Load the checkpoint at `path` on every rank; None on success, else the reason.
        Every rank reaches the same verdict (an all-reduce of the failure flag)."""
        problem = None
        try:
            self._load(path)
        except UserError as e:
            problem = str(e).removeprefix("checkpoint error: ")
        if dist.any_rank(problem is not None, self.device) and problem is None:
            problem = f"{path} failed to load on another rank"
        return problem

    def _load(self, path: str) -> None:
        folder, fmt = open_checkpoint(path)
        if fmt == "full":
            data = load_file(os.path.join(folder, FULL_FILE))
            meta = data
            options = StateDictOptions(full_state_dict=True)
            saved_keys = list(data["model"])  # before loading, which fills in missing entries
            self._apply(lambda: set_model_state_dict(self.model, data["model"], options=options),
                        folder, saved_keys)
            self._apply(lambda: set_optimizer_state_dict(self.model, self.optimizer, data["optimizer"],
                                                         options=options), folder, ())
        else:
            meta = load_file(os.path.join(folder, META_FILE))
            state = {"model": get_model_state_dict(self.model),
                     "optimizer": get_optimizer_state_dict(self.model, self.optimizer)}
            self._apply(lambda: dcp.load(state, checkpoint_id=os.path.join(folder, DCP_DIR)),
                        folder, meta.get("model_keys", ()))
            set_model_state_dict(self.model, state["model"])
            set_optimizer_state_dict(self.model, self.optimizer, state["optimizer"])
        self._restore_meta(meta, folder)

    def _apply(self, fn: Callable[[], Any], folder: str, saved_keys: Any) -> None:
        try:
            fn()
        except (RuntimeError, KeyError, ValueError, AssertionError) as e:
            ours = set(get_model_state_dict(self.model).keys())
            theirs = set(saved_keys)
            detail = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            if theirs and theirs != ours:
                missing, unexpected = sorted(ours - theirs), sorted(theirs - ours)
                detail = (f"checkpoint is from a different model: {len(missing)} key(s) missing "
                          f"(e.g. {missing[:3]}), {len(unexpected)} unexpected (e.g. {unexpected[:3]})")
            raise UserError(f"checkpoint error: {folder}: {detail}") from None

    def _restore_meta(self, meta: dict[str, Any], folder: str) -> None:
        saved_world = meta["world_size"]
        if saved_world == dist.world_size():
            set_rng_state(meta["rng"][dist.rank()], self.device)
        else:
            log.warning(f"world size changed from {saved_world} to {dist.world_size()}: resuming "
                        f"at the same sample of the epoch; random states are re-seeded")
            seed = self.cfg.run.seed + 7919 * (meta["train_state"]["step"] + 1) + dist.rank()
            random.seed(seed)
            numpy.random.seed(seed % 2**32)
            torch.manual_seed(seed)
        self.load_extra_state(meta["extra"])
        self._resumed = dict(meta["train_state"], world_size=saved_world, path=folder)
        self.last_saved_step = meta["train_state"]["step"]
        log.info(f"resumed from {folder} (step {meta['train_state']['step']}, "
                 f"epoch {meta['train_state']['epoch']})")
