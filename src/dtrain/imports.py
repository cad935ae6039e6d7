"""`package.module:function` import paths, the way users plug their own code into a config."""

from __future__ import annotations

import importlib
from collections.abc import Callable

from dtrain.errors import UserError


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
