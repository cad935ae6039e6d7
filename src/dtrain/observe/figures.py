"""Figures a run reports about itself: throughput and MFU, memory, and how long start-up took."""

from __future__ import annotations

import os
import resource
import time
from dataclasses import dataclass

import torch

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


def memory_stats(device: torch.device) -> dict[str, float]:
    if device.type == "cuda":
        return {"cuda_max_allocated_gb": torch.cuda.max_memory_allocated(device) / 2**30}
    # ru_maxrss is in KiB on Linux: the peak, which is what matters for fitting a machine.
    return {"rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}


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
