"""`dtrain plan`: what a config will do, worked out before launching it.

Nothing here starts a process group or reads training data. Dataset sizes come from the config
(synthetic), from the known sizes of the built-in datasets, or from counting files (imagefolder).
The model is built on the meta device, so even a model far larger than this machine costs
nothing; activations come from a forward on fake tensors (shapes only, no memory) with hooks that
add up what autograd saves for the backward.

The state figures (parameters, gradients, optimizer state) are exact: they follow FSDP2's
sharding rule (dim 0 split into `ceil(d0 / shards)` rows per rank) and the optimizers' state
layout, and equal what a run logs as `state_bytes`. Activations, buffers and communication
volumes are estimates.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from dtrain import parallel, tasks
from dtrain.commands.plan import facts as plan_facts
from dtrain.commands.plan import footprint
from dtrain.commands.plan.footprint import activation_bytes, checkpoint_size, state_bytes
from dtrain.config import Config, dump
from dtrain.core.errors import UserError, first_line
from dtrain.data.sampler import epoch_steps


@dataclass
class Memory:
    """Per-rank bytes for one parallel mode and precision."""

    mode: str
    precision: str
    params: int
    grads: int
    optimizer: int
    activations: int | None  # None when the forward could not be traced
    buffers: int  # DDP gradient buckets, or FSDP's gathered parameters and unsharded gradients
    sharded: bool  # the state split over the ranks (FSDP), not replicated (DDP)

    @property
    def state(self) -> int:
        return self.params + self.grads + self.optimizer

    @property
    def total(self) -> int:
        return self.state + (self.activations or 0) + self.buffers


@dataclass
class Plan:
    cfg: Config
    world_size: int
    nproc: int
    nnodes: int
    device: str
    backend: str | None
    mode: str  # the row of `memory` this run is (a single process counts as DDP)
    shown_mode: str  # what it runs as: parallel.mode, or `none (one process)`
    device_bytes: int  # memory one rank can use: the GPU's, or host RAM shared by the node's ranks
    train_size: int
    val_size: int
    sample: str  # what one sample is, e.g. "3x32x32 images, 10 classes"
    data_notes: list[str]  # e.g. the image size and transform a run would choose
    model_bytes: int  # parameters and buffers of the whole model
    largest_tensor: tuple[str, int]  # name and bytes of the largest parameter or buffer
    effective_batch: int
    batch_terms: str  # how the effective batch is made
    steps_per_epoch: int
    total_steps: int
    num_params: int
    num_blocks: int
    checkpoint_format: str
    checkpoint_bytes: int
    checkpoints_kept: int
    fsdp_shards: int
    memory: list[Memory]
    comm_bytes: dict[str, int]  # mode -> bytes sent per rank per optimizer step
    state_bytes_unsharded: int
    activation_note: str = ""
    warnings: list[str] = field(default_factory=list)
    mesh_lines: list[str] = field(default_factory=list)  # under tensor parallelism

    def memory_for(self, mode: str, precision: str | None = None) -> Memory:
        precision = precision or self.cfg.train.precision
        return next(m for m in self.memory if m.mode == mode and m.precision == precision)


# ---------------------------------------------------------------------------------------------
# Data sizes without data


# ---------------------------------------------------------------------------------------------
# Putting it together


def _activations(
    model: nn.Module, cfg: Config, info: dict[str, Any], low: str
) -> tuple[dict[tuple[bool, str], int | None], str]:
    """Activation bytes per (sharded, precision): autocast keeps its casts, FSDP's policy casts
    the parameters instead; and a note when the forward cannot be traced."""
    try:
        low_dtype = torch.float16 if low == "fp16" else torch.bfloat16
        traced: dict[str, int | None] = dict(
            activation_bytes(model, cfg, _example(cfg, info), low_dtype)
        )
        note = ""
    except Exception as e:  # noqa: BLE001 - a model the tracer cannot follow: say so, go on
        traced = {"fp32": None, "autocast": None, "cast": None}
        first = first_line(e)
        note = f"activations not estimated: the forward could not be traced ({first[:120]})"
    return {
        (False, "fp32"): traced["fp32"],
        (True, "fp32"): traced["fp32"],
        (False, low): traced["autocast"],
        (True, low): traced["cast"],
    }, note


def _too_big(plan: Plan) -> str | None:
    cfg = plan.cfg
    chosen = plan.memory_for(plan.mode)
    if chosen.total <= plan.device_bytes:
        return None
    other = next(m for m in plan.memory if m.precision == chosen.precision and m is not chosen)
    hint = (
        f"; {other.mode} would need {size_text(other.total)}" if other.total < chosen.total else ""
    )
    options = [
        o
        for o, applies in (
            ("parallel.mode=fsdp", not chosen.sharded and plan.world_size > 1),
            ("train.precision=bf16", cfg.train.precision == "fp32"),
            ("model.activation_checkpointing=true", not cfg.model.activation_checkpointing),
            ("a smaller data.batch_size", True),
        )
        if applies
    ]
    return (
        f"the estimate for this run, {size_text(chosen.total)} per rank, exceeds the "
        f"{size_text(plan.device_bytes)} a rank has on {plan.device}{hint}; consider "
        f"{', '.join(options)}"
    )


def estimate(cfg: Config, nproc: int | None = None, nnodes: int = 1) -> Plan:
    """Everything `report` prints, as numbers."""
    if nproc is None:
        nproc = torch.cuda.device_count() if torch.cuda.is_available() else 1
    if nproc < 1 or nnodes < 1:
        raise UserError("plan error: --nproc and --nnodes must be >= 1")
    facts = plan_facts.model_facts(cfg, nproc, nnodes)
    layout, shards, shapes, model = facts.layout, facts.shards, facts.shapes, facts.model
    world = layout.world_size
    steps = epoch_steps(layout, cfg.train, cfg.data, len(shapes.train))
    states = {row.row: state_bytes(model, cfg, row.shards) for row in facts.counted}
    low = "fp16" if cfg.train.precision == "fp16" else "bf16"
    activations, note = _activations(model, cfg, shapes.info, low)
    memory = []
    for precision in ("fp32", low):
        itemsize = 4 if precision == "fp32" else 2
        held = footprint.parallel_buffers(
            cfg, world, shards, facts.trainable, facts.root_bytes, facts.largest_block, itemsize
        )
        for row in facts.counted:
            state = states[row.row]
            memory.append(
                Memory(
                    row.row,
                    precision,
                    state["params"],
                    state["grads"],
                    state["optimizer"],
                    activations[(row.sharded, precision)],
                    held[row.row],
                    row.sharded,
                )
            )

    fmt = layout.checkpoint_format
    plan = Plan(
        cfg=cfg,
        world_size=world,
        nproc=nproc,
        nnodes=nnodes,
        device=facts.device,
        backend=layout.backend,
        mode=facts.chosen.row,
        shown_mode=layout.shown_mode(cfg.parallel.mode),
        device_bytes=facts.device_bytes,
        train_size=len(shapes.train),
        val_size=len(shapes.val),
        sample=_describe_sample(cfg, shapes.info),
        data_notes=shapes.notes,
        model_bytes=_tensor_bytes(model),
        largest_tensor=_largest_tensor(model),
        effective_batch=layout.effective_batch,
        batch_terms=layout.batch_terms(),
        steps_per_epoch=steps.per_epoch,
        total_steps=steps.total,
        num_params=sum(p.numel() for p in model.parameters()),
        num_blocks=len(facts.blocks),
        checkpoint_format=fmt,
        checkpoint_bytes=checkpoint_size(model, cfg, shards if fmt == "sharded" else 1, world),
        checkpoints_kept=cfg.ckpt.keep_last + cfg.ckpt.keep_best,
        fsdp_shards=shards,
        memory=memory,
        comm_bytes=footprint.communication(
            cfg, world, shards, facts.trainable, facts.root_bytes, facts.block_bytes
        ),
        state_bytes_unsharded=states[facts.chosen.row]["unsharded"],
        activation_note=note,
        warnings=facts.warnings,
    )
    if layout.tp > 1 or layout.pp > 1:
        plan.mesh_lines = _mesh_lines(facts, cfg)
    too_big = _too_big(plan)
    if too_big:
        plan.warnings.append(too_big)
    return plan


def _mesh_lines(facts: plan_facts.ModelFacts, cfg: Config) -> list[str]:
    """The device mesh, each rank's place on it, what a rank holds of the model's state, and
    under pipeline parallelism the micro-batches in flight and the schedule's bubble."""
    layout, split = facts.layout, facts.tp_split
    pp, tp, shards = layout.pp, layout.tp, layout.shards
    per_stage = layout.world_size // pp

    def place(r: int) -> str:
        inner = f"{r % per_stage // tp // shards},{r % per_stage // tp % shards},{r % tp}"
        return f"{r}:({r // per_stage},{inner})" if pp > 1 else f"{r}:({inner})"

    places = [place(r) for r in range(layout.world_size)]
    shown = places if len(places) <= 16 else [*places[:8], "...", *places[-4:]]
    dims = f"dp_replicate {layout.replicas} x dp_shard {shards} x tp {tp}"
    reader = "a pipeline reads one batch" if pp > 1 else "a tp group reads one batch"
    lines = [
        f"  mesh        {f'pp {pp} x ' if pp > 1 else ''}{dims} = {layout.world_size} rank(s); "
        f"{reader}",
        f"              rank:({'pp,' if pp > 1 else ''}dp_replicate,dp_shard,tp) {' '.join(shown)}",
    ]
    if pp > 1:
        lines += _pipeline_lines(facts, cfg)
    if split is None:
        return [
            *lines,
            "              the state per rank: a user's plan (parallel.tp.plan) is "
            "applied by the run alone; the table below does not count its split",
        ]
    held: list[dict[str, int] | None] = [*facts.pp_held] if facts.pp_held else [None]
    states = [state_bytes(facts.model, cfg, shards, split=split, tp=tp, held=h) for h in held]
    state = max(states, key=lambda s: s["total"])
    where = "" if pp == 1 else f" (stage rank {states.index(state)}, the largest)"
    count = sum(p.numel() for n, p in facts.model.named_parameters() if n in split)
    over = f"{count / 1e6:.3f} M parameters split over tp, the rest replicated in each group; "
    lines.append(
        f"              the state per rank{where}: params {size_text(state['params'])}, grads "
        f"{size_text(state['grads'])}, optimizer {size_text(state['optimizer'])} "
        f"({over if tp > 1 else ''}then over {shards} data shard(s))"
    )
    split_activations = _split_activations(facts, cfg) if tp > 1 and pp == 1 else None
    if split_activations is not None:
        lines.append(
            f"              activations per rank: {size_text(split_activations)} in fp32 for a "
            f"batch of {layout.batch_size} (a tp rank's part, traced)"
        )
    return lines


def _split_activations(facts: plan_facts.ModelFacts, cfg: Config) -> int | None:
    """What one micro-batch's forward keeps for the backward on a rank of a tp group (fp32,
    traced with the model split by its plan), or None where the forward cannot be traced."""
    key = "checkpointed" if cfg.model.activation_checkpointing else "full"
    try:
        example = _example(cfg, facts.shapes.info)
        traced = footprint.traced_activations(
            facts.model, cfg, example, torch.float32, {"fp32": None}, split=True
        )
    except Exception:  # noqa: BLE001 - a model the tracer cannot follow: the state alone
        return None
    return traced["fp32"][key]


def _example(cfg: Config, info: dict[str, Any]) -> Callable[[int], Any]:
    """The task's example input of n samples (what the traces run); a task without one raises."""
    make = getattr(tasks.build(cfg.task, info), "example_input", None)
    if make is None:
        raise ValueError("the task has no example_input(info, batch_size)")
    return lambda n: make(info, n)


def _pipeline_lines(facts: plan_facts.ModelFacts, cfg: Config) -> list[str]:
    """A pipeline's cut, its micro-batches in flight and its schedule's bubble."""
    pp_cfg, layout = cfg.parallel.pp, facts.layout
    micro = pp_cfg.microbatches * layout.grad_accum
    stages = layout.pp * pp_cfg.local_stages
    flight = parallel.in_flight(pp_cfg, layout.pp, micro)
    bubble = parallel.bubble(pp_cfg.schedule, layout.pp, micro, pp_cfg.local_stages)
    by = "" if pp_cfg.split == "auto" else f" (cut by {pp_cfg.split})"
    size = layout.batch_size * layout.grad_accum // micro
    return [
        f"  pipeline    {stages} stages of the {len(facts.blocks)} blocks{by} "
        f"({pp_cfg.local_stages} per rank), schedule {pp_cfg.schedule}, {micro} micro-batches of "
        f"{size} a step",
        f"              activations of up to {flight} micro-batch(es) in flight on a stage rank"
        f"{_in_flight_bytes(facts, cfg, size, micro)}; bubble {bubble:.1%} of a step",
    ]


def _in_flight_bytes(facts: plan_facts.ModelFacts, cfg: Config, size: int, micro: int) -> str:
    """What the micro-batches in flight keep for the backward on the stage rank that keeps
    most (fp32, traced), or nothing where the forward cannot be traced."""
    pp = cfg.parallel.pp
    held = parallel.stage_blocks(facts.model, pp, pp.size, cfg.model.name, facts.blocks)
    try:
        example = _example(cfg, facts.shapes.info)
        sizes = footprint.stage_activations(facts.model, cfg, example, held, size)
    except Exception:  # noqa: BLE001 - a model the tracer cannot follow: the count alone
        return ""
    held_at_once = [
        size * parallel.in_flight(pp, pp.size, micro, rank) for rank, size in enumerate(sizes)
    ]
    largest = max(range(len(sizes)), key=held_at_once.__getitem__)
    return f": {size_text(held_at_once[largest])} in fp32 on stage rank {largest}"


def _describe_sample(cfg: Config, info: dict[str, Any]) -> str:
    if "vocab_size" in info:
        return f"windows of {info['seq_len'] + 1} tokens (vocabulary {info['vocab_size']})"
    if "image_size" in info:
        classes = cfg.model.num_classes or info.get("num_classes")
        size = info["image_size"]
        return f"{info['in_channels']}x{size}x{size} images, {classes} classes"
    return "samples as the user's dataset makes them"


def _tensor_bytes(model: nn.Module) -> int:
    tensors = {id(t): t for t in [*model.parameters(), *model.buffers()]}
    return sum(t.numel() * t.element_size() for t in tensors.values())


def _largest_tensor(model: nn.Module) -> tuple[str, int]:
    named = [*model.named_parameters(), *model.named_buffers()]
    if not named:
        return "", 0
    name, tensor = max(named, key=lambda item: item[1].numel() * item[1].element_size())
    return name, tensor.numel() * tensor.element_size()


def size_text(n: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


def report(cfg: Config, nproc: int | None = None, nnodes: int = 1) -> str:
    """The plan as text: layout, data, steps, checkpoints, memory per rank, communication."""
    p = estimate(cfg, nproc, nnodes)
    c = cfg
    max_steps = f" (train.max_steps {c.train.max_steps})" if c.train.max_steps else ""
    overfit = (
        f" (train.overfit_batches={c.train.overfit_batches}: the same "
        f"{c.train.overfit_batches} batches every epoch)"
        if c.train.overfit_batches
        else ""
    )
    lines = [
        "dtrain plan (no process group started, no training data read)",
        f"  world       {p.world_size} rank(s) = {p.nnodes} node(s) x {p.nproc} per node | device "
        f"{p.device} | backend {p.backend or 'none (single process)'} | mode {p.shown_mode} | "
        f"precision {c.train.precision}",
        *p.mesh_lines,
        f"  data        {c.data.name}: {p.train_size} train / {p.val_size} val samples, "
        f"{p.sample}{overfit}",
        *(f"              {note}" for note in p.data_notes),
        f"  batch       effective {p.effective_batch} = {p.batch_terms}",
        f"  steps       {p.steps_per_epoch} per epoch; {p.total_steps} in total over "
        f"{c.train.epochs} epoch(s){max_steps}",
        f"  model       {c.model.name}: {p.num_params / 1e6:.3f} M parameters in "
        f"{p.num_blocks} block(s)",
        f"  checkpoint  {p.checkpoint_format}, about {size_text(p.checkpoint_bytes)} each; "
        f"at most {p.checkpoints_kept} "
        f"kept (keep_last {c.ckpt.keep_last} + keep_best {c.ckpt.keep_best}) = "
        f"{size_text(p.checkpoint_bytes * p.checkpoints_kept)} on disk, "
        "one more while a save is written",
        "",
        f"memory per rank (batch {c.data.batch_size}; FSDP over "
        f"{p.fsdp_shards} shard(s); rank 0, the largest shard)",
        f"  {'':14}{'params':>11}{'grads':>11}{'optimizer':>11}{'activations':>13}"
        f"{'buffers':>11}{'total':>11}",
    ]
    for m in p.memory:
        mark = "  <- this run" if (m.mode, m.precision) == (p.mode, c.train.precision) else ""
        acts = size_text(m.activations) if m.activations is not None else "?"
        lines.append(
            f"  {m.mode + ' ' + m.precision:14}{size_text(m.params):>11}{size_text(m.grads):>11}"
            f"{size_text(m.optimizer):>11}{acts:>13}{size_text(m.buffers):>11}"
            f"{size_text(m.total):>11}{mark}"
        )
    ddp, fsdp = p.memory_for("ddp", "fp32"), p.memory_for("fsdp", "fp32")
    lines += [
        f"  state (params + grads + optimizer): ddp {ddp.state} bytes, fsdp {fsdp.state} bytes "
        f"(unsharded {p.state_bytes_unsharded}); the run logs these as state_bytes",
        *footprint.ema_lines(c, ddp.grads, fsdp.grads),
        f"  a rank has {size_text(p.device_bytes)} on {p.device}",
    ]
    if p.activation_note:
        lines.append(f"  {p.activation_note}")
    name, largest = p.largest_tensor
    lines += [
        "",
        "building and loading the model",
        f"  ddp   every rank builds the whole model: {size_text(p.model_bytes)} of parameters and "
        f"buffers",
        f"  fsdp  every rank builds only its shard (the constructor replayed row by row; "
        f"unless it cannot be, which the run says): at most one whole tensor at a time besides "
        f"the shards, the largest {size_text(largest)} ({name})",
        "  a full checkpoint or model.init_from file is read by rank 0 alone (memory-mapped) and "
        "broadcast: each rank keeps what it holds; sharded checkpoints are read by every rank, "
        "each its own shards",
    ]
    lines += ["", "communication per optimizer step per rank"]
    if p.world_size == 1:
        lines.append("  none: a single rank")
    else:
        lines.append(f"  ddp   all-reduce of fp32 gradients: {size_text(p.comm_bytes['ddp'])}")
        lines.append(
            f"  fsdp  all-gather of parameters ({c.train.precision}) + reduce-scatter of "
            f"fp32 gradients: {size_text(p.comm_bytes['fsdp'])}"
        )
    for warning in p.warnings:
        lines.append(f"WARNING: {warning}")
    lines += ["", "resolved config:", *("  " + line for line in dump(cfg).splitlines())]
    return "\n".join(lines)
