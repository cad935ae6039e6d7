"""What becomes of an image between its file and the model, for every image dataset (the image
datasets' own, and Hugging Face image columns): the size it is trained at, chosen from the
headers read; what a sample goes through before it is batched (`Transform`); and its
normalisation on the device (`Normalize`).

Every image reaches the device as uint8 and is normalised there: a quarter of the bytes of
float32 cross from host to device. A `Transform` is a pure function of (seed, epoch, sample
index), with torchvision's operations on uint8 tensors:

- `cifar`: pad 4 and a random crop back to the size, and a random horizontal flip;
- `imagenet`: RandomResizedCrop (scale 0.08-1, ratio 3/4-4/3) and a flip for training; for
  validation, resize the shorter side to size x 256/224 and crop the centre;
- `none`: resize to the size, nothing random.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from dtrain.config import DataConfig
from dtrain.data.sampler import sample_random

CROP_PADDING = 4
NATIVE_MAX = 64  # images this small (and all of one square size) keep their own size
HEADER_SAMPLE = 256  # image headers read per split to decide the size
IMAGENET_NORM = ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))


class Normalize:
    """(uint8 images, labels) -> (normalised float32 images, labels), applied on the device:
    (x - 255 mean) / (255 std), as two roundings (subtract, then multiply by the inverse). With
    `keys`, the batch is a dict and the images are its entries of those keys."""

    def __init__(
        self, mean: Sequence[float], std: Sequence[float], keys: Sequence[str] = ()
    ) -> None:
        channels = len(mean)
        self.mean = torch.tensor(mean, dtype=torch.float32).view(channels, 1, 1) * 255
        self.inv_std = 1.0 / (torch.tensor(std, dtype=torch.float32).view(channels, 1, 1) * 255)
        self.keys = tuple(keys)
        self._on: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def __call__(self, batch: Any) -> Any:
        if self.keys:
            return {**batch, **{key: self._normalize(batch[key]) for key in self.keys}}
        images, labels = batch
        return self._normalize(images), labels

    def _normalize(self, images: torch.Tensor) -> torch.Tensor:
        device = images.device
        if device not in self._on:
            self._on[device] = (self.mean.to(device), self.inv_std.to(device))
        mean, inv_std = self._on[device]
        return images.float().sub_(mean).mul_(inv_std)


class Transform:
    """What a sample goes through before it is batched (see the module's description)."""

    def __init__(self, kind: str, size: int, train: bool, seed: int) -> None:
        self.kind, self.size, self.train, self.seed = kind, size, train, seed

    def __call__(self, image: torch.Tensor, epoch: int, index: int) -> torch.Tensor:
        from torchvision.transforms.v2 import functional as TF

        size = self.size
        bits = sample_random(self.seed, epoch, index)
        if self.kind == "imagenet":
            if not self.train:
                return TF.center_crop(
                    TF.resize(image, [round(size * 256 / 224)], antialias=True), [size, size]
                )
            top, left, height, width = _resized_crop_params(image, bits)
            crop = TF.resized_crop(image, top, left, height, width, [size, size], antialias=True)
            return TF.horizontal_flip(crop) if (bits >> 63) & 1 else crop
        if tuple(image.shape[-2:]) != (size, size):
            image = TF.resize(image, [size, size], antialias=True)
        if self.kind == "cifar" and self.train:
            padded = F.pad(image, [CROP_PADDING] * 4)
            return cifar_crop(padded, bits, size)
        return image

    def describe(self) -> str:
        return {
            "cifar": "pad-4 random crop + flip",
            "none": "resize only, no augmentation",
            "imagenet": "RandomResizedCrop + flip; validation: resize + center crop",
        }[self.kind]


def cifar_crop(padded: torch.Tensor, bits: int, size: int) -> torch.Tensor:
    """A crop of `size` from an image padded by 4 on each side, and a flip, chosen by `bits`."""
    span = padded.shape[-1] - size + 1
    top, left, flip = bits % span, (bits >> 16) % span, (bits >> 32) & 1
    crop = padded[..., top : top + size, left : left + size]
    return crop.flip(-1) if flip else crop


def _resized_crop_params(image: torch.Tensor, bits: int) -> tuple[int, int, int, int]:
    """torchvision's RandomResizedCrop parameters, drawn from a generator seeded by the sample's
    own bits (not from the process's random state, which depends on the worker)."""
    from torchvision.transforms import RandomResizedCrop

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(bits & (2**63 - 1))
        return RandomResizedCrop.get_params(image, [0.08, 1.0], [3 / 4, 4 / 3])


def choose_size(cfg: DataConfig, sizes: list[tuple[int, int]]) -> tuple[int, str]:
    """The size images are trained at, and why."""
    if cfg.image_size:
        return cfg.image_size, "data.image_size"
    distinct = sorted(set(sizes))
    if len(distinct) == 1 and distinct[0][0] == distinct[0][1] and distinct[0][0] <= NATIVE_MAX:
        size = distinct[0][0]
        return size, f"the images' own size: every header read is {size}x{size}"
    shown = ", ".join(f"{w}x{h}" for w, h in distinct[:3]) + (", ..." if len(distinct) > 3 else "")
    return 224, (
        f"the default for images that are not all of one square size <= {NATIVE_MAX} px, "
        f"headers read: {shown}; set data.image_size to choose"
    )


def choose_transform(cfg: DataConfig, size: int) -> tuple[str, str]:
    """`auto`: CIFAR-style augmentation for small images (<= 64 px, typically at their own
    size), ImageNet-style for larger ones."""
    if cfg.transform != "auto":
        return cfg.transform, "data.transform"
    if size <= NATIVE_MAX:
        return "cifar", f"auto: trained at {size} px, <= {NATIVE_MAX}"
    return "imagenet", f"auto: trained at {size} px, above {NATIVE_MAX}"
