"""Where the rows of a Hugging Face dataset (`data.name: hf`) are: a `save_to_disk` folder (a
Dataset, or a DatasetDict's splits) or parquet, arrow and JSON-lines files, each split a `Source`
opened as a memory-mapped `datasets.Dataset`; the rows held out for validation where there is no
validation split; and `datasets` itself, loaded offline."""

from __future__ import annotations

import glob
import json
import os
import re
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np

from dtrain.core.errors import UserError, first_line
from dtrain.core.imports import require

FORMATS = {".parquet": "parquet", ".arrow": "arrow", ".jsonl": "json", ".json": "json"}
VAL_SPLITS = ("validation", "valid", "val", "test")


def library() -> ModuleType:
    """`datasets`, offline and quiet: it never reaches for the hub (its own setting, not the
    environment's, which a user's model may read)."""
    lib = require("datasets", "hf", "data.name: hf")
    lib.config.HF_DATASETS_OFFLINE = lib.config.HF_HUB_OFFLINE = True
    lib.disable_progress_bars()
    lib.logging.set_verbosity_error()
    return lib


@dataclass(frozen=True)
class Source:
    """One split's rows: a `save_to_disk` folder of a Dataset, or data files."""

    name: str  # for messages: the folder, or the files
    folder: str | None = None
    files: tuple[str, ...] = ()

    def open(self) -> Any:
        """The split as a memory-mapped `datasets.Dataset`."""
        lib = library()
        try:
            if self.folder is not None:
                with open(os.path.join(self.folder, "state.json")) as f:
                    if not json.load(f).get("_data_files", True):  # saved with no rows at all
                        raise UserError(f"data error: {self.name}: the dataset has no rows")
                return lib.load_from_disk(self.folder)
            parts = []
            for kind in dict.fromkeys(FORMATS[_extension(f)] for f in self.files):
                files = [f for f in self.files if FORMATS[_extension(f)] == kind]
                if kind == "arrow":
                    parts += [lib.Dataset.from_file(f) for f in files]
                else:
                    parts.append(
                        lib.load_dataset(
                            kind, data_files=files, split="train", trust_remote_code=False
                        )
                    )
            return parts[0] if len(parts) == 1 else lib.concatenate_datasets(parts)
        except UserError:
            raise
        except Exception as e:  # noqa: BLE001 - whatever the library says, name the data
            raise UserError(f"data error: cannot read {self.name}: {first_line(e)}") from None


def _extension(path: str) -> str:
    return os.path.splitext(path)[1].lower()


def _split_of(path: str, root: str) -> str | None:
    """The split a data file's name or folder says (`train-0000.parquet`, `val/part.arrow`)."""
    for part in reversed(os.path.relpath(path, root).lower().split(os.sep)):
        word = re.split(r"[-_.]", part, maxsplit=1)[0]
        if word in ("train", *VAL_SPLITS):
            return word
    return None


def _files_source(files: list[str], root: str) -> Source:
    name = files[0] if len(files) == 1 else f"{root} ({len(files)} files)"
    return Source(name, files=tuple(files))


def sources(root: str) -> tuple[Source, Source | None]:
    """The training rows and the validation rows under `root` (None: hold some out)."""
    if os.path.isdir(root):
        if os.path.isfile(os.path.join(root, "dataset_dict.json")):
            with open(os.path.join(root, "dataset_dict.json")) as f:
                splits = json.load(f).get("splits", [])
            if "train" not in splits:
                raise UserError(
                    f"data error: {root}: a DatasetDict without a 'train' split (it has "
                    f"{', '.join(splits) or 'none'})"
                )
            val_split = next((s for s in VAL_SPLITS if s in splits), None)
            folder = os.path.join(root, "train")
            train_split = Source(folder, folder=folder)
            if val_split is None:
                return train_split, None
            val_folder = os.path.join(root, val_split)
            return train_split, Source(val_folder, folder=val_folder)
        if os.path.isfile(os.path.join(root, "state.json")):
            return Source(root, folder=root), None
        pattern, base = os.path.join(root, "**", "*"), root
    else:
        pattern, base = root, os.path.dirname(root.split("*")[0].split("?")[0]) or "."
    files = sorted(
        f
        for f in glob.glob(pattern, recursive=True)
        if _extension(f) in FORMATS and os.path.isfile(f)
    )
    if not files:
        raise UserError(
            f"data error: data.root '{root}' matches no save_to_disk folder and no .parquet, "
            f".arrow or .jsonl files"
        )
    named = {f: _split_of(f, base) for f in files}
    val_name = next((s for s in VAL_SPLITS if s in named.values()), None)
    if val_name is None:
        return _files_source(files, root), None
    val = [f for f in files if named[f] == val_name]
    train = [f for f in files if named[f] == "train"] or [
        f for f in files if named[f] not in VAL_SPLITS
    ]
    if not train:
        raise UserError(f"data error: data.root '{root}' has {val_name} files but no train files")
    return _files_source(train, root), _files_source(val, root)


def held_out_count(rows: int, fraction: float) -> int:
    """Rows held out for validation: `fraction` of them, at least one, and one left to train."""
    return min(rows - 1, max(1, round(rows * fraction)))


def held_out(rows: int, fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """The training rows and the validation rows when `fraction` of `rows` is held out: drawn
    with `seed`, each set in row order (reads follow the file)."""
    count = held_out_count(rows, fraction)
    chosen = np.random.Generator(np.random.PCG64(seed)).choice(rows, count, replace=False)
    is_val = np.zeros(rows, dtype=bool)
    is_val[chosen] = True
    dtype = np.int32 if rows < 2**31 else np.int64
    return np.flatnonzero(~is_val).astype(dtype), np.flatnonzero(is_val).astype(dtype)
