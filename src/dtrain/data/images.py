"""Image datasets: the built-in synthetic set, CIFAR-10, MNIST and Fashion-MNIST (held in memory as
uint8), and image folders (listed once, decoded sample by sample in the loader workers; reading a
file and what an unreadable one becomes are `decode`'s). The size images train at, their
transforms and their normalisation on the device are `transforms`' (which Hugging Face image
datasets, `hf`, share).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

from dtrain.config import DataConfig
from dtrain.core.errors import UserError
from dtrain.data import synthetic
from dtrain.data.decode import BadSample, SkipsBadSamples, bad_sample, decode
from dtrain.data.loaders import NO_SAMPLES, Datasets, Stacked
from dtrain.data.sampler import SampleKey, epoch_and_index, sample_random
from dtrain.data.transforms import (
    CROP_PADDING,
    HEADER_SAMPLE,
    IMAGENET_NORM,
    Normalize,
    Transform,
    choose_size,
    choose_transform,
)
from dtrain.process import dist

# ---------------------------------------------------------------------------------------------
# Images in memory


class ImageDataset(Dataset):
    """uint8 images (N, C, H, W) with labels, in memory; samples as uint8 through `transform`.

    Keys are an index, or (epoch, index) so that a training sample's augmentation is fixed by
    the epoch and the index alone.
    """

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, transform: Transform) -> None:
        self.images, self.labels, self.transform = images, labels, transform
        # The common case, CIFAR-style crops of images already at their size: padded once, so
        # that a whole batch of crops is one indexing operation.
        self._padded: torch.Tensor | None = None
        if (
            transform.kind == "cifar"
            and transform.train
            and images.shape[-1] == transform.size
            and images.shape[-2] == transform.size
        ):
            self._padded = F.pad(images, [CROP_PADDING] * 4)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, key: SampleKey) -> tuple[torch.Tensor, torch.Tensor]:
        epoch, index = epoch_and_index(key)
        return self.transform(self.images[index], epoch, index), self.labels[index]

    def __getitems__(self, keys: list[SampleKey]) -> Stacked:
        """A whole batch at once (the DataLoader calls this instead of __getitem__ per key)."""
        pairs = [epoch_and_index(key) for key in keys]
        index = torch.tensor([i for _, i in pairs], dtype=torch.long)
        if self._padded is not None:
            size = self.transform.size
            span = self._padded.shape[-1] - size + 1
            bits = [sample_random(self.transform.seed, epoch, i) for epoch, i in pairs]
            top = torch.tensor([b % span for b in bits])
            left = torch.tensor([(b >> 16) % span for b in bits])
            flip = torch.tensor([bool((b >> 32) & 1) for b in bits]).view(-1, 1, 1, 1)
            # Every crop of every image as a view (N, C, span, span, size, size): one indexing
            # operation copies out the batch's crops, the same as cifar_crop's.
            windows = self._padded.unfold(2, size, 1).unfold(3, size, 1)
            images = windows[index, :, top, left]
            images = torch.where(flip, images.flip(-1), images)
        elif (
            self.transform.kind in ("cifar", "none")
            and not self.transform.train
            and tuple(self.images.shape[-2:]) == (self.transform.size,) * 2
        ):
            images = self.images[index]
        else:
            images = torch.stack([self.transform(self.images[i], e, i) for e, i in pairs])
        return Stacked((images, self.labels[index]))


# ---------------------------------------------------------------------------------------------
# Image folders: listed once, decoded per sample


@dataclass
class Listing:
    """One split of an image folder: files relative to its root, their labels, the classes."""

    root: str
    files: list[str]
    labels: list[int]
    classes: list[str]

    def path(self, index: int) -> str:
        return os.path.join(self.root, self.files[index])

    def unreadable(self, index: int, error: BaseException) -> BadSample:
        return bad_sample(f"{self.path(index)} (class '{self.classes[self.labels[index]]}')", error)


class ImageFolderSet(SkipsBadSamples, Dataset):
    """An image folder's split, decoded sample by sample (in the loader workers): memory does not
    grow with the number of images. An unreadable image names its file and class; with
    data.on_bad_sample=skip the next readable image takes its place (deterministically) and the
    replacement is counted."""

    def __init__(self, listing: Listing, transform: Transform, skip_bad: bool) -> None:
        super().__init__(skip_bad, listing.root)
        self.listing, self.transform = listing, transform
        self.labels = torch.tensor(listing.labels, dtype=torch.long)

    def __len__(self) -> int:
        return len(self.listing.files)

    def _read(self, index: int) -> torch.Tensor:
        try:
            return decode(self.listing.path(index))
        except Exception as e:  # noqa: BLE001 - any failure to decode is a bad sample
            raise self.listing.unreadable(index, e) from None

    def __getitem__(self, key: SampleKey) -> tuple[torch.Tensor, torch.Tensor]:
        epoch, index = epoch_and_index(key)
        image, used = self.load(index, self._read)
        return self.transform(image, epoch, index), self.labels[used]

    def __getitems__(self, keys: list[SampleKey]) -> Stacked:
        samples = [self[key] for key in keys]
        return Stacked((torch.stack([s[0] for s in samples]), torch.stack([s[1] for s in samples])))


def list_split(root: str, split: str) -> tuple[Listing, list[str], list[str]]:
    """The images of `root/split/<class>/...` (recursively, hidden files and folders left out);
    also the other files left out and the empty class folders, for the banner."""
    from torchvision.datasets.folder import IMG_EXTENSIONS

    path = os.path.join(root, split)
    if not os.path.isdir(path):
        loose = _images_in(root, IMG_EXTENSIONS) if os.path.isdir(root) else []
        classes = (
            sorted(d.name for d in os.scandir(root) if d.is_dir() and not d.name.startswith("."))
            if os.path.isdir(root)
            else []
        )
        hint = ""
        if classes and split == "train" and "val" not in classes:
            hint = (
                f"; it has class folders ({', '.join(classes[:4])}) but no train/ and val/: "
                f"move them to {root}/train/<class>/ and put validation images in "
                f"{root}/val/<class>/"
            )
        elif loose:
            hint = f"; it has images directly in it (e.g. {loose[0]}), which need class folders"
        raise UserError(
            f"data error: image folder '{split}' not found under '{root}': expected "
            f"{path}/<class>/<image>{hint}"
        )
    classes = sorted(d.name for d in os.scandir(path) if d.is_dir() and not d.name.startswith("."))
    loose = _images_in(path, IMG_EXTENSIONS)
    if not classes:
        detail = f" but images directly in it (e.g. {loose[0]})" if loose else ""
        raise UserError(
            f"data error: {path} has no class folders{detail}: expected "
            f"{path}/<class>/<image>, one folder per class"
        )
    files, labels, other, empty = [], [], [], []
    for label, name in enumerate(classes):
        count = 0
        for folder, dirs, names in os.walk(os.path.join(path, name)):
            dirs[:] = sorted(d for d in dirs if not d.startswith("."))
            for file in sorted(names):
                if file.startswith("."):
                    continue
                relative = os.path.relpath(os.path.join(folder, file), path)
                if file.lower().endswith(IMG_EXTENSIONS):
                    files.append(relative)
                    labels.append(label)
                    count += 1
                else:
                    other.append(relative)
        if not count:
            empty.append(name)
    return Listing(path, files, labels, classes), other, empty


def _images_in(path: str, extensions: tuple) -> list[str]:
    return sorted(
        n
        for n in os.listdir(path)
        if n.lower().endswith(extensions) and os.path.isfile(os.path.join(path, n))
    )


def header_sizes(
    listing: Listing, skip_bad: bool, count: int = HEADER_SAMPLE
) -> list[tuple[int, int]]:
    """(width, height) from the headers of up to `count` files spread over the split: PIL
    reads a header without decoding the pixels. A file that is not an image is the same error
    as at its first use (or, with data.on_bad_sample=skip, left out of the sample)."""
    from PIL import Image

    step = max(1, len(listing.files) // count)
    sizes = []
    for index in range(0, len(listing.files), step)[:count]:
        try:
            with Image.open(listing.path(index)) as image:
                sizes.append(image.size)
        except Exception as e:  # noqa: BLE001 - not an image after all: say which file
            if not skip_bad:
                raise listing.unreadable(index, e) from None
    return sizes


# ---------------------------------------------------------------------------------------------
# Building the datasets


def build(cfg: DataConfig, seed: int, val_only: bool = False) -> Datasets:
    """The train and validation sets of a built-in image dataset or an image folder, what models
    need to know, lines for the banner, and the normalisation done on the device. `val_only`
    (evaluation): an image folder's val/ alone (the built-in sets come whole)."""
    if cfg.name == "imagefolder":
        return _image_folder(cfg, seed, val_only)
    loaders = {
        "synthetic": _synthetic,
        "cifar10": _cifar10,
        "mnist": _mnist,
        "fashion_mnist": _mnist,
    }
    (train_x, train_y), (val_x, val_y), num_classes, norm = loaders[cfg.name](cfg)
    native = train_x.shape[-1]
    size = cfg.image_size or native
    kind, why = choose_transform(cfg, size)
    train = ImageDataset(train_x, train_y, Transform(kind, size, cfg.augment, seed))
    val = ImageDataset(val_x, val_y, Transform(kind, size, False, seed))
    info = {"num_classes": num_classes, "in_channels": train_x.shape[1], "image_size": size}
    notes = [
        f"images {size}x{size} ({'their own size' if size == native else 'data.image_size'}), "
        f"transform {kind}: {train.transform.describe()} ({why})"
    ]
    return Datasets(train, val, info, notes, Normalize(*norm))


def _image_folder(cfg: DataConfig, seed: int, val_only: bool = False) -> Datasets:
    """Rank 0 lists the folder and reads a sample of headers; every rank gets its result (ranks
    never each walk a million files). `val_only` (evaluation): val/ alone, train/ need not
    exist."""
    splits = ("val",) if val_only else ("train", "val")

    def survey() -> tuple[dict[str, Listing], list[str], int, str]:
        listed = {split: list_split(cfg.root, split) for split in splits}
        found = {split: listing for split, (listing, _, _) in listed.items()}
        if not val_only and found["train"].classes != found["val"].classes:
            raise UserError(
                f"data error: {cfg.root}: train and val class folders differ "
                f"({found['train'].classes} vs {found['val'].classes})"
            )
        for split, listing in found.items():
            if not listing.files:
                raise UserError(
                    f"data error: {os.path.join(cfg.root, split)} has no images in its class "
                    f"folders"
                )
        notes = []
        for split, (_, other, _) in listed.items():
            if other:
                notes.append(
                    f"image folder {split}/: left out {len(other)} file(s) that are not "
                    f"images (e.g. {other[0]})"
                )
        for split, (_, _, empty) in listed.items():
            if empty:
                notes.append(
                    f"image folder {split}/: class folder(s) with no images: {', '.join(empty[:5])}"
                )
        skip = cfg.on_bad_sample == "skip"
        sizes = [] if cfg.image_size else [s for f in found.values() for s in header_sizes(f, skip)]
        size, why = choose_size(cfg, sizes)
        return found, notes, size, why

    found, notes, size, why = dist.on_main(survey)
    kind, kind_why = choose_transform(cfg, size)
    skip = cfg.on_bad_sample == "skip"
    val = ImageFolderSet(found["val"], Transform(kind, size, False, seed), skip)
    if val_only:
        train: Any = NO_SAMPLES
        counts = f"{len(val)} val images"
    else:
        train = ImageFolderSet(found["train"], Transform(kind, size, cfg.augment, seed), skip)
        counts = f"{len(train)} train / {len(val)} val images"
    classes = found["val"].classes
    notes.append(
        f"image folder {cfg.root}: {counts} in {len(classes)} classes (listed once, decoded per "
        f"sample)"
    )
    described = (train if not val_only else val).transform.describe()
    notes.append(f"images {size}x{size} ({why}), transform {kind}: {described} ({kind_why})")
    info = {"num_classes": len(classes), "in_channels": 3, "image_size": size}
    return Datasets(train, val, info, notes, Normalize(*IMAGENET_NORM))


def _synthetic(cfg: DataConfig) -> tuple:
    train = synthetic.generate(cfg.synthetic.train_size, "train")
    val = synthetic.generate(cfg.synthetic.val_size, "val")
    return train, val, len(synthetic.CLASSES), ((0.5, 0.5, 0.5), (0.25, 0.25, 0.25))


def _missing(what: str, where: str, expect: str) -> UserError:
    return UserError(
        f"data error: {what} not found under '{where}': {expect} "
        f"(or set data.download=true where the machine is online)"
    )


def _cifar10(cfg: DataConfig) -> tuple:
    from torchvision.datasets import CIFAR10

    try:
        train = CIFAR10(cfg.root, train=True, download=cfg.download)
        val = CIFAR10(cfg.root, train=False, download=cfg.download)
    except RuntimeError:
        raise _missing(
            "CIFAR-10", cfg.root, "put the extracted 'cifar-10-batches-py' folder there"
        ) from None

    def as_tensor(d):
        return (
            torch.from_numpy(d.data).permute(0, 3, 1, 2).contiguous(),  # noqa: E731
            torch.tensor(d.targets),
        )

    return (
        as_tensor(train),
        as_tensor(val),
        10,
        ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
    )


def _mnist(cfg: DataConfig) -> tuple:
    from torchvision.datasets import MNIST, FashionMNIST

    cls, folder = (MNIST, "MNIST") if cfg.name == "mnist" else (FashionMNIST, "FashionMNIST")
    try:
        train = cls(cfg.root, train=True, download=cfg.download)
        val = cls(cfg.root, train=False, download=cfg.download)
    except RuntimeError:
        raise _missing(folder, cfg.root, f"put the '{folder}/raw' files there") from None
    as_tensor = lambda d: (d.data.unsqueeze(1).contiguous(), d.targets.clone())  # noqa: E731
    return as_tensor(train), as_tensor(val), 10, ((0.5,), (0.25,))
