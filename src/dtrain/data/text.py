"""Text as bytes: a UTF-8 file, a folder of `.txt` files, or the built-in corpus, cut into fixed
windows of `seq_len + 1` byte tokens (vocabulary 256: no tokenizer, nothing to download).

A window is a sample: the resumable sampler, exact evaluation and bit-exact resume hold as for
images. Training windows start every `data.text.stride` bytes (default `seq_len`: consecutive
windows share one byte); validation windows every `seq_len` bytes, so each validation byte is
predicted once.

Where the validation text comes from: `<root>/train.txt` + `<root>/val.txt`, or `<root>/train/`
+ `<root>/val/` folders of `.txt` files; otherwise the last `data.text.val_fraction` of the text
(a file, or a folder's `.txt` files in name order) is held out.
"""

from __future__ import annotations

import os

import torch
from torch.utils.data import Dataset

from dtrain.config import DataConfig
from dtrain.data.loaders import Datasets, Stacked
from dtrain.data.sampler import SampleKey, index_of
from dtrain.errors import UserError

VOCAB_SIZE = 256
DEFAULT_SEQ_LEN = 256


def seq_len_of(cfg: DataConfig, model_args: dict | None = None) -> int:
    """The window's length: data.text.seq_len, else the model's seq_len, else 256."""
    return cfg.text.seq_len or int((model_args or {}).get("seq_len") or DEFAULT_SEQ_LEN)


def python_docs() -> bytes:
    """The built-in corpus: the Python documentation text that every CPython ships
    (`pydoc_data.topics`, about 465 KB of English prose and code), in topic order."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[name] for name in sorted(topics)).encode("utf-8")


class ByteWindows(Dataset):
    """Windows of `seq_len + 1` bytes every `stride` bytes, as uint8 (batch, seq_len + 1)."""

    def __init__(self, data: torch.Tensor, seq_len: int, stride: int) -> None:
        self.data, self.seq_len, self.stride = data, seq_len, stride
        self.count = _windows(len(data), seq_len, stride)
        # every window as a view: one indexing operation copies out a batch
        self.windows = (
            data.unfold(0, seq_len + 1, stride) if self.count else data.view(0, seq_len + 1)
        )

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, key: SampleKey) -> torch.Tensor:
        return self.windows[index_of(key)].clone()

    def __getitems__(self, keys: list[SampleKey]) -> Stacked:
        return Stacked(self.windows[torch.tensor([index_of(k) for k in keys], dtype=torch.long)])


def _text_files(path: str) -> list[str]:
    """A file itself, or the .txt files of a folder in name order."""
    if os.path.isfile(path):
        return [path]
    return sorted(
        os.path.join(path, n)
        for n in os.listdir(path)
        if n.endswith(".txt") and os.path.isfile(os.path.join(path, n))
    )


def _read_text(path: str) -> bytes:
    files = _text_files(path)
    if not files:
        raise UserError(f"data error: no .txt files in '{path}'; put UTF-8 text files there")
    parts = []
    for name in files:
        with open(name, "rb") as f:
            parts.append(f.read())
    return b"\n".join(parts)


def _text_size(path: str) -> int:
    """The length of what _read_text returns, from the files' sizes alone."""
    files = _text_files(path)
    return sum(os.path.getsize(f) for f in files) + max(0, len(files) - 1)


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


def _splits(cfg: DataConfig) -> tuple[bytes, bytes, str]:
    text = cfg.text
    if text.corpus == "python_docs":
        data = python_docs()
        cut = len(data) - int(len(data) * text.val_fraction)
        return (
            data[:cut],
            data[cut:],
            f"the built-in corpus (Python documentation, {len(data)} bytes)",
        )
    train_path, val_path = _sources(cfg.root)
    if val_path is not None:
        return _read_text(train_path), _read_text(val_path), f"{train_path} and {val_path}"
    data = _read_text(train_path)
    cut = len(data) - int(len(data) * text.val_fraction)
    return (
        data[:cut],
        data[cut:],
        f"{train_path} (the last {text.val_fraction:.0%} held out for validation)",
    )


def _windows(size: int, seq_len: int, stride: int) -> int:
    return max(0, (size - (seq_len + 1)) // stride + 1)


def window_counts(cfg: DataConfig, seq_len: int) -> tuple[int, int]:
    """How many training and validation windows `build` makes, from the sizes of the files
    alone (for `dtrain plan`, which reads no data)."""
    stride = cfg.text.stride or seq_len
    if cfg.text.corpus == "python_docs":
        total = len(python_docs())
    else:
        train_path, val_path = _sources(cfg.root)
        if val_path is not None:
            return (
                _windows(_text_size(train_path), seq_len, stride),
                _windows(_text_size(val_path), seq_len, seq_len),
            )
        total = _text_size(train_path)
    val = int(total * cfg.text.val_fraction)
    return _windows(total - val, seq_len, stride), _windows(val, seq_len, seq_len)


def _tensor(data: bytes) -> torch.Tensor:
    return (
        torch.frombuffer(bytearray(data), dtype=torch.uint8)
        if data
        else torch.zeros(0, dtype=torch.uint8)
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
    train_bytes, val_bytes, source = _splits(cfg)
    stride = cfg.text.stride or seq_len
    train = ByteWindows(_tensor(train_bytes), seq_len, stride)
    val_data = _tensor(val_bytes)
    val = ByteWindows(val_data, seq_len, seq_len)
    for name, windows, size in (
        ("training", train, len(train_bytes)),
        ("validation", val, len(val_bytes)),
    ):
        if len(windows) == 0:
            raise UserError(
                f"data error: the {name} text has {size} bytes, fewer than one window "
                f"of seq_len + 1 = {seq_len + 1}; add text or lower data.text.seq_len"
            )
    info = {"vocab_size": VOCAB_SIZE, "seq_len": seq_len}
    banner = (
        f"text from {source}: {len(train)} training windows of {seq_len + 1} bytes (stride "
        f"{stride}), {len(val)} validation windows; byte-unigram entropy of the validation "
        f"text {unigram_entropy(val_data):.3f} bits"
    )
    return Datasets(train, val, info, [banner])
