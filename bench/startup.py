"""Start-up: time from launching `torchrun --nproc_per_node=2` to the end of the first training
step, for dtrain and for the plain loop, on the same small job.

The clock starts just before the launcher process is created; the first step's end is taken from
each program's own wall clock (rank 0): the plain loop's `first_step_end`, and the time of
dtrain's first TensorBoard event (logged right after step 1). Runs alternate; medians.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from common import Figure  # noqa: E402

NPROC, TRAIN_SIZE, BATCH, WIDTH = 2, 2048, 64, 16


def dtrain_start(work: Path, tag: str) -> float:
    run_dir = work / "runs" / f"startup-{tag}"
    cmd = common.dtrain_cmd(run_dir, [
        "model.name=simple_cnn", f"model.args={{width: {WIDTH}}}",
        f"data.synthetic.train_size={TRAIN_SIZE}", "data.synthetic.val_size=128",
        f"data.batch_size={BATCH}", "data.num_workers=0", "train.max_steps=2", "train.log_every=1",
        "log.tensorboard=true"], NPROC)
    launched = time.time()
    common.run(cmd)
    return common.scalar_events(run_dir)[0][1] - launched


def plain_start(work: Path, tag: str) -> float:
    out = work / f"startup-plain-{tag}"
    cmd = [*common.launcher(NPROC), common.PLAIN, "--steps=2", f"--batch={BATCH}", f"--width={WIDTH}",
           f"--train-size={TRAIN_SIZE}", f"--out={out}"]
    launched = time.time()
    common.run(cmd)
    return json.loads((out / "result.json").read_text())["first_step_end"] - launched


def run(work: Path, rounds: int = 5) -> list[Figure]:
    ours, plain = common.alternate(rounds, lambda i: dtrain_start(work, str(i)),
                                   lambda i: plain_start(work, str(i)))
    a, b = common.median(ours), common.median(plain)
    return [Figure(f"start-up: launch to first step end, dtrain - plain ({NPROC} ranks)", a - b, "s",
                   "<= 0.5s", f"{a:.2f} vs {b:.2f} s (medians of {rounds}); per round "
                   f"{', '.join(f'{x - y:+.2f}' for x, y in zip(ours, plain))} s")]


if __name__ == "__main__":
    common.run_standalone(run)
