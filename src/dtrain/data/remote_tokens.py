"""Token files in an object store (`data.root: s3://bucket/tokens`): each shard read by ranged
requests, or, when the folder fits `data.tokens.cache_gib`, from a node-local copy made once per
node (`node_copy`: the first process to need a shard fetches it under a lock, the others wait and
map it), used only while it is the version the store lists (size and ETag). Memory per rank stays
flat either way (a ranged read holds one window, a copy is memory-mapped)."""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from dtrain.core.errors import UserError
from dtrain.data import node_copy
from dtrain.files.objstore import ObjectStore


class RemoteShard:
    """One token file in the store: its URL and size; `open` gives an array-like of its
    tokens (a memory map of the node's copy, or ranged reads). Pickled into loader workers as
    its URL: each process opens the store itself."""

    def __init__(
        self,
        folder: str,
        name: str,
        nbytes: int,
        cache: str | None,
        version: str = "",
        digest: str = "",
    ) -> None:
        self.folder, self.name, self.nbytes, self.cache = folder, name, nbytes, cache
        self.version = version  # the ETag the store listed: a copy of another is fetched again
        self.digest = digest  # meta.json's for the file (dtrain tokenize's), checked on a fetch

    @property
    def url(self) -> str:
        return f"{self.folder.rstrip('/')}/{self.name}"

    def open(self, dtype: np.dtype) -> Any:
        objects = ObjectStore(self.folder)
        if self.cache is None:
            return _Ranged(objects, self.name, dtype, self.nbytes // dtype.itemsize)
        local = node_copy.ensure(
            objects, self.name, self.nbytes, self.version, self.cache, self.digest
        )
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
        data = self.objects.request(
            f"a read of {self.objects.url_of(self.name)}",
            self.objects.fs._cat_file(
                self.objects.path(self.name), start=start * item, end=stop * item
            ),
            moved=(stop - start) * item,
        )
        return np.frombuffer(data, dtype=self.dtype)


def listing(root: str) -> tuple[dict[str, int], bytes | None, dict[str, str]]:
    """The token folder in the store: its files' sizes by name, meta.json's bytes (None when
    there is none), and the files' versions (ETags). One line when the store cannot be read."""
    objects = ObjectStore(root)
    with objects.failing_as("read"):
        objects.check()
        found = {n: v for n, v in objects.versions().items() if "/" not in n}
        files = {n: size for n, (size, _) in found.items()}
        versions = {n: version for n, (_, version) in found.items()}
        meta = objects.cat("meta.json") if "meta.json" in files else None
    if not files:
        raise UserError(
            f"data error: token folder not found at '{root}': no objects there; set data.root "
            f"to a folder of train.bin and val.bin (e.g. made by dtrain tokenize, then uploaded)"
        )
    return files, meta, versions


def cache_folder(root: str, files: dict[str, int], cache_gib: float) -> str | None:
    """The node-local folder for copies of the folder at `root`, or None (ranged reads) when
    the cache is off (0) or the folder is larger than it."""
    if cache_gib <= 0 or sum(files.values()) > cache_gib * 2**30:
        return None
    return node_copy.folder_for(root)
