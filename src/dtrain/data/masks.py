"""Loss masks beside token files (`train.mask` by `train.bin`, `train_003.mask` by
`train_003.bin`), as `dtrain tokenize --chat` and `--pack` write them: one byte per token, of
two flags (names.MASK_*). COUNTED (1): the token counts as a target of the loss (the
assistant's replies). STARTS (2): the token begins a document (a conversation, or a run of
padding), which attends to nothing before it: a packed window's documents never see each
other. A folder without masks is read as before: every token counts, and attention is causal
over the whole window.

The windows of a masked folder carry their mask (a batch is the pair (tokens, mask)), which the
`language_model` task applies to the targets, and from which it restarts the positions at each
document's first token (models see the boundaries as Hugging Face's packed sequences do).
This module finds the masks and checks them against the token files, says what share of the
tokens they count, and checks that the windows keep whole the documents that `tokenize --chat`
or `--pack` laid out in blocks of its `--seq-len`.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from dtrain.core.errors import UserError
from dtrain.files import names
from dtrain.files.digests import file_digest

if TYPE_CHECKING:
    from dtrain.data.windows import Span

# How many mask bytes are counted at a time, for a folder whose meta.json does not say.
_COUNT_CHUNK = 1 << 24
_FLAGS = names.MASK_COUNTED | names.MASK_STARTS  # every other bit of a mask byte is undefined


def on_disk(path: str) -> bool:
    """Whether a token folder's file (a token file, a mask, meta.json) is there on a disk; one
    that is there but is no regular file (a device such as /dev/zero behind a link, a folder,
    a dangling link) is an error naming it, not a file that is missing."""
    if os.path.isfile(path):
        return True
    if not os.path.lexists(path):
        return False
    what = "a dangling link" if not os.path.exists(path) else "a folder or a device"
    raise UserError(
        f"data error: {path} is not a regular file ({what}); a token folder holds files of "
        f"token ids, masks and meta.json"
    )


def find(root: str, files: dict[str, list[str]], listed: Any) -> dict[str, list[str]]:
    """The masks of each split's token files (paths, or URLs in a store whose names are
    `listed`); none for a folder without masks. Masks for one split alone are an error."""
    found = {split: _beside(root, split, paths, listed) for split, paths in files.items()}
    masks = {split: paths for split, paths in found.items() if paths is not None}
    if masks and len(masks) < len(found):
        bare = next(split for split in found if split not in masks)
        raise UserError(
            f"data error: {root} holds loss masks for its {next(iter(masks))} files but not "
            f"for its {bare} files ({names.loss_mask(names.token_file(bare))}); a folder is "
            f"masked throughout or not at all"
        )
    return masks


def _beside(root: str, split: str, token_paths: Sequence[str], listed: Any) -> list[str] | None:
    """The masks of a split's token files, or None when the split has none."""
    masks = [
        os.path.join(os.path.dirname(p), names.loss_mask(os.path.basename(p)))
        if listed is None
        else f"{p.rpartition('/')[0]}/{names.loss_mask(p.rpartition('/')[2])}"
        for p in token_paths
    ]
    present = [on_disk(m) if listed is None else m.rpartition("/")[2] in listed for m in masks]
    if not any(present):
        return None
    if not all(present):
        missing = masks[present.index(False)]
        raise UserError(
            f"data error: {missing} not found: {root} holds loss masks beside other {split} "
            f"files, and a masked folder needs one beside every token file"
        )
    return masks


def check_sizes(tokens: Span, masks: Span, paths: Sequence[str]) -> None:
    """A mask holds one byte per token of its token file."""
    for path, size, mask_size in zip(paths, tokens.sizes, masks.sizes, strict=True):
        if size != mask_size:
            raise UserError(
                f"data error: {path} has {mask_size} bytes, but its token file holds {size} "
                f"tokens: a loss mask has one byte per token (the files come from different "
                f"runs?)"
            )


def counted(meta: dict[str, Any], split: str, masks: Span, digests: dict[str, str]) -> int:
    """The tokens a split's masks count: meta.json's `counted` (dtrain tokenize writes it) where
    meta.json's `digests` vouch for every mask of the split; otherwise (a folder made by hand,
    or an older one) the bytes with the COUNTED flag, read once, every byte checked to hold no
    flag but COUNTED and STARTS."""
    said = (meta.get("counted") or {}).get(split)
    vouched = [_matches_digest(part, digests) for part in masks.parts]
    if all(vouched) and isinstance(said, int) and not isinstance(said, bool) and said >= 0:
        return said
    total = 0
    for start in range(0, len(masks), _COUNT_CHUNK):
        chunk = np.empty(min(_COUNT_CHUNK, len(masks) - start), dtype=np.uint8)
        masks.read(start, chunk)
        undefined = np.flatnonzero(chunk & ~np.uint8(_FLAGS))
        if undefined.size:
            path, at = masks.locate(start + int(undefined[0]))
            raise UserError(
                f"data error: {path}: byte {at} is {int(chunk[undefined[0]]):#04x}, not a loss "
                f"mask's: its flags are {names.MASK_COUNTED} (counted) and {names.MASK_STARTS} "
                f"(starts a document) alone; the file is damaged, or not a mask (make the folder "
                f"again with dtrain tokenize)"
            )
        total += int(np.count_nonzero(chunk & names.MASK_COUNTED))
    return total


def _matches_digest(part: Any, digests: dict[str, str]) -> bool:
    """Whether meta.json's digest vouches for a mask: a file on a disk is hashed here (a byte
    per token: a fraction of the token files' reading); a store's shard is checked against it
    as a node copies it (data/node_copy.py), but not when read by ranged requests. False where
    meta.json has no digest of it or it is not checked; a file that differs from its digest is
    an error naming it."""
    if not isinstance(part, str):
        return bool(part.digest) and part.cache is not None
    expected = digests.get(os.path.basename(part))
    if not expected:
        return False
    if file_digest(part) != expected:
        raise UserError(
            f"data error: {part} differs from the digest meta.json holds for it (changed or "
            f"damaged since dtrain tokenize wrote the folder); make the folder again with "
            f"dtrain tokenize, or restore the file"
        )
    return True


def check_counted(counted: int, split: str, paths: Sequence[str]) -> None:
    if not counted:
        raise UserError(
            f"data error: the loss masks of {', '.join(paths)} count no token: the {split} "
            f"loss would have nothing to {'learn' if split == 'train' else 'measure'}"
        )


def packed(meta: dict[str, Any]) -> bool:
    """Whether the folder's masks mark where documents start (meta.json's `packed`, which
    `tokenize --chat` and `--pack` write)."""
    return isinstance(meta.get("packed"), dict)


def check_windows(meta: dict[str, Any], root: str, seq_len: int, stride: int) -> None:
    """Windows that keep whole the documents a `tokenize --chat` or `--pack` folder laid out in
    blocks (meta.json's `packed.seq_len`): a length and a stride that are multiples of the block
    size, so that each block lies inside one window."""
    block = (meta.get("packed") or meta.get("chat") or {}).get("seq_len")
    if not isinstance(block, int) or isinstance(block, bool) or block < 1:
        return
    for key, value in (("data.tokens.seq_len", seq_len), ("data.tokens.stride", stride)):
        if value % block:
            raise UserError(
                f"config error: {key} is {value}, but {root} lays its documents out in "
                f"windows of {block} tokens (dtrain tokenize --seq-len {block}), which "
                f"other windows would cut; set {key} to {block} or a multiple of it"
            )


def note(meta: dict[str, Any], counted: dict[str, int], spans: dict[str, Span]) -> str:
    """The banner's line: what share of each split's tokens the loss counts, and which."""
    label = {"train": "training", "val": "validation"}
    shares = " and ".join(
        f"{counted[s] / max(1, len(spans[s])):.1%} of the {label[s]} tokens" for s in counted
    )
    what = meta.get("mask") if isinstance(meta.get("mask"), str) else "the tokens the masks mark"
    starts = "; packed windows: the masks mark where each document starts" if packed(meta) else ""
    return f"loss on {shares}: {what} (the folder's loss masks){starts}"
