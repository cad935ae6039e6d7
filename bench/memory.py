"""Memory per rank: FSDP against DDP on the same transformer, 2 ranks on gloo.

State bytes (parameters, gradients and AdamW's two moments held by rank 0) come from the run's
own first record (`state_bytes`); `dtrain plan` predicts them, and the prediction is shown next
to the measurement. Peak RSS is the largest rank's peak resident memory over the whole run (model
built, sharded, trained, evaluated and checkpointed), which includes the ~0.5 GiB that PyTorch
itself takes in every process.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from common import Figure  # noqa: E402

MODEL = ["model.name=transformer", "model.args={dim: 512, depth: 8, heads: 8}", "optim.name=adamw",
         "optim.lr=0.001", "data.synthetic.train_size=512", "data.synthetic.val_size=64",
         "data.batch_size=4", "train.max_steps=3", "train.log_every=1", "train.eval_every_epochs=0",
         "ckpt.every_epochs=0", "log.tensorboard=false"]


def run_mode(work: Path, mode: str, tag: str) -> tuple[int, int]:
    """State bytes of rank 0 and the largest rank's peak RSS, for one 2-rank run."""
    run_dir = work / "runs" / f"{mode}-{tag}"
    peak = common.run_peak_rss(common.dtrain_cmd(run_dir, [*MODEL, f"parallel.mode={mode}"], nproc=2))
    return common.records(run_dir)[0]["state_bytes"], peak


def planned_state_bytes(mode: str) -> int:
    from dtrain import config, plan
    estimate = plan.estimate(config.load(None, [*MODEL, f"parallel.mode={mode}"]), nproc=2)
    return estimate.memory_for(mode, "fp32").state


def run(work: Path, rounds: int = 2) -> list[Figure]:
    state: dict[str, int] = {}
    peaks: dict[str, list[int]] = {"ddp": [], "fsdp": []}
    for i in range(rounds):
        for mode in ("ddp", "fsdp"):
            state[mode], peak = run_mode(work, mode, str(i))
            peaks[mode].append(peak)
    mib = 2**20
    ddp_rss, fsdp_rss = common.median(peaks["ddp"]), common.median(peaks["fsdp"])
    planned = {mode: planned_state_bytes(mode) for mode in state}
    matches = all(planned[m] == state[m] for m in state)
    return [
        Figure("memory: state bytes per rank fsdp/ddp (2 ranks)", state["fsdp"] / state["ddp"], "x",
               "<= 0.51", f"{state['fsdp'] / mib:.1f} vs {state['ddp'] / mib:.1f} MiB; dtrain plan "
               f"predicted {'exactly these' if matches else planned}"),
        Figure("memory: peak RSS per rank fsdp/ddp (2 ranks)", fsdp_rss / ddp_rss, "x", "",
               f"{fsdp_rss / mib:.0f} vs {ddp_rss / mib:.0f} MiB, largest rank, medians of {rounds}; "
               f"difference {(ddp_rss - fsdp_rss) / mib:.0f} MiB"),
    ]


if __name__ == "__main__":
    common.run_standalone(run)
