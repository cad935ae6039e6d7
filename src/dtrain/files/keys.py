"""Names that strangers write, as local paths: a key in an object store (whoever can write to a
bucket chooses it) and a file a checkpoint's marker lists (its seal finds accidents, not
tampering). Every copy out of a store and every file a marker names goes through `local_path`,
which keeps such a name inside the folder it belongs in, or refuses it before anything is
written or read. No torch.
"""

from __future__ import annotations

import os
import unicodedata

from dtrain.core.errors import OutsideName
from dtrain.core.urls import is_url


def local_path(folder: str, name: str, origin: str) -> str:
    """`name`, a '/'-separated name relative to `origin`, as a path below `folder`. `origin` is
    where the name was read: the store prefix (a URL) that holds it as a key, or the marker file
    that lists it. Refused: an absolute name, an empty, '.' or '..' part, a backslash, a control
    character (NUL included), and a path that resolves (through links already on the disk)
    outside `folder`."""
    problem = _unsafe(name)
    path = os.path.join(folder, *name.split("/"))
    if problem is None and not _inside(path, folder):
        problem = "it resolves outside through a link"
    if problem is None:
        return path
    shown = "".join(c if c.isprintable() else repr(c)[1:-1] for c in name)
    if is_url(origin):
        raise OutsideName(
            f"storage error: the store holds a key outside the run: {origin.rstrip('/')}/{shown} "
            f"({problem}); nothing was copied: delete that object, or the marker entry that "
            f"names it"
        )
    raise OutsideName(
        f"checkpoint error: {origin} lists a file outside its checkpoint: {shown} ({problem}); "
        f"nothing was read: it was not written by dtrain, name another checkpoint"
    )


def _unsafe(name: str) -> str | None:
    """What makes `name` no relative path below a folder, or None."""
    if not name:
        return "an empty name"
    if any(unicodedata.category(c) == "Cc" for c in name):
        return "a control character"
    if "\\" in name:
        return "a backslash"
    if name.startswith("/"):
        return "an absolute name"
    parts = name.split("/")
    if "" in parts:
        return "an empty part"
    odd = next((p for p in ("..", ".") if p in parts), None)
    return f"a '{odd}' part" if odd else None


def _inside(path: str, folder: str) -> bool:
    """Whether `path` resolves (links followed, as a write or a read would) below `folder`."""
    base = os.path.realpath(folder)
    real = os.path.realpath(path)
    return real != base and os.path.commonpath([real, base]) == base
