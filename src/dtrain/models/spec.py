"""What kind of model a run trains, decided once from the model section (and the training
section's `train.qat`).

A run trains the whole model, or low-rank adapters on a frozen base (`model.lora`, models/lora.py);
in float, or through fake quantization from a step on (quantization-aware training,
models/quantize.py). Everything that differs is answered here, so that no flag travels through
the layers: what trains, what a checkpoint holds and whether loading it back must find every
weight, the base a checkpoint depends on, what an export merges, what fake-quantizes from which
step and the int8 model it converts to, and the banner's line. The training run, `dtrain eval`,
`export` and `plan` each make one spec (`spec_of`) and ask it.
"""

from __future__ import annotations

import dataclasses

from torch import nn

from dtrain.config import LoraConfig, ModelConfig, QatConfig
from dtrain.core.errors import UserError
from dtrain.models import lora, quantize


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    section: ModelConfig
    # Low-rank adapters train on a frozen base: a checkpoint holds only what trains (the base is
    # read again from where it came from, checked by its digest).
    adapters: bool
    # Quantization-aware training (train.qat, its scheme set): the Linear layers fake-quantize
    # from its start step on. A checkpoint keeps the plain model's keys and shapes (fake
    # quantization holds no state), so it loads wherever a plain one does. None: float.
    qat: QatConfig | None = None

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

    def fake_quantize(self, model: nn.Module) -> None:
        """Prepare `model` (the user's module, before it is wrapped or sharded: a strategy's
        `prepare`) for quantization-aware training, its fake quantization off until
        `fake_quantizes_at` says it is on. Its parameters keep their names and ties."""
        if self.qat is not None and self.qat.scheme is not None:
            quantize.prepare_qat(model, self.qat.scheme)
            quantize.fake_quantization(model, on=False)

    def fake_quantizes_at(self, step: int) -> bool:
        """Whether the optimizer step after `step` steps (and an evaluation after `step` steps)
        computes fake-quantized: once train.qat.start_step steps have trained in float."""
        return self.qat is not None and step >= self.qat.start_step

    def switch_fake_quantization(self, model: nn.Module, step: int) -> bool:
        """Fake quantization of a prepared `model` on or off, as it is at `step`; whether on."""
        on = self.fake_quantizes_at(step)
        if self.qat is not None:
            quantize.fake_quantization(model, on)
        return on

    def quantized(self, model: nn.Module) -> nn.Module:
        """The int8 model that a quantization-aware run converts to: `model` holds its
        weights (a plain model rebuilt from its checkpoint; not changed)."""
        if self.qat is None or self.qat.scheme is None:
            raise ValueError("quantized: the model trained without fake quantization")
        return quantize.quantized_after_qat(model, self.qat.scheme)

    def describe(self, model: nn.Module) -> str | None:
        """For the banner: the adapters and how much of the model trains, or what
        fake-quantizes from which step (None: the whole model, in float)."""
        if self.adapters:
            return lora.describe(self.section, model)
        if self.qat is None or self.qat.scheme is None:
            return None
        layers = len(quantize.fake_quantized_layers(model))
        start = self.qat.start_step
        when = f"after {start} step(s) in float" if start else "from the first step"
        return (
            f"quantization-aware training for {self.qat.scheme}: {layers} Linear layer(s) "
            f"fake-quantized {when}; checkpoints keep the plain model's weights"
        )


def spec_of(section: ModelConfig, qat: QatConfig | None = None) -> ModelSpec:
    """The one place that reads whether `model.lora` is on; `qat`: the training section's
    `train.qat` (a run that trains quantization-aware; none for a model only read back)."""
    adapters = section.lora.r is not None
    trains_qat = qat is not None and qat.scheme is not None
    if adapters and trains_qat:
        raise UserError(
            "config error: train.qat with model.lora: fake quantization would swap the "
            "adapted layers under the adapters; train the adapters in float and quantize the "
            "merged model by dtrain export, or drop model.lora"
        )
    return ModelSpec(section, adapters=adapters, qat=qat if trains_qat else None)
