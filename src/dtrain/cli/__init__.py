"""The `dtrain` command: train | plan | doctor | eval | generate | export | convert | verify |
runs | sweep | lighthouse | tokenize.

The command comes first; its options and `section.key=value` overrides then come in any order.
Exit codes: 0 success (also after a preemption checkpoint and for --help), 2 bad config or input
(one clear line, no traceback) and usage errors, 1 any other failure (for `verify`: a damaged
checkpoint), 130 a second Ctrl-C in training, 141 a reader of the output that has gone.

Each command's command line is in `parsers`; its handler here hands the parsed arguments to
run/ (`train`) or to commands/.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable

import dtrain
from dtrain import config
from dtrain.cli import parsers
from dtrain.core.urls import redacted

Handler = Callable[[argparse.Namespace], int]

TAKES_CONFIG = "takes its config as --config PATH"


def _train(args: argparse.Namespace) -> int:
    from dtrain import run
    from dtrain.core.errors import UserError

    args.overrides = config.overrides_only(args.overrides, "train", TAKES_CONFIG)
    config_path, overrides = args.config, args.overrides
    if args.sweep is not None:  # a sweep's trial: a SLURM array task, or --trial I
        config_path, overrides = _sweep_trial(args)
    elif args.trial is not None:
        raise UserError("usage error: --trial I goes with --sweep PATH")
    cfg = config.load(config_path, overrides)
    run.train(cfg, config_path)
    return 0


def _sweep_trial(args: argparse.Namespace) -> tuple[str | None, list[str]]:
    from dtrain.commands.sweep import folder as sweep
    from dtrain.core.errors import UserError
    from dtrain.process import slurm

    if args.config is not None:
        raise UserError("usage error: --sweep PATH takes the config from the sweep; drop --config")
    data, trial, overrides = sweep.trial_for_task(args.sweep, args.trial, os.environ)
    if os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")) == "0":
        job = slurm.job_label(os.environ.get("SLURM_JOB_ID"))
        where = f" as SLURM job {job}" if job else ""
        print(
            f"dtrain: sweep {data['name']} trial {trial['index']} {trial['name']}{where}",
            file=sys.stderr,
            flush=True,
        )
    return data["config"], [*overrides, *args.overrides]


def _sweep(args: argparse.Namespace) -> int:
    # no torch to check and launch, only to find GPUs for --nproc
    from dtrain.commands.sweep import command as sweep

    args.words = config.overrides_only(args.words, "sweep", TAKES_CONFIG)
    return sweep.main(args)


def _plan(args: argparse.Namespace) -> int:
    from dtrain.commands.plan import command as plan
    from dtrain.commands.plan import fit as plan_fit
    from dtrain.core.errors import UserError

    limit = plan_fit.parse_size(args.memory_limit) if args.memory_limit is not None else None
    cfg = config.load(args.config, config.overrides_only(args.overrides, "plan", TAKES_CONFIG))
    if limit is None and (args.grow or args.format == "json"):
        raise UserError("plan error: --grow and --format json need --memory-limit (e.g. 6GiB)")
    if limit is None:
        print(plan.report(cfg, nproc=args.nproc, nnodes=args.nnodes))
        return 0
    print(plan_fit.render(cfg, args.nproc, args.nnodes, limit, args.grow or "", args.format))
    return 0


def _doctor(args: argparse.Namespace) -> int:
    from dtrain.commands import doctor

    return doctor.main()


def _eval(args: argparse.Namespace) -> int:
    from dtrain.commands.evaluate import command as evaluate_cmd

    return evaluate_cmd.main(args)


def _generate(args: argparse.Namespace) -> int:
    from dtrain.commands.generate import command as generate

    return generate.main(args)


def _export(args: argparse.Namespace) -> int:
    from dtrain.commands.export import command as export
    from dtrain.core.errors import UserError

    overrides = config.overrides_only(args.overrides, "export", "names its run as --run-dir DIR")
    quantize = None
    if args.quantize is not None:
        quantize = export.Request(
            args.quantize, args.calibration_batches, args.max_drop, args.latency
        )
    elif args.calibration_batches is not None or args.max_drop is not None:
        raise UserError("export error: --calibration-batches and --max-drop go with --quantize")
    export.main(
        args.run,
        args.checkpoint,
        args.out,
        args.format,
        args.weights,
        overrides,
        args.max_shard_size,
        args.trust_remote_code,
        quantize,
    )
    return 0


def _lighthouse(args: argparse.Namespace) -> int:
    from dtrain.commands import lighthouse

    return lighthouse.main(args)


def _convert(args: argparse.Namespace) -> int:
    from dtrain.commands import convert

    return convert.main(args)


def _verify(args: argparse.Namespace) -> int:
    # no torch: checking a run's checkpoints costs their reading only
    from dtrain.commands import verify

    return verify.main(args)


def _runs(args: argparse.Namespace) -> int:
    from dtrain.commands import runs as runs_table
    from dtrain.core.errors import UserError
    from dtrain.run import records

    if args.dir is not None and args.out_dir is not None:
        raise UserError("runs error: give the folder as DIR or as --out-dir, not both")
    if args.dir is None and args.format is None:  # the run records, as before DIR existed
        print(records.table(args.out_dir or "runs"))
        return 0
    return runs_table.main(args.dir or args.out_dir or "runs", args.format or "table")


def _tokenize(args: argparse.Namespace) -> int:
    from dtrain.commands.tokenize import main as tokenize

    return tokenize.main(args)


# Each command's handler, by the name `parsers.COMMANDS` gives its command line.
HANDLERS: dict[str, Handler] = {
    "train": _train,
    "plan": _plan,
    "doctor": _doctor,
    "eval": _eval,
    "generate": _generate,
    "export": _export,
    "verify": _verify,
    "runs": _runs,
    "sweep": _sweep,
    "lighthouse": _lighthouse,
    "convert": _convert,
    "tokenize": _tokenize,
}


def _commands() -> dict[str, tuple[argparse.ArgumentParser, Handler]]:
    """Each command's own parser and its handler, in the order `dtrain --help` lists them."""
    return {name: (parsers.parser(name), HANDLERS[name]) for name in parsers.COMMANDS}


def _top_parser(
    commands: dict[str, tuple[argparse.ArgumentParser, Handler]],
) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dtrain",
        description="Train PyTorch models with DDP or "
        "FSDP from a YAML config, under torchrun, SLURM or alone.",
        epilog="'dtrain COMMAND --help' describes a command's options.",
    )
    parser.add_argument("--version", action="version", version=f"dtrain {dtrain.__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (command_parser, _) in commands.items():
        sub.add_parser(name, help=command_parser.description, add_help=False)
    return parser


def parse(argv: list[str]) -> tuple[Handler, argparse.Namespace]:
    """The command's handler and its arguments. The first word that is not an option names the
    command; what follows it is the command's, options and overrides in any order. argparse
    exits (SystemExit) for --help and for usage errors."""
    commands = _commands()
    end = next((i + 1 for i, arg in enumerate(argv) if not arg.startswith("-")), len(argv))
    name = _top_parser(commands).parse_args(argv[:end]).command
    parser, handler = commands[name]
    return handler, parser.parse_intermixed_args(argv[end:])


def _print_error(message: str, exit_code: int, every_rank: bool = False) -> None:
    """One line on stderr. Under torchrun every rank meets the same config error, so only rank
    0 prints it; a lost peer is seen differently by each rank, so each says what it saw. A URL
    in it shows no userinfo (a config value quoted by a type error, a library's message)."""
    message = redacted(message)
    rank = os.environ.get("RANK", "0")
    if rank == "0":
        print(f"dtrain: {message}", file=sys.stderr, flush=True)
    elif every_rank:
        print(f"dtrain: [rank {rank}] {message}", file=sys.stderr, flush=True)
    else:
        # torchrun stops the other workers as soon as one fails: leave rank 0 the time it
        # needs to print the line (and to be the root cause torchrun reports). It stops its
        # loader workers first, which took over a second on a loaded machine. A SIGTERM from
        # torchrun meanwhile ends this rank with the error's own code, not as killed (-15).
        signal.signal(signal.SIGTERM, lambda *_: os._exit(exit_code))
        time.sleep(3.0)


def _exit_code(stop: SystemExit) -> int:
    """The status a SystemExit asks for, as the interpreter would make it (os._exit skips that):
    None is 0, an int itself, anything else is printed and is 1."""
    if stop.code is None or isinstance(stop.code, int):
        return stop.code or 0
    print(stop.code, file=sys.stderr)
    return 1


def _run(handler: Handler, args: argparse.Namespace) -> int:
    from dtrain.core.errors import CheckpointError, PeerFailure, TrainingStopped, UserError

    try:
        return handler(args)
    except (UserError, TrainingStopped, CheckpointError) as e:
        _print_error(str(e), e.exit_code)
        return e.exit_code
    except PeerFailure as e:
        _print_error(str(e), e.exit_code, every_rank=True)
        return e.exit_code


def main(argv: list[str] | None = None) -> int:
    try:
        handler, args = parse(sys.argv[1:] if argv is None else argv)
    except SystemExit as stop:  # argparse has printed the help (0) or the usage error (2)
        return _exit_code(stop)
    if handler not in (_train, _eval, _generate):  # the other commands need no torch to start
        return _run(handler, args)
    # Under torchrun, a failed rank's error goes to the file the agent reports from. `record`
    # hands back None where the command raised SystemExit(0).
    from torch.distributed.elastic.multiprocessing.errors import record

    return record(_run)(handler, args) or 0


def entry(argv: list[str] | None = None) -> None:
    """Run the command and leave with its exit code, skipping the interpreter's teardown.

    After a complete run, a native destructor of torch's process-group code sometimes aborts the
    process at interpreter exit ("terminate called without an active exception", SIGABRT), which
    would mark a finished run (and its SLURM job) as failed. Everything a run owns is closed
    explicitly before `main` returns (checkpoint thread, loaders, records, process group), so
    dtrain flushes what is buffered and ends with os._exit, where no such destructor runs."""
    try:
        code = main(argv)
    except SystemExit as stop:  # a command that calls sys.exit
        code = _exit_code(stop)
    except BrokenPipeError:  # `dtrain plan | head`: the reader has gone; end quietly, as Unix
        code = 128 + signal.SIGPIPE  # tools do (a shell reports their SIGPIPE so)
    except BaseException:  # noqa: BLE001 - a bug: show it as Python would, then exit 1
        traceback.print_exc()
        code = 1
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)
