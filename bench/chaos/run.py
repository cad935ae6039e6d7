"""A chaos run: real training jobs (torchrun on gloo, DDP and FSDP on 2 ranks) through faults
drawn from a seed, every invariant checked after each episode (bench/chaos/README.md).

    python bench/chaos/run.py --faults 40 --seed 1        (make chaos N=40 SEED=1)
    python bench/chaos/run.py --seed 1 --episode 7        (replays episode 7 of seed 1)

Writes OUT/report.md (faults by kind, every violation with its seed, schedule and replay
command) and OUT/episodes.jsonl; exit 1 when any invariant was violated."""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import checks  # noqa: E402
import episode  # noqa: E402
import faults as chaos  # noqa: E402
import torch  # noqa: E402
from jobs import JOBS, REPO  # noqa: E402

DISK_SIZE = "64m"  # an episode's run takes a few MiB; the fault fills the rest


def main() -> int:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--faults", type=int, default=40, help="inject at least this many")
    parser.add_argument("--seed", type=int, default=0, help="the schedule's seed")
    parser.add_argument("--per-episode", type=int, default=3, help="at most this many at once")
    parser.add_argument("--episode", type=int, help="replay this episode of the seed alone")
    parser.add_argument("--jobs", default=",".join(JOBS), help="among these (default: all)")
    parser.add_argument("--kinds", default=",".join(chaos.KINDS),
                        help="among these fault kinds (default: all)")
    parser.add_argument("--out", type=Path, help="default: runs/chaos/seed_<SEED>")
    parser.add_argument("--minutes", type=float, help="start no episode after this long")
    args = parser.parse_args()
    for given, known in ((args.jobs, JOBS), (args.kinds, chaos.KINDS)):
        unknown = sorted(set(given.split(",")) - set(known))
        if unknown:
            parser.error(f"unknown {', '.join(unknown)}; choose from {', '.join(known)}")
    out = args.out or REPO / "runs" / "chaos" / f"seed_{args.seed}"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    disk = _mount(out / "disk")
    kinds = [k for k in args.kinds.split(",") if disk or k != "disk_full"]
    jobs = args.jobs.split(",")
    try:
        return _chaos(args, out, disk, kinds, jobs)
    finally:
        if disk:
            subprocess.run(["umount", str(disk)], capture_output=True)


def _chaos(args: argparse.Namespace, out: Path, disk: Path | None, kinds: list[str],
           jobs: list[str]) -> int:
    work = disk or out / "work"
    references = {}
    for name in jobs:  # each job once without faults: what every episode must end with
        clean = episode.run(JOBS[name], [], work / f"reference_{name}", random.Random(0), None,
                            disk)
        if clean.violations:
            print(f"chaos: the fault-free {name} run fails its own checks: {clean.violations}")
            return 1
        references[name] = checks.final_weights(work / f"reference_{name}" / "run")
        shutil.rmtree(work / f"reference_{name}")
    indices = [args.episode] if args.episode is not None else _episodes(args, kinds, jobs)
    results, began_all = [], time.monotonic()
    for index in indices:
        if args.minutes and time.monotonic() - began_all > args.minutes * 60:
            print(f"chaos: {args.minutes:g} minutes passed; no further episode")
            break
        job, drawn = schedule(args.seed, index, kinds, jobs, args.per_episode)
        sandbox = work / f"episode_{index:04d}"
        began = time.monotonic()
        outcome = episode.run(JOBS[job], drawn, sandbox, random.Random(f"{args.seed}/{index}/d"),
                              references[job], disk)
        results.append((index, outcome))
        _log(out, args.seed, index, outcome)
        state = "ok" if not outcome.violations else f"{len(outcome.violations)} VIOLATIONS"
        print(f"episode {index}: {job}, {' '.join(f.describe() for f in drawn)}: "
              f"{outcome.launches} launches, {time.monotonic() - began:.0f} s, {state}", flush=True)
        for line in outcome.violations:
            print(f"  {line}", flush=True)
        if outcome.violations:  # kept to look at; the rest is deleted
            shutil.copytree(sandbox, out / "violations" / sandbox.name, symlinks=True)
        shutil.rmtree(sandbox, ignore_errors=True)
    report = render(args.seed, results, kinds, skipped=[] if disk else ["disk_full"])
    (out / "report.md").write_text(report)
    print(report)
    return 1 if any(o.violations for _, o in results) else 0


def schedule(seed: int, index: int, kinds: list[str], jobs: list[str], most: int):
    """Episode `index` of `seed`: its job and its faults (the same on every replay)."""
    rng = random.Random(f"{seed}/{index}")
    job = rng.choice(jobs)
    return job, chaos.draw(rng, kinds, rng.randint(1, most))


def _episodes(args: argparse.Namespace, kinds: list[str], jobs: list[str]):
    total, index = 0, 0
    while total < args.faults:
        total += len(schedule(args.seed, index, kinds, jobs, args.per_episode)[1])
        yield index
        index += 1


def _mount(where: Path) -> Path | None:
    """A tmpfs of its own for the runs, that the disk-full fault can fill (None where none can
    be mounted: that kind is then left out, and the report says so)."""
    where.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={DISK_SIZE}", "tmpfs", str(where)],
                          capture_output=True)
    return where if done.returncode == 0 else None


def _log(out: Path, seed: int, index: int, outcome: episode.Outcome) -> None:
    entry = {"seed": seed, "episode": index, "job": outcome.job, "launches": outcome.launches,
             "seconds": round(outcome.seconds, 1), "violations": outcome.violations,
             "faults": [{"kind": f.kind, "step": f.step, "rank": f.rank, "phase": f.phase,
                         "injected": f.injected_at is not None, "detail": f.detail,
                         "recovered_s": f.recovered_s and round(f.recovered_s, 2)}
                        for f in outcome.faults]}
    with open(out / "episodes.jsonl", "a") as f:
        f.write(json.dumps(entry) + "\n")


def render(seed: int, results: list, kinds: list[str], skipped: list[str]) -> str:
    """The report: faults by kind, the phases they landed in, every violation with its replay."""
    lines = [f"# Chaos run, seed {seed}", "",
             f"{len(results)} episodes, {sum(len(o.faults) for _, o in results)} faults, "
             f"{sum(o.launches for _, o in results)} launches, "
             f"{sum(o.seconds for _, o in results) / 60:.1f} minutes; "
             f"{sum(len(o.violations) for _, o in results)} violations", "",
             "| fault | injected | recovered | time to the next step: median | worst | phases |",
             "|---|---|---|---|---|---|"]
    for kind in kinds:
        these = [f for _, o in results for f in o.faults if f.kind == kind and f.injected_at]
        times = [f.recovered_s for f in these if f.recovered_s is not None]
        phases = sorted({f.phase for f in these})
        median = f"{statistics.median(times):.1f} s" if times else "-"
        worst = f"{max(times):.1f} s" if times else "-"
        lines.append(f"| {kind} | {len(these)} | {len(times)} | {median} | {worst} | "
                     f"{', '.join(phases)} |")
    lines += [f"| {kind} | not run: no tmpfs could be mounted here | | | | |" for kind in skipped]
    bad = [(i, o) for i, o in results if o.violations]
    lines += ["", "## Violations", ""] + (["none"] if not bad else [])
    for index, outcome in bad:
        lines.append(f"- episode {index} ({outcome.job}: "
                     f"{' '.join(f.describe() for f in outcome.faults)}); replay: "
                     f"`make chaos SEED={seed} EPISODE={index}`")
        lines += [f"  - {v}" for v in outcome.violations]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    torch.set_num_threads(1)
    sys.exit(main())
