"""Data: the sampler, per-sample augmentation, the built-in dataset, and datasets from disk."""

from __future__ import annotations


import pytest
import torch
from torch.utils.data import DistributedSampler

from conftest import launch
from dtrain.data import synthetic
from dtrain.config import DataConfig, SyntheticConfig
from dtrain.data import EvalSampler, ImageDataset, ResumableSampler, Transform, build


@pytest.mark.parametrize("size,world,drop_last", [(103, 2, True), (103, 3, False), (64, 4, True)])
def test_sampler_order_equals_distributed_sampler(size, world, drop_last) -> None:
    data = list(range(size))
    for rank in range(world):
        ours = ResumableSampler(size, rank, world, seed=5, drop_last=drop_last)
        theirs = DistributedSampler(data, world, rank, shuffle=True, seed=5, drop_last=drop_last)
        for epoch in (0, 3):
            ours.set_epoch(epoch)
            theirs.set_epoch(epoch)
            assert [i for e, i in ours] == list(theirs) and len(ours) == len(theirs)
            assert all(e == epoch for e, _ in ours)


def test_sampler_length_is_computed_as_its_order_gives_it() -> None:
    """len() is computed without drawing the epoch's permutation (a million-image folder): it
    must equal the length of the order that iterating serves, split over the ranks, for every
    size, world size, tail rule and resume point."""
    for world in range(1, 6):
        for size in range(0, 23):
            for drop_last in (True, False):
                for consumed in range(0, 30, 3):
                    for rank in range(world):
                        sampler = ResumableSampler(size, rank, world, seed=2, drop_last=drop_last)
                        sampler.set_epoch(1, consumed)
                        assert len(sampler) == len(list(sampler)), \
                            (size, world, drop_last, consumed)


@pytest.mark.parametrize("before,after", [(2, 2), (2, 1), (1, 2), (2, 3)])
def test_resuming_mid_epoch_serves_each_remaining_sample_once(before, after) -> None:
    size, batch, steps = 96, 4, 5
    first = [i for r in range(before) for _, i in
             list(ResumableSampler(size, r, before, seed=1))[:steps * batch]]
    consumed = steps * batch * before
    rest = []
    for r in range(after):
        sampler = ResumableSampler(size, r, after, seed=1)
        sampler.set_epoch(0, consumed)
        rest.extend(i for _, i in sampler)
    # each sample at most once; only an uneven tail after a world-size change is dropped
    # (as drop_last drops it in any epoch)
    assert len(set(first + rest)) == len(first + rest)
    assert len(first + rest) == size - (size - consumed) % after


def test_eval_sampler_counts_every_sample_once() -> None:
    size, world = 10, 3
    samplers = [EvalSampler(size, r, world) for r in range(world)]
    assert {len(s) for s in samplers} == {4}  # equal batch counts on every rank
    valid = [i for s in samplers for i in list(s)[:s.valid_count]]
    assert sorted(valid) == list(range(size))


def test_augmentation_depends_only_on_seed_epoch_and_index() -> None:
    images, labels = synthetic.generate(20, "val")
    a = ImageDataset(images, labels, Transform("cifar", 32, True, 3))
    b = ImageDataset(images, labels, Transform("cifar", 32, True, 3))
    assert torch.equal(a[(2, 7)][0], b[(2, 7)][0])          # same key, same image, any order
    assert not torch.equal(a[(2, 7)][0], a[(3, 7)][0])      # another epoch, another crop/flip
    plain = ImageDataset(images, labels, Transform("cifar", 32, False, 3))
    assert plain[(2, 7)][0].shape == a[(2, 7)][0].shape == (3, 32, 32)


def test_synthetic_data_is_deterministic_balanced_and_not_linearly_separable() -> None:
    x, y = synthetic.generate(4000, "train")
    x2, y2 = synthetic.generate(4000, "train")
    assert torch.equal(x, x2) and torch.equal(y, y2)
    assert torch.bincount(y).tolist() == [400] * 10
    xv, yv = synthetic.generate(1000, "val")
    assert not torch.equal(xv[:100], x[:100])
    features = (x.float() / 255 - 0.5).flatten(1)
    val_features = (xv.float() / 255 - 0.5).flatten(1)
    torch.manual_seed(0)
    linear = torch.nn.Linear(features.shape[1], 10)
    opt = torch.optim.Adam(linear.parameters(), 1e-3)
    for _ in range(8):
        for i in range(0, len(features), 200):
            loss = torch.nn.functional.cross_entropy(linear(features[i:i + 200]), y[i:i + 200])
            opt.zero_grad()
            loss.backward()
            opt.step()
    accuracy = (linear(val_features).argmax(1) == yv).float().mean().item()
    assert accuracy < 0.4, accuracy  # a CNN reaches > 0.9 (README); pixels alone do not


@pytest.mark.parametrize("name,expected", [("cifar10", "CIFAR-10 not found"), ("mnist", "MNIST not found"),
                                           ("imagefolder", "image folder 'train' not found")])
def test_missing_dataset_is_a_clear_error(tmp_path, name, expected) -> None:
    result = launch(tmp_path / "runs" / "r", [f"data.name={name}", f"data.root={tmp_path / 'data'}"])
    assert result.returncode == 2
    assert expected in result.stderr and "Traceback" not in result.stderr


def test_dataset_helpers_report_sizes() -> None:
    cfg = DataConfig(synthetic=SyntheticConfig(train_size=50, val_size=20))
    sets = build(cfg, seed=0)
    assert (len(sets.train), len(sets.val)) == (50, 20)
    assert sets.info == {"num_classes": 10, "in_channels": 3, "image_size": 32}


def test_imagefolder_trains(tmp_path) -> None:
    from PIL import Image
    gen = torch.Generator().manual_seed(0)
    for split in ("train", "val"):
        for cls in ("cats", "dogs"):
            folder = tmp_path / "data" / split / cls
            folder.mkdir(parents=True)
            for i in range(8):
                pixels = (torch.rand(20, 24, 3, generator=gen) * 255).to(torch.uint8).numpy()
                Image.fromarray(pixels).save(folder / f"{i}.png")
    result = launch(tmp_path / "runs" / "r", ["data.name=imagefolder", f"data.root={tmp_path / 'data'}",
                                              "data.image_size=16", "data.batch_size=4"])
    assert result.returncode == 0, result.stderr[-3000:]
    assert len(result.losses()) == 4 and result.evals()[-1]["val_acc"] >= 0


def test_user_model_and_dataset_by_import_path(tmp_path) -> None:
    served = tmp_path / "served"
    served.mkdir()
    result = launch(tmp_path / "runs" / "r", ["model.name=user_code:slow_cnn",
                                              "model.args={width: 4, sleep_s: 0}",
                                              "data.name=user_code:served_synthetic"],
                    env={"SERVED_DIR": str(served)})
    assert result.returncode == 0, result.stderr[-3000:]
    assert len(result.losses()) == 512 // 16
    assert sum(len(f.read_text().split()) for f in served.iterdir()) == 512


@pytest.mark.parametrize("override,expected", [
    ("model.name=user_code:nothing", "'user_code' has no callable 'nothing'"),
    ("model.name=no_such_module:build", "cannot import 'no_such_module'"),
    ("model.name=tv:resnet19", "torchvision has no model 'resnet19' (did you mean 'tv:resnet18'?)"),
    ("model.name=resnet", "unknown model 'resnet'"),
])
def test_bad_model_names(tmp_path, override, expected) -> None:
    result = launch(tmp_path / "runs" / "r", [override])
    assert result.returncode == 2 and expected in result.stderr


@pytest.mark.slow
def test_default_config_trains_with_two_ranks(tmp_path) -> None:
    result = launch(tmp_path / "runs" / "default", ["train.max_steps=30", "train.log_every=10",
                                                    "data.synthetic.train_size=2048",
                                                    "data.synthetic.val_size=300"],
                    nproc=2, config="configs/default.yaml", tiny=False)
    assert result.returncode == 0, result.stderr[-3000:]
    files = {p.name for p in result.run_dir.iterdir()}
    assert {"config.yaml", "metrics.jsonl", "checkpoints", "log.txt", "log.rank1.txt", "tb"} <= files
    assert [r["step"] for r in result.records() if "loss" in r] == [10, 20, 30]
    final = result.evals()[-1]
    line = f"val_loss {final['val_loss']:.4g} | val_acc {final['val_acc']:.4g}"
    assert line in (result.run_dir / "log.txt").read_text()
    assert line in (result.run_dir / "log.rank1.txt").read_text()
