"""Tensor parallelism: each block's weights split over the `parallel.tp.size` ranks of a group,
composed with data parallelism (DDP or FSDP) over the groups, on one device mesh
(dp_replicate, dp_shard, tp), tp innermost.

A model is split by a plan: the built-in GPT's own (`GPT_STYLES`), a Hugging Face model's
`base_model_tp_plan` (`hf_styles`), or a user's function `(model, mesh)` by import path. What a
plan leaves whole is replicated over the group as DTensors (`Replicated`), so that every
parameter lives on the same mesh: the gradient norm, the optimizer's foreach kernels and DCP see
one kind of tensor. The parameters keep their names and full shapes: a checkpoint of any layout
loads into any other (DCP reshards).
"""

from __future__ import annotations

import contextlib
import dataclasses
import fnmatch
import functools
import logging
import warnings
from collections.abc import Callable
from typing import Any, cast

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from dtrain.config import ModelConfig, ParallelConfig, TensorParallelConfig
from dtrain.core.errors import UserError
from dtrain.core.imports import load_callable
from dtrain.parallel.loss import SplitLogits
from dtrain.parallel.precision import Precision
from dtrain.parallel.strategies import FSDP, NOTHING, Prepare, Strategy
from dtrain.parallel.styles import FusedColwise, Replicated
from dtrain.process.env import Env
from dtrain.process.layout import Mesh

Plan = Callable[[nn.Module, Any], None]  # (model, the tp mesh): parallelizes in place
MESH_DIMS = ("dp_replicate", "dp_shard", "tp")


class TensorParallel(FSDP):
    """parallel.tp.size > 1: the model built whole on every rank, split over its tp group by
    its plan, then (with more than one group) wrapped by FSDP2 over the data dimensions: mode
    ddp replicates it over them (a shard dimension of 1), mode fsdp shards it (HSDP with
    parallel.fsdp.hybrid_replicas). Checkpoints are DCP's, reshardable onto any layout."""

    @classmethod
    def mesh(cls, cfg: ParallelConfig, env: Env) -> Mesh:
        tp, world = cfg.tp.size, env.world_size
        if cfg.mode == "none":
            raise UserError(
                "config error: parallel.tp.size: tensor parallelism needs parallel.mode ddp or "
                "fsdp for the data dimensions (mode none trains one unrelated model per rank)"
            )
        if world % tp:
            raise UserError(
                f"config error: parallel.tp.size: {tp} does not divide the world size {world}; "
                f"launch a multiple of {tp} ranks"
            )
        data = world // tp
        replicas = data if cfg.mode == "ddp" else cfg.fsdp.hybrid_replicas
        if data % replicas:
            raise UserError(
                f"config error: parallel.fsdp.hybrid_replicas: {replicas} does not divide the "
                f"{data} data ranks ({world} ranks / tp {tp})"
            )
        shards = data // replicas
        return Mesh(
            cfg.mode,
            sharded=data > 1,  # wrapped by FSDP2 (its mixed-precision policy, not autocast)
            replicas=replicas,
            shards=shards,
            shard_index=(env.rank // tp) % shards,
            checkpoint_format="sharded",
            tp=tp,
        )

    @classmethod
    def for_world_size(cls, cfg: ParallelConfig, world_size: int) -> ParallelConfig:
        """At a world size the split does not fit (an evaluation on fewer ranks): none."""
        tp = cfg.tp.size
        if world_size % tp == 0:
            data = world_size // tp
            if cfg.mode == "ddp" or data % cfg.fsdp.hybrid_replicas == 0:
                return cfg
        fsdp = dataclasses.replace(cfg.fsdp, hybrid_replicas=1)
        return dataclasses.replace(cfg, tp=dataclasses.replace(cfg.tp, size=1), fsdp=fsdp)

    def build(
        self,
        model_cfg: ModelConfig,
        info: dict[str, Any],
        seed: int,
        precision: Precision,
        prepare: Prepare | None = None,
    ) -> tuple[nn.Module, int, list[str]]:
        """Built whole on every rank from the seed (the same weights everywhere), then split."""
        model, count, notes = Strategy.build(self, model_cfg, info, seed, precision, prepare)
        layout = self.layout
        rank, tp, shards = layout.env.rank, layout.tp, layout.shards
        place = (rank // tp // shards, rank // tp % shards, rank % tp)
        notes.append(
            f"mesh dp_replicate {layout.replicas} x dp_shard {layout.shards} x tp {layout.tp}; "
            f"rank {rank} at {place}; the model built whole on every rank, then split"
        )
        return model, count, notes

    def wrap(
        self,
        model: nn.Module,
        model_cfg: ModelConfig,
        precision: Precision,
        on_meta: bool = False,
        notes: list[str] | None = None,
    ) -> nn.Module:
        _quiet_torch_notices()
        model.to(self.layout.device)
        check_divides(model, self.layout.tp, model_cfg.name)
        parallelize(model, plan_of(model, self.cfg.tp, model_cfg.name), self._mesh()["tp"])
        return super().wrap(model, model_cfg, precision, on_meta, notes)

    def _mesh(self) -> Any:
        """The run's device mesh, made once (FSDP's dimensions and tp's are views of it)."""
        from torch.distributed.device_mesh import init_device_mesh

        layout = self.layout
        if getattr(self, "_made", None) is None:
            shape = (layout.replicas, layout.shards, layout.tp)
            self._made = init_device_mesh(layout.device.type, shape, mesh_dim_names=MESH_DIMS)
        return self._made

    def _device_mesh(self) -> Any:
        return self._mesh()["dp_replicate", "dp_shard"]

    def _distribute(
        self,
        model: nn.Module,
        blocks: list[nn.Module],
        precision: Precision,
        notes: list[str] | None,
    ) -> nn.Module:
        if self.layout.data_ranks == 1:  # one tp group: nothing to replicate or shard over
            return model
        return super()._distribute(model, blocks, precision, notes)

    @staticmethod
    def gradient_sync(model: nn.Module, sync: bool) -> contextlib.AbstractContextManager:
        from torch.distributed.fsdp import FSDPModule

        if isinstance(model, FSDPModule):
            model.set_requires_gradient_sync(sync)
        return NOTHING


def _quiet_torch_notices() -> None:
    """Two of torch's notices that say nothing of a tensor-parallel run: the gradient norm's
    reduction over two mesh dimensions in turn (every rank of a dimension gets the same sum, so
    the ranks agree), and FSDP's warning that the root returns a view (the all-gathered logits;
    the tasks compute their losses out of place)."""
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")


# -- plans -------------------------------------------------------------------------------------
class Styles:
    """A plan as module-name patterns (`*` for any one name) of a part of the model (`under`:
    the model itself, or a Hugging Face model's base model) and how each is split."""

    def __init__(self, styles: dict[str, Callable[[], ParallelStyle]], under: str = "") -> None:
        self.styles, self.under = styles, under

    def __call__(self, model: nn.Module, mesh: Any) -> None:
        part = model.get_submodule(self.under) if self.under else model
        parallelize_module(part, mesh, {name: style() for name, style in self.styles.items()})

    def splits(self, name: str) -> bool:
        """Whether the parameter `name` of the whole model is split (not replicated)."""
        module = name.rpartition(".")[0]
        prefix = f"{self.under}." if self.under else ""
        return any(
            fnmatch.fnmatchcase(module, prefix + p)
            for p, style in self.styles.items()
            if style not in (SequenceParallel, SequenceEntry)  # these leave weights whole
        )


# The built-in GPT (Megatron's split): attention by heads (the fused qkv regrouped), the MLP's
# first Linear by columns and its second by rows, the vocabulary of the tied embedding and
# output head by rows; norms and positions replicated.
GPT_STYLES: dict[str, Callable[[], ParallelStyle]] = {
    "tok_emb": functools.partial(RowwiseParallel, input_layouts=Replicate()),
    "head": functools.partial(ColwiseParallel, output_layouts=Replicate()),
    "blocks.*.attn.qkv": functools.partial(FusedColwise, 3),
    "blocks.*.attn.proj": RowwiseParallel,
    "blocks.*.mlp.0": ColwiseParallel,
    "blocks.*.mlp.2": RowwiseParallel,
}


def _shard_sequence(mesh: Any, _module: nn.Module, _inputs: tuple, out: torch.Tensor) -> Any:
    """The embeddings' sum (whole on every rank) cut to this rank's part of the sequence: a
    slice forward, an all-gather of the gradients backward (DTensor's redistribution)."""
    size = mesh.size()
    if out.shape[1] % size:
        raise UserError(
            f"config error: parallel.tp.sequence_parallel: a window of {out.shape[1]} tokens "
            f"does not split over tp {size}; choose a data seq_len that {size} divides"
        )
    whole = DTensor.from_local(out, mesh, [Replicate()], run_check=False)
    return whole.redistribute(mesh, [Shard(1)]).to_local()


class SequenceEntry(ParallelStyle):
    """Where the sequence-split residual stream begins (the dropout after the embeddings)."""

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        module.register_forward_hook(functools.partial(_shard_sequence, device_mesh))
        return module


# With parallel.tp.sequence_parallel (Megatron's sequence parallelism): between the splits of
# each block the activations are cut by sequence, not repeated on every rank. The norms work on
# their part of the sequence (their weights replicated, their gradients summed over the group);
# a split's input is all-gathered by sequence and a row split's output reduce-scattered to it.
_SEQUENCE = Shard(1)
GPT_SEQUENCE_STYLES: dict[str, Callable[[], ParallelStyle]] = {
    **GPT_STYLES,
    "drop": SequenceEntry,
    "blocks.*.norm1": SequenceParallel,
    "blocks.*.norm2": SequenceParallel,
    "norm": SequenceParallel,
    "blocks.*.attn.qkv": functools.partial(FusedColwise, 3, input_layouts=_SEQUENCE),
    "blocks.*.attn.proj": functools.partial(RowwiseParallel, output_layouts=_SEQUENCE),
    "blocks.*.mlp.0": functools.partial(ColwiseParallel, input_layouts=_SEQUENCE),
    "blocks.*.mlp.2": functools.partial(RowwiseParallel, output_layouts=_SEQUENCE),
    "head": functools.partial(ColwiseParallel, input_layouts=_SEQUENCE, output_layouts=Replicate()),
}


def gpt_styles(cfg: TensorParallelConfig) -> dict[str, Callable[[], ParallelStyle]]:
    """The built-in GPT's plan with the options of parallel.tp: split by sequence, and the
    head's logits left split by vocabulary for the loss."""
    styles = dict(GPT_SEQUENCE_STYLES if cfg.sequence_parallel else GPT_STYLES)
    if cfg.loss_parallel:
        entry = {"input_layouts": _SEQUENCE} if cfg.sequence_parallel else {}
        styles["head"] = functools.partial(SplitLogits, **entry)
    return styles


# The styles of a Hugging Face model's `base_model_tp_plan` that dtrain applies.
HF_STYLES: dict[str, Callable[[], ParallelStyle]] = {
    "colwise": ColwiseParallel,
    "rowwise": RowwiseParallel,
    "colwise_rep": functools.partial(ColwiseParallel, output_layouts=Replicate()),
    "rowwise_rep": functools.partial(RowwiseParallel, input_layouts=Replicate()),
}


def hf_styles(model: nn.Module, loss_parallel: bool = False) -> Styles:
    """A Hugging Face model's own plan (`base_model_tp_plan` of its config: module name
    patterns of its base model and how each is split); with `loss_parallel`, its output head
    split by vocabulary besides (as the model's own `_tp_plan` splits it), its logits left split
    for the loss, and a tied input embedding split by the same rows, so that the two stay one
    weight."""
    wanted = getattr(model.config, "base_model_tp_plan", None) or {}
    unknown = sorted({style for style in wanted.values() if style not in HF_STYLES})
    if unknown:
        raise UserError(
            f"config error: parallel.tp.plan: the model's base_model_tp_plan uses "
            f"{', '.join(unknown)}, which dtrain does not apply; give a plan function "
            f"(parallel.tp.plan=module:function)"
        )
    prefix = getattr(model, "base_model_prefix", "")
    under = prefix if prefix and hasattr(model, prefix) else ""
    styles = {name: HF_STYLES[style] for name, style in wanted.items()}
    if not loss_parallel:
        return Styles(styles, under)
    names = {id(m): n for n, m in model.named_modules()}
    head, embedding = model.get_output_embeddings(), model.get_input_embeddings()  # type: ignore[operator]
    whole = {f"{under}.{n}" if under else n: style for n, style in styles.items()}
    whole[names[id(head)]] = SplitLogits
    if head.weight is embedding.weight:
        whole[names[id(embedding)]] = functools.partial(RowwiseParallel, input_layouts=Replicate())
    return Styles(whole)


def plan_of(model: nn.Module, cfg: TensorParallelConfig, model_name: str) -> Plan:
    """The plan that splits `model` (model.name `model_name`) as parallel.tp.plan says; a model
    with none is refused in one line."""
    from dtrain.models import GPT  # (models import nothing of parallel)

    config = getattr(model, "config", None)
    own = cfg.plan == "auto"
    gpt, hf = (
        own and isinstance(model, GPT),
        own and bool(getattr(config, "base_model_tp_plan", None)),
    )
    if cfg.sequence_parallel and not gpt:
        raise UserError(
            f"config error: parallel.tp.sequence_parallel: dtrain splits the built-in gpt by "
            f"sequence, not model {model_name} with its plan; drop the option, or apply it in a "
            f"plan function of your own (parallel.tp.plan=module:function)"
        )
    if cfg.loss_parallel and not (gpt or hf):
        raise UserError(
            f"config error: parallel.tp.loss_parallel: dtrain splits the logits of the built-in "
            f"gpt and of a Hugging Face model by its own plan, not model {model_name} with a "
            f"plan function; drop the option, or leave the logits split in your plan"
        )
    vocab = int(getattr(config, "vocab_size", 0))
    if hf and cfg.loss_parallel and vocab % cfg.size:
        raise UserError(
            f"config error: parallel.tp.loss_parallel: {cfg.size} does not divide model "
            f"{model_name}'s vocab_size ({vocab}); choose a size that divides it or drop the "
            f"option"
        )
    if cfg.plan != "auto":
        return load_callable(cfg.plan, "parallel.tp.plan")
    if gpt:
        return Styles(gpt_styles(cfg))
    if hf:
        return hf_styles(model, cfg.loss_parallel)
    raise UserError(
        f"config error: parallel.tp.size: model {model_name} has no tensor-parallel plan (the "
        f"built-in gpt has one, a Hugging Face model its config's base_model_tp_plan); give "
        f"one (parallel.tp.plan=module:function) or set parallel.tp.size=1"
    )


def split_names(model: nn.Module, cfg: TensorParallelConfig, model_name: str) -> set[str] | None:
    """For `dtrain plan` (the model on the meta device): the parameters the plan splits over
    the tp group, after checking that it exists and that the split divides the model. None for
    a user's plan function, which only a run can apply."""
    check_divides(model, cfg.size, model_name)
    plan = plan_of(model, cfg, model_name)
    if not isinstance(plan, Styles):
        return None
    return {name for name, _ in model.named_parameters() if plan.splits(name)}


def check_divides(model: nn.Module, tp: int, model_name: str) -> None:
    """The sizes a split must divide, from the model (built on the meta device in `dtrain
    plan`): the heads, the hidden size and the MLP's width, and for GPT the vocabulary."""
    from dtrain.models import GPT

    sizes: dict[str, int] = {}
    if isinstance(model, GPT):
        dim = model.tok_emb.embedding_dim
        sizes = {"vocab_size": model.tok_emb.num_embeddings, "dim": dim}
        for block in model.blocks[:1]:
            sizes["heads"] = dim // cast(Any, block).attn.head_dim
    else:
        config = getattr(model, "config", None)
        keys = ("num_attention_heads", "num_key_value_heads", "hidden_size", "intermediate_size")
        for key in keys:
            value = getattr(config, key, None)
            if isinstance(value, int):
                sizes[key] = value
    for key, value in sizes.items():
        if value % tp:
            raise UserError(
                f"config error: parallel.tp.size: {tp} does not divide model {model_name}'s "
                f"{key} ({value}); choose a size that divides it"
            )


def parallelize(model: nn.Module, plan: Plan, mesh: Any) -> None:
    """Split `model` over the tp `mesh` by `plan`, then replicate over it every parameter the
    plan left whole; tied parameters (an embedding and its output head) stay tied."""
    ties = _ties(model)
    plan(model, mesh)
    for name, module in list(model.named_modules()):
        own = [p for p in module.parameters(recurse=False) if not isinstance(p, DTensor)]
        if not own:
            continue
        if any(True for _ in module.children()):
            raise UserError(
                f"config error: parallel.tp.plan: module '{name}' holds parameters of its own "
                f"beside its children, which the plan left whole; the plan must split or "
                f"replicate it"
            )
        Replicated()._apply(module, mesh)
    for owner, attr, source in ties:
        setattr(owner, attr, _get(model, source))


def _ties(model: nn.Module) -> list[tuple[nn.Module, str, str]]:
    """Each parameter reached under a second name: (its module, attribute, the first name)."""
    first: dict[int, str] = {}
    ties = []
    for module_name, module in model.named_modules(remove_duplicate=False):
        for attr, param in module.named_parameters(recurse=False):
            name = f"{module_name}.{attr}" if module_name else attr
            if id(param) in first and first[id(param)] != name:
                ties.append((module, attr, first[id(param)]))
            first.setdefault(id(param), name)
    return ties


def _get(model: nn.Module, name: str) -> nn.Parameter:
    module_name, _, attr = name.rpartition(".")
    return getattr(model.get_submodule(module_name) if module_name else model, attr)
