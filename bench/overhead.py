"""Overhead: dtrain against the plain hand-written loop (bench/plain_loop.py) on the same model,
data, seed and steps, as 1 process and as 2-rank DDP on gloo.

Step time is the steady-state wall-clock time per step with everything between two steps
included (data loading, forward, backward, all-reduces, optimizer, and dtrain's logging, progress
and decisions). It is read from each program's own clock: the plain loop's step-end times, and
the wall time of dtrain's TensorBoard events at every logged step (every 50 steps, dtrain's
default). Windows after the first are timed, each run gives their median, and the runs alternate
(dtrain, plain, dtrain, ...) for several rounds. The final weights of the two must be identical.

On a shared machine a run's speed moves by 10-20% with what else runs, more than the overhead
itself. So dtrain's own cost per step is also measured where it stands out: the same comparison
with a tiny model whose step takes a few milliseconds. Run the benchmarks with a higher priority
(`nice -n -10 make bench` as root) on a shared machine.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from common import Figure  # noqa: E402

LOG_EVERY, LR = 50, 0.05


@dataclass(frozen=True)
class Job:
    width: int  # SimpleCNN width
    batch: int  # per rank
    steps: int

    def train_size(self, nproc: int) -> int:
        return self.steps * self.batch * max(1, nproc)  # one epoch: no epoch end while timed


DEFAULT = Job(width=16, batch=64, steps=150)  # the default config's model and batch
TINY = Job(width=2, batch=8, steps=300)  # a step of a few ms: dtrain's own cost stands out


def _per_step(ends: list[float]) -> float:
    """Median of the windows between consecutive logged steps, per step."""
    return common.median([b - a for a, b in zip(ends, ends[1:])]) / LOG_EVERY


def dtrain_run(work: Path, nproc: int, job: Job, tag: str) -> tuple[list[str], Path]:
    run_dir = work / "runs" / f"dtrain-{nproc}-{job.width}-{tag}"
    return common.dtrain_cmd(run_dir, [
        "model.name=simple_cnn", f"model.args={{width: {job.width}}}", "data.name=synthetic",
        f"data.synthetic.train_size={job.train_size(nproc)}", "data.synthetic.val_size=256",
        f"data.batch_size={job.batch}", "data.num_workers=0", f"optim.lr={LR}", "optim.momentum=0.9",
        "optim.weight_decay=5e-4", "sched.name=none", "train.epochs=1",
        f"train.max_steps={job.steps}", f"train.log_every={LOG_EVERY}", "train.eval_every_epochs=0",
        "ckpt.every_epochs=0", "log.tensorboard=true", "log.progress=lines"], nproc), run_dir


def plain_run(work: Path, nproc: int, job: Job, tag: str) -> tuple[list[str], Path]:
    out = work / f"plain-{nproc}-{job.width}-{tag}"
    return [*common.launcher(nproc), common.PLAIN, f"--steps={job.steps}", f"--batch={job.batch}",
            f"--width={job.width}", f"--train-size={job.train_size(nproc)}", f"--lr={LR}",
            f"--out={out}"], out


def _wall_per_step(kind: str, where: Path) -> float:
    if kind == "dtrain":
        return _per_step([t for step, t in common.scalar_events(where) if step % LOG_EVERY == 0])
    ends = json.loads((where / "result.json").read_text())["step_ends"]
    return _per_step(ends[LOG_EVERY - 1::LOG_EVERY])


def compare(work: Path, nproc: int, job: Job, rounds: int) -> tuple[list[float], list[float], float]:
    """Per-step times of dtrain and of the plain loop, alternated `rounds` times, and the largest
    difference between their final weights."""
    import torch
    builders = {"dtrain": dtrain_run, "plain": plain_run}
    wall: dict[str, list[float]] = {"dtrain": [], "plain": []}
    outputs: dict[str, Path] = {}
    for i in range(rounds):
        for kind, build in builders.items():  # alternate: a slow moment hits both alike
            cmd, where = build(work, nproc, job, str(i))
            common.run(cmd)
            wall[kind].append(_wall_per_step(kind, where))
            outputs.setdefault(kind, where)
    weights = common.final_weights(outputs["dtrain"])
    reference = torch.load(outputs["plain"] / "weights.pt", weights_only=True)
    return wall["dtrain"], wall["plain"], common.max_weight_difference(weights, reference)


def _rounds(ours: list[float], plain: list[float]) -> str:
    return ", ".join(f"{a / b:.3f}" for a, b in zip(ours, plain))


def run(work: Path, rounds: int = 3) -> list[Figure]:
    figures = []
    plain_default_step = None
    for nproc, label in ((0, "1 process"), (2, "2-rank DDP, gloo")):
        ours, plain, difference = compare(work, nproc, DEFAULT, rounds)
        a, b = common.median(ours), common.median(plain)
        plain_default_step = plain_default_step or b
        figures += [
            Figure(f"overhead: step time dtrain/plain ({label})", a / b, "x", "<= 1.02",
                   f"{a * 1e3:.1f} vs {b * 1e3:.1f} ms per step; per round {_rounds(ours, plain)}"),
            Figure(f"overhead: final weights max |diff| ({label})", difference, "", "<= 1e-6",
                   "identical" if difference <= 1e-6 else "weights differ"),
        ]
    ours, plain, _ = compare(work, 0, TINY, rounds)
    cost = common.median(ours) - common.median(plain)
    figures.append(Figure("overhead: dtrain's own cost per step (tiny model)", cost * 1e3, "ms", "",
                          f"{common.median(ours) * 1e3:.2f} vs {common.median(plain) * 1e3:.2f} ms; "
                          f"on the default model's {plain_default_step * 1e3:.0f} ms step: ratio "
                          f"{1 + cost / plain_default_step:.3f}"))
    return figures


if __name__ == "__main__":
    common.run_standalone(run)
