"""Token sequences and the windows a model trains on, shared by token folders (data/tokens.py),
their mixes (data/mix.py) and byte-level text (data/text.py).

A `Span` reads files or arrays (token files, loss masks, a remote shard) as one sequence, mapped
on first use in each process; `Windows` cuts windows of `seq_len + 1` tokens from it as a
dataset, and checks the ids against the vocabulary.
"""

from __future__ import annotations

import bisect
import os
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from dtrain.core.errors import UserError
from dtrain.data.decode import BadSample
from dtrain.data.loaders import Stacked
from dtrain.data.remote_tokens import RemoteShard
from dtrain.data.sampler import SampleKey, index_of

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
