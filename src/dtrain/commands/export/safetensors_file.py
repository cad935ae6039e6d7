"""`dtrain export --format safetensors`: the weights as `model.safetensors`, with the resolved
`config.yaml` beside it in a folder (or `NAME.safetensors` with `NAME.config.yaml`), for the
Hugging Face world.

The file's metadata says what model the weights are for: `model_name`, `model_args` and
`model_info` (what the data told the builder: classes, channels, vocabulary, ...) as JSON
strings, and `dtrain_version`; and where they come from: `weights` (model or ema), the
checkpoint's `step` and its last evaluation's `metrics` (JSON). With them,
`dtrain.models.build(cfg.model, info, seed)` rebuilds the model and
`load_state_dict(safetensors.torch.load_file(path))` (strict) fills it. Weights tied to each
other (GPT's output head is its token embedding) are written under each of their names, as
copies: safetensors refuses tensors that share memory, and a strict load needs every name;
`tied` in the metadata lists them.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch
from torch import nn

import dtrain
from dtrain import config, models
from dtrain.commands.export.check import CheckFailed, difference, discard, report
from dtrain.files import names, outputs

WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = names.CONFIG


def paths(out: str) -> tuple[str, str]:
    """The weights file and its config: when `out` names a .safetensors file, `out` itself and
    the config under a name made from it (`model.safetensors`: `model.config.yaml`); else the
    folder `out`'s model.safetensors and config.yaml. Nothing else is written."""
    if out.endswith(".safetensors"):
        return out, out.removesuffix(".safetensors") + ".config.yaml"
    return os.path.join(out, WEIGHTS_FILE), os.path.join(out, CONFIG_FILE)


def write(model: nn.Module, meta: dict, out: str, weights: str = "model") -> None:
    """Write the weights and the config (`paths(out)`); `weights`: which of the checkpoint's,
    for the metadata."""
    from safetensors.torch import save_file

    file, config_file = paths(out)
    os.makedirs(os.path.dirname(os.path.abspath(file)), exist_ok=True)
    tensors, tied = untied(model.state_dict())
    cfg = config.from_dict(meta["config"])
    metadata = {
        "format": "pt",
        "dtrain_version": dtrain.__version__,
        "model_name": json.dumps(cfg.model.name),
        "model_args": json.dumps(cfg.model.args, default=str),
        "model_info": json.dumps(meta["model_info"], default=str),
        "tied": json.dumps(tied),
        "weights": weights,
        "step": str(meta.get("train_state", {}).get("step", "")),
        "metrics": json.dumps(meta.get("metrics") or {}, default=str),
    }
    save_file(tensors, file, metadata=metadata)
    outputs.as_ordinary_files(file)
    with open(config_file, "w", encoding="utf-8") as f:
        f.write(config.dump(cfg))


def read_back(model: nn.Module, path: str, out: str) -> tuple[float, str]:
    """Load the weights back as a user would (`load`) and compare them with `model`'s; `path`:
    the checkpoint in the line."""
    file, config_file = paths(out)
    state = model.state_dict()
    reloaded = load(file, config_file)
    found = difference(list(state.values()), [reloaded[k] for k in state])
    if found != 0:  # weights are copied, not computed: anything but equality is a fault
        discard(file, config_file)
        raise CheckFailed(
            f"export error: the weights read back from {file} differ from the checkpoint's "
            f"by {found:.3g}; it was not written"
        )
    config_name = os.path.basename(config_file)
    return report(path, file, f"safetensors, {config_name} beside it", found, "weights")


def untied(state: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], list[list[str]]]:
    """The state dict with every tensor its own contiguous memory, and the groups of names that
    shared one (tied weights)."""
    groups: dict[tuple, list[str]] = {}
    for name, tensor in state.items():
        if tensor.numel() == 0:  # empty tensors share no memory, whatever their pointer says
            groups[(name,)] = [name]
            continue
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))
        groups.setdefault(key, []).append(name)
    copies = {name for names in groups.values() for name in names[1:]}
    tensors = {
        name: tensor.detach().clone() if name in copies else tensor.detach().contiguous()
        for name, tensor in state.items()
    }
    return tensors, [names for names in groups.values() if len(names) > 1]


def load(file: str, config_file: str) -> dict[str, Any]:
    """The model rebuilt from `config_file` and the file's metadata, filled by a strict
    load_state_dict of `safetensors.torch.load_file(file)`: its state dict."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    with safe_open(file, framework="pt") as f:
        info = json.loads(f.metadata()["model_info"])
    cfg = config.load(config_file)
    model = models.build(cfg.model, info, cfg.run.seed)
    model.load_state_dict(load_file(file), strict=True)
    return model.state_dict()
