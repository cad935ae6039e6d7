"""Writing a command's output files so that a failure leaves what was there: everything is
written into a hidden staging folder beside the final files (the same file system), flushed, and
only then renamed over the final names, one by one. A full disk, a read-only place or a failed
check leaves the files that were at those names as they were."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import tempfile
from collections.abc import Iterator

from dtrain.core.errors import UserError
from dtrain.files.store import fsync_dir

STAGING_PREFIX = ".dtrain-staging-"
# What to do, by command (the others write to their --out).
ADVICE = {
    "eval": "free space or make it writable",
    "train": "free space or make it writable, and launch again (the checkpoints are kept)",
    "sweep": "free space or make it writable, or choose another run.out_dir",
}
# Free space below which a failed write is taken for a full disk (a file system keeps a few
# blocks it does not hand out).
_NEARLY_FULL = 1 << 20


@contextlib.contextmanager
def staged(folder: str, command: str) -> Iterator[str]:
    """A staging folder inside `folder` (created if need be) to write the output files in,
    under their final names; when the block ends without an error, each file is flushed and
    renamed into `folder`. An OSError while writing or renaming is one line for `command`
    ('export', ...) naming the place and the reason."""
    folder = folder or "."
    try:
        os.makedirs(folder, exist_ok=True)
        stage = tempfile.mkdtemp(prefix=STAGING_PREFIX, dir=folder)
    except OSError as e:
        raise output_error(command, folder, e) from None
    try:
        try:
            yield stage
            for name in sorted(os.listdir(stage)):
                _flush(os.path.join(stage, name))
            for name in sorted(os.listdir(stage)):
                os.replace(os.path.join(stage, name), os.path.join(folder, name))
            fsync_dir(folder)
        except UserError:
            raise
        except Exception as e:  # noqa: BLE001 - a library's error for a failed write (safetensors'
            # own type, torch's RuntimeError) is told from a bug by the disk's free space
            failed = write_failure(command, folder, e)
            if failed is None:
                raise
            raise failed from None
    finally:
        shutil.rmtree(stage, ignore_errors=True)


def ordinary_mode() -> int:
    """The mode the user's umask gives a new ordinary file (0644 under umask 022)."""
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


def as_ordinary_files(path: str) -> None:
    """Give the file at `path` (for a folder, each file in it) the mode the user's umask gives
    an ordinary file. safetensors creates its files readable by their owner only, and so do the
    libraries that write through it (transformers', peft's save_pretrained): an output handed on
    to others is readable as the user's other files are. Called where a library has written,
    before any file copied from elsewhere joins it (a copy is readable by no more than its
    original)."""
    mode = ordinary_mode()
    if not os.path.isdir(path):
        os.chmod(path, mode)
        return
    for name in os.listdir(path):
        if os.path.isfile(os.path.join(path, name)):
            os.chmod(os.path.join(path, name), mode)


def what_is_at(path: str) -> str | None:
    """What is at `path`, as messages name it ('a symbolic link to T', dangling or not; 'a
    folder'; 'a file'), or None when nothing is there."""
    if os.path.islink(path):
        dangling = "" if os.path.exists(path) else ", which does not exist"
        return f"a symbolic link to {os.readlink(path)}{dangling}"
    if os.path.isdir(path):
        return "a folder"
    return "a file" if os.path.exists(path) else None


def write_failure(command: str, where: str, error: BaseException) -> UserError | None:
    """A failed write as `output_error`'s line: an OSError, or what a library raised instead of
    the OSError beneath (torch.save a RuntimeError, tokenizers a bare Exception) while the disk
    is full; None for anything else."""
    if isinstance(error, OSError):
        return output_error(command, where, error)
    existing = os.path.abspath(where)
    while not os.path.exists(existing):  # (a folder made for the output may be gone again)
        existing = os.path.dirname(existing)
    if shutil.disk_usage(existing).free <= _NEARLY_FULL:
        return output_error(command, where, OSError(errno.ENOSPC, str(error)))
    return None


def output_error(command: str, where: str, error: OSError) -> UserError:
    if error.errno == errno.ENOSPC:
        reason = "the disk is full"
    else:
        reason = error.strerror or str(error)
    advice = ADVICE.get(command, "free space or choose another --out")
    return UserError(
        f"{command} error: cannot write into {where} ({reason}); nothing there was changed: "
        f"{advice}"
    )


def _flush(path: str) -> None:
    if os.path.isdir(path):  # an output that is a folder of files (a Hugging Face model's)
        for name in os.listdir(path):
            _flush(os.path.join(path, name))
        fsync_dir(path)
        return
    with open(path, "rb+") as f:
        os.fsync(f.fileno())
