"""Documents packed whole into blocks of `--seq-len` tokens: the layout of `tokenize --chat`
(conversations) and `tokenize --pack` (plain documents).

Each block is exactly one training window of `data.name: tokens` (windows of seq_len + 1 tokens
every seq_len tokens: each split ends with one more pad token for the last window's target).
A document goes into the open block with the least room that still holds it (best fit, over
at most OPEN_BLOCKS open at once); when none does and as many are open, the fullest is closed,
its rest padded with the end-of-text id. Blocks are written as they close; at the end, the
documents of the blocks still open are packed again, longest first. Those last blocks pack
less tightly than the rest, and a held-out part (the last blocks) has more padding than the
training part: in the suite's set of documents of 10 to 110 tokens in blocks of 128, 0.2 % of
the training tokens and 4.5 % of the held-out ones; 0.6 % in all. The mask beside the
tokens flags each document's first token, and the first pad of a block's padding, as STARTS
(data/masks.py): training restarts the positions there and attention stays inside a document.
A document's first token is never counted: what precedes it in the window is another
document. Padding is never counted either.

A document longer than a block: a conversation is one line naming its row (a reply without
its conversation would teach nothing true); a plain document is cut into blocks of its own,
each piece a document that sees nothing of the piece before it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, BinaryIO

import numpy as np

from dtrain.commands.tokenize.inputs import Source
from dtrain.commands.tokenize.output import Split, move_tail, sync
from dtrain.core.errors import UserError
from dtrain.files import names

SEQ_LEN = 256  # the block when --seq-len is not given (data.tokens' window when nothing says)
# Blocks open at once for the best fit: more pack tighter; each holds at most --seq-len tokens.
OPEN_BLOCKS = 256
# Closed blocks held before they are written: memory stays small, writes stay large.
_BLOCKS_PER_WRITE = 256
# The columns of a split's index row, one row per block in file order: what a held-out cut
# finds its figures in (each the total up to and with that block).
_INDEX = ("counted", "bytes", "documents", "padding")


@dataclass(frozen=True)
class _Document:
    ids: np.ndarray
    flags: np.ndarray  # the mask's bytes, STARTS on the first
    bytes: int
    whole: bool  # False for the second and later pieces of a long document


@dataclass(eq=False)  # (blocks are told apart by identity)
class _Open:
    documents: list[_Document] = field(default_factory=list)
    fill: int = 0
    figures: tuple[int, ...] = ()  # once closed: its row of _INDEX, for itself alone


class Blocks:
    """Documents packed into blocks of `size` tokens, written to a token file and its mask;
    `index` (or None) receives a row of int64 totals (_INDEX) at the end of each block."""

    def __init__(
        self,
        tokens: BinaryIO,
        mask: BinaryIO,
        index: BinaryIO | None,
        size: int,
        dtype: np.dtype,
        pad_id: int,
        cut_long: bool,
    ) -> None:
        self.tokens, self.mask, self.index = tokens, mask, index
        self.size, self.dtype, self.pad_id, self.cut_long = size, dtype, pad_id, cut_long
        self.split = Split()
        self.open: list[_Open] = []
        self.closed: list[_Open] = []
        self._totals = np.zeros(len(_INDEX), dtype=np.int64)  # of the blocks written

    def add(self, where: str, ids: list[int], mask: np.ndarray, nbytes: int) -> None:
        """One document: its ids, which of them count (a uint8 mask), its bytes of text."""
        if len(ids) > self.size:
            if not self.cut_long:
                raise UserError(
                    f"input error: {where}: the conversation is {len(ids)} tokens, longer than "
                    f"a window of --seq-len {self.size}; raise --seq-len (and train with "
                    f"data.tokens.seq_len a multiple of it), or leave the conversation out"
                )
            for start in range(0, len(ids), self.size):  # the first piece is the document
                piece = slice(start, start + self.size)
                self._place(self._document(ids[piece], mask[piece], nbytes, start == 0))
            return
        self._place(self._document(ids, mask, nbytes, True))

    def _document(self, ids: list[int], mask: np.ndarray, nbytes: int, whole: bool) -> _Document:
        flags = mask.astype(np.uint8, copy=True)
        flags[0] = names.MASK_STARTS  # (never counted: see the module's docstring)
        return _Document(np.asarray(ids, dtype=self.dtype), flags, nbytes if whole else 0, whole)

    def _place(self, document: _Document, pool: int | None = None) -> None:
        """Into the fullest open block it fits in, else a new one (closing the fullest when
        `pool` are open, by default OPEN_BLOCKS)."""
        pool = OPEN_BLOCKS if pool is None else pool
        size = len(document.ids)
        fits = [b for b in self.open if b.fill + size <= self.size]
        if fits:
            block = max(fits, key=lambda b: b.fill)
        else:
            if len(self.open) >= pool:
                self._close(max(self.open, key=lambda b: b.fill))
            block = _Open()
            self.open.append(block)
        block.documents.append(document)
        block.fill += size

    def _close(self, block: _Open) -> None:
        """Pad the block to its size and queue it for writing."""
        self.open.remove(block)
        pad = self.size - block.fill
        if pad:
            padding = np.zeros(pad, dtype=np.uint8)
            padding[0] = names.MASK_STARTS
            pads = np.full(pad, self.pad_id, dtype=self.dtype)
            block.documents.append(_Document(pads, padding, 0, False))
        counted = sum(int(np.count_nonzero(d.flags[1:])) for d in block.documents)
        nbytes = sum(d.bytes for d in block.documents)
        whole = sum(d.whole for d in block.documents)
        block.figures = (counted, nbytes, whole, pad)
        split = self.split
        split.tokens += self.size
        split.counted, split.bytes = split.counted + counted, split.bytes + nbytes
        split.documents, split.padding = split.documents + whole, split.padding + pad
        self.closed.append(block)
        if len(self.closed) >= _BLOCKS_PER_WRITE:
            self._write()

    def _write(self) -> None:
        placed = [d for b in self.closed for d in b.documents]
        self.tokens.write(b"".join(d.ids.tobytes() for d in placed))
        self.mask.write(b"".join(d.flags.tobytes() for d in placed))
        if self.index is not None:
            rows = []
            for b in self.closed:
                self._totals += b.figures
                rows.append(self._totals.copy())
            self.index.write(np.asarray(rows, dtype=np.int64).tobytes())
        self.closed = []

    def finish(self) -> Split:
        """Pack the documents still in open blocks again, longest first, into as many blocks
        as they need (the end of a split is not left to the leftovers of the best fit), close
        them (the fullest first), write what is left, sync."""
        left = sorted((d for b in self.open for d in b.documents), key=lambda d: -len(d.ids))
        self.open = []
        for document in left:
            self._place(document, pool=len(left) + 1)
        for block in sorted(self.open, key=lambda b: -b.fill):
            self._close(block)
        if self.closed:
            self._write()
        sync(self.tokens)
        sync(self.mask)
        return self.split


Add = Callable[[str, list[int], np.ndarray, int], None]  # Blocks.add


def write_splits(
    meta: dict[str, Any],
    val_fraction: float,
    train_sources: list[Source],
    val_sources: list[Source],
    partial: dict[str, str],
    index_path: str,
    feed: Callable[[list[Source], Add, str], None],
    cut_long: bool,
) -> dict[str, Split]:
    """train.bin, val.bin and their masks, under their .partial names, complete and synced, in
    the dtype, the block size (`meta["packed"]`) and with the pad id that `meta` gives: `feed`
    hands each document of the sources it is given to `add`, saying `what` it does."""
    size, dtype, pad_id = meta["packed"]["seq_len"], np.dtype(meta["dtype"]), meta["eot_id"]

    def write(split: str, from_sources: list[Source], what: str, index: BinaryIO | None) -> Split:
        tokens_file = names.token_file(split)
        with (
            open(partial[tokens_file], "wb") as tokens,
            open(partial[names.loss_mask(tokens_file)], "wb") as mask,
        ):
            blocks = Blocks(tokens, mask, index, size, dtype, pad_id, cut_long)
            feed(from_sources, blocks.add, what)
            return blocks.finish()

    with open(index_path, "wb") as index:
        train = write("train", train_sources, "tokenizing", None if val_sources else index)
    if val_sources:
        val = write("val", val_sources, "tokenizing --val", None)
    else:
        val = hold_out(partial, index_path, train, val_fraction, size, dtype)
    for split, written in (("train", train), ("val", val)):
        end(partial, split, written, dtype, pad_id)
    return {"train": train, "val": val}


def hold_out(
    partial: dict[str, str],
    index_path: str,
    train: Split,
    fraction: float,
    size: int,
    dtype: np.dtype,
) -> Split:
    """Move the last `fraction` of the blocks (at least one) into val.bin and its mask."""
    marks = np.memmap(index_path, dtype=np.int64, mode="r").reshape(-1, len(_INDEX))
    blocks = len(marks)
    keep = blocks - max(1, int(blocks * fraction))
    if keep < 1:
        raise UserError(
            f"input error: the documents fill {blocks} window(s) of --seq-len {size}: too "
            f"few to hold out a validation part; add documents or give --val inputs"
        )
    counted, nbytes, documents, padding = (int(x) for x in marks[keep - 1])
    del marks
    train_file, val_file = names.token_file("train"), names.token_file("val")
    move_tail(partial[train_file], partial[val_file], keep * size * dtype.itemsize)
    move_tail(partial[names.loss_mask(train_file)], partial[names.loss_mask(val_file)], keep * size)
    val = Split(
        train.tokens - keep * size,
        train.bytes - nbytes,
        train.documents - documents,
        counted=train.counted - counted,
        padding=train.padding - padding,
    )
    train.tokens, train.bytes, train.documents = keep * size, nbytes, documents
    train.counted, train.padding = counted, padding
    return val


def end(partial: dict[str, str], split: str, written: Split, dtype: np.dtype, pad_id: int) -> None:
    """The pad token that ends a split: its last block's window needs one token past it."""
    tokens_file = names.token_file(split)
    with open(partial[tokens_file], "ab") as tokens:
        tokens.write(np.array([pad_id], dtype=dtype).tobytes())
        sync(tokens)
    with open(partial[names.loss_mask(tokens_file)], "ab") as mask:
        mask.write(np.array([names.MASK_STARTS], dtype=np.uint8).tobytes())
        sync(mask)
    written.tokens += 1
