"""`dtrain eval --profile`: the evaluation under the torch profiler, and where its time went.

Every rank profiles its own evaluation and writes its trace for TensorBoard's profiler view into
one new folder, `eval-<checkpoint>-<time>/` in the run's `profile/` (where `log.profile` writes
training's), or for a run in an object store in `./profile/<run name>/` on this machine, or in
`--profile-dir`. Rank 0 prints its operators that took the most time of their own, the shares of
the wall time spent waiting for data and in copies between the host and the device, and a
verdict: whether int8 quantization, which speeds up matrix multiplies and convolutions, can
shorten it.
"""

from __future__ import annotations

import contextlib
import datetime
import glob
import os
import re
import time
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch.profiler import profile, record_function

from dtrain.core import columns
from dtrain.core.errors import UserError
from dtrain.core.urls import is_url
from dtrain.files import names, outputs
from dtrain.files.store import check_run_dir_entries
from dtrain.observe import profiling

TOP_ROWS = 10
NAME_WIDTH = 64  # an operator's name is cut to this in the table (a loader's runs to 60 and more)
# The operators int8 quantization replaces: matrix multiplies (linear layers) and convolutions.
ARITHMETIC = re.compile(
    r"aten::(mm|addmm|bmm|baddbmm|matmul|linear|_int_mm|_scaled_mm|.*conv(olution|_transpose)?"
    r"(\dd)?(_forward)?)$"
)
# Below this share of the wall time, nothing is named as what the time goes to.
DOMINANT_PERCENT = 30.0


def trace_folder(run_dir: str, checkpoint: str, parent: str | None) -> str:
    """A new folder for this evaluation's traces (rank 0 makes it), in `parent` or the default
    place (the run's profile/ folder; a run in an object store's on this machine). A place that
    cannot be written is one line, before anything is evaluated."""
    if parent is None and is_url(run_dir):
        parent = os.path.join(names.PROFILE, run_dir.rstrip("/").rsplit("/", 1)[-1])
    elif parent is None:
        check_run_dir_entries(run_dir, only=(names.PROFILE,))  # never written through a link
        parent = os.path.join(run_dir, names.PROFILE)
    parent = os.path.abspath(parent)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    try:
        os.makedirs(parent, exist_ok=True)
        for suffix in range(1, 1000):
            again = "" if suffix == 1 else f"-{suffix}"
            folder = os.path.join(parent, f"eval-{checkpoint}-{stamp}{again}")
            try:
                os.mkdir(folder)
                return folder
            except FileExistsError:
                continue
        raise FileExistsError(f"eval-{checkpoint}-{stamp}-999 exists")
    except OSError as e:
        raise _unwritable(parent, e) from None


def joined(folder: str) -> str:
    """The folder that rank 0 made, on this rank's machine (another node's has none yet)."""
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as e:
        raise _unwritable(folder, e) from None
    return folder


def _unwritable(where: str, error: OSError) -> UserError:
    reason = "not a folder" if os.path.exists(where) and not os.path.isdir(where) else None
    return UserError(
        f"eval error: --profile: cannot write the traces into {where} "
        f"({reason or error.strerror or error}); nothing was evaluated: make it writable or "
        f"name another folder with --profile-dir"
    )


class EvalProfile:
    """The profiler around one evaluation (`running`), the time its loader kept it waiting
    (`loader`), and what rank 0 reports (`summary`, `lines`)."""

    def __init__(self, folder: str, rank: int, device: torch.device) -> None:
        self.folder, self.rank, self.device = folder, rank, device
        self.wall_s = self.data_s = 0.0
        self.batches = 0
        self.trace: str | None = None
        self._prof = profile(activities=profiling.activities(device))

    def loader(self, batches: Iterable[Any]) -> Iterator[Any]:
        """`batches`, timing each wait for the next (the loader's start included)."""
        start = time.perf_counter()
        with record_function("dtrain: waiting for data"):
            iterator = iter(batches)
        self.data_s += time.perf_counter() - start
        while True:
            start = time.perf_counter()
            with record_function("dtrain: waiting for data"):
                batch = next(iterator, None)
            self.data_s += time.perf_counter() - start
            if batch is None:
                return
            self.batches += 1
            yield batch

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        """The evaluation inside, profiled and timed; its trace written after."""
        with self._prof:
            start = time.perf_counter()
            yield
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self.wall_s = time.perf_counter() - start
        try:
            profiling.trace_writer(self.folder, self.rank)(self._prof)
        except OSError as e:  # (the disk filled up since the folder was made)
            raise outputs.output_error("eval", self.folder, e) from None
        written = glob.glob(os.path.join(self.folder, f"rank{self.rank}.*.pt.trace.json"))
        self.trace = max(written, key=os.path.getmtime) if written else None

    def close(self) -> None:
        """Removes the trace folder when an evaluation that failed left it empty."""
        with contextlib.suppress(OSError):
            os.rmdir(self.folder)

    def summary(self) -> dict[str, Any]:
        """What the result file keeps: the shares of the wall time (percent; copies None on the
        CPU), the top operators and the trace."""
        ops = profiling.self_times(self._prof, self.device)
        wall_us = self.wall_s * 1e6
        on_gpu = self.device.type == "cuda"
        return {
            "wall_s": round(self.wall_s, 6),
            "batches": self.batches,
            "device": self.device.type,
            "data_percent": _percent(self.data_s * 1e6, wall_us),
            "copy_percent": _percent(profiling.copy_us(self._prof), wall_us) if on_gpu else None,
            "arithmetic_percent": _percent(
                sum(op.self_us for op in ops if ARITHMETIC.match(op.name)), wall_us
            ),
            "top": [
                {"operator": op.name, "self_ms": round(op.self_us / 1e3, 3), "calls": op.calls}
                for op in ops[:TOP_ROWS]
            ],
            "trace": self.trace,
        }


def _percent(part_us: float, whole_us: float) -> float:
    return round(min(100.0, 100.0 * part_us / whole_us), 2) if whole_us > 0 else 0.0


def lines(summary: dict[str, Any], world_size: int, folder: str, run_dir: str) -> list[str]:
    """Rank 0's report: the table of top operators, the shares, the verdict, the traces."""
    wall_ms = summary["wall_s"] * 1e3
    time_of = "GPU" if summary["device"] == "cuda" else "CPU"
    rank = f"rank 0 of {world_size}" if world_size > 1 else "one process"
    out = columns.fitted(
        f"profile ({rank}): {wall_ms:.1f} ms of wall time for {summary['batches']} batches; "
        f"the top {len(summary['top'])} operators by {time_of} time of their own:",
        columns.COLUMNS,
    )
    rows = [
        [
            _cut(op["operator"]),
            f"{op['self_ms']:.2f}",
            f"{_percent(op['self_ms'], wall_ms):.1f}",
            str(op["calls"]),
        ]
        for op in summary["top"]
    ]
    header = ["operator", "self ms", "% of wall", "calls"]
    out += columns.aligned(header, rows, [3], "the result file has them")
    copies = summary["copy_percent"]
    shares = (
        f"waiting for data (the loader): {summary['data_percent']:.1f} % of the wall time | "
        + (
            "host-device copies: none (the model runs on the CPU)"
            if copies is None
            else f"host-device copies: {copies:.1f} %"
        )
    )
    out += columns.fitted(shares, columns.COLUMNS)
    out += columns.fitted(verdict(summary), columns.COLUMNS)
    each = "one per rank, each on its rank's machine" if world_size > 1 else "one"
    if is_url(run_dir):  # a trace is for this machine's TensorBoard: it is not uploaded
        each += "; kept on this machine, not in the store"
    out += columns.fitted(
        f"traces ({each}): {folder} | TensorBoard's profiler view shows them: "
        f"tensorboard --logdir {os.path.dirname(folder)}",
        columns.COLUMNS,
    )
    return out


def _cut(name: str) -> str:
    return name if len(name) <= NAME_WIDTH else name[: NAME_WIDTH - 3] + "..."


def verdict(summary: dict[str, Any]) -> str:
    """One line: what takes the most of the wall time, and whether int8 can shorten it."""
    arithmetic, data = summary["arithmetic_percent"], summary["data_percent"]
    copies = summary["copy_percent"] or 0.0
    largest = max(arithmetic, data, copies)
    if largest >= DOMINANT_PERCENT and largest == arithmetic:
        return (
            f"verdict: matrix multiplies and convolutions take {arithmetic:.0f} % of the time: "
            f"int8 may help (dtrain export --quantize)"
        )
    if largest >= DOMINANT_PERCENT and largest == data:
        return (
            f"verdict: data loading takes {data:.0f} % of the time: quantization will not help "
            f"(more loader workers, data.num_workers, may)"
        )
    if largest >= DOMINANT_PERCENT:
        return (
            f"verdict: host-device copies take {copies:.0f} % of the time: quantization will "
            f"not help"
        )
    return (
        f"verdict: matrix multiplies and convolutions take only {arithmetic:.0f} % of the time: "
        f"int8 would shorten little of it"
    )
