"""The jobs a chaos run trains, and the processes of one launch of them (an attempt).

Each job is a real `torchrun` launch of launch/train.py on gloo, with the relaunch a user's
launcher would make: torchrun's own `--max-restarts` restarts the workers when one fails, and a
plain rerun of the same command follows a launch that ended (a preemption, every process killed)
before the run was done, as a SLURM requeue or a person would."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TRAIN = str(REPO / "launch" / "train.py")
HERE = Path(__file__).resolve().parent

# 512 samples in batches of 16 on 2 ranks: 16 steps an epoch, 32 in all; a checkpoint every 4.
STEPS = 32
SAVE_EVERY = 4
STALL_S = 12.0  # dist.timeout_s: a rank stopped longer than this is named and the run ends
COMMON = [
    "model.name=chaos_model:paced_cnn", "model.args={width: 8, delay_s: 0.03}",
    "data.synthetic.train_size=512", "data.synthetic.val_size=64", "data.batch_size=16",
    "data.num_workers=0", "train.epochs=2", "train.log_every=1", "optim.lr=0.05",
    "sched.name=none", f"ckpt.every_steps={SAVE_EVERY}", "ckpt.keep_last=3",
    "parallel.replicas.sample_log=true", f"dist.timeout_s={STALL_S:g}", "log.tensorboard=true",
    "log.progress=lines", "train.nan_policy=stop",
]


@dataclass(frozen=True)
class Job:
    name: str
    overrides: tuple[str, ...]
    nproc: int = 2

    def command(self, run_dir: Path, restarts: int) -> list[str]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        torchrun = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={self.nproc}",
                    "--nnodes=1", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
                    f"--max-restarts={restarts}",
                    "--signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGUSR1"]
        return [*torchrun, TRAIN, *COMMON, *self.overrides,
                f"run.out_dir={run_dir.parent}", f"run.name={run_dir.name}"]


JOBS = {
    "ddp": Job("ddp", ("parallel.mode=ddp",)),
    "fsdp": Job("fsdp", ("parallel.mode=fsdp",)),  # sharded checkpoints (ckpt.format=auto)
}


def environment(requests: Path, tmp: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_", "MASTER_", "TORCHELASTIC"))}
    path = [str(HERE), str(REPO / "src"), env.get("PYTHONPATH", "")]
    env.update(PYTHONPATH=os.pathsep.join(p for p in path if p), CHAOS_REQUESTS=str(requests),
               TMPDIR=str(tmp), PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    return env


class Attempt:
    """One launch: torchrun in a session of its own (its id is torchrun's pid), its output in
    a file."""

    def __init__(self, job: Job, run_dir: Path, restarts: int, env: dict, output: Path) -> None:
        self.output = output
        with open(output, "w") as out:
            self.proc = subprocess.Popen(job.command(run_dir, restarts), cwd=REPO, env=env,
                                         stdout=out, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        self.started = time.monotonic()
        self.known: set[tuple[int, int]] = set()  # (pid, start time) of its processes

    def running(self) -> bool:
        return self.proc.poll() is None

    def workers(self) -> dict[int, int]:
        """rank -> pid of the workers torchrun runs now."""
        found = {}
        for pid in _children(self.proc.pid):
            try:
                environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            for item in environ:
                if item.startswith(b"RANK="):
                    found[int(item[5:])] = pid
        return found

    def note(self) -> None:
        """Remember every process of this launch now (torchrun starts its workers in sessions
        of their own, and a worker outlives a killed agent for a moment)."""
        todo = [self.proc.pid]
        while todo:
            pid = todo.pop()
            started = _start_time(pid)
            if started is not None:
                self.known.add((pid, started))
                todo += _children(pid)

    def alive(self) -> list[int]:
        """The processes of this launch that still run."""
        self.note()
        return [pid for pid, started in self.known if _start_time(pid) == started]

    def signal_all(self, sig: int) -> None:
        for pid in self.alive():
            send(pid, sig)

    def wait(self, timeout: float) -> int | None:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None

    def text(self) -> str:
        return self.output.read_text(errors="replace")


def _children(pid: int) -> list[int]:
    try:
        tasks = Path(f"/proc/{pid}/task").iterdir()
        return [int(c) for t in tasks for c in (t / "children").read_text().split()]
    except OSError:
        return []


def _start_time(pid: int) -> int | None:
    """A live process's start time (to tell it from a later one of the same pid), else None."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if fields[0] in ("Z", "X") else int(fields[19])


def send(pid: int, sig: int) -> None:
    """`sig` to `pid`, which may have ended meanwhile."""
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def records_logged(run_dir: Path) -> list[tuple[int, str]]:
    """metrics.jsonl's training records as (step, line), in the order written (a torn last
    line left out: the run may be writing it). A record is told from an earlier one of its step
    by its line (its time, its figures)."""
    found: list[tuple[int, str]] = []
    try:
        text = (run_dir / "metrics.jsonl").read_text(errors="replace")
    except FileNotFoundError:
        return found
    for line in text.splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and "loss" in record and "step" in record:
            found.append((int(record["step"]), line))
    return found
