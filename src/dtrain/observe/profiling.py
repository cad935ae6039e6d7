"""`log.profile`: torch.profiler over a few chosen optimizer steps.

The schedule skips `wait` steps, warms up for `warmup` and records `active` steps, once. Every
rank profiles itself (a rank left unprofiled would run faster and skew the collectives), and
writes a trace for TensorBoard's profiler view to `<run dir>/profile/rank<N>.<time>.pt.trace.json`.
Rank 0 also logs the ten operators that took the most time of their own.

The pieces `dtrain eval --profile` shares: which activities to record on a device
(`activities`), the trace writer (`trace_writer`) and the operators' own times (`self_times`).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.profiler import ProfilerActivity, profile, schedule, tensorboard_trace_handler

from dtrain.config import ProfileConfig
from dtrain.core.logs import log
from dtrain.files import names

TOP_ROWS = 10


class Profiler:
    """Started before the first step, stepped after every optimizer step, stopped at the end.
    Every method is a no-op when profiling is off."""

    def __init__(self, cfg: ProfileConfig, run_dir: str, rank: int, device: torch.device) -> None:
        self.cfg, self.rank, self.device = cfg, rank, device
        self.dir = os.path.join(run_dir, names.PROFILE)
        self.traced = False
        self._ending = False
        self._prof: profile | None = None
        if not cfg.enabled:
            return
        self._write_trace = trace_writer(self.dir, rank)
        self._prof = profile(
            activities=activities(device),
            schedule=schedule(wait=cfg.wait, warmup=cfg.warmup, active=cfg.active, repeat=1),
            on_trace_ready=self._on_trace_ready,
        )

    def start(self) -> None:
        if self._prof is not None:
            log.info(
                f"profiler: recording steps {self.cfg.wait + self.cfg.warmup + 1} to "
                f"{self.cfg.wait + self.cfg.warmup + self.cfg.active} of this attempt"
            )
            self._prof.start()

    def step(self) -> None:
        if self._prof is not None:
            self._prof.step()

    def stop(self) -> None:
        """Ends the profile. A window that training did not finish is dropped: it would hold the
        final evaluation and checkpoint under the name of a training step."""
        if self._prof is None:
            return
        prof, self._prof, self._ending = self._prof, None, True
        prof.stop()
        if not self.traced:
            last = self.cfg.wait + self.cfg.warmup + self.cfg.active
            log.warning(
                f"profiler: training ended before step {last} of this attempt, inside the "
                f"profiling window; no trace (lower log.profile.wait, warmup or active)"
            )

    def _on_trace_ready(self, prof: profile) -> None:
        if self._ending:
            return
        self.traced = True
        self._write_trace(prof)
        if self.rank != 0:
            return
        on_gpu = self.device.type == "cuda"
        sort_by = "self_device_time_total" if on_gpu else "self_cpu_time_total"
        table = prof.key_averages().table(sort_by=sort_by, row_limit=TOP_ROWS)
        log.info(
            f"profiler: trace in {self.dir}; top {TOP_ROWS} operators by "
            f"{'CUDA' if on_gpu else 'CPU'} time of their own:\n{table}"
        )


def activities(device: torch.device) -> list[ProfilerActivity]:
    """What the profiler records on `device`: the CPU's operators, and a GPU's kernels."""
    if device.type == "cuda":
        return [ProfilerActivity.CPU, ProfilerActivity.CUDA]
    # Kineto logs a spurious "gpuGetDeviceCount failed" ERROR on machines without a GPU; with
    # one, its messages (CUPTI permissions, say) matter and stay.
    os.environ.setdefault("KINETO_LOG_LEVEL", "5")
    return [ProfilerActivity.CPU]


def trace_writer(folder: str, rank: int) -> Callable[[profile], None]:
    """Writes a profile as `folder/rank<N>.<time>.pt.trace.json`, the name TensorBoard's profiler
    view reads (each rank its own file)."""
    return tensorboard_trace_handler(folder, worker_name=f"rank{rank}")


@dataclass(frozen=True)
class OpTime:
    """One operator's calls in a profile and the time it took of its own (its children's
    excluded), in microseconds: on a GPU the kernels' time, on the CPU the host's."""

    name: str
    self_us: float
    calls: int


def self_times(prof: profile, device: torch.device) -> list[OpTime]:
    """The operators of `prof`, the most time of their own first. The operators alone (the host's
    events): on a GPU a kernel's time is counted once, in the operator that launched it."""
    on_gpu = device.type == "cuda"
    ops = [
        OpTime(e.key, float(e.self_device_time_total if on_gpu else e.self_cpu_time_total), e.count)
        for e in prof.key_averages()
        if e.device_type == torch.autograd.DeviceType.CPU
    ]
    return sorted(ops, key=lambda op: op.self_us, reverse=True)


# The GPU's copies between the host and the device, as Kineto names them ("Memcpy HtoD (Pinned
# -> Device)"); a copy within the device is not one.
HOST_DEVICE_COPIES = ("Memcpy HtoD", "Memcpy DtoH")


def copy_us(prof: profile) -> float:
    """The time a GPU spent in copies between the host and the device, in microseconds; none on
    the CPU."""
    return sum(
        float(e.self_device_time_total)
        for e in prof.key_averages()
        if e.device_type != torch.autograd.DeviceType.CPU and e.key.startswith(HOST_DEVICE_COPIES)
    )
