"""Each `dtrain` command's command line: its parser, options and help texts, one function per
command. Every command's parser is built for every command line (argparse parses intermixed
options and positionals only for a parser without subcommands): nothing here imports more than
argparse."""

from __future__ import annotations

import argparse
from collections.abc import Callable

from dtrain.commands.export.formats import FORMATS as EXPORT_FORMATS
from dtrain.commands.export.formats import QUANTIZE_SCHEMES
from dtrain.commands.tokenize import options as tokenize_options
from dtrain.core.imports import TRUST_HELP, TRUST_SWITCH

RUN_DIR_HELP = "the run directory (or DIR alone); --run is the same outside torchrun"
WEIGHTS = ("model", "ema")
WEIGHTS_HELP = "the trained weights (default) or their moving average (train.ema)"

# Said by the commands that read runs and checkpoints (and write outputs) where they lie: what
# each takes that may be in an object store.
IN_A_STORE = {
    "eval": "A run directory or checkpoint",
    "generate": "A run directory or checkpoint",
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
# The commands that read code others may have named (a model folder's, a dataset's).
READ_CODE = ("eval", "generate", "export", "tokenize")


def _with_config(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="YAML config file (defaults apply without one)")
    parser.add_argument(
        "overrides", nargs="*", metavar="section.key=value", help="config keys, e.g. optim.lr=0.05"
    )


def _train(p: argparse.ArgumentParser) -> None:
    _with_config(p)
    p.add_argument("--sweep", metavar="PATH", help="run a trial of this sweep.yaml (or folder)")
    p.add_argument(
        "--trial", type=int, metavar="I", help="with --sweep: trial I (default: SLURM's array task)"
    )


def _plan(p: argparse.ArgumentParser) -> None:
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


def _doctor(p: argparse.ArgumentParser) -> None:
    """No options."""


def _eval(p: argparse.ArgumentParser) -> None:
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
    p.add_argument(
        "--profile",
        action="store_true",
        help="run the evaluation under the torch profiler: print its top operators, the share "
        "of time spent waiting for data and in host-device copies, whether int8 quantization "
        "can help, and write a trace for TensorBoard (each rank its own)",
    )
    p.add_argument(
        "--profile-dir",
        metavar="DIR",
        help="with --profile: where the traces go (default: the run's profile/ folder; for a "
        "run in an object store, ./profile/<run name> on this machine)",
    )
    p.add_argument(
        "--tasks",
        metavar="FILE_OR_DIR[,...]",
        help="score the model on language-model tasks instead of the validation split: "
        "lm-eval task files (YAML) with local data, or folders of them (the 'tasks' extra); "
        "results as task_<name>_<metric>",
    )
    p.add_argument("--config", help="YAML whose keys go over the run's config.yaml")
    p.add_argument(
        "overrides",
        nargs="*",
        metavar="[DIR] section.key=value",
        help="the run directory, and config keys over the run's (e.g. data.root=PATH)",
    )


def _generate(p: argparse.ArgumentParser) -> None:
    p.add_argument("--run-dir", "--run", dest="run", metavar="DIR", help=RUN_DIR_HELP)
    p.add_argument(
        "--checkpoint",
        default="latest",
        metavar="latest|best|PATH",
        help="the last saved (default), the best by ckpt.monitor, or a checkpoint folder",
    )
    p.add_argument("--weights", choices=WEIGHTS, default="model", help=WEIGHTS_HELP)
    prompts = p.add_mutually_exclusive_group(required=True)
    prompts.add_argument("--prompt", metavar="TEXT", help="one prompt")
    prompts.add_argument("--prompts", metavar="FILE", help="a UTF-8 file of prompts, one per line")
    prompts.add_argument(
        "--interactive", action="store_true", help="read prompts from the terminal, line by line"
    )
    p.add_argument(
        "--max-new-tokens", type=int, default=128, metavar="N", help="at most N new tokens (128)"
    )
    p.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        metavar="T",
        help="0: greedy (default); above 0: sample from softmax(logits / T)",
    )
    p.add_argument("--top-k", type=int, metavar="K", help="sample among the K likeliest tokens")
    p.add_argument(
        "--top-p", type=float, metavar="P", help="sample among the likeliest tokens of mass P"
    )
    p.add_argument(
        "--seed", type=int, default=0, help="of sampling: the same seed, the same text (0)"
    )
    p.add_argument(
        "--format",
        choices=("text", "jsonl"),
        default="text",
        help="text (default): a chat run's reply, another's prompt and continuation; jsonl: a "
        "JSON line per prompt with the token ids and why it stopped",
    )
    p.add_argument("--config", help="YAML whose keys go over the run's config.yaml")
    p.add_argument(
        "overrides",
        nargs="*",
        metavar="[DIR] section.key=value",
        help="the run directory, and config keys over the run's (e.g. data.root=PATH)",
    )


def _export(p: argparse.ArgumentParser) -> None:
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
        "--quantize",
        choices=QUANTIZE_SCHEMES,
        metavar="SCHEME",
        help="--format exported or onnx, quantized: "
        + ", ".join(QUANTIZE_SCHEMES)
        + " (the 'quant' extra); measured against full precision on the run's validation "
        "split, the figures in the run's evals/ (docs/after_training.md)",
    )
    p.add_argument(
        "--calibration-batches",
        type=int,
        metavar="N",
        help="--quantize int8-static: the training batches it calibrates on (default 16, at "
        "least 4)",
    )
    p.add_argument(
        "--max-drop",
        type=float,
        metavar="X",
        help="--quantize: the largest drop accepted, in points of accuracy (default 1) or in "
        "%% of bits per byte or loss (default 2); a larger one exits 1, nothing written",
    )
    p.add_argument(
        "--latency",
        choices=("compiled", "eager"),
        default="compiled",
        help="--quantize --format exported: time both files compiled by torch.compile "
        "(default; how int8 gains speed) or eagerly; ONNX files run under onnxruntime",
    )
    p.add_argument(
        "overrides",
        nargs="*",
        metavar="data.key=value",
        help="--format onnx, --quantize: where the run's data is read from (e.g. data.root)",
    )


def _verify(p: argparse.ArgumentParser) -> None:
    p.add_argument("path", nargs="?", metavar="PATH", help="a run, folder of runs or checkpoint")
    source = p.add_mutually_exclusive_group()
    source.add_argument(
        "--run-dir", "--run", dest="run", metavar="DIR", help="a run directory: all its checkpoints"
    )
    source.add_argument("--checkpoint", metavar="PATH", help="one checkpoint folder")


def _runs(p: argparse.ArgumentParser) -> None:
    p.add_argument("dir", nargs="?", metavar="DIR", help="a sweep folder or a run.out_dir")
    p.add_argument("--out-dir", help="the runs' run.out_dir (default runs)")
    p.add_argument("--format", choices=("table", "csv", "json"), help="(default table)")


def _sweep(p: argparse.ArgumentParser) -> None:
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


def _lighthouse(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--port", type=int, default=29510, help="the port to listen on (default 29510; 0: any)"
    )
    p.add_argument(
        "--min-groups",
        type=int,
        default=1,
        metavar="N",
        help="the fewest replica groups a quorum is made of (default 1)",
    )
    p.add_argument(
        "--heartbeat-timeout-s",
        type=float,
        default=5.0,
        metavar="S",
        help="a group silent this long is lost: the others step on without it (default 5)",
    )
    p.add_argument(
        "--join-timeout-s",
        type=float,
        default=60.0,
        metavar="S",
        help="how long a quorum waits for a live group (one that sends heartbeats) to ask for it "
        "(default 60: longer than the groups' parallel.replicas.timeout_s, the longest an "
        "exchange with a lost peer holds a live group; shorter, the groups that are behind may "
        "retake a step the others took)",
    )
    p.add_argument(
        "--exit-when-idle-s",
        type=float,
        default=0.0,
        metavar="S",
        help="stop once no group has sent a heartbeat for this long, or, before any has, for 5 "
        "minutes (default 0: never; the lighthouse a launch starts for "
        "parallel.replicas.start_lighthouse stops after 60 s)",
    )


def _convert(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checkpoint", metavar="PATH", required=True, help="a checkpoint folder")
    p.add_argument("--to", metavar="FORMAT", required=True, help="full | sharded")
    p.add_argument("--out", metavar="DIR", required=True, help="the new checkpoint's folder")


# Each command, in the order `dtrain --help` lists them: its summary and its options.
COMMANDS: dict[str, tuple[str, Callable[[argparse.ArgumentParser], None]]] = {
    "train": ("train (under torchrun, srun or as a single process)", _train),
    "plan": ("what a config will do, before launching it", _plan),
    "doctor": ("check this machine's PyTorch, devices and backends", _doctor),
    "eval": (
        "a checkpoint's metrics by the run's own evaluation, on its validation data or on "
        "other data (under torchrun, srun or as a single process); read-only but for DIR/evals/",
        _eval,
    ),
    "generate": (
        "what a checkpoint's language model says to prompts: greedy or sampled, a chat run's "
        "reply (under torchrun, srun or as a single process); read-only",
        _generate,
    ),
    "export": ("export a checkpoint's weights for use without dtrain", _export),
    "verify": (
        "check every checkpoint's files against their content digests, offline "
        "(exit 0: none damaged, 1: a checkpoint is damaged)",
        _verify,
    ),
    "runs": (
        "list past runs; with DIR (a sweep folder or a run.out_dir) or --format, compare them: "
        "one row per run, best ckpt.monitor value first",
        _runs,
    ),
    "sweep": ("many runs of a config: a grid or a random search", _sweep),
    "lighthouse": (
        "the quorum server of a run's replica groups (parallel.replicas), in the foreground",
        _lighthouse,
    ),
    "convert": (
        "a checkpoint in the other format: sharded (meta.pt + dcp/) to one checkpoint.pt, or "
        "back; the new folder resumes (ckpt.resume=DIR) and exports like the original",
        _convert,
    ),
    "tokenize": ("text into token shards for data.name=tokens", tokenize_options.add_options),
}


def parser(name: str) -> argparse.ArgumentParser:
    """The command's own parser, with its options."""
    summary, add_options = COMMANDS[name]
    command = argparse.ArgumentParser(
        prog=f"dtrain {name}",
        description=summary,
        epilog=IN_A_STORE[name] + STORE_PATHS if name in IN_A_STORE else None,
    )
    if name in READ_CODE:
        command.add_argument(TRUST_SWITCH, action="store_true", help=TRUST_HELP)
    add_options(command)
    return command
