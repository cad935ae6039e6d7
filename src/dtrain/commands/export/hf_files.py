"""What a Hugging Face folder holds besides its weights, as `dtrain export --format hf` writes
it: the source folder's tokenizer files and generation config, copied only from the folder itself;
the key/value cache setting as the source has it for use; which models have such a folder, and
--max-shard-size.
"""

from __future__ import annotations

import os
import shutil
from typing import Any

from dtrain import config
from dtrain.core.errors import UserError
from dtrain.models import hf

SHARD_SIZE = "2GB"  # each safetensors file at most this much (transformers 4's default)
# What a tokenizer is made of, across tokenizer classes: copied from the source folder if there.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "vocab.txt",
    "chat_template.jinja",
    "chat_template.json",
)
GENERATION_CONFIG = "generation_config.json"
# What an export copies from the source folder as it is.
COPIED_FILES = (*TOKENIZER_FILES, GENERATION_CONFIG)


def check_model(meta: dict) -> None:
    """Only a Hugging Face model has a Hugging Face folder: one line for any other; and only its
    folder's own files are copied (one line for a link out of it), before anything is written."""
    name = config.from_dict(meta["config"]).model.name
    if not name.startswith(hf.PREFIXES):
        raise UserError(
            f"export error: --format hf writes Hugging Face models (model.name: hf:PATH or "
            f"hf-config:PATH); this checkpoint's model is {name}: use --format safetensors"
        )
    source = hf.resolve(name)
    for file in COPIED_FILES:
        own_file(source, file)


def shard_bytes(size: str) -> int:
    """--max-shard-size in bytes: a number of bytes, or with a unit as transformers writes them
    (500MB, 5GB, 2GiB); one line for anything else."""
    from transformers.utils.hub import convert_file_size_to_int

    try:
        found = int(size) if size.isdigit() else convert_file_size_to_int(size)
    except ValueError:
        found = 0
    if found < 1:
        raise UserError(
            f"export error: --max-shard-size {size}: not a size; give bytes or a size such as "
            f"500MB or 5GB"
        )
    return int(found)


def restore_use_cache(model: Any, source: str) -> None:
    """The key/value cache, off while training, as the source folder has it for use."""
    saved_config = type(model.config).from_pretrained(
        source, local_files_only=True, trust_remote_code=False
    )
    if hasattr(saved_config, "use_cache"):
        model.config.use_cache = saved_config.use_cache


def own_file(source: str, name: str) -> str | None:
    """The file `name` of the model folder `source` (where it is read from), or None when the
    folder has no such regular file. A link to a file outside the folder is refused: an export
    never copies from outside the folder the user named. A snapshot of the Hugging Face cache
    (`models--ORG--NAME/snapshots/REV/`) links each file into the model's `blobs/`: that is
    the model's own folder in the cache."""
    path = os.path.join(source, name)
    if not os.path.lexists(path):
        return None
    folder = os.path.realpath(source)
    snapshots = os.path.dirname(folder)
    if os.path.basename(snapshots) == "snapshots":
        folder = os.path.dirname(snapshots)
    real = os.path.realpath(path)
    if os.path.commonpath([real, folder]) != folder:
        raise UserError(
            f"export error: {path} is a link to {real}, outside the model folder {source}; "
            f"an export copies only the folder's own files: put the file itself there"
        )
    return real if os.path.isfile(real) else None


def copy_from_folder(source: str, names: tuple[str, ...], out: str) -> list[str]:
    """Those of `names` that the model folder `source` holds (own_file), copied into `out`;
    returns their names. A copy is readable by no more than the original is (nor than the
    umask allows)."""
    copied = []
    for name in names:
        real = own_file(source, name)
        if real is None:
            continue
        mode = os.stat(real).st_mode & 0o666
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
        with (
            open(real, "rb") as src,
            open(os.open(os.path.join(out, name), flags, mode), "wb") as dst,
        ):
            shutil.copyfileobj(src, dst)
        copied.append(name)
    return copied


def copy_tokenizer(source: str, out: str) -> list[str]:
    """The source folder's tokenizer files, copied into `out`; returns their names."""
    return copy_from_folder(source, TOKENIZER_FILES, out)
