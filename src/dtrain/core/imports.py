"""`package.module:function` import paths, the way users plug their own code into a config."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from types import ModuleType

from dtrain.core.errors import UserError


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
