"""The header of a safetensors file, read and checked before any library opens the file.

The format (documented by its authors): 8 bytes, a little-endian length N; N bytes of JSON that
map each tensor's name to its `dtype`, `shape` and `data_offsets` (begin, end) in the bytes after
the header, plus an optional `__metadata__` of strings; then the tensors, end to end, covering
the rest of the file exactly. A file someone else made may say anything there: what the header
promises is checked here, so that a bad file is one line naming it and the tensor, not the
library's error (which names neither) or a read outside the file.
"""

from __future__ import annotations

import json
import math
import os
import struct
from typing import NamedTuple

# Bits per element of each dtype the format knows.
DTYPE_BITS = {
    "BOOL": 8,
    "F4": 4,
    "F6_E2M3": 6,
    "F6_E3M2": 6,
    "U8": 8,
    "I8": 8,
    "F8_E5M2": 8,
    "F8_E4M3": 8,
    "F8_E8M0": 8,
    "F8_E4M3FNUZ": 8,
    "F8_E5M2FNUZ": 8,
    "I16": 16,
    "U16": 16,
    "F16": 16,
    "BF16": 16,
    "I32": 32,
    "U32": 32,
    "F32": 32,
    "C64": 64,
    "F64": 64,
    "I64": 64,
    "U64": 64,
}
# safetensors refuses longer headers (and a header is JSON read whole into memory).
MAX_HEADER_BYTES = 100_000_000
METADATA = "__metadata__"


class Tensor(NamedTuple):
    dtype: str
    shape: tuple[int, ...]
    nbytes: int


class BadSafetensors(Exception):
    """Why a safetensors file cannot be read: the message names the file (and the tensor)."""


def read_header(path: str) -> dict[str, Tensor]:
    """The tensors of the safetensors file at `path`, by name, once its header is found to
    describe the file: every dtype known, every shape a list of sizes whose bytes are its byte
    range, the ranges end to end from the start of the data to the end of the file. Raises
    BadSafetensors naming the file and the tensor otherwise."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            start = f.read(8)
            if len(start) < 8:
                raise BadSafetensors(f"{path} is not a safetensors file ({size} bytes)")
            (length,) = struct.unpack("<Q", start)
            if length > min(size - 8, MAX_HEADER_BYTES):
                raise BadSafetensors(
                    f"{path} is truncated (its header runs past the end): download it again"
                )
            header = json.loads(f.read(length))
    except FileNotFoundError:
        raise BadSafetensors(f"{path} is missing: download the model again") from None
    except (OSError, ValueError):
        raise BadSafetensors(
            f"{path} is not a safetensors file (its header is not JSON: damaged, or not written "
            f"by safetensors)"
        ) from None
    if not isinstance(header, dict):
        raise BadSafetensors(f"{path} is not a safetensors file (its header is not a mapping)")
    tensors: dict[str, Tensor] = {}
    ranges: list[tuple[int, int, str]] = []
    for name, entry in header.items():
        if name == METADATA:
            continue
        tensor, begin, end = _entry(path, name, entry)
        tensors[name] = tensor
        ranges.append((begin, end, name))
    _check_layout(path, sorted(ranges), size, 8 + length)
    return tensors


def _entry(path: str, name: str, entry: object) -> tuple[Tensor, int, int]:
    """One tensor's entry, checked: its dtype, shape, byte count and byte range."""
    where = f"{path}: tensor {name!r}"
    if not isinstance(entry, dict):
        raise BadSafetensors(f"{where} has no dtype, shape and data_offsets")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if dtype not in DTYPE_BITS:
        raise BadSafetensors(f"{where} has dtype {dtype!r}, which safetensors does not know")
    if not isinstance(shape, list) or not all(_is_size(s) for s in shape):
        raise BadSafetensors(f"{where} has shape {shape!r}, not a list of sizes")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(_is_size(o) for o in offsets)
        or offsets[0] > offsets[1]
    ):
        raise BadSafetensors(f"{where} has data_offsets {offsets!r}, not [begin, end]")
    bits = math.prod(shape) * DTYPE_BITS[dtype]
    begin, end = offsets
    if bits % 8 or bits // 8 != end - begin:
        raise BadSafetensors(
            f"{where}: shape {shape} of {dtype} is {bits / 8:,g} bytes, its data_offsets "
            f"[{begin}, {end}] hold {end - begin:,}: the header contradicts itself"
        )
    return Tensor(str(dtype), tuple(shape), end - begin), begin, end


def _is_size(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _check_layout(path: str, ranges: list[tuple[int, int, str]], size: int, start: int) -> None:
    """The tensors' byte ranges (sorted) lie end to end from the data's `start` to the end of
    the file (`size` bytes)."""
    reached, last = 0, ""
    for begin, end, name in ranges:
        if begin < reached:
            raise BadSafetensors(
                f"{path}: tensor {name!r} at bytes [{begin}, {end}] overlaps tensor {last!r}"
            )
        if begin > reached:
            raise BadSafetensors(
                f"{path}: tensor {name!r} starts at byte {begin}, after a gap (the data before "
                f"it ends at {reached})"
            )
        reached, last = end, name
    if size < start + reached:
        raise BadSafetensors(
            f"{path} is truncated ({size:,} bytes of {start + reached:,}): download it again"
        )
    if size > start + reached:
        raise BadSafetensors(
            f"{path} has {size - start - reached:,} bytes after its last tensor: damaged, or not "
            f"written by safetensors"
        )
