"""The checkpointer saves and resumes parts it knows nothing of: named `Stateful` ones in the
metadata, `ShardedStateful` ones beside the model's weights (one process, no torchrun)."""

from __future__ import annotations

import types
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dtrain import config
from dtrain.checkpoint import (
    POSITION,
    Checkpointer,
    Contents,
    SavedPart,
    ShardedStateful,
    Stateful,
    Store,
)
from dtrain.loop.ema import KEY, EmaWeights
from dtrain.loop.state import TrainState
from dtrain.models.spec import spec_of


class Counter:
    def __init__(self) -> None:
        self.count = 0

    def state_dict(self) -> dict[str, Any]:
        return {"count": self.count}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.count = state["count"]


class Tensors:
    """A sharded part as simple as it gets: one tensor, whole on the one rank."""

    def __init__(self) -> None:
        self.value = torch.zeros(3)

    def state_dict(self, full: bool) -> dict[str, torch.Tensor]:
        return {"value": self.value.clone()}

    def staging(self, saved: SavedPart) -> dict[str, torch.Tensor] | None:
        if saved.format == "full":
            return None if saved.whole is None else {"value": saved.whole["value"].clone()}
        return {"value": torch.empty(3)}

    def load_state_dict(self, staged: dict[str, torch.Tensor]) -> None:
        self.value.copy_(staged["value"])


def _checkpointer(tmp_path: Path, fmt: str) -> tuple[Checkpointer, TrainState, Counter, Tensors]:
    cfg = config.load(None, [f"run.out_dir={tmp_path}", "run.name=r"])
    torch.manual_seed(0)
    model = nn.Linear(2, 3)
    state, counter, tensors = TrainState(), Counter(), Tensors()
    layout: Any = types.SimpleNamespace(
        device=torch.device("cpu"), checkpoint_format=fmt, random_rank=0
    )
    contents = Contents(
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
        spec=spec_of(cfg.model),
        parts={POSITION: state, "counter": counter},
        sharded={"tensors": tensors},
        config=config.to_dict(cfg),
        model_info={},
        seed=0,
    )
    store = Store(str(tmp_path / "r"))
    return Checkpointer(ckpt=cfg.ckpt, layout=layout, store=store, contents=contents), state, \
        counter, tensors


def test_the_checkpointer_saves_and_resumes_parts_by_name(tmp_path: Path) -> None:
    for fmt in ("full", "sharded"):
        where = tmp_path / fmt
        checkpoints, state, counter, tensors = _checkpointer(where, fmt)
        state.step, state.epoch, counter.count = 7, 1, 42
        tensors.value += torch.tensor([1.0, 2.0, 3.0])
        checkpoints.save(state.step, state.epoch, {})
        checkpoints.wait()
        again, state2, counter2, tensors2 = _checkpointer(where, fmt)
        resumed = again.resume()
        assert resumed is not None and resumed.step == 7
        assert (state2.step, state2.epoch, counter2.count) == (7, 1, 42)
        assert torch.equal(tensors2.value, torch.tensor([1.0, 2.0, 3.0]))
        # The metadata as before: the position under "train_state", the others under "extra".
        meta_file = "checkpoint.pt" if fmt == "full" else "meta.pt"
        meta = torch.load(Path(resumed.path) / meta_file, weights_only=True)
        assert meta["train_state"]["step"] == 7 and meta["extra"] == {"counter": {"count": 42}}


def test_a_runs_parts_are_what_the_checkpointer_takes() -> None:
    state: Stateful = TrainState()
    average: ShardedStateful = EmaWeights(nn.Linear(2, 2), 0.9, 1, False)  # saved under KEY
    assert POSITION == "train_state" and KEY == "ema" and state and average
