"""`dtrain export --format peft --out DIR`: a LoRA run's adapters as the folder peft writes
(`adapter_config.json`, `adapter_model.safetensors`), which `PeftModel.from_pretrained(base, DIR)`
loads onto the base model. After writing, the folder is loaded onto a freshly built base (the
run's `hf:` folder, or its built-in model with model.init_from's weights) and its outputs on a
batch are compared with the checkpoint's model.
"""

from __future__ import annotations

import os
import shutil
from typing import Any

import torch
from torch import nn

from dtrain import config, tasks
from dtrain.commands.export.check import TOLERANCE, difference, report
from dtrain.commands.export.checkpoint_model import example_input
from dtrain.core.errors import UserError
from dtrain.files import outputs
from dtrain.models import lora
from dtrain.models.spec import spec_of
from dtrain.run.weights import base_model


def check_model(meta: dict) -> None:
    """Only a LoRA run has adapters: one line for any other."""
    if not spec_of(config.from_dict(meta["config"]).model).adapters:
        raise UserError(
            "export error: --format peft writes a LoRA run's adapters (model.lora.r set); this "
            "checkpoint trained the whole model: use --format hf, safetensors or state_dict"
        )


def write(module: nn.Module, out: str) -> None:
    """Write the folder `out` (a new one) as peft does."""
    model: Any = module  # a peft PeftModel (models.lora's)
    model.save_pretrained(out)
    outputs.as_ordinary_files(out)


def read_back(module: nn.Module, meta: dict, path: str, out: str) -> tuple[float, str]:
    """Load `out` onto a freshly built base as a user would and compare with `module` on the
    task's example input (none: the adapters' weights, by name); `path`: the checkpoint in the
    line."""
    model: Any = module
    example = example_input(meta)
    cfg = config.from_dict(meta["config"])
    base = base_model(cfg, meta["model_info"])
    reloaded = lora.library("dtrain export --format peft").PeftModel.from_pretrained(base, out)
    reloaded.eval()
    if example is None:  # the task makes no batch: the adapters' weights, by name
        ours, theirs = model.state_dict(), reloaded.state_dict()
        found = difference([ours[k] for k in ours], [theirs.get(k) for k in ours])
    else:
        with torch.no_grad():
            found = difference(
                tasks.logits_of(tasks.call(model, example)),
                tasks.logits_of(tasks.call(reloaded, example)),
            )
    if not found <= TOLERANCE:
        shutil.rmtree(out, ignore_errors=True)
    files = ", ".join(sorted(os.listdir(out))) if os.path.isdir(out) else ""
    return report(
        path,
        out,
        f"peft adapter folder: {files}",
        found,
        "outputs" if example is not None else "weights",
    )
