"""ImageDataset.__getitems__ (a whole batch at once) gives bit for bit the batches that
__getitem__ gives sample by sample, through the real loaders."""

from __future__ import annotations

import pytest
import torch

from dtrain import data
from dtrain.config import DataConfig


@pytest.mark.parametrize("augment", [True, False])
def test_batched_loading_equals_per_sample_loading(augment: bool) -> None:
    cfg = DataConfig(batch_size=16, augment=augment)
    cfg.synthetic.train_size, cfg.synthetic.val_size = 200, 40
    datasets = data.build(cfg, seed=3)
    assert hasattr(datasets.train, "__getitems__")
    # Prefix has no __getitems__: the DataLoader falls back to one __getitem__ per key.
    per_sample = data.Datasets(data.Prefix(datasets.train, len(datasets.train)),
                               data.Prefix(datasets.val, len(datasets.val)), datasets.num_classes,
                               datasets.in_channels, datasets.image_size)
    for rank in (0, 1):
        batched_loaders = data.loaders(datasets, cfg, 3, rank, 2, torch.device("cpu"))
        single_loaders = data.loaders(per_sample, cfg, 3, rank, 2, torch.device("cpu"))
        for epoch in (0, 4):
            batched_loaders[1].set_epoch(epoch)
            single_loaders[1].set_epoch(epoch)
            pairs = list(zip(batched_loaders[0], single_loaders[0]))
            assert len(pairs) == 200 // 2 // 16
            for (x, y), (x_ref, y_ref) in pairs:
                assert torch.equal(x, x_ref) and torch.equal(y, y_ref)
                assert x.dtype == x_ref.dtype == torch.float32 and x.shape == (16, 3, 32, 32)
        # validation keys are plain indices, not (epoch, index)
        for (x, y), (x_ref, y_ref) in zip(batched_loaders[2], single_loaders[2]):
            assert torch.equal(x, x_ref) and torch.equal(y, y_ref)
    if augment:  # the same images get other crops in another epoch: the comparison covers them
        keys = list(range(8))
        epoch0 = datasets.train.__getitems__([(0, i) for i in keys])
        epoch1 = datasets.train.__getitems__([(1, i) for i in keys])
        assert not all(torch.equal(a[0], b[0]) for a, b in zip(epoch0, epoch1))
