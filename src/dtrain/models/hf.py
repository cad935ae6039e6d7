"""Hugging Face models by path: `model.name: hf:PATH` (the folder's architecture and weights) and
`hf-config:PATH` (its architecture from `config.json`, with fresh weights: pretraining).

PATH is a local folder with `config.json` (and, for `hf:`, safetensors weights: one file, or
shards with their index), or a model id found in the local Hugging Face cache: nothing is ever
downloaded. The head is the config's `architectures` (a causal LM, a sequence or an image
classifier; `model.num_classes` sets a classifier's labels); `model.args` overrides fields of the
config. Weights load in float32 (the run's precision is applied to them as to any model). A
folder that names code of its own (`auto_map`) is refused unless `model.trust_remote_code`.
"""

from __future__ import annotations

import difflib
import json
import math
import os
from typing import Any

import torch
from torch import nn

from dtrain.config import ModelConfig
from dtrain.core.errors import UserError, first_line
from dtrain.core.imports import refuse_folder_code, require
from dtrain.files.digests import new_hash
from dtrain.files.safetensors_header import BadSafetensors, Tensor, read_header
from dtrain.models import Weights
from dtrain.models.spec import spec_of

PREFIXES = ("hf:", "hf-config:")
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"


def build(cfg: ModelConfig, info: dict[str, Any], weights: Weights = Weights.LOAD) -> nn.Module:
    """`hf:PATH`: the model with the folder's weights; with `Weights.LATER` without them (nothing
    drawn either: the caller reads every tensor, as FSDP does by rows into its shards, see
    `WeightFiles`); with `Weights.NONE` the shapes alone (`dtrain plan`, on the meta device)."""
    folder = resolve(cfg.name)
    cls, config = _class_and_config(cfg, info, folder)
    tensors = check_weights(cfg.name, folder)
    if weights is Weights.NONE:
        return cls(config)
    saved = cls.config_class.from_pretrained(folder, local_files_only=True, trust_remote_code=False)
    saved_labels = getattr(saved, "num_labels", None)
    fresh_head = getattr(config, "num_labels", None) != saved_labels
    _check_shapes(cfg.name, folder, _shapes_of(cls, config), tensors, fresh_head)
    if weights is Weights.LATER:
        from transformers.initialization import no_init_weights

        with no_init_weights():
            model = cls(config)
        model.tie_weights()  # (which no_init_weights leaves to from_pretrained)
        return model
    return cls.from_pretrained(
        folder,
        config=config,
        dtype=torch.float32,
        local_files_only=True,
        trust_remote_code=cfg.trust_remote_code,
        # A classifier for other classes than the folder's: its head starts afresh.
        ignore_mismatched_sizes=fresh_head,
    )


def late_weights(cfg: ModelConfig, info: dict[str, Any]) -> WeightFiles | None:
    """The weight files an FSDP build reads by rows: those of an `hf:PATH` model without LoRA
    (peft's names and adapters go through from_pretrained) whose files hold every parameter of
    the model under its name, in its shape; None for any other model (a classifier whose head
    starts afresh, say: from_pretrained draws what the files do not hold)."""
    if not cfg.name.startswith("hf:") or spec_of(cfg).adapters:
        return None
    folder = resolve(cfg.name)
    cls, config = _class_and_config(cfg, info, folder)
    files = WeightFiles(cfg.name, folder)
    for name, shape in _shapes_of(cls, config).items():  # (each tied tensor under one name)
        if files.shape(name) != shape:
            return None
    return files


def _shapes_of(cls: Any, config: Any) -> dict[str, tuple[int, ...]]:
    """The shape of each parameter of the model `config` describes (built on the meta device:
    no memory, whatever the sizes)."""
    with torch.device("meta"):
        model = cls(config)
    return {name: tuple(param.shape) for name, param in model.named_parameters()}


def _check_shapes(
    name: str,
    folder: str,
    shapes: dict[str, tuple[int, ...]],
    tensors: dict[str, tuple[str, Tensor]],
    fresh_head: bool,
) -> None:
    """Each tensor of the folder's files that the model has under its name has the model's shape
    (one from another model, or a config.json that does not describe these weights, is one line
    naming both; a classifier's head for other classes (`fresh_head`) starts afresh)."""
    for key, (path, tensor) in tensors.items():
        ours = shapes.get(key)
        if ours is None or ours == tensor.shape or fresh_head and ours[1:] == tensor.shape[1:]:
            continue
        raise UserError(
            f"config error: model.name: {name}: {path}: tensor {key!r} has shape "
            f"{list(tensor.shape)} in the file, and {list(ours)} in the model the folder's "
            f"{CONFIG_FILE} describes{_sizes_named(folder, ours, tensor.shape)}: the weights and "
            f"{CONFIG_FILE} are not of one model"
        )


def _sizes_named(folder: str, ours: tuple[int, ...], theirs: tuple[int, ...]) -> str:
    """Which fields of the folder's config.json give the model's sizes that differ from the
    weights' (`' (vocab_size 512)'`), or ''."""
    with open(os.path.join(folder, CONFIG_FILE), encoding="utf-8") as f:
        fields = json.load(f)
    differing = {size for i, size in enumerate(ours) if i >= len(theirs) or theirs[i] != size}
    named = [
        f"{key} {value}"
        for key, value in fields.items()
        if type(value) is int and value in differing  # (not a bool, which is an int too)
    ]
    return f" ({', '.join(named)})" if named else ""


class WeightFiles:
    """A folder's safetensors files, read tensor by tensor, or a tensor's rows alone (the file's
    pages of the other rows are never touched)."""

    def __init__(self, name: str, folder: str) -> None:
        """The files of `folder`, the folder of `model.name` `name`, each header checked before
        safetensors opens the file."""
        from safetensors import safe_open

        self.folder = folder
        located = check_weights(name, folder)
        opened = {path: safe_open(path, framework="pt") for path, _ in located.values()}
        self._where = {key: opened[path] for key, (path, _) in located.items()}
        self._tensors = {key: tensor for key, (_, tensor) in located.items()}
        self.total = sum(t.nbytes for t in self._tensors.values())  # bytes of every tensor
        self.read = 0  # bytes read so far

    def shape(self, key: str) -> tuple[int, ...] | None:
        tensor = self._tensors.get(key)
        return None if tensor is None else tensor.shape

    def rows(self, key: str, start: int, stop: int) -> torch.Tensor:
        part = self._where[key].get_slice(key)
        tensor = part[start:stop]
        self.read += tensor.numel() * tensor.element_size()
        return tensor

    def whole(self, key: str) -> torch.Tensor:
        tensor = self._where[key].get_tensor(key)
        self.read += tensor.numel() * tensor.element_size()
        return tensor


def build_from_config(cfg: ModelConfig, info: dict[str, Any]) -> nn.Module:
    """`hf-config:PATH`: the folder's architecture with fresh weights (seeded by run.seed)."""
    folder = resolve(cfg.name)
    cls, config = _class_and_config(cfg, info, folder)
    try:
        return cls(config).to(torch.float32)
    except (RuntimeError, ValueError, TypeError, ArithmeticError, MemoryError) as e:
        largest = max(_shapes_of(cls, config).values(), key=math.prod, default=())
        raise UserError(
            f"config error: model.name: {cfg.name}: the model {folder}/{CONFIG_FILE} describes "
            f"(with model.args {cfg.args}) cannot be built: its largest tensor "
            f"{list(largest)}{_sizes_named(folder, largest, ())}: {first_line(e)}"
        ) from None


def resolve(name: str) -> str:
    """The local folder that `hf:PATH` names: PATH itself, or the cached snapshot of the model
    id PATH (offline). One line naming where it was looked for when neither has it."""
    path = name.split(":", 1)[1]
    if os.path.isdir(path):
        folder = path
    elif path.startswith(("/", ".", "~")) or path.count("/") > 1:  # a path, not a model id
        raise UserError(f"config error: model.name: {name}: no folder {path!r}")
    else:
        hub = require("huggingface_hub", "transformers", f"model.name: {name}")
        try:
            folder = hub.snapshot_download(path, local_files_only=True)
        except Exception:  # noqa: BLE001 - not in the cache (or not a model id at all)
            raise UserError(
                f"config error: model.name: {name}: no folder {path!r}, and no model {path!r} "
                f"in the Hugging Face cache ({hub.constants.HF_HUB_CACHE}); name a folder with "
                f"{CONFIG_FILE}, or download the model into the cache first (nothing is "
                f"downloaded at run time)"
            ) from None
    if not os.path.isfile(os.path.join(folder, CONFIG_FILE)):
        raise UserError(
            f"config error: model.name: {name}: {folder} has no {CONFIG_FILE}; name the folder "
            f"that save_pretrained wrote"
        )
    return folder


def config_digest(folder: str) -> str:
    """The digest of the folder's config.json as content (its keys in order, no spacing), less
    `transformers_version`, which says who saved the file and changes no computation."""
    with open(os.path.join(folder, CONFIG_FILE), encoding="utf-8") as f:
        fields = json.load(f)
    fields.pop("transformers_version", None)
    digest = new_hash()
    digest.update(json.dumps(fields, sort_keys=True, separators=(",", ":")).encode())
    return str(digest.hexdigest())


def library(feature: str = "a Hugging Face model") -> Any:
    """transformers, imported; one line naming the extra when it is not installed."""
    return require("transformers", "transformers", feature)


def _class_and_config(cfg: ModelConfig, info: dict[str, Any], folder: str) -> tuple[Any, Any]:
    """The model class the config's `architectures` names and the config, with model.args and
    model.num_classes applied and checked against the data."""
    transformers = library(f"model.name: {cfg.name}")
    transformers.logging.disable_progress_bar()  # a bar per load, drawn by every rank
    if not cfg.trust_remote_code:  # (a bool: transformers never asks on stdin)
        refuse_folder_code(
            folder, f"config error: model.name: {cfg.name}", "model.trust_remote_code: true"
        )
    try:
        config = transformers.AutoConfig.from_pretrained(
            folder, local_files_only=True, trust_remote_code=cfg.trust_remote_code
        )
    except Exception as e:  # noqa: BLE001 - whatever the folder's file makes transformers raise
        # (a field of the wrong type is huggingface_hub's validation error, over several lines)
        reason = " ".join(line.strip() for line in str(e).splitlines()) or type(e).__name__
        raise UserError(
            f"config error: model.name: {cfg.name}: {folder}/{CONFIG_FILE} cannot be read "
            f"({reason})"
        ) from None
    for key, value in cfg.args.items():
        if not hasattr(config, key):
            close = difflib.get_close_matches(key, list(config.to_dict()), n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            raise UserError(
                f"config error: model.args.{key}: {type(config).__name__} has no such field{hint}"
            )
        setattr(config, key, value)
    architectures = getattr(config, "architectures", None) or []
    if len(architectures) != 1:
        raise UserError(
            f"config error: model.name: {cfg.name}: {CONFIG_FILE} names "
            f"{len(architectures)} architectures, not one; set model.args.architectures, "
            f"e.g. [LlamaForCausalLM]"
        )
    cls = getattr(transformers, architectures[0], None)
    if cls is None and cfg.trust_remote_code:
        cls = _own_class(config, folder, architectures[0])
    if not isinstance(cls, type) or not issubclass(cls, transformers.PreTrainedModel):
        raise UserError(
            f"config error: model.name: {cfg.name}: transformers "
            f"{transformers.__version__} has no model class {architectures[0]!r} (the "
            f"architecture {CONFIG_FILE} names)"
        )
    if "ForSequenceClassification" in cls.__name__ or "ForImageClassification" in cls.__name__:
        num_classes = cfg.num_classes or info.get("num_classes")
        if num_classes:
            config.num_labels = num_classes
    if hasattr(config, "use_cache"):
        config.use_cache = False  # a cache of keys and values serves generation, not training
    window, positions = info.get("seq_len"), getattr(config, "max_position_embeddings", None)
    if window and positions and window > positions:
        raise UserError(
            f"config error: model.name: {cfg.name}: the data's windows ({window} tokens) are "
            f"longer than the model's max_position_embeddings ({positions}); set the data's "
            f"seq_len (data.tokens.seq_len, data.text.seq_len) to at most {positions}"
        )
    vocab, data_vocab = getattr(config, "vocab_size", None), info.get("vocab_size")
    if vocab and data_vocab and data_vocab > vocab:
        raise UserError(
            f"config error: model.name: {cfg.name}: the model's vocabulary has {vocab} ids, the "
            f"data's {data_vocab}; encode the data with the model's own tokenizer "
            f"(dtrain tokenize --tokenizer {folder})"
        )
    return cls, config


def _own_class(config: Any, folder: str, name: str) -> Any:
    """The folder's own model class `name` (model.trust_remote_code), where its config's
    `auto_map` names it; None where it does not."""
    from transformers.dynamic_module_utils import get_class_from_dynamic_module

    auto_map = getattr(config, "auto_map", None) or {}
    refs = [r for r in auto_map.values() if isinstance(r, str) and r.endswith(f".{name}")]
    return get_class_from_dynamic_module(refs[0], folder, local_files_only=True) if refs else None


def check_weights(name: str, folder: str) -> dict[str, tuple[str, Tensor]]:
    """The tensors of the folder's safetensors files (each with its file's path), each file's
    header checked against the file (files/safetensors_header.py): a truncated download or a
    crafted header is one line naming the file and the tensor, before anything is loaded."""
    tensors: dict[str, tuple[str, Tensor]] = {}
    for file in weight_files(name, folder):
        path = os.path.join(folder, file)
        try:
            tensors.update((key, (path, t)) for key, t in read_header(path).items())
        except BadSafetensors as e:
            raise UserError(f"config error: model.name: {name}: {e}") from None
    return tensors


def weight_files(name: str, folder: str) -> list[str]:
    """The names of the folder's safetensors files: one, or the shards its index lists."""
    index = os.path.join(folder, WEIGHTS_INDEX)
    if os.path.isfile(index):
        try:
            with open(index, encoding="utf-8") as f:
                files = sorted(set(json.load(f)["weight_map"].values()))
            if not all(isinstance(file, str) for file in files):
                raise TypeError("a file name that is not a string")
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            raise UserError(
                f"config error: model.name: {name}: {index} is not a safetensors index"
            ) from None
        outside = [f for f in files if os.path.basename(f) != f or f.startswith(".")]
        if outside:  # the index is the folder's: it names its own files, nothing elsewhere
            raise UserError(
                f"config error: model.name: {name}: {index} lists {outside[0]!r}, which is not "
                f"a file of the folder"
            )
        pickled = [file for file in files if not file.endswith(".safetensors")]
        if pickled:
            raise UserError(
                f"config error: model.name: {name}: {index} lists {pickled[0]}, not a "
                f"safetensors file: dtrain does not load pickled weights (loading them can run "
                f"code); convert the model to safetensors (save_pretrained writes them) where "
                f"you trust it"
            )
    elif os.path.isfile(os.path.join(folder, WEIGHTS_FILE)):
        files = [WEIGHTS_FILE]
    else:
        raise UserError(
            f"config error: model.name: {name}: {folder} has no {WEIGHTS_FILE} or "
            f"{WEIGHTS_INDEX}; save the model with save_pretrained (safetensors), or use "
            f"hf-config:{name.split(':', 1)[1]} to start from fresh weights"
        )
    return files
