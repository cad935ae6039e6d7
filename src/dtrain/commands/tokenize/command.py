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

import json
import os
import shutil
import sys
from collections.abc import Iterator
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
from dtrain.core.errors import UserError, first_line
from dtrain.core.imports import require
from dtrain.files import names, outputs

EOT = "<|endoftext|>"
# The end-of-text tokens of common tokenizers (GPT-2 and most BPEs, Llama 3, Llama 2 and
# Mistral, Gemma), looked for in that order in a given tokenizer.json.
EOT_NAMES = (EOT, "<|end_of_text|>", "</s>", "<eos>")
TOKENIZER_FILE = "tokenizer.json"
PACKED_COUNTED = "every token but the first of each document and the padding"
UINT16_VOCAB = 1 << 16
BATCH_BYTES_PER_THREAD = 256 << 10


def cores() -> int:
    """The cores this process may use."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def threads(workers: int | None) -> int:
    """How many threads encode: --workers, else every core this process may use."""
    return workers or cores()


def use_workers(workers: int | None) -> None:
    """Size the tokenizer's thread pool. tokenizers runs encode_batch and training on rayon's
    global pool, built on first use with RAYON_NUM_THREADS threads (all cores when unset), and
    runs them on the calling thread alone when TOKENIZERS_PARALLELISM is false: so this must
    come before the tokenizer's first use."""
    if workers is None:
        return
    os.environ["RAYON_NUM_THREADS"] = str(workers)
    os.environ["TOKENIZERS_PARALLELISM"] = "true" if workers > 1 else "false"


def load_tokenizer(path: str, eot: str | None) -> tuple[Any, str]:
    """A tokenizer.json (or a model folder's: the model's own tokenizer) and its end-of-text
    token: --eot, else a folder's `eos_token` (tokenizer_config.json), else the first of
    EOT_NAMES in it."""
    tokenizers = require("tokenizers", "tokens", "dtrain tokenize")
    if os.path.isdir(path):
        eot = eot or _eos_token(path)
        folder, path = path, os.path.join(path, TOKENIZER_FILE)
        if not os.path.isfile(path):
            raise UserError(
                f"input error: --tokenizer: {folder} has no {TOKENIZER_FILE} (a fast "
                f"tokenizer's file: save the tokenizer with save_pretrained, or name the file)"
            )
    if not os.path.isfile(path):
        raise UserError(f"input error: --tokenizer: '{path}' not found")
    try:
        tokenizer = tokenizers.Tokenizer.from_file(path)
    except Exception as e:  # noqa: BLE001 - tokenizers raises a bare Exception for a bad file
        raise UserError(f"input error: {path}: not a tokenizer.json ({first_line(e)})") from None
    names = (eot,) if eot else EOT_NAMES
    found = next((n for n in names if tokenizer.token_to_id(n) is not None), None)
    if found is None:
        raise UserError(
            f"input error: {path}: no end-of-text token "
            f"({'no ' + repr(eot) if eot else 'none of ' + ', '.join(EOT_NAMES)}); "
            f"name the tokenizer's with --eot"
        )
    return tokenizer, found


def _eos_token(folder: str) -> str | None:
    """The end-of-sequence token a model folder's tokenizer_config.json names, if any."""
    try:
        with open(os.path.join(folder, "tokenizer_config.json"), encoding="utf-8") as f:
            eos = json.load(f).get("eos_token")
    except (OSError, ValueError, AttributeError):
        return None
    if isinstance(eos, dict):  # an AddedToken written out
        eos = eos.get("content")
    return eos if isinstance(eos, str) and eos else None


# The largest vocabulary trained here. The BPE trainer sizes its tables by it before it reads
# any text: 10**9 aborts in its native code. 2**24 is far above any vocabulary in use (256 K).
MAX_VOCAB = 1 << 24


# The longest window --seq-len packs documents in: a block is written whole (padding included),
# and 2**24 tokens is far above any model's context; 2**40 died allocating its padding.
MAX_SEQ_LEN = 1 << 24


def check_numbers(
    vocab_size: int | None,
    seq_len: int | None,
    workers: int | None,
    render_timeout: float | None,
    chat: bool,
) -> None:
    """The numeric flags within what can be meant, before any work: a thousand million
    --workers spent minutes starting threads on 100 KB of text."""
    if vocab_size is not None and not 257 <= vocab_size <= MAX_VOCAB:
        raise UserError(
            f"usage error: --vocab-size must be from 257 (the 256 bytes and the end-of-text "
            f"token) to {MAX_VOCAB} (2**24), not {vocab_size}"
        )
    if seq_len is not None and not 1 <= seq_len <= MAX_SEQ_LEN:
        raise UserError(
            f"usage error: --seq-len must be from 1 to {MAX_SEQ_LEN} (2**24), not {seq_len}"
        )
    if workers is not None and not 1 <= workers <= cores():
        raise UserError(
            f"usage error: --workers must be from 1 to {cores()} (the cores this process may "
            f"use), not {workers}"
        )
    if render_timeout is not None:
        if not chat:
            raise UserError("usage error: --render-timeout goes with --chat")
        if not 0 < render_timeout <= chat_data.MAX_RENDER_TIMEOUT_S:
            raise UserError(
                f"usage error: --render-timeout must be above 0 and at most "
                f"{chat_data.MAX_RENDER_TIMEOUT_S:g} seconds, not {render_timeout:g}"
            )


def train_tokenizer(texts: Iterator[str], vocab_size: int, eot: str) -> Any:
    """A byte-level BPE of `vocab_size` tokens (fewer when the text has too few pairs to merge)
    with `eot` as its one special token, trained on `texts` as they stream by. It adds no
    prefix space and decodes bytes back exactly, so decode(encode(text).ids) == text."""
    tokenizers = require("tokenizers", "tokens", "dtrain tokenize")
    byte_level = tokenizers.pre_tokenizers.ByteLevel
    tokenizer = tokenizers.Tokenizer(tokenizers.models.BPE())
    tokenizer.pre_tokenizer = byte_level(add_prefix_space=False)
    tokenizer.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[eot],
        initial_alphabet=byte_level.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer


def token_bytes(tokenizer: Any) -> np.ndarray | None:
    """Each id's length in bytes of text, where the tokenizer makes that exact (a byte-level
    model without a normalizer: a token is one character per byte); None otherwise."""
    config = json.loads(tokenizer.to_str())
    if (config.get("decoder") or {}).get("type") != "ByteLevel" or config.get("normalizer"):
        return None
    lengths = np.zeros(tokenizer.get_vocab_size(with_added_tokens=True), dtype=np.int64)
    for token, i in tokenizer.get_vocab(with_added_tokens=False).items():
        lengths[i] = len(token)
    for i, added in tokenizer.get_added_tokens_decoder().items():
        lengths[i] = 1 if added.special else len(added.content.encode("utf-8"))
    return lengths


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


def _inputs(from_sources: list[Source]) -> list[dict[str, Any]]:
    return [{"path": p, "bytes": n} for s in from_sources for p, n in s.files.items()]


def tokenize(
    inputs: list[str],
    out: str,
    *,
    vocab_size: int | None = None,
    tokenizer_path: str | None = None,
    corpus: str | None = None,
    val_fraction: float = 0.1,
    val_inputs: list[str] | None = None,
    column: str | None = None,
    workers: int | None = None,
    overwrite: bool = False,
    eot: str | None = None,
    chat: bool = False,
    pack: bool = False,
    seq_len: int | None = None,
    render_timeout: float | None = None,
    stream: TextIO | None = None,
    trust_remote_code: bool = False,
) -> dict[str, Any]:
    """Tokenize `inputs` (or the built-in `corpus`) into `out`; returns what meta.json holds.
    With `chat`, the inputs are conversations, rendered by the --tokenizer folder's chat
    template (each within `render_timeout` seconds), packed into windows of `seq_len` tokens
    and masked (commands/tokenize/chat.py); with `pack`, plain documents are packed so
    (commands/tokenize/blocks.py); a --chat folder's own tokenizer code runs only with
    `trust_remote_code`.
    Every mistake is a UserError, raised before anything is written or with everything
    written so far removed. Progress goes to `stream` (default: stderr)."""
    stream = stream or sys.stderr
    if inputs and corpus:
        raise UserError("usage error: give INPUT files or folders, or --corpus, not both")
    if not inputs and not corpus:
        raise UserError("usage error: give INPUT files or folders (or --corpus python_docs)")
    if chat and (corpus or tokenizer_path is None):
        raise UserError(
            "usage error: --chat reads conversations from INPUT files with --tokenizer MODEL_DIR "
            "(the folder of the tokenizer and its chat template)"
        )
    if seq_len is not None and not (chat or pack):
        raise UserError(
            "usage error: --seq-len goes with --chat or --pack (plain text is cut into windows "
            "when training, by data.tokens.seq_len)"
        )
    check_numbers(vocab_size, seq_len, workers, render_timeout, chat)
    column = column or ("messages" if chat else "text")
    if (vocab_size is None) == (tokenizer_path is None):
        raise UserError("usage error: give --vocab-size N (to train a tokenizer) or --tokenizer")
    if not val_inputs and not 0 < val_fraction < 1:
        raise UserError(f"usage error: --val-fraction must be between 0 and 1, not {val_fraction}")
    train_sources = corpus_sources(corpus) if corpus else sources(inputs, column, chat=chat)
    val_sources = sources(val_inputs, column, "val", chat) if val_inputs else []
    out = os.path.abspath(out)
    _check_out(out, overwrite)
    use_workers(workers)
    templated: Any = None  # with --chat: the folder's tokenizer as transformers loads it
    layout: dict[str, Any] = {}
    if tokenizer_path is not None:
        tokenizer, eot_text = load_tokenizer(tokenizer_path, eot)
        if chat:
            templated = chat_data.load_tokenizer(tokenizer_path, trust_remote_code)
            layout = chat_data.meta_of(tokenizer_path, templated)
        made_by = os.path.abspath(tokenizer_path)
        if os.path.isdir(tokenizer_path):
            tokenizer_path = os.path.join(tokenizer_path, TOKENIZER_FILE)
    else:
        assert vocab_size is not None
        eot_text = eot or EOT
        reading = Progress(stream, "reading text for the tokenizer", _size(train_sources))
        tokenizer = train_tokenizer(_texts(train_sources, column, reading), vocab_size, eot_text)
        made_by = f"byte-level BPE trained on the INPUT text with --vocab-size {vocab_size}"
    # A document's text is text even where it spells a special token, as in the files.
    tokenizer.encode_special_tokens = True
    vocab = tokenizer.get_vocab_size(with_added_tokens=True)
    meta: dict[str, Any] = {
        "dtype": "uint16" if vocab <= UINT16_VOCAB else "uint32",
        "vocab_size": vocab,
        "eot_id": tokenizer.token_to_id(eot_text),
        "eot": eot_text,
    }
    about = {
        "bytes_counted": chat_data.BYTES_COUNTED if chat else BYTES_COUNTED,
        "tokenizer": "tokenizer.json",
        "tokenizer_from": made_by,
        "val_from": "the --val inputs"
        if val_sources
        else f"the last {val_fraction:g} of the {'windows' if chat or pack else 'token stream'}",
        "val_fraction": None if val_sources else val_fraction,
        "inputs": {"train": _inputs(train_sources), "val": _inputs(val_sources)},
    }
    packs = chat or pack
    if chat:
        about["mask"] = chat_data.COUNTED
        meta["chat"] = layout
    elif pack:
        about["mask"] = PACKED_COUNTED
    if packs:
        meta["packed"] = {"seq_len": seq_len or packed.SEQ_LEN}
    created = not os.path.isdir(out)
    try:
        os.makedirs(out, exist_ok=True)
    except OSError as e:
        raise outputs.output_error("tokenize", out, e) from None
    written = [names.token_file(s) for s in names.TOKEN_SPLITS]
    if packs:
        written += [names.loss_mask(n) for n in written]
    partial = {n: os.path.join(out, n + ".partial") for n in written}
    target = os.path.join(out, "tokenizer.json")
    if tokenizer_path is None or not _same_file(tokenizer_path, target):
        partial["tokenizer.json"] = target + ".partial"
    index_path = os.path.join(out, "documents.partial")
    try:
        if "tokenizer.json" in partial:
            if tokenizer_path is None:
                tokenizer.save(partial["tokenizer.json"])
            else:
                shutil.copyfile(tokenizer_path, partial["tokenizer.json"])
        if templated is not None:
            splits = chat_data.write_splits(
                templated,
                meta,
                val_fraction,
                train_sources,
                val_sources,
                column,
                partial,
                index_path,
                stream,
                render_timeout or chat_data.RENDER_TIMEOUT_S,
            )
        else:
            splits = _write_splits(
                tokenizer,
                meta,
                val_fraction,
                train_sources,
                val_sources,
                column,
                partial,
                index_path,
                workers,
                stream,
                pack,
            )
        for key in ("tokens", "bytes", "documents", *(("counted",) if packs else ())):
            meta[key] = {name: getattr(split, key) for name, split in splits.items()}
        if packs:
            meta["packed"]["padding"] = {name: split.padding for name, split in splits.items()}
        meta.update(about)
        publish(out, partial, meta)
    except BaseException as e:
        for path in [*partial.values(), index_path, os.path.join(out, "meta.json.partial")]:
            if os.path.exists(path):
                os.remove(path)
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
    if os.path.exists(index_path):
        os.remove(index_path)
    return meta


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
    val_fraction: float,
    train_sources: list[Source],
    val_sources: list[Source],
    column: str,
    partial: dict[str, str],
    index_path: str,
    workers: int | None,
    stream: TextIO,
    pack: bool,
) -> dict[str, Split]:
    """train.bin and val.bin, under their .partial names, complete and synced, in the dtype
    and with the end-of-text id that `meta` gives; packed, with their masks."""
    dtype, eot_id = np.dtype(meta["dtype"]), meta["eot_id"]
    batch_bytes = max(1 << 20, threads(workers) * BATCH_BYTES_PER_THREAD)
    if pack:

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
