"""Content digests while checkpoint files are written and read (see `dtrain.files.digests`).

Writing: `torch.save` and DCP write through `HashingFile`, which hashes the bytes on their way to
the file, so no file is read back. Reading: a file's digest is computed in a thread while torch
or DCP reads it (hashing and reading release the GIL), and compared before anything read is
applied. Files of a marker without digests (saved before this version) load unverified, with a
line saying so.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Generator, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any, TypeVar

from dtrain.core.logs import log
from dtrain.files.digests import (
    ALGORITHM,
    Damaged,
    HashingFile,
    digests_of,
    file_digest,
    mismatch,
    read_marker,
)
from dtrain.process import compat

T = TypeVar("T")
_warned: set[str] = set()

__all__ = [
    "ALGORITHM",
    "Damaged",
    "Background",
    "expected_digests",
    "hashing_writer",
    "checked",
    "own_files",
]


def expected_digests(folder: str, marker: dict[str, Any] | None = None) -> dict[str, str] | None:
    """The digests the marker of `folder` holds: None when it has no marker (not a dtrain
    checkpoint folder: nothing to check against) or no digests (logged: loaded unverified)."""
    marker = read_marker(folder) if marker is None else marker
    if marker is None:
        return None
    digests = digests_of(marker)
    if digests is None and os.path.realpath(folder) not in _warned:
        _warned.add(os.path.realpath(folder))  # one line per checkpoint, not one per file
        log.warning(
            f"{folder} was saved without content digests (before dtrain verified "
            f"checkpoints): loading it unverified"
        )
    return digests


class Background:
    """Digests of some files of `folder`, computed in a thread from construction on; `check()`
    waits for them and raises Damaged for the first file that differs from `expected`."""

    def __init__(self, folder: str, names: Iterable[str], expected: dict[str, str] | None) -> None:
        self.folder = folder
        self.expected = expected or {}
        self.names = [n for n in names if n in self.expected]
        self._pool: ThreadPoolExecutor | None = None
        self._futures: list[Future[str]] = []
        if self.names:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="dtrain-digest")
            self._futures = [
                self._pool.submit(file_digest, os.path.join(folder, n)) for n in self.names
            ]

    def check(self) -> None:
        if self._pool is None:
            return
        try:
            for name, future in zip(self.names, self._futures, strict=True):
                try:
                    found = future.result()
                except OSError as e:
                    raise Damaged(
                        f"checkpoint error: {self.folder}: {name} unreadable: {e}"
                    ) from None
                if found != self.expected[name]:
                    raise Damaged(mismatch(self.folder, name, self.expected[name], found))
        finally:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None


def checked(
    folder: str, names: Iterable[str], expected: dict[str, str] | None, read: Callable[[], T]
) -> T:
    """`read()` while the files `names` are hashed; a digest that differs wins over whatever
    error reading the damaged bytes raised."""
    background = Background(folder, names, expected)
    try:
        result = read()
    except BaseException:
        background.check()  # Damaged: the cause of the failure, said plainly
        raise
    background.check()
    return result


# ---------------------------------------------------------------------------------------------
# DCP


def hashing_writer(path: str, streams: Any = None) -> Any:
    """DCP's file-system writer of `path`, recording the digest of each file it writes (its
    `fs.digests`: names relative to `path`). `streams(name)`: an upload of the file `name`
    (relative to `path`) as it is written, or None; a `.tmp` file (DCP's `.metadata`, renamed
    once written) is never streamed."""
    from torch.distributed.checkpoint.filesystem import FileSystem

    class HashingFileSystem(FileSystem):
        def __init__(self) -> None:
            super().__init__()
            self.digests: dict[str, str] = {}
            self._lock = threading.Lock()  # DCP may write several files in threads

        @contextmanager
        def create_stream(self, path: Any, mode: str) -> Generator[Any, None, None]:
            with super().create_stream(path, mode) as stream:
                if "w" not in mode:
                    yield stream
                    return
                name = _relative(path)
                upload = streams(name) if streams and not name.endswith(".tmp") else None
                hashing = HashingFile(stream, upload)
                try:
                    yield hashing
                    if upload is not None:  # every byte went through `hashing` (DCP closed it)
                        upload.finish()
                except BaseException:
                    if upload is not None:
                        upload.abort()
                    raise
            with self._lock:
                self.digests[name] = hashing.hexdigest()

        def rename(self, path: Any, new_path: Any) -> None:
            super().rename(path, new_path)  # DCP writes `.metadata` as `.metadata.tmp` first
            with self._lock:
                if _relative(path) in self.digests:
                    self.digests[_relative(new_path)] = self.digests.pop(_relative(path))

    def _relative(file: Any) -> str:
        return os.path.relpath(os.fspath(file), path)

    return compat.dcp_writer(path, HashingFileSystem())


def verifying_read(
    folder: str, prefix: str, expected: dict[str, str] | None
) -> compat.ReadThrough | None:
    """How DCP's reader of the checkpoint `folder` reads (`compat.dcp_reader`'s `read_through`):
    hashing the files (below `prefix`) each rank's read plan opens while DCP reads them. A
    mismatch is raised inside DCP's read step, so that DCP reports it to every rank and none
    applies anything. None: nothing to check."""
    if not expected:
        return None
    return lambda names, read: checked(folder, [f"{prefix}/{n}" for n in names], expected, read)


def checked_bytes(folder: str, name: str, data: bytes, expected: dict[str, str] | None) -> bytes:
    """`data`, read from `name` of `folder`, after checking its digest (small files: read whole)."""
    if expected and name in expected:
        from dtrain.files.digests import new_hash

        found = new_hash()
        found.update(data)
        if found.hexdigest() != expected[name]:
            raise Damaged(mismatch(folder, name, expected[name], found.hexdigest()))
    return data


def own_files(folder: str, rank: int, writer: Any) -> tuple[dict[str, int], dict[str, str]]:
    """The DCP files this rank wrote into `folder` (DCP names them __<rank>_<n>.distcp; rank 0
    also writes `.metadata`), with their sizes, and the digests of all it wrote. A file the
    writer has no digest of (none is expected) is hashed from disk, so every file has one."""
    prefix = f"__{rank}_"
    dcp = os.path.basename(folder)
    written: dict[str, str] = dict(getattr(getattr(writer, "fs", None), "digests", {}))
    names = [n for n in os.listdir(folder) if n.startswith(prefix)]
    names += [n for n in written if n not in names]
    sizes = {f"{dcp}/{n}": os.path.getsize(os.path.join(folder, n)) for n in names}
    digests = {f"{dcp}/{n}": written.get(n) or file_digest(os.path.join(folder, n)) for n in names}
    return sizes, digests
