"""Overhead: dtrain against the plain hand-written loop (bench/plain_loop.py) on the same model,
data, seed and steps, as 1 process and as 2-rank DDP on gloo.

Step time is the steady-state wall-clock time per step with everything between two steps
included (data loading, forward, backward, all-reduces, optimizer, and dtrain's logging, progress
and decisions). It is read from each program's own clock: the plain loop's step-end times, and
the wall time of dtrain's TensorBoard events at every logged step. Windows of LOG_EVERY steps
after the first are timed, each run gives their median, and the runs alternate (dtrain, plain,
dtrain, ...) for several rounds. The final weights of the two must be identical.

Wall-clock time moves with whatever else the machine runs: on a shared machine run the
benchmarks with a higher priority (`nice -n -10 make bench` as root) or expect noise.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from common import Figure  # noqa: E402

STEPS, LOG_EVERY, BATCH, WIDTH, LR = 60, 10, 64, 16, 0.05


def _train_size(nproc: int) -> int:
    return STEPS * BATCH * max(1, nproc)  # one epoch: no epoch boundary inside the timed windows


def _per_step(ends: list[float]) -> float:
    """Median of the windows between consecutive logged steps, per step."""
    return common.median([b - a for a, b in zip(ends, ends[1:])]) / LOG_EVERY


def dtrain_run(work: Path, nproc: int, steps: int, tag: str) -> tuple[list[str], Path]:
    run_dir = work / "runs" / f"dtrain-{nproc}-{steps}-{tag}"
    return common.dtrain_cmd(run_dir, [
        "model.name=simple_cnn", f"model.args={{width: {WIDTH}}}", "data.name=synthetic",
        f"data.synthetic.train_size={_train_size(nproc)}", "data.synthetic.val_size=256",
        f"data.batch_size={BATCH}", f"optim.lr={LR}", "optim.momentum=0.9",
        "optim.weight_decay=5e-4", "sched.name=none", "train.epochs=1", f"train.max_steps={steps}",
        f"train.log_every={LOG_EVERY}", "train.eval_every_epochs=0", "ckpt.every_epochs=0",
        "log.tensorboard=true", "log.progress=lines"], nproc), run_dir


def plain_run(work: Path, nproc: int, steps: int, tag: str) -> tuple[list[str], Path]:
    out = work / f"plain-{nproc}-{steps}-{tag}"
    return [*common.launcher(nproc), common.PLAIN, f"--steps={steps}", f"--batch={BATCH}",
            f"--width={WIDTH}", f"--train-size={_train_size(nproc)}", f"--lr={LR}",
            f"--out={out}"], out


def _wall_per_step(kind: str, where: Path) -> float:
    if kind == "dtrain":
        return _per_step([t for step, t in common.scalar_events(where) if step % LOG_EVERY == 0])
    ends = json.loads((where / "result.json").read_text())["step_ends"]
    return _per_step(ends[LOG_EVERY - 1::LOG_EVERY])


def measure(work: Path, nproc: int, rounds: int) -> list[Figure]:
    import torch
    builders = {"dtrain": dtrain_run, "plain": plain_run}
    wall: dict[str, list[float]] = {"dtrain": [], "plain": []}
    outputs: dict[str, Path] = {}
    for i in range(rounds):
        for kind, build in builders.items():  # alternate: a slow moment hits both alike
            cmd, where = build(work, nproc, STEPS, str(i))
            common.run(cmd)
            wall[kind].append(_wall_per_step(kind, where))
            outputs.setdefault(kind, where)
    weights = common.final_weights(outputs["dtrain"])
    reference = torch.load(outputs["plain"] / "weights.pt", weights_only=True)
    difference = common.max_weight_difference(weights, reference)
    label = "1 process" if nproc == 0 else f"{nproc}-rank DDP, gloo"
    ours, plain = common.median(wall["dtrain"]), common.median(wall["plain"])
    return [
        Figure(f"overhead: step time dtrain/plain ({label})", ours / plain, "x", "<= 1.02",
               f"{ours * 1e3:.1f} vs {plain * 1e3:.1f} ms per step; per round "
               f"{', '.join(f'{a / b:.3f}' for a, b in zip(wall['dtrain'], wall['plain']))}"),
        Figure(f"overhead: final weights max |diff| ({label})", difference, "", "<= 1e-6",
               "identical" if difference <= 1e-6 else "weights differ"),
    ]


def run(work: Path, rounds: int = 3) -> list[Figure]:
    return measure(work, 0, rounds) + measure(work, 2, rounds)


if __name__ == "__main__":
    with tempfile.TemporaryDirectory(prefix="dtrain-bench-") as tmp:
        for figure in run(Path(tmp)):
            print(figure.line(), flush=True)
