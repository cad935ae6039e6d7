"""What `dtrain plan` knows of a dataset without reading a sample: its splits' lengths and what
models need (`info`), as `Datasets` whose samples are never read. One function per built-in
builder, named by its registry entry (`registry.DATASETS`, `sizes`); a user's datasets are
constructed, the only way to learn their sizes."""

from __future__ import annotations

from dtrain.config import DataConfig
from dtrain.data.loaders import Datasets

# The built-in torchvision datasets: (train, val, channels, image size, classes).
KNOWN_IMAGES = {
    "cifar10": (50000, 10000, 3, 32, 10),
    "mnist": (60000, 10000, 1, 28, 10),
    "fashion_mnist": (60000, 10000, 1, 28, 10),
}


class SizeOnly:
    """Stands in for a dataset of which plan needs the length only."""

    def __init__(self, size: int) -> None:
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: object) -> None:
        raise IndexError("dtrain plan reads no samples")


def _sized(train: int, val: int, info: dict, notes: list[str] | None = None) -> Datasets:
    return Datasets(train=SizeOnly(train), val=SizeOnly(val), info=info, notes=notes or [])


def text(cfg: DataConfig, seed: int) -> Datasets:
    """Windows counted from the files' sizes."""
    from dtrain.data import text as text_data

    seq_len = text_data.seq_len_of(cfg)
    train, val = text_data.window_counts(cfg, seq_len)
    return _sized(train, val, {"vocab_size": text_data.VOCAB_SIZE, "seq_len": seq_len})


def tokens(cfg: DataConfig, seed: int) -> Datasets:
    """Windows counted from meta.json and the files' sizes."""
    from dtrain.data import mix
    from dtrain.data import text as text_data

    train, val, info = mix.window_counts(cfg, text_data.seq_len_of(cfg))
    return _sized(train, val, info)


def hf(cfg: DataConfig, seed: int) -> Datasets:
    """Rows counted, columns checked, a sample of image headers read."""
    from dtrain.data import hf_store

    found = hf_store.survey(cfg, seed)
    return _sized(found.rows[0], found.rows[1], found.info, found.notes)


def images(cfg: DataConfig, seed: int) -> Datasets:
    """An image folder listed and a sample of its headers read (nothing decoded); the built-in
    sets by their known sizes. With the size and transform a run would choose, as a note."""
    from dtrain.data import images as image_data
    from dtrain.data import synthetic, transforms

    if cfg.name == "imagefolder":
        train_list, val_list = (image_data.list_split(cfg.root, s)[0] for s in ("train", "val"))
        skip = cfg.on_bad_sample == "skip"
        headers = (
            []
            if cfg.image_size
            else [
                *image_data.header_sizes(train_list, skip),
                *image_data.header_sizes(val_list, skip),
            ]
        )
        size, why = transforms.choose_size(cfg, headers)
        train, val, channels = len(train_list.files), len(val_list.files), 3
        classes = len(train_list.classes)
    else:
        known = KNOWN_IMAGES.get(cfg.name) or (
            cfg.synthetic.train_size,
            cfg.synthetic.val_size,
            3,
            synthetic.IMAGE_SIZE,
            len(synthetic.CLASSES),
        )
        train, val, channels, native_size, classes = known
        size = cfg.image_size or native_size
        why = "their own size" if size == native_size else "data.image_size"
    kind, kind_why = transforms.choose_transform(cfg, size)
    info = {"num_classes": classes, "in_channels": channels, "image_size": size}
    return _sized(
        train, val, info, [f"images {size}x{size} ({why}), transform {kind} ({kind_why})"]
    )
