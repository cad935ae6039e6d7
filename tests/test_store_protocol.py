"""The checkpoint store's protocol (files/store_protocol.py): the store on a disk and the one in
an object store (moto's S3 server) both implement it, and keep its promises alike: saves listed
newest first by their save numbers, found by where they are, rotated; an object store's hook,
given at construction, runs before each marker."""

from __future__ import annotations

from pathlib import Path

import pytest

from dtrain.files.digests import file_digest
from dtrain.files.objstore import ObjectStore
from dtrain.files.remote_store import RemoteStore
from dtrain.files.store import Store
from dtrain.files.store_protocol import CheckpointStore


@pytest.fixture(params=["disk", "object store"])
def store_and_hooks(request, tmp_path: Path, monkeypatch) -> tuple[CheckpointStore, list[str]]:
    """A store of each kind, and what its before-marker hook was called for."""
    called: list[str] = []
    if request.param == "disk":
        return Store(str(tmp_path / "run"), {"anon": False}, timeout_s=5.0), called
    s3 = request.getfixturevalue("s3")
    for name, value in s3.env.items():
        monkeypatch.setenv(name, value)
    objects = ObjectStore(f"s3://{s3.bucket()}/exp/run", {"anon": False}, timeout_s=5.0)
    hook = lambda: called.append("marker")  # noqa: E731
    return RemoteStore(str(tmp_path / "stage"), objects, before_marker=hook), called


def _save(store: CheckpointStore, step: int) -> str:
    name = f"step_{step:06d}-epoch_00"
    tmp = store.begin(name)
    Path(tmp, "checkpoint.pt").write_bytes(bytes(range(step)))
    files = {"checkpoint.pt": step}
    digests = {"checkpoint.pt": file_digest(str(Path(tmp, "checkpoint.pt")))}
    store.upload(name, tmp, list(files))
    return store.publish(name, tmp, {"format": "full", "step": step}, files, digests)


def test_both_stores_keep_the_protocols_promises(store_and_hooks) -> None:
    store, called = store_and_hooks
    assert isinstance(store, CheckpointStore)
    assert (store.options, store.timeout_s) == ({"anon": False}, 5.0)  # given at construction
    store.prepare()
    assert store.complete() == [] and store.best("val_loss", "min") is None
    first, second = _save(store, 3), _save(store, 2)  # a rewind: saved last, the newest
    saved = store.complete()
    assert [(e.seq, e.step, e.path) for e in saved] == [(2, 2, second), (1, 3, first)]
    assert store.find(first) == saved[1] and store.find(first + "-elsewhere") is None
    store.rotate(keep_last=1, keep_best=0, monitor="val_loss", mode="min")
    assert [e.path for e in store.complete()] == [second]
    assert called == ([] if type(store) is Store else ["marker", "marker"])
