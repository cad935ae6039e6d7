"""Image folders at scale: listed once, decoded per sample in the loader workers, at their own size
when they are small, with torchvision's transforms drawn from each sample's own random bits, uint8
to the device, and unreadable files handled as the user chose."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import torch

from conftest import Result, dtrain, kill_then_resume, launch


def image_folder(root: Path, train: int = 24, val: int = 8, size: int = 32, ext: str = ".jpg",
                 sizes: tuple[int, ...] = ()) -> Path:
    """root/{train,val}/<class>/<n><ext>: the built-in synthetic shapes as image files, `train`
    and `val` per class, resized to `size` (or to each of `sizes` in turn)."""
    from PIL import Image
    from dtrain.data import synthetic
    for split, per_class in (("train", train), ("val", val)):
        images, labels = synthetic.generate(per_class * 10, split)
        for i in range(len(labels)):
            folder = root / split / synthetic.CLASSES[int(labels[i])]
            folder.mkdir(parents=True, exist_ok=True)
            side = sizes[i % len(sizes)] if sizes else size
            picture = Image.fromarray(images[i].permute(1, 2, 0).numpy())
            if side != 32:
                picture = picture.resize((side, side))
            picture.save(folder / f"{i}{ext}", quality=95)
    return root


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return image_folder(tmp_path_factory.mktemp("images") / "data")


def plan_lines(root: Path, *overrides: str) -> str:
    result = dtrain("plan", "data.name=imagefolder", f"data.root={root}", "data.batch_size=4",
                    *overrides)
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_small_images_keep_their_size_and_get_cifar_style_augmentation(folder) -> None:
    out = plan_lines(folder)
    assert "240 train / 80 val samples, 3x32x32 images, 10 classes" in out
    assert ("images 32x32 (the images' own size: every header read is 32x32), transform cifar "
            "(auto: trained at 32 px, <= 64)") in out


def test_larger_or_mixed_images_go_to_224_with_imagenet_transforms(tmp_path) -> None:
    mixed = image_folder(tmp_path / "mixed", train=2, val=1, sizes=(32, 40))
    out = plan_lines(mixed)
    assert ("images 224x224 (the default for images that are not all of one square size <= 64 "
            "px, headers read: 32x32, 40x40; set data.image_size to choose), transform imagenet "
            "(auto: trained at 224 px, above 64)") in out
    big = image_folder(tmp_path / "big", train=2, val=1, size=96)
    out = plan_lines(big)
    assert "images 224x224" in out and "headers read: 96x96" in out
    chosen = plan_lines(big, "data.image_size=64", "data.transform=cifar")
    assert "images 64x64 (data.image_size), transform cifar (data.transform)" in chosen


def test_transforms_are_torchvisions_and_a_pure_function_of_the_sample(folder) -> None:
    from torchvision.transforms.v2 import functional as TF
    from dtrain.data import Transform
    from dtrain.data.images import decode
    image = decode(str(next((folder / "train" / "circle").iterdir())))
    image = TF.resize(image, [64, 64], antialias=True)
    train = Transform("imagenet", 48, train=True, seed=5)
    a, b, c = train(image, 0, 7), train(image, 0, 7), train(image, 1, 7)
    assert a.dtype == torch.uint8 and a.shape == (3, 48, 48)
    assert torch.equal(a, b) and not torch.equal(a, c)  # (seed, epoch, index) decide, nothing else
    val = Transform("imagenet", 48, train=False, seed=5)(image, 3, 7)
    assert torch.equal(val, TF.center_crop(TF.resize(image, [round(48 * 256 / 224)]), [48, 48]))
    assert Transform("none", 32, train=True, seed=5)(image, 0, 0).shape == (3, 32, 32)


# ---------------------------------------------------------------------------------------------
# Decoding with Pillow: every mode to RGB uint8 (3, H, W), no deprecated torchvision decoder

@pytest.mark.parametrize("mode,suffix", [("RGB", ".jpg"), ("L", ".png"), ("RGBA", ".png"),
                                         ("LA", ".png"), ("P", ".png"), ("P", ".gif"),
                                         ("CMYK", ".jpg")])
def test_images_of_every_mode_decode_to_rgb_uint8(tmp_path, mode, suffix) -> None:
    import warnings

    import numpy as np
    from PIL import Image
    from dtrain.data.decode import decode
    pixels = np.random.default_rng(0).integers(0, 256, (10, 12, 3), dtype=np.uint8)  # 12 wide
    picture = Image.fromarray(pixels).convert(mode)
    path = tmp_path / f"image{suffix}"
    picture.save(path, **({"transparency": 0} if mode == "P" else {}))
    with Image.open(path) as saved:
        rgb = saved.convert("RGBA") if saved.mode == "P" else saved
        expected = torch.from_numpy(np.array(rgb.convert("RGB"))).permute(2, 0, 1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # Pillow's palette warning, torchvision's deprecation
        image = decode(str(path))
        from_bytes = decode(path.read_bytes())
    assert image.dtype == torch.uint8 and image.shape == (3, 10, 12)
    assert torch.equal(image, expected) and torch.equal(from_bytes, expected)


def test_pixel_arrays_become_rgb_uint8_whatever_their_layout() -> None:
    import numpy as np
    from dtrain.data.decode import from_array
    rgb = np.random.default_rng(0).integers(0, 256, (10, 12, 3), dtype=np.uint8)
    expected = torch.from_numpy(rgb).permute(2, 0, 1)
    assert torch.equal(from_array(rgb), expected)
    assert torch.equal(from_array(rgb.transpose(2, 0, 1)), expected)  # channels first
    rgba = np.concatenate([rgb, np.full((10, 12, 1), 7, np.uint8)], axis=-1)
    assert torch.equal(from_array(rgba), expected)  # alpha dropped
    grey = rgb[..., 0]
    for layout in (grey, grey[..., None], grey[None]):
        assert torch.equal(from_array(layout), torch.from_numpy(grey).expand(3, 10, 12))
    with pytest.raises(ValueError, match="pixel arrays must be uint8, not float32"):
        from_array(rgb.astype(np.float32))


def test_constructing_the_datasets_decodes_nothing(tmp_path, monkeypatch) -> None:
    """Every file is garbage with an image's name: listing works, the first use names the file."""
    from dtrain.config import DataConfig
    from dtrain.data import build, images
    root = tmp_path / "garbage"
    for split in ("train", "val"):
        for cls in ("a", "b"):
            (root / split / cls).mkdir(parents=True)
            for i in range(3):
                (root / split / cls / f"{i}.jpg").write_bytes(b"not an image")
    decoded = []
    monkeypatch.setattr(images, "decode", lambda path: decoded.append(path) or torch.zeros(3, 8, 8))
    cfg = DataConfig(name="imagefolder", root=str(root), image_size=32)
    sets = build(cfg, seed=0)
    assert len(sets.train) == 6 and len(sets.val) == 6 and decoded == []
    monkeypatch.undo()
    with pytest.raises(images.BadSample, match=r"cannot read image .*garbage/train/a/0.jpg \(class 'a'\)"):
        sets.train[(0, 0)]
    # Without data.image_size the header read of the listing already tells
    result = launch(tmp_path / "runs" / "r", ["data.name=imagefolder", f"data.root={root}"])
    assert result.returncode == 2
    assert "cannot read image" in result.stderr and "garbage/train/a/0.jpg (class 'a')" in result.stderr


def test_batches_reach_the_device_as_uint8(folder) -> None:
    from dtrain.config import DataConfig
    from dtrain.data import build, loaders, to_device
    cfg = DataConfig(name="imagefolder", root=str(folder), batch_size=8)
    sets = build(cfg, seed=0)
    batch = next(iter(loaders(sets.train, sets.val, cfg=cfg, seed=0, rank=0, world_size=1,
                              device=torch.device("cpu")).train))
    assert batch[0].dtype == torch.uint8 and batch[0].shape == (8, 3, 32, 32)
    images, labels = to_device(batch, torch.device("cpu"), sets.on_device)
    assert images.dtype == torch.float32
    mean = torch.tensor([0.485, 0.456, 0.406]).view(3, 1, 1) * 255
    std = torch.tensor([0.229, 0.224, 0.225]).view(3, 1, 1) * 255
    assert torch.allclose(images, (batch[0].float() - mean) / std, atol=1e-5)


@pytest.mark.parametrize("layout,message", [
    ("no_splits", "image folder 'train' not found under '{root}': expected {root}/train/<class>/<image>; "
                  "it has class folders (a, b) but no train/ and val/: move them to {root}/train/<class>/ "
                  "and put validation images in {root}/val/<class>/"),
    ("loose", "{root}/train has no class folders but images directly in it (e.g. 0.png): expected "
              "{root}/train/<class>/<image>, one folder per class"),
    ("classes_differ", "{root}: train and val class folders differ (['a', 'b'] vs ['a'])"),
])
def test_a_folder_not_laid_out_as_expected_says_how_to_fix_it(tmp_path, layout, message) -> None:
    from PIL import Image
    root = tmp_path / "data"
    picture = Image.new("RGB", (8, 8))
    if layout == "no_splits":
        for cls in ("a", "b"):
            (root / cls).mkdir(parents=True)
            picture.save(root / cls / "0.png")
    elif layout == "loose":
        for split in ("train", "val"):
            (root / split).mkdir(parents=True)
            picture.save(root / split / "0.png")
    else:
        for split, classes in (("train", ("a", "b")), ("val", ("a",))):
            for cls in classes:
                (root / split / cls).mkdir(parents=True)
                picture.save(root / split / cls / "0.png")
    result = launch(tmp_path / "runs" / "r", ["data.name=imagefolder", f"data.root={root}"])
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [f"dtrain: data error: {message.format(root=root)}"]


@pytest.fixture(scope="module")
def junk_folder_run(tmp_path_factory) -> Result:
    """One single-process run on a folder holding hidden files, other files and empty classes,
    with data.num_workers=auto: test_hidden_files_other_files_and_empty_classes_are_left_out_and_
    reported and test_workers_auto_is_said_in_the_banner read its output."""
    tmp = tmp_path_factory.mktemp("junk")
    root = image_folder(tmp / "data", train=2, val=1)
    (root / "train" / "circle" / ".DS_Store").write_bytes(b"junk")
    (root / "train" / "circle" / "notes.txt").write_text("not an image")
    (root / "train" / ".thumbnails").mkdir()
    (root / "train" / "zz_empty").mkdir()
    (root / "val" / "zz_empty").mkdir()
    return launch(tmp / "runs" / "r", ["data.name=imagefolder", f"data.root={root}",
                                       "data.batch_size=4", "data.num_workers=auto",
                                       "train.max_steps=2"])


def test_hidden_files_other_files_and_empty_classes_are_left_out_and_reported(
        junk_folder_run) -> None:
    result = junk_folder_run
    assert result.returncode == 0, result.stderr[-3000:]
    assert "image folder train/: left out 1 file(s) that are not images (e.g. circle/notes.txt)" in result.stderr
    assert "image folder train/: class folder(s) with no images: zz_empty" in result.stderr
    assert "20 train / 10 val images in 11 classes" in result.stderr


# ---------------------------------------------------------------------------------------------
# Unreadable images

def truncate_one(root: Path) -> Path:
    """Cut the 4th image of root/train/square short (a truncated JPEG): its path."""
    bad = root / "train" / "square" / sorted(os.listdir(root / "train" / "square"))[3]
    bad.write_bytes(bad.read_bytes()[:40])
    return bad


@pytest.fixture(scope="module")
def damaged(tmp_path_factory) -> tuple[Path, Path]:
    root = image_folder(tmp_path_factory.mktemp("damaged") / "data", train=8, val=2)
    return root, truncate_one(root)


@pytest.fixture(scope="module")
def skipped_killed_and_resumed(tmp_path_factory):
    """2 ranks on a JPEG folder with one truncated file and data.on_bad_sample=skip: one run
    straight through without loader workers, and one killed after step 10 with 2 workers per
    rank, then resumed. test_killed_and_resumed_on_a_jpeg_folder_with_workers_is_bit_exact
    compares the two; test_skipping_unreadable_images_is_deterministic_and_counted reads them as
    its runs with 0 and 2 workers (two 2-rank launches fewer than runs of its own)."""
    tmp = tmp_path_factory.mktemp("resume")
    root = image_folder(tmp / "data", train=40, val=4)
    bad = truncate_one(root)
    common = ["data.name=imagefolder", f"data.root={root}", "data.batch_size=8",
              "data.on_bad_sample=skip", "model.name=user_code:slow_cnn",
              "model.args={width: 8, sleep_s: 0.03}", "train.epochs=2", "ckpt.every_steps=5",
              "ckpt.keep_last=10"]
    straight = launch(tmp / "runs" / "straight", [*common, "data.num_workers=0"], nproc=2)
    killed_at, resumed = kill_then_resume(tmp / "runs" / "killed",
                                          [*common, "data.num_workers=2"], at_step=10)
    return bad, straight, killed_at, resumed


@pytest.mark.slow
def test_an_unreadable_image_stops_every_rank_with_one_line(damaged, tmp_path) -> None:
    root, bad = damaged
    result = launch(tmp_path / "runs" / "r", ["data.name=imagefolder", f"data.root={root}",
                                              "data.batch_size=4", "data.num_workers=1",
                                              "data.image_size=32", "ckpt.every_steps=2"], nproc=2)
    assert result.returncode != 0
    line = f"dtrain: data error: cannot read image {bad} (class 'square'): "
    assert result.stderr.count(line) == 1, result.stderr[-3000:]
    assert "data.on_bad_sample=skip" in result.stderr
    assert set(re.findall(r"exitcode\s*:\s*(-?\d+)", result.stderr)) == {"2"}
    checkpoints = result.run_dir / "checkpoints"
    assert not any(p.name.startswith(".tmp") for p in checkpoints.iterdir())
    for done in checkpoints.iterdir():  # the checkpoints before the bad batch are complete
        if done.is_dir():
            assert (done / "COMPLETE").exists()


@pytest.mark.slow
def test_skipping_unreadable_images_is_deterministic_and_counted(skipped_killed_and_resumed) -> None:
    bad, second, _, first = skipped_killed_and_resumed  # with 0 workers; 2 workers, resumed
    for result in (first, second):
        assert result.returncode == 0, result.stderr[-3000:]
        log = (result.run_dir / "log.txt").read_text() + (result.run_dir / "log.rank1.txt").read_text()
        assert f"cannot read image {bad}" in log and "skipped (data.on_bad_sample=skip)" in log
    assert first.losses() == second.losses()  # the same replacement with 0 or 2 workers
    replaced = [r.get("bad_samples_replaced", 0) for r in first.records() if "loss" in r]
    assert replaced[-1] >= 1  # counted (each epoch serves the bad file once, on one rank)


@pytest.mark.filterwarnings("ignore:This DataLoader will create")
def test_replacements_are_counted_by_any_number_of_loader_workers(damaged) -> None:
    """data.num_workers has no upper bound: workers 0 and 65 of 66 each replace the bad file,
    and the rank's count says 2; the rank itself replacing it once more makes 3."""
    from torch.utils.data import DataLoader
    from dtrain.config import DataConfig
    from dtrain.data import build, collate
    root, bad = damaged
    cfg = DataConfig(name="imagefolder", root=str(root), image_size=32, on_bad_sample="skip")
    train = build(cfg, seed=0).train
    bad_index = train.listing.files.index(str(bad.relative_to(root / "train")))
    good = (bad_index + 1) % len(train)
    workers = 66
    keys = [good] * (workers - 1) + [bad_index, bad_index]  # batch k goes to worker k % 66
    loader = DataLoader(train, batch_size=1, sampler=keys, num_workers=workers, collate_fn=collate,
                        prefetch_factor=1)
    labels = [int(labels[0]) for _, labels in loader]
    assert labels[-2:] == [train.listing.labels[good]] * 2  # the next readable image stood in
    assert train.replaced_count() == 2
    train[(0, bad_index)]
    assert train.replaced_count() == 3


# ---------------------------------------------------------------------------------------------
# Killed and resumed on a JPEG folder, with loader workers

@pytest.mark.slow
def test_killed_and_resumed_on_a_jpeg_folder_with_workers_is_bit_exact(
        skipped_killed_and_resumed) -> None:
    """A 2-rank run killed after step 10 with 2 loader workers per rank, then resumed, has the
    losses of the same run made straight through without workers: bitwise."""
    _, straight, killed_at, resumed = skipped_killed_and_resumed
    assert straight.returncode == 0, straight.stderr[-3000:]
    assert killed_at < 50
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stderr
    assert resumed.losses() == straight.losses()


@pytest.mark.slow
def test_workers_auto_is_said_in_the_banner(junk_folder_run) -> None:
    result = junk_folder_run
    assert result.returncode == 0, result.stderr[-3000:]
    cpus = len(os.sched_getaffinity(0))
    workers = max(0, min(8, cpus - 1))
    assert f"data.num_workers {workers} (auto: {cpus} CPU(s) for 1 rank(s) on this node" in result.stderr

