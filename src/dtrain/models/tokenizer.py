"""A trained language model's tokenizer, as the commands that talk to it and the task evaluation
use it: an `hf:` model folder's own, else the token folder's that `dtrain tokenize` wrote beside
the tokens; a chat run's template (a prompt as a user's message, with the header the model
replies after) and what ends a reply.

`command` in each function: the name its lines begin with ("generate error: ...").
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from dtrain.config import DataConfig, ModelConfig
from dtrain.core.errors import UserError, first_line
from dtrain.core.imports import require
from dtrain.core.urls import is_url
from dtrain.data.text import VOCAB_SIZE as BYTES  # (the byte-level data's 256 tokens)
from dtrain.files import names
from dtrain.models import hf

TOKENIZER_FILE = "tokenizer.json"


@dataclass(frozen=True)
class RunTokenizer:
    """Text to the run's token ids and back; `stop_ids`: the tokens that end a reply (the
    end-of-text token; in a chat run every special token too: the end of a turn); `chat`:
    whether a prompt is rendered as a user's message with the chat template. `encode_text`:
    text's ids as they are, never rendered (`special`: whether the tokenizer adds its special
    tokens, a beginning-of-sequence token say; None: as it does by default)."""

    encode: Callable[[str], list[int]]
    decode: Callable[[list[int]], str]
    stop_ids: frozenset[int]
    chat: bool
    size: int  # the tokenizer's vocabulary, added tokens included
    where: str  # where it came from, for the log line
    encode_text: Callable[[str, bool | None], list[int]]
    bos_id: int | None = None  # the beginning-of-sequence token, where the tokenizer has one

    @property
    def pad_id(self) -> int:
        return min(self.stop_ids) if self.stop_ids else 0

    @property
    def prefix_id(self) -> int:
        """What a text is scored after when nothing comes before it: the beginning of a
        sequence, else the end of one (as the evaluation harness does)."""
        return self.bos_id if self.bos_id is not None else self.pad_id


def token_folder(data: DataConfig) -> str | None:
    """The local token folder of a `data.name: tokens` run (a mix's first), else None."""
    if data.name != "tokens":
        return None
    mix = data.tokens.mix
    root = str(mix[0]["root"]) if mix else data.root
    return None if is_url(root) else root


def run_tokenizer(data: DataConfig, model: ModelConfig, command: str) -> RunTokenizer:
    """An `hf:` model's own tokenizer where its folder has one, else the token folder's, else a
    byte-level run's bytes (data.name text); one line where the run has none of them (a run on
    images, on a dataset of its own)."""
    folder = token_folder(data)
    meta = _folder_meta(folder, command) if folder else {}
    if model.name.startswith(hf.PREFIXES):
        own = hf.resolve(model.name)
        if any(os.path.isfile(os.path.join(own, f)) for f in (TOKENIZER_FILE, "tokenizer.model")):
            return _model_tokenizer(own, meta, model.trust_remote_code, command)
    if folder and os.path.isfile(os.path.join(folder, TOKENIZER_FILE)):
        return _folder_tokenizer(folder, meta, command)
    if data.name == "text":
        return _byte_tokenizer()
    raise UserError(
        f"{command} error: the run has no tokenizer: its model ({model.name}) has no folder with "
        f"one and its data (data.name {data.name}) is not a token folder with a "
        f"{TOKENIZER_FILE} (dtrain tokenize writes one)"
    )


def _folder_meta(folder: str, command: str) -> dict[str, Any]:
    path = os.path.join(folder, names.TOKEN_META)
    try:
        with open(path, encoding="utf-8") as f:
            meta = json.load(f)
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        raise UserError(f"{command} error: cannot read {path} ({first_line(e)})") from None
    return meta if isinstance(meta, dict) else {}


def _folder_tokenizer(folder: str, meta: dict[str, Any], command: str) -> RunTokenizer:
    tokenizers = require("tokenizers", "tokens", f"dtrain {command} (the token folder's tokenizer)")
    path = os.path.join(folder, TOKENIZER_FILE)
    try:
        tokenizer = tokenizers.Tokenizer.from_file(path)
    except Exception as e:  # noqa: BLE001 - the library raises its own kinds for a bad file
        raise UserError(f"{command} error: cannot load {path} ({first_line(e)})") from None
    tokenizer.encode_special_tokens = True  # a prompt's text is text, as the documents' was
    special = {i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special}
    eot = meta.get("eot_id")
    stop = {int(eot)} if isinstance(eot, int) else set()
    template = (meta.get("chat") or {}).get("template")

    def encode_text(text: str, special_tokens: bool | None = None) -> list[int]:
        return list(tokenizer.encode(text, add_special_tokens=special_tokens is not False).ids)

    encode: Callable[[str], list[int]] = encode_text
    if template:
        transformers = require("transformers", "transformers", f"dtrain {command} (a chat run)")
        templated = transformers.PreTrainedTokenizerFast(
            tokenizer_object=tokenizer, eos_token=meta.get("eot")
        )
        templated.chat_template = template
        encode = _rendered(templated)
        stop |= special
    return RunTokenizer(
        encode,
        lambda ids: tokenizer.decode(ids, skip_special_tokens=bool(template)),
        frozenset(stop),
        bool(template),
        tokenizer.get_vocab_size(with_added_tokens=True),
        path,
        encode_text,
    )


def _byte_tokenizer() -> RunTokenizer:
    """A byte-level run's: a text's UTF-8 bytes are its tokens. There is no end-of-text token: a
    continuation ends at --max-new-tokens or the window; bytes that end inside a character are
    shown as U+FFFD."""

    def encode_text(text: str, special_tokens: bool | None = None) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(ids: list[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")

    where = "the run's bytes (data.name text: a text's UTF-8 bytes are its tokens)"
    return RunTokenizer(encode_text, decode, frozenset(), False, BYTES, where, encode_text)


def _model_tokenizer(
    folder: str, meta: dict[str, Any], trusted: bool, command: str
) -> RunTokenizer:
    transformers = require("transformers", "transformers", f"dtrain {command} (an hf: model)")
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(
            folder, local_files_only=True, trust_remote_code=trusted
        )
    except Exception as e:  # noqa: BLE001 - transformers raises many kinds for a bad folder
        raise UserError(
            f"{command} error: cannot load the tokenizer in {folder} ({first_line(e)})"
        ) from None
    chat = bool(meta.get("chat"))
    if chat and not getattr(tokenizer, "chat_template", None):
        tokenizer.chat_template = meta["chat"].get("template")
    stop = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    if isinstance(meta.get("eot_id"), int):
        stop.add(meta["eot_id"])
    if chat:
        stop |= {i for i, t in tokenizer.added_tokens_decoder.items() if t.special}

    def encode_text(text: str, special_tokens: bool | None = None) -> list[int]:
        options = {} if special_tokens is None else {"add_special_tokens": special_tokens}
        return list(tokenizer(text, **options)["input_ids"])

    return RunTokenizer(
        _rendered(tokenizer) if chat else (lambda text: encode_text(text, True)),
        lambda ids: tokenizer.decode(ids, skip_special_tokens=chat),
        frozenset(stop),
        chat,
        len(tokenizer),
        folder,
        encode_text,
        tokenizer.bos_token_id,
    )


def _rendered(tokenizer: Any) -> Callable[[str], list[int]]:
    """A prompt as the chat template renders a user's message before the model's reply."""

    def encode(text: str) -> list[int]:
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
        )
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

    return encode
