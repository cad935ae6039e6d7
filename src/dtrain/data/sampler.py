"""The order samples are served in: resumable in the middle of an epoch, and exact in evaluation.

Keys are an index, or (epoch, index) for a training sample, so that a sample's augmentation can be
a pure function of (seed, epoch, index): it does not depend on how many batches came before, on
the number of loader workers, or on the world size. Together with a sampler that can start
part-way through an epoch, that makes a mid-epoch resume bit-exact.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import Dataset, Sampler

SampleKey = int | tuple[int, int]  # an index, or (epoch, index) for a training sample
_MASK64 = (1 << 64) - 1


def index_of(key: SampleKey) -> int:
    return key[1] if isinstance(key, tuple) else key


def epoch_and_index(key: SampleKey) -> tuple[int, int]:
    return key if isinstance(key, tuple) else (0, key)


def sample_random(seed: int, epoch: int, index: int) -> int:
    """64 random bits for one sample in one epoch (splitmix64 of the three numbers)."""
    z = (
        seed * 0x9E3779B97F4A7C15 + epoch * 0xBF58476D1CE4E5B9 + index * 0x94D049BB133111EB
    ) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


class ResumableSampler(Sampler[tuple[int, int]]):
    """DistributedSampler's order, keyed by (epoch, index), able to start part-way through an epoch.

    The epoch's order is a permutation seeded by seed + epoch (as DistributedSampler's), and rank r
    takes every world-th sample from position r. After k steps the ranks together have consumed
    exactly the first `consumed` positions, whatever the world size, so a resume maps the
    position by global samples consumed and never skips or repeats a sample.
    """

    def __init__(
        self,
        size: int,
        rank: int,
        world_size: int,
        seed: int,
        shuffle: bool = True,
        drop_last: bool = True,
    ) -> None:
        self.size, self.rank, self.world_size = size, rank, world_size
        self.seed, self.shuffle, self.drop_last = seed, shuffle, drop_last
        self.epoch, self.consumed = 0, 0

    def set_epoch(self, epoch: int, consumed: int = 0) -> None:
        self.epoch, self.consumed = epoch, consumed

    def _order(self) -> list[int]:
        if self.shuffle:
            gen = torch.Generator().manual_seed(self.seed + self.epoch)
            order = torch.randperm(self.size, generator=gen).tolist()
        else:
            order = list(range(self.size))
        if self.drop_last:
            order = order[: self.size - self.size % self.world_size]
        else:
            order += order[: (-self.size) % self.world_size]
        rest = order[self.consumed :]
        uneven = len(rest) % self.world_size  # only after a world-size change
        if uneven:
            rest = rest[:-uneven] if self.drop_last else rest + rest[: self.world_size - uneven]
        return rest

    def __iter__(self) -> Iterator[tuple[int, int]]:
        return iter([(self.epoch, i) for i in self._order()[self.rank :: self.world_size]])

    def __len__(self) -> int:
        """Batches of this rank: _order()'s length by arithmetic (no permutation to draw)."""
        size, world = self.size, self.world_size
        total = size - size % world if self.drop_last else size + min(-size % world, size)
        rest = max(total - self.consumed, 0)
        uneven = rest % world
        if uneven:
            rest = rest - uneven if self.drop_last else rest + min(world - uneven, rest)
        return rest // world


class EvalSampler(Sampler[int]):
    """Rank r takes positions r, r + world, ...; short ranks repeat a sample so that every rank
    runs the same number of batches (FSDP's forward is a collective). `valid_count` says how
    many of a rank's samples are real: each sample is counted exactly once over all ranks."""

    def __init__(self, size: int, rank: int, world_size: int) -> None:
        self.size, self.rank, self.world_size = size, rank, world_size
        self.per_rank = math.ceil(size / world_size)
        self.valid_count = len(range(rank, size, world_size))

    def __iter__(self) -> Iterator[int]:
        return iter(
            [min(self.rank + j * self.world_size, self.size - 1) for j in range(self.per_rank)]
        )

    def __len__(self) -> int:
        return self.per_rank


class Prefix(Dataset):
    """The first `count` samples of a dataset, keys passed through unchanged."""

    def __init__(self, dataset: Dataset, count: int) -> None:
        self.dataset, self.count = dataset, count

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, key: SampleKey) -> Any:
        return self.dataset[key]

    def __getitems__(self, keys: list[SampleKey]) -> Any:
        getitems = getattr(self.dataset, "__getitems__", None)
        return getitems(keys) if getitems is not None else [self.dataset[k] for k in keys]
