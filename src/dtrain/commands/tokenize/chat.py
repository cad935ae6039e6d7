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

Windows. Conversations are packed whole into blocks of `--seq-len` tokens (blocks.py): block k
is exactly window k of `data.name: tokens`, each reply is predicted from all of its
conversation before it and from nothing else (the masks mark where each conversation starts);
one longer than a block is one line naming its row. The held-out part is the last
`--val-fraction` of the blocks.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Callable, Iterator
from typing import Any, TextIO

import numpy as np

from dtrain.commands.tokenize import blocks as packed
from dtrain.commands.tokenize.conversations import Conversation, conversations
from dtrain.commands.tokenize.inputs import Source
from dtrain.commands.tokenize.output import Progress, Split
from dtrain.core.errors import UserError, first_line
from dtrain.core.imports import TRUST_SWITCH, refuse_folder_code, require

TEMPLATE_FILE = "chat_template.jinja"
# Rendering one conversation takes milliseconds; a template that loops for longer (two nested
# `range(100000)`, which the sandbox allows) is stopped after this long, naming its row.
RENDER_TIMEOUT_S = 10.0
MAX_RENDER_TIMEOUT_S = 24 * 3600.0
COUNTED = "the assistant's replies, each with the end-of-turn token after it"
BYTES_COUNTED = (
    "UTF-8 bytes of the assistant's replies (their messages' content), plus 1 for each "
    "reply's end of turn"
)


def load_tokenizer(folder: str, trust_remote_code: bool = False) -> Any:
    """The model folder's tokenizer (transformers', offline), which must have a chat template.
    A folder that names tokenizer code of its own is refused unless `trust_remote_code`."""
    transformers = require("transformers", "transformers", "dtrain tokenize --chat")
    if not os.path.isdir(folder):
        raise UserError(
            f"usage error: --chat needs --tokenizer MODEL_DIR, a folder with the tokenizer and "
            f"its chat template, not the file {folder}"
        )
    if not trust_remote_code:  # (a bool: transformers never asks on stdin)
        refuse_folder_code(folder, "input error: --tokenizer", TRUST_SWITCH)
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(
            folder, local_files_only=True, trust_remote_code=trust_remote_code
        )
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


def meta_of(folder: str, tokenizer: Any) -> dict[str, Any]:
    """What meta.json says of the template that rendered the conversations."""
    own_file = os.path.isfile(os.path.join(folder, TEMPLATE_FILE))
    return {
        "template_from": TEMPLATE_FILE if own_file else "tokenizer_config.json",
        "template": tokenizer.chat_template,
    }


class _TooSlow(BaseException):
    """The render's time is up (a BaseException: a template's `except Exception` on the way,
    if any, must not take it for the template's own error)."""


def _too_slow(signum: int, frame: object) -> None:
    raise _TooSlow


@contextlib.contextmanager
def _time_limit(seconds: float) -> Iterator[None]:
    """Raise _TooSlow in the code within once `seconds` have passed. Jinja renders in Python
    on this thread: a timer signal (SIGALRM, delivered to the main thread) interrupts any loop
    of a template, nested or not, whatever it iterates over; bounding `range` in the sandbox
    would leave loops over other long sequences (a string, a joined list) unbounded. Outside
    the main thread (no signal reaches it) there is no limit."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = signal.signal(signal.SIGALRM, _too_slow)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, before)


class Replies:
    """A conversation's token ids (those apply_chat_template gives), a uint8 mask of those that
    count (the assistant's replies, as the module's docstring says), and the replies' bytes.
    A conversation is refused before it is rendered when its text could not fit a `window`
    of tokens; its rendering is stopped after `timeout` seconds."""

    def __init__(self, tokenizer: Any, window: int, timeout: float) -> None:
        self.tokenizer, self.window, self.timeout = tokenizer, window, timeout
        decoder = tokenizer.added_tokens_decoder
        self.special = {i for i, token in decoder.items() if token.special}
        # No token stands for more characters of text than its own longest spelling in the
        # vocabulary has (byte-level tokens spell one character per byte, which is at most one
        # character of text): text longer than a window of those cannot fit it. (An unknown
        # token of a tokenizer without byte fallback may stand for a longer run of characters
        # it cannot spell; chat models' tokenizers fall back to bytes.) The check costs a sum
        # of lengths, where rendering and tokenizing a 20 MB conversation took minutes and
        # gigabytes before its length was known.
        self.longest = max(map(len, tokenizer.get_vocab()), default=1)

    def _check_length(self, conversation: Conversation) -> None:
        characters = sum(len(m["content"]) for m in conversation.messages)
        if characters > self.window * self.longest:
            raise UserError(
                f"input error: {conversation.where}: the conversation's text is {characters:,} "
                f"characters, more than a window of --seq-len {self.window} tokens can hold "
                f"(the tokenizer's tokens spell at most {self.longest} characters); raise "
                f"--seq-len, or leave the conversation out"
            )

    def _texts(self, conversation: Conversation, replies: list[int]) -> list[str]:
        """The whole conversation rendered, then for each reply, the conversation up to it
        (with the generation prompt) and through it."""
        messages = conversation.messages
        try:
            with _time_limit(self.timeout):
                texts = [self._render(conversation, len(messages), False)]
                for i in replies:
                    # Before a first message there is nothing to render (the template needs
                    # messages).
                    texts += [self._render(conversation, i, True) if i else ""]
                    texts += [self._render(conversation, i + 1, False)]
        except _TooSlow:
            raise UserError(
                f"input error: {conversation.where}: the chat template took more than "
                f"{self.timeout:g} s to render the conversation (a template that loops without "
                f"end?); fix the template, leave the conversation out, or raise "
                f"--render-timeout"
            ) from None
        return texts

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
        self._check_length(conversation)
        whole, *parts = self.tokenizer(
            self._texts(conversation, replies), add_special_tokens=False
        )["input_ids"]
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
    render_timeout: float,
) -> dict[str, Split]:
    """train.bin, val.bin and their masks, under their .partial names, complete and synced, in
    the dtype, the block size and with the pad id that `meta` gives."""
    replies = Replies(tokenizer, meta["packed"]["seq_len"], render_timeout)

    def feed(from_sources: list[Source], add: packed.Add, what: str) -> None:
        progress = Progress(stream, what, _size(from_sources))
        rows, replied = _encode(from_sources, column, replies, add, progress)
        if not replied:  # (said before a held-out cut finds too few windows to cut)
            inputs, use = (
                ("--val", "evaluate the loss on")
                if from_sources is val_sources
                else ("training", "learn")
            )
            raise UserError(
                f"input error: no assistant reply in the {rows:,} conversation(s) of the "
                f"{inputs} inputs: nothing to {use} (--chat counts the assistant's replies)"
            )

    splits = packed.write_splits(
        meta, val_fraction, train_sources, val_sources, partial, index_path, feed, cut_long=False
    )
    train, val = splits["train"], splits["val"]
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
    return splits


def _encode(
    from_sources: list[Source],
    column: str,
    replies: Replies,
    add: Callable[[str, list[int], np.ndarray, int], None],
    progress: Progress,
) -> tuple[int, int]:
    """Each source's conversations, rendered and handed to `add` in order; how many there
    were, and how many of them hold an assistant reply."""
    found = {s.input: 0 for s in from_sources}
    replied = 0
    for source in from_sources:
        for conversation in conversations(source, column):
            ids, mask, nbytes = replies(conversation)
            add(conversation.where, ids, mask, nbytes)
            found[source.input] += 1
            replied += any(m["role"] == "assistant" for m in conversation.messages)
            progress.count(conversation.advance, conversation.nbytes, len(ids))
    for given, count in found.items():
        if not count:
            raise UserError(f"input error: '{given}' has no conversations")
    progress.finish()
    return sum(found.values()), replied


def _size(from_sources: list[Source]) -> int:
    return sum(s.size for s in from_sources)
