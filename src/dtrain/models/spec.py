"""What kind of model a run trains, decided once from the model section.

A run trains the whole model, or low-rank adapters on a frozen base (`model.lora`, models/lora.py).
Everything that differs between the two is answered here, so that no flag travels through the
layers: what trains, what a checkpoint holds and whether loading it back must find every weight,
the base a checkpoint depends on, what an export merges, and the banner's line. The training
run, `dtrain eval`, `export` and `plan` each make one spec (`spec_of`) and ask it.
"""

from __future__ import annotations

import dataclasses

from torch import nn

from dtrain.config import LoraConfig, ModelConfig
from dtrain.models import lora


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    section: ModelConfig
    # Low-rank adapters train on a frozen base: a checkpoint holds only what trains (the base is
    # read again from where it came from, checked by its digest).
    adapters: bool

    @property
    def holds_everything(self) -> bool:
        """A checkpoint holds every weight (loading one back must find them all)."""
        return not self.adapters

    @property
    def base(self) -> ModelConfig:
        """The same model section without adapters: the model a LoRA run adapts (built to merge
        into for an export, or to size a full fine-tune against)."""
        return dataclasses.replace(self.section, lora=LoraConfig())

    def adapt(self, model: nn.Module, num_classes: int | None) -> nn.Module:
        """`model` as the run trains it: with its adapters (and all else frozen), or itself."""
        return lora.apply(model, self.section, num_classes) if self.adapters else model

    def left_out(self, model: nn.Module) -> set[str]:
        """The names of `model`'s state that a checkpoint leaves out (the frozen base's)."""
        if not self.adapters:
            return set()
        return {n for n, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad}

    def base_names(self, names: list[str]) -> dict[str, str]:
        """Each tensor name of the trained model and its name in the base model (the same,
        unless adapters wrap the model; the adapters' own tensors have none)."""
        if not self.adapters:
            return {k: k for k in names}
        return {k: base for k in names if (base := lora.base_name(k)) is not None}

    def describe(self, model: nn.Module) -> str | None:
        """For the banner: the adapters and how much of the model trains (None: all of it)."""
        return lora.describe(self.section, model) if self.adapters else None


def spec_of(section: ModelConfig) -> ModelSpec:
    """The one place that reads whether `model.lora` is on."""
    return ModelSpec(section, adapters=section.lora.r is not None)
