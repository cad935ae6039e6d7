"""The model's repeated blocks: what FSDP shards as units, and where activation checkpointing and
torch.compile apply (the same blocks in every mode, so that no parameter is renamed)."""

from __future__ import annotations

import functools

import torch
from torch import nn

from dtrain.core.errors import UserError


def find_blocks(model: nn.Module, wrap: str | list[str] = "auto") -> list[nn.Module]:
    """The model's repeated blocks: modules of the classes `wrap` names (parallel.fsdp.wrap), or
    with "auto" those of the classes a Hugging Face model names as its blocks
    (`_no_split_modules`), else each child with parameters of the model's sequential stages
    (Sequential / ModuleList) that is itself made of layers. Blocks are never nested in each
    other."""
    class_names = wrap if isinstance(wrap, list) else None
    blocks: list[nn.Module] = []
    inside: set[int] = set()

    def mark(module: nn.Module) -> None:
        blocks.append(module)
        inside.update(id(m) for m in module.modules())

    if class_names is None and own_block_classes(model):
        class_names = own_block_classes(model)
    if class_names is not None:
        wanted = set(class_names)
        for module in model.modules():
            if type(module).__name__ in wanted and id(module) not in inside and module is not model:
                mark(module)
        found = {type(b).__name__ for b in blocks}
        missing = wanted - found
        if missing:
            present = sorted({type(m).__name__ for m in model.modules()})
            raise UserError(
                f"config error: parallel.fsdp.wrap: no module of class "
                f"{', '.join(sorted(missing))} in the model; it has {', '.join(present)}"
            )
        return blocks
    for module in model.modules():
        if id(module) in inside or not isinstance(module, (nn.Sequential, nn.ModuleList)):
            continue
        children = list(module.children())
        composite = [
            c
            for c in children
            if any(True for _ in c.children()) and any(True for _ in c.parameters())
        ]
        if len(composite) >= 2:
            for child in composite:
                mark(child)
    return blocks


def own_block_classes(model: nn.Module) -> list[str]:
    """The block classes a Hugging Face model declares (`_no_split_modules`) that it has."""
    declared = set(getattr(model, "_no_split_modules", None) or ())
    return sorted(declared & {type(m).__name__ for m in model.modules()})


def describe_blocks(blocks: list[nn.Module], model: nn.Module) -> str:
    """For the banner: what FSDP shards as units."""
    counts: dict[str, int] = {}
    for block in blocks:
        if block is not model:
            counts[type(block).__name__] = counts.get(type(block).__name__, 0) + 1
    units = ", ".join(f"{n} {name}" for name, n in counts.items()) or "none"
    why = " (the model's _no_split_modules)" if own_block_classes(model) else ""
    return f"FSDP units: {units}{why}, then the root"


def checkpoint_activations(block: nn.Module) -> None:
    """Recompute the block's activations in backward instead of storing them. The block keeps its
    parameter names: its forward is replaced on the instance, not wrapped in a new module."""
    forward = block.forward

    @functools.wraps(forward)
    def checkpointed(*args, **kwargs):
        return torch.utils.checkpoint.checkpoint(forward, *args, use_reentrant=False, **kwargs)

    block.forward = checkpointed
