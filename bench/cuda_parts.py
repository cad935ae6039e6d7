"""The pieces of bench/cuda_check.py: launching dtrain and reading its records, the figures and
their table, and the language-model parts (built-in GPTs, memory against `dtrain plan`, an `hf:`
Llama). `TRY` (set by `--cpu-try`) runs every part on the CPU at tiny sizes: its numbers mean
nothing, it proves that the commands, the parsing and the table work before a GPU is at hand."""

from __future__ import annotations

import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import common

REPO = Path(__file__).resolve().parents[1]
LAUNCH_TIMEOUT_S = 240
TRY = False  # --cpu-try: the CPU, tiny sizes
ROWS: list[tuple[str, str, str]] = []  # (part, figure, value) for the table at the end


def env(cpu: bool = False) -> dict:
    e = dict(os.environ, PYTHONPATH=str(REPO / "src"), PYTHONUNBUFFERED="1")
    if cpu or TRY:
        e["CUDA_VISIBLE_DEVICES"] = ""
    return e


def figure(part_no: str, name: str, value: str, detail: str = "") -> None:
    """One figure: printed at once (one line), and kept for the table."""
    print(f"  {name}: {value}{'  (' + detail + ')' if detail else ''}", flush=True)
    ROWS.append((part_no, name, value))


def table() -> str:
    width = max([len(n) for _, n, _ in ROWS] + [6])
    lines = [f"{'part':<4}  {'figure':<{width}}  value", f"{'-' * 4}  {'-' * width}  {'-' * 5}"]
    lines += [f"{p:<4}  {n:<{width}}  {v}" for p, n, v in ROWS]
    return "\n".join(lines)


def train(out: Path, name: str, config: str | None, *overrides: str, cpu: bool = False,
          torchrun: bool = True, nproc: int = 1) -> list[dict]:
    """One dtrain launch (torchrun with `nproc` ranks, or a single process without a process
    group); its training records. Its log is kept. `config` None: dtrain's defaults under the
    overrides."""
    launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    cmd = [sys.executable, *(launcher if torchrun else []),
           str(REPO / "launch" / "train.py"), *(["--config", str(REPO / config)] if config else []),
           *overrides, *(["data.num_workers=0"] if TRY else []), f"run.out_dir={out}",
           f"run.name={name}", "ckpt.resume=none"]
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


def steady(records: list[dict], key: str) -> float | None:
    """Median of a figure over the windows after the first (warm-up); None where no record has
    it (MFU on a device without a known peak)."""
    values = [r[key] for r in records[1:] if key in r] or [r[key] for r in records if key in r]
    return statistics.median(values) if values else None


def plan_command(config: str | None, overrides: list[str], *flags: str, nproc: int = 1) -> str:
    cmd = [sys.executable, "-m", "dtrain", "plan", *(["--config", str(REPO / config)] if config
                                                      else []), "--nproc", str(nproc), *overrides,
           *flags]
    proc = subprocess.run(cmd, env=env(), capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S)
    if proc.returncode != 0:
        raise RuntimeError("dtrain plan: " + (proc.stderr.strip().splitlines() or ["?"])[-1])
    return proc.stdout


def plan_total(config: str | None, overrides: list[str], nproc: int = 1) -> float:
    """`dtrain plan`'s predicted peak per rank for the planned run, in GiB."""
    planned = plan_command(config, overrides, nproc=nproc)
    line = next(x for x in planned.splitlines() if "<- this run" in x)
    value, unit = re.findall(r"([\d.]+) (B|KiB|MiB|GiB)", line)[-1]
    return float(value) * {"B": 2**-30, "KiB": 2**-20, "MiB": 2**-10, "GiB": 1}[unit]


def peak_gib(run_dir: Path) -> float:
    """The run's peak memory from TensorBoard (a dashboard figure; metrics.jsonl does not hold
    it): `mem/cuda_max_allocated_gb` on a GPU, the process's `mem/rss_gb` on the CPU."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tb"), size_guidance={"scalars": 0})
    events.Reload()
    tag = "mem/rss_gb" if TRY else "mem/cuda_max_allocated_gb"
    return max(e.value for e in events.Scalars(tag))


def _rate(value: float | None, fmt: str) -> str:
    return "n/a (no peak known for this device)" if value is None else format(value, fmt)


def _lm_figures(part_no: str, label: str, records: list[dict], run_dir: Path,
                config: str | None, planned_overrides: list[str]) -> None:
    """tokens/s and MFU as the run's records report them; its peak memory against the plan."""
    figure(part_no, f"{label} tokens/s", f"{steady(records, 'tokens_per_s'):.0f}")
    figure(part_no, f"{label} MFU", _rate(steady(records, "mfu"), ".3f"))
    peak, planned = peak_gib(run_dir), plan_total(config, planned_overrides)
    figure(part_no, f"{label} peak/plan", f"{peak / planned:.2f}",
           f"peak {'RSS' if TRY else 'CUDA'} memory {peak:.3f} GiB, dtrain plan {planned:.3f} GiB")


# ---------------------------------------------------------------------------------------------
# 3. Built-in GPTs: 152 M and about 1 B parameters, compiled, bf16, fused AdamW, SDPA

GPT_SIZES = {  # name: (dim, depth, heads, seq_len, batch, steps)
    "gpt-152m": (1024, 12, 16, 1024, 16, 40),
    "gpt-1b": (2048, 20, 16, 1024, 8, 30),
}
GPT_TRY = {"gpt-152m": (64, 2, 4, 64, 4, 6), "gpt-1b": (64, 3, 4, 64, 4, 6)}


def gpt_overrides(dim: int, depth: int, heads: int, seq_len: int, batch: int) -> list[str]:
    return [f"model.args.dim={dim}", f"model.args.depth={depth}", f"model.args.heads={heads}",
            f"model.args.seq_len={seq_len}", f"data.batch_size={batch}",
            f"data.text.stride={seq_len}", "train.precision=bf16"]


def gpts(out: Path) -> None:
    name, peak = DEVICE["name"], DEVICE["peak"]
    figure("3", "peak FLOP/s used for MFU", "none (MFU not reported)" if peak is None
           else f"{peak / 1e12:.0f} TFLOP/s", f"looked up by the device name '{name}'")
    for label, size in (GPT_TRY if TRY else GPT_SIZES).items():
        *shape, steps = size
        sized = gpt_overrides(*shape)
        # The CPU's inductor takes minutes on two cores; the commands are the same without it.
        compiled = [] if TRY else ["model.compile=true"]
        records = train(out, label, "configs/gpt_text.yaml", *sized, *compiled,
                        f"train.max_steps={steps}", f"train.log_every={max(1, steps // 6)}",
                        "train.eval_every_steps=null", "ckpt.every_steps=null")
        _lm_figures("3", label, records, out / label, "configs/gpt_text.yaml", sized)


# ---------------------------------------------------------------------------------------------
# 4. The CUDA context's size against the plan's allowance; the deepest GPT the plan says fits

DEVICE: dict = {}  # probe_device's findings; main fills it before any part runs

# Run in a child process: a CUDA context in this one would sit on the device through every run
# (the frontier's above all) and would itself be what part 4 measures.
DEVICE_PROBE = """
import json, torch
from dtrain.observe import peak_flops
torch.cuda.init()
free, total = torch.cuda.mem_get_info()
x = torch.randn(1024, 1024, device="cuda", dtype=torch.bfloat16)
(x @ x).sum().item()  # cuBLAS's handle and workspace: every training step needs them
after, _ = torch.cuda.mem_get_info()
print(json.dumps({"name": torch.cuda.get_device_name(0), "cuda": torch.version.cuda,
                  "nccl": ".".join(map(str, torch.cuda.nccl.version())),
                  "peak": peak_flops(torch.device("cuda", 0), "bf16"), "total": total,
                  "init": total - free, "matmul": total - after - torch.cuda.memory_reserved()}))
"""


def _used_by_others_mib() -> float:
    """What the device already holds before our probe starts (0 where nvidia-smi is missing)."""
    if not shutil.which("nvidia-smi"):
        return 0.0
    proc = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,"
                           "nounits", "-i", "0"], capture_output=True, text=True, timeout=30)
    return float(proc.stdout.strip() or 0) if proc.returncode == 0 else 0.0


def probe_device() -> dict:
    """The GPU's name, versions, memory, the peak dtrain takes for MFU, and the CUDA context's
    size; on the CPU (--cpu-try) only a name and no peak."""
    if TRY:
        return {"name": "cpu", "peak": None}
    before = _used_by_others_mib()
    proc = subprocess.run([sys.executable, "-c", DEVICE_PROBE], env=env(), capture_output=True,
                          text=True, timeout=120)
    if proc.returncode != 0:
        raise RuntimeError("device probe: " + proc.stderr.strip().splitlines()[-1])
    return {**json.loads(proc.stdout.strip().splitlines()[-1]), "before_mib": before}


def context_and_limit() -> int:
    """Prints the context's size beside the plan's allowance; returns the device's memory (on
    the CPU under --cpu-try, a small host limit that keeps the frontier shallow)."""
    from dtrain.commands.plan.fit import CUDA_CONTEXT_BYTES

    allowance = (f"plan allows {CUDA_CONTEXT_BYTES / 2**20:.0f} MiB per rank of host memory for "
                 "it; its device peak counts none")
    if TRY:
        figure("4", "CUDA context", "not measured (no CUDA)", allowance)
        return 900 * 2**20
    mib, before = 2**20, DEVICE["before_mib"]
    figure("4", "CUDA context after init", f"{DEVICE['init'] / mib - before:.0f} MiB", allowance)
    figure("4", "CUDA context with cuBLAS", f"{DEVICE['matmul'] / mib - before:.0f} MiB",
           f"device memory {DEVICE['total'] / 2**30:.1f} GiB, {before:.0f} MiB held before")
    return DEVICE["total"]


FRONTIER = (1024, 12, 16, 1024, 16)  # the 152 M GPT's shape, grown in depth
FRONTIER_TRY = (256, 2, 4, 64, 4)


def frontier(out: Path) -> None:
    limit = context_and_limit()
    sized = gpt_overrides(*(FRONTIER_TRY if TRY else FRONTIER))
    shown = json.loads(plan_command("configs/gpt_text.yaml", sized, "--memory-limit", str(limit),
                                    "--grow", "model.args.depth", "--format", "json"))
    largest = shown["ddp"]["largest"]  # the mode a one-process run of this config takes
    figure("4", "plan: largest depth that fits", str(largest),
           f"--memory-limit {limit} bytes, --grow model.args.depth, ddp")
    if not largest:
        return
    # Eager (no compile): a few steps at a depth of ~100 blocks, without compiling each.
    for depth, expected in ((largest, "fits"), (largest + 1, "out of memory")):
        name = f"frontier-depth{depth}"
        deeper = [*sized, f"model.args.depth={depth}"]
        try:
            train(out, name, "configs/gpt_text.yaml", *deeper, "train.max_steps=3",
                  "train.log_every=1", "train.eval_every_steps=null", "ckpt.every_steps=null")
            happened = "fits"
        except RuntimeError:
            log = (out / f"{name}.log").read_text().lower()
            if "out of memory" not in log and "outofmemory" not in log:
                raise
            happened = "out of memory"
        if TRY and expected != happened:
            happened += " (the CPU run has no memory limit)"
        ok = "as expected" if happened == expected else f"expected {expected}"
        figure("4", f"depth {depth}", f"{happened}, {ok}")


# ---------------------------------------------------------------------------------------------
# 5. An hf: model: a Llama made here from a config, on token files of random ids

LLAMA = dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=12,
             num_attention_heads=16, num_key_value_heads=8, vocab_size=32000,
             max_position_embeddings=1024)
LLAMA_TRY = dict(hidden_size=64, intermediate_size=172, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
                 max_position_embeddings=64)
LLAMA_RUN = (1024, 16, 40)  # seq_len, batch, steps
LLAMA_RUN_TRY = (64, 4, 6)


def make_llama(out: Path, llama: dict, tokens: int) -> tuple[Path, Path, int]:
    """A Llama folder (save_pretrained) and token files (uniform random ids); its parameters."""
    model_dir, data = out / "hf-llama", out / "hf-tokens"
    sizes = {"train": tokens, "val": max(tokens // 20, 10_000)}
    return model_dir, data, common.make_llama(model_dir, data, llama, sizes)


def hf_llama(out: Path) -> None:
    seq_len, batch, steps = LLAMA_RUN_TRY if TRY else LLAMA_RUN
    model_dir, data, count = make_llama(out, LLAMA_TRY if TRY else LLAMA,
                                        2 * steps * batch * (seq_len + 1))
    print(f"  Llama of {count / 1e6:.1f} M parameters in {model_dir}", flush=True)
    sized = ["task.name=language_model", f"model.name=hf:{model_dir}", "model.args={}",
             "data.name=tokens", f"data.root={data}", f"data.batch_size={batch}",
             f"data.tokens.seq_len={seq_len}", f"data.tokens.stride={seq_len}",
             "optim.name=adamw", "train.precision=bf16", "ckpt.monitor=val_loss",
             "ckpt.monitor_mode=min"]
    modes = {"hf-llama": []}
    if not TRY:  # the CPU's inductor would take minutes
        modes["hf-llama-compiled"] = ["model.compile=true"]
    for label, extra in modes.items():
        records = train(out, label, None, *sized, *extra, f"train.max_steps={steps}",
                        f"train.log_every={max(1, steps // 6)}", "train.eval_every_epochs=0",
                        "ckpt.every_epochs=0")
        _lm_figures("5", label, records, out / label, None, sized)


# ---------------------------------------------------------------------------------------------
# 7 and 8. Tensor and pipeline parallelism on two GPUs, against DDP on the same two, bf16 on NCCL


def tensor_parallel(out: Path) -> None:
    """The 152 M GPT of part 3 (eager, not compiled) as DDP on 2 GPUs and as tp 2 (one group
    reading twice DDP's per-rank batch: the same global batch)."""
    _against_ddp(out, "7", "tensor parallelism", "tp2", ["parallel.tp.size=2"])


def pipeline_parallel(out: Path) -> None:
    """The same GPT as pp 2 (1F1B, 4 micro-batches; one pipeline reading twice DDP's per-rank
    batch)."""
    _against_ddp(out, "8", "pipeline parallelism", "pp2",
                 ["parallel.pp.size=2", "parallel.pp.microbatches=4"])


def _against_ddp(out: Path, part_no: str, what: str, label: str, layout: list[str]) -> None:
    """DDP on 2 GPUs and `layout` on the same two with the same global batch: tokens/s, the
    first losses against DDP's (bf16 tolerance), and each one's peak memory against `dtrain
    plan`. Needs two GPUs; with one it says so (under --cpu-try: 2 CPU ranks on gloo, tiny)."""
    import torch

    if not TRY and torch.cuda.device_count() < 2:
        figure(part_no, what, f"skipped: {torch.cuda.device_count()} GPU(s), needs 2")
        return
    dim, depth, heads, seq_len, batch, steps = (GPT_TRY if TRY else GPT_SIZES)["gpt-152m"]
    base = [*gpt_overrides(dim, depth, heads, seq_len, batch), f"train.max_steps={steps}",
            f"train.log_every={max(1, steps // 8)}", "train.eval_every_steps=null",
            "ckpt.every_steps=null"]
    runs = {}
    for name, extra in (("ddp2", []), (label, [f"data.batch_size={2 * batch}", *layout])):
        records = train(out, f"gpt-{name}", "configs/gpt_text.yaml", *base, *extra, nproc=2)
        runs[name] = records
        figure(part_no, f"gpt-152m {name} tokens/s", f"{steady(records, 'tokens_per_s'):.0f}")
        peak = peak_gib(out / f"gpt-{name}")
        planned = plan_total("configs/gpt_text.yaml", [*base, *extra], nproc=2)
        figure(part_no, f"gpt-152m {name} peak/plan", f"{peak / planned:.2f}",
               f"peak {peak:.3f} GiB, dtrain plan {planned:.3f} GiB")
    pairs = list(zip(runs[label], runs["ddp2"]))[:4]
    worst = max(abs(a["loss"] - b["loss"]) / abs(b["loss"]) for a, b in pairs)
    figure(part_no, f"{label} vs ddp2 bf16 losses", f"{worst:.4f}",
           f"largest relative difference over the first {len(pairs)} records; "
           f"{'within' if worst <= 0.02 else 'OUTSIDE'} bf16 tolerance 0.02")
