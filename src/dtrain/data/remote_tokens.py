"""Token files in an object store (`data.root: s3://bucket/tokens`): each shard read by ranged
requests, or, when the folder fits `data.tokens.cache_gib`, from a node-local copy made once per
node (the first process to need a shard fetches it under a lock, the others wait and map it).
A cached copy is used only while its size is the store's; memory per rank stays flat either way
(a ranged read holds one window, a copy is memory-mapped)."""

from __future__ import annotations

import fcntl
import hashlib
import os
import tempfile
from typing import Any

import numpy as np

from dtrain.core.errors import UserError
from dtrain.files.objstore import ObjectStore


class RemoteShard:
    """One token file in the store: its URL and size; `open` gives an array-like of its
    tokens (a memory map of the node's copy, or ranged reads). Pickled into loader workers as
    its URL: each process opens the store itself."""

    def __init__(self, folder: str, name: str, nbytes: int, cache: str | None) -> None:
        self.folder, self.name, self.nbytes, self.cache = folder, name, nbytes, cache

    @property
    def url(self) -> str:
        return f"{self.folder.rstrip('/')}/{self.name}"

    def open(self, dtype: np.dtype) -> Any:
        objects = ObjectStore(self.folder)
        if self.cache is None:
            return _Ranged(objects, self.name, dtype, self.nbytes // dtype.itemsize)
        local = os.path.join(self.cache, self.name)
        if not _fetched(local, self.nbytes):
            os.makedirs(self.cache, exist_ok=True)
            with open(local + ".lock", "w") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)  # one fetch per node; the others wait for it
                if not _fetched(local, self.nbytes):
                    _fetch(objects, self.name, local, self.nbytes)
        return np.memmap(local, dtype=dtype, mode="r")


class _Ranged:
    """A shard's tokens as an array one reads slices of: each slice one ranged GET."""

    def __init__(self, objects: ObjectStore, name: str, dtype: np.dtype, size: int) -> None:
        self.objects, self.name, self.dtype, self.size = objects, name, dtype, size
        self.pid = os.getpid()

    def __getitem__(self, index: slice) -> np.ndarray:
        if os.getpid() != self.pid:  # a forked loader worker: s3fs's event loop is the parent's
            self.objects, self.pid = ObjectStore(self.objects.url), os.getpid()
        start, stop, _ = index.indices(self.size)
        if stop <= start:
            return np.zeros(0, dtype=self.dtype)
        item = self.dtype.itemsize
        data = self.objects.fs.cat_file(
            self.objects.path(self.name), start=start * item, end=stop * item
        )
        return np.frombuffer(data, dtype=self.dtype)


def _fetched(local: str, nbytes: int) -> bool:
    try:
        return os.path.getsize(local) == nbytes
    except OSError:
        return False


def _fetch(objects: ObjectStore, name: str, local: str, nbytes: int) -> None:
    tmp = f"{local}.tmp.{os.getpid()}"
    try:
        objects.get(name, tmp)
        if os.path.getsize(tmp) != nbytes:
            raise UserError(
                f"data error: {objects.url_of(name)} changed while it was fetched "
                f"({os.path.getsize(tmp)} bytes, the store listed {nbytes})"
            )
        os.replace(tmp, local)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def listing(root: str) -> tuple[dict[str, int], bytes | None]:
    """The token folder in the store: its files' sizes by name, and meta.json's bytes (None
    when there is none). One line when the store cannot be read."""
    objects = ObjectStore(root)
    try:
        objects.check()
        files = {n: s for n, s in objects.files().items() if "/" not in n}
        meta = objects.cat("meta.json") if "meta.json" in files else None
    except UserError:
        raise
    except Exception as e:  # noqa: BLE001 - the store's failure as one line
        raise objects.error(e, "read") from None
    if not files:
        raise UserError(
            f"data error: token folder not found at '{root}': no objects there; set data.root "
            f"to a folder of train.bin and val.bin (e.g. made by dtrain tokenize, then uploaded)"
        )
    return files, meta


def cache_folder(root: str, files: dict[str, int], cache_gib: float) -> str | None:
    """The node-local folder for copies of the folder at `root`, or None (ranged reads) when
    the cache is off (0) or the folder is larger than it."""
    if cache_gib <= 0 or sum(files.values()) > cache_gib * 2**30:
        return None
    digest = hashlib.sha256(root.rstrip("/").encode()).hexdigest()[:16]
    return os.path.join(tempfile.gettempdir(), f"dtrain-data-{os.getuid()}", digest)
