"""What fits under a memory limit, measured and planned: the largest depth that completes 3
AdamW steps, an evaluation and a sharded checkpoint at 2 ranks, with the whole job (torchrun's
agent, both ranks, the page cache their checkpoint writes leave) inside one memory cgroup of
6 GiB, for DDP, FSDP and FSDP + activation checkpointing, on two shapes:

- weight-bound: a transformer classifier, dim 1024, heads 16, patch 4, batch 2 per rank;
- activation-bound: a byte-level GPT, dim 512, heads 8, seq_len 256, batch 8 per rank.

The depth is found by bisection, its bracket seeded with `dtrain plan --grow model.args.depth`'s
answer (a probe at the prediction, then steps away from it until one side fails), so that a
good plan needs few probes. A probe that the kernel stops for memory (its exit code, and the
cgroup's oom_kill count) does not fit; any other failure is an error of the benchmark. Each
probe's run directory is deleted as soon as it ends (a checkpoint of these is gigabytes).
Needs root and a cgroup memory controller; otherwise it says so and measures nothing.
"""

from __future__ import annotations

import math
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent))
import cgroup  # noqa: E402
import common  # noqa: E402
from common import Figure  # noqa: E402

GIB = 2**30
LIMIT = 6 * GIB
KEY = "model.args.depth"
# 3 steps, the end's evaluation and checkpoint (sharded in every mode), nothing else written.
RUN = ["optim.name=adamw", "optim.lr=0.001", "data.num_workers=0", "train.max_steps=3",
       "train.log_every=1", "train.eval_every_epochs=0", "ckpt.every_epochs=0",
       "ckpt.format=sharded", "log.tensorboard=false"]
WEIGHT_BOUND = ["model.name=transformer",
                "model.args={dim: 1024, depth: 12, heads: 16, patch_size: 4}",
                "data.synthetic.train_size=16", "data.synthetic.val_size=4", "data.batch_size=2"]
# About 40 KB of text: 140 training windows of 257 bytes, one validation batch per rank.
TEXT_BYTES = 40_000
ACTIVATION_BOUND = ["task.name=language_model", "model.name=gpt",
                    "model.args={dim: 512, depth: 20, heads: 8, seq_len: 256, dropout: 0.0}",
                    "data.name=text", "data.batch_size=8", "ckpt.monitor=val_loss"]
# What a process says when an allocation fails before the kernel kills anything.
MEMORY_ERRORS = ("MemoryError", "can't allocate memory", "out of memory")
SHAPES = {"weight-bound": WEIGHT_BOUND, "activation-bound": ACTIVATION_BOUND}
MODES = {"ddp": ["parallel.mode=ddp"], "fsdp": ["parallel.mode=fsdp"],
         "fsdp+ac": ["parallel.mode=fsdp", "model.activation_checkpointing=true"]}


def text_file(work: Path) -> Path:
    """A small text the byte-level GPT trains on (any bytes will do for memory)."""
    path = work / "frontier-text.txt"
    if not path.exists():
        line = "the quick brown fox jumps over the lazy dog; 0123456789\n"
        path.write_text((line * (TEXT_BYTES // len(line) + 1))[:TEXT_BYTES])
    return path


def overrides(work: Path, shape: list[str], mode: str) -> list[str]:
    extra = [f"data.root={text_file(work)}"] if "data.name=text" in shape else []
    return [*RUN, *shape, *extra, *MODES[mode]]


def probe(work: Path, base: list[str], value: int, limit: int, key: str = KEY) -> cgroup.Limited:
    """One 2-rank run of `base` with `key`=`value` under `limit` bytes for the whole job."""
    run_dir = work / "runs" / f"probe-{value}"
    cmd = common.dtrain_cmd(run_dir, [*base, f"{key}={value}"], nproc=2)
    try:
        result = cgroup.run(cmd, limit, common.env(timing_malloc=False), common.REPO)
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    memory_error = any(sign in result.stderr for sign in MEMORY_ERRORS)
    if result.returncode != 0 and result.oom_kills <= 0 and not memory_error:
        raise RuntimeError(f"probe {key}={value} failed, not for memory (exit "
                           f"{result.returncode}):\n{result.stderr[-3000:]}")
    print(f"    probe {key}={value}: {'fits' if result.fits else 'does not fit'} (exit "
          f"{result.returncode}, {result.oom_kills} killed for memory, peak "
          f"{result.peak_bytes / 2**20:.0f} MiB)", file=sys.stderr, flush=True)
    return result


def largest(fits: Callable[[int], bool], guess: int, resolution: int = 1) -> tuple[int, int]:
    """The largest value for which `fits` holds (assumed monotone), starting at `guess`: steps
    of about 5 % away from it until the other side is found, then bisection down to
    `resolution`. Returns it and the number of probes."""
    probes = 0

    def check(value: int) -> bool:
        nonlocal probes
        probes += 1
        return fits(value)

    guess = max(1, guess)
    step = max(1, math.ceil(guess * 0.05))
    if check(guess):
        low, high = guess, guess + step
        while check(high):
            low, high, step = high, high + step, 2 * step
    else:
        low, high = guess - step, guess
        while low >= 1 and not check(low):
            high, low, step = low, low - step, 2 * step
        if low < 1:
            if high == 1 or not check(1):
                return 0, probes
            low = 1
    while high - low > resolution:
        middle = (low + high) // 2
        if check(middle):
            low = middle
        else:
            high = middle
    return low, probes


@dataclass
class Frontier:
    shape: str
    mode: str
    measured: int
    params: int
    probes: int
    planned: int | None
    breakdown: str
    resolution: int  # the bisection stopped with the first failing depth at most this far above


def planned(base: list[str], nproc: int, limit: int, key: str = KEY):
    """dtrain plan's fit for `base` (every mode) and its largest value of `key`."""
    from dtrain import config
    from dtrain.commands.plan import fit as plan_fit
    return plan_fit.fit(config.load(None, base), nproc=nproc, limit=limit, grow=key)


def num_params(base: list[str], value: int, key: str = KEY) -> int:
    from dtrain import config
    from dtrain.commands.plan import command as plan
    return plan.estimate(config.load(None, [*base, f"{key}={value}"]), nproc=2).num_params


def measure(work: Path, shape: str, mode: str, plans: dict, limit: int = LIMIT) -> Frontier:
    """The measured frontier of `mode` on `shape`, seeded by `plans` (plan's fit of the shape)."""
    base = overrides(work, SHAPES[shape], mode)
    fit = plans[mode]
    guess = fit.largest or 1
    resolution = max(1, guess // 32)  # within 3 %: well inside the plan's 10 % tolerance
    found, probes = largest(lambda v: probe(work, base, v, limit).fits, guess, resolution)
    at = planned([*base, f"{KEY}={found}"], 2, limit, key="")[mode] if found else fit
    return Frontier(shape, mode, found, num_params(base, found) if found else 0, probes,
                    fit.largest, at.describe(), resolution)


def run(work: Path, rounds: int = 1) -> list[Figure]:
    why = cgroup.available()
    if why:
        return [Figure("frontier: under a 6 GiB cgroup", 0, "", "", f"skipped: {why}")]
    figures = []
    found: dict[tuple[str, str], Frontier] = {}
    for shape in SHAPES:
        plans = planned(overrides(work, SHAPES[shape], "ddp"), 2, LIMIT)  # every mode at once
        for mode in MODES:
            f = found[shape, mode] = measure(work, shape, mode, plans)
            off = (f.planned - f.measured) / f.measured if f.measured and f.planned else math.nan
            within = f"; {f.measured + f.resolution} or less fails" if f.resolution > 1 else ""
            figures.append(Figure(
                f"frontier {shape} {mode}: largest depth", f.measured, "", "",
                f"{f.params / 1e6:.1f} M params ({f.probes} probes"
                f"{within}); "
                f"plan says "
                f"{f.planned} ({off:+.0%}); plan at {f.measured}: {f.breakdown}"))
    ratios = (("weight-bound", "fsdp", ">= 1.9"), ("activation-bound", "fsdp+ac", ">= 4.5"))
    for shape, mode, goal in ratios:
        ddp, other = found[shape, "ddp"], found[shape, mode]
        figures.append(Figure(f"frontier {shape}: {mode}/ddp parameters",
                              other.params / max(1, ddp.params), "x", goal,
                              f"depth {other.measured} vs {ddp.measured} under 6 GiB"))
    return figures


if __name__ == "__main__":
    common.run_standalone(run)
