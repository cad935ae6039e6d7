"""Text as bytes: a UTF-8 file, a folder of `.txt` files, or the built-in corpus, cut into fixed
windows of `seq_len + 1` byte tokens (vocabulary 256: no tokenizer, nothing to download).

A window is a sample: the resumable sampler, exact evaluation and bit-exact resume hold as for
images. Training windows start every `data.text.stride` bytes (default `seq_len`: consecutive
windows share one byte); validation windows every `seq_len` bytes, so each validation byte is
predicted once.

Where the validation text comes from: `<root>/train.txt` + `<root>/val.txt`, or `<root>/train/`
+ `<root>/val/` folders of `.txt` files; otherwise the last `data.text.val_fraction` of the text
(a file, or a folder's `.txt` files in name order) is held out.

Files are memory-mapped (a folder's files read as one sequence, a newline between two files), as
token files are (data/tokens.py): no rank copies the corpus into its memory.
"""

from __future__ import annotations

import os

import numpy as np
import torch

from dtrain.config import DataConfig
from dtrain.core.errors import UserError
from dtrain.data.loaders import Datasets
from dtrain.data.windows import Span, Windows, count_windows, sampled

VOCAB_SIZE = 256
DEFAULT_SEQ_LEN = 256
NEWLINE = 10  # between two files of a folder


def seq_len_of(cfg: DataConfig, model_args: dict | None = None) -> int:
    """The window's length: data.tokens.seq_len for token files, data.text.seq_len for text,
    else the model's seq_len, else 256."""
    own = cfg.tokens.seq_len if cfg.name == "tokens" else cfg.text.seq_len
    return own or int((model_args or {}).get("seq_len") or DEFAULT_SEQ_LEN)


def python_docs() -> bytes:
    """The built-in corpus: the Python documentation text that every CPython ships
    (`pydoc_data.topics`, about 465 KB of English prose and code), in topic order."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[name] for name in sorted(topics)).encode("utf-8")


def _text_files(path: str) -> list[str]:
    """A file itself, or the .txt files of a folder in name order."""
    if os.path.isfile(path):
        return [path]
    if not os.path.isdir(path):  # a device (/dev/zero), a pipe, a socket: never read
        raise UserError(
            f"data error: '{path}' is neither a file nor a folder (a device, a pipe or a "
            f"socket); set data.root to a UTF-8 text file or a folder of .txt files"
        )
    return sorted(
        os.path.join(path, n)
        for n in os.listdir(path)
        if n.endswith(".txt") and os.path.isfile(os.path.join(path, n))
    )


def _text(path: str) -> Span:
    """The text at `path` as one memory-mapped byte sequence: a file, or a folder's .txt files
    in name order with a newline between consecutive files."""
    files = _text_files(path)
    if not files:
        raise UserError(f"data error: no .txt files in '{path}'; put UTF-8 text files there")
    return Span(files, np.uint8, separator=NEWLINE)


def _sources(root: str) -> tuple[str, str | None]:
    """The training text and the validation text under `root` (train.txt and val.txt, or train/
    and val/), or `root` alone and None: the validation text is then its last part."""
    if not os.path.exists(root):
        raise UserError(
            f"data error: text not found at '{root}': set data.root to a UTF-8 file "
            f"or a folder of .txt files (or data.text.corpus=python_docs)"
        )
    for train_name, val_name in (("train.txt", "val.txt"), ("train", "val")):
        train_path, val_path = os.path.join(root, train_name), os.path.join(root, val_name)
        if os.path.isdir(root) and os.path.exists(train_path) and os.path.exists(val_path):
            return train_path, val_path
    return root, None


def _splits(cfg: DataConfig) -> tuple[Span, Span, str]:
    text = cfg.text
    if text.corpus == "python_docs":
        corpus = np.frombuffer(python_docs(), dtype=np.uint8)
        train, val = _held_out(Span([corpus], np.uint8), text.val_fraction)
        return train, val, f"the built-in corpus (Python documentation, {corpus.size} bytes)"
    train_path, val_path = _sources(cfg.root)
    if val_path is not None:
        return _text(train_path), _text(val_path), f"{train_path} and {val_path}"
    train, val = _held_out(_text(train_path), text.val_fraction)
    return train, val, f"{train_path} (the last {text.val_fraction:.0%} held out for validation)"


def _held_out(whole: Span, fraction: float) -> tuple[Span, Span]:
    return whole.cut(len(whole) - int(len(whole) * fraction))


def window_counts(cfg: DataConfig, seq_len: int) -> tuple[int, int]:
    """How many training and validation windows `build` makes, from the sizes of the files
    alone (for `dtrain plan`, which reads no data)."""
    train, val, _ = _splits(cfg)
    return count_windows(len(train), seq_len, cfg.text.stride or seq_len), count_windows(
        len(val), seq_len, seq_len
    )


def unigram_entropy(data: torch.Tensor) -> float:
    """Bits per byte of the text's byte frequencies: what a model that ignores context achieves."""
    counts = torch.bincount(data.long(), minlength=VOCAB_SIZE).double()
    p = counts[counts > 0] / counts.sum()
    return float(-(p * p.log2()).sum())


def build(cfg: DataConfig, seed: int) -> Datasets:
    """Train and validation windows of `seq_len_of(cfg)` (+ 1) bytes, what the model needs to
    know, and a line for the banner. The windows' order is the sampler's: `seed` is not used."""
    seq_len = seq_len_of(cfg)
    train_text, val_text, source = _splits(cfg)
    stride = cfg.text.stride or seq_len
    train = Windows(train_text, seq_len, stride)
    val = Windows(val_text, seq_len, seq_len)
    where = "data.text.corpus=python_docs" if cfg.text.corpus else cfg.root
    for name, windows in (("training", train), ("validation", val)):
        if len(windows) == 0:
            raise UserError(
                f"data error: {where}: the {name} text has {len(windows.span)} bytes, fewer "
                f"than one window of seq_len + 1 = {seq_len + 1}; add text or lower "
                f"data.text.seq_len"
            )
    info = {"vocab_size": VOCAB_SIZE, "seq_len": seq_len, "bytes_per_token": 1.0}
    sample = np.concatenate([chunk for _, chunk in sampled(val_text)])
    banner = (
        f"text from {source}: {len(train)} training windows of {seq_len + 1} bytes (stride "
        f"{stride}), {len(val)} validation windows; byte-unigram entropy of the validation "
        f"text {unigram_entropy(torch.from_numpy(sample)):.3f} bits"
    )
    return Datasets(train, val, info, [banner])
