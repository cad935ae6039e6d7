"""`dtrain plan --memory-limit`: whether a job fits in the memory one node gives it, in DDP, FSDP
and FSDP with activation checkpointing, and the largest value of a config key that still fits.

The limit is for the whole job on a node, as a memory cgroup or a scheduler's limit counts it:
every rank, torchrun's agent, and the pages the kernel charges the job for beyond them. The
prediction is built from the plan's own figures (state exact; activations traced on fake
tensors), how they overlap in a step, and constants measured on CPU runs under a cgroup
(bench/frontier.py measures the frontier this predicts). A search over a key builds the model
on the meta device at each value tried, so even sizes far beyond the machine cost nothing.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from dtrain import config, parallel, tasks
from dtrain.commands.plan import command as plan
from dtrain.commands.plan import facts as plan_facts
from dtrain.commands.plan import footprint
from dtrain.config import Config
from dtrain.core.errors import UserError
from dtrain.models.spec import spec_of
from dtrain.parallel import Counted

MIB = 2**20
# Anonymous memory of one rank that no setting changes: the interpreter, torch and its CPU
# kernels' tables, the gloo process group and its threads, dtrain itself, a loader. Measured as
# the largest RssAnon of a 2-rank CPU run of a model of 20 K parameters: 365-367 MiB per rank.
PROCESS_BYTES = 366 * MIB
# torchrun's agent (it imports torch too, but starts no process group): RssAnon 282-283 MiB.
AGENT_BYTES = 283 * MIB
# What the kernel charges the job at its peak beyond the processes' anonymous memory: the
# shared libraries' pages the job faults in (RssFile is ~310 MiB a process, mostly torch's
# libraries, shared by the processes of the node, most of them not charged to the job when
# already cached), and the checkpoint's page cache not yet written back when it is reclaimed
# (DCP writes one file per rank and fsyncs it: clean pages are dropped under the limit, dirty
# ones wait for writeback), the extra working memory of a block's backward
# (BACKWARD_BLOCKS). Both calibrated together against frontiers measured under a cgroup
# (bench/frontier.py, 2 ranks, AdamW, fp32): each frontier (fits at d, not at d + 1) bounds
# them, and these are in every bound: transformer dim 512 under 3 GiB (DDP 18), dim 1024 under
# 6 GiB (DDP 12, FSDP 24), GPT dim 512 under 6 GiB (DDP 20, FSDP + checkpointing 96).
NODE_BYTES = 150 * MIB
BACKWARD_BLOCKS = 2.0
# Extra headroom per rank in CUDA runs' host memory: the CUDA context and its libraries.
CUDA_CONTEXT_BYTES = 1024 * MIB
# A sharded strategy's row once more, with activation checkpointing.
CHECKPOINTED = "+ac"
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?)B?\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """'6GiB', '6G', '512MiB', '1.5GB', '1000000' -> bytes (K/M/G/T are powers of 1024 with or
    without 'i', as memory limits are given; a plain number is bytes)."""
    found = _SIZE.match(text)
    if not found or (found.group(3) and not found.group(2)):
        raise UserError(
            f"plan error: --memory-limit '{text}' is not a size; give e.g. 6GiB, 6G, 512MiB or "
            "a number of bytes"
        )
    number, unit = float(found.group(1)), found.group(2).upper()
    size = int(number * 1024 ** " KMGT".index(unit or " "))
    if size <= 0:
        raise UserError(f"plan error: --memory-limit '{text}' must be more than 0 bytes")
    return size


@dataclass
class Fit:
    """One mode under the limit: the peak a rank reaches, its parts, and the job's total."""

    mode: str
    device: str  # "cpu": the peak is host memory; else the device's memory per rank
    parts: dict[str, int]  # per rank: fixed, params, grads, optimizer, activations, buffers
    peak_bytes_per_rank: int
    job_bytes: int  # host memory of the whole job on one node
    fits: bool
    largest: int | None = None

    def describe(self) -> str:
        parts = ", ".join(f"{k} {v / MIB:.0f}" for k, v in self.parts.items())
        where = "host" if self.device == "cpu" else f"{self.device} memory"
        return (
            f"{where} per rank {self.peak_bytes_per_rank / MIB:.0f} MiB ({parts}); "
            f"job {self.job_bytes / MIB:.0f} MiB"
        )


def _activations(model: torch.nn.Module, cfg: Config, info: dict[str, Any]) -> dict[str, int]:
    """Saved-for-backward bytes without ("full") and with ("checkpointed") checkpointing, and
    the largest block's ("block"), in the run's precision (FSDP's cast; what autocast keeps is
    close to it). Zero where the forward cannot be traced."""
    task = tasks.build(cfg.task, info)
    make = getattr(task, "example_input", None)
    none = {"full": 0, "checkpointed": 0, "block": 0}
    if make is None:
        return none
    try:
        if cfg.train.precision == "fp32":
            return footprint.activation_bytes_fp32(model, cfg, lambda n: make(info, n))
        low = torch.float16 if cfg.train.precision == "fp16" else torch.bfloat16
        return footprint.traced_activations(model, cfg, lambda n: make(info, n), low, {"c": None})[
            "c"
        ]
    except Exception:  # noqa: BLE001 - the plan's own report says why it could not trace
        return none


def evaluate(cfg: Config, nproc: int, nnodes: int, limit: int) -> dict[str, Fit]:
    """Every mode of `cfg` at `nproc` ranks per node, against `limit` bytes for the job."""
    facts = plan_facts.model_facts(cfg, nproc, nnodes)
    model, blocks, shards, device = facts.model, facts.blocks, facts.shards, facts.device
    itemsize = 4 if cfg.train.precision == "fp32" else 2
    held = footprint.parallel_buffers(
        cfg,
        facts.layout.world_size,
        shards,
        facts.trainable,
        facts.root_bytes,
        facts.largest_block,
        itemsize,
    )
    acts = _activations(model, cfg, facts.shapes.info)
    fits = {}
    for mode, row, checkpointed in _rows(facts.counted):
        state = footprint.state_bytes(model, cfg, row.shards)
        act = acts["checkpointed" if checkpointed and blocks else "full"]
        # When the peak comes. DDP's gradients are views into its all-reduce buckets, which live
        # from the first step on: everything adds up at the end of the forward. FSDP frees its
        # sharded gradients at every zero_grad: the backward turns activations into gradients,
        # and the peak is the larger of the two, beside the gathered block and its gradient.
        grads_at_peak = state["grads"] if row.shards == 1 else 0
        growing = max(act, state["grads"] - grads_at_peak)
        # A block's backward makes the gradients of its activations and autograd's temporaries
        # next to what it saved: BACKWARD_BLOCKS times the largest block's activations. Not
        # counted: the evaluation (a forward without autograd: one block's activations at a
        # time, far below the training step's peak), and the sharded save's own copies (DCP
        # serialises one tensor at a time from the state in place, and fsyncs each rank's file:
        # its page cache is clean and reclaimed under the limit, see NODE_BYTES). What they add
        # at all is inside NODE_BYTES: the frontiers it was fitted to include both.
        working = int(BACKWARD_BLOCKS * acts["block"])
        on_device = (
            state["params"] + grads_at_peak + state["optimizer"] + growing + held[row.row] + working
        )
        parts = {
            "fixed": PROCESS_BYTES,
            "params": state["params"],
            "grads": state["grads"],
            "optimizer": state["optimizer"],
            "activations": act,
            "backward": working,
            "buffers": held[row.row],
        }
        if not device.startswith("cuda"):  # the CPU, or an Apple GPU's memory shared with it
            peak = PROCESS_BYTES + on_device
            job = AGENT_BYTES + nproc * peak + NODE_BYTES
            ok = job <= limit
        else:  # the device holds the step; the host the processes and the checkpoint's copies
            parts["fixed"] = PROCESS_BYTES + CUDA_CONTEXT_BYTES
            peak = on_device
            job = AGENT_BYTES + nproc * (parts["fixed"] + state["total"]) + NODE_BYTES
            ok = job <= limit and peak <= facts.device_bytes
        fits[mode] = Fit(mode, device, parts, peak, job, ok)
    return fits


def _key_value(cfg: Config, key: str) -> int:
    """The integer value of `key` in `cfg`; a plan error for an unknown or non-integer key."""
    node: Any = config.to_dict(cfg)
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            if key.startswith("model.args.") and isinstance(node, dict):
                raise UserError(
                    f"plan error: --grow {key}: not set in the config; set it (e.g. "
                    f"{key}=12) for plan to grow it from there"
                )
            raise UserError(f"plan error: --grow {key}: no such config key (e.g. model.args.depth)")
        node = node[part]
    if isinstance(node, bool) or not isinstance(node, int):
        raise UserError(
            f"plan error: --grow {key}: its value {node!r} is not an integer; choose an "
            "integer key such as model.args.depth or data.batch_size"
        )
    return node


def with_value(cfg: Config, key: str, value: int) -> Config:
    data = config.to_dict(cfg)
    node = data
    *path, last = key.split(".")
    for part in path:
        node = node[part]
    node[last] = value
    return config.from_dict(data)


def _search(
    fits: Callable[[int], bool], job: Callable[[int], int], limit: int, start: int
) -> int | None:
    """The largest value >= 1 for which `fits` holds (0 if none), assuming it holds up to a point:
    from `start`, extrapolating (or halving) until the limit is bracketed, then interpolating the
    job's bytes (close to linear in a depth or a batch size: a few evaluations do) with every third
    step a bisection, so that any curve ends. None when the bytes do not grow with the value."""
    low, high = 0, None  # low fits (0: none known), high does not
    value, steps, grown = max(1, start), 0, 0
    while True:
        if fits(value):
            low = value
        else:
            high = value
        if high is not None and high - low <= 1:
            return low
        if high is None:
            if grown and job(low) <= job(grown):
                return None  # no limit to find: the key does not change what the job holds
            value = 2 * low
            if grown:  # where the line through the last two points crosses the limit
                slope = (job(low) - job(grown)) / (low - grown)
                value = min(max(math.floor(low + (limit - job(low)) / slope), low + 1), 8 * low)
            grown = low
        elif low == 0:
            value = max(1, high // 2)
        elif steps % 3 != 2:
            steps += 1
            slope = (job(high) - job(low)) / (high - low)
            aim = low + (limit - job(low)) / slope if slope > 0 else (low + high) / 2
            value = min(max(math.floor(aim), low + 1), high - 1)
        else:
            value = (low + high) // 2
            steps += 1


def fit(
    cfg: Config, nproc: int = 1, nnodes: int = 1, limit: int = 0, grow: str = ""
) -> dict[str, Fit]:
    """Every mode against `limit`; with `grow`, each mode's largest value of that key."""
    if nproc < 1 or nnodes < 1:
        raise UserError("plan error: --nproc and --nnodes must be >= 1")
    fits = evaluate(cfg, nproc, nnodes, limit)
    if not grow:
        return fits
    start = _key_value(cfg, grow)
    cache: dict[int, dict[str, Fit]] = {start: fits}

    def at(value: int) -> dict[str, Fit]:
        if value not in cache:
            try:
                cache[value] = evaluate(with_value(cfg, grow, value), nproc, nnodes, limit)
            except UserError:  # a value the config refuses (heads must divide dim, ...)
                cache[value] = {m: dataclasses.replace(f, fits=False) for m, f in fits.items()}
        return cache[value]

    for mode, f in fits.items():

        def ok(value: int, mode: str = mode) -> bool:
            return at(value)[mode].fits

        def job(value: int, mode: str = mode) -> int:
            return at(value)[mode].job_bytes

        f.largest = _search(ok, job, limit, start)
    return fits


# ---------------------------------------------------------------------------------------------
# What `dtrain plan --memory-limit` prints


def _rows(counted: list[Counted]) -> list[tuple[str, Counted, bool]]:
    """The modes the fit compares, each with its strategy and whether activations are
    checkpointed: every strategy `dtrain plan` counts, and each sharded one again with
    activation checkpointing."""
    plain = [(row.row, row, False) for row in counted]
    return plain + [(row.row + CHECKPOINTED, row, True) for row in counted if row.sharded]


def _chosen(cfg: Config) -> str:
    """The mode of the fit that this run is."""
    asked = parallel.configured(cfg.parallel)
    checkpointed = asked.sharded and cfg.model.activation_checkpointing
    return asked.plan_row + (CHECKPOINTED if checkpointed else "")


def _micro_batch(cfg: Config, nproc: int, nnodes: int, limit: int) -> tuple[int, int] | None:
    """The largest micro-batch (and the accumulation that keeps the effective batch) at which
    FSDP with activation checkpointing fits; None if not even one sample does."""
    total = cfg.data.batch_size * cfg.train.grad_accum
    cache: dict[int, Fit] = {}

    def at(batch: int) -> Fit:
        if batch not in cache:
            smaller = with_value(cfg, "data.batch_size", batch)
            smaller = with_value(smaller, "train.grad_accum", math.ceil(total / batch))
            cache[batch] = evaluate(smaller, nproc, nnodes, limit)["fsdp+ac"]
        return cache[batch]

    found = _search(lambda b: at(b).fits, lambda b: at(b).job_bytes, limit, cfg.data.batch_size)
    if not found:
        return None
    batch = min(found, cfg.data.batch_size)
    return batch, math.ceil(total / batch)


def _suggestion(cfg: Config, fits: dict[str, Fit], nproc: int, nnodes: int, limit: int) -> str:
    chosen = _chosen(cfg)
    if fits[chosen].fits:
        return f"this run ({chosen}) fits"
    if chosen == "ddp" and fits["fsdp"].fits:
        return "parallel.mode=fsdp (FSDP shards the state over the ranks)"
    if fits["fsdp+ac"].fits:
        return (
            "parallel.mode=fsdp model.activation_checkpointing=true (FSDP, and activations "
            "recomputed in the backward)"
        )
    smaller = _micro_batch(cfg, nproc, nnodes, limit)
    if smaller is None:
        return (
            "nothing fits, not even one sample per rank with FSDP and activation checkpointing: "
            "more memory, more nodes, or a smaller model"
        )
    batch, accum = smaller
    return (
        f"parallel.mode=fsdp model.activation_checkpointing=true data.batch_size={batch} "
        f"train.grad_accum={accum} (a smaller micro-batch, accumulated to an effective batch of "
        f"{batch * accum * nproc * nnodes})"
    )


def _as_json(f: Fit) -> dict[str, Any]:
    return {"fits": f.fits, "peak_bytes_per_rank": f.peak_bytes_per_rank, "largest": f.largest}


def render(cfg: Config, nproc: int | None, nnodes: int, limit: int, grow: str, fmt: str) -> str:
    """The fit of every mode as text (with a suggestion) or as JSON."""
    import json

    if nproc is None:
        nproc = torch.cuda.device_count() if torch.cuda.is_available() else 1
    fits = fit(cfg, nproc, nnodes, limit, grow)
    # A LoRA run's frontier beside full fine-tuning's: what freezing the base buys.
    spec = spec_of(cfg.model)
    plain = dataclasses.replace(cfg, model=spec.base)
    full = fit(plain, nproc, nnodes, limit, grow) if spec.adapters else {}
    if fmt == "json":
        shown = {mode: _as_json(f) for mode, f in fits.items()}
        if full:
            shown["full_fine_tuning"] = {mode: _as_json(f) for mode, f in full.items()}
        return json.dumps(shown)
    chosen = _chosen(cfg)
    rows = [(mode, f, "  <- this run" if mode == chosen else "") for mode, f in fits.items()]
    if full:
        rows = [(f"LoRA {mode}", f, mark) for mode, f, mark in rows]
        rows += [(f"full {mode}", f, "") for mode, f in full.items()]
    width = max(9, *(len(mode) + 2 for mode, _, _ in rows))
    grown = f"  largest {grow}" if grow else ""
    lines = [
        f"dtrain plan: memory for the whole job on one node, limit {plan.size_text(limit)} "
        f"({nproc} rank(s), torchrun's agent, the pages the kernel charges the job)",
        f"  {'mode':{width}}{'fits':6}{'peak per rank':>15}{'job':>12}{grown}",
    ]
    for mode, f, mark in rows:
        largest = "" if not grow else f"  {f.largest if f.largest is not None else 'any'}"
        peak = plan.size_text(f.peak_bytes_per_rank)
        lines.append(
            f"  {mode:{width}}{'yes' if f.fits else 'no':6}{peak:>15}"
            f"{plan.size_text(f.job_bytes):>12}{largest}{mark}"
        )
    lines.append(
        "per rank (MiB; the peak adds them up, but under FSDP the gradients, freed at every "
        "zero_grad, and the activations take turns: the larger of the two counts):"
    )
    for mode, f, _ in rows:
        lines.append(
            f"  {mode:{width}}" + ", ".join(f"{k} {v / MIB:.0f}" for k, v in f.parts.items())
        )
    if grow and any(f.largest == 0 for f in fits.values()):
        lines.append(f"  largest 0: not even {grow}=1 fits in that mode")
    lines.append(f"suggested: {_suggestion(cfg, fits, nproc, nnodes, limit)}")
    return "\n".join(lines)
