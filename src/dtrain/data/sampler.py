"""The order samples are served in: resumable in the middle of an epoch, and exact in evaluation.

Keys are an index, or (epoch, index) for a training sample, so that a sample's augmentation can be
a pure function of (seed, epoch, index): it does not depend on how many batches came before, on
the number of loader workers, or on the world size. Together with a sampler that can start
part-way through an epoch, that makes a mid-epoch resume bit-exact.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, Sampler

from dtrain.config import DataConfig, TrainConfig
from dtrain.core.errors import UserError
from dtrain.process.layout import Layout, Steps

SampleKey = int | tuple[int, int]  # an index, or (epoch, index) for a training sample
_MASK64 = (1 << 64) - 1
# From this many samples on, a training order is a SeededBijection rather than DistributedSampler's
# permutation: below it, the permutation tensor of an epoch stays under 32 MiB per rank.
LAZY_ORDER_FROM = 1 << 22
_CHUNK = 4096  # positions worked out at once while serving


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


class SeededBijection:
    """A permutation of [0, n) drawn by (seed, epoch), computed position by position in O(1) memory.

    A balanced Feistel network (six rounds of splitmix64) permutes the smallest square power of
    two >= n, 4**h; a value that lands outside [0, n) is sent through the network again until it
    lands inside (cycle walking), which restricts the permutation of [0, 4**h) to one of [0, n).
    As 4**h < 4n, a position takes fewer than four passes on average.
    """

    ROUNDS = 6

    def __init__(self, n: int, seed: int, epoch: int) -> None:
        self.n = n
        self.half = (max(n - 1, 1).bit_length() + 1) // 2
        self.mask = np.uint64((1 << self.half) - 1)
        self.keys = [np.uint64(sample_random(seed, epoch, r)) for r in range(self.ROUNDS)]

    def _network(self, x: np.ndarray) -> np.ndarray:
        shift = np.uint64(self.half)
        left, right = x >> shift, x & self.mask
        for key in self.keys:
            z = right ^ key
            z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
            z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
            left, right = right, left ^ ((z ^ (z >> np.uint64(31))) & self.mask)
        return (left << shift) | right

    def __call__(self, positions: np.ndarray) -> np.ndarray:
        """The indices at `positions` (each in [0, n)), as int64."""
        out = self._network(positions.astype(np.uint64))
        outside = out >= self.n
        while outside.any():
            out[outside] = self._network(out[outside])
            outside = out >= self.n
        return out.astype(np.int64)


def seeded_order(size: int, seed: int, epoch: int) -> Callable[[np.ndarray], np.ndarray]:
    """A permutation of [0, size) drawn by (seed, epoch), as a function: positions -> indices.
    Below LAZY_ORDER_FROM, torch.randperm of seed + epoch (DistributedSampler's); from there
    on, a SeededBijection, which holds no tensor of the order."""
    if size >= LAZY_ORDER_FROM:
        return SeededBijection(size, seed, epoch)
    gen = torch.Generator().manual_seed(seed + epoch)
    order = torch.randperm(size, generator=gen).numpy()
    return lambda positions: order[positions]


class ResumableSampler(Sampler[tuple[int, int]]):
    """DistributedSampler's order, keyed by (epoch, index), able to start part-way through an epoch.

    The epoch's order is a permutation seeded by seed + epoch, and rank r takes every world-th
    sample from position r. After k steps the ranks together have consumed exactly the first
    `consumed` positions, whatever the world size, so a resume maps the position by global
    samples consumed and never skips or repeats a sample.

    With `drop_last`, the sampler also decides which part batch is kept (the loader keeps every
    batch it is given): none while the position is a whole number of steps (ranks x
    `batch_size`), as DistributedSampler and a dropping loader would; after a world-size
    change, the part step the change left beyond what a fresh epoch drops (see `_kept`).

    The permutation: below LAZY_ORDER_FROM samples, DistributedSampler's own (torch.randperm of
    seed + epoch, held as one tensor for the epoch: 8 bytes a sample); from there on, a
    SeededBijection of (seed, epoch), computed per position: a corpus of tens of millions of
    windows costs no memory for its order. Either way the sampler serves lazily, a chunk of
    positions at a time.
    """

    def __init__(
        self,
        size: int,
        rank: int,
        world_size: int,
        seed: int,
        shuffle: bool = True,
        drop_last: bool = True,
        batch_size: int = 1,
    ) -> None:
        self.size, self.rank, self.world_size = size, rank, world_size
        self.seed, self.shuffle, self.drop_last = seed, shuffle, drop_last
        self.batch_size = batch_size
        self.epoch, self.consumed = 0, 0
        # The keys served, in order, where someone reads them (a replica group's sample log).
        self.served: deque[tuple[int, int]] | None = None

    def set_epoch(self, epoch: int, consumed: int = 0) -> None:
        self.epoch, self.consumed = epoch, consumed

    def permutation(self) -> Callable[[np.ndarray], np.ndarray]:
        """The epoch's order as a function: positions in [0, size) -> indices."""
        if not self.shuffle:
            return lambda positions: positions
        return seeded_order(self.size, self.seed, self.epoch)

    def _kept(self) -> int:
        """drop_last: how many positions after `consumed` the ranks take, rank r every world-th
        from the r-th. Whole steps (world x batch) while the rest fills them; of the part step
        left, a fresh epoch's tail (size mod world x batch) is dropped and the remainder kept as
        a short last step, so no epoch drops more than a fresh one at this world size. Without
        a change the part step is exactly that tail: nothing short is ever kept. A remainder
        smaller than the world would leave some rank without a sample for that step (the ranks
        must run the same number of batches): it is dropped too."""
        step = self.world_size * self.batch_size
        rest = max(self.size - self.consumed, 0)
        kept = rest - min(rest % step, self.size % step)
        short = kept % step
        return kept - short if short < self.world_size else kept

    def _rest(self) -> int:
        """Without drop_last: positions of the epoch's order left after `consumed`, the order
        padded from its start to divide over the ranks, as DistributedSampler pads it."""
        size, world = self.size, self.world_size
        return max(size + min(-size % world, size) - self.consumed, 0)

    def __len__(self) -> int:
        """Samples of this rank, by arithmetic (no permutation to draw). Without drop_last, a
        rest that does not divide over the ranks (only after a world-size change) is padded
        from its own start."""
        world = self.world_size
        if self.drop_last:
            return len(range(self.rank, self._kept(), world))
        rest = self._rest()
        uneven = rest % world
        if uneven:
            rest += min(world - uneven, rest)
        return rest // world

    def __iter__(self) -> Iterator[tuple[int, int]]:
        # The epoch and position are read now: a later set_epoch does not change this pass.
        rest = self._kept() if self.drop_last else self._rest()
        return self._serve(self.epoch, self.consumed, rest, len(self), self.permutation())

    def _serve(
        self,
        epoch: int,
        consumed: int,
        rest: int,
        count: int,
        permutation: Callable[[np.ndarray], np.ndarray],
    ) -> Iterator[tuple[int, int]]:
        for first in range(0, count, _CHUNK):
            served = self.rank + np.arange(first, min(first + _CHUNK, count)) * self.world_size
            served = np.where(served < rest, served, served - rest)  # padding: the rest again
            position = consumed + served
            position = np.where(position < self.size, position, position - self.size)
            for index in permutation(position).tolist():
                if self.served is not None:
                    self.served.append((epoch, index))
                yield (epoch, index)


class EvalSampler(Sampler[int]):
    """Rank r takes positions r, r + world, ...; short ranks repeat a sample so that every rank
    runs the same number of batches (FSDP's forward is a collective). `valid_count` says how
    many of a rank's samples are real: each sample is counted exactly once over all ranks."""

    def __init__(self, size: int, rank: int, world_size: int) -> None:
        self.size, self.rank, self.world_size = size, rank, world_size
        self.per_rank = math.ceil(size / world_size)
        self.valid_count = len(range(rank, size, world_size))

    def __iter__(self) -> Iterator[int]:
        return (min(self.rank + j * self.world_size, self.size - 1) for j in range(self.per_rank))

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


def epoch_steps(layout: Layout, train: TrainConfig, data: DataConfig, train_size: int) -> Steps:
    """Steps for a training set of `train_size` samples, by the loaders' own rule: the
    sampler gives each rank its share, the loader cuts it into batches, and
    `train.grad_accum` batches make a step (train.overfit_batches: a fixed prefix)."""
    if train.overfit_batches:
        train_size = min(train_size, train.overfit_batches * layout.batch_size * layout.data_ranks)
    per_rank = len(ResumableSampler(train_size, 0, layout.data_ranks, 0, False, data.drop_last))
    batches = per_rank // layout.batch_size
    if not data.drop_last and per_rank % layout.batch_size:
        batches += 1
    per_epoch = batches // layout.grad_accum
    if per_epoch < 1:
        raise UserError(
            f"data error: an epoch has {batches} batches per rank, fewer than "
            f"train.grad_accum={layout.grad_accum}; lower one of them"
        )
    total = train.epochs * per_epoch
    if train.max_steps:
        total = min(total, train.max_steps)
    return Steps(batches_per_epoch=batches, per_epoch=per_epoch, total=total)
