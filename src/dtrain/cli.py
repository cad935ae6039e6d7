"""The `dtrain` command: train | plan | doctor | eval | export | convert | verify | runs | sweep |
tokenize.

The command comes first; its options and `section.key=value` overrides then come in any order.
Exit codes: 0 success (also after a preemption checkpoint and for --help), 2 bad config or input
(one clear line, no traceback) and usage errors, 1 any other failure (for `verify`: a damaged
checkpoint), 130 a second Ctrl-C in training, 141 a reader of the output that has gone.
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
from dtrain.commands.export.formats import FORMATS as EXPORT_FORMATS
from dtrain.commands.tokenize import options as tokenize_options
from dtrain.core.imports import TRUST_HELP, TRUST_SWITCH
from dtrain.core.urls import redacted

Handler = Callable[[argparse.Namespace], int]


RUN_DIR_HELP = "the run directory (or DIR alone); --run is the same outside torchrun"
WEIGHTS = ("model", "ema")
WEIGHTS_HELP = "the trained weights (default) or their moving average (train.ema)"
TAKES_CONFIG = "takes its config as --config PATH"


# Said by the commands that read runs and checkpoints (and write outputs) where they lie: what
# each takes that may be in an object store.
IN_A_STORE = {
    "eval": "A run directory or checkpoint",
    "export": "A run directory, checkpoint or --out",
    "verify": "A run directory or checkpoint",
    "runs": "DIR or --out-dir",
    "convert": "A checkpoint or --out",
}
STORE_PATHS = (
    " may be in an object store (s3://bucket/prefix, the 's3' extra): the endpoint and "
    "credentials come from the environment as for every AWS tool (AWS_ENDPOINT_URL, "
    "AWS_ACCESS_KEY_ID, AWS_PROFILE, ...); see docs/storage.md."
)


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


def _export(args: argparse.Namespace) -> int:
    from dtrain.commands.export import command as export

    overrides = config.overrides_only(args.overrides, "export", "names its run as --run-dir DIR")
    export.main(
        args.run,
        args.checkpoint,
        args.out,
        args.format,
        args.weights,
        overrides,
        args.max_shard_size,
        args.trust_remote_code,
    )
    return 0


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


def _sweep_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="YAML config file (defaults apply without one)")
    p.add_argument(
        "words",
        nargs="*",
        metavar="key=[v1,v2] | key=uniform(a,b) | key=value",
        help="a grid of values, a distribution for --random (uniform, loguniform, choice), or "
        "a fixed override for every trial",
    )
    p.add_argument(
        "--name", help="the sweep folder under run.out_dir (default: <config name>_sweep)"
    )
    p.add_argument("--nproc", type=int, metavar="N", help="ranks per trial (default: GPUs or 1)")
    p.add_argument("--random", type=int, metavar="N", help="N random trials instead of a grid")
    p.add_argument("--seed", type=int, default=0, help="the seed of --random (default 0)")
    p.add_argument("--extend", action="store_true", help="add the trials of a changed grid")
    p.add_argument("--dry-run", action="store_true", help="list the trials; write nothing")
    p.add_argument("--slurm", action="store_true", help="submit one SLURM job array")
    p.add_argument(
        "--max-parallel", type=int, metavar="K", help="--slurm: at most K trials at a time"
    )
    p.add_argument(
        "--script", metavar="PATH", help="--slurm: the batch script (default slurm/train.sbatch)"
    )
    p.add_argument(
        "--sbatch-args",
        metavar='"..."',
        help='--slurm: sbatch options, verbatim; write --sbatch-args="--time=2:00:00 ..."',
    )


def _with_config(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="YAML config file (defaults apply without one)")
    parser.add_argument(
        "overrides", nargs="*", metavar="section.key=value", help="config keys, e.g. optim.lr=0.05"
    )


def _commands() -> dict[str, tuple[argparse.ArgumentParser, Handler]]:
    """Each command's own parser (and its handler): argparse parses intermixed options and
    positionals only for a parser without subcommands."""
    commands: dict[str, tuple[argparse.ArgumentParser, Handler]] = {}

    def command(name: str, summary: str, handler: Handler) -> argparse.ArgumentParser:
        parser = argparse.ArgumentParser(
            prog=f"dtrain {name}",
            description=summary,
            epilog=IN_A_STORE[name] + STORE_PATHS if name in IN_A_STORE else None,
        )
        if name in ("eval", "export", "tokenize"):  # they read code that others may have named
            parser.add_argument(TRUST_SWITCH, action="store_true", help=TRUST_HELP)
        commands[name] = (parser, handler)
        return parser

    p = command("train", "train (under torchrun, srun or as a single process)", _train)
    _with_config(p)
    p.add_argument("--sweep", metavar="PATH", help="run a trial of this sweep.yaml (or folder)")
    p.add_argument(
        "--trial", type=int, metavar="I", help="with --sweep: trial I (default: SLURM's array task)"
    )
    p = command("plan", "what a config will do, before launching it", _plan)
    _with_config(p)
    p.add_argument("--nproc", type=int, default=None, help="ranks per node (default: GPUs or 1)")
    p.add_argument("--nnodes", type=int, default=1, help="nodes (default 1)")
    p.add_argument(
        "--memory-limit",
        metavar="SIZE",
        help="memory for the whole job on one node (all ranks, the agent, the page cache): "
        "6GiB, 6G, 512MiB or bytes; says what fits in DDP, FSDP and FSDP + activation "
        "checkpointing",
    )
    p.add_argument(
        "--grow",
        metavar="KEY",
        help="with --memory-limit: the largest value of this integer config key that fits "
        "(e.g. model.args.depth)",
    )
    p.add_argument(
        "--format",
        choices=("text", "json"),
        default="text",
        help="with --memory-limit: json for scripts (default text)",
    )
    command("doctor", "check this machine's PyTorch, devices and backends", _doctor)
    p = command(
        "eval",
        "a checkpoint's metrics by the run's own evaluation, on its validation data or on "
        "other data (under torchrun, srun or as a single process); read-only but for DIR/evals/",
        _eval,
    )
    # --run-dir, not --run: torchrun's own parser takes `--run` for a prefix of its --run-path
    # wherever it appears (`torchrun ... -m dtrain eval --run DIR` is refused); the short
    # spelling stays for single processes.
    p.add_argument("--run-dir", "--run", dest="run", metavar="DIR", help=RUN_DIR_HELP)
    p.add_argument(
        "--checkpoint",
        default="latest",
        metavar="latest|best|PATH",
        help="the last saved (default), the best by ckpt.monitor, or a checkpoint folder",
    )
    p.add_argument("--weights", choices=WEIGHTS, default="model", help=WEIGHTS_HELP)
    p.add_argument("--config", help="YAML whose keys go over the run's config.yaml")
    p.add_argument(
        "overrides",
        nargs="*",
        metavar="[DIR] section.key=value",
        help="the run directory, and config keys over the run's (e.g. data.root=PATH)",
    )
    p = command("export", "export a checkpoint's weights for use without dtrain", _export)
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument(
        "--run-dir",
        "--run",
        dest="run",
        metavar="DIR",
        help="a run directory: its newest checkpoint",
    )
    source.add_argument("--checkpoint", metavar="PATH", help="a checkpoint folder or file")
    p.add_argument(
        "--out",
        metavar="PATH",
        required=True,
        help="a new file (safetensors: or folder; hf, peft: a new folder); never over anything",
    )
    p.add_argument(
        "--format",
        choices=tuple(EXPORT_FORMATS),
        default="state_dict",
        help="onnx and safetensors need the 'export' extra, hf (a Hugging Face model's folder) "
        "the 'transformers' extra, peft (a LoRA run's adapters) the 'peft' extra; a LoRA run's "
        "other formats hold the merged model (default state_dict)",
    )
    p.add_argument("--weights", choices=WEIGHTS, default="model", help=WEIGHTS_HELP)
    p.add_argument(
        "--max-shard-size",
        metavar="SIZE",
        help="--format hf: the largest safetensors file, e.g. 500MB (default 2GB)",
    )
    p.add_argument(
        "overrides",
        nargs="*",
        metavar="data.key=value",
        help="--format onnx: where the check's validation batch is read from (e.g. data.root)",
    )
    p = command(
        "verify",
        "check every checkpoint's files against their content digests, offline "
        "(exit 0: none damaged, 1: a checkpoint is damaged)",
        _verify,
    )
    p.add_argument("path", nargs="?", metavar="PATH", help="a run, folder of runs or checkpoint")
    source = p.add_mutually_exclusive_group()
    source.add_argument(
        "--run-dir", "--run", dest="run", metavar="DIR", help="a run directory: all its checkpoints"
    )
    source.add_argument("--checkpoint", metavar="PATH", help="one checkpoint folder")
    p = command(
        "runs",
        "list past runs; with DIR (a sweep folder or a run.out_dir) or --format, compare them: "
        "one row per run, best ckpt.monitor value first",
        _runs,
    )
    p.add_argument("dir", nargs="?", metavar="DIR", help="a sweep folder or a run.out_dir")
    p.add_argument("--out-dir", help="the runs' run.out_dir (default runs)")
    p.add_argument("--format", choices=("table", "csv", "json"), help="(default table)")
    _sweep_options(command("sweep", "many runs of a config: a grid or a random search", _sweep))
    p = command(
        "convert",
        "a checkpoint in the other format: sharded (meta.pt + dcp/) to one checkpoint.pt, or "
        "back; the new folder resumes (ckpt.resume=DIR) and exports like the original",
        _convert,
    )
    p.add_argument("--checkpoint", metavar="PATH", required=True, help="a checkpoint folder")
    p.add_argument("--to", metavar="FORMAT", required=True, help="full | sharded")
    p.add_argument("--out", metavar="DIR", required=True, help="the new checkpoint's folder")
    tokenize_options.add_options(
        command("tokenize", "text into token shards for data.name=tokens", _tokenize)
    )
    return commands


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
    if handler not in (_train, _eval):  # the other commands need no torch to start
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
