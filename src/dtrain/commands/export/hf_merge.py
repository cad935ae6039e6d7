"""The tensors of a LoRA run's merged model, read tensor by tensor: `dtrain export --format hf`
of a sharded checkpoint of a LoRA fine-tune on an `hf:` base writes them file by file
(hf_stream.py) without the model whole in memory.

The checkpoint holds only what trained (the adapters, a `modules_to_save` copy, buffers); the
base's own weights are read from its folder, after its digest is checked against the one the
run recorded (a changed base is one line, exit 2). Each tensor of the merged model is then:
the checkpoint's, for what trained in full; the base file's, plus its layer's adapter product
as peft computes it (`get_delta_weight`: B @ A scaled by alpha / r, transposed for GPT-2's
Conv1D), for an adapted layer's weight; the base file's as it is for everything else. Floating
tensors come out in float32, as the whole-model export writes them. The adapters are made on
the meta device with the rest of the model and given their values alone, so the memory held is
the adapters' and the file being written.

A base whose folder does not hold every tensor under the model's name and shape, or a LoRA
layer whose weight is tied to another tensor, goes through the whole model instead (`fits`).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from dtrain import config, models
from dtrain.checkpoint.load import trained_shapes
from dtrain.checkpoint.state import read_sharded_in_parts, shape_mismatch
from dtrain.core.errors import UserError
from dtrain.models import hf, lora
from dtrain.run.weights import prepare_base

ADAPTER = "default"  # peft's name for the one adapter model.lora makes


def base_model(meta: dict) -> nn.Module:
    """The LoRA run's base model on the meta device: names, shapes and config, no weights."""
    cfg = config.from_dict(meta["config"])
    with torch.device("meta"):
        return models.build(lora.without(cfg).model, meta["model_info"], cfg.run.seed)


def adapted_model(meta: dict) -> Any:
    """The run's model with its adapters (peft's), on the meta device."""
    cfg = config.from_dict(meta["config"])
    with torch.device("meta"):
        return models.build(cfg.model, meta["model_info"], cfg.run.seed)


def fits(meta: dict) -> bool:
    """Whether the run's merged model can be read tensor by tensor: an `hf:PATH` base whose
    every tensor is in the checkpoint (it trained) or in the base's files under its name and
    shape, and no adapted weight tied to another name (merging it would change both)."""
    cfg = config.from_dict(meta["config"])
    if not (lora.enabled(cfg.model) and cfg.model.name.startswith("hf:")):
        return False
    if cfg.model.init_from:  # the base's weights are another file's, not the folder's
        return False
    base, adapted = base_model(meta), adapted_model(meta)
    trained = {lora.base_name(k) for k in trained_shapes(adapted, adapters_only=True)}
    files = _files(cfg)
    named = base.state_dict(keep_vars=True)
    if any(n not in trained and files.shape(n) != tuple(t.shape) for n, t in named.items()):
        return False
    uses: dict[int, int] = {}
    for tensor in named.values():
        uses[id(tensor)] = uses.get(id(tensor), 0) + 1
    return all(n in named and uses[id(named[n])] == 1 for n in _layers(adapted))


class Merged:
    """The merged tensors of the LoRA checkpoint in the DCP folder `folder` (named `where` in
    messages), by base-model name."""

    def __init__(self, folder: str, meta: dict, where: str) -> None:
        cfg = config.from_dict(meta["config"])
        adapted = adapted_model(meta)
        prepare_base(adapted, cfg, meta["model_info"], where)  # the base's digest, checked
        held = trained_shapes(adapted, adapters_only=True)
        like = adapted.state_dict()
        state = {"model": {k: torch.empty(held[k], dtype=like[k].dtype) for k in held}}
        saved = next(read_sharded_in_parts(folder, [state]))["model"]
        problem = shape_mismatch(held, {k: tuple(v.shape) for k, v in saved.items()})
        if problem:
            raise UserError(f"checkpoint error: {where}: {problem}")
        adapters = {k: v for k, v in saved.items() if lora.base_name(k) is None}
        adapted.load_state_dict(adapters, strict=False, assign=True)
        self.layers = _layers(adapted)
        self.trained = {lora.base_name(k): v for k, v in saved.items() if k not in adapters}
        self.files = _files(cfg)

    def tensors(self, names: Iterable[list[str]]) -> Iterator[dict[str, torch.Tensor]]:
        """For each list of names in turn, those tensors of the merged model."""
        for part in names:
            yield {name: self.tensor(name) for name in part}

    def tensor(self, name: str) -> torch.Tensor:
        tensor = self.trained.get(name)
        if tensor is None:
            tensor = self.files.whole(name)
        if tensor.is_floating_point():
            tensor = tensor.float()
        layer = None if name in self.trained else self.layers.get(name)
        if layer is not None:
            with torch.no_grad():
                tensor = tensor + layer.get_delta_weight(ADAPTER).float()
        return tensor


def _files(cfg: Any) -> hf.WeightFiles:
    folder = hf.resolve(cfg.model.name)
    return hf.WeightFiles(folder, hf.weight_files(cfg.model.name, folder))


def _layers(adapted: nn.Module) -> dict[str, Any]:
    """peft's adapted layers, by the base-model name of the weight they adapt."""
    from peft.tuners.lora import LoraLayer

    found = {}
    for name, module in adapted.named_modules():
        key = lora.base_name(f"{name}.base_layer.weight")
        if isinstance(module, LoraLayer) and key is not None:
            found[key] = module
    return found
