"""What the benchmarks share: real launches of dtrain and of the plain loop, their records, and
the figures they report."""

from __future__ import annotations

import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

REPO = Path(__file__).resolve().parents[1]
TRAIN = str(REPO / "launch" / "train.py")
PLAIN = str(REPO / "bench" / "plain_loop.py")
sys.path.insert(0, str(REPO / "src"))


@dataclass
class Figure:
    """One measured figure, the goal it is held against and whether it met it."""
    name: str
    value: float
    unit: str  # "x" for ratios, "s", "%", "MiB", ...
    goal: str = ""  # e.g. "<= 1.02"; empty for figures that only inform
    detail: str = ""

    @property
    def met(self) -> Optional[bool]:
        if not self.goal:
            return None
        op, bound = self.goal.split()
        bound_value = float(bound.rstrip("x%s"))
        return {"<=": self.value <= bound_value, ">=": self.value >= bound_value,
                "<": self.value < bound_value, ">": self.value > bound_value}[op]

    def line(self) -> str:
        value = f"{self.value:.3f}{self.unit}" if self.unit == "x" else f"{self.value:.3g} {self.unit}"
        verdict = {None: "", True: "met", False: "MISSED"}[self.met]
        goal = f"goal {self.goal:<9} {verdict:<6}" if self.goal else " " * 23
        return f"  {self.name:<48} {value:>12}  {goal} {self.detail}"


# glibc's malloc returns freed memory to the system and maps large blocks afresh, so every step
# pays page faults for its activations, more or fewer depending on the heap's layout: a process
# that imported more modules happened to fault less, which made the plain loop ~30% slower than
# dtrain on the CPU. Both sides get the same settings that keep freed memory for reuse.
MALLOC_SETTINGS = {"MALLOC_MMAP_THRESHOLD_": str(2**30), "MALLOC_TRIM_THRESHOLD_": str(2**30)}


def env(extra: Optional[dict] = None, timing_malloc: bool = True) -> dict:
    """One intra-op thread per process, as torchrun sets for several ranks, so that runs on a
    shared machine do not fight over cores; the same allocator settings for every program
    (timing_malloc; without it, glibc's defaults, as users get, for measuring memory); no
    inherited launcher variables."""
    out = dict(os.environ)
    out.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    if timing_malloc:
        out.update(MALLOC_SETTINGS)
    else:
        for name in MALLOC_SETTINGS:
            out.pop(name, None)
    out["PYTHONPATH"] = os.pathsep.join([str(REPO / "src"), out.get("PYTHONPATH", "")])
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "SLURM_JOB_ID",
                 "SLURM_PROCID", "SLURM_NTASKS", "SLURM_STEP_ID"):
        out.pop(name, None)
    out.update(extra or {})
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launcher(nproc: int) -> list[str]:
    """A plain python process for nproc 0, else torchrun with nproc ranks on this machine."""
    if not nproc:
        return [sys.executable]
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
            "--nnodes=1", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{_free_port()}"]


def run(cmd: Sequence[str], timeout: float = 600,
        timing_malloc: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(list(cmd), cwd=REPO, env=env(timing_malloc=timing_malloc), text=True,
                          capture_output=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:6])} ... exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    return proc


# Peak RSS of the largest process of a tree: Linux folds a reaped child's peak (and its own
# children's) into its parent's RUSAGE_CHILDREN, so a fresh wrapper process sees the tree's.
_PEAK_RSS = ("import resource, subprocess, sys\n"
             "code = subprocess.call(sys.argv[1:])\n"
             "print('peak_rss_kib', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)\n"
             "sys.exit(code)\n")


def run_peak_rss(cmd: Sequence[str], timeout: float = 600, timing_malloc: bool = True) -> int:
    """Run `cmd`; the peak resident memory of its largest process (a rank), in bytes."""
    proc = run([sys.executable, "-c", _PEAK_RSS, *cmd], timeout, timing_malloc)
    line = [x for x in proc.stdout.splitlines() if x.startswith("peak_rss_kib")][-1]
    return int(line.split()[1]) * 1024


def dtrain_cmd(run_dir: Path, overrides: Sequence[str], nproc: int = 0,
               config: Optional[str] = None) -> list[str]:
    args = ([f"--config={config}"] if config else []) + [
        f"run.out_dir={run_dir.parent}", f"run.name={run_dir.name}", *overrides]
    return [*launcher(nproc), TRAIN, *args]


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def scalar_events(run_dir: Path, tag: str = "train/loss") -> list[tuple[int, float]]:
    """(step, wall-clock time) of each TensorBoard event of `tag`: dtrain's own clock at every
    logged step."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    events = EventAccumulator(str(run_dir / "tb"), size_guidance={"scalars": 0})
    events.Reload()
    return [(e.step, e.wall_time) for e in events.Scalars(tag)]


def final_weights(run_dir: Path) -> dict:
    import torch
    latest = (run_dir / "checkpoints" / "latest").read_text().strip()
    ckpt = torch.load(run_dir / "checkpoints" / latest / "checkpoint.pt", weights_only=True)
    return ckpt["model"]


def max_weight_difference(a: dict, b: dict) -> float:
    if a.keys() != b.keys():
        return float("inf")
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def median(values: Sequence[float]) -> float:
    return statistics.median(values)


def alternate(rounds: int, *measures: Callable[[int], float]) -> list[list[float]]:
    """Run the measures in turn, `rounds` times (A B A B ...), so that a machine's slow moments
    fall on all of them alike; returns each measure's results."""
    results: list[list[float]] = [[] for _ in measures]
    for i in range(rounds):
        for results_of, measure in zip(results, measures):
            results_of.append(measure(i))
    return results


def run_standalone(run: Callable[[Path], list]) -> None:
    """`python bench/<name>.py`: one benchmark's figures, measured in a temporary folder."""
    with tempfile.TemporaryDirectory(prefix="dtrain-bench-") as tmp:
        for figure in run(Path(tmp)):
            print(figure.line(), flush=True)


def make_llama(model_dir: str | Path, data: str | Path, llama: dict, sizes: dict[str, int]) -> int:
    """A Llama of config `llama` with fresh weights (seed 0) saved with save_pretrained into
    `model_dir`, and token files of uniform random ids (`sizes`: tokens per split, seed 0) with
    the meta.json `dtrain tokenize` writes into `data`; returns the model's parameters."""
    import numpy as np
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**llama))
    count = sum(p.numel() for p in model.parameters())
    model.save_pretrained(model_dir)
    data = Path(data)
    data.mkdir(parents=True, exist_ok=True)
    gen = np.random.default_rng(0)
    for split, n in sizes.items():
        gen.integers(0, llama["vocab_size"], n).astype(np.uint16).tofile(data / f"{split}.bin")
    (data / "meta.json").write_text(json.dumps(
        {"dtype": "uint16", "vocab_size": llama["vocab_size"], "eot_id": 0, "tokens": sizes}))
    return count


def checkpointer(cfg, model, optimizer, info: dict, store, state):
    """dtrain's Checkpointer as a run makes it, for one process on the CPU: the model, its
    optimizer and the loop's position `state` (a TrainState), nothing else."""
    import torch
    from dtrain import config, models
    from dtrain.checkpoint import POSITION, Checkpointer, Contents
    from dtrain.models.spec import spec_of
    from dtrain.process.env import Env
    from dtrain.run.pieces import layout_of

    contents = Contents(model=model, optimizer=optimizer, spec=spec_of(cfg.model),
                        parts={POSITION: state}, sharded={}, config=config.to_dict(cfg),
                        model_info=models.model_info(cfg.model, info), seed=cfg.run.seed)
    layout = layout_of(cfg, Env(launcher="single"), torch.device("cpu"))
    return Checkpointer(ckpt=cfg.ckpt, layout=layout, store=store, contents=contents)
