"""`dtrain verify PATH`: every checkpoint that PATH names, checked against the digests its
marker holds, one line each and a summary. No torch: checking a run's checkpoints costs their
reading only."""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from dtrain.core.errors import OutsideName, UserError
from dtrain.files.digests import (
    ALGORITHM,
    CHECKPOINTS,
    FULL_FILE,
    MARKER,
    digests_of,
    file_digest,
    listed_path,
    marker_damaged,
    parse_marker,
    read_marker,
    verify_files,
)
from dtrain.files.objstore import ObjectStore, StoreUnanswered, is_url
from dtrain.files.remote_store import fetch_checkpoint


def _check(folder: str, marker: dict[str, Any], threads: int) -> tuple[str, str]:
    """(verdict, details) of one checkpoint: intact, damaged or unverified."""
    files: dict[str, int] = marker.get("files", {})
    wrong = verify_files(folder, marker)
    if wrong:
        return "damaged", f"{wrong} (truncated or damaged)"
    digests = digests_of(marker)
    total = sum(files.values())
    if digests is None:
        return "unverified", (
            f"saved without content digests (before dtrain verified checkpoints); "
            f"{_files(len(files))}, sizes match"
        )
    unlisted = sorted(set(files) - set(digests))
    if unlisted:
        return "damaged", f"the marker has no digest of {unlisted[0]}"
    names = sorted(files)
    with ThreadPoolExecutor(max(1, min(threads, len(names)))) as pool:
        found = list(pool.map(lambda n: file_digest(listed_path(folder, n)), names))
    bad = [(n, digests[n], f) for n, f in zip(names, found, strict=True) if f != digests[n]]
    if bad:
        name, expected, actual = bad[0]
        more = f" (and {len(bad) - 1} more damaged files)" if len(bad) > 1 else ""
        return "damaged", f"{name}: digest {actual}, expected {expected}{more}"
    return "intact", f"{_files(len(files))}, {total / 2**20:.1f} MiB, {ALGORITHM}"


def _files(n: int) -> str:
    return f"{n} file" if n == 1 else f"{n} files"


class _Folder:
    """A folder on this disk, as `_walk` reads it: names relative to it ('/'-separated)."""

    def __init__(self, path: str) -> None:
        if not os.path.exists(path):
            raise UserError(f"verify error: {path} not found")
        self.name = path

    def where(self, rel: str) -> str:
        return os.path.join(self.name, *rel.split("/")) if rel else self.name

    def is_checkpoint(self, rel: str) -> bool:
        return os.path.exists(os.path.join(self.where(rel), MARKER))

    def folders(self, rel: str) -> list[str]:
        """Sub-folders by name, without hidden ones (`.tmp-` folders of saves in progress)."""
        path = self.where(rel)
        return sorted(
            n
            for n in os.listdir(path)
            if not n.startswith(".") and os.path.isdir(os.path.join(path, n))
        )


class _Prefix:
    """A prefix of an object store, as `_walk` reads it (its listing, the marker objects)."""

    def __init__(self, url: str) -> None:
        self.objects = ObjectStore(url)
        self.name = self.objects.url
        with self.objects.failing_as("read"):
            if not self.objects.exists():
                raise UserError(f"verify error: {url} not found")

    def where(self, rel: str) -> str:
        return self.objects.url_of(rel)

    def is_checkpoint(self, rel: str) -> bool:
        with self.objects.failing_as("read"):
            return self.objects.cat(f"{rel}/{MARKER}" if rel else MARKER) is not None

    def folders(self, rel: str) -> list[str]:
        with self.objects.failing_as("read"):
            return [n for n in self.objects.folders(rel) if not n.startswith(".")]


def checkpoints_of(path: str) -> tuple[list[str], bool]:
    """The checkpoint folders that `path` names (a run directory, its `checkpoints/` folder, a
    folder of runs such as a sweep or a run.out_dir, a checkpoint folder or its checkpoint.pt),
    on this disk or in an object store, and whether it named one checkpoint."""
    if is_url(path):
        if path.rstrip("/").endswith(f"/{FULL_FILE}"):
            return [path.rstrip("/").rsplit("/", 1)[0]], True
        return _walk(_Prefix(path))
    if os.path.isfile(path):
        if os.path.basename(path) == FULL_FILE:
            return [os.path.dirname(path) or "."], True
        raise UserError(
            f"verify error: {path} is a file; name a checkpoint folder or a run directory"
        )
    return _walk(_Folder(path))


def _walk(folder: _Folder | _Prefix) -> tuple[list[str], bool]:
    """The one reading of what a path names, the same on a disk and in a store: a checkpoint
    (its marker), a run directory or its checkpoints/ folder, or a folder of runs."""
    if folder.is_checkpoint(""):
        return [folder.where("")], True
    if os.path.basename(os.path.normpath(folder.name)) == CHECKPOINTS:
        below = [""]
    elif CHECKPOINTS in folder.folders(""):
        below = [CHECKPOINTS]
    else:
        runs = [run for run in folder.folders("") if CHECKPOINTS in folder.folders(run)]
        below = [f"{run}/{CHECKPOINTS}" for run in runs]
        if not below:
            raise UserError(
                f"verify error: {folder.name} is neither a checkpoint (no {MARKER} marker), a "
                f"run directory (no {CHECKPOINTS}/ folder) nor a folder of runs"
            )
    found = [f"{b}/{n}" if b else n for b in below for n in folder.folders(b)]
    return [folder.where(rel) for rel in found], False


def _remote_verdict(url: str, into: str, threads: int) -> tuple[str, str]:
    objects = ObjectStore(url)
    data = objects.cat(MARKER)
    if data is None and not objects.files():  # rotated away by a running job meanwhile
        return "gone", ""
    if data is None:
        return "incomplete", f"no {MARKER} marker: an interrupted save, never loaded"
    marker = parse_marker(data)
    if marker is None:
        return "damaged", f"its {MARKER} marker is not what the save wrote: changed since"
    try:
        local = fetch_checkpoint(url, into, {})
    except (OutsideName, StoreUnanswered):  # a store to refuse, or one that told nothing
        raise
    except UserError as e:
        return "damaged", str(e).removeprefix("checkpoint error: ")
    try:
        return _check(local, marker, threads)
    finally:
        shutil.rmtree(local, ignore_errors=True)


def run(path: str, threads: int = 4) -> int:
    """Check every checkpoint `path` names; print one line each and a summary. Exit status: 0
    when none is damaged (unverified ones, saved before digests, are not), 1 otherwise, 2 when
    there was nothing to check: a verification that checked nothing is no success. In an
    object store, each is fetched (to a temporary folder) and checked as on a disk."""
    remote = is_url(path)
    folders, single = checkpoints_of(path)
    if not folders:
        raise UserError(f"verify error: no checkpoints in {path}: nothing to verify")
    counts = {"intact": 0, "damaged": 0, "unverified": 0, "incomplete": 0}
    with tempfile.TemporaryDirectory(prefix="dtrain-verify-") as into:
        for folder in folders:
            verdict, details = (
                _remote_verdict(folder, into, threads) if remote else _verdict(folder, threads)
            )
            if verdict == "gone":
                continue
            counts[verdict] += 1
            print(f"{verdict:<10}  {folder}: {details}", flush=True)
    damaged = counts["damaged"] + (counts["incomplete"] if single else 0)
    shown = ", ".join(f"{n} {k}" for k, n in counts.items() if n or k != "incomplete")
    if len(folders) > 1:
        print(f"{len(folders)} checkpoints: {shown}")
    if not damaged and not counts["intact"] + counts["unverified"]:
        raise UserError(
            f"verify error: no complete checkpoint in {path} (interrupted saves only, or "
            f"removed meanwhile): nothing to verify"
        )
    return 1 if damaged else 0


def _verdict(folder: str, threads: int) -> tuple[str, str]:
    """(verdict, details) of one checkpoint folder on a disk; 'gone' when it went meanwhile."""
    marker = read_marker(folder)
    if marker_damaged(folder):
        return "damaged", f"its {MARKER} marker is not what the save wrote: changed since"
    if marker is None:
        return "incomplete", f"no {MARKER} marker: an interrupted save, never loaded"
    try:
        return _check(folder, marker, threads)
    except OSError as e:
        if not os.path.isdir(folder):  # rotated away by a running job meanwhile
            return "gone", ""
        return "damaged", f"unreadable: {e}"


def main(args: argparse.Namespace) -> int:
    given = [p for p in (args.path, args.run, args.checkpoint) if p is not None]
    if len(given) != 1:
        raise UserError(
            "verify error: name one run directory or checkpoint (PATH, --run-dir DIR or "
            "--checkpoint PATH)"
        )
    if (
        args.checkpoint is not None
        and not is_url(args.checkpoint)
        and not os.path.exists(os.path.join(args.checkpoint, MARKER))
    ):
        if os.path.isdir(args.checkpoint):
            print(f"{'incomplete':<10}  {args.checkpoint}: no {MARKER} marker")
            return 1
    return run(given[0])
