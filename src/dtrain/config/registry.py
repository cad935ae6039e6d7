"""One table per extension point: models, datasets, tasks, optimizers, schedules.

A table names what a config key may say (`model.name: gpt`) and which builder makes it, as a
'module:function' string imported only when the builder is used: checking a config against the
tables (before any process group) imports nothing heavy. The same tables dispatch (`builder`),
list what there is (`describe`, for `dtrain plan` and the docs) and say what a wrong name should
have been. Every key also takes a user's 'module:function'; its table's `user` builder imports it
and checks what it returns. A builder's arguments are the table's own (see each table).
"""

from __future__ import annotations

import difflib
import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from dtrain.core.errors import UserError
from dtrain.core.imports import TRUST_SWITCH, is_import_path

if TYPE_CHECKING:
    from dtrain.config.schema import Config

USER_PATH = "module:function"


@dataclass(frozen=True)
class Entry:
    target: str  # the builder, as 'module:function'
    doc: str = ""
    reports: tuple[str, ...] = ()  # tasks: what an evaluation reports, as val_<name>
    # What tells the size of what the builder makes without making it ('module:function'):
    # datasets, their lengths and `info` (the builder's arguments; none: the builder itself, for
    # a user's datasets); optimizers, their state per parameter (called with the optim config).
    sizes: str = ""
    free: str = "NAME"  # a prefix's entry: what follows the prefix, for messages (`tv:NAME`)


@dataclass(frozen=True)
class Table:
    key: str  # the config key that names an entry
    kind: str  # what an entry is, for messages
    entries: Mapping[str, Entry]
    user: Entry  # the builder of a user's 'module:function'
    # Names made of a prefix and a free part (`tv:resnet18`): the prefix's builder reads the name.
    prefixes: Mapping[str, Entry] = field(default_factory=dict)

    def forms(self) -> list[str]:
        """What the key accepts, for messages and listings: names, prefixed forms, user paths."""
        return [*self.entries, *(f"{p}{e.free}" for p, e in self.prefixes.items()), USER_PATH]

    def entry(self, name: str) -> Entry:
        """The entry that builds `name`, or a one-line UserError saying what would do."""
        if name in self.entries:
            return self.entries[name]
        for prefix, entry in self.prefixes.items():
            if name.startswith(prefix) and len(name) > len(prefix):
                return entry
        if is_import_path(name) and not any(name.startswith(p) for p in self.prefixes):
            return self.user
        close = difflib.get_close_matches(name, list(self.entries), n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        *names, last = self.forms()
        raise UserError(
            f"config error: {self.key}: unknown {self.kind} '{name}'; use one of "
            f"{', '.join(names)} or {last}{hint}"
        )

    def check(self, name: str) -> None:
        self.entry(name)

    def builder(self, name: str) -> Callable[..., Any]:
        """The function that builds `name` (imported now)."""
        return _imported(self.entry(name).target)

    def sizes(self, name: str) -> Callable[..., Any]:
        """The function that gives `name`'s sizes without building it, else its builder."""
        entry = self.entry(name)
        return _imported(entry.sizes or entry.target)


def _imported(target: str) -> Callable[..., Any]:
    module, _, attr = target.partition(":")
    return getattr(importlib.import_module(module), attr)


def _entries(target: str, docs: dict[str, str], sizes: str = "") -> dict[str, Entry]:
    return {name: Entry(target, doc, sizes=sizes) for name, doc in docs.items()}


# builder(cfg: ModelConfig, info: dict) -> nn.Module; `info` is what the datasets declare.
MODELS = Table(
    key="model.name",
    kind="model",
    entries={
        "simple_cnn": Entry("dtrain.models:build_simple_cnn", "a small CNN (GroupNorm)"),
        "resnet_small": Entry("dtrain.models:build_resnet_small", "a small ResNet for 32 px"),
        "transformer": Entry("dtrain.models:build_transformer", "a small vision transformer"),
        "gpt": Entry("dtrain.models:build_gpt", "a decoder-only language model"),
    },
    prefixes={
        "tv:": Entry("dtrain.models:build_torchvision", "a torchvision classifier"),
        "timm:": Entry("dtrain.models:build_timm", "a timm model (the 'timm' extra)"),
        "hf:": Entry(
            "dtrain.models.hf:build", "a Hugging Face model folder (or cached id)", free="PATH"
        ),
        "hf-config:": Entry(
            "dtrain.models.hf:build_from_config",
            "a Hugging Face architecture, fresh weights",
            free="PATH",
        ),
    },
    user=Entry("dtrain.models:build_user", "called with the model config"),
)

# builder(cfg: DataConfig, seed: int) -> data.Datasets; sizes: the same, of samples never read
DATASETS = Table(
    key="data.name",
    kind="dataset",
    entries={
        **_entries(
            "dtrain.data.images:build",
            {
                "synthetic": "coloured shapes, 10 classes, generated (offline)",
                "cifar10": "CIFAR-10 under data.root",
                "mnist": "MNIST under data.root",
                "fashion_mnist": "Fashion-MNIST under data.root",
                "imagefolder": "data.root/{train,val}/<class>/<image>",
            },
            sizes="dtrain.data.sizes:images",
        ),
        "text": Entry(
            "dtrain.data.text:build", "UTF-8 text as byte windows", sizes="dtrain.data.sizes:text"
        ),
        "tokens": Entry(
            "dtrain.data.mix:build",  # one folder (data/tokens.py), or a mix of them
            "token files (.bin, meta.json) as windows",
            sizes="dtrain.data.sizes:tokens",
        ),
        "hf": Entry(
            "dtrain.data.hf_store:build",
            "Hugging Face datasets on disk (saved, parquet) or saved to an object store",
            sizes="dtrain.data.sizes:hf",
        ),
    },
    user=Entry("dtrain.data.user:build", "returns (train_dataset, val_dataset)"),
)

# builder(cfg: TaskConfig, info: dict) -> tasks.Task
TASKS = Table(
    key="task.name",
    kind="task",
    entries={
        "classification": Entry(
            "dtrain.tasks:classification", "cross-entropy on (inputs, labels)", ("loss", "acc")
        ),
        "language_model": Entry(
            "dtrain.tasks:language_model",
            "next-token prediction on token windows",
            ("loss", "perplexity", "bits_per_byte"),
        ),
        "model_loss": Entry(
            "dtrain.tasks:model_loss", "the model computes its own loss", ("loss",)
        ),
    },
    user=Entry("dtrain.tasks:build_user", "returns an object with loss() and metrics()"),
)

# builder(param_groups: list[dict], cfg: OptimConfig) -> torch.optim.Optimizer
_SGD_STATE, _ADAM_STATE = "dtrain.loop.optim:sgd_state", "dtrain.loop.optim:adam_state"
OPTIMIZERS = Table(
    key="optim.name",
    kind="optimizer",
    entries={
        "sgd": Entry("dtrain.loop.optim:sgd", "SGD with momentum", sizes=_SGD_STATE),
        "adam": Entry("dtrain.loop.optim:adam", "Adam", sizes=_ADAM_STATE),
        "adamw": Entry(
            "dtrain.loop.optim:adamw", "AdamW (decoupled weight decay)", sizes=_ADAM_STATE
        ),
    },
    user=Entry(
        "dtrain.loop.optim:build_user_optimizer",
        "called with the groups and the config",
        sizes="dtrain.loop.optim:user_state",
    ),
)

# builder(optimizer, cfg: SchedConfig, *, base_lr, total_steps, monitor_mode) -> a schedule
SCHEDULES = Table(
    key="sched.name",
    kind="schedule",
    entries=_entries(
        "dtrain.loop.optim:LRSchedule",
        {
            "cosine": "warmup, then cosine to sched.min_lr",
            "step": "warmup, then x sched.gamma every sched.step_size steps",
            "plateau": "warmup, then x sched.gamma when the monitored metric stalls",
            "none": "warmup, then constant",
        },
    ),
    user=Entry("dtrain.loop.optim:UserSchedule", "returns a torch LRScheduler or alike"),
)

TABLES = (MODELS, DATASETS, TASKS, OPTIMIZERS, SCHEDULES)


def check_names(cfg: Config) -> None:
    """Every name the config gives an extension point is known (or a user's path)."""
    for table, name in (
        (MODELS, cfg.model.name),
        (DATASETS, cfg.data.name),
        (TASKS, cfg.task.name),
        (OPTIMIZERS, cfg.optim.name),
        (SCHEDULES, cfg.sched.name),
    ):
        table.check(name)


# The keys whose names a command that only reads a run builds: its model, data and task.
BUILT_BY_READERS = ("model.name", "data.name", "task.name")


def code_named(cfg: Config, keys: tuple[str, ...] = BUILT_BY_READERS) -> dict[str, Any]:
    """The code, not dtrain's, that building `keys` of the config runs: each user's
    'module:function' by its key, and `model.trust_remote_code` where it lets a model folder's
    own code run."""
    tables = {table.key: table for table in TABLES}
    named: dict[str, Any] = {}
    for key in keys:
        section, _, field_name = key.partition(".")
        name = getattr(getattr(cfg, section), field_name)
        if tables[key].entry(name) is tables[key].user:
            named[key] = name
    if "model.name" in keys and cfg.model.trust_remote_code:
        named["model.trust_remote_code"] = True
    return named


def refuse_code(named: dict[str, Any], source: str) -> None:
    """One line when a config that the user did not give in this command (`source`: a run's
    saved config.yaml, a checkpoint's) names code to run: it runs only with TRUST_SWITCH."""
    if named:
        shown = ", ".join(f"{key}: {value}" for key, value in named.items())
        raise UserError(
            f"config error: {source} names code to run ({shown}); code that a saved config "
            f"names runs only with {TRUST_SWITCH}"
        )


def builtin_metrics(task_name: str) -> tuple[str, ...] | None:
    """The validation metrics a built-in task reports (`val_<name>`), or None for a user's."""
    entry = TASKS.entries.get(task_name)
    return tuple(f"val_{m}" for m in entry.reports) if entry is not None else None


def describe() -> list[str]:
    """What each extension point offers, a line per key and one per entry."""
    lines = []
    for table in TABLES:
        lines.append(f"{table.key}: {', '.join(table.forms())}")
        for name, entry in {**table.entries, **table.prefixes}.items():
            shown = f"{name}{entry.free}" if name in table.prefixes else name
            lines.append(f"  {shown:<16} {entry.doc}")
        lines.append(f"  {USER_PATH:<16} {table.user.doc}")
    return lines
