"""What a run shows: per-rank log files, the console, metrics.jsonl and TensorBoard (rank 0).

Only rank 0 writes shared files. On resume, records from the interrupted attempt that lie after
the resumed step are dropped (metrics.jsonl is rewritten, TensorBoard purges them), so every
curve continues without duplicate or out-of-order steps.
"""

from __future__ import annotations

import json
import logging
import os
import resource
import sys
import time
from typing import Any, Optional, TextIO

import torch

from dtrain.config import Config, flatten, to_dict

log = logging.getLogger("dtrain")


def setup_logging(run_dir: Optional[str], rank: int, all_ranks: bool) -> None:
    """Rank 0 logs to the console and log.txt; rank N to log.rankN.txt (and the console if asked)."""
    log.handlers.clear()
    log.setLevel(logging.INFO)
    log.propagate = False
    prefix = "" if rank == 0 else f"[rank {rank}] "
    fmt = logging.Formatter(f"%(asctime)s {prefix}%(message)s", datefmt="%Y-%m-%d %H:%M:%S")
    if rank == 0 or all_ranks:
        console = logging.StreamHandler(sys.stderr)
        console.setFormatter(fmt)
        log.addHandler(console)
    if run_dir is not None:
        name = "log.txt" if rank == 0 else f"log.rank{rank}.txt"
        handler = logging.FileHandler(os.path.join(run_dir, name), encoding="utf-8")
        handler.setFormatter(fmt)
        log.addHandler(handler)


def memory_stats(device: torch.device) -> dict[str, float]:
    if device.type == "cuda":
        return {"cuda_max_allocated_gb": torch.cuda.max_memory_allocated(device) / 2**30}
    # ru_maxrss is in KiB on Linux: the peak, which is what matters for fitting a machine.
    return {"rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}


class Progress:
    """A one-line progress bar on a terminal; on anything else (SLURM logs, CI, a pipe) plain
    timestamped lines at most every `every_s` seconds or every `every_steps` steps."""

    def __init__(self, stream: TextIO, style: str, every_s: float) -> None:
        self.stream = stream
        self.bar = style == "bar" or (style == "auto" and stream.isatty())
        self.every_s = every_s
        self.last_line = 0.0
        self.epoch_steps, self.epoch = 0, 0

    def start_epoch(self, epoch: int, steps: int) -> None:
        self.epoch, self.epoch_steps = epoch, steps

    def update(self, done: int, record: dict[str, Any], force_line: bool) -> None:
        if self.bar:
            width = 30
            filled = int(width * done / max(1, self.epoch_steps))
            self.stream.write(f"\repoch {self.epoch} [{'#' * filled}{'.' * (width - filled)}] "
                              f"{done}/{self.epoch_steps} loss {record['loss']:.4f} "
                              f"lr {record['lr']:.3g} {record['samples_per_s']:.0f} samples/s ")
            if done >= self.epoch_steps:
                self.stream.write("\n")
            self.stream.flush()
            return
        now = time.monotonic()
        if force_line or now - self.last_line >= self.every_s:
            self.last_line = now
            log.info(format_record(record))

    def end_epoch(self) -> None:
        if self.bar:
            self.stream.write("\n")
            self.stream.flush()


def format_record(record: dict[str, Any]) -> str:
    parts = [f"step {record['step']}", f"epoch {record['epoch']}"]
    for key, value in record.items():
        if key not in ("step", "epoch") and value is not None:
            parts.append(f"{key} {value:.4g}" if isinstance(value, float) else f"{key} {value}")
    return " | ".join(parts)


class RunLog:
    """The run's records. Every method is a no-op except on rank 0 (logging aside)."""

    def __init__(self, cfg: Config, run_dir: str, is_main: bool, resumed_step: int) -> None:
        self.cfg, self.run_dir, self.is_main = cfg, run_dir, is_main
        self.metrics: Optional[TextIO] = None
        self.writer = None
        self.progress = Progress(sys.stderr, cfg.log.progress, cfg.log.every_s)
        if not is_main:
            return
        path = os.path.join(run_dir, "metrics.jsonl")
        _drop_records_after(path, resumed_step)
        self.metrics = open(path, "a", encoding="utf-8")
        if cfg.log.tensorboard:
            from torch.utils.tensorboard import SummaryWriter
            # purge_step discards events the interrupted attempt wrote after the resumed step.
            self.writer = SummaryWriter(os.path.join(run_dir, "tb"),
                                        purge_step=resumed_step + 1 if resumed_step else None)

    def _write(self, record: dict[str, Any]) -> None:
        if self.metrics is not None:
            self.metrics.write(json.dumps(record) + "\n")
            self.metrics.flush()

    def train(self, record: dict[str, Any], extra_scalars: dict[str, float], done_in_epoch: int,
              at_log_step: bool) -> None:
        if not self.is_main:
            return
        if at_log_step:
            self._write(record)
            if self.writer is not None:
                for key in ("loss", "lr", "grad_norm", "samples_per_s", "step_time_s", "data_wait_pct"):
                    if record.get(key) is not None:
                        self.writer.add_scalar(f"train/{key}", record[key], record["step"])
                for key, value in extra_scalars.items():
                    self.writer.add_scalar(key, value, record["step"])
        self.progress.update(done_in_epoch, record, force_line=at_log_step)

    def evaluation(self, record: dict[str, Any]) -> None:
        log.info(format_record(record))  # every rank's log: they must all show the same numbers
        if not self.is_main:
            return
        self._write(record)
        if self.writer is not None:
            self.writer.add_scalar("val/loss", record["val_loss"], record["step"])
            self.writer.add_scalar("val/acc", record["val_acc"], record["step"])
            self.writer.flush()

    def hparams(self, final_metrics: dict[str, float]) -> None:
        if self.writer is None:
            return
        flat = {k: (v if isinstance(v, (int, float, str, bool)) else str(v))
                for k, v in flatten(to_dict(self.cfg)).items()}
        metrics = {f"hparam/{k}": v for k, v in final_metrics.items() if v is not None}
        self.writer.add_hparams(flat, metrics, run_name=".")

    def close(self) -> None:
        if self.metrics is not None:
            self.metrics.close()
            self.metrics = None
        if self.writer is not None:
            self.writer.close()
            self.writer = None


def _drop_records_after(path: str, step: int) -> None:
    """Keep only records up to `step` (all of them for a fresh start with step 0 and no file)."""
    if not os.path.exists(path):
        return
    with open(path, encoding="utf-8") as f:
        lines = f.readlines()
    kept = []
    for line in lines:
        try:
            if json.loads(line)["step"] <= step:
                kept.append(line)
        except (ValueError, KeyError, TypeError):
            continue  # a line torn by a crash mid-write
    if len(kept) != len(lines):
        tmp = path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            f.writelines(kept)
        os.replace(tmp, path)
