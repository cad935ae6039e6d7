"""The checkpoint `dtrain eval` evaluates: which one (latest, best or a PATH, as rank 0 finds
it), its local copy when it lies in an object store, and its model weights, loaded the way a
resume loads them.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from dataclasses import dataclass
from typing import Any

from torch import nn

from dtrain.checkpoint.load import (
    apply_full,
    apply_sharded,
    local_folder,
    open_checkpoint,
    trained_shapes,
)
from dtrain.checkpoint.state import (
    FULL_FILE,
    META_FILE,
    dcp_model_shapes,
    load_checked,
    shape_mismatch,
)
from dtrain.config import Config
from dtrain.core.errors import UserError
from dtrain.core.urls import is_url
from dtrain.files import remote_copies
from dtrain.files.store import MARKER, Store, read_marker
from dtrain.files.store_protocol import CheckpointStore
from dtrain.models.spec import spec_of
from dtrain.parallel import unwrap
from dtrain.process import dist
from dtrain.run.weights import prepare_base


@dataclass(frozen=True)
class Chosen:
    """The checkpoint to evaluate, as rank 0 found it."""

    folder: str
    fmt: str  # "full" | "sharded"
    file: str | None  # the full checkpoint's file
    step: int | None
    saved_world_size: int | None
    url: str | None = None  # in an object store: where it is (`folder` is then a local copy)

    @property
    def name(self) -> str:
        return os.path.basename(os.path.normpath(self.folder))

    @property
    def shown(self) -> str:
        return self.url or self.folder

    def file_shown(self, name: str) -> str | None:
        """How messages name the checkpoint's file `name`: by its URL for a store's (a local
        copy's path is gone when the message is read); None: by its path."""
        return f"{self.url}/{name}" if self.url else None


def choose(run_dir: str, which: str, cfg: Config, listing_dir: str = "") -> Chosen:
    """`latest` (the last complete checkpoint saved, as resuming counts it), `best` (by
    ckpt.monitor, as rotation keeps it) or a PATH: its folder or checkpoint.pt. Its save must
    have completed and every file it lists must have its size. A run or a checkpoint in an
    object store is only named here (`fetched` makes the local copy)."""
    options = dict(cfg.run.storage_options)
    store: CheckpointStore
    if is_url(run_dir):  # listing only: Store.prepare would move folders
        store = remote_copies.listing(run_dir, options, listing_dir)
        remote_copies.checkpoints(store, "eval", run_dir)
    else:
        store = Store(run_dir)
    if which == "latest":
        saved = store.complete()
        if not saved:
            raise UserError(
                f"eval error: --checkpoint latest: no complete checkpoint in {store.location}; "
                f"name one with --checkpoint PATH"
            )
        path = saved[0].path
    elif which == "best":
        monitor, mode = cfg.ckpt.monitor, cfg.ckpt.monitor_mode
        best = store.best(monitor, mode)
        if best is None:
            raise UserError(
                f"eval error: --checkpoint best: no checkpoint in {store.location} records a value "
                f"of ckpt.monitor {monitor}; use --checkpoint latest or a PATH"
            )
        path = best.path
    else:
        path = which
    if is_url(path):
        marker = remote_copies.marker_of(path, options, "eval")
        url = remote_copies.checkpoint_folder(path)
        return Chosen(
            url,
            str(marker.get("format", "full")),
            None,
            marker.get("step"),
            marker.get("world_size"),
            url,
        )
    if which not in ("latest", "best"):
        if not os.path.exists(path):
            raise UserError(
                f"eval error: --checkpoint {path} not found; name a checkpoint folder (or its "
                f"{FULL_FILE}), latest or best"
            )
        folder_like = os.path.isdir(path) and any(
            os.path.exists(os.path.join(path, f)) for f in (MARKER, FULL_FILE, META_FILE)
        )
        if not folder_like and os.path.basename(path) != FULL_FILE:
            raise UserError(
                f"eval error: --checkpoint {path} is not a checkpoint (no {MARKER} marker); "
                f"name a folder of {os.path.join(run_dir, 'checkpoints')}, latest or best"
            )
    folder, fmt = open_checkpoint(path)
    marker = read_marker(folder) or {}
    if fmt == "full":
        file = os.path.join(folder, FULL_FILE) if marker or os.path.isdir(path) else path
    else:
        file = None
    return Chosen(folder, fmt, file, marker.get("step"), marker.get("world_size"))


def fetched(chosen: Chosen, into: str, options: dict[str, Any]) -> Chosen:
    """A checkpoint in an object store as this process's local copy below `into` (of a full
    one, rank 0 fetches the files; every rank fetches its marker), each file checked by its
    digest as it is read; any other checkpoint as it is."""
    if chosen.url is None:
        return chosen
    local = local_folder(chosen.url, into, options)
    file = os.path.join(local, FULL_FILE) if chosen.fmt == "full" else None
    return dataclasses.replace(chosen, folder=local, file=file)


def load_weights(model: nn.Module, chosen: Chosen, cfg: Config) -> None:
    """The checkpoint's model weights into `model` (wrapped for this launch), by the functions a
    resume loads them with (`checkpoint.load`): a full checkpoint is read by rank 0
    (memory-mapped) and sent to the ranks, each its part; a sharded one is read by every rank,
    its own part, through DCP. A checkpoint of another model is refused with resuming's line
    before anything is loaded; a LoRA checkpoint's adapters go onto their base, checked by its
    digest, as resuming does."""
    spec = spec_of(cfg.model)
    ours = trained_shapes(unwrap(model), spec)

    def refuse_other_model(theirs: dict[str, tuple[int, ...]]) -> None:
        problem = shape_mismatch(ours, theirs)
        if problem:
            raise UserError(f"checkpoint error: {chosen.shown}: {problem}")

    if chosen.fmt == "full":
        held: dict[str, Any] = {}  # rank 0's memory-mapped weights; never broadcast whole

        def read() -> dict[str, Any]:
            assert chosen.file is not None
            saved = load_checked(chosen.file, mmap=True, shown=chosen.file_shown(FULL_FILE))
            weights = saved.get("model")
            if not isinstance(weights, dict):
                raise UserError(
                    f"eval error: {chosen.file_shown(FULL_FILE) or chosen.file} holds no model "
                    f"weights (not a dtrain checkpoint)"
                )
            refuse_other_model({k: tuple(v.shape) for k, v in weights.items()})
            held["model"] = weights
            return dict(saved.get("model_info") or {})

        prepare_base(model, cfg, dist.on_main(read), chosen.shown)
        apply_full(model, None, held or None, chosen.folder, spec)
        return

    def read_sharded() -> dict[str, Any]:
        refuse_other_model(dcp_model_shapes(chosen.folder))
        meta = load_checked(
            os.path.join(chosen.folder, META_FILE), shown=chosen.file_shown(META_FILE)
        )
        return dict(meta.get("model_info") or {})

    prepare_base(model, cfg, dist.on_main(read_sharded), chosen.shown)
    try:
        with warnings.catch_warnings():
            # DCP's note that one process reads alone: what evaluating in one process means.
            warnings.filterwarnings(
                "ignore", message=".*assuming the intent is to load in a single"
            )
            apply_sharded(model, None, chosen.folder, spec)
    except UserError:
        if not os.path.isdir(chosen.folder):
            raise UserError(
                f"eval error: {chosen.shown} was removed while it was read (the training "
                f"that is running rotated it out, ckpt.keep_last); run dtrain eval again"
            ) from None
        raise


def check_ema(chosen: Chosen) -> None:
    """`--weights ema` of a checkpoint without them: refused before anything is built."""
    from dtrain.loop import ema  # only `--weights ema` needs it

    if not ema.has_ema(chosen.folder):
        raise UserError(
            f"eval error: {chosen.shown} was saved without EMA weights (train.ema.decay "
            f"unset); use --weights model"
        )
