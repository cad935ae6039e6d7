"""Where a run's records go, behind one small interface: metrics.jsonl, TensorBoard, and the
experiment trackers (`trackers`: MLflow, W&B), each a class with the same three methods.

Only rank 0 has sinks. On resume, each sink drops what the interrupted attempt wrote after the
resumed step (metrics.jsonl is rewritten, TensorBoard purges), so that every curve continues
without duplicate or out-of-order steps; a tracker, which cannot drop, skips the steps it holds.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol

from dtrain.config.checks import TASK_METRIC
from dtrain.core.logs import log
from dtrain.files import metrics as metrics_file
from dtrain.files import names

if TYPE_CHECKING:
    from torch.utils.tensorboard import SummaryWriter

# What an evaluation's metrics begin with: the validation split's, the tasks' (train.eval_tasks).
EVALUATED = ("val_", TASK_METRIC)


@dataclass(frozen=True)
class Record:
    """One record of a run, as every sink receives it.

    `values` is exactly one line of metrics.jsonl: `step`, `epoch`, then the figures (`loss`,
    `lr`, ... for "train"; `val_loss`, `val_acc`, `task_<name>_<metric>`, ... for "val").
    `scalars` are figures for dashboards only, already named by their tag (`mem/rss_gb`):
    metrics.jsonl does not hold them.
    """

    kind: Literal["train", "val"]
    values: Mapping[str, Any]
    scalars: Mapping[str, float] = field(default_factory=dict)

    @property
    def step(self) -> int:
        return int(self.values["step"])


@dataclass(frozen=True)
class RunFacts:
    """What the sinks are told about the run besides its records; the assembly makes it from
    the resolved config."""

    name: str  # run.name, resolved
    out_dir: str  # run.out_dir
    monitor: tuple[str, str]  # ckpt.monitor and ckpt.monitor_mode
    config: Mapping[str, Any]  # the resolved config, flattened to dotted keys


class Sink(Protocol):
    """A destination of records. Called on rank 0 only, in step order, from the training loop:
    a sink must not call collectives, and should be quick (it runs between two steps)."""

    def write(self, record: Record) -> None:
        """Keep one record; on disk (or sent) before returning, so that a killed run keeps it."""

    def hparams(self, step: int, config: Mapping[str, Any], final: Mapping[str, float]) -> None:
        """At the end of a run: the resolved config flattened to dotted keys with scalar values
        (`optim.lr`: 0.05), and the final and best metrics (`val_loss`, `best_val_acc`)."""

    def close(self) -> None:
        """Release files and connections; called once, also after a failed run."""


class JsonlSink:
    """metrics.jsonl: one JSON object per record, flushed at once."""

    def __init__(self, path: str, resumed_step: int, superseded: str | None = None) -> None:
        drop_records_after(path, resumed_step, superseded)
        self.file = open(path, "a", encoding="utf-8")

    def write(self, record: Record) -> None:
        self.file.write(json.dumps(dict(record.values)) + "\n")
        self.file.flush()

    def hparams(self, step: int, config: Mapping[str, Any], final: Mapping[str, float]) -> None:
        """Nothing: config.yaml holds the config and the records the metrics."""

    def close(self) -> None:
        self.file.close()


def drop_records_after(path: str, step: int, superseded: str | None = None) -> None:
    """Keep only records up to `step` (all of them for a fresh start with step 0 and no file).
    The dropped records go to `superseded/<time>/metrics.jsonl` when a rewind moved checkpoints
    there, so that nothing of the abandoned history is lost. Lines that cannot be read (torn by
    a kill, damaged) are left out with a warning: a record never stops a run."""
    records, skipped = metrics_file.read(path)
    if not records and not skipped:
        return
    kept = [line for line, record in records if record["step"] <= step]
    dropped = [line for line, record in records if record["step"] > step]
    if skipped:
        log.warning(
            f"{path}: left out {skipped} line(s) that cannot be read (torn by a kill, or "
            f"damaged); the other records are kept"
        )
    if dropped and superseded is not None:
        with open(os.path.join(superseded, names.METRICS), "a", encoding="utf-8") as f:
            f.writelines(dropped)
    if dropped or skipped:
        tmp = path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            f.writelines(kept)
        os.replace(tmp, path)


class TensorBoardSink:
    """TensorBoard event files in `log_dir`: train/<figure>, val/<metric>, the records' scalars
    under their own tags, and the HParams tab (a row from the first record on, its columns at
    the end), all in one event file per attempt."""

    TRAIN_FIGURES = (
        "loss",
        "lr",
        "grad_norm",
        "samples_per_s",
        "step_time_s",
        "data_wait_pct",
        "step_time_max",
        "step_time_min",
        "slowest_rank",
        "world_size",
        "tokens_per_s",
        "flops_per_s",
        "mfu",
    )

    def __init__(self, log_dir: str, resumed_step: int) -> None:
        self.log_dir = log_dir
        # TensorBoard discards the events an earlier attempt wrote from this step on (after the
        # resumed checkpoint; all of them on a fresh start in a used directory).
        self.purge_step = resumed_step + 1
        self._writer: SummaryWriter | None = None

    @property
    def writer(self) -> SummaryWriter:
        """Made at the first record rather than on the way to the first step (importing
        TensorBoard takes a while)."""
        if self._writer is None:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(self.log_dir, purge_step=self.purge_step)
        return self._writer

    def write(self, record: Record) -> None:
        step, values = record.step, record.values
        if record.kind == "train":
            for key in self.TRAIN_FIGURES:
                if values.get(key) is not None:
                    self.writer.add_scalar(f"train/{key}", values[key], step)
        else:
            for key, value in values.items():
                if key.startswith(EVALUATED):  # val/loss, task/<name>_<metric>
                    kind, _, name = key.partition("_")
                    self.writer.add_scalar(f"{kind}/{name}", value, step)
        for tag, value in record.scalars.items():
            self.writer.add_scalar(tag, value, step)
        # On disk at every record, as metrics.jsonl is: a killed run keeps its curves.
        self.writer.flush()

    def session_start(self, config: Mapping[str, Any]) -> None:
        """The HParams tab's row for this run, from its first record on (observe/tb_hparams.py):
        a run still going on, killed or failed is in the table too."""
        from dtrain.files.sweeps import trial_of
        from dtrain.observe import tb_hparams

        summary = tb_hparams.session_start(config, trial_of(os.path.dirname(self.log_dir)))
        self._add_summaries([summary], 0)

    def hparams(self, step: int, config: Mapping[str, Any], final: Mapping[str, float]) -> None:
        """The HParams tab's columns (a sweep's swept keys first) and the final and best
        figures as `hparam/<name>` scalars, written by the run's own writer
        (SummaryWriter.add_hparams would open a second event file)."""
        from dtrain.files.sweeps import trial_of
        from dtrain.observe import tb_hparams

        trial = trial_of(os.path.dirname(self.log_dir))
        metrics = {f"hparam/{key}": value for key, value in final.items()}
        summaries = [tb_hparams.session_start(config, trial)]  # ignored after the first record's
        if metrics:  # TensorBoard keeps a run's first experiment: one with the metrics' columns
            summaries.append(tb_hparams.experiment(config, trial, list(metrics)))
        self._add_summaries(summaries, step)
        for tag, value in metrics.items():
            self.writer.add_scalar(tag, value, step)
        self.writer.flush()

    def _add_summaries(self, summaries: list[Any], step: int) -> None:
        file_writer = self.writer.file_writer
        assert file_writer is not None  # SummaryWriter opens it when it is made
        for summary in summaries:
            file_writer.add_summary(summary, step)
        self.writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
