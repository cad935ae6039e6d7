"""What a store of a run's checkpoints does, wherever they are: `CheckpointStore`, the protocol
that the store on this disk (`files.store.Store`) and the one in an object store
(`files.remote_store.RemoteStore`) implement, and that the checkpointer, the run and the commands
that read a run are written against; and `Entry`, a complete checkpoint as a store lists it.

A save, as the checkpointer drives it: rank 0 `begin`s a temporary folder on this disk, every
rank writes its files there (each may go up while it is written: `streaming`) and `upload`s
them; rank 0 then `publish`es the save (its marker, written last, makes it complete) and
`rotate`s. A save that failed is `discard`ed. A store gets what it needs at construction: its
folder or prefix, the storage options, the deadline of a request, and its hooks.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

# Names of checkpoints saved before markers held the monitored metric.
_LEGACY_NAME = re.compile(r"^step_(\d+)-epoch_(\d+)(?:-([A-Za-z_]+)_(-?[0-9.]+|nan|inf))?$")


@dataclass(frozen=True)
class Entry:
    """A complete checkpoint: its folder name, where it is (a folder, or a URL) and marker."""

    name: str
    path: str
    marker: dict[str, Any]

    @property
    def seq(self) -> int:
        return int(self.marker.get("seq", 0))

    @property
    def step(self) -> int:
        return int(self.marker.get("step", 0))

    def metric(self, monitor: str) -> float | None:
        """The monitored value at this checkpoint (None when it was not evaluated there)."""
        if "metric" in self.marker:
            if self.marker["metric"] != monitor or self.marker.get("value") is None:
                return None
            return float(self.marker["value"])
        match = _LEGACY_NAME.match(self.name)  # markers written before the metric was in them
        if match and match.group(3) == monitor and match.group(4) is not None:
            return float(match.group(4))
        return None


class Upload(Protocol):
    """One file of a save going up while it is written: its bytes as they come, then `finish`
    (the file exists in the store); `abort` leaves nothing."""

    def write(self, data: Any) -> int: ...

    def finish(self) -> None: ...

    def abort(self) -> None: ...


@runtime_checkable
class CheckpointStore(Protocol):
    """The checkpoints of one run directory, in the order they were saved (the markers' save
    numbers, never the steps in their names). Only rank 0 changes it."""

    run_dir: str  # the run directory on this disk (an object store's run: the staging folder)
    dir: str  # the folder of this disk where saves are written first
    location: str  # where the checkpoints are, for messages (a folder, or a URL)
    options: dict[str, Any]  # run.storage_options: also for a checkpoint named by its URL
    timeout_s: float  # the deadline of each request to an object store (run.store_timeout_s)
    # Whether a failed save may pass (training goes on, the next save tries again): not on a
    # disk, where it fails for reasons that stay (full, read-only).
    retries_saves: bool

    def prepare(self) -> None:
        """Before the first save: what interrupted saves left is removed; a checkpoint whose
        marker cannot be trusted is moved aside, never deleted."""
        ...

    def complete(self) -> list[Entry]:
        """The complete checkpoints, newest (last saved) first."""
        ...

    def find(self, path: str) -> Entry | None:
        """The entry that `path` (a folder, or a URL) names, or None for one elsewhere."""
        ...

    def best(self, monitor: str, mode: str) -> Entry | None:
        """The checkpoint with the best value of `monitor`, None when none records one."""
        ...

    def begin(self, name: str) -> str:
        """A fresh temporary folder on this disk for the save of `name`."""
        ...

    def streaming(self, name: str, rel: str) -> Upload | None:
        """An upload of the save `name`'s file `rel` while it is written, None where the file
        stays where it is written."""
        ...

    def upload(self, name: str, tmp: str, files: list[str]) -> None:
        """Each rank's own files of a save (below `tmp`) into the store."""
        ...

    def discard(self, name: str) -> None:
        """What a failed save left in the store, unless its marker got written."""
        ...

    def publish(
        self,
        name: str,
        tmp: str,
        marker: dict[str, Any],
        files: dict[str, int],
        digests: dict[str, str],
    ) -> str:
        """Once every file of the save is in the store with its size: the marker (the next save
        number, each file's size and digest), which makes the checkpoint complete, then
        `latest`. Returns where the checkpoint is."""
        ...

    def rotate(self, keep_last: int, keep_best: int, monitor: str, mode: str) -> None:
        """Keep the `keep_last` last saved and the `keep_best` best complete checkpoints."""
        ...

    def delete(self, entry: Entry) -> None: ...

    def supersede(self, entries: list[Entry], reason: str, records: bool = False) -> str | None:
        """Move `entries` (with `records`, the run's metrics and TensorBoard events) aside into
        `superseded/<time>/`; nothing is deleted. Returns that folder on this disk, None when
        nothing moved."""
        ...
