"""Hugging Face datasets saved to an object store (`data.name: hf`, `data.root: s3://...`): a
folder that `save_to_disk` wrote there (a Dataset, or a DatasetDict with its splits), read from
this node's copy (`node_copy`: fetched once per node, each file checked against the store's size
and version), memory-mapped as a local one is. Only saved folders: parquet or JSON-lines files
would be converted into each node's `datasets` cache by rank 0 alone.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from dtrain.config import DataConfig
from dtrain.core.errors import UserError
from dtrain.core.urls import is_url
from dtrain.data import hf, node_copy
from dtrain.data.loaders import Datasets
from dtrain.files.keys import local_path
from dtrain.files.objstore import ObjectStore
from dtrain.process import dist

# What save_to_disk writes at the top of its folder: a Dataset's state, a DatasetDict's splits.
SAVED = ("state.json", "dataset_dict.json")


def build(cfg: DataConfig, seed: int) -> Datasets:
    """hf.build, of the node's copy for a dataset in the store."""
    if not is_url(cfg.root):
        return hf.build(cfg, seed)
    local = dataclasses.replace(cfg, root=node_copy_of(cfg.root))  # every process: its node's
    theirs, found = dist.on_main(lambda: (local.root, _survey(local, seed, cfg.root)))
    return hf.build(local, seed, _moved(found, theirs, local.root))


def survey(cfg: DataConfig, seed: int) -> hf.Survey:
    """hf.survey, of the node's copy for a dataset in the store (`dtrain plan`)."""
    if not is_url(cfg.root):
        return hf.survey(cfg, seed)
    return _survey(dataclasses.replace(cfg, root=node_copy_of(cfg.root)), seed, cfg.root)


def node_copy_of(url: str) -> str:
    """This node's copy of the saved dataset at `url`: every file fetched unless the copy there
    is of the store's version; files the store no longer has removed."""
    objects = ObjectStore(url)
    with objects.failing_as("read"):
        objects.check()
        listed = {n: v for n, v in objects.versions().items() if not n.startswith(".")}
    if not any(name in listed for name in SAVED):
        what = "no objects there" if not listed else f"no {' or '.join(SAVED)} at its top"
        raise UserError(
            f"data error: data.root '{url}': {what}. Of an object store, data.name hf reads a "
            f"folder that datasets' save_to_disk wrote (dataset.save_to_disk('{url}')); for "
            f"parquet or JSON-lines files, copy them to a node-local folder and set data.root"
        )
    folder = node_copy.folder_for(url)
    for name in listed:  # every key checked before the first is fetched
        local_path(folder, name, objects.url)
    for name, (size, version) in sorted(listed.items()):
        node_copy.ensure(objects, name, size, version, folder)
    node_copy.remove_others(folder, set(listed))
    return folder


def _survey(cfg: DataConfig, seed: int, url: str) -> hf.Survey:
    """hf.survey of the copy, its messages naming the store's URL instead of the copy."""
    url = url.rstrip("/")
    try:
        found = hf.survey(cfg, seed)
    except UserError as e:
        raise UserError(str(e).replace(cfg.root, url)) from None

    def named(source: Any) -> Any:
        return dataclasses.replace(source, name=source.name.replace(cfg.root, url))

    return dataclasses.replace(
        found,
        train=named(found.train),
        val=named(found.val) if found.val is not None else None,
        notes=[note.replace(cfg.root, url) for note in found.notes],
    )


def _moved(found: hf.Survey, theirs: str, mine: str) -> hf.Survey:
    """Rank 0's survey, its paths in this node's copy (another node's temporary folder may be
    elsewhere)."""
    if theirs == mine:
        return found

    def moved(source: Any) -> Any:
        if source is None:
            return None
        folder = source.folder.replace(theirs, mine, 1) if source.folder else None
        files = tuple(f.replace(theirs, mine, 1) for f in source.files)
        return dataclasses.replace(source, folder=folder, files=files)

    return dataclasses.replace(found, train=moved(found.train), val=moved(found.val))
