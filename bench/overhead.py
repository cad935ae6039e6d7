"""Overhead: dtrain against the plain hand-written loop (bench/plain_loop.py) on the same model,
data, seed and steps, as 1 process and as 2-rank DDP on gloo.

Step time is the steady-state wall-clock time per step, everything between two steps included
(data loading, forward, backward, all-reduces, optimizer, and dtrain's logging, progress and
decisions). It is read from each program's own clock: the plain loop's step-end times, and the
wall time of dtrain's TensorBoard events at every logged step. Windows of LOG_EVERY steps after
the first are timed; each run gives their median, and the runs alternate, dtrain then plain, for
several rounds. The final weights of the two must be identical.
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

STEPS, LOG_EVERY, BATCH, WIDTH, LR = 50, 10, 64, 16, 0.05


def _train_size(nproc: int) -> int:
    return STEPS * BATCH * max(1, nproc)  # one epoch: no epoch boundary inside the timed windows


def _per_step(ends: list[float]) -> float:
    """Median of the windows between consecutive logged steps, per step."""
    windows = [b - a for a, b in zip(ends, ends[1:])]
    return common.median(windows) / LOG_EVERY


def run_dtrain(work: Path, nproc: int, tag: str) -> tuple[float, Path]:
    run_dir = work / "runs" / f"dtrain-{nproc}-{tag}"
    common.run(common.dtrain_cmd(run_dir, [
        "model.name=simple_cnn", f"model.args={{width: {WIDTH}}}", "data.name=synthetic",
        f"data.synthetic.train_size={_train_size(nproc)}", "data.synthetic.val_size=256",
        f"data.batch_size={BATCH}", f"optim.lr={LR}", "optim.momentum=0.9",
        "optim.weight_decay=5e-4", "sched.name=none", "train.epochs=1", f"train.max_steps={STEPS}",
        f"train.log_every={LOG_EVERY}", "train.eval_every_epochs=0", "ckpt.every_epochs=0",
        "log.tensorboard=true", "log.progress=lines"], nproc))
    ends = [t for step, t in common.scalar_events(run_dir) if step % LOG_EVERY == 0]
    return _per_step(ends), run_dir


def run_plain(work: Path, nproc: int, tag: str) -> tuple[float, Path]:
    out = work / f"plain-{nproc}-{tag}"
    common.run([*common.launcher(nproc), common.PLAIN, f"--steps={STEPS}", f"--batch={BATCH}",
                f"--width={WIDTH}", f"--train-size={_train_size(nproc)}", f"--lr={LR}",
                f"--out={out}"])
    ends = json.loads((out / "result.json").read_text())["step_ends"]
    return _per_step(ends[LOG_EVERY - 1::LOG_EVERY]), out


def measure(work: Path, nproc: int, rounds: int) -> list[Figure]:
    import torch
    firsts: dict[str, Path] = {}

    def timed(kind: str):
        def measure_once(i: int) -> float:
            per_step, where = (run_dtrain if kind == "dtrain" else run_plain)(work, nproc, str(i))
            firsts.setdefault(kind, where)
            return per_step
        return measure_once

    ours, plain = common.alternate(rounds, timed("dtrain"), timed("plain"))
    weights = common.final_weights(firsts["dtrain"])
    reference = torch.load(firsts["plain"] / "weights.pt", weights_only=True)
    difference = common.max_weight_difference(weights, reference)
    label = "1 process" if nproc == 0 else f"{nproc}-rank DDP, gloo"
    ratio = common.median(ours) / common.median(plain)
    return [
        Figure(f"overhead: step time dtrain / plain ({label})", ratio, "x", "<= 1.02",
               f"dtrain {common.median(ours) * 1e3:.1f} ms, plain {common.median(plain) * 1e3:.1f} ms "
               f"per step (medians of {rounds} alternated runs)"),
        Figure(f"overhead: final weights, max |dtrain - plain| ({label})", difference, "", "<= 1e-6",
               "identical up to float rounding" if difference <= 1e-6 else "weights differ"),
    ]


def run(work: Path, rounds: int = 3) -> list[Figure]:
    return measure(work, 0, rounds) + measure(work, 2, rounds)


if __name__ == "__main__":
    with tempfile.TemporaryDirectory(prefix="dtrain-bench-") as tmp:
        for figure in run(Path(tmp)):
            print(figure.line(), flush=True)
