"""`dtrain tokenize --chat`: conversations rendered with the tokenizer's chat template into token
files and loss masks that count the assistant's replies alone.

Finding the replies. Most chat templates mark nothing as the assistant's (no `{% generation %}`
blocks), so each conversation is rendered whole and again up to each assistant message i:
messages[:i] with the generation prompt (the header a model is given before it replies) and
messages[:i+1]. The tokens the second adds to the first are the reply and what the template
puts after it. Both must tokenize to a start of the whole conversation's tokens, or the
template cannot be read this way (one line naming the row). Of what follows the reply, the
template's text after its last special token (the newline after `<|im_end|>`) is not counted;
the end-of-turn token is, so that the model learns to stop. The ids are apply_chat_template's.

Windows. Conversations are laid out in blocks of `--seq-len` tokens, as many whole ones as
fit, the rest padded with the end-of-text id (never counted); each split ends with one more pad
token, so that block k is exactly window k of `data.name: tokens` (windows of seq_len + 1 tokens
every seq_len tokens). A conversation is thus whole in one window and each reply is predicted
from all of the conversation before it; one longer than a block is one line naming its row.
The held-out part is the last `--val-fraction` of the blocks.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, BinaryIO, TextIO

import numpy as np

from dtrain.commands.tokenize.conversations import Conversation, conversations
from dtrain.commands.tokenize.inputs import Source
from dtrain.commands.tokenize.output import Progress, Split, move_tail, sync
from dtrain.core.errors import UserError, first_line
from dtrain.core.imports import require
from dtrain.files import names

SEQ_LEN = 256  # the window data.tokens cuts when neither it nor the model says otherwise
TEMPLATE_FILE = "chat_template.jinja"
COUNTED = "the assistant's replies, each with the end-of-turn token after it"
BYTES_COUNTED = (
    "UTF-8 bytes of the assistant's replies (their messages' content), plus 1 for each "
    "reply's end of turn"
)
# Blocks held before they are written: memory stays small, writes stay large.
_BLOCKS_PER_WRITE = 256


def load_tokenizer(folder: str) -> Any:
    """The model folder's tokenizer (transformers', offline), which must have a chat template."""
    transformers = require("transformers", "transformers", "dtrain tokenize --chat")
    if not os.path.isdir(folder):
        raise UserError(
            f"usage error: --chat needs --tokenizer MODEL_DIR, a folder with the tokenizer and "
            f"its chat template, not the file {folder}"
        )
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(folder, local_files_only=True)
    except Exception as e:  # noqa: BLE001 - transformers raises many kinds for a bad folder
        raise UserError(
            f"input error: --tokenizer: cannot load the tokenizer in {folder} ({first_line(e)})"
        ) from None
    if not getattr(tokenizer, "chat_template", None):
        raise UserError(
            f"input error: --chat: the tokenizer in {folder} has no chat template (neither "
            f"tokenizer_config.json's chat_template nor a {TEMPLATE_FILE}); add one, or "
            f"tokenize plain text without --chat"
        )
    return tokenizer


def meta_of(folder: str, tokenizer: Any, seq_len: int) -> dict[str, Any]:
    """What meta.json says of the conversations' layout and the template that rendered them."""
    own_file = os.path.isfile(os.path.join(folder, TEMPLATE_FILE))
    return {
        "seq_len": seq_len,
        "template_from": TEMPLATE_FILE if own_file else "tokenizer_config.json",
        "template": tokenizer.chat_template,
    }


class Replies:
    """A conversation's token ids (those apply_chat_template gives), a uint8 mask of those that
    count (the assistant's replies, as the module's docstring says), and the replies' bytes."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        decoder = tokenizer.added_tokens_decoder
        self.special = {i for i, token in decoder.items() if token.special}

    def _render(self, conversation: Conversation, upto: int, prompt: bool) -> str:
        try:
            return self.tokenizer.apply_chat_template(
                conversation.messages[:upto], tokenize=False, add_generation_prompt=prompt
            )
        except Exception as e:  # noqa: BLE001 - a template raises what it likes (raise_exception)
            raise UserError(
                f"input error: {conversation.where}: the chat template refuses the "
                f"conversation ({first_line(e)})"
            ) from None

    def __call__(self, conversation: Conversation) -> tuple[list[int], np.ndarray, int]:
        messages = conversation.messages
        replies = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        texts = [self._render(conversation, len(messages), False)]
        for i in replies:
            # Before a first message there is nothing to render (the template needs messages).
            texts += [self._render(conversation, i, True) if i else ""]
            texts += [self._render(conversation, i + 1, False)]
        whole, *parts = self.tokenizer(texts, add_special_tokens=False)["input_ids"]
        mask = np.zeros(len(whole), dtype=np.uint8)
        nbytes = 0
        for k, i in enumerate(replies):
            before, through = parts[2 * k], parts[2 * k + 1]
            start, end = len(before), len(through)
            if end < start or whole[:start] != before or whole[:end] != through:
                raise UserError(
                    f"input error: {conversation.where}: the chat template does not render the "
                    f"conversation up to message {i + 1} (assistant) as the start of the whole "
                    f"conversation, so its reply's tokens cannot be found; --chat cannot read "
                    f"conversations with this template"
                )
            ends = [j for j in range(start, end) if whole[j] in self.special]
            mask[start : ends[-1] + 1 if ends else end] = 1
            nbytes += len(messages[i]["content"].encode("utf-8")) + 1
        # A conversation's first token would be predicted from what precedes it in its window:
        # padding, or another conversation.
        mask[:1] = 0
        return whole, mask, nbytes


class Blocks:
    """Conversations laid out in blocks of `size` tokens, written to a token file and its mask;
    `index` receives, at the end of each block, the int64 triple (tokens counted, bytes,
    conversations) so far: where a held-out cut finds its figures."""

    def __init__(
        self,
        tokens: BinaryIO,
        mask: BinaryIO,
        index: BinaryIO | None,
        size: int,
        dtype: np.dtype,
        pad_id: int,
    ) -> None:
        self.tokens, self.mask, self.index = tokens, mask, index
        self.size, self.dtype, self.pad_id = size, dtype, pad_id
        self.split = Split()
        self.fill = 0  # tokens in the open block
        self.ids: list[np.ndarray] = []
        self.flags: list[np.ndarray] = []
        self.blocks: list[tuple[int, int, int]] = []  # the index rows not written yet

    def add(self, where: str, ids: list[int], mask: np.ndarray, nbytes: int) -> None:
        if len(ids) > self.size:
            raise UserError(
                f"input error: {where}: the conversation is {len(ids)} tokens, longer than a "
                f"window of --seq-len {self.size}; raise --seq-len (and train with "
                f"data.tokens.seq_len a multiple of it), or leave the conversation out"
            )
        if self.fill + len(ids) > self.size:
            self._close()
        self.ids.append(np.asarray(ids, dtype=self.dtype))
        self.flags.append(mask)
        self.fill += len(ids)
        split = self.split
        split.counted += int(mask.sum())
        split.bytes += nbytes
        split.documents += 1

    def _close(self) -> None:
        """Pad the open block to its size."""
        pad = self.size - self.fill
        self.ids.append(np.full(pad, self.pad_id, dtype=self.dtype))
        self.flags.append(np.zeros(pad, dtype=np.uint8))
        self.fill = 0
        split = self.split
        split.tokens += self.size
        self.blocks.append((split.counted, split.bytes, split.documents))
        if len(self.blocks) >= _BLOCKS_PER_WRITE:
            self._write()

    def _write(self) -> None:
        self.tokens.write(np.concatenate(self.ids).tobytes())
        self.mask.write(np.concatenate(self.flags).tobytes())
        if self.index is not None:
            self.index.write(np.asarray(self.blocks, dtype=np.int64).tobytes())
        self.ids, self.flags, self.blocks = [], [], []

    def finish(self) -> Split:
        if self.fill:
            self._close()
        if self.blocks:
            self._write()
        sync(self.tokens)
        sync(self.mask)
        return self.split


def write_splits(
    tokenizer: Any,
    meta: dict[str, Any],
    val_fraction: float,
    train_sources: list[Source],
    val_sources: list[Source],
    column: str,
    partial: dict[str, str],
    index_path: str,
    stream: TextIO,
) -> dict[str, Split]:
    """train.bin, val.bin and their masks, under their .partial names, complete and synced, in
    the dtype, the block size and with the pad id that `meta` gives."""
    replies = Replies(tokenizer)
    size = meta["chat"]["seq_len"]

    def write(split: str, from_sources: list[Source], what: str, index: BinaryIO | None) -> Split:
        tokens_file = names.token_file(split)
        with (
            open(partial[tokens_file], "wb") as tokens,
            open(partial[names.loss_mask(tokens_file)], "wb") as mask,
        ):
            blocks = Blocks(tokens, mask, index, size, np.dtype(meta["dtype"]), meta["eot_id"])
            _encode(
                from_sources,
                column,
                replies,
                blocks.add,
                Progress(stream, what, _size(from_sources)),
            )
            return blocks.finish()

    with open(index_path, "wb") as index:
        train = write("train", train_sources, "tokenizing", None if val_sources else index)
    if val_sources:
        val = write("val", val_sources, "tokenizing --val", None)
    else:
        val = _hold_out(partial, index_path, train, val_fraction, size, np.dtype(meta["dtype"]))
    if not train.counted:
        raise UserError(
            "input error: the training conversations hold no assistant reply: nothing to learn"
        )
    if not val.counted:
        held_out = "the --val inputs" if val_sources else "the held-out last conversations"
        raise UserError(
            f"input error: the validation conversations ({held_out}) hold no assistant reply "
            f"to evaluate the loss on; give --val inputs with replies"
        )
    for split, written in (("train", train), ("val", val)):
        _end(partial, split, written, np.dtype(meta["dtype"]), meta["eot_id"])
    return {"train": train, "val": val}


def _encode(
    from_sources: list[Source],
    column: str,
    replies: Replies,
    add: Callable[[str, list[int], np.ndarray, int], None],
    progress: Progress,
) -> None:
    """Each source's conversations, rendered and handed to `add` in order."""
    found = {s.input: 0 for s in from_sources}
    for source in from_sources:
        for conversation in conversations(source, column):
            ids, mask, nbytes = replies(conversation)
            add(conversation.where, ids, mask, nbytes)
            found[source.input] += 1
            progress.count(conversation.advance, conversation.nbytes, len(ids))
    for given, count in found.items():
        if not count:
            raise UserError(f"input error: '{given}' has no conversations")
    progress.finish()


def _hold_out(
    partial: dict[str, str],
    index_path: str,
    train: Split,
    fraction: float,
    size: int,
    dtype: np.dtype,
) -> Split:
    """Move the last `fraction` of the blocks (at least one) into val.bin and its mask."""
    marks = np.memmap(index_path, dtype=np.int64, mode="r").reshape(-1, 3)  # searched, not read
    blocks = len(marks)
    keep = blocks - max(1, int(blocks * fraction))
    if keep < 1:
        raise UserError(
            f"input error: the conversations fill {blocks} window(s) of --seq-len {size}: too "
            f"few to hold out a validation part; add conversations or give --val inputs"
        )
    counted, nbytes, documents = (int(x) for x in marks[keep - 1])
    del marks
    train_file, val_file = names.token_file("train"), names.token_file("val")
    move_tail(partial[train_file], partial[val_file], keep * size * dtype.itemsize)
    move_tail(partial[names.loss_mask(train_file)], partial[names.loss_mask(val_file)], keep * size)
    val = Split(
        train.tokens - keep * size,
        train.bytes - nbytes,
        train.documents - documents,
        counted=train.counted - counted,
    )
    train.tokens, train.bytes, train.documents = keep * size, nbytes, documents
    train.counted = counted
    return val


def _end(partial: dict[str, str], split: str, written: Split, dtype: np.dtype, pad_id: int) -> None:
    """The pad token that ends a split: its last block's window needs one token past it."""
    tokens_file = names.token_file(split)
    with open(partial[tokens_file], "ab") as tokens:
        tokens.write(np.array([pad_id], dtype=dtype).tobytes())
        sync(tokens)
    with open(partial[names.loss_mask(tokens_file)], "ab") as mask:
        mask.write(b"\0")
        sync(mask)
    written.tokens += 1


def _size(from_sources: list[Source]) -> int:
    return sum(s.size for s in from_sources)
