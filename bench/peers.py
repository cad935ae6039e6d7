"""Side by side with the peers: the same job (bench/job.py: model, data, batch, optimizer, seed;
2 ranks, DDP on gloo) trained by dtrain, the plain loop, Lightning's Trainer, Lightning Fabric and
Hugging Face Accelerate, alternated over rounds.

- Steady-state step time: 200 steps each; the median time per step between steps 50 and 200
  from each program's own clock (dtrain: its records every 50 steps; the others: their step ends).
- Start-up: from launching `torchrun` to the end of the first step (a 2-step run of each).
- First losses (mean over ranks, steps 1-5): the same for all five when they train the same thing.
- Per-step cost where the frameworks' own work shows: a tiny model (SimpleCNN width 2, batch 8 per
  rank: a step of a few milliseconds), the same fused SGD for all, no loss read in the timed steps
  of any of them (dtrain records and checks only at its last step), timed by the same clock at
  every step's end inside each rank (bench/peer_loops.py): wall time, this process's CPU time
  (process_time) and its training thread's (thread_time) per step over steps 100 to 998, rank 0,
  medians of at least 9 alternated rounds. Their final weights must agree: the same work. And,
  in a run of each that is not timed, the Python calls (Python and C functions) the training
  thread makes per step: how much code each runs besides the shared model, data and optimizer,
  a count that a busy machine does not move.

The peers are the optional `bench` extra (`pip install -e '.[bench]'`); without them the
benchmark says so and compares dtrain with the plain loop only.
"""

from __future__ import annotations

import importlib.util
import json
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from common import Figure  # noqa: E402

NPROC, STEPS, WINDOW, BATCH, WIDTH = 2, 200, 50, 64, 16
TINY_WIDTH, TINY_BATCH, TINY_STEPS, TINY_FROM, TINY_ROUNDS = 2, 8, 1000, 100, 9
PEERS = {"lightning": "lightning", "fabric": "lightning", "accelerate": "accelerate"}
PEER_LOOPS = str(common.REPO / "bench" / "peer_loops.py")


def _job_args(steps: int) -> list[str]:
    return [f"--steps={steps}", f"--batch={BATCH}", f"--width={WIDTH}",
            f"--train-size={steps * BATCH * NPROC}"]


def _dtrain(work: Path, tag: str, steps: int, log_every: int) -> Path:
    run_dir = work / "runs" / f"dtrain-{tag}"
    common.run(common.dtrain_cmd(run_dir, [
        "model.name=simple_cnn", f"model.args={{width: {WIDTH}}}", "data.name=synthetic",
        f"data.synthetic.train_size={steps * BATCH * NPROC}", "data.synthetic.val_size=128",
        f"data.batch_size={BATCH}", "data.num_workers=0", "optim.lr=0.05", "sched.name=none",
        f"train.max_steps={steps}", f"train.log_every={log_every}", "train.eval_every_epochs=0",
        "ckpt.every_epochs=0", "log.tensorboard=true", "log.progress=lines"], NPROC))
    return run_dir


def _other(work: Path, kind: str, tag: str, steps: int) -> dict:
    out = work / f"{kind}-{tag}"
    script = [common.PLAIN] if kind == "plain" else [PEER_LOOPS, "--framework", kind]
    common.run([*common.launcher(NPROC), *script, *_job_args(steps), f"--out={out}"])
    return json.loads((out / "result.json").read_text())


def step_time(work: Path, kind: str, tag: str) -> float:
    if kind == "dtrain":
        events = [t for step, t in common.scalar_events(_dtrain(work, f"steady-{tag}", STEPS, WINDOW))]
        return (events[-1] - events[0]) / (STEPS - WINDOW)
    ends = _other(work, kind, f"steady-{tag}", STEPS)["step_ends"]
    return (ends[STEPS - 1] - ends[WINDOW - 1]) / (STEPS - WINDOW)


def start_up(work: Path, kind: str, tag: str) -> float:
    launched = time.time()
    if kind == "dtrain":
        return common.scalar_events(_dtrain(work, f"start-{tag}", 2, 1))[0][1] - launched
    return _other(work, kind, f"start-{tag}", 2)["first_step_end"] - launched


def first_losses(work: Path, kind: str) -> list[float]:
    if kind == "dtrain":
        records = common.records(_dtrain(work, "losses", 5, 1))
        return [r["loss"] for r in records if "loss" in r][:5]
    return _other(work, kind, "losses", 5)["losses"][:5]


CLOCKS = {"wall": "step_ends", "CPU": "cpu_ends", "thread CPU": "thread_ends"}
# Two summaries of a run's steps: the mean holds everything the steps took, the machine's slow
# moments included; the typical (median) step is what a step costs when nothing else intervenes,
# and moves far less from run to run on a shared machine.
STATS = {"mean": lambda durations: sum(durations) / len(durations), "typical": common.median}
MEASURES = [f"{clock}, {stat}" for clock in CLOCKS for stat in STATS
            if not (clock == "thread CPU" and stat == "typical")]


def tiny_step(work: Path, kind: str, tag: str) -> tuple[dict[str, float], Path]:
    """Seconds per step of rank 0 over the timed steps (after TINY_FROM, before the last:
    dtrain's one check and record are at the last step) by each measure, and where the weights
    are."""
    result = _tiny_run(work, kind, f"tiny-{kind}-{tag}")
    per_measure = {}
    for clock, key in CLOCKS.items():
        ends = result[key][TINY_FROM - 1:TINY_STEPS - 1]
        durations = [b - a for a, b in zip(ends, ends[1:])]
        for stat, summary in STATS.items():
            per_measure[f"{clock}, {stat}"] = summary(durations)
    return {m: per_measure[m] for m in MEASURES}, work / f"tiny-{kind}-{tag}" / "weights.pt"


def calls_per_step(work: Path, kind: str) -> float:
    """The Python calls rank 0's training thread makes per step over the timed steps, counted in
    a run of its own (counting slows the steps): a figure no busy machine moves."""
    counted = f"--count-calls={TINY_FROM}:{TINY_STEPS - 1}"
    return _tiny_run(work, kind, f"tiny-calls-{kind}", [counted])["calls_per_step"]


def _tiny_run(work: Path, kind: str, name: str, extra: tuple[str, ...] | list[str] = ()) -> dict:
    """The tiny job trained by `kind` at 2 ranks: rank 0's result.json (weights beside it)."""
    out = work / name
    script = [common.PLAIN, "--loss-steps", "5"] if kind == "plain" else [
        PEER_LOOPS, "--framework", kind]
    common.run([*common.launcher(NPROC), *script, f"--steps={TINY_STEPS}", f"--batch={TINY_BATCH}",
                f"--width={TINY_WIDTH}", f"--train-size={TINY_STEPS * TINY_BATCH * NPROC}",
                *extra, f"--out={out}"])
    return json.loads((out / "result.json").read_text())


def per_step_cost(work: Path, kinds: list[str], rounds: int) -> list[Figure]:
    """The tiny model's step, alternated over rounds: each framework's time per step by each
    measure, its cost over the plain loop (median of the per-round differences), the Python
    calls it makes per step, and whether the weights agree."""
    import torch
    times: dict[str, dict[str, list[float]]] = {m: {k: [] for k in kinds} for m in MEASURES}
    weights: dict[str, Path] = {}
    for i in range(rounds):
        order = kinds if i % 2 == 0 else kinds[::-1]  # no framework always runs first
        for kind in order:
            per_measure, weights[kind] = tiny_step(work, kind, str(i))
            for measure, value in per_measure.items():
                times[measure][kind].append(value)

    def over_plain(kind: str, measure: str) -> list[float]:
        return [a - b for a, b in zip(times[measure][kind], times[measure]["plain"], strict=True)]

    figures = []
    for kind in kinds:
        for measure in MEASURES:
            if kind == "plain":
                continue
            values, plain, over = times[measure][kind], times[measure]["plain"], over_plain(
                kind, measure)
            goal = "<= 0.2" if kind == "dtrain" and not measure.startswith("thread") else ""
            detail = (f"{common.median(values) * 1e3:.3f} ms per step, plain "
                      f"{common.median(plain) * 1e3:.3f}; over plain per round "
                      f"{', '.join(f'{d * 1e3:+.3f}' for d in over)}")
            figures.append(Figure(f"tiny step: {kind} - plain ({measure})",
                                  common.median(over) * 1e3, "ms", goal, detail))
    peers = [k for k in kinds if k not in ("dtrain", "plain")]
    for measure in MEASURES:  # dtrain's cost against each peer's, by the same measure
        if not peers or measure.startswith("thread"):
            continue
        cost = {k: common.median(over_plain(k, measure)) for k in kinds if k != "plain"}
        lightest = min(peers, key=cost.__getitem__)
        figures.append(Figure(
            f"tiny step: dtrain - lightest peer ({measure})",
            (cost["dtrain"] - cost[lightest]) * 1e3, "ms", "< 0",
            f"lightest peer {lightest} at {cost[lightest] * 1e3:+.3f} ms over plain"))
    calls = {kind: calls_per_step(work, kind) for kind in kinds}
    for kind in kinds:
        if kind != "plain":
            figures.append(Figure(f"tiny step: Python calls {kind} - plain",
                                  calls[kind] - calls["plain"], "calls", "",
                                  f"{calls[kind]:.0f} calls per step, plain {calls['plain']:.0f}"))
    if peers:
        fewest = min(peers, key=calls.__getitem__)
        figures.append(Figure("tiny step: Python calls dtrain - fewest of the peers",
                              calls["dtrain"] - calls[fewest], "calls", "< 0",
                              f"fewest peer {fewest} at {calls[fewest]:.0f} per step"))
    reference = torch.load(weights["plain"], weights_only=True)
    differences = {k: common.max_weight_difference(
        torch.load(weights[k], weights_only=True), reference) for k in kinds}
    figures.append(Figure("tiny step: final weights max |diff| vs plain",
                          max(differences.values()), "", "<= 1e-6",
                          "; ".join(f"{k} {v:.1e}" for k, v in differences.items())))
    return figures


def installed_kinds() -> tuple[list[str], list[str]]:
    missing = [name for name, module in PEERS.items() if importlib.util.find_spec(module) is None]
    return ["dtrain", "plain", *[name for name in PEERS if name not in missing]], missing


def run(work: Path, rounds: int = 3) -> list[Figure]:
    kinds, missing = installed_kinds()
    steps: dict[str, list[float]] = {k: [] for k in kinds}
    starts: dict[str, list[float]] = {k: [] for k in kinds}
    for i in range(rounds):
        for kind in kinds:  # alternated: a slow moment of the machine falls on all of them
            steps[kind].append(step_time(work, kind, str(i)))
            starts[kind].append(start_up(work, kind, str(i)))
    losses = {kind: first_losses(work, kind) for kind in kinds}
    plain_step, plain_start = common.median(steps["plain"]), common.median(starts["plain"])
    figures = []
    for kind in kinds:
        step, start = common.median(steps[kind]), common.median(starts[kind])
        goal = "<= 1.02" if kind == "dtrain" else ""
        figures.append(Figure(
            f"peers: step time {kind}/plain (2-rank DDP)", step / plain_step, "x", goal,
            f"{step * 1e3:.1f} ms; rounds {', '.join(f'{a / b:.3f}' for a, b in zip(steps[kind], steps['plain']))}"))
        figures.append(Figure(
            f"peers: start-up to first step end, {kind} - plain", start - plain_start, "s",
            "<= 0.5s" if kind == "dtrain" else "",
            f"{start:.2f} s; rounds {', '.join(f'{a - b:+.2f}' for a, b in zip(starts[kind], starts['plain']))}"))
    same = all(abs(a - b) <= 1e-5 for k in kinds for a, b in zip(losses[k], losses["plain"]))
    figures.append(Figure("peers: first losses agree", float(same), "", "",
                          "; ".join(f"{k} {', '.join(f'{v:.5f}' for v in losses[k][:3])}" for k in kinds)))
    figures += per_step_cost(work, kinds, max(rounds, TINY_ROUNDS))
    if missing:
        figures.append(Figure("peers: not installed", len(missing), "", "",
                              f"{', '.join(missing)}: pip install -e '.[bench]' to compare them"))
    return figures


if __name__ == "__main__":
    if sys.argv[1:2] == ["tiny"]:  # the per-step part alone: bench/peers.py tiny [rounds]
        rounds = int(sys.argv[2]) if len(sys.argv) > 2 else TINY_ROUNDS
        common.run_standalone(lambda work: per_step_cost(work, installed_kinds()[0], rounds))
    else:
        common.run_standalone(run)
