"""`dtrain export --format hf` of a sharded checkpoint (`meta.pt` + `dcp/`), without the model
whole in memory: the model is made on the meta device (shapes, names and config, no weights),
its tensors are grouped into the safetensors files of the folder (each at most the shard size,
in the model's order, as transformers' own `save_pretrained` shards), and each file's tensors
are read from the checkpoint, written, synced and read back, one file at a time. Peak memory is
about one file's tensors, not the model's. The names are the model's state-dict names less the
tied duplicates (GPT-2's head is its token embedding: saved once), as `save_pretrained` writes
them; `config.json` is the training run's (the source's with `model.args`), the tokenizer files
the source's (hf_folder.py).

The check: every tensor read back from its file equals what was read from the checkpoint, and
the names and shapes are exactly those the model loads (`from_pretrained` of the folder with
equal logits is what the suite checks against the whole-model export).

A LoRA run on an `hf:` base is written the same way, each tensor merged as it is read
(hf_merge.py): the base's files, the checkpoint's adapters. `--weights ema`, and a LoRA run
whose base hf_merge cannot read tensor by tensor, go through the whole model (hf_folder.py).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from dtrain import config, models
from dtrain.checkpoint.state import read_sharded_in_parts
from dtrain.commands.export.check import report
from dtrain.commands.export.hf_folder import (
    GENERATION_CONFIG,
    copy_from_folder,
    copy_tokenizer,
    restore_use_cache,
)
from dtrain.core.errors import UserError
from dtrain.core.imports import require
from dtrain.files import outputs
from dtrain.models import hf, lora

WEIGHTS_FILE, INDEX_FILE = hf.WEIGHTS_FILE, hf.WEIGHTS_INDEX


def saved_names(model: nn.Module) -> list[str]:
    """The state-dict names `save_pretrained` writes: each tensor once (a tied one under the
    name that is not among the model's tied keys, else its first)."""
    tied = getattr(model, "_tied_weights_keys", None) or {}
    first: dict[int, str] = {}
    for name, value in model.state_dict(keep_vars=True).items():
        key = id(value)
        if key not in first or first[key] in tied and name not in tied:
            first[key] = name
    return [n for n in model.state_dict(keep_vars=True) if n in set(first.values())]


def groups(shapes: dict[str, torch.Tensor], names: list[str], limit: int) -> list[list[str]]:
    """The names in order, cut into runs of at most `limit` bytes (a larger tensor alone)."""
    out: list[list[str]] = [[]]
    size = 0
    for name in names:
        tensor = shapes[name]
        nbytes = tensor.numel() * tensor.element_size()
        if out[-1] and size + nbytes > limit:
            out.append([])
            size = 0
        out[-1].append(name)
        size += nbytes
    return out


def file_names(count: int) -> list[str]:
    if count == 1:
        return [WEIGHTS_FILE]
    return [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]


@dataclass(frozen=True)
class Source:
    """What a file-by-file export writes: the model on the meta device (names, shapes and
    config), the names saved, and their tensors read a list of names at a time."""

    model: nn.Module
    names: list[str]
    read: Callable[[Iterable[list[str]]], Iterator[dict[str, torch.Tensor]]]
    merging: bool  # a LoRA run's adapters, merged into the base as it is read


def source(folder: str, meta: dict, where: str) -> Source | None:
    """The file-by-file export of the sharded checkpoint `folder` (named `where` in messages);
    None for a LoRA run whose merge hf_merge cannot read tensor by tensor."""
    cfg = config.from_dict(meta["config"])
    with torch.device("meta"):  # a LoRA run's: its base, which the export holds merged
        model: Any = models.build(
            lora.without(cfg).model, meta["model_info"], cfg.run.seed, models.Weights.NONE
        )
    names = saved_names(model)
    if not lora.enabled(cfg.model):
        shapes = model.state_dict()
        return Source(model, names, lambda parts: _from_checkpoint(folder, shapes, parts), False)
    from dtrain.commands.export import hf_merge

    merged = hf_merge.merged(folder, meta, where, model, names)
    return None if merged is None else Source(model, names, merged.tensors, True)


def export(source: Source, meta: dict, what: str, out: str, limit: int) -> tuple[float, str]:
    """Write the folder `out` (a new one) from `source`; returns the check's largest
    difference and the line to print."""
    safetensors = require("safetensors.torch", "export", "dtrain export --format hf")
    cfg = config.from_dict(meta["config"])
    model: Any = source.model
    parts = groups(model.state_dict(), source.names, limit)
    files = file_names(len(parts))
    os.makedirs(out, exist_ok=True)
    weight_map: dict[str, str] = {}
    total, largest = 0, 0.0
    for file, part in zip(files, source.read(parts), strict=True):
        tensors = {n: t.contiguous() for n, t in part.items()}
        path = os.path.join(out, file)
        safetensors.save_file(tensors, path, metadata={"format": "pt"})
        outputs.as_ordinary_files(path)
        with open(path, "rb") as written:  # on disk before the next file is read
            os.fsync(written.fileno())
        largest = max(largest, _read_back(path, tensors))
        weight_map.update(dict.fromkeys(tensors, file))
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        del part, tensors
    if len(files) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        with open(os.path.join(out, INDEX_FILE), "w", encoding="utf-8") as f:
            json.dump(index, f, indent=2, sort_keys=True)
    origin = hf.resolve(cfg.model.name)
    restore_use_cache(model, origin)
    model.config.save_pretrained(out)
    copy_from_folder(origin, (GENERATION_CONFIG,), out)
    copied = copy_tokenizer(origin, out)
    what_files = f"{len(files)} safetensors file{'s' if len(files) > 1 else ''}"
    tokenizer = ", the tokenizer" if copied else ", no tokenizer files"
    how = (
        "the adapters merged into the base file by file"
        if source.merging
        else "written file by file"
    )
    return report(
        what,
        out,
        f"Hugging Face folder: config.json, {what_files}{tokenizer}, {how}",
        largest,
        "weights",
    )


def _from_checkpoint(
    folder: str, shapes: dict[str, torch.Tensor], parts: Iterable[list[str]]
) -> Iterator[dict[str, torch.Tensor]]:
    """For each list of names in turn, those tensors read from the DCP folder."""
    states = ({"model": {n: _empty(shapes[n]) for n in part}} for part in parts)
    for state in read_sharded_in_parts(folder, states):
        yield state["model"]


def _empty(like: torch.Tensor) -> torch.Tensor:
    return torch.empty(like.shape, dtype=like.dtype)


def _read_back(path: str, written: dict[str, torch.Tensor]) -> float:
    """The largest difference between the tensors of the file at `path`, read one at a time,
    and `written`."""
    from safetensors import safe_open

    largest = 0.0
    with safe_open(path, framework="pt") as f:
        found = set(f.keys())
        if found != set(written):
            raise UserError(f"export error: {path} holds {sorted(found)}, not {sorted(written)}")
        for name, tensor in written.items():
            if tensor.numel():
                back = f.get_tensor(name)
                largest = max(largest, float((back.float() - tensor.float()).abs().max()))
    return largest
