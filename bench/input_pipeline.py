"""Input pipeline: the share of step time spent waiting for data, on the default config
(configs/default.yaml: 2-rank DDP, the synthetic set with augmentation, loading in the training
process). The trainer logs `data_wait_pct` for every window of `train.log_every` steps; the first
window (warm-up) is left out and the median of the others is reported.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from common import Figure  # noqa: E402

STEPS, LOG_EVERY = 100, 20


def run(work: Path, rounds: int = 1) -> list[Figure]:
    shares, step_times = [], []
    for i in range(rounds):
        run_dir = work / "runs" / f"pipeline-{i}"
        common.run(common.dtrain_cmd(run_dir, [f"train.max_steps={STEPS}", f"train.log_every={LOG_EVERY}"],
                                     nproc=2, config=str(common.REPO / "configs" / "default.yaml")))
        windows = [r for r in common.records(run_dir) if "data_wait_pct" in r][1:]
        shares += [r["data_wait_pct"] for r in windows]
        step_times += [r["step_time_s"] for r in windows]
    return [Figure("input pipeline: data wait / step time (default config)", common.median(shares), "%",
                   "< 5%", f"step {common.median(step_times) * 1e3:.1f} ms; windows "
                   f"{', '.join(f'{s:.1f}' for s in shares)} %")]


if __name__ == "__main__":
    common.run_standalone(run)
