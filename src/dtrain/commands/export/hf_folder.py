"""`dtrain export --format hf --out DIR`: a model trained from `hf:PATH` (or `hf-config:PATH`)
as a Hugging Face folder that `AutoModelFor...from_pretrained(DIR)` and serving tools load:
`config.json` (the source's, with the run's `model.args` applied), the weights as safetensors
(sharded past the shard size, with `model.safetensors.index.json`), `generation_config.json`
when the model has one, and the source folder's tokenizer files (hf_files.py).

One writer; where its tensors come from is chosen in one place, `source_of`:
- `FileByFile`, a sharded checkpoint (`meta.pt` + `dcp/`) without the model whole in memory: the
  model is made on the meta device (shapes, names and config, no weights), its tensors grouped
  into the folder's files (each at most the shard size, in the model's order, as transformers'
  own `save_pretrained` shards), and each file's tensors read from the checkpoint, written,
  synced and read back, one file at a time: peak memory is about one file's tensors. The names
  are the model's state-dict names less the tied duplicates (GPT-2's head is its token
  embedding: saved once), as `save_pretrained` writes them. The check: every tensor read back
  from its file equals what was read from the checkpoint. A LoRA run on an `hf:` base is written
  the same way, each tensor merged as it is read (hf_merge.py).
- `InMemory`, the whole model (`--weights ema`, a full checkpoint, a LoRA run whose base
  hf_merge cannot read tensor by tensor): transformers' `save_pretrained` writes it; the folder
  is loaded back with transformers and its logits on a batch compared with the checkpoint's.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from dtrain import config, models
from dtrain.checkpoint.state import load_checked, read_sharded_in_parts
from dtrain.commands.export import hf_merge
from dtrain.commands.export.check import TOLERANCE, difference, report
from dtrain.commands.export.checkpoint_model import (
    example_input,
    load_model,
    open_saved,
    refuse_code,
)
from dtrain.commands.export.hf_files import (
    GENERATION_CONFIG,
    check_model,
    copy_from_folder,
    copy_tokenizer,
    restore_use_cache,
)
from dtrain.core.errors import UserError
from dtrain.core.imports import require
from dtrain.files import outputs
from dtrain.models import hf
from dtrain.models.spec import spec_of

WEIGHTS_FILE, INDEX_FILE = hf.WEIGHTS_FILE, hf.WEIGHTS_INDEX


@dataclass(frozen=True)
class Weights:
    """What a source wrote: the files as the report line names them, and the largest difference
    found reading each file back as it was written (None: checked once the folder is whole)."""

    said: str
    largest: float | None


class Source(Protocol):
    """Where the folder's tensors come from, and how they are checked."""

    @property
    def model(self) -> Any:
        """A transformers PreTrainedModel: whole, or on the meta device (names and config)."""

    @property
    def how(self) -> str:
        """How the weights were written, for the report line ("" for save_pretrained's)."""

    def write(self, out: str, limit: int, origin: str) -> Weights:
        """The weights (files of at most `limit` bytes), config.json and the generation config
        (the model folder `origin`'s) into `out`."""
        ...

    def read_back(self, out: str, meta: dict, written: Weights) -> tuple[float, str]:
        """The largest difference to the checkpoint's model, and what was compared."""
        ...


def source_of(
    path: str, weights: str, untrusted: tuple[str, ...], shown: str
) -> tuple[Source, dict]:
    """Where the export of the checkpoint at `path` reads its tensors, and the checkpoint's
    metadata: a sharded checkpoint's trained weights file by file (a LoRA run's merged tensor by
    tensor where hf_merge can); anything else whole in memory. `untrusted`, `shown`: as
    `load_model`'s."""
    if weights == "model":
        folder, saved_as = open_saved(path)
        if saved_as.in_parts:
            meta = load_checked(os.path.join(folder, saved_as.meta_file))
            refuse_code(meta, shown, untrusted)
            check_model(meta)
            source = _file_by_file(folder, meta, path)
            if source is not None:
                return source, meta
    model, meta = load_model(path, weights, False, untrusted, shown)
    check_model(meta)
    return InMemory(model), meta


@dataclass(frozen=True)
class Written:
    weights: Weights
    tokenizer: bool  # the source folder's tokenizer files were copied


def write(source: Source, meta: dict, out: str, limit: int) -> Written:
    """Write the folder `out` (a new one) from `source`, files of at most `limit` bytes."""
    origin = hf.resolve(config.from_dict(meta["config"]).model.name)
    restore_use_cache(source.model, origin)
    weights = source.write(out, limit, origin)
    return Written(weights, bool(copy_tokenizer(origin, out)))


def read_back(
    source: Source, meta: dict, path: str, out: str, written: Written
) -> tuple[float, str]:
    """The check of the folder `out` (removed if it fails) and the line to print; `path`: the
    checkpoint in the line."""
    found, compared = source.read_back(out, meta, written.weights)
    if not found <= TOLERANCE:
        shutil.rmtree(out, ignore_errors=True)
    tokenizer = ", the tokenizer" if written.tokenizer else ", no tokenizer files"
    what = f"Hugging Face folder: config.json, {written.weights.said}{tokenizer}{source.how}"
    return report(path, out, what, found, compared)


class InMemory:
    """The whole model, as transformers saves and loads it."""

    how = ""

    def __init__(self, model: nn.Module) -> None:
        self.model: Any = model  # a transformers PreTrainedModel (hf.build's)

    def write(self, out: str, limit: int, origin: str) -> Weights:
        self.model.save_pretrained(out, max_shard_size=limit)
        outputs.as_ordinary_files(out)
        return Weights("safetensors", None)

    def read_back(self, out: str, meta: dict, written: Weights) -> tuple[float, str]:
        """The folder loaded back as a user would, its logits on the task's example input
        compared with the model's (no example input: the weights, by name)."""
        example = example_input(meta)
        transformers = hf.library("dtrain export --format hf")
        reloaded = getattr(transformers, type(self.model).__name__).from_pretrained(
            out, local_files_only=True, trust_remote_code=False
        )
        reloaded.eval()
        if example is None:
            ours, theirs = self.model.state_dict(), reloaded.state_dict()
            return difference([ours[k] for k in ours], [theirs.get(k) for k in ours]), "weights"
        with torch.no_grad():
            return difference(self.model(example).logits, reloaded(example).logits), "outputs"


@dataclass(frozen=True)
class FileByFile:
    """The model on the meta device (names, shapes and config), the names saved, and their
    tensors read a list of names at a time."""

    model: Any
    names: list[str]
    read: Callable[[Iterable[list[str]]], Iterator[dict[str, torch.Tensor]]]
    how: str

    def write(self, out: str, limit: int, origin: str) -> Weights:
        safetensors = require("safetensors.torch", "export", "dtrain export --format hf")
        parts = groups(self.model.state_dict(), self.names, limit)
        files = file_names(len(parts))
        os.makedirs(out, exist_ok=True)
        weight_map: dict[str, str] = {}
        total, largest = 0, 0.0
        for file, part in zip(files, self.read(parts), strict=True):
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
        self.model.config.save_pretrained(out)
        copy_from_folder(origin, (GENERATION_CONFIG,), out)
        return Weights(f"{len(files)} safetensors file{'s' if len(files) > 1 else ''}", largest)

    def read_back(self, out: str, meta: dict, written: Weights) -> tuple[float, str]:
        """Each file was read back as it was written (before the next was read)."""
        assert written.largest is not None
        return written.largest, "weights"


def _file_by_file(folder: str, meta: dict, where: str) -> FileByFile | None:
    """The file-by-file source of the sharded checkpoint `folder` (named `where` in messages);
    None for a LoRA run whose merge hf_merge cannot read tensor by tensor."""
    cfg = config.from_dict(meta["config"])
    spec = spec_of(cfg.model)
    # Shapes only (a LoRA run's: its base, which the export holds merged).
    model: Any = models.build(spec.base, meta["model_info"], cfg.run.seed, models.Weights.NONE)
    names = saved_names(model)
    if not spec.adapters:
        shapes = model.state_dict()
        read = functools.partial(_from_checkpoint, folder, shapes)
        return FileByFile(model, names, read, ", written file by file")
    merged = hf_merge.merged(folder, meta, where, model, names)
    if merged is None:
        return None
    how = ", the adapters merged into the base file by file"
    return FileByFile(model, names, merged.tensors, how)


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
