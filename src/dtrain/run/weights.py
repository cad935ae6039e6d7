"""Where a model's initial weights come from when not from its own initialisation, for
fine-tuning: `model.init_from` (a dtrain checkpoint, an exported state_dict, a torchvision `.pth`)
and `model.pretrained` (torchvision's weights from the local torch hub cache). Weights only: the
optimizer, the schedule and the step start fresh.

Rank 0 reads a file (memory-mapped) and the other ranks receive what they hold (their shards
under FSDP): the file is read once, whatever the number of ranks. A sharded dtrain checkpoint is
read by every rank, each its own shards.
"""

from __future__ import annotations

import fnmatch
import os
import shutil
import tempfile
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from dtrain import models
from dtrain.checkpoint.load import check_base
from dtrain.checkpoint.state import (
    FULL_FILE,
    dcp_model_shapes,
    load_checked,
    read_sharded,
    shape_mismatch,
)
from dtrain.config import Config, ModelConfig
from dtrain.core.errors import UserError, first_line
from dtrain.core.imports import require
from dtrain.core.urls import is_url
from dtrain.files.digests import file_digest, new_hash
from dtrain.files.keys import local_path
from dtrain.files.objstore import ObjectStore
from dtrain.files.remote_store import fetch_checkpoint
from dtrain.files.safetensors_header import BadSafetensors, read_header
from dtrain.files.store import read_marker
from dtrain.models import hf
from dtrain.models.spec import spec_of
from dtrain.process import dist

if TYPE_CHECKING:
    from torch.distributed.checkpoint.state_dict import ValueType


def pretrained_path(model_name: str) -> str:
    """Where torchvision's default weights of `tv:<model_name>` lie in the torch hub cache, or a
    UserError saying which file to put where (nothing is downloaded at run time)."""
    if model_name.startswith("timm:"):
        return _timm_weights(model_name)
    import torchvision

    name = model_name.removeprefix("tv:")
    try:
        weights = torchvision.models.get_model_weights(name).DEFAULT
    except (ValueError, KeyError, AttributeError):
        raise UserError(
            f"config error: model.pretrained: torchvision has no weights for {model_name}"
        ) from None
    filename = os.path.basename(weights.url)
    path = os.path.join(torch.hub.get_dir(), "checkpoints", filename)
    if not os.path.isfile(path):
        raise UserError(
            f"config error: model.pretrained: torchvision's weights for {model_name} "
            f"are not in the torch hub cache; put {filename} (from {weights.url}) at "
            f"{path} (dtrain downloads nothing at run time)"
        )
    return path


def _timm_weights(model_name: str) -> str:
    """Where timm's pretrained weights of `timm:<name>` lie in the local Hugging Face cache, or
    a UserError saying what to download where (nothing is downloaded at run time)."""
    timm = require("timm", "timm", f"model.name: {model_name}")
    hub = require("huggingface_hub", "timm", "model.pretrained")
    name = model_name.removeprefix("timm:")
    repo = getattr(
        timm.models.get_pretrained_cfg(name, allow_unregistered=False), "hf_hub_id", None
    )
    if not repo:
        raise UserError(f"config error: model.pretrained: timm has no weights for {model_name}")
    repo, _, revision = repo.partition("@")
    for file in ("model.safetensors", "pytorch_model.bin"):
        found = hub.try_to_load_from_cache(repo, file, revision=revision or None)
        if isinstance(found, str):
            return found
    raise UserError(
        f"config error: model.pretrained: timm's weights for {model_name} are not in the "
        f"Hugging Face cache ({hub.constants.HF_HUB_CACHE}); download them there first "
        f"(hf download {repo}): dtrain downloads nothing at run time"
    )


def _state_dict_of(path: str, shown: str) -> dict[str, torch.Tensor]:
    """The model weights in a file: a dtrain full checkpoint's `model` (checked against its
    marker's digest), a plain state_dict, or a safetensors file (its header checked against
    the file first). `shown`: the weights' place for messages."""
    if path.endswith(".safetensors"):
        safetensors = require("safetensors.torch", "export", "model.init_from (.safetensors)")
        try:
            read_header(path)
        except BadSafetensors as e:
            raise UserError(
                f"config error: model.init_from: {str(e).replace(path, shown)}"
            ) from None
        return dict(safetensors.load_file(path))
    data = load_checked(path, mmap=True)
    if isinstance(data, dict) and isinstance(data.get("model"), dict) and "train_state" in data:
        data = data["model"]
    if not isinstance(data, dict) or not all(isinstance(v, torch.Tensor) for v in data.values()):
        raise UserError(
            f"config error: model.init_from: {path} holds no state_dict (a mapping of "
            f"parameter names to tensors) nor a dtrain checkpoint"
        )
    return data


def _model_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's state dict (DTensors under FSDP): a model's state holds only tensors, which
    get_model_state_dict's return type, shared with optimizer state, does not say."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return cast(dict[str, torch.Tensor], get_model_state_dict(model))


class StartingWeights:
    """The weights model.init_from or model.pretrained names, checked against the model before
    anything of the run is written (on construction), loaded once the run knows it starts fresh
    (`load`).
    Strict unless model.init_strict is false: every weight of the model not excluded by
    model.init_exclude must be in the file, with its shape."""

    def __init__(
        self, model: nn.Module, cfg: ModelConfig, options: dict[str, Any] | None = None
    ) -> None:
        """`options`: run.storage_options, for an init_from in an object store."""
        self.cfg = cfg
        self.path = pretrained_path(cfg.name) if cfg.pretrained else str(cfg.init_from)
        self.url = self.path if is_url(self.path) else None  # a URL's local copy is read
        self.fetched_into: str | None = None
        if self.url:
            self.fetched_into = tempfile.mkdtemp(prefix="dtrain-init-from-")
            self.path = _fetched(self.path, self.fetched_into, options)
        # A LoRA model's tensors by their base model's names (the file's); its adapters start
        # from their own initialisation.
        self.names = spec_of(cfg).base_names(list(_model_tensors(model)))
        ours = {self.names[k]: v for k, v in _model_tensors(model).items() if k in self.names}
        self.excluded = {k for k in ours if self._excluded(k)}
        shapes = {k: tuple(v.shape) for k, v in ours.items() if k not in self.excluded}
        folder = self.path if os.path.isdir(self.path) else None
        sharded = folder is not None and (read_marker(folder) or {}).get("format") == "sharded"
        self.sharded_folder = folder if sharded else None
        if folder is not None and self.sharded_folder is None:
            self.path = os.path.join(folder, FULL_FILE)
        if not os.path.exists(self.path):
            raise UserError(f"config error: model.init_from: {self.shown} not found")
        self.weights: dict[str, torch.Tensor] | None = None  # read by rank 0 only
        self.count = dist.on_main(lambda: self._check(shapes))

    @property
    def shown(self) -> str:
        """The weights' place for messages: the URL, or the local file read."""
        return self.url or self.path

    def _excluded(self, name: str) -> bool:
        return any(fnmatch.fnmatchcase(name, glob) for glob in self.cfg.init_exclude)

    def _check(self, shapes: dict[str, tuple]) -> int:
        if self.sharded_folder is not None:
            theirs = {
                k: v
                for k, v in dcp_model_shapes(self.sharded_folder).items()
                if k not in self.excluded
            }
        else:  # memory-mapped: read as the broadcast goes
            self.weights = {
                k: v
                for k, v in _state_dict_of(self.path, self.shown).items()
                if not self._excluded(k)
            }
            theirs = {k: tuple(v.shape) for k, v in self.weights.items()}
        problem = shape_mismatch(shapes, theirs, strict=self.cfg.init_strict)
        if problem:
            raise UserError(
                f"config error: model.init_from: {self.shown}: {problem}; leave weights "
                f"out with model.init_exclude (e.g. [fc.*] for another head)"
            )
        return len(set(shapes) & set(theirs))

    def load(self, model: nn.Module) -> str:
        """Into `model`: rank 0 broadcasts each tensor (every rank keeps its shard), or, from a
        sharded checkpoint, each rank reads its own. Returns a line for the log."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        try:
            if self.sharded_folder is not None:
                staged: dict[str, dict[str, ValueType]] = {
                    "model": {
                        self.names[k]: torch.empty_like(v)
                        for k, v in _model_tensors(model).items()
                        if self.names.get(k) not in self.excluded | {None}
                    }
                }
                read_sharded(self.sharded_folder, staged)
                weights = self._by_model_names(staged["model"])
                set_model_state_dict(model, weights, options=StateDictOptions(strict=False))
            else:
                options = StateDictOptions(
                    full_state_dict=True, strict=False, broadcast_from_rank0=dist.is_distributed()
                )
                # Tensors are state values; the cast only widens the dict's declared value type.
                weights = self._by_model_names(cast("dict[str, ValueType]", self.weights or {}))
                set_model_state_dict(model, weights, options=options)
        except (RuntimeError, KeyError, ValueError) as e:
            raise UserError(
                f"config error: model.init_from: {self.shown}: {first_line(e)}"
            ) from None
        finally:
            self.weights = None
            if self.fetched_into:  # the local copy of weights in an object store
                shutil.rmtree(self.fetched_into, ignore_errors=True)
        left = (
            (
                f", {len(self.excluded)} left at their initial values "
                f"({', '.join(self.cfg.init_exclude)})"
            )
            if self.excluded
            else ""
        )
        return f"initial weights from {self.shown}: {self.count} tensors{left}"

    def _by_model_names(self, weights: dict[str, ValueType]) -> dict[str, ValueType]:
        """`weights` by the model's names (a LoRA model may hold one base tensor twice: the
        frozen original of a module trained in full, and its trained copy)."""
        return {ours: weights[base] for ours, base in self.names.items() if base in weights}

    def identity(self) -> dict[str, str]:
        """Where the weights are and their digest: a file's own, or a checkpoint's marker's
        (which holds every file's digest)."""
        marker = read_marker(self.sharded_folder) if self.sharded_folder else None
        if marker is not None:
            return {"weights": self.shown, "digest": str(marker.get("marker_digest", ""))}
        return {"weights": self.shown, "digest": file_digest(self.path)}


def base_identity(
    cfg: ModelConfig, seed: int, starting: StartingWeights | None
) -> dict[str, dict[str, str]]:
    """For a LoRA run, what its frozen base is (`lora_base`: where the weights come from, and
    their digest; for a Hugging Face folder's model also its config.json's digest, as a changed
    activation or rotary base computes another model from the same weights), saved in its
    checkpoints and checked wherever they are read; else nothing. Computed on rank 0 (reading
    the weights once) and given to every rank."""
    if not spec_of(cfg).adapters:
        return {}

    def identity() -> dict[str, str]:
        found = weights_identity()
        if cfg.name.startswith(hf.PREFIXES):
            found["config_digest"] = hf.config_digest(hf.resolve(cfg.name))
        return found

    def weights_identity() -> dict[str, str]:
        if starting is not None:
            return starting.identity()
        if cfg.name.startswith("hf:"):
            folder = hf.resolve(cfg.name)
            files = hf.weight_files(cfg.name, folder)
            digest = new_hash()
            for file in files:
                digest.update(f"{file} {file_digest(os.path.join(folder, file))}\n".encode())
            return {"weights": folder, "digest": str(digest.hexdigest())}
        # Fresh weights (the builder's initialisation from run.seed): the config says them.
        return {"weights": f"{cfg.name} initialised from run.seed {seed}", "digest": f"seed {seed}"}

    return {"lora_base": dist.on_main(identity)}


def prepare_base(model: nn.Module, cfg: Config, saved_info: dict[str, Any], where: str) -> None:
    """Before a LoRA checkpoint's adapters are loaded outside training (`dtrain eval`,
    `export`): the base they were trained on, checked by its digest against the checkpoint's
    `where` (exit 2 when it changed), with its weights from model.init_from / pretrained."""
    if not spec_of(cfg.model).adapters:
        return
    uses_file = bool(cfg.model.init_from or cfg.model.pretrained)
    starting = StartingWeights(model, cfg.model, cfg.run.storage_options) if uses_file else None
    check_base(saved_info, base_identity(cfg.model, cfg.run.seed, starting), where)
    if starting is not None:
        starting.load(model)


def base_model(cfg: Config, info: dict[str, Any]) -> nn.Module:
    """A LoRA run's base as a plain model (no adapters): built as the run builds it, with
    model.init_from / pretrained's weights loaded (outside training: one process)."""
    plain = spec_of(cfg.model).base
    model = models.build(plain, info, cfg.run.seed)
    if plain.init_from or plain.pretrained:
        StartingWeights(model, plain, cfg.run.storage_options).load(model)
    return model.eval()


def _fetched(url: str, into: str, options: dict[str, Any] | None) -> str:
    """A local copy in `into` of the weights at `url`: a dtrain checkpoint (its folder or
    checkpoint.pt, fetched with its marker and checked by its digests as it is read) or a single
    file (an exported state_dict, a `.pth`)."""
    name = url.rstrip("/").rsplit("/", 1)[1]
    if "." in name and name != FULL_FILE:
        objects = ObjectStore(url.rstrip("/").rsplit("/", 1)[0], options)
        local = local_path(into, name, objects.url)
        with objects.failing_as("read"):
            try:
                objects.get(name, local)
            except FileNotFoundError:
                raise UserError(f"config error: model.init_from: {url} not found") from None
        return local
    return fetch_checkpoint(url, into, dict(options or {}))
