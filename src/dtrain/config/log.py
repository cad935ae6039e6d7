"""The `log` section: what a run reports and where (the console, TensorBoard, the profiler,
the experiment trackers)."""

from __future__ import annotations

from dataclasses import dataclass, field

from dtrain.config.fields import AT_LEAST_ONE, DURATION, NON_NEGATIVE, option


@dataclass(frozen=True)
class ProfileConfig:
    """The torch profiler's schedule, in optimizer steps."""

    enabled: bool = option(False, doc="record one window of steps on every rank")
    wait: int = option(1, check=NON_NEGATIVE, doc="steps skipped first")
    warmup: int = option(1, check=NON_NEGATIVE, doc="steps traced but not recorded")
    active: int = option(3, check=AT_LEAST_ONE, doc="steps recorded")


@dataclass(frozen=True)
class MlflowConfig:
    """MLflow tracking, rank 0 only; see [Watching a run](watching.md#experiment-trackers)."""

    enabled: bool = option(False, doc="send params, tags and metrics to MLflow (extra `[mlflow]`)")
    tracking_uri: str | None = option(
        None,
        doc="default: `sqlite:///<run.out_dir>/mlflow.db`, a local file (no server); "
        "`http://host:5000` for a tracking server (its credentials in the environment: "
        "MLFLOW_TRACKING_USERNAME, MLFLOW_TRACKING_PASSWORD; never in the URL)",
    )
    experiment: str | None = option(
        None, doc="default: the sweep's name for a trial of `dtrain sweep`, else `run.name`"
    )


@dataclass(frozen=True)
class WandbConfig:
    """Weights & Biases, rank 0 only; see [Watching a run](watching.md#experiment-trackers)."""

    enabled: bool = option(False, doc="log params, tags and metrics to W&B (extra `[wandb]`)")
    project: str | None = option(None, doc="default: as `log.mlflow.experiment`")
    mode: str = option(
        "offline",
        choices=("offline", "online"),
        doc="offline: files under `<run dir>/wandb/` (`wandb sync` uploads them later); "
        "online: needs `wandb login`",
    )


@dataclass(frozen=True)
class LogConfig:
    """What a run reports, and where; see [Watching a run](watching.md)."""

    tensorboard: bool = option(True, doc="rank 0 writes TensorBoard events to `tb/`")
    every_s: float = option(
        30.0,
        check=DURATION,
        doc="non-terminal consoles: a progress line at least this often "
        "(besides one every `train.log_every` steps)",
    )
    all_ranks: bool = option(False, doc="every rank prints to the console, not only rank 0")
    progress: str = option(
        "auto",
        choices=("auto", "bar", "lines"),
        doc="auto: a bar on a terminal, timestamped lines elsewhere",
    )
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    mlflow: MlflowConfig = field(default_factory=MlflowConfig)
    wandb: WandbConfig = field(default_factory=WandbConfig)
