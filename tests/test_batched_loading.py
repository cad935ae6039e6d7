"""ImageDataset.__getitems__ (a whole batch at once) gives bit for bit the batches that
__getitem__ gives sample by sample, through the real loaders."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import Dataset

from dtrain import data
from dtrain.config import DataConfig, SyntheticConfig


class PerSample(Dataset):
    """The same dataset without __getitems__: the DataLoader asks for one sample at a time."""

    def __init__(self, dataset: Dataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, key):
        return self.dataset[key]


@pytest.mark.parametrize("augment", [True, False])
def test_batched_loading_equals_per_sample_loading(augment: bool) -> None:
    cfg = DataConfig(batch_size=16, augment=augment,
                     synthetic=SyntheticConfig(train_size=200, val_size=40))
    datasets = data.build(cfg, seed=3)
    assert hasattr(datasets.train, "__getitems__")
    for rank in (0, 1):
        where = dict(cfg=cfg, seed=3, rank=rank, world_size=2, device=torch.device("cpu"))
        batched = data.loaders(datasets.train, datasets.val, **where)
        single = data.loaders(PerSample(datasets.train), PerSample(datasets.val), **where)
        for epoch in (0, 4):
            batched.train_sampler.set_epoch(epoch)
            single.train_sampler.set_epoch(epoch)
            pairs = list(zip(batched.train, single.train))
            assert len(pairs) == 200 // 2 // 16
            for (x, y), (x_ref, y_ref) in pairs:
                assert torch.equal(x, x_ref) and torch.equal(y, y_ref)
                assert x.dtype == x_ref.dtype and x.shape == (16, 3, 32, 32)
        # validation keys are plain indices, not (epoch, index)
        for (x, y), (x_ref, y_ref) in zip(batched.val, single.val):
            assert torch.equal(x, x_ref) and torch.equal(y, y_ref)
    if augment:  # the same images get other crops in another epoch: the comparison covers them
        keys = list(range(8))
        epoch0 = data.collate(datasets.train.__getitems__([(0, i) for i in keys]))[0]
        epoch1 = data.collate(datasets.train.__getitems__([(1, i) for i in keys]))[0]
        assert not torch.equal(epoch0, epoch1)
