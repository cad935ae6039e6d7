"""What the CPU cannot show, on one machine with CUDA (bench/cuda_check.sh runs this). One line per
figure; a part that fails says so and the others still run. Without a CUDA device it says so and
exits 0.

1. DDP and FSDP with bf16 on NCCL (configs/fsdp_transformer.yaml): steps/s, and the first losses
   against the same config's fp32 losses on the CPU (bf16 tolerance).
2. The default CNN with channels_last and bf16: images/s against a plain hand-written loop
   (bench/cuda_plain.py) with the same model, data, batch and loader workers, alternated; both
   a single process without DDP.
3. The language model: tokens/s and MFU of configs/gpt_text.yaml and of a larger GPT (dim 1024,
   depth 12, seq_len 1024), and the larger one's peak CUDA memory against `dtrain plan`.
4. Host-device synchronisations inside steady steps (train.sync_debug=true): torch warns at each.

    python bench/cuda_check.py [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LAUNCH_TIMEOUT_S = 240


def env(cpu: bool = False) -> dict:
    e = dict(os.environ, PYTHONPATH=str(REPO / "src"), PYTHONUNBUFFERED="1")
    if cpu:
        e["CUDA_VISIBLE_DEVICES"] = ""
    return e


def train(out: Path, name: str, config: str, *overrides: str, cpu: bool = False,
          torchrun: bool = True) -> list[dict]:
    """One dtrain launch (torchrun with one rank, or a single process without a process group);
    its training records. Its log is kept."""
    launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1"]
    cmd = [sys.executable, *(launcher if torchrun else []), str(REPO / "launch" / "train.py"),
           "--config", str(REPO / config), *overrides, f"run.out_dir={out}", f"run.name={name}",
           "ckpt.resume=none"]
    started = time.perf_counter()
    proc = subprocess.run(cmd, env=env(cpu), capture_output=True, text=True,
                          timeout=LAUNCH_TIMEOUT_S)
    (out / f"{name}.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        lines = (proc.stdout + proc.stderr).strip().splitlines()
        said = [x for x in lines if x.startswith("dtrain:") or "Error" in x] or lines[-3:]
        raise RuntimeError(f"exit {proc.returncode}: " + " | ".join(said[:3]))
    records = [json.loads(line) for line in (out / name / "metrics.jsonl").read_text().splitlines()]
    print(f"  ({name}: {time.perf_counter() - started:.0f} s wall)", flush=True)
    return [r for r in records if "loss" in r]


def steady(records: list[dict], key: str) -> float:
    """Median of a figure over the windows after the first (warm-up)."""
    values = [r[key] for r in records[1:] if key in r] or [r[key] for r in records if key in r]
    return statistics.median(values)


def part(title: str, fn) -> None:
    print(f"== {title}", flush=True)
    try:
        fn()
    except Exception as e:  # one part's failure must not hide the others' figures
        print(f"  FAILED: {type(e).__name__}: {e}", flush=True)


def nccl_modes(out: Path) -> None:
    common = ["train.max_steps=100", "train.log_every=5", "train.eval_every_epochs=0",
              "ckpt.every_epochs=0", "data.num_workers=4"]
    cpu = train(out, "transformer-cpu", "configs/fsdp_transformer.yaml", "parallel.mode=ddp",
                "train.precision=fp32", "train.max_steps=20", "train.log_every=5",
                "train.eval_every_epochs=0", "ckpt.every_epochs=0", "data.num_workers=4", cpu=True)
    cpu_losses = [r["loss"] for r in cpu]
    for mode in ("ddp", "fsdp"):
        records = train(out, f"transformer-{mode}", "configs/fsdp_transformer.yaml",
                        f"parallel.mode={mode}", "train.precision=bf16", *common)
        losses = [r["loss"] for r in records[: len(cpu_losses)]]
        worst = max(abs(a - b) / abs(b) for a, b in zip(losses, cpu_losses, strict=True))
        print(f"  {mode} bf16 nccl: {steady(records, 'samples_per_s') / 64:.1f} steps/s; "
              f"losses at steps 5..20 {[round(v, 4) for v in losses]} vs cpu fp32 "
              f"{[round(v, 4) for v in cpu_losses]}: largest relative difference {worst:.4f} "
              f"({'within' if worst <= 0.02 else 'OUTSIDE'} bf16 tolerance 0.02)", flush=True)


def images_vs_plain(out: Path) -> None:
    dtrain_rates, plain_rates = [], []
    for round_ in range(2):
        records = train(out, f"cnn-{round_}", "configs/default.yaml", "model.channels_last=true",
                        "train.precision=bf16", "train.max_steps=600", "train.log_every=50",
                        "train.eval_every_epochs=0", "ckpt.every_epochs=0", "data.num_workers=4",
                        torchrun=False)  # like the plain loop: one process, no DDP
        dtrain_rates.append(steady(records, "samples_per_s"))
        proc = subprocess.run([sys.executable, str(REPO / "bench" / "cuda_plain.py"),
                               "--steps", "600", "--warmup", "50", "--workers", "4"],
                              env=env(), capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S)
        if proc.returncode != 0:
            raise RuntimeError("plain loop: " + proc.stderr.strip().splitlines()[-1])
        plain_rates.append(json.loads(proc.stdout.strip().splitlines()[-1])["images_per_s"])
    d, p = statistics.median(dtrain_rates), statistics.median(plain_rates)
    print(f"  cnn channels_last bf16: dtrain {d:.0f} images/s, plain loop {p:.0f} images/s, "
          f"ratio {d / p:.3f} (rounds: dtrain {[round(v) for v in dtrain_rates]}, "
          f"plain {[round(v) for v in plain_rates]})", flush=True)


def plan_total(config: str, overrides: list[str]) -> float:
    """`dtrain plan`'s predicted peak per rank for the planned run, in GiB."""
    proc = subprocess.run([sys.executable, "-m", "dtrain", "plan", "--config", str(REPO / config),
                           "--nproc", "1", *overrides], env=env(), capture_output=True,
                          text=True, timeout=120)
    line = next(x for x in proc.stdout.splitlines() if "<- this run" in x)
    value, unit = re.findall(r"([\d.]+) (B|KiB|MiB|GiB)", line)[-1]
    return float(value) * {"B": 2**-30, "KiB": 2**-20, "MiB": 2**-10, "GiB": 1}[unit]


def peak_cuda_gib(run_dir: Path) -> float:
    """The run's peak CUDA memory: TensorBoard's `mem/cuda_max_allocated_gb` (a dashboard figure;
    metrics.jsonl does not hold it)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tb"), size_guidance={"scalars": 0})
    events.Reload()
    return max(e.value for e in events.Scalars("mem/cuda_max_allocated_gb"))


def language_models(out: Path) -> None:
    small = train(out, "gpt-small", "configs/gpt_text.yaml", "train.precision=bf16",
                  "train.max_steps=300", "train.log_every=50", "train.eval_every_steps=null",
                  "ckpt.every_steps=null")
    print(f"  gpt_text (1.9 M parameters) bf16: {steady(small, 'tokens_per_s'):.0f} tokens/s, "
          f"MFU {steady(small, 'mfu'):.4f}", flush=True)
    large = ["model.args.dim=1024", "model.args.depth=12", "model.args.heads=16",
             "model.args.seq_len=1024", "data.batch_size=16", "data.text.stride=1024",
             "train.precision=bf16"]
    records = train(out, "gpt-large", "configs/gpt_text.yaml", *large, "train.max_steps=60",
                    "train.log_every=10", "train.eval_every_steps=null", "ckpt.every_steps=null")
    peak = peak_cuda_gib(out / "gpt-large")
    planned = plan_total("configs/gpt_text.yaml", large)
    print(f"  gpt dim 1024 depth 12 seq 1024 batch 16 bf16: {steady(records, 'tokens_per_s'):.0f}"
          f" tokens/s, MFU {steady(records, 'mfu'):.3f}; peak CUDA memory {peak:.2f} GiB, "
          f"dtrain plan {planned:.2f} GiB (measured/planned {peak / planned:.2f})", flush=True)


def sync_free(out: Path) -> None:
    train(out, "sync-debug", "configs/default.yaml", "train.sync_debug=true",
          "train.max_steps=120", "train.log_every=1000", "train.check_every_steps=1000",
          "train.eval_every_epochs=0", "ckpt.every_epochs=0")
    log = (out / "sync-debug.log").read_text()
    count = log.count("called a synchronizing CUDA operation")
    print(f"  synchronising operations warned about inside steady steps: {count}", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(REPO / "runs" / "cuda_check"))
    parser.add_argument("--only", default="1,2,3,4", help="the parts to run, e.g. 2,3")
    args = parser.parse_args()
    only = set(args.only.split(","))
    import torch

    if not torch.cuda.is_available():
        print("cuda_check: no CUDA device visible; nothing checked")
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    print(f"cuda_check: {torch.cuda.get_device_name(0)}, torch {torch.__version__}, CUDA "
          f"{torch.version.cuda}, NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}", flush=True)
    started = time.perf_counter()
    parts = {
        "1": ("DDP and FSDP, bf16 on NCCL", nccl_modes),
        "2": ("CNN, channels_last + bf16, against the plain loop", images_vs_plain),
        "3": ("language model: tokens/s, MFU, peak memory against plan", language_models),
        "4": ("host-device synchronisations in steady steps", sync_free),
    }
    for number, (title, check) in parts.items():
        if number in only:
            part(f"{number}. {title}", lambda check=check: check(out))
    print(f"cuda_check: done in {time.perf_counter() - started:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
