"""LoRA (`model.lora`): low-rank adapters trained beside a model whose own weights stay frozen,
through peft (extra `[peft]`).

The model is built as usual (an `hf:` model with its folder's weights, a built-in one with its
initialisation), then peft wraps it: each targeted layer gets a pair of small matrices A (r x in)
and B (out x r, zeros) whose product, scaled by alpha / r, is added to the layer's output, so the
adapted model starts out equal to its base. Only the adapters and `modules_to_save` (a
classifier's new head) train; a checkpoint holds only those (the base is read again from where it
came from, checked by its digest: `run.weights.base_identity`).

Names: peft's, inside its wrapper (`base_model.model.<name>`, a targeted layer's own weight as
`<layer>.base_layer.weight`); `base_name` maps them back to the base model's.
"""

from __future__ import annotations

import difflib
import warnings
from typing import Any

from torch import nn

from dtrain.config import ModelConfig
from dtrain.core.errors import UserError, first_line

PREFIX = "base_model.model."  # peft's names for the wrapped model's tensors
ALL_LINEAR = "all-linear"
# The built-in models' layers that get adapters when model.lora.target_modules is unset: the
# attention's projections, as the LoRA paper adapts (peft's defaults for Hugging Face models
# are the same choice: q_proj and v_proj for Llama).
BUILT_IN_TARGETS = {"gpt": ["qkv", "proj"]}
# Parts of peft's names that the base model's names do not have.
_WRAPPER_PARTS = (".base_layer", ".original_module", ".modules_to_save.default")


def library(feature: str = "model.lora") -> Any:
    """peft, imported; one line naming the extra when it is not installed."""
    from dtrain.core.imports import require

    return require("peft", "peft", feature)


def apply(model: nn.Module, cfg: ModelConfig, num_classes: int | None) -> nn.Module:
    """`model` with adapters on the layers `model.lora.target_modules` names and everything else
    frozen, except `modules_to_save` (by default the head of a classifier with `num_classes`)."""
    peft = library()
    lora = cfg.lora
    to_save = _modules_to_save(model, cfg, num_classes)
    targets = _targets(model, cfg, to_save)
    config = peft.LoraConfig(
        r=lora.r,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=targets,
        modules_to_save=to_save or None,
        # GPT-2's layers are transformers' Conv1D, weights stored (in, out): peft must know, or
        # it says it guessed.
        fan_in_fan_out=any(type(m).__name__ == "Conv1D" for m in model.modules()),
    )
    try:
        with warnings.catch_warnings():
            # peft asks transformers 5 by a name it has deprecated: not the user's business.
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing")
            return peft.get_peft_model(model, config)
    except (ValueError, TypeError, RuntimeError) as e:  # e.g. a layer type peft cannot adapt
        raise UserError(
            f"config error: model.lora: peft cannot adapt {cfg.name}: {first_line(e)}"
        ) from None


def base_name(name: str) -> str | None:
    """The name the tensor `name` of an adapted model has in its base model; None for an
    adapter's own tensors (they are not in the base)."""
    if ".lora_" in name:
        return None
    name = name.removeprefix(PREFIX)
    for part in _WRAPPER_PARTS:
        name = name.replace(part, "")
    return name


def _module_names(model: nn.Module) -> list[str]:
    return [name for name, _ in model.named_modules() if name]


def _matches(names: list[str], key: str) -> bool:
    """peft's rule for a name in target_modules: a module's whole name or its last parts."""
    return any(name == key or name.endswith("." + key) for name in names)


def _check_names(model: nn.Module, cfg: ModelConfig, key: str, wanted: list[str]) -> None:
    """Every name in `wanted` names a module of the model; else one line with the nearest."""
    names = _module_names(model)
    for entry in wanted:
        if not isinstance(entry, str) or not _matches(names, entry):
            shorts = sorted({n.rsplit(".", 1)[-1] for n in names} | set(names))
            close = difflib.get_close_matches(str(entry), shorts, n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            linear = sorted(
                {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, nn.Linear)}
            )
            raise UserError(
                f"config error: model.lora.{key}: no module of {cfg.name} is named "
                f"{entry!r}{hint}; its linear layers are named {', '.join(linear[:12])}"
            )


def _targets(model: nn.Module, cfg: ModelConfig, to_save: list[str]) -> list[str] | str:
    """model.lora.target_modules, checked, or the default for the model."""
    wanted = cfg.lora.target_modules
    is_hf = hasattr(model, "config") and hasattr(model, "_no_split_modules")
    if wanted is None:
        if cfg.name in BUILT_IN_TARGETS:
            return BUILT_IN_TARGETS[cfg.name]
        model_type = getattr(getattr(model, "config", None), "model_type", None)
        from peft.utils import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as defaults

        if is_hf and model_type in defaults:
            return list(defaults[model_type])
        raise UserError(
            f"config error: model.lora.target_modules: there is no default for {cfg.name}; "
            f"name the layers that get adapters, e.g. [{', '.join(_linear_names(model)[:3])}], "
            f"or [{ALL_LINEAR}]"
        )
    if wanted == [ALL_LINEAR]:
        # peft finds a Hugging Face model's linear layers without its output head itself; for
        # any other model the head is the last linear layer, and a module trained in full is
        # not adapted as well.
        if is_hf:
            return ALL_LINEAR
        linear = _linear_names(model)[:-1]
        return [n for n in linear if not any(n == s or n.startswith(s + ".") for s in to_save)]
    _check_names(model, cfg, "target_modules", wanted)
    return list(wanted)


def _linear_names(model: nn.Module) -> list[str]:
    return [name for name, m in model.named_modules() if isinstance(m, nn.Linear)]


def _modules_to_save(model: nn.Module, cfg: ModelConfig, num_classes: int | None) -> list[str]:
    """model.lora.modules_to_save, checked; by default a classifier's head (the last linear
    layer with one output per class), which a fine-tune on other classes starts afresh."""
    wanted = cfg.lora.modules_to_save
    if wanted is not None:
        _check_names(model, cfg, "modules_to_save", wanted)
        return list(wanted)
    if not num_classes:
        return []
    heads = [
        name
        for name, m in model.named_modules()
        if isinstance(m, nn.Linear) and m.out_features == num_classes
    ]
    return heads[-1:]


def describe(cfg: ModelConfig, model: nn.Module) -> str:
    """For the banner: the adapters, and how much of the model trains."""
    targets = getattr(model, "peft_config", {}).get("default")
    where = sorted(targets.target_modules) if targets is not None else []
    shown = ", ".join(where) if isinstance(where, list) else str(where)
    total = sum(p.numel() for p in model.parameters())
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return (
        f"LoRA r={cfg.lora.r}, alpha {cfg.lora.alpha:g} on {shown}: {trained:,} of {total:,} "
        f"parameters train ({100 * trained / max(total, 1):.2f} %), the rest frozen"
    )
