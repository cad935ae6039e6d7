"""The parts of a run that a checkpoint holds beside the model and the optimizer, as the
`Checkpointer` sees them: objects with a state, saved and loaded by name. It knows nothing else
of them (what trains them, when they change); the run that owns them hands them over.

- `Stateful`: a small state (numbers, strings, a few tensors) kept in the checkpoint's metadata.
  The part named `POSITION` says where the run is (its state has "step" and "epoch"); it is
  saved as "train_state", every other one under "extra" by its name.
- `ShardedStateful`: tensors kept beside the model's weights and sharded alike (the averaged
  weights): DCP entries `<name>.<key>` of a sharded checkpoint, whole tensors under `<name>` in
  a full one. They load in two steps, so that nothing is applied unless the whole checkpoint
  was read.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from dtrain.checkpoint.state import POSITION, dcp_model_shapes
from dtrain.models.spec import ModelSpec


class Stateful(Protocol):
    """A piece of a run that a checkpoint saves and restores by name."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


@dataclass(frozen=True)
class SavedPart:
    """A sharded part as the checkpoint being loaded holds it: its `name`, the checkpoint's
    `folder` and `format`, in a full one the whole tensors it holds (`whole`, on rank 0 only:
    the others receive their part from it), and the `device` the ranks exchange tensors on."""

    name: str
    folder: str
    format: str
    whole: dict[str, torch.Tensor] | None
    device: torch.device

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """The names and full shapes of the part's tensors in the checkpoint (empty: none),
        read on rank 0."""
        if self.format == "sharded":
            return dcp_model_shapes(self.folder, f"{self.name}.")
        return {k: tuple(v.shape) for k, v in (self.whole or {}).items()}


class ShardedStateful(Protocol):
    """Tensors a checkpoint holds beside the model's weights, sharded alike.

    `state_dict(full)`: whole tensors in CPU memory on rank 0 (nothing on the others) for a
    full checkpoint, each rank's own tensors (DTensors under FSDP) for a sharded one.
    `staging(saved)`: the saved tensors, placed as this rank holds them but not applied: empty
    ones of a sharded checkpoint, which the read of the model's shards fills; a full one's,
    sent by rank 0. None when the checkpoint holds none that fit: the part starts anew.
    `load_state_dict(staged)`: takes them, once the model and the optimizer were applied."""

    def state_dict(self, full: bool) -> dict[str, torch.Tensor]: ...

    def staging(self, saved: SavedPart) -> dict[str, torch.Tensor] | None: ...

    def load_state_dict(self, staged: dict[str, torch.Tensor]) -> None: ...


@dataclass(frozen=True)
class Contents:
    """What a checkpoint of a run holds: the (wrapped) `model` as its `spec` says (for LoRA,
    not the frozen base's weights, nor are they read back) and its `optimizer`; the `parts`
    kept in the metadata by name (one named `POSITION`) and the `sharded` ones kept beside the
    weights; the whole resolved `config` as data and `model_info`, what rebuilding the model
    needs (for LoRA, the base and its digest), both compared with a resumed checkpoint's.
    `seed`, the run's, re-seeds the random states where the world size changed."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    spec: ModelSpec
    parts: Mapping[str, Stateful]
    sharded: Mapping[str, ShardedStateful]
    config: dict[str, Any]
    model_info: dict[str, Any]
    seed: int

    def __post_init__(self) -> None:
        assert POSITION in self.parts, f"a run's parts say where it is ('{POSITION}')"
