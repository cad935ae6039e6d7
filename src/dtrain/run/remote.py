"""A run whose directory is in an object store: what `dtrain train` holds of it between the
claim and the end (the prefixes, the lease, the mirror of its records)."""

from __future__ import annotations

from dtrain.config import Config
from dtrain.files.lease import Lease
from dtrain.files.objstore import ObjectStore
from dtrain.files.remote_store import RemoteStore
from dtrain.files.store_protocol import CheckpointStore
from dtrain.run.mirror import RecordMirror


class RemoteRun:
    """A run whose directory is in an object store: the out_dir's prefix (runs.csv), the run's,
    its lease and the mirror of its records."""

    def __init__(self, cfg: Config, rank: int) -> None:
        assert cfg.run_url is not None
        self.out = ObjectStore(cfg.run.out_dir, cfg.run.storage_options, cfg.run.store_timeout_s)
        self.run = self.out.child(cfg.run_name)
        self.lease = Lease(self.run)
        self.mirror = RecordMirror(cfg.run_dir, self.run, cfg.run.upload_every_s, rank)
        # Whether this launch got the run: one refused (another run holds it) uploads nothing;
        # its staging folder may hold records of an older attempt, or the other run's own.
        self.claimed = False

    def store(self, run_dir: str) -> CheckpointStore:
        # The records up to a checkpoint go up before its marker.
        return RemoteStore(run_dir, self.run, before_marker=self.mirror.sync)

    def close(self, answering: bool = True) -> None:
        """The last upload of the records, then the lease goes; neither when the store stopped
        answering (the records stay in the staging folder, the lease lapses by itself), and no
        upload by a launch that never held the run (refused: the run is another's)."""
        if self.claimed:
            self.mirror.stop(upload=answering)
        self.lease.release(remove=answering)
