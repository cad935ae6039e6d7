"""`dtrain tokenize` as the command line runs it: the arguments handed to `tokenize`, the summary
printed, and a stop signal (Ctrl-C, SIGTERM, SIGHUP) turned into one line and the shell's exit
code (130, 143, 129) once what was begun is removed."""

from __future__ import annotations

import argparse
import sys

from dtrain.commands.tokenize import command
from dtrain.commands.tokenize.settings import Settings
from dtrain.core import signals


def main(args: argparse.Namespace) -> int:
    try:
        with signals.stops_raise():
            settings = Settings(
                args.inputs,
                args.out,
                vocab_size=args.vocab_size,
                tokenizer_path=args.tokenizer,
                corpus=args.corpus,
                val_fraction=args.val_fraction,
                val_inputs=args.val,
                column=args.column,
                workers=args.workers,
                overwrite=args.overwrite,
                eot=args.eot,
                chat=args.chat,
                pack=args.pack,
                seq_len=args.seq_len,
                render_timeout=args.render_timeout,
                trust_remote_code=args.trust_remote_code,
            )
            meta = command.tokenize(settings)
    except signals.Stopped as stop:
        print(
            f"dtrain: tokenize stopped by {stop.name}: nothing written to {args.out} (the "
            f"unfinished files removed)",
            file=sys.stderr,
            flush=True,
        )
        return stop.exit_code
    print(command.summary(args.out, meta))
    return 0
