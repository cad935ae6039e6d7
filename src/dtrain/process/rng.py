"""Random number generators: seeding them, and capturing and restoring their state.

States are stored as tensors, ints and strings (NumPy's key array as an int64 tensor), so that a
checkpoint holding them loads with `weights_only=True`.
"""

from __future__ import annotations

import random
from typing import Any, cast

import numpy
import torch


def reseed(seed: int) -> None:
    """Python's, NumPy's and torch's generators (every device's) from one seed."""
    random.seed(seed)
    numpy.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def seed_loader_worker(worker_id: int) -> None:
    """A loader worker's Python and NumPy generators from the seed torch gave the worker, so that
    users' own random transforms differ between workers."""
    worker = torch.utils.data.get_worker_info()
    assert worker is not None, "called in a loader worker only"
    seed = worker.seed % 2**32
    random.seed(seed)
    numpy.random.seed(seed)


def capture(device: torch.device) -> dict[str, Any]:
    """This process's generator states: Python, NumPy, torch's CPU one and `device`'s on CUDA."""
    np_state = cast(tuple, numpy.random.get_state(legacy=True))  # (name, keys, pos, ...)
    state = {
        "python": random.getstate(),
        "numpy": {
            "name": np_state[0],
            "keys": torch.from_numpy(np_state[1].astype(numpy.int64)),
            "pos": int(np_state[2]),
            "has_gauss": int(np_state[3]),
            "gauss": float(np_state[4]),
        },
        "torch": torch.get_rng_state(),
    }
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def restore(state: dict[str, Any], device: torch.device) -> None:
    """Restore what `capture` captured."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    np_state = state["numpy"]
    numpy.random.set_state(
        (
            np_state["name"],
            np_state["keys"].numpy().astype(numpy.uint32),
            np_state["pos"],
            np_state["has_gauss"],
            np_state["gauss"],
        )
    )
    torch.set_rng_state(state["torch"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)
