"""Replica groups (parallel.replicas, torchft): their cost per step when nothing fails, and the
time a failure costs, against plain DDP and today's restart path on the same two ranks.

The job: the default config's model and batch (configs/default.yaml: simple_cnn width 16, 64
samples per rank, SGD with momentum) on synthetic data, as in bench/ema_cost.py, with the
learning-rate schedule off. Two sides, each on 2 processes:

- ddp: one torchrun of 2 ranks (DDP on gloo), as a run without replica groups is launched;
- replicas: a lighthouse (`python -m dtrain lighthouse`, its defaults: a group is lost after 5 s
  without a heartbeat) and two replica groups of one process each (plain processes; in the
  failure runs each group its own torchrun of one rank), their gradients averaged through
  torchft's Manager.

Speed, no failure: each side trains STEPS steps; a run's step time is the median of its logged
windows after the first (the wall time of dtrain's TensorBoard events every LOG_EVERY steps, as
bench/ema_cost.py reads it); the figure is the median over rounds of ddp/replicas steps per
second within each round, the detail its range. Both sides must end with the same weights: a
failure-free run of replica groups is plain DDP over the same ranks. The groups run as a user's
would, without the sample log (parallel.replicas.sample_log, an audit the failure runs keep on).

A failure: both sides save a checkpoint every CKPT_EVERY steps, as a user would, log every step,
and have a worker killed with SIGKILL at the first step logged from KILL_AT on (replica groups:
once both have also taken TOGETHER steps together), the step under way then lost:

- replicas: group 1's worker (its torchrun, --max-restarts=1, starts it again). Measured from
  the kill, by following the files as they grow: group 0's next committed step, and its first
  step without group 1 (the sample log says how many groups took each step); the "healed from a
  live peer" line of group 1; group 0's first step with both groups again. Steps redone: any
  step a group committed twice and any sample trained twice in an epoch (the sample logs), and
  the steps not committed (each a step's work tried again; the "not committed" lines).
- ddp: rank 1's worker under torchrun --max-restarts=1, which restarts every rank from the last
  checkpoint. Measured from the kill: the next step logged anywhere (a step redone after the
  restart), and the first step past the one logged at the kill; steps redone: those logged
  before the kill and logged again after it.

    python bench/replicas.py [--rounds 3] [--only speed,failure] [--json results.json]
                             [--work DIR]     (keeps the runs and their logs there)

Both sides alternate within a round, each round starting with the other. Needs torchft (the
`replicas` extra). The figures move with the machine's load: the load average is recorded at
every run and given with them.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from common import Figure  # noqa: E402

NPROC, BATCH, STEPS, LOG_EVERY = 2, 64, 300, 50
# Killed at the first step logged from KILL_AT on: half-way between two checkpoints, where the
# restart path redoes CKPT_EVERY / 2 steps on average.
FAIL_STEPS, KILL_AT, CKPT_EVERY, TOGETHER = 1000, 110, 20, 10
CONFIG = str(common.REPO / "configs" / "default.yaml")
SIDES = ("ddp", "replicas")
HEALED = "healed from a live peer"
DIGEST = re.compile(r"replica group (\d+): left at step (\d+), weights digest ([0-9a-f]{64})")
NOT_COMMITTED = "not committed"


def _job(steps: int, log_every: int) -> list[str]:
    return ["data.name=synthetic", f"data.synthetic.train_size={steps * BATCH * NPROC}",
            "data.synthetic.val_size=256", f"data.batch_size={BATCH}", "data.num_workers=0",
            "sched.name=none", "train.epochs=1", f"train.max_steps={steps}",
            f"train.log_every={log_every}", "train.eval_every_epochs=0", "log.tensorboard=true",
            "log.progress=lines"]


def _groups(address: str, group: int, min_groups: int, sample_log: bool = True) -> list[str]:
    """One group's settings; the sample log (a line a step) where the audit reads it."""
    return ["parallel.replicas.groups=2", f"parallel.replicas.group={group}",
            f"parallel.replicas.lighthouse={address}", f"parallel.replicas.min_groups={min_groups}",
            f"parallel.replicas.sample_log={str(sample_log).lower()}"]


def _command(run_dir: Path, overrides: list[str], nproc: int, restarts: int = 0) -> list[str]:
    """dtrain's launch of `overrides` on the default config: torchrun with `nproc` ranks (and
    --max-restarts=`restarts`), or one plain process for nproc 0."""
    cmd = common.dtrain_cmd(run_dir, overrides, nproc, config=CONFIG)
    if restarts:
        cmd.insert(cmd.index(common.TRAIN), f"--max-restarts={restarts}")
    return cmd


def _start(cmd: list[str], log: Path) -> subprocess.Popen:
    with open(log, "w") as out:
        return subprocess.Popen(cmd, cwd=common.REPO, env=common.env(), stdout=out,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)


def _wait(procs: list[subprocess.Popen], logs: list[Path], timeout: float = 600) -> None:
    for proc, log in zip(procs, logs, strict=True):
        if proc.wait(timeout=timeout) != 0:
            raise RuntimeError(f"{log.name}: exited {proc.returncode}:\n{log.read_text()[-3000:]}")


@contextlib.contextmanager
def lighthouse(log: Path) -> Iterator[str]:
    """`dtrain lighthouse` on a free port, with its defaults; yields its address."""
    with open(log, "w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "dtrain", "lighthouse", "--port=0"],
                                cwd=common.REPO, env=common.env(), stdout=subprocess.PIPE,
                                stderr=err, text=True)
    try:
        line = proc.stdout.readline() if proc.stdout else ""
        if "lighthouse listening on" not in line:
            raise RuntimeError(f"the lighthouse did not start: {line}{log.read_text()}")
        yield "http://127.0.0.1:" + line.split()[3].rsplit(":", 1)[1]
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=20)


def _load() -> float:
    return os.getloadavg()[0]


# -- speed, no failure ---------------------------------------------------------------------------

def _step_time(run_dir: Path) -> float:
    ends = [t for step, t in common.scalar_events(run_dir) if step % LOG_EVERY == 0]
    return common.median([b - a for a, b in zip(ends, ends[1:], strict=False)]) / LOG_EVERY


def speed_run(work: Path, side: str, round_: int) -> dict:
    """One failure-free run of `side`: its steady step time, its final weights' place and the
    load average at its end."""
    run_dir = work / "runs" / f"speed-{side}-{round_}"
    if side == "ddp":
        common.run(_command(run_dir, _job(STEPS, LOG_EVERY), NPROC))
    else:
        logs = [work / f"speed-{round_}-lighthouse.log",
                *(work / f"speed-{round_}-group{g}.log" for g in (0, 1))]
        with lighthouse(logs[0]) as address:
            # Both groups from the first step (a group alone would take it by itself).
            groups = [_start(_command(run_dir, [*_job(STEPS, LOG_EVERY),
                                                *_groups(address, g, 2, sample_log=False)], 0), log)
                      for g, log in zip((0, 1), logs[1:], strict=True)]
            _wait(groups, logs[1:])
    return {"step_s": _step_time(run_dir), "run_dir": str(run_dir), "load": _load()}


def speed(work: Path, rounds: int) -> tuple[list[Figure], dict]:
    runs: dict[str, list[dict]] = {side: [] for side in SIDES}
    for i in range(rounds):
        for side in SIDES[i % 2:] + SIDES[:i % 2]:
            runs[side].append(speed_run(work, side, i))
    ratios = [d["step_s"] / r["step_s"] for d, r in zip(runs["ddp"], runs["replicas"], strict=True)]
    extra_ms = [(r["step_s"] - d["step_s"]) * 1e3
                for d, r in zip(runs["ddp"], runs["replicas"], strict=True)]
    ddp_s = common.median([r["step_s"] for r in runs["ddp"]])
    rep_s = common.median([r["step_s"] for r in runs["replicas"]])
    difference = common.max_weight_difference(
        common.final_weights(Path(runs["ddp"][-1]["run_dir"])),
        common.final_weights(Path(runs["replicas"][-1]["run_dir"])))
    same = "weights identical" if difference == 0 else f"weights differ by up to {difference:.2g}"
    loads = [run["load"] for side in SIDES for run in runs[side]]
    figures = [
        Figure("replicas: steps/s, 2 groups of 1 / 2-rank DDP", common.median(ratios), "x",
               ">= 0.95", f"{1 / rep_s:.1f} vs {1 / ddp_s:.1f} steps/s; per round "
               f"{min(ratios):.3f}-{max(ratios):.3f}; {same}; load {min(loads):.1f}-"
               f"{max(loads):.1f}"),
        Figure("replicas: the Manager's cost per step", common.median(extra_ms), "ms", "",
               f"{rep_s * 1e3:.2f} vs {ddp_s * 1e3:.2f} ms per step; per round "
               f"{min(extra_ms):.2f}-{max(extra_ms):.2f} ms"),
    ]
    return figures, {"runs": runs, "ratios": ratios, "extra_ms": extra_ms,
                     "weights_difference": difference}


# -- a failure -----------------------------------------------------------------------------------

class Follow:
    """Files followed as they grow: each new whole line with the time it was first seen,
    polled every 10 ms. A file replaced (metrics.jsonl, cut back to the checkpoint's step when
    a run resumes) is read again from its start, its lines already seen left out."""

    def __init__(self, files: dict[str, Path]) -> None:
        self.files = files
        self.places = {name: (0, 0) for name in files}  # (inode, offset)
        self.seen: dict[str, list[tuple[float, str]]] = {name: [] for name in files}
        # The step records among them (metrics.jsonl, a sample log), read once.
        self.steps: dict[str, list[tuple[float, dict]]] = {name: [] for name in files}

    def poll(self) -> None:
        now = time.time()
        for name, path in self.files.items():
            with contextlib.suppress(FileNotFoundError), open(path, "rb") as f:
                inode, offset = self.places[name]
                replaced = os.fstat(f.fileno()).st_ino != inode
                f.seek(0 if replaced else offset)
                text = f.read()
                whole = text[:text.rfind(b"\n") + 1]  # a line still being written: next time
                self.places[name] = (os.fstat(f.fileno()).st_ino,
                                     (0 if replaced else offset) + len(whole))
                known = {line for _, line in self.seen[name]} if replaced else set()
                for line in whole.decode().splitlines():
                    if line not in known:
                        self.seen[name].append((now, line))
                        record = _record_of(line)
                        if "step" in record:
                            self.steps[name].append((now, record))

    def until(self, done: Callable[[], bool], procs: list[subprocess.Popen],
              timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while True:
            self.poll()
            if done():
                return
            if time.monotonic() > deadline or any(p.poll() not in (None, 0) for p in procs):
                raise RuntimeError(f"gave up following {', '.join(map(str, self.files.values()))}")
            time.sleep(0.01)

    def records(self, name: str, after: float = 0.0) -> list[tuple[float, dict]]:
        """(time seen, record) of each step record seen at or after `after`."""
        return [(t, r) for t, r in self.steps[name] if t >= after]

    def lines(self, name: str, after: float = 0.0) -> list[tuple[float, str]]:
        return [(t, line) for t, line in self.seen[name] if t >= after]

    def last_step(self, name: str, before: float = float("inf")) -> int:
        return max((r["step"] for t, r in self.records(name) if t < before), default=0)


def _record_of(line: str) -> dict:
    """A record of a line, or {} for another line (a log's, one torn by a kill)."""
    try:
        record = json.loads(line) if line.startswith("{") else {}
    except ValueError:
        return {}
    return record if isinstance(record, dict) else {}


def _workers(pid: int) -> dict[int, int]:
    """The workers of the torchrun agent `pid`, by their RANK."""
    children: dict[int, list[int]] = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError, ValueError, IndexError):
            stat = Path(f"/proc/{entry}/stat").read_text()
            children.setdefault(int(stat.rsplit(")", 1)[1].split()[1]), []).append(int(entry))
    found, todo = {}, [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            todo.append(child)
            with contextlib.suppress(OSError):
                environ = Path(f"/proc/{child}/environ").read_bytes().split(b"\0")
                ranks = [v[5:] for v in environ if v.startswith(b"RANK=")]
                if ranks and _TRAIN in Path(f"/proc/{child}/cmdline").read_bytes():
                    found[int(ranks[0])] = child
    return found


_TRAIN = os.fsencode(common.TRAIN)


def _kill_at(follow: Follow, procs: list[subprocess.Popen], torchrun: subprocess.Popen,
             rank: int) -> float:
    """Once follow's "metrics" has logged step KILL_AT: SIGKILL to the worker of `rank` under
    the agent `torchrun`; the time of the kill."""
    follow.until(lambda: follow.last_step("metrics") >= KILL_AT, procs)
    os.kill(_workers(torchrun.pid)[rank], signal.SIGKILL)
    return time.time()


def _first(seen: list, test: Callable = lambda _: True) -> float:
    return next((t for t, item in seen if test(item)), float("nan"))


def replicas_failure(work: Path, round_: int) -> dict:
    """Group 1's worker killed at step KILL_AT; group 0 steps on, group 1 restarts and heals."""
    run_dir = work / "runs" / f"failure-replicas-{round_}"
    logs = [work / f"failure-{round_}-lighthouse.log",
            *(work / f"failure-{round_}-group{g}.log" for g in (0, 1))]
    samples = [run_dir / "replica_samples.rank0.jsonl",
               run_dir / "replicas" / "group_1" / "replica_samples.rank0.jsonl"]
    follow = Follow({"metrics": run_dir / "metrics.jsonl", "samples": samples[0],
                     "log1": logs[2]})
    overrides = [*_job(FAIL_STEPS, 1), f"ckpt.every_steps={CKPT_EVERY}"]
    with lighthouse(logs[0]) as address:
        groups = [_start(_command(run_dir, [*overrides, *_groups(address, g, min_groups=1)], 1,
                                  restarts=g), log)
                  for g, log in zip((0, 1), logs[1:], strict=True)]
        # Both groups stepping before the kill (group 1 may start late, and group 0 steps alone
        # until it joins): TOGETHER steps of both groups first.
        follow.until(lambda: sum(r["groups"] == 2 for _, r in follow.records("samples"))
                     >= TOGETHER, groups)
        killed = _kill_at(follow, groups, groups[1], 0)
        at_kill = follow.last_step("metrics", before=killed)

        def together_again() -> bool:
            healed = _first(follow.lines("log1", killed), lambda line: HEALED in line)
            return any(r["groups"] == 2 for _, r in follow.records("samples", healed))

        follow.until(together_again, groups)
        _wait(groups, logs[1:])
    after = follow.records("samples", killed)
    healed = _first(follow.lines("log1", killed), lambda line: HEALED in line)
    return {
        "at_kill": at_kill, "load": _load(),
        "next_step_s": _first(after) - killed,
        "alone_s": _first(after, lambda r: r["groups"] == 1) - killed,
        "healed_s": healed - killed,
        "together_s": _first([x for x in after if x[0] >= healed],
                             lambda r: r["groups"] == 2) - killed,
        **_replicas_redone(samples, logs[1:]),
    }


def _replicas_redone(samples: list[Path], logs: list[Path]) -> dict:
    """What the sample logs and the groups' logs say was done twice."""
    twice_steps, twice_samples = 0, 0
    per_epoch: dict[int, Counter] = {}
    for path in samples:
        steps = Counter(json.loads(line)["step"] for line in path.read_text().splitlines())
        twice_steps += sum(n - 1 for n in steps.values())
        for line in path.read_text().splitlines():
            for epoch, index in json.loads(line)["samples"]:
                per_epoch.setdefault(epoch, Counter())[index] += 1
    twice_samples = sum(n - 1 for counts in per_epoch.values() for n in counts.values())
    texts = [log.read_text() for log in logs]
    digests = {found for text in texts for found in DIGEST.findall(text)}
    return {"steps_committed_twice": twice_steps, "samples_trained_twice": twice_samples,
            "steps_not_committed": sum(text.count(NOT_COMMITTED) for text in texts),
            "equal_digests": {group for group, _, _ in digests} == {"0", "1"}
            and len({(step, digest) for _, step, digest in digests}) == 1}


def ddp_failure(work: Path, round_: int) -> dict:
    """Rank 1 killed at step KILL_AT; torchrun restarts both ranks from the last checkpoint."""
    run_dir = work / "runs" / f"failure-ddp-{round_}"
    log = work / f"failure-{round_}-ddp.log"
    follow = Follow({"metrics": run_dir / "metrics.jsonl"})
    job = _start(_command(run_dir, [*_job(FAIL_STEPS, 1), f"ckpt.every_steps={CKPT_EVERY}"],
                          NPROC, restarts=1), log)
    killed = _kill_at(follow, [job], job, 1)
    # The restart's first record is the first with a world_size (each attempt's first has it);
    # rank 0 may have logged a step or two between the kill and its own end.
    follow.until(lambda: any("world_size" in r for _, r in follow.records("metrics", killed)),
                 [job])
    restarted = _first(follow.records("metrics", killed), lambda r: "world_size" in r)
    at_kill = follow.last_step("metrics", before=killed)
    last = follow.last_step("metrics", before=restarted)
    follow.until(lambda: follow.last_step("metrics") > last, [job])
    _wait([job], [log])
    after = follow.records("metrics", restarted)
    resumed_at = after[0][1]["step"] - 1
    return {
        "at_kill": at_kill, "last_before_restart": last, "resumed_at": resumed_at,
        "load": _load(), "next_step_s": restarted - killed,
        "past_kill_s": _first(after, lambda r: r["step"] > last) - killed,
        "steps_redone": last - resumed_at,
    }


def failure(work: Path, rounds: int) -> tuple[list[Figure], dict]:
    runs: dict[str, list[dict]] = {side: [] for side in SIDES}
    measure = {"ddp": ddp_failure, "replicas": replicas_failure}
    for i in range(rounds):
        for side in SIDES[i % 2:] + SIDES[:i % 2]:
            runs[side].append(measure[side](work, i))

    def spread(side: str, key: str) -> tuple[float, str]:
        values = [run[key] for run in runs[side]]
        return common.median(values), f"{min(values):.1f}-{max(values):.1f} s over rounds"

    rep, ddp = runs["replicas"], runs["ddp"]
    loads = [run["load"] for side in SIDES for run in runs[side]]
    figures = [Figure(f"replicas, kill -9 of group 1: {what}", *spread("replicas", key)[:1], "s",
                      "", spread("replicas", key)[1])
               for what, key in [("group 0's next committed step", "next_step_s"),
                                 ("group 0's first step alone", "alone_s"),
                                 ("group 1 healed from group 0", "healed_s"),
                                 ("both groups stepping again", "together_s")]]
    figures.append(Figure(
        "replicas, kill -9 of group 1: steps redone", sum(r["steps_committed_twice"] for r in rep),
        "steps", "", f"samples trained twice {sum(r['samples_trained_twice'] for r in rep)}; "
        f"steps not committed (tried again) {[r['steps_not_committed'] for r in rep]}; equal "
        f"final digests {all(r['equal_digests'] for r in rep)}; killed at "
        f"{[r['at_kill'] for r in rep]}"))
    figures += [Figure(f"ddp, kill -9 of rank 1: {what}", *spread("ddp", key)[:1], "s", "",
                       spread("ddp", key)[1])
                for what, key in [("the next step (after the restart)", "next_step_s"),
                                  ("back past the step at the kill", "past_kill_s")]]
    figures.append(Figure(
        "ddp, kill -9 of rank 1: steps redone", common.median([r["steps_redone"] for r in ddp]),
        "steps", "", f"per round {[r['steps_redone'] for r in ddp]} (checkpoint every "
        f"{CKPT_EVERY} steps, killed at {[r['at_kill'] for r in ddp]}); load "
        f"{min(loads):.1f}-{max(loads):.1f}"))
    return figures, runs


PARTS = {"speed": speed, "failure": failure}


def run(work: Path, rounds: int = 3, only: tuple[str, ...] = tuple(PARTS),
        results: dict | None = None) -> list[Figure]:
    figures: list[Figure] = []
    for name in only:
        part, detail = PARTS[name](work, rounds)
        figures += part
        if results is not None:
            results[name] = detail
    return figures


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--only", default=",".join(PARTS), help="speed, failure or both")
    parser.add_argument("--json", default="", help="write every run's figures to this file")
    parser.add_argument("--work", default="", help="keep the runs and their logs in this folder "
                        "(default: a temporary one)")
    args = parser.parse_args()
    chosen = tuple(name.strip() for name in args.only.split(",") if name.strip())
    measured: dict = {"load_at_start": os.getloadavg(), "cores": os.cpu_count()}
    with tempfile.TemporaryDirectory(prefix="dtrain-bench-") as tmp:
        work = Path(args.work or tmp)
        work.mkdir(parents=True, exist_ok=True)
        for figure in run(work, args.rounds, chosen, measured):
            print(figure.line(), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(measured, indent=1, default=str))
