"""Image folders: loader throughput against torchvision's reference pipeline, and memory that does
not grow with the number of images.

- Throughput: train-loader images/s on a JPEG folder written by the benchmark (5,000 images of
  256x256), ImageNet-style transforms at 224, the same workers and batch size on both sides.
  dtrain: its image folder (decoded per sample with Pillow in the workers, uint8 crops) and the
  normalisation it does on the device (here the CPU, in the training process). Reference:
  torchvision's ImageFolder (Pillow's decoder too) + transforms.v2 RandomResizedCrop /
  RandomHorizontalFlip / ToImage / ToDtype / Normalize in the workers, and a DataLoader. Rounds
  alternate; medians.
- Memory: the largest rank's peak RSS of a 2-rank run (20 steps) on a folder of 64x64 JPEGs with
  2,000 and with 20,000 images.
- Small images learn: `configs/default.yaml` as it is (8 epochs) with only `data.name:
  imagefolder` and its root, on the built-in set's 22,000 images of 32x32 written as PNG files,
  2 ranks: the size it chose and the validation accuracy after each epoch.
"""

from __future__ import annotations

import re
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from common import Figure  # noqa: E402

BATCH, WORKERS, BATCHES = 64, 2, 40


def write_folder(root: Path, count: int, side: int, classes: int = 10, noise: float = 12,
                 suffix: str = "jpg") -> Path:
    """`count` images of side x side in root/{train,val}/<class>/ (a tenth of them in val): the
    built-in synthetic shapes, scaled to `side`, with `noise` added so that JPEGs compress like
    photographs rather than flat drawings."""
    import torch
    from PIL import Image
    from dtrain.data import synthetic
    if (root / "done").exists():
        return root
    for split, n in (("train", count - count // 10), ("val", count // 10)):
        images, labels = synthetic.generate(n, "train" if split == "train" else "val")
        gen = torch.Generator().manual_seed(n)
        for i in range(n):
            folder = root / split / f"class_{int(labels[i]) % classes}"
            folder.mkdir(parents=True, exist_ok=True)
            image = images[i]
            if side != image.shape[-1]:
                image = torch.nn.functional.interpolate(image[None].float(), size=(side, side),
                                                        mode="bilinear", align_corners=False)[0]
            if noise:
                image = (image + noise * torch.randn(image.shape, generator=gen)).clamp(0, 255)
            Image.fromarray(image.to(torch.uint8).permute(1, 2, 0).numpy()).save(
                folder / f"{i}.{suffix}", **({"quality": 90} if suffix == "jpg" else {}))
    (root / "done").touch()
    return root


def _images_per_s(loader, prepare) -> float:
    batches = iter(loader)
    prepare(next(batches))  # the workers' start-up is not the pipeline's speed
    started, images = time.perf_counter(), 0
    for _ in range(BATCHES):
        images += len(prepare(next(batches))[0])
    return images / (time.perf_counter() - started)


def dtrain_loader(root: Path) -> float:
    import torch
    from dtrain.config import DataConfig
    from dtrain.data import build, loaders, to_device
    cfg = DataConfig(name="imagefolder", root=str(root), batch_size=BATCH, image_size=224,
                     transform="imagenet", persistent_workers=False)
    sets = build(cfg, seed=0)
    train = loaders(sets.train, sets.val, cfg=cfg, seed=0, rank=0, world_size=1,
                    device=torch.device("cpu"), workers=WORKERS).train
    return _images_per_s(train, lambda batch: to_device(batch, torch.device("cpu"), sets.on_device))


def reference_loader(root: Path) -> float:
    import torch
    from torch.utils.data import DataLoader
    from torchvision.datasets import ImageFolder
    from torchvision.transforms import v2
    transform = v2.Compose([v2.RandomResizedCrop(224, antialias=True), v2.RandomHorizontalFlip(),
                            v2.ToImage(), v2.ToDtype(torch.float32, scale=True),
                            v2.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])])
    loader = DataLoader(ImageFolder(str(root / "train"), transform=transform), batch_size=BATCH,
                        shuffle=True, num_workers=WORKERS, drop_last=True)
    return _images_per_s(loader, lambda batch: batch)


def peak_rss(work: Path, root: Path, tag: str) -> int:
    run_dir = work / "runs" / tag
    return common.run_peak_rss(common.dtrain_cmd(
        run_dir, ["data.name=imagefolder", f"data.root={root}", "train.max_steps=20",
                  "data.batch_size=32", "data.num_workers=1", "log.tensorboard=false",
                  "ckpt.every_epochs=0", "train.eval_every_epochs=0"],
        nproc=2, config=str(common.REPO / "configs" / "default.yaml")))


def small_images_accuracy(work: Path) -> tuple[list[float], str, float]:
    """`configs/default.yaml` as it is (8 epochs), with only the data changed to a folder of the
    built-in set's 32x32 images written as PNG files: val_acc after each epoch, the banner's line
    on size, and the run's seconds."""
    root = write_folder(work / "png32", 22000, 32, noise=0, suffix="png")  # 19,800 + 2,200
    run_dir = work / "runs" / "small-images"
    started = time.perf_counter()
    common.run(common.dtrain_cmd(run_dir, ["data.name=imagefolder", f"data.root={root}"], nproc=2,
                                 config=str(common.REPO / "configs" / "default.yaml")),
               timeout=1800)
    seconds = time.perf_counter() - started
    accuracy = [r["val_acc"] for r in common.records(run_dir) if "val_acc" in r]
    size = re.search(r"images \d+x\d+ \([^)]*\)", (run_dir / "log.txt").read_text())
    return accuracy, size.group(0) if size else "no size line", seconds


def run(work: Path, rounds: int = 3) -> list[Figure]:
    import torch
    torch.set_num_threads(1)
    big = write_folder(work / "jpeg256", 5000, 256)
    ours, theirs = common.alternate(rounds, lambda i: dtrain_loader(big),
                                    lambda i: reference_loader(big))
    ratio = common.median(ours) / common.median(theirs)
    small = write_folder(work / "jpeg64_2k", 2000, 64)
    large = write_folder(work / "jpeg64_20k", 20000, 64)
    rss_small, rss_large = common.alternate(2, lambda i: peak_rss(work, small, f"2k-{i}"),
                                            lambda i: peak_rss(work, large, f"20k-{i}"))
    mib = 2**20
    small_peak, large_peak = common.median(rss_small), common.median(rss_large)
    accuracy, size, seconds = small_images_accuracy(work)
    return [
        Figure("image folder: loader images/s dtrain/torchvision", ratio, "x", ">= 1.0",
               f"{common.median(ours):.0f} vs {common.median(theirs):.0f} images/s (224 px, "
               f"{WORKERS} workers, batch {BATCH}); rounds: "
               f"{', '.join(f'{a:.0f}/{b:.0f}' for a, b in zip(ours, theirs))}"),
        Figure("image folder: peak RSS per rank 20k/2k images", large_peak / small_peak, "x",
               "<= 1.1", f"{large_peak / mib:.0f} vs {small_peak / mib:.0f} MiB (largest rank, "
               f"64 px JPEGs, 2 ranks, 20 steps)"),
        Figure("image folder: 32x32 PNGs, default config, final val accuracy", accuracy[-1], "",
               ">= 0.9", f"per epoch {', '.join(f'{a:.3f}' for a in accuracy)}; {size}; 2 ranks, "
               f"{seconds:.0f} s"),
    ]


if __name__ == "__main__":
    common.run_standalone(run)
