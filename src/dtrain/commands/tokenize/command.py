"""`dtrain tokenize`: text into token shards that `data.name: tokens` reads.

    dtrain tokenize INPUT... --out DIR (--vocab-size N | --tokenizer tokenizer.json|MODEL_DIR)
    dtrain tokenize --corpus python_docs --out DIR --vocab-size N

With `--vocab-size`, a byte-level BPE (Hugging Face `tokenizers`) is trained on the training
inputs; with `--tokenizer`, an existing `tokenizer.json` is used (a model folder's: the model's
own tokenizer, its `eos_token` ending each document). Each document is encoded as it
is (no added prefix space, no special tokens of the tokenizer's own) and followed by the
end-of-text token. What DIR then holds:

- `train.bin`, `val.bin`: the token ids, flat, little-endian uint16 when the vocabulary has at
  most 65,536 ids, else uint32, no header;
- `tokenizer.json`: the tokenizer, which `tokenizers.Tokenizer.from_file` reads alone;
- `meta.json`: dtype, vocab_size, eot_id (and the token's text), tokens, bytes and documents per
  split, the tokenizer's file and where it came from, the inputs with their sizes (see
  `tokenize`; how bytes are counted: `dtrain.commands.tokenize.output`).

The held-out part is the last `--val-fraction` of the token stream (at least one token), or the
`--val` inputs. Memory does not grow with the corpus: documents are read, encoded (by
`encode_batch_fast`, on all cores or `--workers`) and written in batches (a quarter of a megabyte
of text per thread, at least a megabyte). The files are written under `.partial` names,
synced, and renamed when complete; meta.json comes last, so a folder with a meta.json is always
a finished one.
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, TextIO

import numpy as np

from dtrain.commands.tokenize import blocks as packed
from dtrain.commands.tokenize import chat as chat_data
from dtrain.commands.tokenize.inputs import Source, corpus_sources, pieces, sources
from dtrain.commands.tokenize.output import (
    BYTES_COUNTED,
    Progress,
    Split,
    encode,
    existing_shards,
    hold_out,
    publish,
    sync,
)
from dtrain.commands.tokenize.settings import Settings, check
from dtrain.commands.tokenize.tokenizer import (
    EOT,
    TOKENIZER_FILE,
    load_tokenizer,
    threads,
    token_bytes,
    train_tokenizer,
    use_workers,
)
from dtrain.core.errors import UserError
from dtrain.files import names, outputs

PACKED_COUNTED = "every token but the first of each document and the padding"
UINT16_VOCAB = 1 << 16
BATCH_BYTES_PER_THREAD = 256 << 10


@dataclass(frozen=True)
class Inputs:
    """The documents of each split, as the settings name them."""

    train: list[Source]
    val: list[Source]  # empty: the held-out part of `train`
    column: str


@dataclass(frozen=True)
class Chosen:
    """The tokenizer that encodes, and where it came from."""

    tokenizer: Any  # a tokenizers.Tokenizer
    eot: str  # its end-of-text token
    made_by: str  # for meta.json: the given tokenizer's path, or how it was trained
    file: str | None  # the given tokenizer.json; None: trained here
    templated: Any = None  # with --chat: the folder's tokenizer as transformers loads it
    chat_layout: dict[str, Any] = field(default_factory=dict)  # with --chat: meta.json's "chat"


@dataclass(frozen=True)
class Unfinished:
    """The files being written into `out`, under .partial names until each is complete."""

    out: str
    files: dict[str, str]  # a final name -> its .partial path
    index: str  # where each document ends (the held-out cut keeps documents whole); removed

    def remove(self) -> None:
        for path in [*self.files.values(), self.index, os.path.join(self.out, "meta.json.partial")]:
            if os.path.exists(path):
                os.remove(path)


def tokenize(settings: Settings, stream: TextIO | None = None) -> dict[str, Any]:
    """Tokenize the settings' inputs (or the built-in corpus) into their `out`; returns what
    meta.json holds. With `chat`, the inputs are conversations, rendered by the --tokenizer
    folder's chat template (each within `render_timeout` seconds), packed into windows of
    `seq_len` tokens and masked (commands/tokenize/chat.py); with `pack`, plain documents are
    packed so (commands/tokenize/blocks.py); a --chat folder's own tokenizer code runs only
    with `trust_remote_code`.
    Every mistake is a UserError, raised before anything is written or with everything
    written so far removed. Progress goes to `stream` (default: stderr)."""
    stream = stream or sys.stderr
    check(settings)
    inputs = _inputs_of(settings)
    out = os.path.abspath(settings.out)
    _check_out(out, settings.overwrite)
    use_workers(settings.workers)
    chosen = _choose_tokenizer(settings, inputs, stream)
    meta = _meta(settings, chosen)
    created = not os.path.isdir(out)
    try:
        os.makedirs(out, exist_ok=True)
    except OSError as e:
        raise outputs.output_error("tokenize", out, e) from None
    unfinished = _unfinished(out, settings, chosen)
    try:
        _write_folder(settings, inputs, chosen, meta, unfinished, stream)
    except BaseException as e:
        unfinished.remove()
        if created and not os.listdir(out):
            os.rmdir(out)
        # A full disk: the files that were in `out` are as they were.
        failed = (
            outputs.write_failure("tokenize", out, e)
            if isinstance(e, Exception) and not isinstance(e, UserError)
            else None
        )
        if failed is not None:
            raise failed from None
        raise
    if os.path.exists(unfinished.index):
        os.remove(unfinished.index)
    return meta


def _unfinished(out: str, settings: Settings, chosen: Chosen) -> Unfinished:
    written = [names.token_file(s) for s in names.TOKEN_SPLITS]
    if settings.packs:
        written += [names.loss_mask(n) for n in written]
    partial = {n: os.path.join(out, n + ".partial") for n in written}
    target = os.path.join(out, TOKENIZER_FILE)
    if chosen.file is None or not _same_file(chosen.file, target):
        partial[TOKENIZER_FILE] = target + ".partial"
    return Unfinished(out, partial, os.path.join(out, "documents.partial"))


def _inputs_of(settings: Settings) -> Inputs:
    column, chat = settings.text_column, settings.chat
    if settings.corpus:
        train = corpus_sources(settings.corpus)
    else:
        train = sources(settings.inputs, column, chat=chat)
    val = sources(settings.val_inputs, column, "val", chat) if settings.val_inputs else []
    return Inputs(train, val, column)


def _choose_tokenizer(settings: Settings, inputs: Inputs, stream: TextIO) -> Chosen:
    """The given tokenizer (with --chat, also as transformers loads it), or one trained on the
    training inputs."""
    path = settings.tokenizer_path
    if path is not None:
        tokenizer, eot = load_tokenizer(path, settings.eot)
        templated: Any = None
        layout: dict[str, Any] = {}
        if settings.chat:
            templated = chat_data.load_tokenizer(path, settings.trust_remote_code)
            layout = chat_data.meta_of(path, templated)
        file = os.path.join(path, TOKENIZER_FILE) if os.path.isdir(path) else path
        return Chosen(tokenizer, eot, os.path.abspath(path), file, templated, layout)
    assert settings.vocab_size is not None
    eot = settings.eot or EOT
    reading = Progress(stream, "reading text for the tokenizer", _size(inputs.train))
    texts = _texts(inputs.train, inputs.column, reading)
    tokenizer = train_tokenizer(texts, settings.vocab_size, eot)
    made_by = f"byte-level BPE trained on the INPUT text with --vocab-size {settings.vocab_size}"
    return Chosen(tokenizer, eot, made_by, None)


def _meta(settings: Settings, chosen: Chosen) -> dict[str, Any]:
    """What meta.json says before any token is written."""
    tokenizer = chosen.tokenizer
    # A document's text is text even where it spells a special token, as in the files.
    tokenizer.encode_special_tokens = True
    vocab = tokenizer.get_vocab_size(with_added_tokens=True)
    meta: dict[str, Any] = {
        "dtype": "uint16" if vocab <= UINT16_VOCAB else "uint32",
        "vocab_size": vocab,
        "eot_id": tokenizer.token_to_id(chosen.eot),
        "eot": chosen.eot,
    }
    if settings.chat:
        meta["chat"] = chosen.chat_layout
    if settings.packs:
        meta["packed"] = {"seq_len": settings.seq_len or packed.SEQ_LEN}
    return meta


def _about(settings: Settings, inputs: Inputs, chosen: Chosen) -> dict[str, Any]:
    """What meta.json says of where its tokens came from (after the counts)."""
    held_out = "windows" if settings.packs else "token stream"
    about = {
        "bytes_counted": chat_data.BYTES_COUNTED if settings.chat else BYTES_COUNTED,
        "tokenizer": TOKENIZER_FILE,
        "tokenizer_from": chosen.made_by,
        "val_from": "the --val inputs"
        if inputs.val
        else f"the last {settings.val_fraction:g} of the {held_out}",
        "val_fraction": None if inputs.val else settings.val_fraction,
        "inputs": {"train": _listed(inputs.train), "val": _listed(inputs.val)},
    }
    if settings.chat:
        about["mask"] = chat_data.COUNTED
    elif settings.pack:
        about["mask"] = PACKED_COUNTED
    return about


def _write_folder(
    settings: Settings,
    inputs: Inputs,
    chosen: Chosen,
    meta: dict[str, Any],
    unfinished: Unfinished,
    stream: TextIO,
) -> None:
    """The tokenizer, the splits and meta.json, under their .partial names, then put in place."""
    partial = unfinished.files
    if TOKENIZER_FILE in partial:
        if chosen.file is None:
            chosen.tokenizer.save(partial[TOKENIZER_FILE])
        else:
            shutil.copyfile(chosen.file, partial[TOKENIZER_FILE])
    if chosen.templated is not None:
        splits = chat_data.write_splits(
            chosen.templated,
            meta,
            settings.val_fraction,
            inputs.train,
            inputs.val,
            inputs.column,
            partial,
            unfinished.index,
            stream,
            settings.render_timeout or chat_data.RENDER_TIMEOUT_S,
        )
    else:
        splits = _write_splits(chosen.tokenizer, meta, settings, inputs, unfinished, stream)
    for key in ("tokens", "bytes", "documents", *(("counted",) if settings.packs else ())):
        meta[key] = {name: getattr(split, key) for name, split in splits.items()}
    if settings.packs:
        meta["packed"]["padding"] = {name: split.padding for name, split in splits.items()}
    meta.update(_about(settings, inputs, chosen))
    publish(unfinished.out, partial, meta)


def _texts(from_sources: list[Source], column: str, progress: Progress) -> Iterator[str]:
    """The sources' text for training the tokenizer, checked to have some in every input."""
    text_of = {s.input: 0 for s in from_sources}
    for source in from_sources:
        for piece in pieces(source, column):
            text_of[source.input] += piece.nbytes
            progress.add([piece], 0)
            yield piece.text
    for given, text in text_of.items():
        if not text:
            raise UserError(f"input error: '{given}' has no text")
    progress.finish()


def _listed(from_sources: list[Source]) -> list[dict[str, Any]]:
    return [{"path": p, "bytes": n} for s in from_sources for p, n in s.files.items()]


def _check_out(out: str, overwrite: bool) -> None:
    if os.path.exists(out) and not os.path.isdir(out):
        raise UserError(f"output error: --out '{out}' is a file, not a folder")
    held = existing_shards(out) if os.path.isdir(out) else []
    if held and not overwrite:
        raise UserError(
            f"output error: '{out}' already holds token shards ({', '.join(held)}); "
            f"choose another --out or add --overwrite"
        )


def _write_splits(
    tokenizer: Any,
    meta: dict[str, Any],
    settings: Settings,
    inputs: Inputs,
    unfinished: Unfinished,
    stream: TextIO,
) -> dict[str, Split]:
    """train.bin and val.bin, under their .partial names, complete and synced, in the dtype
    and with the end-of-text id that `meta` gives; packed, with their masks."""
    dtype, eot_id = np.dtype(meta["dtype"]), meta["eot_id"]
    batch_bytes = max(1 << 20, threads(settings.workers) * BATCH_BYTES_PER_THREAD)
    train_sources, val_sources, column = inputs.train, inputs.val, inputs.column
    partial, index_path, val_fraction = unfinished.files, unfinished.index, settings.val_fraction
    if settings.pack:

        def feed(from_sources: list[Source], add: packed.Add, what: str) -> None:
            progress = Progress(stream, what, _size(from_sources))

            def document(ids: list[int], nbytes: int) -> None:
                add("a document", ids, np.ones(len(ids), dtype=np.uint8), nbytes)

            encode(
                tokenizer,
                from_sources,
                column,
                None,
                dtype,
                eot_id,
                batch_bytes,
                progress,
                sink=document,
            )

        return packed.write_splits(
            meta, val_fraction, train_sources, val_sources, partial, index_path, feed, True
        )
    with open(partial["train.bin"], "wb") as f, open(index_path, "wb") as index:
        progress = Progress(stream, "tokenizing", _size(train_sources))
        index_or_none = None if val_sources else index
        train = encode(
            tokenizer, train_sources, column, f, dtype, eot_id, batch_bytes, progress, index_or_none
        )
        sync(f)
    if not val_sources:
        lengths = token_bytes(tokenizer)
        val = hold_out(
            partial["train.bin"],
            partial["val.bin"],
            index_path,
            train,
            val_fraction,
            dtype,
            lengths,
        )
        return {"train": train, "val": val}
    with open(partial["val.bin"], "wb") as f:
        progress = Progress(stream, "tokenizing --val", _size(val_sources))
        val = encode(tokenizer, val_sources, column, f, dtype, eot_id, batch_bytes, progress)
        sync(f)
    return {"train": train, "val": val}


def _size(from_sources: list[Source]) -> int:
    return sum(s.size for s in from_sources)


def _same_file(a: str, b: str) -> bool:
    return os.path.exists(b) and os.path.samefile(a, b)


def summary(out: str, meta: dict[str, Any]) -> str:
    tokens, size = meta["tokens"], meta["bytes"]
    total = tokens["train"] + tokens["val"]
    line = (
        f"wrote {out}: train.bin {tokens['train']:,} tokens, val.bin {tokens['val']:,} tokens "
        f"({meta['dtype']}, vocabulary {meta['vocab_size']:,}, end-of-text id "
        f"{meta['eot_id']}), "
    )
    if "counted" not in meta:
        return line + f"{(size['train'] + size['val']) / max(1, total):.2f} bytes per token"
    counted, layout = meta["counted"], meta["packed"]
    padding = sum(layout["padding"].values())
    return line + (
        f"{meta['documents']['train'] + meta['documents']['val']:,} "
        f"{'conversations' if 'chat' in meta else 'documents'} packed in windows of "
        f"{layout['seq_len']} ({padding / total:.1%} padding); the masks count "
        f"{(counted['train'] + counted['val']) / total:.1%} of the tokens ({meta['mask']})"
    )
