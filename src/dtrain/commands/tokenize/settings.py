"""What `dtrain tokenize` is asked to do (`Settings`, one field per option), and the checks of
the options together, made before any input is read."""

from __future__ import annotations

from dataclasses import dataclass

from dtrain.commands.tokenize import chat as chat_data
from dtrain.commands.tokenize.tokenizer import MAX_VOCAB, cores
from dtrain.core.errors import UserError

# The longest window --seq-len packs documents in: a block is written whole (padding included),
# and 2**24 tokens is far above any model's context; 2**40 died allocating its padding.
MAX_SEQ_LEN = 1 << 24


@dataclass(frozen=True)
class Settings:
    """The options of `dtrain tokenize` (commands/tokenize/options.py), by their names there."""

    inputs: list[str]  # files and folders; empty with `corpus`
    out: str
    vocab_size: int | None = None  # train a byte-level BPE of this many tokens
    tokenizer_path: str | None = None  # or use this tokenizer.json, or a model folder's
    corpus: str | None = None  # the built-in corpus instead of `inputs`
    val_fraction: float = 0.1  # the held-out part, without `val_inputs`
    val_inputs: list[str] | None = None
    column: str | None = None  # default: text, or with `chat` messages
    workers: int | None = None  # encoding threads; default: every core
    overwrite: bool = False
    eot: str | None = None
    chat: bool = False  # conversations, rendered with the tokenizer folder's chat template
    pack: bool = False  # documents packed whole into windows of `seq_len`
    seq_len: int | None = None
    render_timeout: float | None = None  # seconds per conversation, with `chat`
    trust_remote_code: bool = False  # a --chat folder's own tokenizer code may run

    @property
    def text_column(self) -> str:
        return self.column or ("messages" if self.chat else "text")

    @property
    def packs(self) -> bool:
        """Whether documents are packed into windows (with loss masks beside the tokens)."""
        return self.chat or self.pack


def check(settings: Settings) -> None:
    """The options together, before any input is read or anything written."""
    if settings.inputs and settings.corpus:
        raise UserError("usage error: give INPUT files or folders, or --corpus, not both")
    if not settings.inputs and not settings.corpus:
        raise UserError("usage error: give INPUT files or folders (or --corpus python_docs)")
    if settings.chat and (settings.corpus or settings.tokenizer_path is None):
        raise UserError(
            "usage error: --chat reads conversations from INPUT files with --tokenizer MODEL_DIR "
            "(the folder of the tokenizer and its chat template)"
        )
    if settings.seq_len is not None and not settings.packs:
        raise UserError(
            "usage error: --seq-len goes with --chat or --pack (plain text is cut into windows "
            "when training, by data.tokens.seq_len)"
        )
    _check_numbers(settings)
    if (settings.vocab_size is None) == (settings.tokenizer_path is None):
        raise UserError("usage error: give --vocab-size N (to train a tokenizer) or --tokenizer")
    if not settings.val_inputs and not 0 < settings.val_fraction < 1:
        raise UserError(
            f"usage error: --val-fraction must be between 0 and 1, not {settings.val_fraction}"
        )


def _check_numbers(settings: Settings) -> None:
    """The numeric flags within what can be meant, before any work: a thousand million
    --workers spent minutes starting threads on 100 KB of text."""
    vocab_size, seq_len, workers = settings.vocab_size, settings.seq_len, settings.workers
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
    render_timeout = settings.render_timeout
    if render_timeout is not None:
        if not settings.chat:
            raise UserError("usage error: --render-timeout goes with --chat")
        if not 0 < render_timeout <= chat_data.MAX_RENDER_TIMEOUT_S:
            raise UserError(
                f"usage error: --render-timeout must be above 0 and at most "
                f"{chat_data.MAX_RENDER_TIMEOUT_S:g} seconds, not {render_timeout:g}"
            )
