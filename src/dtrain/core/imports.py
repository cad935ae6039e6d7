"""`package.module:function` import paths, the way users plug their own code into a config; and
the code that a model folder names, which runs only when the user says so."""

from __future__ import annotations

import importlib
import json
import os
from collections.abc import Callable
from types import ModuleType

from dtrain.core.errors import UserError

# The command-line switch that lets a command run the code named by what it reads (a model
# folder's own code, a saved config's `module:function`), which it otherwise refuses.
TRUST_SWITCH = "--trust-remote-code"
TRUST_HELP = "run the code that the run's saved config or the model folder names (docs/trust.md)"
# The files in which a model folder names code of its own for transformers to import.
FOLDER_CODE_FILES = ("config.json", "tokenizer_config.json")


def is_import_path(name: str) -> bool:
    return ":" in name


def load_callable(spec: str, what: str) -> Callable:
    """'package.module:function' -> the function, with a clear error when it is not there.
    `what` names the config key for the message (e.g. 'model.name')."""
    module_name, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise UserError(f"config error: {what}: cannot import '{module_name}' ({e})") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise UserError(f"config error: {what}: '{module_name}' has no callable '{attr}'")
    return fn


def require(module: str, extra: str, feature: str) -> ModuleType:
    """`module`, imported; when it is not installed, one line naming the extra that brings it
    (a module that is there but fails to import is that module's own error)."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name != module.partition(".")[0]:
            raise
        raise UserError(
            f"missing dependency: {feature} needs the '{extra}' extra: "
            f"pip install 'dtrain[{extra}]'"
        ) from None


def folder_code(folder: str) -> list[str]:
    """The code of its own that a model folder names: transformers' `auto_map` in config.json or
    tokenizer_config.json (a custom architecture, config or tokenizer), as 'FILE: module.Class'
    each; [] for a folder that transformers' own classes load."""
    found = []
    for file in FOLDER_CODE_FILES:
        try:
            with open(os.path.join(folder, file), encoding="utf-8") as f:
                auto_map = json.load(f).get("auto_map")
        except (OSError, ValueError, AttributeError):
            continue  # absent, or not a JSON object: the loader's own line says what is wrong
        for value in auto_map.values() if isinstance(auto_map, dict) else [auto_map]:
            # A tokenizer's is [slow class, fast class], either of them may be null.
            refs = value if isinstance(value, list) else [value]
            found += [f"{file}: {ref}" for ref in refs if ref]
    return found


def refuse_folder_code(folder: str, what: str, switch: str) -> None:
    """One line (`what`: the message's start) when the model folder names code of its own:
    dtrain runs none unless the user says so with `switch`."""
    code = folder_code(folder)
    if code:
        raise UserError(
            f"{what}: {folder} names code of its own to run ({', '.join(code)}); dtrain runs a "
            f"model folder's code only with {switch}"
        )
