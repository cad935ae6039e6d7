"""`dtrain export`: a checkpoint's model as a file that loads without dtrain, checked on a batch.

Formats: `state_dict` (plain tensors by parameter name, from full and sharded checkpoints alike),
`torchscript` (torch.jit.trace) and `exported` (torch.export). After writing, the file is loaded
back the way a user would and its outputs are compared with the checkpoint's model on a batch.
"""

from __future__ import annotations

import os
import warnings

import torch
from torch import nn

from dtrain import checkpoint, config, models
from dtrain.checkpoint.state import read_sharded
from dtrain.data import Datasets
from dtrain.errors import UserError

TOLERANCE = 1e-5


def load_model(path: str) -> tuple[nn.Module, dict]:
    """The model of the checkpoint at `path` (a checkpoint directory or its checkpoint.pt), in
    eval mode on the CPU, and the checkpoint's metadata."""
    folder, fmt = checkpoint.open_checkpoint(path)
    sharded = fmt == "sharded"
    meta_path = os.path.join(folder, checkpoint.META_FILE if sharded else checkpoint.FULL_FILE)
    meta = checkpoint.load_file(path if os.path.isfile(path) else meta_path)
    cfg = config.from_dict(meta["config"])
    info = meta["model_info"]
    model = models.build(cfg.model, Datasets(train=None, val=None, **info), cfg.run.seed)
    if sharded:
        state = {"model": model.state_dict()}
        read_sharded(folder, state)
        weights = state["model"]
    else:
        weights = meta["model"]
    try:
        model.load_state_dict(weights)
    except RuntimeError as e:
        raise UserError(f"checkpoint error: {path}: {str(e).splitlines()[0]}") from None
    return model.eval(), meta


def example_batch(meta: dict, size: int = 4) -> torch.Tensor:
    info = meta["model_info"]
    gen = torch.Generator().manual_seed(0)
    return torch.randn(size, info["in_channels"], info["image_size"], info["image_size"], generator=gen)


def export(path: str, out: str, fmt: str = "state_dict") -> float:
    """Write the export, load it back, and return the largest output difference on a batch."""
    model, meta = load_model(path)
    batch = example_batch(meta)
    with torch.no_grad():
        expected = model(batch)
    out_dir = os.path.dirname(os.path.abspath(out))
    os.makedirs(out_dir, exist_ok=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.jit's deprecation notes are not the user's business
        if fmt == "state_dict":
            torch.save(model.state_dict(), out)
            reloaded = _reload_state_dict(meta, out)
        elif fmt == "torchscript":
            torch.jit.save(torch.jit.trace(model, batch), out)
            reloaded = torch.jit.load(out)
        elif fmt == "exported":
            torch.export.save(torch.export.export(model, (batch,)), out)
            reloaded = torch.export.load(out).module()
        else:
            raise UserError(f"export error: unknown format '{fmt}'")
        with torch.no_grad():
            actual = reloaded(batch)
    difference = (actual - expected).abs().max().item()
    if difference > TOLERANCE:
        raise UserError(f"export error: the exported model's outputs differ from the checkpoint's "
                        f"by {difference:.3g} (> {TOLERANCE}); {out} is not trustworthy")
    print(f"exported {path} -> {out} ({fmt}); outputs match the checkpoint on a batch "
          f"(max difference {difference:.2g})")
    return difference


def _reload_state_dict(meta: dict, out: str) -> nn.Module:
    cfg = config.from_dict(meta["config"])
    model = models.build(cfg.model, Datasets(train=None, val=None, **meta["model_info"]), cfg.run.seed)
    model.load_state_dict(torch.load(out, weights_only=True))
    return model.eval()
