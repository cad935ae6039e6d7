"""EMA cost: dtrain's step time with train.ema on against off, at the default config's model and
batch (configs/default.yaml: simple_cnn width 16, 64 samples per rank).

Three kinds of run alternate for several rounds (off, on, on with train.nan_policy=skip, whose
update is weighted on the device by "not skipped"), on the same data, seed and steps. A run's
step time is the median of its logged windows after the first (the wall time of dtrain's
TensorBoard events every 50 steps, as bench/overhead.py reads it); a kind's figure is the median
over rounds of on/off within each round, and the detail gives the range over rounds. The losses
of every run must be the same: the average never feeds back into training.

    python bench/ema_cost.py [--rounds 5] [--nproc 0|2]      (nproc 0: one process)
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from common import Figure  # noqa: E402

LOG_EVERY, STEPS, BATCH = 50, 250, 64
KINDS = {
    "off": [],
    "on": ["train.ema.decay=0.999"],
    "on, nan_policy=skip": ["train.ema.decay=0.999", "train.nan_policy=skip"],
}


def _run(work: Path, kind: str, nproc: int, round_: int) -> tuple[float, list[float]]:
    """One run of `kind`: its steady step time in seconds and its losses."""
    run_dir = work / "runs" / f"{kind.replace(' ', '').replace(',', '-')}-{nproc}-{round_}"
    overrides = [
        *KINDS[kind], "data.name=synthetic",
        f"data.synthetic.train_size={STEPS * BATCH * max(1, nproc)}",  # one epoch, no epoch end
        "data.synthetic.val_size=256", f"data.batch_size={BATCH}", "data.num_workers=0",
        "sched.name=none", "train.epochs=1", f"train.max_steps={STEPS}",
        f"train.log_every={LOG_EVERY}", "train.eval_every_epochs=0", "ckpt.every_epochs=0",
        "log.tensorboard=true", "log.progress=lines"]
    common.run(common.dtrain_cmd(run_dir, overrides, nproc, config=str(common.REPO / "configs"
                                                                          / "default.yaml")))
    ends = [t for step, t in common.scalar_events(run_dir) if step % LOG_EVERY == 0]
    per_step = common.median([b - a for a, b in zip(ends, ends[1:], strict=False)]) / LOG_EVERY
    losses = [r["loss"] for r in common.records(run_dir) if "loss" in r]
    return per_step, losses


def update_time(device: str = "cpu", calls: int = 500) -> float:
    """Seconds one update of the average takes on the default model's parameters, timed alone
    in this process (free of the machine's noise that moves whole runs)."""
    import time

    import torch

    from dtrain import config, models
    from dtrain.loop.ema import EmaWeights

    cfg = config.load(str(common.REPO / "configs" / "default.yaml"), [])
    info = {"num_classes": 10, "in_channels": 3, "image_size": 32}
    model = models.build(cfg.model, info, seed=0).to(device)
    ema = EmaWeights(model, decay=0.999, every_steps=1, evaluates=False)
    for step in range(1, 21):  # warm-up
        ema.update(step, None)
    if device == "cuda":
        torch.cuda.synchronize()
    began = time.perf_counter()
    for step in range(1, calls + 1):
        ema.update(step, None)
    if device == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - began) / calls


def run(work: Path, rounds: int = 5, nproc: int = 0) -> list[Figure]:
    times: dict[str, list[float]] = {kind: [] for kind in KINDS}
    losses: dict[str, list[list[float]]] = {kind: [] for kind in KINDS}
    for i in range(rounds):
        # Alternated, each round starting with another kind: a slow moment of the machine (or
        # a GPU's clock still rising) falls on every kind alike.
        for kind in [*KINDS][i % len(KINDS):] + [*KINDS][: i % len(KINDS)]:
            step_s, kind_losses = _run(work, kind, nproc, i)
            times[kind].append(step_s)
            losses[kind].append(kind_losses)
    same = _losses_compared(losses)
    off = times["off"]
    where = "1 process" if not nproc else f"{nproc}-rank DDP"
    figures = []
    for kind in ("on", "on, nan_policy=skip"):
        ratios = [a / b for a, b in zip(times[kind], off, strict=True)]
        figures.append(Figure(
            f"ema: step time on/off ({kind}; {where})", common.median(ratios), "x", "<= 1.05",
            f"{common.median(times[kind]) * 1e3:.2f} vs {common.median(off) * 1e3:.2f} ms per "
            f"step; per round {min(ratios):.3f}-{max(ratios):.3f}; {same}"))
    alone = update_time("cuda" if _cuda() else "cpu")
    figures.append(Figure(
        "ema: one update alone, share of the step without", alone / common.median(off) * 100, "%",
        "<= 5%", f"{alone * 1e6:.0f} us per update against {common.median(off) * 1e3:.2f} ms"))
    return figures


def _losses_compared(losses: dict[str, list[list[float]]]) -> str:
    """Where runs without EMA repeat their losses exactly (the CPU), every run with it must have
    the same ones: the average never feeds back. A GPU's nondeterministic kernels make runs
    differ among themselves; then the spread with EMA is said beside the spread without."""
    reference = losses["off"][0]

    def spread(runs: list[list[float]]) -> float:
        return max(abs(a - b) for run in runs for a, b in zip(run, reference, strict=True))

    if spread(losses["off"]) == 0.0:
        if any(spread(runs) for runs in losses.values()):
            raise RuntimeError("the losses with EMA differ from those without: it fed back")
        return "losses identical"
    return (f"losses within {max(spread(r) for r in losses.values()):.2g} of each other "
            f"(without EMA: {spread(losses['off']):.2g}; nondeterministic kernels)")


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--nproc", type=int, default=0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="dtrain-bench-") as tmp:
        for figure in run(Path(tmp), args.rounds, args.nproc):
            print(figure.line(), flush=True)
