"""The README's headline: what `make train` gives. The default config (configs/default.yaml) as
`make train` runs it, 2-rank torchrun, with only the run directory moved to a temporary folder:
the validation accuracy after each epoch and the wall time of the whole launch, from the command
to torchrun's exit (creating the virtual environment is not included).

    python bench/headline.py
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from common import Figure  # noqa: E402

CONFIG = str(common.REPO / "configs" / "default.yaml")


def run(work: Path, rounds: int = 1) -> list[Figure]:
    figures = []
    for i in range(rounds):
        run_dir = work / "runs" / f"headline-{i}"
        began = time.perf_counter()
        # glibc's default malloc settings and the config as it is: what a user's `make train` gets.
        common.run(common.dtrain_cmd(run_dir, [], nproc=2, config=CONFIG), timing_malloc=False)
        wall_s = time.perf_counter() - began
        evaluations = [r for r in common.records(run_dir) if "val_acc" in r]
        accuracy = {r["epoch"]: r["val_acc"] for r in evaluations}
        suffix = f" (round {i + 1})" if rounds > 1 else ""
        # val_acc is a multiple of 1/2000 on the default validation set: four digits say which.
        figures += [Figure(f"make train: val accuracy after epoch {epoch}{suffix}", 100 * acc, "%",
                           detail=f"val_acc {acc:.4f}") for epoch, acc in sorted(accuracy.items())]
        figures.append(Figure(f"make train: wall time, {max(accuracy)} epochs{suffix}", wall_s, "s",
                              detail=f"launch to exit, {evaluations[-1]['step']} steps"))
    return figures


if __name__ == "__main__":
    common.run_standalone(run)
