"""The `data` section of the config: datasets, their loaders and each source's own keys."""

from __future__ import annotations

import difflib
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field

from dtrain.config.fields import AT_LEAST_ONE, NON_NEGATIVE, number, option, read_number
from dtrain.core import urls
from dtrain.core.errors import UserError

# A mix's weights are kept to this resolution: the interleave repeats every MIX_PERIOD samples
# (data/mix.py), so no source may weigh less than one sample of a period.
MIX_PERIOD = 10_000
_MIX_KEYS = ("root", "weight", "name")
# What the language model task reports per source of a mix, as val_<metric>_<name> (tasks.py).
MIX_METRICS = ("loss", "share")
# A source's name goes into metric names (val_loss_<name>) and so into TensorBoard and MLflow.
_SOURCE_NAME = re.compile(r"[A-Za-z0-9_.-]+")


@dataclass(frozen=True)
class SyntheticConfig:
    """The built-in offline image set (`data.name: synthetic`)."""

    train_size: int = option(20000, check=AT_LEAST_ONE, doc="training images generated")
    val_size: int = option(2000, check=AT_LEAST_ONE, doc="validation images generated")


@dataclass(frozen=True)
class TextConfig:
    """Byte-level text (`data.name: text`)."""

    corpus: str | None = option(
        None,
        choices=(None, "python_docs"),
        doc="`python_docs`: the built-in corpus instead of the text at `data.root`",
    )
    seq_len: int | None = option(
        None,
        check=AT_LEAST_ONE,
        doc="bytes a window predicts; default: `model.args.seq_len`, else 256",
    )
    stride: int | None = option(
        None,
        check=AT_LEAST_ONE,
        doc="training windows start every this many bytes; default: `seq_len`",
    )
    val_fraction: float = option(
        0.1,
        check=(lambda v: 0 < v < 1, "must be in (0, 1)"),
        doc="the end of the text held out when there is no `val` file or folder",
    )


def _weights_read(mix: list) -> list:
    """A mix's entries with their weights read as numbers (`7e-1`, as other numbers are)."""
    return [
        {**entry, "weight": read_number(entry["weight"])}
        if isinstance(entry, dict) and "weight" in entry
        else entry
        for entry in mix
    ]


@dataclass(frozen=True)
class TokensConfig:
    """Token files (`data.name: tokens`): `train.bin` and `val.bin` (or `train_*.bin` and
    `val_*.bin` shards) under `data.root`, with the `meta.json` that `dtrain tokenize` writes;
    see [Token files](data.md#token-files)."""

    seq_len: int | None = option(
        None,
        check=AT_LEAST_ONE,
        doc="tokens a window predicts; default: `model.args.seq_len`, else 256",
    )
    stride: int | None = option(
        None,
        check=AT_LEAST_ONE,
        doc="training windows start every this many tokens; default: `seq_len`",
    )
    dtype: str | None = option(
        None,
        choices=(None, "uint16", "uint32"),
        doc="the files' token type, for a folder without `meta.json` (nanoGPT's: uint16)",
    )
    vocab_size: int | None = option(
        None,
        check=AT_LEAST_ONE,
        doc="the tokenizer's vocabulary, for a folder without `meta.json`; the `gpt` model's "
        "vocabulary comes from it",
    )
    cache_gib: float = option(
        16.0,
        check=NON_NEGATIVE,
        doc="token files in an object store (`data.root: s3://...`): a node-local copy when the "
        "folder is at most this large, else (and with 0) ranged reads",
    )
    mix: list | None = option(
        None,
        parse=_weights_read,
        doc="several token folders drawn by weight instead of `data.root`: a list of "
        "`{root, weight, name}` (name: default the folder's last path component); see "
        "[Mixing sources](data.md#mixing-sources)",
    )


def _column_map(value: dict) -> bool:
    return bool(value) and all(isinstance(k, str) and isinstance(v, str) for k, v in value.items())


@dataclass(frozen=True)
class HFConfig:
    """Hugging Face `datasets` on disk (`data.name: hf`): a `save_to_disk` folder, or parquet,
    arrow or JSON-lines files (a file, a folder or a glob) at `data.root`; see
    [Hugging Face datasets](data.md#hugging-face-datasets)."""

    columns: dict = option(
        {"input": "image", "target": "label"},
        check=(_column_map, "must map names to column names, e.g. {input: image, target: label}"),
        doc="name -> the dataset's column; the names `input` and `target` give (input, target) "
        "batches (classification), any other names dict batches of them (a user's task)",
    )
    val_fraction: float = option(
        0.1,
        check=(lambda v: 0 < v < 1, "must be in (0, 1)"),
        doc="the rows held out (drawn with `run.seed`) when there is no validation split",
    )


@dataclass(frozen=True)
class DataConfig:
    """Datasets and their loaders; see [Data and models](data.md)."""

    name: str = option(
        "synthetic",
        doc="a built-in dataset, or a user's `module:function` returning "
        "`(train_dataset, val_dataset)`",
    )
    root: str = option("data", doc="where datasets on disk are read from")
    download: bool = option(False, doc="let torchvision download cifar10/mnist (needs a network)")
    batch_size: int = option(128, check=AT_LEAST_ONE, doc="per rank")
    eval_batch_size: int | None = option(None, check=AT_LEAST_ONE, doc="default: `batch_size`")
    num_workers: int | str = option(
        "auto",
        check=(lambda v: v == "auto" or (isinstance(v, int) and v >= 0), "must be auto or >= 0"),
        doc="loader processes per rank; auto: one fewer than each rank's share of the CPUs "
        "(at most 8)",
    )
    persistent_workers: bool = option(True, doc="keep loader workers between epochs")
    augment: bool = option(True, doc="false: the validation transform for training too")
    drop_last: bool = option(
        True,
        doc="drop the incomplete last batch and the samples that do not divide over ranks "
        "(after a world-size change, only what a fresh epoch drops: "
        "[sample order](data.md#sample-order))",
    )
    image_size: int | None = option(
        None,
        check=AT_LEAST_ONE,
        doc="null: the images' own size when they share one square size <= 64 px, else 224",
    )
    transform: str = option(
        "auto",
        choices=("auto", "cifar", "imagenet", "none"),
        doc="auto: cifar up to 64 px, imagenet above (see [Image folders](data.md#image-folders))",
    )
    on_bad_sample: str = option(
        "error",
        choices=("error", "skip"),
        doc="an unreadable image stops the run (exit 2) or is replaced by the next readable one",
    )
    synthetic: SyntheticConfig = field(default_factory=SyntheticConfig)
    text: TextConfig = field(default_factory=TextConfig)
    tokens: TokensConfig = field(default_factory=TokensConfig)
    hf: HFConfig = field(default_factory=HFConfig)


def source_name(root: str) -> str:
    """A mix source's default name: the last path component of its folder (or URL)."""
    return root.rstrip("/").rsplit("/", 1)[-1]


def mix_names(cfg: DataConfig) -> list[str]:
    """The names of the mix's sources (none without a mix), as its metrics name them."""
    return [entry.get("name") or source_name(entry["root"]) for entry in cfg.tokens.mix or []]


def check_mix(cfg: DataConfig) -> None:
    """data.tokens.mix's entries: a mapping each, with a root data.root would accept, a
    positive weight of at least 1/MIX_PERIOD of the total, and a name of its own; never beside
    a data.root of its own (which of the two would be read?)."""
    mix = cfg.tokens.mix
    if mix is None:
        return
    if cfg.name != "tokens":
        raise UserError(
            f"config error: data.tokens.mix: mixes token folders (data.name: tokens), not "
            f"data.name {cfg.name}"
        )
    if not mix:
        raise UserError(
            "config error: data.tokens.mix: an empty list; give at least one {root, weight} "
            "or drop the key"
        )
    if cfg.root != DataConfig.root:
        raise UserError(
            f"config error: data.root ({cfg.root}) and data.tokens.mix both name the token "
            f"folders; keep one (a mix names its folders in its entries' root)"
        )
    names: dict[str, int] = {}
    for i, entry in enumerate(mix):
        key = f"data.tokens.mix[{i}]"
        if not isinstance(entry, dict):
            raise UserError(
                f"config error: {key}: expected a mapping {{root: FOLDER, weight: NUMBER}}, "
                f"got {entry!r}"
            )
        for unknown in (k for k in entry if k not in _MIX_KEYS):
            close = difflib.get_close_matches(str(unknown), _MIX_KEYS, n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            raise UserError(f"config error: unknown key '{key}.{unknown}'{hint}")
        for needed in ("root", "weight"):
            if needed not in entry:
                raise UserError(f"config error: {key}.{needed}: missing")
        root, weight, name = entry["root"], entry["weight"], entry.get("name")
        if not isinstance(root, str) or not root.strip():
            raise UserError(f"config error: {key}.root: expected a folder, got {root!r}")
        urls.check_location(root, f"{key}.root")
        if number(weight) is None or not 0 < weight < math.inf:
            raise UserError(
                f"config error: {key}.weight: must be a finite number > 0, got {weight!r}"
            )
        name = source_name(root) if name is None else name
        if not isinstance(name, str) or not _SOURCE_NAME.fullmatch(name):
            raise UserError(
                f"config error: {key}.name: {name!r} cannot name metrics (val_loss_<name>); "
                f"give the entry a name: of letters, digits, '_', '.' or '-'"
            )
        if name in names:
            raise UserError(
                f"config error: {key}.name: '{name}' names data.tokens.mix[{names[name]}] "
                f"too; give each source its own name: {{root: FOLDER, weight: NUMBER, name: NAME}}"
            )
        names[name] = i
    for i, share in enumerate(mix_shares([entry["weight"] for entry in mix])):
        if share * MIX_PERIOD < 1:
            raise UserError(
                f"config error: data.tokens.mix[{i}].weight: {mix[i]['weight']!r} is less than "
                f"1/{MIX_PERIOD} of the weights' total ({share:.2g} of it); raise it or drop "
                f"the source"
            )


def mix_shares(weights: Sequence[float]) -> list[float]:
    """The weights normalised to sum to 1, from their ratios to the largest: weights as large
    as 1e308 each have a total that overflows to inf, and every share would be 0."""
    top = max(weights)
    ratios = [w / top for w in weights]
    return [r / sum(ratios) for r in ratios]
