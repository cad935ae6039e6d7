"""Token ids on disk (`data.name: tokens`), read through numpy.memmap: no rank copies the corpus.

`data.root` holds `train.bin` and `val.bin` (or `train_*.bin` and `val_*.bin` shards, read as one
sequence in name order): flat token ids, uint16 or uint32, no header, as `dtrain tokenize`,
nanoGPT and torchtitan write them. `meta.json` says the dtype, the vocabulary and the bytes of
text per split; a folder without it needs `data.tokens.dtype` and `data.tokens.vocab_size`.

A sample is a window of `seq_len + 1` tokens: training windows start every `data.tokens.stride`
tokens, validation windows every `seq_len` (each validation token is predicted once): `Windows`
over a `Span` (data/windows.py), as byte-level text has them too.
"""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from fnmatch import fnmatch
from typing import Any

import numpy as np

from dtrain.config import DataConfig
from dtrain.core.errors import UserError
from dtrain.core.urls import is_url, join
from dtrain.data import masks as loss_masks
from dtrain.data import remote_tokens
from dtrain.data.loaders import NO_SAMPLES, Datasets
from dtrain.data.remote_tokens import RemoteShard
from dtrain.data.windows import Span, Windows, check_ids, count_windows
from dtrain.files import names
from dtrain.files.digests import ALGORITHM
from dtrain.process import dist

DTYPES = {"uint16": np.uint16, "uint32": np.uint32}


@dataclass(frozen=True)
class Folder:
    """What a token folder holds: each split's files as one Span (sizes checked against the
    dtype), the vocabulary, and from meta.json (when there is one) the bytes of text per token
    of each split; with loss masks, each split's masks as one Span and the tokens they count."""

    root: str
    files: dict[str, list[str]]  # "train" / "val" -> paths, in reading order
    spans: dict[str, Span]
    vocab_size: int
    bytes_per_token: dict[str, float | None]
    described_by: str  # where dtype and vocabulary came from, for the banner
    masks: dict[str, Span]  # empty for a folder without loss masks
    meta: dict[str, Any]  # meta.json ({} without one)

    def info(self, seq_len: int) -> dict[str, Any]:
        """What the model and the task learn from the folder: the vocabulary, the window's
        length, the validation split's bytes of text per token (for bits per byte) and
        whether the masks mark where documents start (packed windows)."""
        return {
            "vocab_size": self.vocab_size,
            "seq_len": seq_len,
            "bytes_per_token": self.bytes_per_token["val"],
            "documents": bool(self.masks) and loss_masks.packed(self.meta),
        }


def _split_files(root: str, split: str, listed: dict[str, int] | None = None) -> list[str]:
    """A split's files in reading order: on a disk, or among the names `listed` in a store."""
    if listed is not None:
        single = f"{root.rstrip('/')}/{names.token_file(split)}"
        pattern = names.token_shards(split)
        shards = [f"{root.rstrip('/')}/{n}" for n in sorted(listed) if fnmatch(n, pattern)]
        present = names.token_file(split) in listed
    else:
        single = os.path.join(root, names.token_file(split))
        found = glob.glob(os.path.join(glob.escape(root), names.token_shards(split)))
        shards = sorted(p for p in found if loss_masks.on_disk(p))
        present = loss_masks.on_disk(single)
    if present and shards:
        raise UserError(
            f"data error: {root} holds both {split}.bin and {split}_*.bin shards; keep one form"
        )
    if present:
        return [single]
    if not shards:
        raise UserError(
            f"data error: no {split}.bin (or {split}_*.bin shards) in {root}; data.root must be "
            f"a folder of token files, e.g. the output of dtrain tokenize"
        )
    return shards


def _parts(
    root: str,
    paths: list[str],
    listed: dict[str, int] | None,
    cache_gib: float,
    versions: dict[str, str],
    digests: dict[str, str],
) -> list[str | RemoteShard]:
    """The files as a Span reads them: paths on a disk, shards in a store (with their versions
    and meta.json's digests, which a node's copy is checked against)."""
    if listed is None:
        return list(paths)
    cache = remote_tokens.cache_folder(root, listed, cache_gib)
    shards = [os.path.basename(p) for p in paths]
    return [
        RemoteShard(root, n, listed[n], cache, versions.get(n, ""), digests.get(n, ""))
        for n in shards
    ]


def _digests(meta: dict[str, Any]) -> dict[str, str]:
    """meta.json's content digests of the files (dtrain tokenize writes them), when they are of
    the algorithm dtrain checks; none otherwise (a folder made by hand, an older one)."""
    digests = meta.get("digests")
    if meta.get("digest") != ALGORITHM or not isinstance(digests, dict):
        return {}
    return {str(k): str(v) for k, v in digests.items()}


def _read_meta(path: str, data: bytes | None = None) -> dict[str, Any]:
    """meta.json at `path` (its bytes `data` when read from a store)."""
    try:
        if data is None:
            with open(path, "rb") as f:
                data = f.read()
        meta = json.loads(data)
    except (OSError, ValueError) as e:
        raise UserError(f"data error: cannot read {path}: {e}") from None
    if not isinstance(meta, dict):
        raise UserError(f"data error: {path} is not a JSON object")
    return meta


def _meta_value(meta: dict[str, Any], key: str, path: str, valid: Any, what: str) -> Any:
    value = meta.get(key)
    if not valid(value):
        raise UserError(f"data error: {path}: '{key}' is {value!r}; it must be {what}")
    return value


def _bytes_per_token(meta: dict[str, Any], split: str, masked: bool) -> float | None:
    """Bytes of text per token; of a masked folder, per token the masks count (the loss's)."""
    tokens = (meta.get("counted" if masked else "tokens") or {}).get(split)
    text = (meta.get("bytes") or {}).get(split)
    if isinstance(tokens, int) and isinstance(text, (int, float)) and tokens > 0 and text > 0:
        return text / tokens
    return None


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def read_folder(cfg: DataConfig, splits: Sequence[str] = names.TOKEN_SPLITS) -> Folder:
    """The token folder at data.root, checked from its metadata and file sizes (no tokens read);
    its `splits` only (evaluation reads val alone)."""
    root, keys = cfg.root, cfg.tokens
    listed: dict[str, int] | None = None
    meta_bytes: bytes | None = None
    versions: dict[str, str] = {}
    if is_url(root):
        listed, meta_bytes, versions = remote_tokens.listing(root)
    elif not os.path.isdir(root):
        raise UserError(
            f"data error: token folder not found at '{root}': set data.root to a folder of "
            f"train.bin and val.bin (e.g. made by dtrain tokenize)"
        )
    files = {split: _split_files(root, split, listed) for split in splits}
    mask_files = loss_masks.find(root, files, listed)
    meta_path = join(root, names.TOKEN_META) if listed else os.path.join(root, names.TOKEN_META)
    if meta_bytes is not None or (listed is None and loss_masks.on_disk(meta_path)):
        meta = _read_meta(meta_path, meta_bytes)
        dtype = _meta_value(meta, "dtype", meta_path, DTYPES.__contains__, "uint16 or uint32")
        vocab = _meta_value(meta, "vocab_size", meta_path, _is_count, "a positive integer")
        for key, mine in (("dtype", dtype), ("vocab_size", vocab)):
            given = getattr(keys, key)
            if given is not None and given != mine:
                raise UserError(
                    f"config error: data.tokens.{key}: {given!r} disagrees with {meta_path} "
                    f"({mine!r}); leave data.tokens.{key} unset to use meta.json's"
                )
        per_token = {split: _bytes_per_token(meta, split, bool(mask_files)) for split in files}
        described = meta_path
    else:
        missing = [k for k in ("dtype", "vocab_size") if getattr(keys, k) is None]
        if missing:
            raise UserError(
                f"data error: {meta_path} not found: set data.tokens.{missing[0]} (and "
                f"data.tokens.dtype, data.tokens.vocab_size) for token files without one"
            )
        meta, dtype, vocab = {}, keys.dtype, keys.vocab_size
        per_token = {split: None for split in files}
        described = "data.tokens.dtype and data.tokens.vocab_size"
    digests = _digests(meta)
    spans = {
        split: Span(_parts(root, paths, listed, keys.cache_gib, versions, digests), DTYPES[dtype])
        for split, paths in files.items()
    }
    masks = {
        split: Span(_parts(root, paths, listed, keys.cache_gib, versions, digests), np.uint8)
        for split, paths in mask_files.items()
    }
    for split, mask in masks.items():
        loss_masks.check_sizes(spans[split], mask, mask_files[split])
    for split, paths in files.items():
        said = (meta.get("tokens") or {}).get(split)
        if isinstance(said, int) and said != len(spans[split]):
            raise UserError(
                f"data error: {', '.join(paths)} hold(s) {len(spans[split])} tokens, but "
                f"{meta_path} says {said}: the files and meta.json come from different runs"
            )
    return Folder(root, files, spans, vocab, per_token, described, masks, meta)


def window_counts(cfg: DataConfig, seq_len: int) -> tuple[int, int, dict[str, Any]]:
    """How many training and validation windows `build` makes, and its `info`, from metadata
    and file sizes alone (for `dtrain plan`, which reads no data)."""
    folder = read_folder(cfg)
    stride = cfg.tokens.stride or seq_len
    return (
        count_windows(len(folder.spans["train"]), seq_len, stride),
        count_windows(len(folder.spans["val"]), seq_len, seq_len),
        folder.info(seq_len),
    )


def enough_windows(windows: Windows, what: str, seq_len: int, key: str) -> None:
    """A split needs at least one window per rank (every rank evaluates and trains)."""
    world = dist.world_size()
    if len(windows) < world:
        raise UserError(
            f"data error: {what} has {len(windows.span)} tokens: {len(windows)} window(s) of "
            f"seq_len + 1 = {seq_len + 1}, fewer than one per rank ({world}); add data or lower "
            f"{key}"
        )


def build(cfg: DataConfig, seed: int, val_only: bool = False) -> Datasets:
    """Train and validation windows of the token folder at data.root (`val_only`, evaluation:
    validation windows alone; no train files needed). The windows' order is the sampler's:
    `seed` is not used."""
    folder = read_folder(cfg, ("val",) if val_only else names.TOKEN_SPLITS)
    seq_len = cfg.tokens.seq_len
    assert seq_len is not None, "data.build settles data.tokens.seq_len"
    stride = cfg.tokens.stride or seq_len
    spans, masks = folder.spans, folder.masks
    for span in spans.values():
        check_ids(span, folder.vocab_size)
    loss_masks.check_windows(folder.meta, cfg.root, seq_len, stride)
    val = Windows(spans["val"], seq_len, seq_len, folder.vocab_size, masks.get("val"))
    train: Any = NO_SAMPLES
    if not val_only:
        train = Windows(spans["train"], seq_len, stride, folder.vocab_size, masks.get("train"))
        enough_windows(train, ", ".join(folder.files["train"]), seq_len, "data.tokens.seq_len")
    enough_windows(val, ", ".join(folder.files["val"]), seq_len, "data.tokens.seq_len")
    per_token = folder.bytes_per_token["val"]
    bytes_note = (
        f"{per_token:.3f} bytes of text per {'counted ' if masks else ''}validation token"
        if per_token
        else "no bytes per token in meta.json: bits per byte not reported"
    )
    training = (
        ""
        if val_only
        else f"{len(train)} training windows of {seq_len + 1} tokens (stride {stride}), "
    )
    banner = (
        f"tokens from {cfg.root} ({spans['val'].dtype.name}, vocabulary "
        f"{folder.vocab_size}, from {folder.described_by}): {training}{len(val)} validation "
        f"windows; {bytes_note}"
    )
    notes = [banner]
    if masks:
        notes.append(masks_note(folder))
    return Datasets(train, val, folder.info(seq_len), notes)


def masks_note(folder: Folder) -> str:
    """The banner's line of a masked folder, once each split's masks are checked: what
    meta.json's digests say they are (or of defined flags alone), and counting some token."""
    digests = _digests(folder.meta)
    counted = {
        split: loss_masks.counted(folder.meta, split, m, digests)
        for split, m in folder.masks.items()
    }
    for split, count in counted.items():
        loss_masks.check_counted(count, split, folder.files[split])
    return loss_masks.note(folder.meta, counted, folder.spans)
