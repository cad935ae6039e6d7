"""What a checkpoint holds, in which files, and how it is read back safely.

Format "full": one `checkpoint.pt` written by rank 0 (the metadata and the consolidated model and
optimizer). Format "sharded": `dcp/` written by every rank through torch.distributed.checkpoint,
plus `meta.pt` with the rest. Everything is tensors, numbers and strings: `torch.load` runs with
`weights_only=True`, and DCP's own pickled parts (`.metadata`, small values stored as bytes) are
read through an allow-list, so a file crafted to run code when unpickled is refused.
"""

from __future__ import annotations

import io
import os
import pickle
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from dtrain.checkpoint import digest
from dtrain.core.errors import OutsideName, UserError, first_line
from dtrain.files.digests import HashingFile, check_file
from dtrain.files.keys import local_path
from dtrain.process import compat, dist

FULL_FILE = "checkpoint.pt"
META_FILE = "meta.pt"
DCP_DIR = "dcp"
FORMAT_VERSION = 2
# The metadata's key of the part that says where the run is (its state has "step" and "epoch").
POSITION = "train_state"
# What a checkpoint's metadata holds (meta.pt, and checkpoint.pt beside the weights).
META_KEYS: tuple[str, ...] = ("format_version", "format", POSITION, "extra", "world_size")
META_KEYS += ("rng", "config", "model_info", "metrics", "versions")


def shape_mismatch(
    ours: dict[str, tuple], theirs: dict[str, tuple], strict: bool = True
) -> str | None:
    """What keeps weights named and shaped as `theirs` from loading into a model with `ours`
    (None when they fit): keys missing or unexpected (only when `strict`), or a different shape."""
    missing, unexpected = sorted(ours.keys() - theirs.keys()), sorted(theirs.keys() - ours.keys())
    if strict and (missing or unexpected):
        return (
            f"checkpoint is from a different model: {len(missing)} key(s) missing (e.g. "
            f"{missing[:3]}), {len(unexpected)} unexpected (e.g. {unexpected[:3]})"
        )
    wrong = [k for k in sorted(ours.keys() & theirs.keys()) if tuple(ours[k]) != tuple(theirs[k])]
    if wrong:
        return (
            f"checkpoint is from a different model: {wrong[0]} has shape "
            f"{list(theirs[wrong[0]])} there, {list(ours[wrong[0]])} here "
            f"({len(wrong)} such key(s))"
        )
    return None


# ---------------------------------------------------------------------------------------------
# Reading files


# What torch's weights-only unpickler names when it refuses a file: the global it would import.
_REFUSED_GLOBAL = re.compile(r"GLOBAL ([\w.]+)")


def load_file(path: str, mmap: bool = False, shown: str | None = None) -> dict[str, Any]:
    """torch.load with weights_only=True and errors a user can act on, naming the file as
    `shown` (a store's URL, for a local copy of its file) or else `path`. With `mmap`, tensors
    are read from the file as they are used instead of all at once."""
    shown = shown or path
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except FileNotFoundError:
        raise UserError(f"checkpoint error: {shown} not found") from None
    except Exception as e:  # noqa: BLE001 - any failure here means "not a usable checkpoint"
        if "weights_only" in str(e) or "Unsupported global" in str(e):
            # torch's own text goes on to suggest weights_only=False: only its reason is kept.
            named = _REFUSED_GLOBAL.search(str(e))
            reason = f"it names {named.group(1)}" if named else "not plain tensors and data"
            raise UserError(
                f"checkpoint error: {shown} holds objects that only arbitrary unpickling can "
                f"load ({reason}); refused: dtrain loads weights only, never code"
            ) from None
        raise UserError(
            f"checkpoint error: {shown} is corrupt or not a checkpoint: {first_line(e)}"
        ) from None


def _allowed_global(module: str, name: str) -> bool:
    """The globals DCP's `.metadata` pickle may name: its own metadata classes, torch.Size,
    dtypes and layouts, paths and plain containers. Nothing that runs code."""
    if module == "torch.distributed.checkpoint.metadata":
        return True
    if (module, name) in {
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),
        ("pathlib", "PosixPath"),
        ("pathlib", "PurePosixPath"),
        ("collections", "OrderedDict"),
        ("builtins", "set"),
        ("builtins", "frozenset"),
        ("builtins", "slice"),
    }:
        return True
    return module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if not _allowed_global(module, name):
            raise pickle.UnpicklingError(f"{module}.{name} is not allowed in checkpoint metadata")
        return super().find_class(module, name)


def safe_reader(folder: str, expected: dict[str, str] | None = None) -> Any:
    """DCP's file-system reader of the checkpoint `folder`, reading `.metadata` through the
    allow-list; with `expected` digests, every file it reads is checked against them."""
    shards = os.path.join(folder, DCP_DIR)

    def read_metadata(f: Any) -> Any:
        data = digest.checked_bytes(folder, f"{DCP_DIR}/.metadata", f.read(), expected)
        metadata = _MetadataUnpickler(io.BytesIO(data)).load()
        # The files DCP opens, by the names the metadata gives: each must be in the folder.
        for stored in (getattr(metadata, "storage_data", None) or {}).values():
            local_path(shards, str(stored.relative_path), os.path.join(shards, ".metadata"))
        return metadata

    return compat.dcp_reader(
        shards, read_metadata, digest.verifying_read(folder, DCP_DIR, expected)
    )


def safe_planner() -> Any:
    """DCP's load planner, reading values stored as bytes with weights_only=True."""
    return compat.dcp_planner(lambda value: torch.load(value, weights_only=True))


def read_sharded(folder: str, state: dict[str, Any], process_group: Any = None) -> None:
    """Fill `state` (tensors of the right shapes and shardings) from the DCP folder, checking
    the digest of every file read. Any failure, including DCP's CheckpointException (a
    BaseException), becomes a UserError: a damaged file's own line when one is damaged."""
    _load(folder, state, digest.expected_digests(folder), process_group)


def read_sharded_in_parts(folder: str, parts: Iterable[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """Fill each state of `parts` in turn from the DCP folder, in this process alone, and yield
    it: the tensors of one part are all that is read at a time. Every file's digest is checked
    once, before the first part (not again for each part that reads from it)."""
    expected = digest.expected_digests(folder) or {}
    for name in sorted(expected):
        if name.startswith(f"{DCP_DIR}/"):
            check_file(folder, name, expected[name])
    for state in parts:
        _load(folder, state, None, None)
        yield state


def _load(folder: str, state: dict[str, Any], expected: Any, process_group: Any) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    path = os.path.join(folder, DCP_DIR)
    try:
        dcp.load(
            state,
            storage_reader=safe_reader(folder, expected),
            planner=safe_planner(),
            process_group=process_group,
            no_dist=not dist.is_distributed(),
        )
    except (CheckpointException, Exception) as e:  # noqa: BLE001 - any failure: unusable
        damaged = _damaged_in(e)
        if damaged is not None:
            raise damaged from None
        raise UserError(f"checkpoint error: {path} is unreadable: {_dcp_reason(e)}") from None


def _failures(error: BaseException) -> list[BaseException]:
    """The failures inside a CheckpointException (every rank's), or the error itself."""
    failures = getattr(error, "failures", None)
    if not failures:
        return [error]
    return [f[0] if isinstance(f, tuple) else f for f in failures.values()]


def _damaged_in(error: BaseException) -> UserError | None:
    """The damaged file, or the file outside the folder, that DCP's failure on some rank reports
    (the same on every rank)."""
    return next((f for f in _failures(error) if isinstance(f, digest.Damaged | OutsideName)), None)


def _dcp_reason(error: BaseException) -> str:
    """The first failure inside a CheckpointException (which lists every rank's traceback)."""
    inner = _failures(error)[0]
    if inner is error:
        return first_line(error)
    return f"{type(inner).__name__}: {first_line(inner)}"


def dcp_model_shapes(folder: str, prefix: str = "model.") -> dict[str, tuple[int, ...]]:
    """The model's keys and shapes as DCP's metadata lists them (read through the allow-list);
    another `prefix` gives another part's tensors (`ema.`: the averaged weights)."""
    try:
        metadata = safe_reader(folder, digest.expected_digests(folder)).read_metadata()
    except (digest.Damaged, OutsideName):
        raise
    except Exception as e:  # noqa: BLE001 - unreadable metadata: an unusable checkpoint
        raise UserError(
            f"checkpoint error: {folder}: its DCP metadata is unreadable: {first_line(e)}"
        ) from None
    shapes = {}
    for key, item in metadata.state_dict_metadata.items():
        if key.startswith(prefix) and hasattr(item, "size"):
            shapes[key[len(prefix) :]] = tuple(item.size)
    return shapes


def write_sharded(
    folder: str, state: dict[str, Any], process_group: Any = None, streams: Any = None
) -> Any:
    """DCP's save into `folder`/dcp; returns the writer, whose `fs.digests` has the digest of
    every file this rank wrote. `streams`: digest.hashing_writer's."""
    import torch.distributed.checkpoint as dcp

    writer = digest.hashing_writer(os.path.join(folder, DCP_DIR), streams)
    dcp.save(
        state, storage_writer=writer, process_group=process_group, no_dist=not dist.is_distributed()
    )
    return writer


def torch_save(obj: Any, path: str, upload: Any = None) -> str:
    """torch.save, fsynced; returns the file's digest, computed as the bytes are written. With
    `upload` (an object store's StreamingUpload), the bytes also go up as they are written: the
    object exists when this returns, or, on any failure, not at all."""
    try:
        with open(path, "wb") as f:
            hashing = HashingFile(f, upload)
            torch.save(obj, hashing)  # type: ignore[arg-type]  # a file-like object with write()
            f.flush()
            os.fsync(f.fileno())
        if upload is not None:
            upload.finish()
    except BaseException:
        if upload is not None:
            upload.abort()
        raise
    return hashing.hexdigest()


def load_checked(path: str, mmap: bool = False, shown: str | None = None) -> dict[str, Any]:
    """`load_file`, with the file's digest checked against its folder's marker (computed while
    torch reads it) when the folder is a checkpoint that has digests."""
    folder, name = os.path.split(path)
    expected = digest.expected_digests(folder or ".")
    return digest.checked(
        folder or ".", [name], expected, lambda: load_file(path, mmap=mmap, shown=shown)
    )


def tensor_bytes(obj: Any) -> int:
    """The bytes of the tensors in `obj` that this rank holds (a DTensor's local shard)."""
    local = [compat.local_part(t) for t in compat.tensor_leaves(obj)]
    return sum(t.numel() * t.element_size() for t in local)


def cpu_copy(obj: Any) -> Any:
    """A copy of every tensor in CPU memory (one copy, straight from the device), so that a
    background write is not changed by training."""
    return compat.tree_map_tensors(
        lambda t: t.detach().clone() if t.device.type == "cpu" else t.detach().to("cpu", copy=True),
        obj,
    )


@dataclass(frozen=True)
class Resumed:
    """The checkpoint a run resumed from."""

    path: str
    step: int
    world_size: int
