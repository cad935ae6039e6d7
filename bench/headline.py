"""The README's headline: what `make train` gives. The default config (configs/default.yaml) as
`make train` runs it, 2-rank torchrun, with only the run directory moved to a temporary folder:
the validation accuracy after each epoch and the wall time of the whole launch, from the command
to torchrun's exit (creating the virtual environment is not included).

    python bench/headline.py
    python bench/headline.py --seeds 5 --kernels all --stop-after 2   # the spread, early epochs
    python bench/headline.py --seeds 2 --kernels all optim.lr=0.05     # another recipe

--seeds N runs seeds 0..N-1 (run.seed), or from --first-seed S on; --kernels runs each seed
again with the CPU kernels' rounding perturbed (another thread count, oneDNN off, AVX2 instead of
AVX-512 kernels): the same recipe, summed in another order. --stop-after K ends each run after
epoch K, with the schedule of the whole run. Overrides apply to every run.
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from common import Figure  # noqa: E402

CONFIG = str(common.REPO / "configs" / "default.yaml")
# Each perturbation of the kernels' rounding: environment variables for the ranks, and whether
# the ranks run with oneDNN (mkldnn) off, through kernels_off.py.
KERNELS: dict[str, tuple[dict[str, str], bool]] = {
    "as make train": ({}, False),
    "2 threads": ({"OMP_NUM_THREADS": "2"}, False),
    "oneDNN off": ({}, True),
    "AVX2 kernels": ({"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}, False),
}
KERNELS_OFF = str(Path(__file__).resolve().parent / "kernels_off.py")


def launch(run_dir: Path, seed: int, kernels: str, overrides: list[str],
           stop_after: int | None) -> tuple[dict[int, float], int, float]:
    """One `make train` launch: the validation accuracy after each epoch, the last step and the
    wall time. With stop_after, the launch is ended once epoch stop_after has been evaluated."""
    extra_env, onednn_off = KERNELS[kernels]
    cmd = common.dtrain_cmd(run_dir, [f"run.seed={seed}", *overrides], nproc=2, config=CONFIG)
    if onednn_off:
        cmd.insert(cmd.index(common.TRAIN), KERNELS_OFF)
    # glibc's default malloc settings and the config as it is: what a user's `make train` gets.
    env = {**common.env(timing_malloc=False), **extra_env}
    log = run_dir.parent / f"{run_dir.name}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    began = time.perf_counter()
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, cwd=common.REPO, env=env, stdout=out, stderr=out,
                                start_new_session=True)
    metrics = run_dir / "metrics.jsonl"
    while proc.poll() is None:
        time.sleep(1)
        if stop_after and metrics.exists() and stop_after in _accuracy(run_dir):
            # torchrun stops its ranks (each saves a checkpoint, as on a preemption) and exits.
            proc.send_signal(signal.SIGTERM)
            proc.wait()
            break
    else:
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd[:6])} ... exited {proc.returncode}:\n"
                               f"{log.read_text()[-3000:]}")
    wall_s = time.perf_counter() - began
    evaluations = [r for r in common.records(run_dir) if "val_acc" in r]
    return _accuracy(run_dir), evaluations[-1]["step"], wall_s


def _accuracy(run_dir: Path) -> dict[int, float]:
    """Validation accuracy by epoch (1 = after the first), from the run's records so far."""
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines if line.endswith("}")]
    return {r["epoch"]: r["val_acc"] for r in records if "val_acc" in r}


def run(work: Path, rounds: int = 1, seeds: int = 1, first_seed: int = 0,
        kernels: list[str] | None = None, overrides: list[str] | None = None,
        stop_after: int | None = None) -> list[Figure]:
    figures = []
    rows = []
    names = kernels or ["as make train"]
    for i in range(rounds):
        for seed in range(first_seed, first_seed + seeds):
            for name in names:
                run_dir = work / "runs" / f"headline-{i}-{seed}-{len(rows)}"
                accuracy, step, wall_s = launch(run_dir, seed, name, overrides or [], stop_after)
                rows.append((seed, name, accuracy))
                label = "" if (rounds, seed, seeds, names) == (1, 0, 1, ["as make train"]) else \
                    f" (seed {seed}, {name}{f', round {i + 1}' if rounds > 1 else ''})"
                # val_acc is a multiple of 1/2000 on the default validation set: four digits
                # say which.
                figures += [Figure(f"make train: val accuracy after epoch {epoch}{label}",
                                   100 * acc, "%", detail=f"val_acc {acc:.4f}")
                            for epoch, acc in sorted(accuracy.items())]
                figures.append(Figure(f"make train: wall time, {max(accuracy)} epochs{label}",
                                      wall_s, "s", detail=f"launch to exit, {step} steps"))
    if len(rows) > 1:
        for epoch in sorted({e for _, _, acc in rows for e in acc}):
            values = [acc[epoch] for _, _, acc in rows if epoch in acc]
            figures.append(Figure(f"make train: spread after epoch {epoch}, {len(values)} runs",
                                  100 * min(values), "%",
                                  detail=f"min {min(values):.4f} max {max(values):.4f}"))
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=1, help="run N seeds (default 1)")
    parser.add_argument("--first-seed", type=int, default=0, help="the first (default 0)")
    parser.add_argument("--kernels", default="as make train",
                        help=f"comma-separated subset of: {', '.join(KERNELS)}; or all")
    parser.add_argument("--stop-after", type=int, default=None, metavar="K",
                        help="end each run after epoch K (the whole run's schedule)")
    parser.add_argument("overrides", nargs="*", help="section.key=value for every run")
    args = parser.parse_args()
    kernels = list(KERNELS) if args.kernels == "all" else args.kernels.split(",")
    unknown = [k for k in kernels if k not in KERNELS]
    if unknown:
        parser.error(f"unknown kernels {', '.join(unknown)}; choose from {', '.join(KERNELS)}")
    with tempfile.TemporaryDirectory(prefix="dtrain-bench-") as tmp:
        for figure in run(Path(tmp), seeds=args.seeds, kernels=kernels, first_seed=args.first_seed,
                          overrides=args.overrides, stop_after=args.stop_after):
            print(figure.line(), flush=True)


if __name__ == "__main__":
    main()
