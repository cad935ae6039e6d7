"""The tensors of a LoRA run's merged model, read tensor by tensor: `dtrain export --format hf`
of a sharded checkpoint of a LoRA fine-tune on an `hf:` base writes them file by file
(hf_folder.py) without the model whole in memory.

The checkpoint holds only what trained (the adapters, a `modules_to_save` copy, buffers); the
base's own weights are read from its folder, after its digest is checked against the one the
run recorded (a changed base is one line, exit 2). Each tensor of the merged model is then:
the checkpoint's, for what trained in full; the base file's, plus its layer's adapter product
as peft computes it (`get_delta_weight`: B @ A scaled by alpha / r, transposed for GPT-2's
Conv1D), for an adapted layer's weight; the base file's as it is for everything else. Floating
tensors come out in float32, as the whole-model export writes them. The adapters are made on
the meta device with the rest of the model and given their values alone, so the memory held is
the adapters' and the file being written.

A run whose base is not the folder's files as they are (weights from model.init_from, a tensor
missing from the files under the model's name and shape) or with a LoRA layer whose weight is
tied to another tensor goes through the whole model instead (`merged` is None).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from dtrain import config, models
from dtrain.checkpoint.load import trained_shapes
from dtrain.checkpoint.state import read_sharded_in_parts, shape_mismatch
from dtrain.core.errors import UserError
from dtrain.models import hf
from dtrain.models.spec import ModelSpec, spec_of
from dtrain.run.weights import prepare_base

ADAPTER = "default"  # peft's name for the one adapter model.lora makes


class Merged:
    """The merged model's tensors, by base-model name."""

    def __init__(
        self, layers: dict[str, Any], trained: dict[str, torch.Tensor], files: hf.WeightFiles
    ) -> None:
        self.layers = layers  # peft's adapted layers, by the name of the weight they adapt
        self.trained = trained  # what trained in full, from the checkpoint
        self.files = files  # the base's

    def tensors(self, names: Iterable[list[str]]) -> Iterator[dict[str, torch.Tensor]]:
        """For each list of names in turn, those tensors of the merged model."""
        for part in names:
            yield {name: self.tensor(name) for name in part}

    def tensor(self, name: str) -> torch.Tensor:
        tensor = self.trained.get(name)
        if tensor is not None:
            return tensor.float() if tensor.is_floating_point() else tensor
        tensor = self.files.whole(name)
        tensor = tensor.float() if tensor.is_floating_point() else tensor
        layer = self.layers.get(name)
        if layer is not None:
            with torch.no_grad():
                tensor = tensor + layer.get_delta_weight(ADAPTER).float()
        return tensor


def merged(
    folder: str, meta: dict, where: str, base: nn.Module, written: list[str]
) -> Merged | None:
    """The merged tensors of the LoRA checkpoint in the DCP folder `folder` (named `where` in
    messages), whose base is `base` (on the meta device) and whose export holds the tensors
    `written`; None where they cannot be read tensor by tensor (the module's docstring)."""
    cfg = config.from_dict(meta["config"])
    if not cfg.model.name.startswith("hf:") or cfg.model.init_from:
        return None
    adapted: Any = models.build(cfg.model, meta["model_info"], cfg.run.seed, models.Weights.NONE)
    spec = spec_of(cfg.model)
    held = trained_shapes(adapted, spec)
    trained = set(spec.base_names(list(held)).values())
    source = hf.resolve(cfg.model.name)
    files = hf.WeightFiles(cfg.model.name, source)
    named = base.state_dict(keep_vars=True)
    if any(n not in trained and files.shape(n) != tuple(named[n].shape) for n in written):
        return None
    layers = _layers(adapted, spec)
    uses = Counter(id(tensor) for tensor in named.values())
    if any(n not in named or uses[id(named[n])] > 1 for n in layers):
        return None  # merging a tied weight would change its twin too

    prepare_base(adapted, cfg, meta["model_info"], where)  # the base's digest, checked
    like = adapted.state_dict()
    state = {"model": {k: torch.empty(held[k], dtype=like[k].dtype) for k in held}}
    saved = next(read_sharded_in_parts(folder, [state]))["model"]
    problem = shape_mismatch(held, {k: tuple(v.shape) for k, v in saved.items()})
    if problem:
        raise UserError(f"checkpoint error: {where}: {problem}")
    in_base = spec.base_names(list(saved))  # what trained in full; the rest are the adapters
    adapters = {k: v for k, v in saved.items() if k not in in_base}
    adapted.load_state_dict(adapters, strict=False, assign=True)
    in_full = {in_base[k]: v for k, v in saved.items() if k in in_base}
    return Merged(layers, in_full, files)


def _layers(adapted: nn.Module, spec: ModelSpec) -> dict[str, Any]:
    """peft's adapted layers, by the base-model name of the weight they adapt."""
    from peft.tuners.lora import LoraLayer

    found = {}
    for name, module in adapted.named_modules():
        weight = f"{name}.base_layer.weight"
        key = spec.base_names([weight]).get(weight)
        if isinstance(module, LoraLayer) and key is not None:
            found[key] = module
    return found
