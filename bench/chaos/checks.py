"""What must hold after every episode, however many faults it took: each check returns the
violations it found, one line each."""

from __future__ import annotations

import fcntl
import json
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import torch
from jobs import REPO, STEPS

TRAIN_SIZE = 512
sys.path.insert(0, str(REPO / "src"))  # (dtrain's loader reads the final checkpoints)


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    """The model of the run's newest checkpoint, read by dtrain's own loader (full or sharded)."""
    from dtrain.commands.export.checkpoint_model import load_model

    saved = sorted((p for p in (run_dir / "checkpoints").glob("step_*") if p.is_dir()),
                   key=lambda p: int(p.name[5:11]))
    model, _ = load_model(str(saved[-1]))
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def weights(run_dir: Path, reference: dict[str, torch.Tensor]) -> list[str]:
    try:
        found = final_weights(run_dir)
    except Exception as error:  # noqa: BLE001 - any failure to read it is the violation
        return [f"weights: the final checkpoint does not load: {str(error).splitlines()[0]}"]
    differ = [k for k in reference if k not in found or not torch.equal(found[k], reference[k])]
    return [f"weights: {len(differ)} tensors differ from the fault-free run's ({differ[0]}, ...)"
            ] if differ else []


def samples(run_dir: Path) -> list[str]:
    """Each rank's sample log: a step trained again after a resume drew the same samples as
    before; the steps are 1..STEPS; over the ranks, each sample once in each epoch."""
    problems: list[str] = []
    per_epoch: dict[int, Counter] = {}
    logs = sorted(run_dir.glob("replica_samples.rank*.jsonl"))
    if not logs:
        return ["samples: no sample log"]
    for path in logs:
        last: dict[int, list] = {}
        for line in path.read_text().splitlines():
            try:
                entry = json.loads(line)
            except ValueError:
                continue  # (a line torn by a kill)
            step, keys = entry["step"], entry["samples"]
            if step in last and last[step] != keys:
                problems.append(f"samples: {path.name} step {step} drew other samples when "
                                f"trained again")
            last[step] = keys
        if sorted(last) != list(range(1, STEPS + 1)):
            missing = sorted(set(range(1, STEPS + 1)) - set(last))
            problems.append(f"samples: {path.name} lacks steps {missing[:5]}")
        for keys in last.values():
            for epoch, index in keys:
                per_epoch.setdefault(epoch, Counter())[index] += 1
    for epoch, counts in sorted(per_epoch.items()):
        twice = [i for i, n in counts.items() if n > 1]
        if twice or len(counts) != TRAIN_SIZE:
            problems.append(f"samples: epoch {epoch}: {len(counts)} of {TRAIN_SIZE} samples, "
                            f"{len(twice)} trained more than once")
    return problems


def records(run_dir: Path) -> list[str]:
    """metrics.jsonl and TensorBoard: every step's training record once, 1..STEPS."""
    problems = []
    steps = []
    for line in (run_dir / "metrics.jsonl").read_text(errors="replace").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            problems.append("records: a damaged line in metrics.jsonl")
            continue
        if "loss" in record and "step" in record:
            steps.append(record["step"])
    if steps != list(range(1, STEPS + 1)):
        problems.append(f"records: metrics.jsonl's steps are not 1..{STEPS} once each: "
                        f"{_runs(steps)}")
    board = tensorboard_steps(run_dir / "tb")
    if board != list(range(1, STEPS + 1)):
        problems.append(f"records: TensorBoard's train/loss steps are not 1..{STEPS} once each: "
                        f"{_runs(board)}")
    return problems


def tensorboard_steps(folder: Path) -> list[int]:
    import logging

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    # (its warning on the steps a resume wrote again: those it then leaves out, as shown)
    logging.getLogger("tensorboard").setLevel(logging.ERROR)

    events = EventAccumulator(str(folder), size_guidance={"scalars": 0})
    events.Reload()
    tag = next((t for t in events.Tags()["scalars"] if t.endswith("loss") and "val" not in t), None)
    return sorted(e.step for e in events.Scalars(tag)) if tag else []


def _runs(steps: list[int]) -> str:
    """A list of steps in short: `1-12, 9-32`."""
    parts, start = [], None
    for i, step in enumerate(steps):
        if start is None:
            start = step
        if i + 1 == len(steps) or steps[i + 1] != step + 1:
            parts.append(f"{start}-{step}" if step != start else f"{step}")
            start = None
    return ", ".join(parts) or "none"


def checkpoints(run_dir: Path, damaged: list[str], outputs: str) -> list[str]:
    """No resume from a checkpoint the harness damaged; each damaged one named; the rest
    verify (`dtrain verify`)."""
    problems = []
    resumed = re.findall(r"resumed from \S*/(step_[^\s/]+)", outputs)
    for name in damaged:
        if name in resumed:
            problems.append(f"checkpoints: resumed from {name}, which was damaged")
        if not re.search(rf"checkpoint {re.escape(name)} is unusable", outputs):
            problems.append(f"checkpoints: the damaged {name} was never named")
    check = subprocess.run([sys.executable, "-m", "dtrain", "verify", str(run_dir)],
                           capture_output=True, text=True, cwd=REPO, timeout=300)
    if check.returncode != 0:
        problems.append(f"checkpoints: dtrain verify exit {check.returncode}: "
                        f"{(check.stdout + check.stderr).strip().splitlines()[-1:]}")
    return problems


def leftovers(sandbox: Path, run_dir: Path, live: list[int]) -> list[str]:
    """Nothing beside the run's folders in the episode's sandbox, nothing in its temporary
    folder, no save in progress or partial file in the run, no lock held, no process left."""
    problems = []
    beside = sorted(p.name for p in sandbox.iterdir()) if sandbox.is_dir() else []
    # (runs.csv: the index of the runs in run.out_dir, dtrain's, with its lock)
    ours = ("run", "requests", "tmp", "runs.csv", "runs.csv.lock")
    extra = [n for n in beside if n not in ours and not n.startswith("launch_")]
    if extra:
        problems.append(f"leftovers: written beside the run: {extra}")
    # torch's own folders there (torchrun's per-launch files, the compiler's cache) are not dtrain's
    left = sorted(p.name for p in (sandbox / "tmp").iterdir()
                  if not p.name.startswith(("torchelastic_", "torchinductor_")))
    if left:
        problems.append(f"leftovers: left in TMPDIR: {left}")
    partial = [str(p.relative_to(run_dir)) for p in run_dir.rglob("*")
               if p.name.startswith(".tmp-") or p.name.endswith((".partial", ".tmp"))]
    if partial:
        problems.append(f"leftovers: partial files in the run: {partial[:5]}")
    lock = run_dir / ".lock"
    if lock.exists():
        with open(lock) as f:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                problems.append("leftovers: the run's .lock is still held")
    if live:
        problems.append(f"leftovers: processes of the job still alive: {live}")
    return problems


TRACEBACK = re.compile(r"Traceback \(most recent call last\)")
# torchrun's agent itself, stopped by the signal it forwards (its SignalException): torch's
# launcher's way to end, under which dtrain's ranks saved and exited 0.
AGENT_STOPPED = re.compile(r"torch\.distributed\.elastic\.multiprocessing\.api\.SignalException: "
                           r"Process \d+ got signal: \d+")


def endings(outputs: list[str]) -> list[str]:
    """No launch's output holds a Python traceback: every end is a named line."""
    problems = []
    for i, text in enumerate(outputs):
        for found in TRACEBACK.finditer(text):
            where = text[found.start():].splitlines()[1:80]
            last = next((ln for ln in where if ln and not ln.startswith(" ")), "")
            if not AGENT_STOPPED.match(last):
                problems.append(f"endings: launch {i + 1} printed a traceback ({last[:160]})")
    return problems
