"""Reading image files, and what an unreadable one becomes.

`decode` turns a file into uint8 RGB; `bad_sample` is the one-line error that names the file and
its class; `ReplacedCount` counts the samples that data.on_bad_sample=skip replaced, over every
loader worker of a rank.
"""

from __future__ import annotations

import multiprocessing

import torch

from dtrain.errors import UserError, first_line


class BadSample(UserError):
    """An image that cannot be read. Raised in a loader worker, it reaches the training process
    re-created from the worker's traceback text: the original message is its last line."""

    def __init__(self, message: str) -> None:
        marker = f"{type(self).__name__}: "
        if "Original Traceback" in message and marker in message:
            message = message.rsplit(marker, 1)[1].strip().splitlines()[0]
        super().__init__(message)


def bad_sample(path: str, label: str, error: BaseException) -> BadSample:
    """The error for the image at `path`, of class `label`, that failed with `error`."""
    first = first_line(error)
    return BadSample(
        f"data error: cannot read image {path} (class '{label}'): {first}; remove "
        f"or replace it, or set data.on_bad_sample=skip"
    )


def decode(path: str) -> torch.Tensor:
    """An image file as uint8 RGB (3, H, W): torchvision's decoders where they apply (JPEG, PNG,
    GIF, WebP; about a quarter faster than PIL on JPEGs here), else PIL (other formats, or a
    torchvision without them)."""
    try:
        from torchvision.io import ImageReadMode, decode_image, read_file

        return decode_image(read_file(path), mode=ImageReadMode.RGB)
    except (ImportError, RuntimeError):
        pass
    from PIL import Image
    from torchvision.transforms.functional import pil_to_tensor

    with Image.open(path) as image:
        return pil_to_tensor(image.convert("RGB"))


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
