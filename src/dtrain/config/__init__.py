"""The run configuration: YAML plus dotted overrides into nested dataclasses, checked strictly.
The sections and keys are declared, with their docs, in `schema` (`data` and `model` in
their own modules).

Every problem is a `UserError` naming the key, raised before any process group exists and
before anything is written, so a bad config costs nothing.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import typing
from types import UnionType
from typing import Any, Union

import yaml

from dtrain.config.data import (
    MIX_METRICS,
    DataConfig,
    SyntheticConfig,
    TextConfig,
    check_mix,
    mix_names,
)
from dtrain.config.fields import number
from dtrain.config.model import LoraConfig, ModelConfig
from dtrain.config.plain_yaml import DuplicateKey
from dtrain.config.plain_yaml import load as load_yaml
from dtrain.config.schema import (
    DEFAULT_RUN_NAME,
    CkptConfig,
    Config,
    DDPConfig,
    DistConfig,
    EarlyStopConfig,
    EmaConfig,
    FSDPConfig,
    LogConfig,
    OptimConfig,
    ParallelConfig,
    ProfileConfig,
    RunConfig,
    SchedConfig,
    SlurmConfig,
    TaskConfig,
    TrainConfig,
)
from dtrain.core import urls
from dtrain.core.errors import UserError

# The schema (sections, keys, defaults, checks and docs) lives in schema.py; every name is
# re-exported here, so `dtrain.config` stays the one place to import the config from.
__all__ = [
    "DEFAULT_RUN_NAME",
    "CkptConfig",
    "Config",
    "DDPConfig",
    "DataConfig",
    "DistConfig",
    "EarlyStopConfig",
    "EmaConfig",
    "FSDPConfig",
    "LogConfig",
    "LoraConfig",
    "ModelConfig",
    "OptimConfig",
    "ParallelConfig",
    "ProfileConfig",
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
]


# ---------------------------------------------------------------------------------------------
# YAML keys and dataclass fields: a field named `async_` is the YAML key `async`.


def _key(f: dataclasses.Field) -> str:
    return f.name.rstrip("_")


def _fields(cls: type) -> dict[str, dataclasses.Field]:
    return {_key(f): f for f in dataclasses.fields(cls)}


def _field_types(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {_key(f): hints[f.name] for f in dataclasses.fields(cls)}


def _is_section(tp: Any) -> typing.TypeGuard[type]:
    """Whether a field's annotation is a nested section (a dataclass) rather than a value."""
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def all_keys(cls: type = Config, prefix: str = "") -> list[str]:
    """Every dotted key of the schema, e.g. 'optim.lr'."""
    keys = []
    for key, tp in _field_types(cls).items():
        if _is_section(tp):
            keys.extend(all_keys(tp, prefix + key + "."))
        else:
            keys.append(prefix + key)
    return keys


def _all_names() -> list[str]:
    """Every dotted key and every section, e.g. 'optim.lr', 'optim', 'parallel.fsdp'."""
    names = set(all_keys())
    for key in list(names):
        parts = key.split(".")
        names.update(".".join(parts[:i]) for i in range(1, len(parts)))
    return sorted(names)


def unknown_key(dotted: str) -> UserError:
    depth = dotted.count(".")
    same_depth = [n for n in _all_names() if n.count(".") == depth]
    close = difflib.get_close_matches(dotted, same_depth, n=1, cutoff=0.5)
    if not close:  # a misspelt leaf under a right section: compare the last part only
        leaf = dotted.rsplit(".", 1)[-1]
        by_leaf = {k.rsplit(".", 1)[-1]: k for k in all_keys()}
        close = [
            by_leaf[m] for m in difflib.get_close_matches(leaf, list(by_leaf), n=1, cutoff=0.6)
        ]
    hint = f" (did you mean '{close[0]}'?)" if close else ""
    return UserError(f"config error: unknown key '{dotted}'{hint}")


def _coerce(value: Any, tp: Any, dotted: str) -> Any:
    """Check `value` against the annotation `tp`; allow the conversions YAML users expect."""
    origin = typing.get_origin(tp)
    if origin in (Union, UnionType):  # Optional[X] and X | None alike
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in (a for a in args if a is not type(None)):
            try:
                return _coerce(value, arg, dotted)
            except UserError as e:
                errors.append(e)
        if len(errors) == 1:  # one type besides None: its own words (e.g. "must be finite")
            raise errors[0]
        names = " or ".join(_type_name(a) for a in args if a is not type(None))
        raise UserError(f"config error: {dotted}: expected {names}, got {value!r}")
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        parsed = number(value)  # also "1e-3", which YAML 1.1 reads as a string
        if parsed is not None and not math.isfinite(parsed):
            # No key means "forever" or "without limit" by inf: a run would end in NaN at its
            # first step or in an overflow deep inside (a timeout, a clock); null says "none".
            raise UserError(f"config error: {dotted}: must be a finite number, got {value!r}")
        if parsed is not None:
            return parsed
    elif tp is str:
        if isinstance(value, str):
            return value
    elif tp is list or origin is list:
        if isinstance(value, list):
            return value
    elif tp is dict or origin is dict:
        if isinstance(value, dict):
            return value
    raise UserError(f"config error: {dotted}: expected {_type_name(tp)}, got {value!r}")


def _type_name(tp: Any) -> str:
    return {
        bool: "true/false",
        int: "an integer",
        float: "a number",
        str: "a string",
        list: "a list",
        dict: "a mapping",
    }.get(tp, getattr(tp, "__name__", str(tp)))


def _build(cls: type, data: Any, prefix: str) -> Any:
    if not isinstance(data, dict):
        raise UserError(
            f"config error: {prefix.rstrip('.') or 'config'}: expected a mapping, got {data!r}"
        )
    fields = _fields(cls)
    types = _field_types(cls)
    kwargs = {}
    for key, value in data.items():
        dotted = prefix + str(key)
        if key not in fields:
            raise unknown_key(dotted)
        tp = types[key]
        if _is_section(tp):
            kwargs[fields[key].name] = _build(tp, value if value is not None else {}, dotted + ".")
        else:
            value = _coerce(value, tp, dotted)
            parse = fields[key].metadata.get("parse")  # numbers inside a list or mapping
            kwargs[fields[key].name] = parse(value) if parse and value is not None else value
    obj = cls(**kwargs)
    _validate(obj, prefix)
    return obj


def _validate(obj: Any, prefix: str) -> None:
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        dotted = prefix + _key(f)
        choices = f.metadata.get("choices")
        if choices and value not in choices:
            close = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            raise UserError(
                f"config error: {dotted}: '{value}' is not one of "
                f"{', '.join(map(str, choices))}{hint}"
            )
        check = f.metadata.get("check")
        if check and value is not None and not check[0](value):
            raise UserError(f"config error: {dotted}: {check[1]}, got {value!r}")


# torch's generators take seeds up to 2**64 - 1, and the run adds the rank (and 1) to its seed.
MAX_SEED = 2**63 - 1
# The datasets that read data.root in an object store (the others read a disk).
STORE_DATA = ("tokens", "hf")


def _cross_checks(cfg: Config) -> None:
    """Rules that involve more than one key."""
    from dtrain.config import registry  # the names extension points know (imports nothing heavy)

    registry.check_names(cfg)
    urls.check_location(cfg.run.out_dir, "run.out_dir")
    if cfg.ckpt.resume not in ("auto", "none"):
        urls.check_location(cfg.ckpt.resume, "ckpt.resume")
    if cfg.model.init_from:
        urls.check_location(cfg.model.init_from, "model.init_from")
    urls.check_options(cfg.run.storage_options)
    if cfg.log.mlflow.tracking_uri:
        urls.check_no_userinfo(
            cfg.log.mlflow.tracking_uri, "log.mlflow.tracking_uri", urls.MLFLOW_CREDENTIALS
        )
    if urls.is_url(cfg.data.root) and cfg.data.name not in STORE_DATA:
        urls.check_location(cfg.data.root, "data.root")
        raise UserError(
            f"config error: data.root: {cfg.data.root}: of an object store, dtrain reads token "
            f"files (data.name: tokens) and datasets saved by save_to_disk (data.name: hf); "
            f"data.name {cfg.data.name} reads a disk: copy it to a node-local folder first "
            f"(aws s3 sync {cfg.data.root} DIR) and set data.root=DIR"
        )
    if cfg.data.name in STORE_DATA:
        urls.check_location(cfg.data.root, "data.root")
    check_mix(cfg.data)
    betas = cfg.optim.betas
    if len(betas) != 2 or not all(
        isinstance(b, (int, float)) and not isinstance(b, bool) for b in betas
    ):
        raise UserError(f"config error: optim.betas: expected two numbers, got {betas!r}")
    if not all(0 <= b < 1 for b in betas):
        raise UserError(f"config error: optim.betas: each must be in [0, 1), got {betas!r}")
    if cfg.optim.nesterov and cfg.optim.momentum == 0:
        raise UserError(
            "config error: optim.nesterov: Nesterov momentum needs optim.momentum > 0; set "
            "one or drop optim.nesterov"
        )
    if cfg.run.seed > MAX_SEED:
        raise UserError(
            f"config error: run.seed: at most {MAX_SEED} (2**63 - 1), got {cfg.run.seed}"
        )
    no_decay = cfg.optim.no_decay
    if (isinstance(no_decay, str) and no_decay != "auto") or (
        isinstance(no_decay, list) and not all(isinstance(g, str) for g in no_decay)
    ):
        raise UserError(
            f"config error: optim.no_decay: expected auto or a list of name globs, got {no_decay!r}"
        )
    if cfg.model.pretrained and not cfg.model.name.startswith(("tv:", "timm:")):
        raise UserError(
            f"config error: model.pretrained: only torchvision and timm models (tv:NAME, "
            f"timm:NAME) have pretrained weights here; use model.init_from=PATH for "
            f"{cfg.model.name}"
        )
    if cfg.model.pretrained and cfg.model.init_from:
        raise UserError(
            "config error: model.pretrained and model.init_from both name starting "
            "weights; keep one"
        )
    wrap = cfg.parallel.fsdp.wrap
    if isinstance(wrap, str) and wrap != "auto":
        raise UserError(
            f"config error: parallel.fsdp.wrap: expected 'auto' or a list of class "
            f"names, got {wrap!r}"
        )
    if cfg.ckpt.resume not in ("auto", "none") and not cfg.ckpt.resume.strip():
        raise UserError("config error: ckpt.resume: expected auto, none or a checkpoint path")
    train = cfg.train
    if train.early_stop.patience is not None and not (
        train.eval_every_epochs or train.eval_every_steps
    ):
        raise UserError(
            "config error: train.early_stop.patience is set but nothing is evaluated during the "
            "run; set train.eval_every_epochs or train.eval_every_steps, or drop train.early_stop"
        )
    name = cfg.run.name
    if name is not None and (
        not name
        or name in (".", "..")
        or "/" in name
        or any(ord(c) < 32 or ord(c) == 127 for c in name)
    ):
        raise UserError(f"config error: run.name: {name!r} is not a plain directory name")
    from dtrain.config.registry import builtin_metrics  # what the built-in tasks report

    reported = builtin_metrics(cfg.task.name)
    if reported is not None and cfg.task.name == "language_model":  # a mix's, per source
        reported = (*reported, *(f"val_{m}_{n}" for n in mix_names(cfg.data) for m in MIX_METRICS))
    if reported is not None and train.ema.decay is not None and train.ema.eval:
        reported = (*reported, *(f"{m}_ema" for m in reported))  # the averaged weights' too
    if reported is not None and cfg.ckpt.monitor not in reported:
        close = difflib.get_close_matches(cfg.ckpt.monitor, reported, n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        raise UserError(
            f"config error: ckpt.monitor: '{cfg.ckpt.monitor}' is not a metric the "
            f"{cfg.task.name} task reports; use one of {', '.join(reported)}{hint}"
        )


# ---------------------------------------------------------------------------------------------
# Loading


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
    cfg = _build(Config, data, "")
    _cross_checks(cfg)
    return cfg


def to_dict(obj: Any) -> Any:
    """The config as plain data, with YAML key names (for config.yaml and checkpoints)."""
    if dataclasses.is_dataclass(obj):
        return {_key(f): to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, list):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj


def from_dict(data: dict) -> Config:
    """Rebuild a config from `to_dict` output (e.g. a checkpoint's), with the same checks."""
    cfg = _build(Config, data, "")
    _cross_checks(cfg)
    return cfg


def dump(cfg: Config) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)


def flatten(data: dict, prefix: str = "") -> dict[str, Any]:
    """{'optim': {'lr': 0.1}} -> {'optim.lr': 0.1}"""
    out: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, dict) and value and key != "args":
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[prefix + key] = value
    return out
