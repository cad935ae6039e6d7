"""Seeding, and capturing and restoring the random generators (dtrain.process.rng)."""

from __future__ import annotations

import random

import numpy
import torch

from dtrain.process import rng


def _draws() -> tuple:
    return random.random(), float(numpy.random.rand()), float(torch.rand(()))


def test_a_captured_state_restores_every_generator_through_a_weights_only_file(tmp_path) -> None:
    rng.reseed(11)
    _draws()
    numpy.random.randn()  # leaves a cached gaussian in NumPy's state
    state = rng.capture(torch.device("cpu"))
    expected = _draws()
    torch.save(state, tmp_path / "rng.pt")
    rng.reseed(99)
    rng.restore(torch.load(tmp_path / "rng.pt", weights_only=True), torch.device("cpu"))
    assert _draws() == expected


def test_reseeding_repeats_every_generator_and_other_seeds_differ() -> None:
    rng.reseed(5)
    first = _draws()
    rng.reseed(5)
    assert _draws() == first
    rng.reseed(6)
    assert all(a != b for a, b in zip(_draws(), first, strict=True))
