"""What `dtrain tokenize` writes: the token ids of a stream of documents, in batches, to one
file per split; the held-out cut; and the finished files put in place, meta.json last.

How bytes are counted (meta.json's `bytes`, from which bits per byte = loss per token in nats x
tokens / bytes / ln 2 compares across tokenizers): the UTF-8 bytes of each document's text, plus
one byte for the end-of-text token that follows it (as the byte-level `text` source puts one
newline between files). Where the held-out cut divides a document, each side counts the bytes of
its own tokens: exact for byte-level tokenizers, in proportion to the tokens for others.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, BinaryIO, TextIO

import numpy as np

from dtrain.commands.tokenize.inputs import Piece, Source, pieces
from dtrain.core.errors import UserError
from dtrain.files import names
from dtrain.files.digests import ALGORITHM, file_digest
from dtrain.observe.progress import clock

BYTES_COUNTED = (
    "UTF-8 bytes of the documents' text, plus 1 for each end-of-text token; where the "
    "held-out cut divides a document, each side counts the bytes of its own tokens"
)
_TOKEN_PATTERNS = (
    *(names.token_file(s) for s in names.TOKEN_SPLITS),
    *(names.token_shards(s) for s in names.TOKEN_SPLITS),
)
# Masks included: a stale mask left beside a new run's token files would mask them.
SHARD_PATTERNS = (*_TOKEN_PATTERNS, *map(names.loss_mask, _TOKEN_PATTERNS), names.TOKEN_META)


@dataclass
class Split:
    """What was written for one split: tokens, bytes (as BYTES_COUNTED says), documents, the
    text bytes each input gave, and of packed blocks (blocks.py) the tokens a loss mask counts
    and the padding."""

    tokens: int = 0
    bytes: int = 0
    documents: int = 0
    text_of: dict[str, int] = field(default_factory=dict)
    counted: int = 0
    padding: int = 0


class Progress:
    """On a terminal, a line redrawn in place: share of the input read, text, tokens, tokens/s.
    Elsewhere, the same as a plain line every EVERY_S seconds and at the end."""

    REDRAW_S, EVERY_S, WIDTH = 0.2, 10.0, 20

    def __init__(self, stream: TextIO, what: str, total: int) -> None:
        self.stream, self.what, self.total = stream, what, max(1, total)
        self.tty = stream.isatty()
        self.started = self.shown = time.monotonic()
        self.read = self.text = self.tokens = 0

    def add(self, pieces_read: list[Piece], tokens: int) -> None:
        read = sum(p.advance for p in pieces_read)
        self.count(read, sum(p.nbytes for p in pieces_read), tokens)

    def count(self, read: int, text: int, tokens: int) -> None:
        """`read` more bytes of the input read, holding `text` bytes of text, made `tokens`."""
        self.read += read
        self.text += text
        self.tokens += tokens
        now = time.monotonic()
        if now - self.shown >= (self.REDRAW_S if self.tty else self.EVERY_S):
            self.shown = now
            self._show(now, done=False)

    def finish(self) -> None:
        self.read = self.total
        self._show(time.monotonic(), done=True)

    def _show(self, now: float, done: bool) -> None:
        elapsed = max(1e-9, now - self.started)
        share = min(1.0, self.read / self.total)
        figures = f"{self.text / 1e6:.1f} MB of text ({self.text / 1e6 / elapsed:.2f} MB/s)"
        if self.tokens:
            figures += f", {self.tokens:,} tokens ({self.tokens / elapsed:,.0f} tokens/s)"
        if self.tty:
            filled = int(self.WIDTH * share)
            bar = f"|{'#' * filled}{'.' * (self.WIDTH - filled)}|"
            line = f"{self.what} {share:4.0%} {bar} {figures} [{clock(elapsed)}]"
            # A line that wraps cannot be redrawn in place: it gives way at the edge.
            width = shutil.get_terminal_size().columns - 1
            self.stream.write("\r\x1b[K" + line[:width] + ("\n" if done else ""))
        else:
            self.stream.write(f"{self.what}: {share:.0%}, {figures}, {clock(elapsed)}\n")
        self.stream.flush()


def encode(
    tokenizer: Any,
    from_sources: list[Source],
    column: str,
    out: BinaryIO | None,
    dtype: np.dtype,
    eot_id: int,
    batch_bytes: int,
    progress: Progress,
    index: BinaryIO | None = None,
    sink: Callable[[list[int], int], None] | None = None,
) -> Split:
    """Encode the sources' documents into `out`, each followed by `eot_id`, a batch of about
    `batch_bytes` of text at a time. `index` receives, for each document, the int64 pair
    (tokens so far, bytes so far) at its end: where a held-out cut can find its document.
    With `sink`, each whole document's ids and bytes go to it instead (`out` is not used)."""
    split = Split(text_of={s.input: 0 for s in from_sources})
    batch: list[Piece] = []
    size = 0
    document: list[int] = []  # with a sink: the pieces of the document not yet ended
    document_bytes = 0

    def to_sink(encoded: list[Any]) -> None:
        nonlocal document, document_bytes
        assert sink is not None
        for encoding, piece in zip(encoded, batch, strict=True):
            document += encoding.ids
            document_bytes += piece.nbytes
            if piece.last:
                sink([*document, eot_id], document_bytes + 1)
                document, document_bytes = [], 0
        progress.add(batch, sum(len(e.ids) for e in encoded))

    def flush() -> None:
        encoded = tokenizer.encode_batch_fast([p.text for p in batch], add_special_tokens=False)
        if sink is not None:
            to_sink(encoded)
            return
        flat: list[int] = []
        marks = []
        for encoding, piece in zip(encoded, batch, strict=True):
            flat += encoding.ids
            split.bytes += piece.nbytes
            if piece.last:
                flat.append(eot_id)
                split.bytes += 1
                split.documents += 1
                marks.append((split.tokens + len(flat), split.bytes))
        assert out is not None
        out.write(np.array(flat, dtype=dtype).tobytes())
        split.tokens += len(flat)
        if index is not None and marks:
            index.write(np.asarray(marks, dtype=np.int64).tobytes())
        progress.add(batch, len(flat))

    for source in from_sources:
        for piece in pieces(source, column):
            split.text_of[source.input] += piece.nbytes
            batch.append(piece)
            size += piece.nbytes
            if size >= batch_bytes:
                flush()
                batch, size = [], 0
    if batch:
        flush()
    for given, text in split.text_of.items():
        if not text:
            raise UserError(f"input error: '{given}' has no text")
    progress.finish()
    return split


def hold_out(
    train_path: str,
    val_path: str,
    index_path: str,
    train: Split,
    fraction: float,
    dtype: np.dtype,
    lengths: np.ndarray | None,
) -> Split:
    """Move the last `fraction` of the tokens (at least one) from train_path into val_path and
    settle the two splits' bytes: whole documents count theirs; the document the cut divides
    gives each side the bytes of its own tokens (exact with `lengths`, else in proportion to
    the tokens)."""
    val_tokens = max(1, int(train.tokens * fraction))
    cut = train.tokens - val_tokens
    if cut < 1:  # only a tokenizer that makes no token of some text gets here
        raise UserError(
            f"input error: the text makes {train.tokens} token(s): too few to hold out "
            f"a validation part; add text or give --val inputs"
        )
    marks = np.memmap(index_path, dtype=np.int64, mode="r").reshape(-1, 2)  # searched, not read
    k = int(np.searchsorted(marks[:, 0], cut, side="right"))  # the document the cut falls in
    start_tokens, start_bytes = (int(x) for x in marks[k - 1]) if k else (0, 0)
    end_tokens, end_bytes = (int(x) for x in marks[k])
    text_tokens, text_bytes = end_tokens - 1 - start_tokens, end_bytes - 1 - start_bytes
    if cut == start_tokens:
        before = 0
    elif lengths is not None:
        ids = np.memmap(train_path, dtype=dtype, mode="r")
        before = sum(
            int(lengths[ids[i : min(cut, i + (1 << 24))]].sum())
            for i in range(start_tokens, cut, 1 << 24)
        )
        del ids
    else:
        before = text_bytes * (cut - start_tokens) // max(1, text_tokens)
    train_bytes = start_bytes + min(before, text_bytes)
    move_tail(train_path, val_path, cut * np.dtype(dtype).itemsize)
    del marks
    val = Split(val_tokens, train.bytes - train_bytes, train.documents - k, {})
    train.tokens, train.bytes, train.documents = cut, train_bytes, k + (cut > start_tokens)
    return val


def move_tail(source_path: str, target_path: str, offset: int) -> None:
    """Move the bytes of the file at `source_path` from `offset` on into a new file at
    `target_path`, both synced."""
    with open(source_path, "r+b") as source, open(target_path, "wb") as target:
        source.seek(offset)
        shutil.copyfileobj(source, target, 16 << 20)
        source.truncate(offset)
        sync(source)
        sync(target)


def sync(f: BinaryIO) -> None:
    f.flush()
    os.fsync(f.fileno())


def existing_shards(out: str) -> list[str]:
    return sorted(
        os.path.basename(p)
        for pattern in SHARD_PATTERNS
        for p in glob.glob(os.path.join(out, pattern))
    )


def publish(out: str, partial: dict[str, str], meta: dict[str, Any]) -> None:
    """Rename the finished `.partial` files to their names and write meta.json last, with
    every file's digest. An older
    meta.json goes first and stale shards of another run with it, so that until the new
    meta.json is in place the folder does not claim to be complete."""
    # Each file's content digest, for the copies a node makes of the folder in an object store.
    digests = {name: file_digest(path) for name, path in sorted(partial.items())}
    meta = {**meta, "digest": ALGORITHM, "digests": digests}
    for name in existing_shards(out):
        if name == names.TOKEN_META or name not in partial:
            os.remove(os.path.join(out, name))
    for name, path in partial.items():
        os.replace(path, os.path.join(out, name))
    meta_partial = os.path.join(out, names.TOKEN_META + ".partial")
    with open(meta_partial, "w", encoding="utf-8") as f:
        json.dump(meta, f, indent=2)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(meta_partial, os.path.join(out, names.TOKEN_META))
    directory = os.open(out, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)
