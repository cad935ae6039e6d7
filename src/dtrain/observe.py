"""What a run shows: per-rank log files, the console, metrics.jsonl and TensorBoard (rank 0).

Only rank 0 writes shared files. On resume, records from the interrupted attempt that lie after
the resumed step are dropped (metrics.jsonl is rewritten, TensorBoard purges them), so every
curve continues without duplicate or out-of-order steps.
"""

from __future__ import annotations

import json
import logging
import logging.handlers
import os
import resource
import sys
import time
from dataclasses import dataclass
from typing import Any, TextIO

import torch

from dtrain.config import Config, flatten, to_dict

log = logging.getLogger("dtrain")


def setup_logging(rank: int, all_ranks: bool) -> None:
    """Rank 0 logs to the console and log.txt; rank N to log.rankN.txt (and the console if asked).
    Lines are kept until `attach_log_files` names the run directory: a run writes nothing there
    before the directory is known to be its own."""
    log.handlers.clear()
    log.setLevel(logging.INFO)
    log.propagate = False
    prefix = "" if rank == 0 else f"[rank {rank}] "
    fmt = logging.Formatter(f"%(asctime)s {prefix}%(message)s", datefmt="%Y-%m-%d %H:%M:%S")
    if rank == 0 or all_ranks:
        console = _Console(sys.stderr)
        console.setFormatter(fmt)
        log.addHandler(console)
    early = logging.handlers.MemoryHandler(capacity=1_000_000, flushLevel=logging.CRITICAL + 1)
    early.setFormatter(fmt)
    log.addHandler(early)


def attach_log_files(run_dir: str, rank: int) -> None:
    """Log into the run directory from now on, the lines logged so far first."""
    name = "log.txt" if rank == 0 else f"log.rank{rank}.txt"
    handler = logging.FileHandler(os.path.join(run_dir, name), encoding="utf-8")
    for early in [h for h in log.handlers if isinstance(h, logging.handlers.MemoryHandler)]:
        handler.setFormatter(early.formatter)
        early.setTarget(handler)
        early.flush()
        log.removeHandler(early)
    log.addHandler(handler)


class _Console(logging.StreamHandler):
    """The console handler. A log line first erases a live progress bar on the same terminal and
    redraws it below, so that lines and bar never run into each other."""

    def __init__(self, stream: TextIO) -> None:
        super().__init__(stream)
        self.bar: Progress | None = None

    def emit(self, record: logging.LogRecord) -> None:
        bar = self.bar
        if bar is not None:
            bar.erase()
        super().emit(record)
        if bar is not None:
            bar.redraw()


# Dense bf16/fp16 peak FLOP/s of one GPU, by a name torch reports for it (for MFU).
PEAK_FLOPS = {
    "B200": 2250e12,
    "H200": 989e12,
    "H100": 989e12,
    "H800": 989e12,
    "A100": 312e12,
    "A800": 312e12,
    "L40S": 362e12,
    "L4": 121e12,
    "A10": 125e12,
    "V100": 125e12,
}


def peak_flops(device: torch.device, precision: str) -> float | None:
    """One device's peak for the run's precision where it is known (a GPU of the table in bf16
    or fp16); None on CPUs and for fp32."""
    if device.type != "cuda" or precision == "fp32":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in PEAK_FLOPS.items() if key in name), None)


@dataclass
class Throughput:
    """What a record adds for token-based tasks: tokens/s, the model's FLOP/s (6 x parameters x
    tokens/s: forward and backward of the weights' matrix products) and, where the devices' peak
    is known, the fraction of it (MFU). Rates are of all ranks together."""

    tokens_per_sample: int | None = None
    num_params: int = 0
    peak_flops: float | None = None  # all ranks' devices together

    def figures(self, samples_per_s: float) -> dict[str, float]:
        if not self.tokens_per_sample:
            return {}
        tokens = samples_per_s * self.tokens_per_sample
        out = {"tokens_per_s": tokens, "flops_per_s": 6.0 * self.num_params * tokens}
        if self.peak_flops:
            out["mfu"] = out["flops_per_s"] / self.peak_flops
        return out


def process_start_time() -> float:
    """When this process started (seconds since the epoch), from the kernel's accounting: the
    imports before any of dtrain's code ran count too. The time of this call where /proc has it
    not."""
    try:
        with open("/proc/self/stat", encoding="ascii") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/stat", encoding="ascii") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime"))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, StopIteration, IndexError):
        return time.time()


class StartupClock:
    """How long each phase of start-up takes, from the process's start to the end of the first
    step: logged once, so that a slow start names its phase."""

    def __init__(self) -> None:
        self.started = process_start_time()
        self.last = self.started
        self.phases: list[tuple[str, float]] = []

    def mark(self, phase: str) -> None:
        now = time.time()
        self.phases.append((phase, now - self.last))
        self.last = now

    def line(self) -> str:
        parts = ", ".join(f"{name} {seconds:.2f} s" for name, seconds in self.phases)
        return f"start-up: {parts} ({self.last - self.started:.2f} s since the process started)"


def memory_stats(device: torch.device) -> dict[str, float]:
    if device.type == "cuda":
        return {"cuda_max_allocated_gb": torch.cuda.max_memory_allocated(device) / 2**30}
    # ru_maxrss is in KiB on Linux: the peak, which is what matters for fitting a machine.
    return {"rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}


class Progress:
    """Rank 0's console view of training.

    On a terminal: one bar per epoch with loss, lr, samples/s and the time left, redrawn in place
    at most `REDRAW_S` apart. Anywhere else (a SLURM log, CI, `| tee`): no carriage returns, only
    timestamped lines, one every `train.log_every` steps and one whenever `every_s` seconds pass
    without a line, so that a slow job still shows signs of life and a fast one does not flood
    the file. Logged steps also go to log.txt in both cases.
    """

    REDRAW_S = 0.1
    BAR_WIDTH = 24

    def __init__(self, stream: TextIO, style: str, every_s: float) -> None:
        self.stream = stream
        self.bar = style == "bar" or (style == "auto" and stream.isatty())
        self.every_s = every_s
        self.last_line = time.monotonic()
        self.last_draw = 0.0
        self.text = ""  # the bar as it is on screen; "" when none is
        self.epoch, self.epoch_steps = 0, 0
        self.epoch_started, self.first_done = 0.0, None
        self.latest: tuple[int, dict[str, Any]] | None = None  # the last update, drawn or not
        self.figures: dict[str, Any] = {}  # the last record's figures, kept across epochs
        self.shown_done = 0
        self.linked = False  # whether the console handler redraws the bar after each log line
        if self.bar:
            for handler in log.handlers:
                if isinstance(handler, _Console) and handler.stream is stream:
                    handler.bar, self.linked = self, True

    def start_epoch(self, epoch: int, steps: int) -> None:
        self.epoch, self.epoch_steps = epoch, steps
        self.epoch_started, self.first_done, self.latest = time.monotonic(), None, None

    def update(self, done: int, record: dict[str, Any], at_log_step: bool) -> None:
        now = time.monotonic()
        if (
            self.first_done is None
        ):  # a resumed epoch starts part-way: time only this attempt's steps
            self.first_done = done - 1
        self.latest = (done, record)
        self.figures = record
        render = self.bar and (
            at_log_step or done >= self.epoch_steps or now - self.last_draw >= self.REDRAW_S
        )
        if render:
            self._render(done, record, now)
        if at_log_step or (not self.bar and now - self.last_line >= self.every_s):
            self.last_line = now
            log.info(format_record(record))  # the console handler redraws the bar after the line
        if render and not (at_log_step and self.linked):
            self.redraw()

    def tick(self, done: int) -> None:
        """A step without a record: on a terminal the bar's counter moves (with the last
        record's figures, carried across epochs) at most every REDRAW_S; nothing else."""
        if not self.bar:
            return
        now = time.monotonic()
        if self.first_done is None:
            self.first_done = done - 1
        self.latest = (done, self.figures)
        if now - self.last_draw >= self.REDRAW_S or done >= self.epoch_steps:
            self._render(done, self.figures, now)
            self.redraw()

    def line_due(self) -> bool:
        """Whether a plain-lines console owes a line: log.every_s passed without one."""
        return not self.bar and time.monotonic() - self.last_line >= self.every_s

    def _render(self, done: int, record: dict[str, Any], now: float) -> None:
        self.last_draw, self.shown_done = now, done
        total = max(1, self.epoch_steps)
        elapsed = now - self.epoch_started
        rate = (done - self.first_done) / max(1e-9, elapsed)
        left = (total - done) / rate if rate > 0 else 0.0
        head = f"epoch {self.epoch} {100 * done // total:3d}%|"
        figures = (
            f" loss {record['loss']:.4f} lr {record['lr']:.3g} "
            f"{record['samples_per_s']:.0f} samples/s"
            if record
            else ""
        )
        tail = f"| {done}/{total} [{_clock(elapsed)}<{_clock(left)}]{figures}"
        # The line must never wrap, or \r no longer returns to its start: the bar gives way first.
        columns = _columns(self.stream) - 1
        width = max(5, min(self.BAR_WIDTH, columns - len(head) - len(tail)))
        filled = int(width * min(done, total) / total)
        self.text = (head + "#" * filled + "." * (width - filled) + tail)[: max(20, columns)]

    def erase(self) -> None:
        if self.text:
            self.stream.write("\r\x1b[K")
            self.stream.flush()

    def redraw(self) -> None:
        if self.text:
            self.stream.write("\r\x1b[K" + self.text)
            self.stream.flush()

    def end_epoch(self) -> None:
        """Leave the finished (or interrupted) bar on screen, up to date, and start a new line."""
        if self.bar and self.latest is not None and self.latest[0] != self.shown_done:
            self._render(*self.latest, time.monotonic())
            self.redraw()
        if self.text:
            self.stream.write("\n")
            self.stream.flush()
            self.text = ""


def _columns(stream: TextIO) -> int:
    try:
        return os.get_terminal_size(stream.fileno()).columns or 80
    except (OSError, ValueError, AttributeError):
        return 80


def _clock(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes:02d}:{secs:02d}"


def format_record(record: dict[str, Any]) -> str:
    parts = [f"step {record['step']}", f"epoch {record['epoch']}"]
    for key, value in record.items():
        if key not in ("step", "epoch") and value is not None:
            parts.append(f"{key} {value:.4g}" if isinstance(value, float) else f"{key} {value}")
    return " | ".join(parts)


class RunLog:
    """The run's records. Every method is a no-op except on rank 0 (logging aside)."""

    def __init__(
        self,
        cfg: Config,
        run_dir: str,
        is_main: bool,
        resumed_step: int,
        superseded: str | None = None,
    ) -> None:
        self.cfg, self.run_dir, self.is_main = cfg, run_dir, is_main
        self.metrics: TextIO | None = None
        self._writer = None
        self.resumed_step = resumed_step
        self.progress = Progress(sys.stderr, cfg.log.progress, cfg.log.every_s)
        if not is_main:
            return
        path = os.path.join(run_dir, "metrics.jsonl")
        _drop_records_after(path, resumed_step, superseded)
        self.metrics = open(path, "a", encoding="utf-8")

    @property
    def writer(self) -> Any:
        """The TensorBoard writer, made at the first record rather than on the way to the first
        step (importing TensorBoard takes a while)."""
        if self._writer is None and self.is_main and self.cfg.log.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            # purge_step: TensorBoard discards the events an earlier attempt wrote from this step
            # on (after the resumed checkpoint; all of them on a fresh start in a used directory).
            self._writer = SummaryWriter(
                os.path.join(self.run_dir, "tb"), purge_step=self.resumed_step + 1
            )
        return self._writer

    def _write(self, record: dict[str, Any]) -> None:
        if self.metrics is not None:
            self.metrics.write(json.dumps(record) + "\n")
            self.metrics.flush()

    def train(
        self,
        record: dict[str, Any],
        extra_scalars: dict[str, float],
        done_in_epoch: int,
        at_log_step: bool,
    ) -> None:
        if not self.is_main:
            return
        if at_log_step:
            self._write(record)
            if self.writer is not None:
                for key in (
                    "loss",
                    "lr",
                    "grad_norm",
                    "samples_per_s",
                    "step_time_s",
                    "data_wait_pct",
                    "tokens_per_s",
                    "flops_per_s",
                    "mfu",
                ):
                    if record.get(key) is not None:
                        self.writer.add_scalar(f"train/{key}", record[key], record["step"])
                for key, value in extra_scalars.items():
                    self.writer.add_scalar(key, value, record["step"])
                # On disk at every logged step, as metrics.jsonl is: a killed run keeps its curves.
                self.writer.flush()
        self.progress.update(done_in_epoch, record, at_log_step)

    def evaluation(self, record: dict[str, Any]) -> None:
        log.info(format_record(record))  # every rank's log: they must all show the same numbers
        if not self.is_main:
            return
        self._write(record)
        if self.writer is not None:
            for key, value in record.items():
                if key.startswith("val_"):
                    self.writer.add_scalar(f"val/{key[4:]}", value, record["step"])
            self.writer.flush()

    def hparams(self, step: int, final_metrics: dict[str, float | None]) -> None:
        """The flattened resolved config and the final/best metrics, for the HParams tab. The
        run's own writer writes them (SummaryWriter.add_hparams would open a second event file)."""
        if self.writer is None:
            return
        from torch.utils.tensorboard.summary import hparams

        flat = {
            k: (v if isinstance(v, (int, float, str, bool)) else str(v))
            for k, v in flatten(to_dict(self.cfg)).items()
        }
        metrics = {f"hparam/{k}": v for k, v in final_metrics.items() if v is not None}
        for summary in hparams(flat, metrics):
            self.writer.file_writer.add_summary(summary, step)
        for tag, value in metrics.items():
            self.writer.add_scalar(tag, value, step)
        self.writer.flush()

    def close(self) -> None:
        if self.metrics is not None:
            self.metrics.close()
            self.metrics = None
        if self._writer is not None:
            self._writer.close()
            self._writer = None


def _drop_records_after(path: str, step: int, superseded: str | None = None) -> None:
    """Keep only records up to `step` (all of them for a fresh start with step 0 and no file).
    The dropped records go to `superseded/<time>/metrics.jsonl` when a rewind moved checkpoints
    there, so that nothing of the abandoned history is lost."""
    if not os.path.exists(path):
        return
    with open(path, encoding="utf-8") as f:
        lines = f.readlines()
    kept, dropped = [], []
    for line in lines:
        try:
            (kept if json.loads(line)["step"] <= step else dropped).append(line)
        except (ValueError, KeyError, TypeError):
            continue  # a line torn by a crash mid-write
    if dropped and superseded is not None:
        with open(os.path.join(superseded, "metrics.jsonl"), "a", encoding="utf-8") as f:
            f.writelines(dropped)
    if len(kept) != len(lines):
        tmp = path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            f.writelines(kept)
        os.replace(tmp, path)
