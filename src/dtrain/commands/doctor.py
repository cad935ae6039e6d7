"""`dtrain doctor`: check this machine's PyTorch, devices and backends, one verdict per line.

Every check prints `ok`, `warn` or `FAIL` and what it found; the command exits 1 when any check
fails. The collective check starts two real processes that all-reduce over gloo on 127.0.0.1, the
same path a multi-process run takes, so a broken network setting (GLOO_SOCKET_IFNAME, a firewall
on the loopback) shows up here rather than after a job has queued.
"""

from __future__ import annotations

import functools
import os
import platform
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

# Variables that decide how a run starts and talks: the launcher's and the backends'.
LAUNCH_VARIABLES = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_RUN_ID",
)
SLURM_VARIABLES = (
    "SLURM_JOB_ID",
    "SLURM_JOB_NAME",
    "SLURM_PROCID",
    "SLURM_LOCALID",
    "SLURM_NODEID",
    "SLURM_NTASKS",
    "SLURM_NTASKS_PER_NODE",
    "SLURM_JOB_NUM_NODES",
    "SLURM_NNODES",
    "SLURM_JOB_NODELIST",
    "SLURM_STEP_ID",
    "SLURM_GPUS_ON_NODE",
    "SLURM_RESTART_COUNT",
)
NETWORK_VARIABLES = (
    "CUDA_VISIBLE_DEVICES",
    "NCCL_SOCKET_IFNAME",
    "NCCL_IB_DISABLE",
    "NCCL_DEBUG",
    "GLOO_SOCKET_IFNAME",
    "OMP_NUM_THREADS",
)
ALL_REDUCE_TIMEOUT_S = 90.0

# Run by each of the two processes of the collective check: rank, world size, port, backend.
_WORKER = """
import datetime, sys, torch, torch.distributed as dist
rank, world, port, backend = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
if device.type == "cuda":
    torch.cuda.set_device(device)
dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                        world_size=world, timeout=datetime.timedelta(seconds=60))
value = torch.tensor([float(rank + 1)], device=device)
dist.all_reduce(value)
print(f"result {value.item()}", flush=True)
dist.destroy_process_group()
"""


@dataclass
class Check:
    verdict: str  # "ok" | "warn" | "FAIL"
    name: str
    detail: str

    def line(self) -> str:
        return f"{self.verdict:<5} {self.name}: {self.detail}"


def _gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB"


def check_versions() -> Check:
    try:
        import torchvision

        vision = torchvision.__version__
    except ImportError:
        return Check(
            "FAIL",
            "versions",
            f"torch {torch.__version__}; torchvision is not installed (pip install torchvision)",
        )
    parts = [
        f"python {platform.python_version()}",
        f"torch {torch.__version__}",
        f"torchvision {vision}",
    ]
    if torch.version.cuda:
        parts.append(f"CUDA {torch.version.cuda}")
        cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
        parts.append(f"cuDNN {_cudnn_version(cudnn)}" if cudnn else "cuDNN none")
        try:
            parts.append("NCCL " + ".".join(map(str, torch.cuda.nccl.version())))
        except (RuntimeError, AttributeError):
            parts.append("NCCL none")
    else:
        parts.append("CUDA none (a CPU build of torch)")
    return Check("ok", "versions", ", ".join(parts))


def _cudnn_version(v: int) -> str:
    """cuDNN's integer version: major*10000 + minor*100 + patch from 9 on, major*1000 before."""
    if v >= 90000:
        return f"{v // 10000}.{v % 10000 // 100}.{v % 100}"
    return f"{v // 1000}.{v % 1000 // 100}.{v % 100}"


def _cpu_memory() -> tuple[int, int]:
    """Available and total host memory in bytes."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    available = total
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
    except OSError:
        pass
    return available, total


def devices() -> list[torch.device]:
    found = [torch.device("cpu")]
    if torch.cuda.is_available():
        found += [torch.device("cuda", i) for i in range(torch.cuda.device_count())]
    if getattr(torch.backends, "mps", None) and torch.backends.mps.is_available():
        found.append(torch.device("mps"))
    return found


def check_devices() -> Check:
    available, total = _cpu_memory()
    parts = [f"cpu ({os.cpu_count()} cores, {_gib(available)} free of {_gib(total)})"]
    verdict = "ok"
    if not torch.cuda.is_available():
        if torch.version.cuda and os.path.exists("/dev/nvidiactl"):
            verdict = "warn"  # an NVIDIA driver is loaded, yet torch cannot use it
            parts.append(
                "NVIDIA devices present but torch sees no GPU (driver too old for CUDA "
                f"{torch.version.cuda}? CUDA_VISIBLE_DEVICES?)"
            )
        else:
            parts.append("no GPU")
    for device in devices():
        if device.type == "cuda":
            free, total_gpu = torch.cuda.mem_get_info(device)
            parts.append(
                f"{device} {torch.cuda.get_device_name(device)} "
                f"({_gib(free)} free of {_gib(total_gpu)})"
            )
        elif device.type == "mps":
            parts.append("mps (Apple GPU)")
    return Check(verdict, "devices", "; ".join(parts))


def check_matmul(device: torch.device) -> Check:
    """A 256 x 256 matmul on the device against a float64 product on the CPU."""
    name = f"matmul on {device}"
    try:
        gen = torch.Generator().manual_seed(0)
        a, b = torch.randn(256, 256, generator=gen), torch.randn(256, 256, generator=gen)
        started = time.perf_counter()
        result = (a.to(device) @ b.to(device)).cpu()
        elapsed = time.perf_counter() - started
    except Exception as e:  # noqa: BLE001 - any failure of the device is the finding
        return Check("FAIL", name, f"{type(e).__name__}: {_first_line(e)}")
    error = (result.double() - a.double() @ b.double()).abs().max().item()
    # TF32 on recent GPUs gives errors near 1e-2 for this size; anything far beyond is wrong.
    if not error < 0.1:
        return Check("FAIL", name, f"wrong result: max error {error:.3g}")
    return Check("ok", name, f"max error {error:.2g} vs float64, {elapsed * 1e3:.1f} ms")


def check_backends() -> Check:
    import torch.distributed as dist

    if not dist.is_available():
        return Check("FAIL", "backends", "this torch build has no torch.distributed")
    found = {
        "gloo": dist.is_gloo_available(),
        "nccl": dist.is_nccl_available(),
        "mpi": dist.is_mpi_available(),
    }
    detail = ", ".join(f"{name} {'yes' if ok else 'no'}" for name, ok in found.items())
    if not found["gloo"]:
        return Check("FAIL", "backends", f"{detail}: gloo is needed for CPU runs")
    if torch.cuda.is_available() and not found["nccl"]:
        return Check("warn", "backends", f"{detail}: GPUs without NCCL; set dist.backend=gloo")
    return Check("ok", "backends", detail)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _first_line(error: object) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else ""


def check_all_reduce(backend: str = "gloo", world: int = 2) -> Check:
    """`world` fresh processes on this machine join a process group and all-reduce rank + 1."""
    name = f"{backend} all-reduce ({world} processes on 127.0.0.1)"
    port = str(_free_port())
    started = time.perf_counter()
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _WORKER, str(rank), str(world), port, backend],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(world)
    ]
    outputs = []
    deadline = started + ALL_REDUCE_TIMEOUT_S
    for proc in procs:
        try:
            out, err = proc.communicate(timeout=max(1.0, deadline - time.perf_counter()))
            outputs.append((proc.returncode, out, err))
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
                p.wait()
            return Check(
                "FAIL",
                name,
                f"no result within {ALL_REDUCE_TIMEOUT_S:.0f} s: the processes "
                f"could not connect (firewall on the loopback? GLOO_SOCKET_IFNAME?)",
            )
    elapsed = time.perf_counter() - started
    expected = world * (world + 1) / 2
    for rank, (code, out, err) in enumerate(outputs):
        if code != 0:
            reason = [line for line in err.strip().splitlines() if line.strip()][-1:] or [
                f"exit {code}"
            ]
            hint = ""
            if backend == "gloo" and os.environ.get("GLOO_SOCKET_IFNAME"):
                hint = f" (GLOO_SOCKET_IFNAME={os.environ['GLOO_SOCKET_IFNAME']} is set)"
            return Check("FAIL", name, f"rank {rank} failed: {reason[0].strip()[:300]}{hint}")
        got = [line.split()[1] for line in out.splitlines() if line.startswith("result ")]
        if not got or float(got[0]) != expected:
            return Check(
                "FAIL", name, f"rank {rank} got {got[0] if got else 'nothing'}, expected {expected}"
            )
    return Check(
        "ok", name, f"sum {expected} on every rank in {elapsed:.1f} s (including process start-up)"
    )


def check_launcher() -> Check:
    """What dtrain would make of the launcher variables in effect, and the variables themselves."""
    from dtrain.core.errors import UserError
    from dtrain.process import env as env_mod

    shown = [
        f"{k}={os.environ[k]}"
        for k in LAUNCH_VARIABLES + SLURM_VARIABLES + NETWORK_VARIABLES
        if k in os.environ
    ]
    variables = (
        " | " + " ".join(shown) if shown else " | no torchrun, SLURM or network variables set"
    )
    try:
        detected = env_mod.detect()
    except UserError as e:
        return Check("FAIL", "launcher", f"{e}{variables}")
    if detected.rank >= detected.world_size or detected.local_rank >= detected.local_world_size:
        return Check(
            "FAIL",
            "launcher",
            f"rank {detected.rank} / local rank {detected.local_rank} "
            f"outside world size {detected.world_size}{variables}",
        )
    return Check("ok", "launcher", f"{detected.describe()}{variables}")


def run_checks(report: Callable[[Check], None]) -> list[Check]:
    checks: list[Callable[[], Check]] = [check_versions, check_devices]
    checks += [functools.partial(check_matmul, d) for d in devices()]
    checks += [check_backends, check_launcher, check_all_reduce]
    if torch.cuda.is_available() and torch.cuda.device_count() >= 2:
        checks.append(lambda: check_all_reduce("nccl"))
    results = []
    for check in checks:
        result = check()
        report(result)
        results.append(result)
    return results


def main() -> int:
    """Print one line per check and a summary; 1 when any check failed."""
    results = run_checks(lambda c: print(c.line(), flush=True))
    failed = [c for c in results if c.verdict == "FAIL"]
    warned = [c for c in results if c.verdict == "warn"]
    if failed:
        print(
            f"doctor: {len(failed)} of {len(results)} checks failed: "
            f"{', '.join(c.name for c in failed)}"
        )
        return 1
    print(
        f"doctor: all {len(results)} checks passed"
        + (f" ({len(warned)} with warnings)" if warned else "")
    )
    return 0
