"""A built-in, offline 10-class image dataset: coloured shapes and patterns on noisy backgrounds.

Each image places one of ten shapes at a random position, size, foreground and background colour,
with pixel noise. Colour and position vary freely, so a linear model on pixels cannot solve it,
while a small CNN learns it in a few epochs. The same (size, split) always gives the same images.
"""

from __future__ import annotations

import torch

CLASSES = (
    "circle",
    "square",
    "triangle",
    "ring",
    "plus",
    "h_stripes",
    "v_stripes",
    "diagonal_stripes",
    "checkerboard",
    "x_cross",
)
IMAGE_SIZE = 32
_SPLIT_SEEDS = {"train": 20240917, "val": 19730308}


def generate(count: int, split: str) -> tuple[torch.Tensor, torch.Tensor]:
    """`count` images as uint8 (N, 3, 32, 32) and their labels (N,), balanced over classes."""
    gen = torch.Generator().manual_seed(_SPLIT_SEEDS[split])
    labels = torch.arange(count) % len(CLASSES)
    labels = labels[torch.randperm(count, generator=gen)]

    def uniform(lo: float, hi: float, *shape: int) -> torch.Tensor:
        return lo + (hi - lo) * torch.rand(count, *shape, generator=gen)

    grid = torch.arange(IMAGE_SIZE, dtype=torch.float32)
    cy, cx = uniform(9.5, 22.5, 1, 1), uniform(9.5, 22.5, 1, 1)
    dy, dx = grid.view(1, -1, 1) - cy, grid.view(1, 1, -1) - cx
    size = uniform(5.5, 9.5, 1, 1)
    period = torch.randint(2, 4, (count, 1, 1), generator=gen).float()
    mask = torch.zeros(count, IMAGE_SIZE, IMAGE_SIZE, dtype=torch.bool)
    for label in range(len(CLASSES)):
        pick = labels == label
        mask[pick] = _shape(label, dx[pick], dy[pick], size[pick], period[pick])

    foreground = uniform(0.0, 1.0, 3, 1, 1)
    # Backgrounds differ from the foreground by a clear margin so that every shape is visible.
    background = (foreground + uniform(0.35, 0.65, 3, 1, 1)) % 1.0
    image = torch.where(mask.unsqueeze(1), foreground, background)
    image = image + 0.08 * torch.randn(image.shape, generator=gen)
    pixels = (image.clamp(0, 1) * 255).round().to(torch.uint8)
    return pixels, labels


def _shape(
    label: int, dx: torch.Tensor, dy: torch.Tensor, size: torch.Tensor, period: torch.Tensor
) -> torch.Tensor:
    adx, ady = dx.abs(), dy.abs()
    in_square = (adx < size) & (ady < size)
    distance = (dx * dx + dy * dy).sqrt()
    band = size / 3
    if label == 0:
        return distance < size
    if label == 1:
        return (adx < size * 0.8) & (ady < size * 0.8)
    if label == 2:
        return (dy > -size) & (dy < size) & (adx < (dy + size) / 2)
    if label == 3:
        return (distance < size) & (distance > size * 0.55)
    if label == 4:
        return ((adx < band) & (ady < size)) | ((ady < band) & (adx < size))
    if label == 5:
        return in_square & (torch.floor(dy / period) % 2 == 0)
    if label == 6:
        return in_square & (torch.floor(dx / period) % 2 == 0)
    if label == 7:
        return in_square & (torch.floor((dx + dy) / period) % 2 == 0)
    if label == 8:
        return in_square & ((torch.floor(dx / period) + torch.floor(dy / period)) % 2 == 0)
    return in_square & ((adx - ady).abs() < band * 0.8)
