"""The `dtrain` command: train | plan | doctor | export | runs.

Exit codes: 0 success (also after a preemption checkpoint), 2 bad config or input (one clear
line, no traceback), 1 any other failure.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
import traceback
from collections.abc import Callable

from torch.distributed.elastic.multiprocessing.errors import record

from dtrain import config


def _train(args: argparse.Namespace) -> int:
    from dtrain import run

    cfg = config.load(args.config, args.overrides)
    run.train(cfg, args.config)
    return 0


def _plan(args: argparse.Namespace) -> int:
    from dtrain import plan

    cfg = config.load(args.config, args.overrides)
    print(plan.report(cfg, nproc=args.nproc, nnodes=args.nnodes))
    return 0


def _doctor(args: argparse.Namespace) -> int:
    from dtrain import doctor

    return doctor.main()


def _export(args: argparse.Namespace) -> int:
    from dtrain import export

    export.export(args.checkpoint, args.out, args.format)
    return 0


def _runs(args: argparse.Namespace) -> int:
    from dtrain import records

    print(records.table(args.out_dir))
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dtrain",
        description="Train PyTorch models with DDP or "
        "FSDP from a YAML config, under torchrun, SLURM or alone.",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    def with_config(p: argparse.ArgumentParser) -> None:
        p.add_argument("--config", help="YAML config file (defaults apply without one)")
        p.add_argument("overrides", nargs="*", metavar="section.key=value")

    p = sub.add_parser("train", help="train (under torchrun, srun or as a single process)")
    with_config(p)
    p.set_defaults(handler=_train)
    p = sub.add_parser("plan", help="what a config will do, before launching it")
    with_config(p)
    p.add_argument("--nproc", type=int, default=None, help="ranks per node (default: GPUs or 1)")
    p.add_argument("--nnodes", type=int, default=1)
    p.set_defaults(handler=_plan)
    p = sub.add_parser("doctor", help="check this machine's PyTorch, devices and backends")
    p.set_defaults(handler=_doctor)
    p = sub.add_parser("export", help="export a checkpoint's weights for use without dtrain")
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--out", required=True)
    p.add_argument(
        "--format", choices=("state_dict", "torchscript", "exported"), default="state_dict"
    )
    p.set_defaults(handler=_export)
    p = sub.add_parser("runs", help="list past runs")
    p.add_argument("--out-dir", default="runs")
    p.set_defaults(handler=_runs)
    return parser


def _print_error(message: str, every_rank: bool = False) -> None:
    """One line on stderr. Under torchrun every rank meets the same config error, so only rank
    0 prints it; a lost peer is seen differently by each rank, so each says what it saw."""
    rank = os.environ.get("RANK", "0")
    if rank == "0":
        print(f"dtrain: {message}", file=sys.stderr, flush=True)
    elif every_rank:
        print(f"dtrain: [rank {rank}] {message}", file=sys.stderr, flush=True)
    else:
        # torchrun stops the other workers as soon as one fails: leave rank 0 the moment it
        # needs to print the line (and to be the root cause torchrun reports).
        time.sleep(1.0)


@record
def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    handler: Callable[[argparse.Namespace], int] = args.handler
    from dtrain.checkpoint import CheckpointError
    from dtrain.errors import PeerFailure, TrainingStopped, UserError

    try:
        return handler(args)
    except (UserError, TrainingStopped, CheckpointError) as e:
        _print_error(str(e))
        return e.exit_code
    except PeerFailure as e:
        _print_error(str(e), every_rank=True)
        return e.exit_code


def entry(argv: list[str] | None = None) -> None:
    """Run the command and leave with its exit code, skipping the interpreter's teardown.

    After a complete run, a native destructor of torch's process-group code sometimes aborts the
    process at interpreter exit ("terminate called without an active exception", SIGABRT), which
    would mark a finished run (and its SLURM job) as failed. Everything a run owns is closed
    explicitly before `main` returns (checkpoint thread, loaders, records, process group), so
    dtrain flushes what is buffered and ends with os._exit, where no such destructor runs."""
    try:
        code = main(argv)
    except SystemExit as e:  # argparse: --help (0) and usage errors (2)
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
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
