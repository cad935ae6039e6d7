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

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset

from dtrain import data, footprint, models, parallel, tasks
from dtrain import layout as layout_mod
from dtrain.config import Config, dump
from dtrain.env import Env, device_index
from dtrain.errors import UserError, first_line
from dtrain.footprint import activation_bytes, checkpoint_size, state_bytes
from dtrain.imports import is_import_path
from dtrain.layout import Layout

# Sizes of the built-in torchvision datasets: (train, val, channels, image size, classes).
KNOWN_DATASETS = {
    "cifar10": (50000, 10000, 3, 32, 10),
    "mnist": (60000, 10000, 1, 28, 10),
    "fashion_mnist": (60000, 10000, 1, 28, 10),
}


class _SizeOnly(Dataset):
    """Stands in for a dataset of which plan needs the length only."""

    def __init__(self, size: int) -> None:
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: object) -> None:
        raise IndexError("dtrain plan reads no samples")


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
    device_bytes: int  # memory one rank can use: the GPU's, or host RAM shared by the node's ranks
    train_size: int
    val_size: int
    sample: str  # what one sample is, e.g. "3x32x32 images, 10 classes"
    data_notes: list[str]  # e.g. the image size and transform a run would choose
    model_bytes: int  # parameters and buffers of the whole model
    largest_tensor: tuple[str, int]  # name and bytes of the largest parameter or buffer
    effective_batch: int
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

    def memory_for(self, mode: str, precision: str | None = None) -> Memory:
        precision = precision or self.cfg.train.precision
        return next(m for m in self.memory if m.mode == mode and m.precision == precision)


# ---------------------------------------------------------------------------------------------
# Data sizes without data


def _dataset_shapes(cfg: Config) -> data.Datasets:
    """Datasets of the right lengths whose samples are never read, with what models need (and,
    for images, the size and transform a run would choose, as a note)."""
    from dtrain.data import images

    dcfg = cfg.data
    if is_import_path(
        dcfg.name
    ):  # a user's datasets: constructing them is the only way to learn the sizes
        return data.build(dcfg, cfg.run.seed, cfg.model.args)
    if dcfg.name == "text":
        from dtrain.data import text

        seq_len = data.seq_len_of(dcfg, cfg.model.args)
        train, val = text.window_counts(dcfg, seq_len)
        return data.Datasets(
            train=_SizeOnly(train),
            val=_SizeOnly(val),
            info={"vocab_size": text.VOCAB_SIZE, "seq_len": seq_len},
        )
    if dcfg.name == "hf":  # rows counted, columns checked, a sample of headers read
        from dtrain.data import hf

        found = hf.survey(dcfg, cfg.run.seed)
        return data.Datasets(
            train=_SizeOnly(found.rows[0]),
            val=_SizeOnly(found.rows[1]),
            info=found.info,
            notes=found.notes,
        )
    if dcfg.name == "tokens":  # windows counted from meta.json and the files' sizes
        from dtrain.data import tokens

        seq_len = data.seq_len_of(dcfg, cfg.model.args)
        train, val, info = tokens.window_counts(dcfg, seq_len)
        return data.Datasets(train=_SizeOnly(train), val=_SizeOnly(val), info=info)
    if dcfg.name == "imagefolder":  # listed and a sample of headers read: nothing decoded
        (train_list, _, _), (val_list, _, _) = (
            images.list_split(dcfg.root, s) for s in ("train", "val")
        )
        skip = dcfg.on_bad_sample == "skip"
        sizes = (
            []
            if dcfg.image_size
            else (images.header_sizes(train_list, skip) + images.header_sizes(val_list, skip))
        )
        size, why = images.choose_size(dcfg, sizes)
        train, val, channels, classes = (
            len(train_list.files),
            len(val_list.files),
            3,
            len(train_list.classes),
        )
    elif dcfg.name == "synthetic" or dcfg.name in KNOWN_DATASETS:
        from dtrain import synthetic

        known = KNOWN_DATASETS.get(dcfg.name) or (
            dcfg.synthetic.train_size,
            dcfg.synthetic.val_size,
            3,
            synthetic.IMAGE_SIZE,
            len(synthetic.CLASSES),
        )
        train, val, channels, native_size, classes = known
        size = dcfg.image_size or native_size
        why = "their own size" if size == native_size else "data.image_size"
    else:
        data.build(dcfg, cfg.run.seed)  # raises the run's own error for an unknown name
        raise AssertionError("unreachable")
    kind, kind_why = images.choose_transform(dcfg, size)
    note = f"images {size}x{size} ({why}), transform {kind} ({kind_why})"
    return data.Datasets(
        train=_SizeOnly(train),
        val=_SizeOnly(val),
        info={"num_classes": classes, "in_channels": channels, "image_size": size},
        notes=[note],
    )


# ---------------------------------------------------------------------------------------------
# Putting it together


def _device_memory(layout: Layout) -> tuple[str, int, list[str]]:
    """The device rank 0 of the layout gets, described; the memory one rank may use; warnings
    for a launch the run would refuse (more ranks on a node than GPUs)."""
    device, nproc = layout.device, layout.ranks_per_node
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if device.type == "mps":
        return "mps", ram, []
    if device.type != "cuda":
        return "cpu", ram // nproc, []  # the node's ranks share its RAM
    warnings = []
    last_rank = dataclasses.replace(layout.env, local_rank=nproc - 1)
    try:
        device_index(last_rank, torch.cuda.device_count())
    except UserError as e:
        warnings.append(f"{str(e).removeprefix('device error: ')}: the run will stop there")
    props = torch.cuda.get_device_properties(0)
    return f"cuda ({props.name})", props.total_memory, warnings


def _build_meta_model(cfg: Config, shapes: data.Datasets) -> nn.Module:
    with torch.device("meta"):
        return models.build(cfg.model, shapes.info, cfg.run.seed)


def _param_bytes(modules: list[nn.Module]) -> int:
    return sum(p.numel() * p.element_size() for m in modules for p in m.parameters())


def _activations(
    model: nn.Module, cfg: Config, info: dict[str, Any], low: str
) -> tuple[dict[tuple[str, str], int | None], str]:
    """Activation bytes per (mode, precision), and a note when the forward cannot be traced."""
    task = tasks.build(cfg.task, info)
    make = getattr(task, "example_input", None)
    try:
        if make is None:
            raise ValueError("the task has no example_input(info, batch_size)")
        traced: dict[str, int | None] = dict(
            activation_bytes(
                model,
                cfg,
                lambda n: make(info, n),
                torch.float16 if low == "fp16" else torch.bfloat16,
            )
        )
        note = ""
    except Exception as e:  # noqa: BLE001 - a model the tracer cannot follow: say so, go on
        traced = {"fp32": None, "autocast": None, "cast": None}
        first = first_line(e)
        note = f"activations not estimated: the forward could not be traced ({first[:120]})"
    return {
        ("ddp", "fp32"): traced["fp32"],
        ("fsdp", "fp32"): traced["fp32"],
        ("ddp", low): traced["autocast"],
        ("fsdp", low): traced["cast"],
    }, note


def _too_big(plan: Plan) -> str | None:
    cfg = plan.cfg
    chosen = plan.memory_for(_mode(cfg))
    if chosen.total <= plan.device_bytes:
        return None
    other = plan.memory_for("ddp" if chosen.mode == "fsdp" else "fsdp")
    hint = f"; {other.mode} would need {_size(other.total)}" if other.total < chosen.total else ""
    options = [
        o
        for o, applies in (
            ("parallel.mode=fsdp", chosen.mode != "fsdp" and plan.world_size > 1),
            ("train.precision=bf16", cfg.train.precision == "fp32"),
            ("model.activation_checkpointing=true", not cfg.model.activation_checkpointing),
            ("a smaller data.batch_size", True),
        )
        if applies
    ]
    return (
        f"the estimate for this run, {_size(chosen.total)} per rank, exceeds the "
        f"{_size(plan.device_bytes)} a rank has on {plan.device}{hint}; consider "
        f"{', '.join(options)}"
    )


def _launch(cfg: Config, nproc: int, nnodes: int, mode: str | None = None) -> Layout:
    """The layout of rank 0 of a launch of `nnodes` x `nproc` ranks (in `mode` if given)."""
    world = nproc * nnodes
    env = Env(
        launcher="torchrun" if world > 1 else "single",
        world_size=world,
        local_world_size=nproc,
        num_nodes=nnodes,
    )
    if mode is not None:
        cfg = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, mode=mode))
    return layout_mod.resolve(cfg, env)


def estimate(cfg: Config, nproc: int | None = None, nnodes: int = 1) -> Plan:
    """Everything `report` prints, as numbers."""
    if nproc is None:
        nproc = torch.cuda.device_count() if torch.cuda.is_available() else 1
    if nproc < 1 or nnodes < 1:
        raise UserError("plan error: --nproc and --nnodes must be >= 1")
    layout = _launch(cfg, nproc, nnodes)
    world = layout.world_size
    shards = _launch(cfg, nproc, nnodes, "fsdp").shards  # the FSDP column, whatever the mode
    device, device_bytes, warnings = _device_memory(layout)

    shapes = _dataset_shapes(cfg)
    steps = layout.steps(cfg, len(shapes.train))

    model = _build_meta_model(cfg, shapes)
    wrap = cfg.parallel.fsdp.wrap if isinstance(cfg.parallel.fsdp.wrap, list) else None
    blocks = [b for b in parallel.find_blocks(model, wrap) if b is not model]
    ddp_state, fsdp_state = state_bytes(model, cfg, 1), state_bytes(model, cfg, shards)
    trainable = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    low = "fp16" if cfg.train.precision == "fp16" else "bf16"
    activations, note = _activations(model, cfg, shapes.info, low)

    largest_block = max((_param_bytes([b]) for b in blocks), default=0)
    block_bytes = _param_bytes(blocks)
    root_bytes = _param_bytes([model]) - block_bytes
    memory = []
    for precision in ("fp32", low):
        itemsize = 4 if precision == "fp32" else 2
        held = footprint.parallel_buffers(
            cfg, world, shards, trainable, root_bytes, largest_block, itemsize
        )
        for mode, state, buffers in (
            ("ddp", ddp_state, held["ddp"]),
            ("fsdp", fsdp_state, held["fsdp"]),
        ):
            memory.append(
                Memory(
                    mode,
                    precision,
                    state["params"],
                    state["grads"],
                    state["optimizer"],
                    activations[(mode, precision)],
                    buffers,
                )
            )

    fmt = layout.checkpoint_format
    plan = Plan(
        cfg=cfg,
        world_size=world,
        nproc=nproc,
        nnodes=nnodes,
        device=device,
        backend=layout.backend,
        device_bytes=device_bytes,
        train_size=len(shapes.train),
        val_size=len(shapes.val),
        sample=_describe_sample(cfg, shapes.info),
        data_notes=shapes.notes,
        model_bytes=_tensor_bytes(model),
        largest_tensor=_largest_tensor(model),
        effective_batch=layout.effective_batch,
        steps_per_epoch=steps.per_epoch,
        total_steps=steps.total,
        num_params=sum(p.numel() for p in model.parameters()),
        num_blocks=len(blocks),
        checkpoint_format=fmt,
        checkpoint_bytes=checkpoint_size(model, cfg, shards if fmt == "sharded" else 1, world),
        checkpoints_kept=cfg.ckpt.keep_last + cfg.ckpt.keep_best,
        fsdp_shards=shards,
        memory=memory,
        comm_bytes=footprint.communication(cfg, world, shards, trainable, root_bytes, block_bytes),
        state_bytes_unsharded=ddp_state["unsharded"],
        activation_note=note,
        warnings=warnings,
    )
    too_big = _too_big(plan)
    if too_big:
        plan.warnings.append(too_big)
    return plan


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


def _mode(cfg: Config) -> str:
    return "fsdp" if cfg.parallel.mode == "fsdp" else "ddp"


def _size(n: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


def report(cfg: Config, nproc: int | None = None, nnodes: int = 1) -> str:
    """The plan as text: layout, data, steps, checkpoints, memory per rank, communication."""
    p = estimate(cfg, nproc, nnodes)
    c = cfg
    chosen_mode = _mode(cfg)
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
        f"{p.device} | backend {p.backend or 'none (single process)'} | mode {c.parallel.mode} | "
        f"precision {c.train.precision}",
        f"  data        {c.data.name}: {p.train_size} train / {p.val_size} val samples, "
        f"{p.sample}{overfit}",
        *(f"              {note}" for note in p.data_notes),
        f"  batch       effective {p.effective_batch} = {c.data.batch_size} per rank x "
        f"{p.world_size} rank(s) x {c.train.grad_accum} accumulation",
        f"  steps       {p.steps_per_epoch} per epoch; {p.total_steps} in total over "
        f"{c.train.epochs} epoch(s){max_steps}",
        f"  model       {c.model.name}: {p.num_params / 1e6:.3f} M parameters in "
        f"{p.num_blocks} block(s)",
        f"  checkpoint  {p.checkpoint_format}, about {_size(p.checkpoint_bytes)} each; "
        f"at most {p.checkpoints_kept} "
        f"kept (keep_last {c.ckpt.keep_last} + keep_best {c.ckpt.keep_best}) = "
        f"{_size(p.checkpoint_bytes * p.checkpoints_kept)} on disk, "
        "one more while a save is written",
        "",
        f"memory per rank (batch {c.data.batch_size}; FSDP over "
        f"{p.fsdp_shards} shard(s); rank 0, the largest shard)",
        f"  {'':14}{'params':>11}{'grads':>11}{'optimizer':>11}{'activations':>13}"
        f"{'buffers':>11}{'total':>11}",
    ]
    for m in p.memory:
        mark = "  <- this run" if (m.mode, m.precision) == (chosen_mode, c.train.precision) else ""
        acts = _size(m.activations) if m.activations is not None else "?"
        lines.append(
            f"  {m.mode + ' ' + m.precision:14}{_size(m.params):>11}{_size(m.grads):>11}"
            f"{_size(m.optimizer):>11}{acts:>13}{_size(m.buffers):>11}"
            f"{_size(m.total):>11}{mark}"
        )
    ddp, fsdp = p.memory_for("ddp", "fp32"), p.memory_for("fsdp", "fp32")
    lines += [
        f"  state (params + grads + optimizer): ddp {ddp.state} bytes, fsdp {fsdp.state} bytes "
        f"(unsharded {p.state_bytes_unsharded}); the run logs these as state_bytes",
        *footprint.ema_lines(c, ddp.grads, fsdp.grads),
        f"  a rank has {_size(p.device_bytes)} on {p.device}",
    ]
    if p.activation_note:
        lines.append(f"  {p.activation_note}")
    name, largest = p.largest_tensor
    lines += [
        "",
        "building and loading the model",
        f"  ddp   every rank builds the whole model: {_size(p.model_bytes)} of parameters and "
        f"buffers",
        f"  fsdp  every rank builds only its shard (the constructor replayed row by row; "
        f"unless it cannot be, which the run says): at most one whole tensor at a time besides "
        f"the shards, the largest {_size(largest)} ({name})",
        "  a full checkpoint or model.init_from file is read by rank 0 alone (memory-mapped) and "
        "broadcast: each rank keeps what it holds; sharded checkpoints are read by every rank, "
        "each its own shards",
    ]
    lines += ["", "communication per optimizer step per rank"]
    if p.world_size == 1:
        lines.append("  none: a single rank")
    else:
        lines.append(f"  ddp   all-reduce of fp32 gradients: {_size(p.comm_bytes['ddp'])}")
        lines.append(
            f"  fsdp  all-gather of parameters ({c.train.precision}) + reduce-scatter of "
            f"fp32 gradients: {_size(p.comm_bytes['fsdp'])}"
        )
    for warning in p.warnings:
        lines.append(f"WARNING: {warning}")
    lines += ["", "resolved config:", *("  " + line for line in dump(cfg).splitlines())]
    return "\n".join(lines)
