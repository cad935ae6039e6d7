"""Memory per rank: FSDP against DDP on a transformer of 151 M parameters (dim 1024, depth 12),
AdamW, fp32, 2 ranks on gloo, 3 steps.

- State bytes (parameters, gradients and AdamW's two moments held by rank 0) come from the run's
  own first record (`state_bytes`), next to what `dtrain plan` predicts.
- Peak RSS is measured from outside the processes: the largest rank's peak resident memory over
  the whole run (built, sharded, trained, evaluated, checkpointed), which includes what PyTorch
  itself takes in every process. Memory runs use glibc's default allocator settings, as users
  get, not the fixed ones the timing benchmarks share.
- Start-up: the time from the process's start to the end of its first step (the run's own
  `start-up:` log line).
- Fits where DDP does not: both runs again in a memory cgroup whose limit lies between what the
  two need (root and a cgroup memory controller only; otherwise said and skipped).
"""

from __future__ import annotations

import re
import shutil
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent))
import cgroup  # noqa: E402
import common  # noqa: E402
from common import Figure  # noqa: E402

MODEL = ["model.name=transformer", "model.args={dim: 1024, depth: 12, heads: 16, patch_size: 4}",
         "optim.name=adamw", "optim.lr=0.001", "data.synthetic.train_size=64",
         "data.synthetic.val_size=16", "data.batch_size=2", "data.num_workers=0",
         "train.max_steps=3", "train.log_every=1", "train.eval_every_epochs=0",
         "ckpt.every_epochs=0", "log.tensorboard=false"]


def run_mode(work: Path, mode: str, tag: str) -> tuple[int, int, float]:
    """State bytes of rank 0, the largest rank's peak RSS, and rank 0's start-up seconds."""
    run_dir = work / "runs" / f"{mode}-{tag}"
    cmd = common.dtrain_cmd(run_dir, [*MODEL, f"parallel.mode={mode}"], nproc=2)
    peak = common.run_peak_rss(cmd, timing_malloc=False)
    log = (run_dir / "log.txt").read_text()
    startup = re.search(r"\(([\d.]+) s since the process started\)", log)
    state = common.records(run_dir)[0]["state_bytes"]
    # Its final checkpoint (1.8 GB) would only weigh on the disk for the benchmarks after this one.
    shutil.rmtree(run_dir)
    return state, peak, float(startup.group(1))


def planned(mode: str) -> tuple[int, int]:
    """dtrain plan's state bytes and total per rank for `mode`."""
    from dtrain import config
    from dtrain.commands.plan import command as plan
    estimate = plan.estimate(config.load(None, [*MODEL, f"parallel.mode={mode}"]), nproc=2)
    memory = estimate.memory_for(mode, "fp32")
    return memory.state, memory.total


def under_limit(work: Path, mode: str, limit: int) -> tuple[int, int, int] | None:
    """Run `mode` inside a memory cgroup of `limit` bytes: its exit code, how many of its
    processes the kernel killed for memory, and the job's peak usage (None: no cgroup here)."""
    if cgroup.available():
        return None
    run_dir = work / "runs" / f"limited-{mode}"
    cmd = common.dtrain_cmd(run_dir, [*MODEL, f"parallel.mode={mode}"], nproc=2)
    try:
        result = cgroup.run(cmd, limit, common.env(timing_malloc=False), common.REPO, timeout=900)
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    return result.returncode, result.oom_kills, result.peak_bytes


def run(work: Path, rounds: int = 2) -> list[Figure]:
    state: dict[str, int] = {}
    peaks: dict[str, list[int]] = {"ddp": [], "fsdp": []}
    startups: dict[str, list[float]] = {"ddp": [], "fsdp": []}
    for i in range(rounds):
        for mode in ("ddp", "fsdp"):
            state[mode], peak, startup = run_mode(work, mode, str(i))
            peaks[mode].append(peak)
            startups[mode].append(startup)
    mib = 2**20
    ddp_rss, fsdp_rss = common.median(peaks["ddp"]), common.median(peaks["fsdp"])
    plans = {mode: planned(mode) for mode in state}
    matches = all(plans[m][0] == state[m] for m in state)
    figures = [
        Figure("memory: state bytes per rank fsdp/ddp (151 M params)", state["fsdp"] / state["ddp"],
               "x", "<= 0.51", f"{state['fsdp'] / mib:.0f} vs {state['ddp'] / mib:.0f} MiB; dtrain "
               f"plan predicted {'exactly these' if matches else [plans[m][0] for m in plans]}"),
        Figure("memory: peak RSS per rank fsdp/ddp (151 M params)", fsdp_rss / ddp_rss, "x",
               "<= 0.5", f"{fsdp_rss / mib:.0f} vs {ddp_rss / mib:.0f} MiB, largest rank, "
               f"medians of {rounds}; "
               f"plan's total per rank {plans['fsdp'][1] / mib:.0f} vs {plans['ddp'][1] / mib:.0f} "
               f"MiB (state, activations, buffers: without what torch itself takes)"),
        Figure("memory: start-up to the end of the first step, fsdp",
               common.median(startups["fsdp"]), "s", "",
               f"ddp {common.median(startups['ddp']):.1f} s (rank 0, from process start)"),
    ]
    # Both ranks together, plus the torchrun agent: a limit between what FSDP and DDP need.
    limit = int((2 * fsdp_rss + 2 * ddp_rss) / 2)
    limited = {mode: under_limit(work, mode, limit) for mode in ("fsdp", "ddp")}
    if None in limited.values():
        figures.append(Figure("memory: under a cgroup limit", 0, "", "",
                              "skipped: no cgroup memory controller (or not root) here"))
    else:
        said = {mode: f"{mode} exit {code}, {kills} process(es) killed for memory, job peak "
                      f"{peak / mib:.0f} MiB" for mode, (code, kills, peak) in limited.items()}
        figures.append(Figure("memory: under a cgroup limit, fsdp's exit code", limited["fsdp"][0],
                              "", "", f"limit {limit / mib:.0f} MiB for the whole job: "
                              f"{said['fsdp']}; {said['ddp']}"))
    return figures


if __name__ == "__main__":
    common.run_standalone(run)
