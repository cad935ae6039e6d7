"""Hugging Face `datasets` on disk (`data.name: hf`): a `save_to_disk` folder (a Dataset, or a
DatasetDict with `train` and `validation`/`valid`/`val`/`test`), or parquet, arrow or JSON-lines
files (`data.root`: a file, a folder, a glob), read by index from memory-mapped Arrow: nothing is
loaded whole; sampler, exact evaluation and bit-exact resume hold as for every dataset. Saved
folders and `.arrow` files are mapped where they lie; parquet and JSON lines are converted once by
rank 0 into the `datasets` cache (HF_DATASETS_CACHE). Nothing is downloaded.

`data.hf.columns` names the columns. With the names `input` and `target` (the default) a batch is
the (images, labels) pair of the image datasets; with other names a dict of them (tensors;
strings as lists), as a user's task takes it. Image columns (an `Image` feature, encoded bytes,
or as `input` uint8 arrays) are decoded in the loader workers, with the image folders' sizes,
transforms and normalisation. Without a validation split, `data.hf.val_fraction` of the rows,
drawn with run.seed, is held out. Where the rows are, and which are held out: data/hf_rows.py.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from dtrain.config import DataConfig
from dtrain.core.errors import UserError
from dtrain.data.decode import (
    SkipsBadSamples,
    arrow_pixels,
    bad_sample,
    decode,
    from_array,
    open_image,
)
from dtrain.data.hf_rows import Source, held_out, held_out_count, library, sources
from dtrain.data.loaders import Datasets, Stacked
from dtrain.data.sampler import SampleKey, epoch_and_index
from dtrain.data.transforms import (
    HEADER_SAMPLE,
    IMAGENET_NORM,
    Normalize,
    Transform,
    choose_size,
    choose_transform,
)
from dtrain.process import dist

# ---------------------------------------------------------------------------------------------
# What the columns hold


def _leaf(feature: Any) -> Any:
    """The innermost feature of a list feature (List, Sequence, LargeList), or the feature."""
    while hasattr(feature, "feature") and not isinstance(feature, dict):
        feature = feature.feature
    return feature


def _kind(lib: ModuleType, feature: Any, key: str) -> str:
    """How a column is read: `encoded` (an image feature or bytes, decoded here), `array`
    (uint8 pixels, as `input`), or `value` (tensors, or lists of strings)."""
    if isinstance(feature, lib.Image) or _describe(feature) in ("binary", "large_binary"):
        return "encoded"
    if key != "input":
        return "value"
    leaf = _leaf(feature)
    array = isinstance(feature, (lib.Array2D, lib.Array3D)) or leaf is not feature
    if array and getattr(leaf, "dtype", None) == "uint8":
        return "array"
    return "not an image"


def _describe(feature: Any) -> str:
    return getattr(feature, "dtype", None) or type(feature).__name__


@dataclass
class Survey:
    """What rank 0 finds out about the data before any rank reads a sample (and `dtrain plan`
    reports): where the splits are, how the columns are read, what models need to know."""

    train: Source
    val: Source | None  # None: `val_rows` of train held out
    rows: tuple[int, int]  # training and validation rows
    columns: dict[str, str]
    kinds: dict[str, str]  # per name: encoded | array | value
    pair: bool
    class_names: list[str] | None
    size: int = 0
    kind: str = "none"
    info: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


def survey(cfg: DataConfig, seed: int) -> Survey:
    """Checks the data (one line naming the file or key for what does not fit) and chooses
    the image size and transform; reads a sample of image headers, decodes nothing."""
    lib = library()
    columns = dict(cfg.hf.columns)
    train_source, val_source = sources(cfg.root)
    train = train_source.open()
    val = val_source.open() if val_source is not None else None
    splits = [(train_source, train)]
    if val_source is not None and val is not None:
        splits.append((val_source, val))
    for source, split in splits:
        _check_columns(source, split, columns)
    if val is None and len(train) < 2:
        raise UserError(
            f"data error: {train_source.name}: 1 row, too few to hold out "
            f"data.hf.val_fraction for validation"
        )
    kinds = {key: _kind(lib, train.features[column], key) for key, column in columns.items()}
    for key, kind in kinds.items():
        if kind == "not an image":
            raise UserError(
                f"data error: {train_source.name}: column '{columns[key]}' "
                f"(data.hf.columns.{key}) holds {_describe(train.features[columns[key]])}, not "
                f"images (an Image feature, encoded image bytes or uint8 arrays)"
            )
    pair = set(columns) == {"input", "target"}
    class_names = None
    info: dict[str, Any] = {}
    if "target" in columns:
        class_names, info["num_classes"] = _classes(lib, splits, columns["target"])
    if val is None:
        val_rows = held_out_count(len(train), cfg.hf.val_fraction)
        rows = (len(train) - val_rows, val_rows)
        where = f"val: data.hf.val_fraction {cfg.hf.val_fraction} held out, drawn with run.seed"
    else:
        assert val_source is not None  # a validation split comes from its own source
        rows = (len(train), len(val))
        where = f"val: {val_source.name}"
    batch = (
        f"batches of (input, target) from columns {columns['input']}, {columns['target']}"
        if pair
        else f"dict batches of {', '.join(f'{k}: {c}' for k, c in columns.items())}"
    )
    found = Survey(train_source, val_source, rows, columns, kinds, pair, class_names, info=info)
    found.notes.append(
        f"hf {train_source.name}: {rows[0]} train / {rows[1]} val rows ({where}); {batch}"
    )
    images = [key for key, kind in kinds.items() if kind != "value"]
    if images:
        skip = cfg.on_bad_sample == "skip"
        sizes = [] if cfg.image_size else _header_sizes(found, train, skip, images[0])
        found.size, why = choose_size(cfg, sizes)
        found.kind, kind_why = choose_transform(cfg, found.size)
        info.update(in_channels=3, image_size=found.size)
        described = Transform(found.kind, found.size, cfg.augment, seed).describe()
        found.notes.append(
            f"images {found.size}x{found.size} ({why}), transform {found.kind}: {described} "
            f"({kind_why})"
        )
    return found


def _check_columns(source: Source, split: Any, columns: dict[str, str]) -> None:
    """Every mapped column is there and has a value in every row; there are rows."""
    for key, column in columns.items():
        if column not in split.column_names:
            raise UserError(
                f"data error: {source.name}: no column '{column}' (data.hf.columns.{key}); its "
                f"columns: {', '.join(split.column_names)}"
            )
        nulls = split.data.column(column).null_count
        if nulls:
            raise UserError(
                f"data error: {source.name}: column '{column}' (data.hf.columns.{key}) is "
                f"empty (null) in {nulls} row(s)"
            )
    if len(split) == 0:
        raise UserError(f"data error: {source.name}: the dataset has no rows")


def _classes(
    lib: ModuleType, splits: list[tuple[Source, Any]], column: str
) -> tuple[list[str] | None, int]:
    """The class names (a ClassLabel's) and the number of classes of the target column."""
    import pyarrow.compute as pc

    feature = splits[0][1].features[column]
    names = list(feature.names) if isinstance(feature, lib.ClassLabel) else None
    high = -1
    for source, split in splits:
        dtype = _describe(split.features[column])
        if names is None and not re.fullmatch(r"u?int(8|16|32|64)", str(dtype)):
            raise UserError(
                f"data error: {source.name}: column '{column}' (data.hf.columns.target) holds "
                f"{dtype}, not integer class labels; encode them (Dataset.class_encode_column) "
                f"or map data.hf.columns.target to another column"
            )
        bounds = pc.min_max(split.data.column(column)).as_py()
        if bounds["min"] < 0:  # a ClassLabel's -1: a row without a label (test splits often)
            raise UserError(
                f"data error: {source.name}: column '{column}' (data.hf.columns.target) holds "
                f"negative labels ({bounds['min']}); class labels are 0, 1, ..."
            )
        high = max(high, bounds["max"])
    return names, len(names) if names is not None else int(high) + 1


def _header_sizes(found: Survey, train: Any, skip: bool, key: str) -> list:
    """(width, height) of up to HEADER_SAMPLE images spread over the training rows, from their
    headers (arrays: their shape)."""
    reader = HFSet(found, train, None, found.train.name, None, skip)
    step = max(1, len(train) // HEADER_SAMPLE)
    sizes = []
    for row in range(0, len(train), step)[:HEADER_SAMPLE]:
        try:
            sizes.append(reader.read_size(row, key))
        except UserError:
            if not skip:
                raise
    return sizes


# ---------------------------------------------------------------------------------------------
# Samples


class HFSet(SkipsBadSamples, Dataset):
    """One split: its rows (all, or the given ones) read by index, images decoded here (in the
    loader workers), as a pair (image, label) or a dict (see the module's description)."""

    def __init__(
        self,
        found: Survey,
        table: Any,
        rows: np.ndarray | None,
        where: str,
        transform: Transform | None,
        skip_bad: bool,
    ) -> None:
        """`rows`: the table's rows this split reads (None: all); `transform`: None for none."""
        super().__init__(skip_bad, where)
        lib = library()
        self.columns, self.kinds, self.pair = found.columns, found.kinds, found.pair
        self.class_names, self.transform, self.rows = found.class_names, transform, rows
        used = list(dict.fromkeys(self.columns.values()))
        table = table.select_columns(used)
        for column in used:
            if isinstance(table.features[column], lib.Image):
                table = table.cast_column(column, lib.Image(decode=False))
        arrays = [c for k, c in self.columns.items() if self.kinds[k] == "array"]
        plain = [c for k, c in self.columns.items() if self.kinds[k] == "value"]
        self.table = table.select_columns([c for c in used if c not in arrays]).with_format(
            "numpy", columns=plain, output_all_columns=True
        )
        # Pixel arrays as Arrow: the numpy formatter builds them from Python lists, ~500x slower.
        self.arrays = table.select_columns(arrays).with_format("arrow") if arrays else None

    def __len__(self) -> int:
        return len(self.rows) if self.rows is not None else len(self.table)

    def _row(self, index: int) -> int:
        return int(self.rows[index]) if self.rows is not None else index

    def _unreadable(self, row: int, key: str, values: dict, error: BaseException) -> UserError:
        label = ""
        if "target" in self.columns and key != "target":
            target = values[self.columns["target"]]
            label = f", class '{self.class_names[target] if self.class_names else target}'"
        return bad_sample(
            f"in row {row} of {self.where} (column '{self.columns[key]}'{label})", error
        )

    def _values(self, row: int) -> dict[str, Any]:
        values = dict(self.table[row])
        if self.arrays is not None:
            arrays = self.arrays[row]
            values.update((name, arrays.column(name)) for name in arrays.column_names)
        return values

    def _image(self, value: Any, kind: str) -> torch.Tensor:
        return from_array(arrow_pixels(value)) if kind == "array" else decode(value)

    def _read(self, index: int) -> dict[str, Any]:
        """The values of one row by name, images decoded."""
        row = self._row(index)
        values = self._values(row)
        out = {}
        for key, column in self.columns.items():
            value, kind = values[column], self.kinds[key]
            if kind == "value":
                out[key] = _tensor(value)
                continue
            try:
                out[key] = self._image(value, kind)
            except Exception as e:  # noqa: BLE001 - any failure to decode is a bad sample
                raise self._unreadable(row, key, values, e) from None
        return out

    def read_size(self, row: int, key: str) -> tuple[int, int]:
        """(width, height) of the image of `key` in `row`, from its header."""
        values = self._values(row)
        value = values[self.columns[key]]
        try:
            if self.kinds[key] == "array":
                height, width = from_array(arrow_pixels(value)).shape[-2:]
                return width, height
            with open_image(value) as image:
                return image.size
        except Exception as e:  # noqa: BLE001 - not an image after all: say which row
            raise self._unreadable(row, key, values, e) from None

    def __getitem__(self, key: SampleKey) -> Any:
        epoch, index = epoch_and_index(key)
        values, _ = self.load(index, self._read)
        for name, kind in self.kinds.items():
            if kind != "value" and self.transform is not None:
                values[name] = self.transform(values[name], epoch, index)
        return (values["input"], values["target"]) if self.pair else values

    def __getitems__(self, keys: list[SampleKey]) -> Any:
        samples = [self[key] for key in keys]
        if not self.pair:
            return samples  # the default collate stacks tensors and lists strings
        return Stacked((torch.stack([s[0] for s in samples]), torch.stack([s[1] for s in samples])))


def _tensor(value: Any) -> Any:
    """A column's value as the batch holds it: a tensor, or a string."""
    if isinstance(value, str):
        return str(value)
    return torch.tensor(np.asarray(value))


# ---------------------------------------------------------------------------------------------
# Building the datasets


def build(cfg: DataConfig, seed: int, found: Survey | None = None) -> Datasets:
    """The train and validation sets of `data.root`: rank 0 checks the data (and converts
    parquet / JSON lines into the cache), then every rank maps it. `found`: rank 0's survey,
    when it was made already."""
    if found is None:
        found = dist.on_main(lambda: survey(cfg, seed))
    train = found.train.open()
    skip = cfg.on_bad_sample == "skip"
    train_rows = val_rows = None
    val, val_where = train, found.train.name
    if found.val is None:
        train_rows, val_rows = held_out(len(train), cfg.hf.val_fraction, seed)
    else:
        val, val_where = found.val.open(), found.val.name
    augmented = Transform(found.kind, found.size, cfg.augment, seed)
    train_set = HFSet(found, train, train_rows, found.train.name, augmented, skip)
    val_transform = Transform(found.kind, found.size, False, seed)
    val_set = HFSet(found, val, val_rows, val_where, val_transform, skip)
    images = [key for key, kind in found.kinds.items() if kind != "value"]
    on_device = None
    if images:
        on_device = Normalize(*IMAGENET_NORM, keys=() if found.pair else images)
    return Datasets(train_set, val_set, found.info, list(found.notes), on_device)
