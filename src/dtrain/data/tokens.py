"""Token ids on disk (`data.name: tokens`), read through numpy.memmap: no rank copies the corpus.

`data.root` holds `train.bin` and `val.bin` (or `train_*.bin` and `val_*.bin` shards, read as one
sequence in name order): flat token ids, uint16 or uint32, no header, as `dtrain tokenize`,
nanoGPT and torchtitan write them. `meta.json` says the dtype, the vocabulary and the bytes of
text per split; a folder without it needs `data.tokens.dtype` and `data.tokens.vocab_size`.

A sample is a window of `seq_len + 1` tokens: training windows start every `data.tokens.stride`
tokens, validation windows every `seq_len` (each validation token is predicted once). The
window sequence (`Windows` over a `Span`) is shared with byte-level text (data/text.py).
"""

from __future__ import annotations

import bisect
import glob
import json
import os
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from fnmatch import fnmatch
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from dtrain.config import DataConfig
from dtrain.core.errors import UserError
from dtrain.core.urls import is_url, join
from dtrain.data import masks as loss_masks
from dtrain.data import remote_tokens
from dtrain.data.decode import BadSample
from dtrain.data.loaders import NO_SAMPLES, Datasets, Stacked
from dtrain.data.remote_tokens import RemoteShard
from dtrain.data.sampler import SampleKey, index_of
from dtrain.files import names
from dtrain.files.digests import ALGORITHM
from dtrain.process import dist

DTYPES = {"uint16": np.uint16, "uint32": np.uint32}
# What a window becomes as a tensor: torch has few uint16/uint32 operations; uint8 stays (bytes).
_TENSOR_DTYPES = {np.uint8: np.uint8, np.uint16: np.int32, np.uint32: np.int64}
# What start-up reads of a split (to check token ids, or a text's byte entropy): 4M tokens at most.
_SAMPLED_CHUNKS, _CHUNK_TOKENS = 64, 1 << 16
# Files mapped at once per Span (the least recently read is unmapped): a folder of many thousand
# text files stays under the process's limit on open files.
_OPEN_MAPS = 128


class BadTokens(BadSample):
    """A token id the vocabulary does not hold, found in a batch (in a loader worker)."""


class Span:
    """Tokens [start, stop) of files or arrays read as one sequence, with an optional
    `separator` token between consecutive parts. Files are memory-mapped on first use, in each
    process (a pickled Span carries paths, never the data)."""

    def __init__(
        self,
        parts: Sequence[str | np.ndarray | RemoteShard],
        dtype: type,
        separator: int | None = None,
        start: int = 0,
        stop: int | None = None,
    ) -> None:
        self.parts, self.dtype, self.separator = list(parts), np.dtype(dtype), separator
        sizes = [p.size if isinstance(p, np.ndarray) else self._file_tokens(p) for p in parts]
        gap = 0 if separator is None else 1
        self.offsets = [0]  # where each part begins in the whole sequence
        for size in sizes[:-1]:
            self.offsets.append(self.offsets[-1] + size + gap)
        self.sizes = sizes
        total = self.offsets[-1] + sizes[-1] if sizes else 0
        self.start, self.stop = start, total if stop is None else stop
        self._maps: OrderedDict[int, np.ndarray] = OrderedDict()

    def _file_tokens(self, part: str | RemoteShard) -> int:
        if isinstance(part, RemoteShard):
            size, path = part.nbytes, part.url
        else:
            size, path = os.path.getsize(part), part
        if size % self.dtype.itemsize:
            raise UserError(
                f"data error: {path} has {size} bytes, not a whole number of {self.dtype.name} "
                f"tokens ({self.dtype.itemsize} bytes each); is the dtype right "
                f"(meta.json or data.tokens.dtype)?"
            )
        return size // self.dtype.itemsize

    def __len__(self) -> int:
        return self.stop - self.start

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_maps": OrderedDict()}

    def part(self, k: int) -> np.ndarray:
        source = self.parts[k]
        if isinstance(source, np.ndarray):
            return source
        array = self._maps.get(k)
        if array is not None:
            self._maps.move_to_end(k)
            return array
        if self.sizes[k] == 0:  # numpy cannot map an empty file
            array = np.zeros(0, dtype=self.dtype)
        elif isinstance(source, RemoteShard):
            array = source.open(self.dtype)
        else:
            array = np.memmap(source, dtype=self.dtype, mode="r")
        self._maps[k] = array
        if len(self._maps) > _OPEN_MAPS:  # each map holds a file descriptor
            self._maps.popitem(last=False)
        return array

    def cut(self, at: int) -> tuple[Span, Span]:
        """The first `at` tokens and the rest, as two Spans over the same parts (and maps)."""
        head, tail = Span.__new__(Span), Span.__new__(Span)
        head.__dict__.update(self.__dict__, stop=self.start + at)
        tail.__dict__.update(self.__dict__, start=self.start + at)
        return head, tail

    def locate(self, position: int) -> tuple[str, int]:
        """Which file holds the span's token at `position`, and where in it (for messages)."""
        whole = self.start + position
        k = bisect.bisect_right(self.offsets, whole) - 1
        source = self.parts[k]
        if isinstance(source, RemoteShard):
            name = source.url
        else:
            name = source if isinstance(source, str) else "the built-in corpus"
        return name, whole - self.offsets[k]

    def read(self, position: int, out: np.ndarray) -> None:
        """Copy the span's tokens from `position` on into `out` (its length is how many)."""
        whole, filled = self.start + position, 0
        k = bisect.bisect_right(self.offsets, whole) - 1
        while filled < out.size:
            inside = whole - self.offsets[k]
            if inside < self.sizes[k]:
                take = min(self.sizes[k] - inside, out.size - filled)
                out[filled : filled + take] = self.part(k)[inside : inside + take]
                filled, whole = filled + take, whole + take
            else:  # the end of part k: the separator, if any, then part k + 1
                if self.separator is not None:
                    out[filled] = self.separator
                    filled, whole = filled + 1, whole + 1
                k += 1


def count_windows(tokens: int, seq_len: int, stride: int) -> int:
    return max(0, (tokens - (seq_len + 1)) // stride + 1)


class Windows(Dataset):
    """Windows of `seq_len + 1` tokens every `stride` tokens of a Span, as a (batch, seq_len + 1)
    tensor (bytes as uint8; token ids as int32, or int64 for uint32 files). With `vocab_size`,
    a batch holding an id outside the vocabulary stops the run with the file named. With a
    `mask` (a Span of the loss masks, data/masks.py), a batch is the pair (tokens, mask), the
    mask a uint8 tensor of the same shape (its flags: data/masks.py)."""

    def __init__(
        self,
        span: Span,
        seq_len: int,
        stride: int,
        vocab_size: int | None = None,
        mask: Span | None = None,
    ) -> None:
        self.span, self.seq_len, self.stride, self.vocab_size = span, seq_len, stride, vocab_size
        self.mask = mask
        self.count = count_windows(len(span), seq_len, stride)
        self.tensor_dtype = _TENSOR_DTYPES[span.dtype.type]

    def __len__(self) -> int:
        return self.count

    def _rows(self, span: Span, indices: list[int], dtype: type) -> np.ndarray:
        out: np.ndarray = np.empty((len(indices), self.seq_len + 1), dtype=dtype)
        row = np.empty(self.seq_len + 1, dtype=span.dtype)
        for i, index in enumerate(indices):
            if not 0 <= index < self.count:
                raise IndexError(f"window {index} of {self.count}")
            span.read(index * self.stride, row)
            out[i] = row
        return out

    def batch(self, indices: list[int]) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        out = self._rows(self.span, indices, self.tensor_dtype)
        if self.vocab_size is not None and out.size and int(out.max()) >= self.vocab_size:
            i, j = np.argwhere(out >= self.vocab_size)[0]
            raise self._out_of_vocabulary(indices[i] * self.stride + int(j), int(out[i, j]))
        if self.mask is None:
            return torch.from_numpy(out)
        return torch.from_numpy(out), torch.from_numpy(self._rows(self.mask, indices, np.uint8))

    def _out_of_vocabulary(self, position: int, token: int) -> BadTokens:
        path, at = self.span.locate(position)
        return BadTokens(out_of_vocabulary(path, at, token, self.vocab_size or 0))

    def __getitem__(self, key: SampleKey) -> Any:
        batch = self.batch([index_of(key)])
        return batch[0] if isinstance(batch, torch.Tensor) else tuple(part[0] for part in batch)

    def __getitems__(self, keys: list[SampleKey]) -> Stacked:
        return Stacked(self.batch([index_of(k) for k in keys]))


def out_of_vocabulary(path: str, at: int, token: int, vocab_size: int) -> str:
    return (
        f"data error: {path} holds token id {token} (token {at} of the file), not below the "
        f"vocabulary size {vocab_size}; the vocabulary (meta.json's vocab_size or "
        f"data.tokens.vocab_size) does not fit these files"
    )


def sampled(span: Span) -> Iterator[tuple[int, np.ndarray]]:
    """A sample of the span as (position, tokens) chunks that do not overlap: all of it up to
    _SAMPLED_CHUNKS chunks, else that many spread evenly, the first and last included."""
    size = len(span)
    if size <= _SAMPLED_CHUNKS * _CHUNK_TOKENS:
        starts: list[int] = list(range(0, size, _CHUNK_TOKENS))
    else:
        spread = np.linspace(0, size - _CHUNK_TOKENS, _SAMPLED_CHUNKS)
        starts = spread.astype(np.int64).tolist()
    for start in starts:
        chunk = np.empty(min(_CHUNK_TOKENS, size - start), dtype=span.dtype)
        span.read(start, chunk)
        yield start, chunk


def check_ids(span: Span, vocab_size: int) -> None:
    """Token ids below `vocab_size` on a sample of the span: a vocabulary that does not fit the
    files ends the run at start-up, with the file named, rather than in a loader worker."""
    for start, chunk in sampled(span):
        if chunk.size and int(chunk.max()) >= vocab_size:
            offset = int(np.argmax(chunk >= vocab_size))
            path, at = span.locate(start + offset)
            raise UserError(out_of_vocabulary(path, at, int(chunk[offset]), vocab_size))


# ---------------------------------------------------------------------------------------------
# The folder


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
