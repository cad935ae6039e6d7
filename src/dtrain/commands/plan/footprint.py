"""What a run will hold and send, computed from shapes alone (a model on the meta device, fake
tensors for the forward): state bytes per rank (exact: FSDP2's sharding rule and the optimizers'
state layout), checkpoint size, activation bytes saved for the backward, communication volume.
`dtrain plan` puts these together with the run's layout.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from dtrain import parallel
from dtrain.checkpoint.load import trained_shapes
from dtrain.config import Config, registry
from dtrain.loop.optim import StateShape
from dtrain.models.spec import spec_of
from dtrain.parallel.sharded_init import shard_rows
from dtrain.parallel.tensor import parallelize, plan_of
from dtrain.process import compat

# RNG states (~15 KiB per rank), the resolved config and the small training state in a checkpoint.
CHECKPOINT_META_BYTES_PER_RANK = 16 * 1024
# Container overhead per stored tensor: an entry in checkpoint.pt's zip ("full"), or a torch.save
# of its own in a .distcp file plus its line in DCP's .metadata ("sharded"). It matters only for
# small models, where it can double the size.
FULL_BYTES_PER_TENSOR = 270
DCP_BYTES_PER_ITEM = 1800
_ADAM_STEP_BYTES = 4  # Adam's per-parameter `step` is a float32 scalar tensor, never sharded


# ---------------------------------------------------------------------------------------------
# State: parameters, gradients, optimizer state per rank


def _local_bytes(p: torch.Tensor, shards: int, rank: int) -> int:
    if shards == 1 or p.dim() == 0:
        return p.numel() * p.element_size()
    per_row = p.numel() // p.shape[0] if p.shape[0] else 0
    start, stop = shard_rows(p.shape[0], shards, rank)
    return (stop - start) * per_row * p.element_size()


def optimizer_state(cfg: Config) -> StateShape:
    """What the optimizer keeps per parameter, as its registry entry says."""
    shape: StateShape = registry.OPTIMIZERS.sizes(cfg.optim.name)(cfg.optim)
    return shape


def ema_copies(cfg: Config) -> int:
    """Copies of the trainable parameters that train.ema keeps (sharded like them)."""
    return 1 if cfg.train.ema.decay is not None else 0


def state_bytes(
    model: nn.Module,
    cfg: Config,
    shards: int,
    rank: int = 0,
    split: Collection[str] = (),
    tp: int = 1,
    held: dict[str, int] | None = None,
) -> dict[str, int]:
    """The bytes `run.state_bytes` measures after the first step, computed from shapes:
    params, grads, optimizer (the EMA weights included) and their total for `rank` of `shards`,
    and 'unsharded'. The parameters named in `split` are split over `tp` ranks besides; with
    `held` (a pipeline stage rank's), only the parameters it names, as many times as it says."""
    state = optimizer_state(cfg)
    slots, adam = state.slots + ema_copies(cfg), state.step
    totals = {"params": 0, "grads": 0, "optimizer": 0, "unsharded": 0}
    for name, p in model.named_parameters():
        copies = 1 if held is None else held.get(name, 0)
        if not copies:
            continue
        local, full = _local_bytes(p, shards, rank), p.numel() * p.element_size()
        if name in split:
            local //= tp
        local, full = local * copies, full * copies
        totals["params"] += local
        totals["unsharded"] += full
        if not p.requires_grad:
            continue
        totals["grads"] += local
        totals["optimizer"] += slots * local + (_ADAM_STEP_BYTES if adam else 0)
        totals["unsharded"] += full + slots * full + (_ADAM_STEP_BYTES if adam else 0)
    totals["total"] = totals["params"] + totals["grads"] + totals["optimizer"]
    return totals


def checkpoint_size(model: nn.Module, cfg: Config, shards: int, world: int) -> int:
    """Bytes of one checkpoint on disk: model state, optimizer state, their container overhead
    ("full" when `shards` is 1, DCP pieces from every rank holding a shard otherwise), and the
    per-rank metadata."""
    state = optimizer_state(cfg)
    # the EMA weights: one tensor per parameter more
    slots, adam = state.slots + ema_copies(cfg), state.step
    # What a checkpoint holds of the model: all of it, or a LoRA run's adapters (and buffers).
    held = trained_shapes(model, spec_of(cfg.model))
    tensors = {k: t for k, t in model.state_dict().items() if k in held}
    data_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
    trainable = [p for p in model.parameters() if p.requires_grad]
    data_bytes += sum(slots * p.numel() * p.element_size() for p in trainable)
    data_bytes += _ADAM_STEP_BYTES * len(trainable) if adam else 0
    meta = CHECKPOINT_META_BYTES_PER_RANK * world
    per_param_tensors = slots + (1 if adam else 0)
    if shards == 1:
        count = len(tensors) + per_param_tensors * len(trainable)
        return data_bytes + count * FULL_BYTES_PER_TENSOR + meta

    def pieces(t: torch.Tensor) -> int:  # ranks with a non-empty shard of a parameter
        return sum(1 for r in range(shards) if _local_bytes(t, shards, r)) if t.dim() else 1

    params = dict(model.named_parameters())
    count = sum(pieces(t) if name in params else 1 for name, t in tensors.items())
    count += sum(slots * pieces(p) + (1 if adam else 0) for p in trainable)
    # the optimizer's hyperparameters are stored as items too, one per key of its param group
    from dtrain.loop.optim import build_optimizer

    count += len(build_optimizer(model, cfg.optim).param_groups[0])
    return data_bytes + count * DCP_BYTES_PER_ITEM + meta


def ema_lines(cfg: Config, ddp_bytes: int, fsdp_bytes: int) -> list[str]:
    """What `dtrain plan` says of the EMA weights: their bytes per rank (those of the trainable
    parameters, i.e. of the gradients), counted in the optimizer column."""
    if not ema_copies(cfg):
        return []
    return [
        f"  the optimizer column holds the EMA weights (train.ema): ddp {ddp_bytes} bytes, "
        f"fsdp {fsdp_bytes} bytes per rank"
    ]


# ---------------------------------------------------------------------------------------------
# Activations: what autograd saves for the backward, traced on fake tensors


@dataclass
class _Saved:
    """Bytes saved for backward by one forward: outside any block, per block, and the blocks'
    inputs (what activation checkpointing keeps instead of the block's own)."""

    before: int  # outside any block, before the first (the embeddings)
    after: int  # outside any block, after one (the final norm, the head)
    per_block: list[int]
    block_inputs: list[int]

    @property
    def outside(self) -> int:
        return self.before + self.after

    def retained(
        self, checkpointing: bool, stage: tuple[list[int], bool, bool] | None = None
    ) -> int:
        """What the forward keeps for the backward; with `stage` (a pipeline stage rank's block
        indices, and whether it holds the first and the last stage), what that rank keeps."""
        held, first, last = stage or (list(range(len(self.per_block))), True, True)
        outside = self.before * first + self.after * last
        own = [self.per_block[i] for i in held]
        if checkpointing and own:
            # Kept: block inputs; at the peak, one block's activations are recomputed.
            return outside + sum(self.block_inputs[i] for i in held) + max(own)
        return outside + sum(own)


def _trace_saved(
    model: nn.Module,
    blocks: list[nn.Module],
    x: torch.Tensor,
    autocast_dtype: torch.dtype | None,
) -> _Saved:
    """One forward of `x` (fake tensors, under an active FakeTensorMode), adding up the tensors
    autograd saves and which block saved them. Parameters and views of them are not counted."""
    param_ids = {id(p) for p in model.parameters()}
    seen: dict[int, tuple[torch.Tensor, int, int]] = {}  # holds the tensors so that ids stay unique
    current, inputs = [-1], [0] * len(blocks)  # current: the block running; -2 after one ran

    def pack(t: torch.Tensor) -> torch.Tensor:
        base = t._base if t._base is not None else t
        if id(base) not in param_ids and id(base) not in seen:
            local = base.to_local() if isinstance(base, DTensor) else base  # (this rank's part)
            seen[id(base)] = (base, local.numel() * local.element_size(), current[0])
        return t

    def enter(index: int) -> Callable:
        def hook(module: nn.Module, args: tuple) -> None:
            current[0] = index
            inputs[index] += sum(
                a.numel() * a.element_size() for a in args if isinstance(a, torch.Tensor)
            )

        return hook

    def leave(module: nn.Module, args: tuple, output: object) -> None:
        current[0] = -2

    handles = [
        h
        for i, b in enumerate(blocks)
        for h in (b.register_forward_pre_hook(enter(i)), b.register_forward_hook(leave))
    ]
    autocast = torch.autocast(
        "cpu", dtype=autocast_dtype or torch.bfloat16, enabled=autocast_dtype is not None
    )
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), autocast:
            model(x)
    finally:
        for h in handles:
            h.remove()
    per_block = [0] * len(blocks)
    before = after = 0
    for _, size, where in seen.values():
        if where == -1:
            before += size
        elif where == -2:
            after += size
        else:
            per_block[where] += size
    return _Saved(before, after, per_block, inputs)


def traced_activations(
    meta_model: nn.Module,
    cfg: Config,
    example: Callable[[int], Any],
    weights: torch.dtype,
    kinds: dict[str, torch.dtype | None],
    split: bool = False,
) -> dict[str, dict[str, int]]:
    """Saved-for-backward bytes of one micro-batch of `data.batch_size` with `weights` for each
    kind (name -> autocast dtype or None): without ("full") and with ("checkpointed")
    activation checkpointing, and the largest block's own ("block"); one pair of traced
    forwards gives all three. Two forwards (2 and 4 samples) separate what grows with the
    batch from what does not (autocast's copies of the weights); 2, not 1, because BatchNorm
    refuses one sample. With `split`, what one rank of a tp group saves (`_traceable`)."""
    with _traceable(meta_model, cfg, weights, split) as (model, blocks):
        return _retained(model, blocks, cfg, example, weights, kinds)


def stage_activations(
    meta_model: nn.Module,
    cfg: Config,
    example: Callable[[int], Any],
    stage_blocks: list[list[int]],
    micro: int,
) -> list[int]:
    """fp32 saved-for-backward bytes of one micro-batch of `micro` samples on each pipeline
    stage rank, which holds the blocks `stage_blocks[r]` (indices of the model's blocks; the
    first rank the embeddings, the last the head), with activation checkpointing as the config
    says, and under tensor parallelism what one rank of the stage's tp group keeps."""
    checkpointing = cfg.model.activation_checkpointing
    with _traceable(meta_model, cfg, torch.float32, cfg.parallel.tp.size > 1) as (model, blocks):
        two, four = (_trace_saved(model, blocks, example(n), None) for n in (2, 4))
    sizes = []
    last = len(stage_blocks) - 1
    for rank, held in enumerate(stage_blocks):
        stage = (held, rank == 0, rank == last)
        at_two, at_four = (t.retained(checkpointing, stage) for t in (two, four))
        per_sample = (at_four - at_two) / 2
        sizes.append(int(at_two + per_sample * (micro - 2)))
    return sizes


@contextlib.contextmanager
def _traceable(
    meta_model: nn.Module, cfg: Config, weights: torch.dtype, split: bool
) -> Iterator[tuple[nn.Module, list[nn.Module]]]:
    """A copy of `meta_model` in `weights` on fake tensors (shapes and dtypes only, no memory),
    in training mode, and its blocks. With `split`, split first by its tp plan over a pretended
    mesh of parallel.tp.size ranks, for the while: its forward then saves, as DTensors, what the
    first rank of a real tp group saves (sequence parallelism's split norms included); each is
    counted by its local part."""
    model = copy.deepcopy(meta_model).to(weights)
    with contextlib.ExitStack() as stack:
        if split:
            tp = cfg.parallel.tp
            mesh = stack.enter_context(compat.pretended_mesh(tp.size))
            parallelize(model, plan_of(model, tp, cfg.model.name), mesh)
        stack.enter_context(compat.fake_tensor_mode())
        blocks = [b for b in parallel.find_blocks(model, cfg.parallel.fsdp.wrap) if b is not model]
        model.to_empty(device="cpu").train()
        yield model, blocks


def _retained(
    model: nn.Module,
    blocks: list[nn.Module],
    cfg: Config,
    example: Callable[[int], Any],
    weights: torch.dtype,
    kinds: dict[str, torch.dtype | None],
) -> dict[str, dict[str, int]]:
    results: dict[str, dict[str, int]] = {}
    for kind, autocast in kinds.items():
        two, four = (
            _trace_saved(model, blocks, _cast(example(n), weights), autocast) for n in (2, 4)
        )

        def at_batch(bytes_two: float, bytes_four: float) -> int:
            per_sample = (bytes_four - bytes_two) / 2
            return int(bytes_two - 2 * per_sample + per_sample * cfg.data.batch_size)

        results[kind] = {
            "full": at_batch(two.retained(False), four.retained(False)),
            "checkpointed": at_batch(two.retained(True), four.retained(True)),
            "block": at_batch(max(two.per_block, default=0), max(four.per_block, default=0)),
        }
    return results


def activation_bytes(
    meta_model: nn.Module, cfg: Config, example: Callable[[int], Any], low: torch.dtype
) -> dict[str, int]:
    """Saved-for-backward bytes of one micro-batch, for 'fp32', 'autocast' (DDP's mixed
    precision: fp32 weights, `low` compute) and 'cast' (FSDP's: weights and inputs in `low`),
    with activation checkpointing as the config says."""
    checkpointing = cfg.model.activation_checkpointing
    full = traced_activations(
        meta_model, cfg, example, torch.float32, {"fp32": None, "autocast": low}
    )
    cast = traced_activations(meta_model, cfg, example, low, {"cast": None})
    key = "checkpointed" if checkpointing else "full"
    return {kind: by[key] for kind, by in {**full, **cast}.items()}


def activation_bytes_fp32(
    meta_model: nn.Module, cfg: Config, example: Callable[[int], Any]
) -> dict[str, int]:
    """fp32 saved-for-backward bytes of one micro-batch: without ("full") and with
    ("checkpointed") checkpointing, and the largest block's own ("block")."""
    return traced_activations(meta_model, cfg, example, torch.float32, {"fp32": None})["fp32"]


def parallel_buffers(
    cfg: Config,
    world: int,
    shards: int,
    trainable: int,
    root: int,
    largest_block: int,
    itemsize: int,
) -> dict[str, int]:
    """Bytes per rank outside the state that the parallel wrapper holds at its peak. DDP: its
    gradient buckets, a copy of the gradients unless they are views into them. FSDP: gathered
    parameters (the root's, this block's and the prefetched next one's, in the compute
    precision) and unsharded gradients (one block's before its reduce-scatter, all of them
    while accumulating without synchronisation)."""
    ddp = trainable if world > 1 and not cfg.parallel.ddp.gradient_as_bucket_view else 0
    fsdp = 0
    if shards > 1:
        gathered = (root + 2 * largest_block) * itemsize // 4
        fsdp = gathered + (trainable if cfg.train.grad_accum > 1 else largest_block)
    return {"ddp": ddp, "fsdp": fsdp}


def _cast(inputs: Any, dtype: torch.dtype) -> Any:
    """Floating-point inputs in the weights' dtype (token ids stay integers)."""
    if isinstance(inputs, torch.Tensor) and inputs.is_floating_point():
        return inputs.to(dtype)
    return inputs


def communication(
    cfg: Config, world: int, shards: int, trainable: int, root: int, blocks: int
) -> dict[str, int]:
    """Bytes each rank sends per optimizer step with ring collectives: DDP all-reduces the fp32
    gradients once; FSDP all-gathers parameters in the compute precision for every micro-batch's
    forward (and again for its backward when it reshards after forward) and reduce-scatters the
    fp32 gradients once; HSDP adds an all-reduce of the shards across replicas."""
    comm = {"ddp": 0, "fsdp": 0}
    if world == 1:
        return comm
    comm["ddp"] = int(2 * (world - 1) / world * trainable)
    if shards > 1:
        itemsize = 4 if cfg.train.precision == "fp32" else 2
        gathered = root + blocks * (2 if cfg.parallel.fsdp.reshard_after_forward else 1)
        comm["fsdp"] = int(
            (shards - 1) / shards * (cfg.train.grad_accum * gathered * itemsize // 4 + trainable)
        )
    replicas = world // shards
    if replicas > 1:
        comm["fsdp"] += int(2 * (replicas - 1) / replicas * trainable / shards)
    return comm
