"""Exit codes of finished runs: many short 2-rank launches (DDP and FSDP), every one must exit 0.

torch/gloo teardown has been seen to abort a worker at interpreter exit after a complete run
("terminate called without an active exception", SIGABRT), about once in 26 launches; dtrain
leaves with os._exit after closing what it owns so that this cannot happen. This benchmark
counts: `python bench/exit_codes.py [--rounds N]` launches N runs per mode (default 20).
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from common import Figure  # noqa: E402

TINY = ["model.name=simple_cnn", "model.args={width: 8}", "data.synthetic.train_size=256",
        "data.synthetic.val_size=64", "data.batch_size=16", "train.max_steps=8",
        "log.tensorboard=false", "ckpt.every_steps=4", "data.num_workers=0"]


def run(work: Path, rounds: int = 20) -> list[Figure]:
    import subprocess
    figures = []
    for mode in ("ddp", "fsdp"):
        codes = []
        for i in range(rounds):
            cmd = common.dtrain_cmd(work / mode / f"run{i}", [*TINY, f"parallel.mode={mode}"], nproc=2)
            proc = subprocess.run(cmd, cwd=common.REPO, env=common.env(), text=True,
                                  capture_output=True, timeout=300)
            codes.append(proc.returncode)
            if proc.returncode != 0:
                print(f"  {mode} run {i}: exit {proc.returncode}\n{proc.stderr[-1500:]}", flush=True)
        failed = sum(code != 0 for code in codes)
        figures.append(Figure(f"exit codes: failed 2-rank {mode} launches", failed, "runs", "<= 0",
                              f"{rounds - failed} of {rounds} exited 0"))
    return figures


if __name__ == "__main__":
    rounds = int(sys.argv[sys.argv.index("--rounds") + 1]) if "--rounds" in sys.argv else 20
    common.run_standalone(lambda work: run(work, rounds))
