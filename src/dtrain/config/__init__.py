"""The run configuration: YAML plus dotted overrides into nested dataclasses, checked strictly.
The sections and keys are declared, with their docs, in `schema` (`data`, `model` and `log` in
their own modules); `build` makes the dataclasses from plain data and back, `checks` holds the
rules that involve more than one key. This module reads the YAML and the overrides.

Every problem is a `UserError` naming the key, raised before any process group exists and
before anything is written, so a bad config costs nothing.
"""

from __future__ import annotations

import os
from typing import Any

import yaml

from dtrain.config.build import all_keys, build, flatten, to_dict, unknown_key
from dtrain.config.checks import cross_checks
from dtrain.config.data import DataConfig, SyntheticConfig, TextConfig
from dtrain.config.log import LogConfig, ProfileConfig
from dtrain.config.model import LoraConfig, ModelConfig
from dtrain.config.parallel import (
    DDPConfig,
    FSDPConfig,
    ParallelConfig,
    PipelineConfig,
    ReplicasConfig,
    TensorParallelConfig,
)
from dtrain.config.plain_yaml import DuplicateKey
from dtrain.config.plain_yaml import load as load_yaml
from dtrain.config.schema import (
    DEFAULT_RUN_NAME,
    QAT_SCHEMES,
    QUANTIZATION_SCHEMES,
    CkptConfig,
    Config,
    DistConfig,
    EarlyStopConfig,
    EmaConfig,
    OptimConfig,
    QatConfig,
    RunConfig,
    SchedConfig,
    SlurmConfig,
    TaskConfig,
    TrainConfig,
)
from dtrain.core.errors import UserError

# The schema (sections, keys, defaults, checks and docs) lives in schema.py; every name is
# re-exported here, so `dtrain.config` stays the one place to import the config from.
__all__ = [
    "DEFAULT_RUN_NAME",
    "QAT_SCHEMES",
    "QUANTIZATION_SCHEMES",
    "CkptConfig",
    "Config",
    "DDPConfig",
    "ReplicasConfig",
    "DataConfig",
    "DistConfig",
    "EarlyStopConfig",
    "EmaConfig",
    "FSDPConfig",
    "PipelineConfig",
    "TensorParallelConfig",
    "LogConfig",
    "LoraConfig",
    "ModelConfig",
    "OptimConfig",
    "ParallelConfig",
    "ProfileConfig",
    "QatConfig",
    "RunConfig",
    "SchedConfig",
    "SlurmConfig",
    "SyntheticConfig",
    "TaskConfig",
    "TextConfig",
    "TrainConfig",
    "all_keys",
    "dump",
    "flatten",
    "from_dict",
    "load",
    "parse_override",
    "to_dict",
    "unknown_key",
]


def read_yaml(path: str) -> dict:
    if not os.path.isfile(path):
        raise UserError(f"config error: config file '{path}' not found")
    try:
        with open(path, encoding="utf-8") as f:
            data = load_yaml(f)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else path
        if isinstance(e, DuplicateKey):
            raise UserError(f"config error: {path}: {e}; give each key once") from None
        if isinstance(e, yaml.constructor.ConstructorError):
            raise UserError(
                f"config error: {where}: {e.problem} (only plain YAML is allowed)"
            ) from None
        raise UserError(f"config error: {where}: malformed YAML: {e.problem}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"config error: cannot read '{path}': {e}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise UserError(f"config error: {path}: expected a mapping of sections at the top")
    return data


def parse_override(text: str) -> tuple[str, Any]:
    """'optim.lr=0.1' -> ('optim.lr', 0.1); the value is read as a YAML scalar or list."""
    if "=" not in text:
        raise UserError(f"config error: override '{text}' is not of the form section.key=value")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key:
        raise UserError(f"config error: override '{text}' has no key")
    try:
        value = load_yaml(raw) if raw.strip() else ""
    except DuplicateKey as e:
        inner = f"{key}.{e.key}".replace(".[", "[")  # model.args.a, data.tokens.mix[0].weight
        raise UserError(
            f"config error: override '{text}': duplicate key '{inner}'; give each key once"
        ) from None
    except yaml.YAMLError:
        value = raw
    return key, value


def paths_and_overrides(words: list[str]) -> tuple[list[str], list[str]]:
    """A command's words: the paths among them and the `section.key=value` overrides. A word is
    a path when it has no '=', when a '/' comes before its first '=' (no key has one: a sweep's
    trial runs/lr_sweep/lr=0.3, an s3:// URL), or when a file or folder of that name exists (the
    trial lr=0.3 named from its sweep folder). So an override that is also a file's name here is
    a path, never silently both; quoting its value makes it an override again (run.name='x')."""

    def is_path(word: str) -> bool:
        key, pair, _ = word.partition("=")
        return not pair or "/" in key or os.path.exists(word)

    return [w for w in words if is_path(w)], [w for w in words if not is_path(w)]


def overrides_only(words: list[str], command: str, instead: str) -> list[str]:
    """The overrides of a command that takes no path among them; a path is one line."""
    paths, overrides = paths_and_overrides(words)
    if paths:
        raise UserError(
            f"usage error: '{paths[0]}' is no section.key=value override (a word without '=', "
            f"with a '/' before its '=' or naming an existing file is a path); dtrain {command} "
            f"{instead}"
        )
    return overrides


def set_dotted(data: dict, dotted: str, value: Any) -> None:
    node = data
    parts = dotted.split(".")
    for part in parts[:-1]:
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise UserError(f"config error: override '{dotted}': '{part}' is not a section")
        node = child
    node[parts[-1]] = value


def load(path: str | None = None, overrides: tuple[str, ...] | list[str] = ()) -> Config:
    """Read `path` (if given), apply `section.key=value` overrides, and check everything."""
    data = read_yaml(path) if path else {}
    for text in overrides:
        key, value = parse_override(text)
        set_dotted(data, key, value)
    cfg = build(Config, data)
    cross_checks(cfg)
    return cfg


def from_dict(data: dict) -> Config:
    """Rebuild a config from `to_dict` output (e.g. a checkpoint's), with the same checks."""
    cfg = build(Config, data)
    cross_checks(cfg)
    return cfg


def dump(cfg: Config) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)
