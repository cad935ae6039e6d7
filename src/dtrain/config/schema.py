"""A config is YAML with the sections below (read with `yaml.safe_load`: tags such as
`!!python/...` are refused, and so is a key given twice); every key has a default, so a config
lists only what differs. Overrides on the command line are dotted `section.key=value` pairs whose
values are read as YAML: `optim.lr=3e-4`, `model.args={width: 32}`,
`parallel.fsdp.wrap=[BasicBlock]`.

Checking is strict and happens before any process group exists or anything is written: an unknown
key names the closest valid one (`unknown key 'optim.lrr' (did you mean 'optim.lr'?)`), a wrong
type or an out-of-range value (`.inf` or `.nan` for any number) names the key, malformed YAML
gives the file, line and column, each as one line on stderr with exit code 2. The resolved config
is written to the run directory as `config.yaml`. A loaded config is read-only (frozen
dataclasses): the code a config names (a builder, a task) gets its section as it was checked;
`dataclasses.replace` makes a changed copy.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from dtrain.config.data import DataConfig
from dtrain.config.fields import (
    AT_LEAST_ONE,
    DURATION,
    FRACTION,
    NON_NEGATIVE,
    POSITIVE,
    numbers_read,
    option,
)
from dtrain.config.log import LogConfig
from dtrain.config.model import ModelConfig
from dtrain.config.parallel import ParallelConfig
from dtrain.core.urls import is_url, join, staging_dir

# The name of a run started without a config file, a SLURM job or run.name.
DEFAULT_RUN_NAME = "default"


@dataclass(frozen=True)
class RunConfig:
    """Where a run lives and the one seed it draws from."""

    name: str | None = option(
        None,
        doc="run directory name; default: `job_<id>` under SLURM, else the config file's name "
        "(`configs/default.yaml` → `default`), else `default`",
    )
    out_dir: str = option("runs", doc="parent of all run directories")
    seed: int = option(
        0,
        check=NON_NEGATIVE,
        doc="the one seed: model init, data order, augmentation, per-rank randomness",
    )
    private: bool = option(
        False,
        doc="run directories 0700 and files 0600 (owner only); off: what the umask gives, as "
        "every file dtrain writes",
    )
    storage_options: dict = option(
        {},
        doc="for run.out_dir, ckpt.resume, model.init_from and data.root in an object store: "
        "s3fs's options beyond the environment's (e.g. `{client_kwargs: {endpoint_url: ...}}`); "
        "never credentials (AWS_ACCESS_KEY_ID, AWS_PROFILE, ...)",
    )
    staging_dir: str = option(
        "",
        doc="a run in an object store: the node-local folder for its records and checkpoint "
        "files before upload; default: a folder of the system's temporary directory",
    )
    upload_every_s: float = option(
        60.0,
        check=DURATION,
        doc="a run in an object store: seconds between uploads of its records (also at every "
        "checkpoint and at exit)",
    )
    store_timeout_s: float = option(
        45.0,
        check=DURATION,
        doc="a run in an object store: the longest one request waits for the store's answer, "
        "its retries included (a transfer also gets a second per MiB it moved); past it a save "
        "is given up (a warning, training goes on), anything else ends the run with one line",
    )


@dataclass(frozen=True)
class DistConfig:
    """The process group: backend and timeouts."""

    backend: str = option(
        "auto", choices=("auto", "nccl", "gloo"), doc="auto: nccl on CUDA, gloo on the CPU"
    )
    timeout_s: float = option(600.0, check=DURATION, doc="collective timeout while training")
    init_timeout_s: float = option(
        300.0,
        check=DURATION,
        doc="timeout of the start-up rendezvous (slow starts don't trip the training timeout)",
    )


@dataclass(frozen=True)
class TaskConfig:
    """What is learned: a loss and per-sample metrics; see [Tasks](tasks.md)."""

    name: str = option(
        "classification",
        doc="a built-in task, or a user's `module:function` called with this config",
    )
    args: dict = option(
        {}, doc="keyword arguments for a built-in task; a user's builder gets the whole task config"
    )


@dataclass(frozen=True)
class OptimConfig:
    """The optimizer, built after wrapping (under FSDP it sees only the rank's shards)."""

    name: str = option(
        "sgd",
        doc="a built-in optimizer (built fused), or a user's `module:function` called with the "
        "parameter groups and this config",
    )
    lr: float = option(0.1, check=POSITIVE, doc="the peak learning rate")
    weight_decay: float = option(5e-4, check=NON_NEGATIVE, doc="for the decayed group")
    no_decay: str | list = option(
        "auto",
        doc="parameters without weight decay: auto (biases, norm weights, embeddings) "
        "or a list of globs",
    )
    momentum: float = option(0.9, check=FRACTION, doc="sgd")
    nesterov: bool = option(False, doc="sgd")
    betas: list = option([0.9, 0.999], parse=numbers_read, doc="adam/adamw: two numbers")
    eps: float = option(1e-8, check=POSITIVE, doc="adam/adamw")


@dataclass(frozen=True)
class SchedConfig:
    """The learning-rate schedule, stepped per optimizer step (plateau: per evaluation)."""

    name: str = option(
        "cosine",
        doc="a built-in schedule after the warmup, or a user's `module:function` called with "
        "the optimizer, this config and the run's total steps",
    )
    warmup_steps: int = option(
        0, check=NON_NEGATIVE, doc="linear warmup from 0 before the schedule"
    )
    min_lr: float = option(0.0, check=NON_NEGATIVE, doc="cosine floor")
    step_size: int = option(1000, check=AT_LEAST_ONE, doc="step: decay every this many steps")
    gamma: float = option(0.1, check=POSITIVE, doc="step/plateau: decay factor")
    patience: int = option(
        2, check=NON_NEGATIVE, doc="plateau: evaluations without improvement of `ckpt.monitor`"
    )


@dataclass(frozen=True)
class EarlyStopConfig:
    """Ends a run whose `ckpt.monitor` has stopped improving, counted at the evaluations of
    `train.eval_every_epochs` and `train.eval_every_steps`; see [Training](training.md)."""

    patience: int | None = option(
        None,
        check=AT_LEAST_ONE,
        doc="evaluations in a row without an improvement after which the run stops (exit 0, "
        "status stopped_early); null = never",
    )
    min_delta: float = option(
        0.0,
        check=NON_NEGATIVE,
        doc="an improvement beats the best value so far by more than this, in "
        "`ckpt.monitor_mode`'s direction",
    )


@dataclass(frozen=True)
class EmaConfig:
    """An exponential moving average of the parameters, saved in every checkpoint and evaluated
    beside them; see [After training](after_training.md#ema-weights)."""

    decay: float | None = option(
        None,
        check=(lambda v: 0 < v < 1, "must be in (0, 1), e.g. 0.999"),
        doc="each update keeps this share of the average and takes the rest from the "
        "parameters; null = no EMA",
    )
    every_steps: int = option(
        1, check=AT_LEAST_ONE, doc="update the average after every this many optimizer steps"
    )
    eval: bool = option(
        True, doc="each evaluation also evaluates the averaged weights (`val_<name>_ema`)"
    )


# The quantization schemes (models/quantize.py implements them), and those whose fake
# quantization quantization-aware training can train with.
QUANTIZATION_SCHEMES = ("int8-dynamic", "int8-weight", "int8-static", "int4-weight")
QAT_SCHEMES = ("int8-dynamic",)


@dataclass(frozen=True)
class QatConfig:
    """Quantization-aware training: the Linear layers train through torchao's fake quantization
    (float numbers rounded as the scheme will round them) so that the weights learn to live with
    int8; see [Training](training.md#quantization-aware-training-trainqat)."""

    scheme: str | None = option(
        None,
        doc=f"the scheme trained for and later converted to: {', '.join(QAT_SCHEMES)}; "
        "null = no fake quantization",
    )
    start_step: int = option(
        0,
        check=NON_NEGATIVE,
        doc="the first this many optimizer steps train in float, the rest fake-quantized "
        "(0: all of them)",
    )


@dataclass(frozen=True)
class TrainConfig:
    """The loop: length, precision, checks and evaluation; see [Faults](faults.md)."""

    epochs: int = option(10, check=AT_LEAST_ONE, doc="passes over the training set")
    max_steps: int | None = option(
        None,
        check=AT_LEAST_ONE,
        doc="optimizer steps; whichever of epochs and max_steps ends first",
    )
    precision: str = option(
        "fp32",
        choices=("fp32", "bf16", "fp16"),
        doc="bf16/fp16: autocast (FSDP: its mixed-precision policy); fp16 adds a grad scaler",
    )
    grad_accum: int = option(1, check=AT_LEAST_ONE, doc="micro-batches per optimizer step")
    loss_scale_init: float = option(
        65536.0, check=POSITIVE, doc="fp16: the grad scaler's first scale"
    )
    clip_grad_norm: float | None = option(
        None, check=POSITIVE, doc="clip the global gradient norm of the whole model"
    )
    log_every: int = option(
        50, check=AT_LEAST_ONE, doc="steps between records (metrics.jsonl, TensorBoard, console)"
    )
    check_every_steps: int = option(
        10,
        check=AT_LEAST_ONE,
        doc="the host reads the device (loss, non-finite steps) and the ranks agree on stop "
        "signals this often, and at every record, evaluation and save; steps in between "
        "never wait for the device",
    )
    eval_every_epochs: int = option(1, check=NON_NEGATIVE, doc="0 = only at the end")
    eval_every_steps: int | None = option(
        None, check=AT_LEAST_ONE, doc="also evaluate every this many steps"
    )
    eval_tasks: list = option(
        [],
        check=(lambda v: all(isinstance(p, str) and p for p in v), "must list files or folders"),
        doc="language-model task files (lm-eval's format) or folders, scored at each evaluation "
        "as `task_<name>_<metric>`; see "
        "[Training](training.md#scoring-on-tasks-while-training-traineval_tasks)",
    )
    nan_policy: str = option(
        "stop",
        choices=("stop", "skip"),
        doc="a non-finite loss or gradient: end the run (exit 1), or skip the step on every rank",
    )
    max_consecutive_skips: int = option(
        10, check=NON_NEGATIVE, doc="skip: more non-finite steps in a row than this stop the run"
    )
    detect_anomaly: bool = option(False, doc="autograd anomaly detection")
    sync_debug: bool = option(
        False, doc="CUDA: torch warns at every host-device synchronisation inside a step"
    )
    cudnn_benchmark: bool = option(False, doc="`torch.backends.cudnn.benchmark`")
    deterministic: bool = option(False, doc="`torch.use_deterministic_algorithms(True)`")
    overfit_batches: int = option(
        0,
        check=NON_NEGATIVE,
        doc="K > 0: train on the same K batches, augmentation off (a smoke test)",
    )
    early_stop: EarlyStopConfig = field(default_factory=EarlyStopConfig)
    ema: EmaConfig = field(default_factory=EmaConfig)
    qat: QatConfig = field(default_factory=QatConfig)


@dataclass(frozen=True)
class CkptConfig:
    """When checkpoints are saved, which are kept, and how a run resumes; see
    [Checkpoints](checkpoints.md)."""

    every_steps: int | None = option(None, check=AT_LEAST_ONE, doc="save every this many steps")
    every_epochs: int = option(1, check=NON_NEGATIVE, doc="0 = never at epoch ends")
    keep_last: int = option(
        3, check=AT_LEAST_ONE, doc="how many of the last saved checkpoints are kept"
    )
    keep_best: int = option(
        1, check=NON_NEGATIVE, doc="best checkpoints by `ckpt.monitor`, kept beside the last ones"
    )
    monitor: str = option(
        "val_acc",
        doc="a metric the task reports (`val_loss`, `val_acc`, `val_<name>`); any other name "
        "is exit 2",
    )
    monitor_mode: str = option(
        "max", choices=("max", "min"), doc="max: higher `ckpt.monitor` is better; min: lower"
    )
    resume: str = option("auto", doc="auto | none | PATH")
    resume_config_change: str = option(
        "refuse",
        choices=("refuse", "allow"),
        doc="resuming with a config that trains something else (a changed length, "
        "`train.epochs` or `train.max_steps`, is not: see `ckpt.on_length_change`)",
    )
    on_length_change: str = option(
        "respan",
        choices=("respan", "keep"),
        doc="a resume that changed `train.epochs` or `train.max_steps`: respan: the lr schedule "
        "becomes the one of the new length from the start (a cosine jumps back up); keep: it "
        "keeps its length, and steps past its end train at its last lr",
    )
    format: str = option(
        "auto",
        choices=("auto", "full", "sharded"),
        doc="auto: full for DDP/none, sharded for FSDP",
    )
    async_: bool = option(False, doc="write checkpoints in the background")


@dataclass(frozen=True)
class SlurmConfig:
    """Behaviour inside a SLURM job; see [SLURM](slurm.md)."""

    requeue: bool = option(
        True,
        doc="after a stop signal's checkpoint, rank 0 requeues the running SLURM job "
        "(`scontrol requeue`)",
    )


@dataclass(frozen=True)
class Config:
    """The whole run configuration, one section per field."""

    run: RunConfig = field(default_factory=RunConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    sched: SchedConfig = field(default_factory=SchedConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    ckpt: CkptConfig = field(default_factory=CkptConfig)
    log: LogConfig = field(default_factory=LogConfig)
    slurm: SlurmConfig = field(default_factory=SlurmConfig)

    @property
    def run_name(self) -> str:
        """run.name, or the name of a run that names none (the launcher names every run first:
        after its SLURM job or config file)."""
        return self.run.name or DEFAULT_RUN_NAME

    @property
    def run_url(self) -> str | None:
        """The run directory in an object store (run.out_dir is a URL), else None."""
        return join(self.run.out_dir, self.run_name) if is_url(self.run.out_dir) else None

    @property
    def run_dir(self) -> str:
        """Where this process writes the run's files: the run directory, or for a run in an
        object store this node's staging folder (uploaded from there)."""
        if self.run_url:
            return staging_dir(self.run_url, self.run.staging_dir)
        return os.path.join(self.run.out_dir, self.run_name)
