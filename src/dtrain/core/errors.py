"""Errors that end a run with a clear one-line message instead of a traceback."""


class UserError(Exception):
    """Bad config or input: the CLI prints the message on one line and exits 2."""

    exit_code = 2


class OutsideName(UserError):
    """A name read from a store or a checkpoint's marker that would reach outside the folder it
    belongs in (files/keys.py): input to refuse, never a damaged checkpoint to fall back from or
    to set aside."""


class TrainingStopped(Exception):
    """Training cannot go on (non-finite loss, too many skipped steps): exit 1 with this message."""

    exit_code = 1


class CheckpointError(Exception):
    """A save failed (disk full, no permission): exit 1, with the previous checkpoint kept."""

    exit_code = 1


class Interrupted(TrainingStopped):
    """A second Ctrl-C: the run stops at once, without its stop checkpoint: exit 130 (as a
    shell reports an interrupt) with this message, which says what was kept."""

    exit_code = 130


class PeerFailure(Exception):
    """A collective failed because another rank died or stalled: exit 1 with this message, on
    every rank that saw it (it is not the same on all ranks)."""

    exit_code = 1


def first_line(error: BaseException) -> str:
    """The first line of an error's message, or its type's name when it has none: what a
    one-line report shows of an exception."""
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
