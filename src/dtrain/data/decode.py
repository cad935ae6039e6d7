"""Reading images, and what an unreadable one becomes.

`decode` turns a file or encoded bytes, and `from_array` a pixel array (`arrow_pixels`: one in an
Arrow column) into uint8 RGB (3, H, W), with Pillow (torchvision's decoders are deprecated);
`bad_sample` is the one-line error that names the image; `SkipsBadSamples` replaces an unreadable
sample by the next readable one when data.on_bad_sample=skip and counts it (`ReplacedCount`, over
every loader worker of a rank).
"""

from __future__ import annotations

import io
import multiprocessing
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from dtrain.core.errors import UserError, first_line


class BadSample(UserError):
    """An image that cannot be read. Raised in a loader worker, it reaches the training process
    re-created from the worker's traceback text: the original message is its last line."""

    def __init__(self, message: str) -> None:
        marker = f"{type(self).__name__}: "
        if "Original Traceback" in message and marker in message:
            message = message.rsplit(marker, 1)[1].strip().splitlines()[0]
        super().__init__(message)


def bad_sample(image: str, error: BaseException) -> BadSample:
    """The error for `image` (what names it: a file and its class, a row and its column) that
    failed with `error`."""
    return BadSample(
        f"data error: cannot read image {image}: {first_line(error)}; remove or replace it, "
        f"or set data.on_bad_sample=skip"
    )


def decode(image: str | bytes | dict) -> torch.Tensor:
    """An image file, encoded image bytes (PNG, JPEG, ...) or a `datasets` Image feature's
    {bytes, path} as uint8 RGB (3, H, W)."""
    with open_image(image) as opened:
        return _rgb_tensor(opened)


def open_image(image: str | bytes | dict) -> Any:
    """A Pillow image of `decode`'s argument: its header read, its pixels not yet decoded."""
    from PIL import Image

    data: Any = image
    if isinstance(image, dict):  # a `datasets` Image value: its bytes, else its file
        data = image["bytes"] if image.get("bytes") is not None else image.get("path")
    if isinstance(data, bytes) and data:
        return Image.open(io.BytesIO(data))
    if isinstance(data, str) and data:
        return Image.open(data)
    raise ValueError(f"no image data ({type(data).__name__})")


def from_array(pixels: Any) -> torch.Tensor:
    """uint8 pixels (H, W), (H, W, C) or (C, H, W) with C of 1, 3 or 4, as uint8 RGB (3, H, W):
    grey is repeated, alpha dropped (as Pillow converts)."""
    array = np.asarray(pixels)
    if array.dtype != np.uint8:
        raise ValueError(f"pixel arrays must be uint8, not {array.dtype}")
    if array.ndim == 3 and array.shape[0] in (1, 3, 4) and array.shape[-1] not in (1, 3, 4):
        array = array.transpose(1, 2, 0)  # channels first, as torch keeps images
    if array.ndim == 3 and array.shape[-1] == 1:
        array = array[..., 0]
    if array.ndim == 2:
        array = np.repeat(array[..., None], 3, axis=-1)
    if array.ndim != 3 or array.shape[-1] not in (3, 4):
        raise ValueError(f"pixel arrays must be (H, W), (H, W, C) or (C, H, W), not {array.shape}")
    return torch.from_numpy(np.array(array[..., :3])).permute(2, 0, 1)  # a copy: writable


def arrow_pixels(column: Any) -> np.ndarray:
    """One row's pixel array (nested lists, or an Array2D/3D) from its Arrow column: the numpy
    formatter of `datasets` builds it from Python lists, hundreds of times slower."""
    import pyarrow as pa
    import pyarrow.compute as pc

    array, shape = column.combine_chunks(), []
    array = array.storage if isinstance(array.type, pa.ExtensionType) else array
    while pa.types.is_list(array.type) or pa.types.is_fixed_size_list(array.type):
        lengths = pc.min_max(pc.list_value_length(array)).as_py()
        if lengths["min"] != lengths["max"]:
            raise ValueError("a ragged pixel array (rows of different lengths)")
        shape.append(lengths["max"])
        array = array.flatten()
    return array.to_numpy(zero_copy_only=False).reshape(shape)


def _rgb_tensor(image: Any) -> torch.Tensor:
    """A Pillow image as uint8 RGB (3, H, W): grey, palette, RGBA, CMYK, ... converted to RGB.
    The tensor is a channels-last view of the (H, W, 3) pixels, which torch's uint8 resizing
    takes as it is (no copy into planes)."""
    if image.mode == "P" and "transparency" in image.info:
        image = image.convert("RGBA")  # Pillow asks for this step (it warns on a direct RGB)
    if image.mode != "RGB":
        image = image.convert("RGB")
    return torch.from_numpy(np.array(image)).permute(2, 0, 1)


class ReplacedCount:
    """Samples replaced because they could not be read: one number in shared memory that the
    rank's loader workers add to and the rank reads.

    One counter behind a lock rather than a slot per worker: a dataset is made before anyone
    knows how many workers will load it (data.num_workers has no upper bound), and a replacement
    is rare enough that the lock costs nothing. Shared with the workers as they start (inherited
    or pickled by the DataLoader when it starts them).
    """

    def __init__(self) -> None:
        self._count = multiprocessing.Value("q", 0)

    def add(self) -> None:
        with self._count.get_lock():
            self._count.value += 1

    def total(self) -> int:
        # Read without the lock: a worker killed while holding it must not hang the rank, and an
        # aligned 64-bit read is never torn.
        return int(self._count.get_obj().value)


class SkipsBadSamples:
    """What an image dataset does with a sample it cannot read: with `skip_bad` false the
    BadSample stops the run; with it true the next readable sample (index+1, +2, ...) takes its
    place, deterministically, the unreadable one is logged once per process, and the
    replacement is counted (`replaced_count`, summed for the records)."""

    def __init__(self, skip_bad: bool, where: str) -> None:
        self.skip_bad, self.where = skip_bad, where
        self.replaced = ReplacedCount()
        self._warned: set[int] = set()

    def __len__(self) -> int:
        raise NotImplementedError

    def load(self, index: int, read: Callable[[int], Any]) -> tuple[Any, int]:
        """`read(index)`, or with skip_bad the first readable of index+1, +2, ...: what it
        read and the index it came from."""
        for offset in range(len(self)):
            candidate = (index + offset) % len(self)
            try:
                value = read(candidate)
            except BadSample as bad:
                if not self.skip_bad:
                    raise
                if candidate not in self._warned:
                    self._warned.add(candidate)
                    from dtrain.core.logs import log

                    log.warning(f"{bad} -- skipped (data.on_bad_sample=skip)")
                continue
            if offset:
                self.replaced.add()
            return value, candidate
        raise UserError(f"data error: no readable image in {self.where}")

    def replaced_count(self) -> int:
        return self.replaced.total()
