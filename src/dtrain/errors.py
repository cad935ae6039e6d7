"""Errors that end a run with a clear one-line message instead of a traceback."""


class UserError(Exception):
    """Bad config or input: the CLI prints the message on one line and exits 2."""

    exit_code = 2


class TrainingStopped(Exception):
    """Training cannot go on (non-finite loss, too many skipped steps): exit 1 with this message."""

    exit_code = 1
