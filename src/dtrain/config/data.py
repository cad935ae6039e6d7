"""The `data` section of the config: datasets, their loaders and each source's own keys."""

from __future__ import annotations

from dataclasses import dataclass, field

from dtrain.config.fields import AT_LEAST_ONE, NON_NEGATIVE, option


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
