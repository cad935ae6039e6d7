"""The run configuration: YAML plus dotted overrides into nested dataclasses, checked strictly.

Every problem is a `UserError` naming the key, raised before any process group exists and
before anything is written, so a bad config costs nothing.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Union

import yaml

from dtrain.errors import UserError
from dtrain.imports import is_import_path

Check = tuple[Callable[[Any], bool], str]


def _opt(
    default: Any, *, choices: tuple | None = None, check: Check | None = None, doc: str = ""
) -> Any:
    """A config field with its allowed values or a range check, used by `validate`."""
    meta = {"choices": choices, "check": check, "doc": doc}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)


POSITIVE: Check = (lambda v: v > 0, "must be > 0")
NON_NEGATIVE: Check = (lambda v: v >= 0, "must be >= 0")
AT_LEAST_ONE: Check = (lambda v: v >= 1, "must be >= 1")
FRACTION: Check = (lambda v: 0 <= v < 1, "must be in [0, 1)")


@dataclass
class RunConfig:
    name: str | None = _opt(
        None, doc="run directory name; default: the SLURM job id, else 'default'"
    )
    out_dir: str = _opt("runs", doc="parent of all run directories")
    seed: int = _opt(0, check=NON_NEGATIVE)
    private: bool = _opt(True, doc="run directories 0700 and files 0600")


@dataclass
class DistConfig:
    backend: str = _opt("auto", choices=("auto", "nccl", "gloo"))
    timeout_s: float = _opt(600.0, check=POSITIVE, doc="collective timeout while training")
    init_timeout_s: float = _opt(300.0, check=POSITIVE, doc="timeout for the start-up rendezvous")


@dataclass
class DDPConfig:
    bucket_cap_mb: float = _opt(25.0, check=POSITIVE)
    find_unused_parameters: bool = _opt(False)
    static_graph: bool = _opt(False)
    broadcast_buffers: bool = _opt(True)
    gradient_as_bucket_view: bool = _opt(
        True, doc="gradients are views into the all-reduce buckets: one copy of them, not two"
    )


@dataclass
class FSDPConfig:
    wrap: str | list = _opt("auto", doc="'auto' or a list of module class names")
    reshard_after_forward: bool = _opt(True)
    hybrid_replicas: int = _opt(1, check=AT_LEAST_ONE, doc="HSDP replica groups; 1 = plain FSDP")
    cpu_offload: bool = _opt(False)


@dataclass
class ParallelConfig:
    mode: str = _opt("ddp", choices=("ddp", "fsdp", "none"))
    sync_batchnorm: bool = _opt(False, doc="BatchNorm statistics over all ranks' batches")
    ddp: DDPConfig = field(default_factory=DDPConfig)
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)


@dataclass
class TaskConfig:
    name: str = _opt(
        "classification", doc="classification | language_model | model_loss | module:function"
    )
    args: dict = _opt({}, doc="keyword arguments for the task (the builder's config for a user's)")


@dataclass
class ModelConfig:
    name: str = _opt(
        "simple_cnn",
        doc="simple_cnn | resnet_small | transformer | gpt | tv:NAME | module:function",
    )
    num_classes: int | None = _opt(None, check=AT_LEAST_ONE, doc="default: from the dataset")
    args: dict = _opt({}, doc="keyword arguments for the model builder")
    activation_checkpointing: bool = _opt(False)
    compile: bool = _opt(False)
    channels_last: bool = _opt(False)
    init_from: str | None = _opt(
        None,
        doc="start from these weights: a dtrain checkpoint, an "
        "exported state_dict or a torchvision .pth file",
    )
    init_exclude: list = _opt([], doc="globs of weights not taken from init_from, e.g. [fc.*]")
    init_strict: bool = _opt(True, doc="every other weight must be in init_from, with its shape")
    pretrained: bool = _opt(
        False,
        doc="tv: models: torchvision's weights, from the torch hub "
        "cache (never downloaded at run time)",
    )


@dataclass
class SyntheticConfig:
    train_size: int = _opt(20000, check=AT_LEAST_ONE)
    val_size: int = _opt(2000, check=AT_LEAST_ONE)


@dataclass
class TextConfig:
    corpus: str | None = _opt(
        None,
        choices=(None, "python_docs"),
        doc="a built-in corpus instead of the text at data.root",
    )
    seq_len: int | None = _opt(
        None,
        check=AT_LEAST_ONE,
        doc="tokens a window predicts; default: model.args.seq_len, else 256",
    )
    stride: int | None = _opt(
        None,
        check=AT_LEAST_ONE,
        doc="training windows start every this many bytes; default seq_len",
    )
    val_fraction: float = _opt(
        0.1,
        check=(lambda v: 0 < v < 1, "must be in (0, 1)"),
        doc="the end of the text held out when there is no val file/folder",
    )


@dataclass
class DataConfig:
    name: str = _opt(
        "synthetic",
        doc="synthetic | cifar10 | mnist | fashion_mnist | imagefolder | text | module:function",
    )
    root: str = _opt("data")
    download: bool = _opt(False)
    batch_size: int = _opt(128, check=AT_LEAST_ONE, doc="per rank")
    eval_batch_size: int | None = _opt(None, check=AT_LEAST_ONE, doc="default: batch_size")
    num_workers: int | str = _opt(
        "auto",
        check=(lambda v: v == "auto" or (isinstance(v, int) and v >= 0), "must be auto or >= 0"),
        doc="loader processes per rank; auto: from the CPUs per rank",
    )
    persistent_workers: bool = _opt(True)
    augment: bool = _opt(True, doc="false: the validation transform for training too")
    drop_last: bool = _opt(True)
    image_size: int | None = _opt(
        None,
        check=AT_LEAST_ONE,
        doc="null: the images' own size when they share one small square size (<= 64 px), else 224",
    )
    transform: str = _opt(
        "auto",
        choices=("auto", "cifar", "imagenet", "none"),
        doc="auto: cifar for small native sizes, imagenet otherwise",
    )
    on_bad_sample: str = _opt(
        "error",
        choices=("error", "skip"),
        doc="an unreadable image: stop with exit 2, or use another sample",
    )
    synthetic: SyntheticConfig = field(default_factory=SyntheticConfig)
    text: TextConfig = field(default_factory=TextConfig)


@dataclass
class OptimConfig:
    name: str = _opt(
        "sgd",
        check=(
            lambda v: v in ("sgd", "adam", "adamw") or is_import_path(v),
            "must be sgd, adam, adamw or module:function",
        ),
    )
    lr: float = _opt(0.1, check=POSITIVE)
    weight_decay: float = _opt(5e-4, check=NON_NEGATIVE)
    no_decay: str | list = _opt(
        "auto",
        doc="parameters without weight decay: auto (biases, "
        "normalisation weights, embeddings), or globs",
    )
    momentum: float = _opt(0.9, check=FRACTION)
    nesterov: bool = _opt(False)
    betas: list = _opt([0.9, 0.999])
    eps: float = _opt(1e-8, check=POSITIVE)


@dataclass
class SchedConfig:
    name: str = _opt(
        "cosine",
        check=(
            lambda v: v in ("cosine", "step", "plateau", "none") or is_import_path(v),
            "must be cosine, step, plateau, none or module:function",
        ),
    )
    warmup_steps: int = _opt(0, check=NON_NEGATIVE)
    min_lr: float = _opt(0.0, check=NON_NEGATIVE, doc="cosine floor")
    step_size: int = _opt(1000, check=AT_LEAST_ONE, doc="step: decay every this many steps")
    gamma: float = _opt(0.1, check=POSITIVE, doc="step/plateau: decay factor")
    patience: int = _opt(2, check=NON_NEGATIVE, doc="plateau: evals without improvement")


@dataclass
class TrainConfig:
    epochs: int = _opt(10, check=AT_LEAST_ONE)
    max_steps: int | None = _opt(None, check=AT_LEAST_ONE, doc="optimizer steps; ends first wins")
    precision: str = _opt("fp32", choices=("fp32", "bf16", "fp16"))
    grad_accum: int = _opt(1, check=AT_LEAST_ONE)
    loss_scale_init: float = _opt(
        65536.0, check=POSITIVE, doc="fp16: the grad scaler's first scale"
    )
    clip_grad_norm: float | None = _opt(None, check=POSITIVE)
    log_every: int = _opt(50, check=AT_LEAST_ONE)
    check_every_steps: int = _opt(
        10,
        check=AT_LEAST_ONE,
        doc="the host waits for the device (and ranks agree on stop "
        "signals and non-finite steps) this often, and at records",
    )
    eval_every_epochs: int = _opt(1, check=NON_NEGATIVE, doc="0 = only at the end")
    eval_every_steps: int | None = _opt(None, check=AT_LEAST_ONE)
    nan_policy: str = _opt("stop", choices=("stop", "skip"))
    max_consecutive_skips: int = _opt(10, check=NON_NEGATIVE)
    detect_anomaly: bool = _opt(False)
    sync_debug: bool = _opt(
        False,
        doc="CUDA: warn at every host-device synchronisation of a "
        "step outside the checks (finds what makes steps wait)",
    )
    cudnn_benchmark: bool = _opt(False)
    deterministic: bool = _opt(False)
    overfit_batches: int = _opt(0, check=NON_NEGATIVE, doc="K > 0: train on the same K batches")


@dataclass
class CkptConfig:
    every_steps: int | None = _opt(None, check=AT_LEAST_ONE)
    every_epochs: int = _opt(1, check=NON_NEGATIVE, doc="0 = never at epoch ends")
    keep_last: int = _opt(3, check=AT_LEAST_ONE)
    keep_best: int = _opt(1, check=NON_NEGATIVE)
    monitor: str = _opt("val_acc")
    monitor_mode: str = _opt("max", choices=("max", "min"))
    resume: str = _opt("auto", doc="auto | none | PATH")
    resume_config_change: str = _opt(
        "refuse",
        choices=("refuse", "allow"),
        doc="resuming with a config that trains something else",
    )
    format: str = _opt("auto", choices=("auto", "full", "sharded"))
    async_: bool = _opt(False)


@dataclass
class ProfileConfig:
    enabled: bool = _opt(False)
    wait: int = _opt(1, check=NON_NEGATIVE)
    warmup: int = _opt(1, check=NON_NEGATIVE)
    active: int = _opt(3, check=AT_LEAST_ONE)


@dataclass
class LogConfig:
    tensorboard: bool = _opt(True)
    every_s: float = _opt(30.0, check=POSITIVE, doc="non-TTY progress lines at most this often")
    all_ranks: bool = _opt(False)
    progress: str = _opt("auto", choices=("auto", "bar", "lines"))
    profile: ProfileConfig = field(default_factory=ProfileConfig)


@dataclass
class SlurmConfig:
    requeue: bool = _opt(
        True,
        doc="after a stop signal's checkpoint, rank 0 requeues the "
        "running SLURM job (scontrol requeue)",
    )


@dataclass
class Config:
    run: RunConfig = field(default_factory=RunConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    sched: SchedConfig = field(default_factory=SchedConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    ckpt: CkptConfig = field(default_factory=CkptConfig)
    log: LogConfig = field(default_factory=LogConfig)
    slurm: SlurmConfig = field(default_factory=SlurmConfig)

    @property
    def run_dir(self) -> str:
        return os.path.join(self.run.out_dir, self.run.name or "default")


# ---------------------------------------------------------------------------------------------
# YAML keys and dataclass fields: a field named `async_` is the YAML key `async`.


def _key(f: dataclasses.Field) -> str:
    return f.name.rstrip("_")


def _fields(cls: type) -> dict[str, dataclasses.Field]:
    return {_key(f): f for f in dataclasses.fields(cls)}


def _field_types(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {_key(f): hints[f.name] for f in dataclasses.fields(cls)}


def all_keys(cls: type = Config, prefix: str = "") -> list[str]:
    """Every dotted key of the schema, e.g. 'optim.lr'."""
    keys = []
    for key, tp in _field_types(cls).items():
        if dataclasses.is_dataclass(tp):
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


def _unknown_key(dotted: str) -> UserError:
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
    if origin is Union:
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in (a for a in args if a is not type(None)):
            try:
                return _coerce(value, arg, dotted)
            except UserError as e:
                errors.append(e)
        names = " or ".join(_type_name(a) for a in args if a is not type(None))
        raise UserError(f"config error: {dotted}: expected {names}, got {value!r}")
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads "1e-3" as a string
            try:
                return float(value)
            except ValueError:
                pass
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
            raise _unknown_key(dotted)
        tp = types[key]
        if dataclasses.is_dataclass(tp):
            kwargs[fields[key].name] = _build(tp, value if value is not None else {}, dotted + ".")
        else:
            kwargs[fields[key].name] = _coerce(value, tp, dotted)
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


def _cross_checks(cfg: Config) -> None:
    """Rules that involve more than one key."""
    if len(cfg.optim.betas) != 2 or not all(isinstance(b, (int, float)) for b in cfg.optim.betas):
        raise UserError(f"config error: optim.betas: expected two numbers, got {cfg.optim.betas!r}")
    no_decay = cfg.optim.no_decay
    if (isinstance(no_decay, str) and no_decay != "auto") or (
        isinstance(no_decay, list) and not all(isinstance(g, str) for g in no_decay)
    ):
        raise UserError(
            f"config error: optim.no_decay: expected auto or a list of name globs, got {no_decay!r}"
        )
    if cfg.model.pretrained and not cfg.model.name.startswith("tv:"):
        raise UserError(
            f"config error: model.pretrained: only torchvision models (tv:NAME) have "
            f"pretrained weights here; use model.init_from=PATH for {cfg.model.name}"
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
    name = cfg.run.name
    if name is not None and (not name or name in (".", "..") or "/" in name):
        raise UserError(f"config error: run.name: {name!r} is not a plain directory name")
    from dtrain.tasks import builtin_metrics  # the tasks know what they report

    reported = builtin_metrics(cfg.task.name)
    if reported is not None and cfg.ckpt.monitor not in reported:
        close = difflib.get_close_matches(cfg.ckpt.monitor, reported, n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        raise UserError(
            f"config error: ckpt.monitor: '{cfg.ckpt.monitor}' is not a metric the "
            f"{cfg.task.name} task reports; use one of {', '.join(reported)}{hint}"
        )


# ---------------------------------------------------------------------------------------------
# Loading


def _read_yaml(path: str) -> dict:
    if not os.path.isfile(path):
        raise UserError(f"config error: config file '{path}' not found")
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except yaml.constructor.ConstructorError as e:
        mark = e.problem_mark
        raise UserError(
            f"config error: {path}:{mark.line + 1}:{mark.column + 1}: "
            f"{e.problem} (only plain YAML is allowed)"
        ) from None
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else path
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
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return key, value


def _set_dotted(data: dict, dotted: str, value: Any) -> None:
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
    data = _read_yaml(path) if path else {}
    for text in overrides:
        key, value = parse_override(text)
        _set_dotted(data, key, value)
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


# Keys that do not change what a run trains: where it runs and writes, how it logs, checkpoints
# and communicates, and how fast its data loads. A resumed run may change them freely; any other
# change needs ckpt.resume_config_change=allow.
NOT_TRAINING = (
    "run.name",
    "run.out_dir",
    "run.private",
    "log.",
    "ckpt.",
    "dist.",
    "slurm.",
    "data.num_workers",
    "data.persistent_workers",
)


def is_training_key(key: str) -> bool:
    return not any(key == k or (k.endswith(".") and key.startswith(k)) for k in NOT_TRAINING)


def training_part(data: dict) -> dict[str, Any]:
    """The flattened config without the keys of NOT_TRAINING."""
    return {k: v for k, v in flatten(data).items() if is_training_key(k)}


def training_differences(saved: dict, current: dict) -> list[str]:
    """'key: old -> new' for every training key that both configs have and that differs."""
    a, b = training_part(saved), training_part(current)
    return [
        f"{key}: {a[key]!r} -> {b[key]!r}"
        for key in sorted(a.keys() & b.keys())
        if a[key] != b[key]
    ]


def flatten(data: dict, prefix: str = "") -> dict[str, Any]:
    """{'optim': {'lr': 0.1}} -> {'optim.lr': 0.1}"""
    out: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, dict) and value and key != "args":
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[prefix + key] = value
    return out
