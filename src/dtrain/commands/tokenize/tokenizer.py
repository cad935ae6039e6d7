"""The tokenizer of `dtrain tokenize`: a given tokenizer.json (or a model folder's) with its
end-of-text token, or a byte-level BPE trained on the inputs; the threads it encodes on; and the
bytes of text each of its ids stands for."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

import numpy as np

from dtrain.core.errors import UserError, first_line
from dtrain.core.imports import require

EOT = "<|endoftext|>"
# The end-of-text tokens of common tokenizers (GPT-2 and most BPEs, Llama 3, Llama 2 and
# Mistral, Gemma), looked for in that order in a given tokenizer.json.
EOT_NAMES = (EOT, "<|end_of_text|>", "</s>", "<eos>")
TOKENIZER_FILE = "tokenizer.json"
# The largest vocabulary trained here. The BPE trainer sizes its tables by it before it reads
# any text: 10**9 aborts in its native code. 2**24 is far above any vocabulary in use (256 K).
MAX_VOCAB = 1 << 24


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
