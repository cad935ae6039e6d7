"""EMA weights (`train.ema`): an exponential moving average of the trainable parameters.

- Kept like the parameters: under FSDP each rank holds the average of its own shards (DTensors
  of the same mesh and placements), under DDP each rank a whole copy.
- Updated on the device after every `every_steps`-th optimizer step by foreach kernels on the
  local tensors, so nothing is read on the host. A step that changed nothing (skipped as
  non-finite under `train.nan_policy=skip`, or an fp16 overflow) leaves the average as it was:
  the update's weight is multiplied by "not skipped" on the device.
- Saved in every checkpoint under "ema" beside "model" and "optimizer": whole tensors in
  `checkpoint.pt`, DCP entries `ema.<name>` in a sharded checkpoint (they reshard like the
  parameters on another world size).
- Evaluated by exchanging values in place: parameters and average swap, the model is evaluated,
  they swap back (copies, so the weights come back bitwise). Buffers (BatchNorm statistics) are
  the model's own.

`has_ema` and `load_ema_into` read a checkpoint's average outside training (`dtrain eval` and
`dtrain export` with `--weights ema`).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from dtrain.checkpoint.load import open_checkpoint
from dtrain.checkpoint.state import (
    FULL_FILE,
    dcp_model_shapes,
    load_checked,
    load_file,
    read_sharded,
    shape_mismatch,
)
from dtrain.core.errors import UserError
from dtrain.core.logs import log
from dtrain.parallel import reshard, unwrap, whole_shapes
from dtrain.process import compat, dist

if TYPE_CHECKING:
    from dtrain.checkpoint import SavedPart
    from dtrain.config import CkptConfig, EmaConfig

KEY = "ema"  # the part of a checkpoint that holds the average: {parameter name: tensor}
SUFFIX = "_ema"  # metrics of the averaged weights: val_acc_ema beside val_acc


def monitored_metric(ckpt: CkptConfig, ema: EmaConfig) -> str:
    """`ckpt.monitor` as the task itself reports it: `val_acc_ema` is the task's `val_acc`,
    measured on the averaged weights, when they are evaluated (`train.ema`)."""
    monitor = ckpt.monitor
    if ema.decay is not None and ema.eval and monitor.endswith(SUFFIX):
        return monitor[: -len(SUFFIX)]
    return monitor


def _local(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    return [compat.local_part(t) for t in tensors]


def _placed(whole: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """This rank's part of the whole tensor `whole`, as `like` holds it: its shard of a DTensor
    (cut locally, no communication), or all of it."""
    if hasattr(like, "device_mesh"):
        from torch.distributed.tensor import distribute_tensor

        like_d: Any = like
        part = distribute_tensor(whole, like_d.device_mesh, like_d.placements, src_data_rank=None)
        return part.to_local()
    return whole


class EmaWeights:
    """The average of a (wrapped) model's trainable parameters, by parameter name."""

    def __init__(self, model: nn.Module, decay: float, every_steps: int, evaluates: bool) -> None:
        self.model = model
        self.decay, self.every_steps, self.evaluates = decay, every_steps, evaluates
        named = [(n, p) for n, p in unwrap(model).named_parameters() if p.requires_grad]
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        with torch.no_grad():
            self.average = [p.detach().clone() for p in self.params]
        self.loaded = False  # whether a checkpoint gave the average (else `reset` at the start)

    @staticmethod
    def build(ema: EmaConfig, model: nn.Module) -> EmaWeights | None:
        """The average of `model`'s parameters when `train.ema.decay` is set, else None."""
        if ema.decay is None:
            return None
        return EmaWeights(model, ema.decay, ema.every_steps, ema.eval)

    @torch.no_grad()
    def reset(self) -> None:
        """The average starts from the weights the run starts from."""
        compat.foreach_copy(_local(self.average), _local(self.params))

    @torch.no_grad()
    def update(self, step: int, skipped: torch.Tensor | None) -> None:
        """After optimizer step `step` (counted from 1): average <- decay * average + (1 - decay)
        * parameters, every `every_steps` steps. With `skipped` (a 0-d bool tensor on the
        device), a skipped step leaves the average unchanged, decided on the device."""
        if step % self.every_steps or not self.average:
            return
        average, params = _local(self.average), _local(self.params)
        if skipped is None:
            compat.foreach_lerp(average, params, 1.0 - self.decay)
            return
        # A tensor weight: lerp's takes only a number, and reading the flag would wait.
        weight = (~skipped).to(device=average[0].device, dtype=torch.float32) * (1.0 - self.decay)
        compat.foreach_move_towards(average, params, weight)

    @contextlib.contextmanager
    def swapped(self) -> Iterator[None]:
        """The model holds the average inside the block, its own weights again after it."""
        self._exchange()
        try:
            yield
        finally:
            self._exchange()

    @torch.no_grad()
    def _exchange(self) -> None:
        # An FSDP unit left unsharded by a forward without backward would go on computing with
        # the values gathered before the exchange: drop those first.
        reshard(self.model)
        for param, average in zip(_local(self.params), _local(self.average), strict=True):
            held = param.clone()
            param.copy_(average)
            average.copy_(held)

    # -- checkpoints (a `ShardedStateful` part, saved under KEY) ---------------------------------
    def state_dict(self, full: bool) -> dict[str, torch.Tensor]:
        """What a checkpoint saves. Sharded: the tensors themselves (DCP writes each rank's
        shards). Full: whole tensors in CPU memory on rank 0 (under FSDP gathered from every
        rank, one at a time), nothing on the others."""
        if not full:
            return dict(zip(self.names, self.average, strict=True))
        whole: dict[str, torch.Tensor] = {}
        for name, average in zip(self.names, self.average, strict=True):
            value = average.full_tensor() if hasattr(average, "full_tensor") else average
            if dist.is_main():
                whole[name] = value.detach().cpu()
        return whole

    def staging(self, saved: SavedPart) -> dict[str, torch.Tensor] | None:
        """The checkpoint's average, read but not applied (every rank calls it). Sharded: empty
        tensors like ours, for the read of the model and optimizer to fill. Full: rank 0 holds
        the file's tensors (`saved.whole`) and sends each rank its part. None when the
        checkpoint has no average that fits this model (the average starts from the weights)."""
        shapes = dist.on_main(saved.shapes)
        ours = {n: tuple(a.shape) for n, a in zip(self.names, self.average, strict=True)}
        if shapes and whole_shapes(self.model) is not None and ours.keys() <= shapes.keys():
            shapes = {n: shapes[n] for n in ours}  # a pipeline stage's rank: its stages' part
        problem = shape_mismatch(ours, shapes) if shapes else "it holds none (train.ema was off)"
        if problem:
            log.warning(
                f"{saved.folder}: no EMA weights for this model ({problem}): the average "
                f"starts from the resumed weights"
            )
            return None
        if saved.format == "sharded":
            return {n: torch.empty_like(a) for n, a in zip(self.names, self.average, strict=True)}
        import torch.distributed as torch_dist

        parts = {}
        for name, average in zip(self.names, self.average, strict=True):
            if dist.is_main():
                assert saved.whole is not None
                whole = saved.whole[name].to(device=saved.device, dtype=average.dtype)
            else:
                whole = torch.empty(average.shape, dtype=average.dtype, device=saved.device)
            if dist.is_distributed():
                torch_dist.broadcast(whole, src=0)
            parts[name] = _placed(whole, average).to(_local([average])[0].device, copy=True)
        return parts

    @torch.no_grad()
    def load_state_dict(self, staged: dict[str, torch.Tensor]) -> None:
        """Take the average `staging` read (after the rest of the checkpoint was applied)."""
        values = [staged[n] for n in self.names]
        compat.foreach_copy(_local(self.average), _local(values))
        self.loaded = True


# ---------------------------------------------------------------------------------------------
# Outside training: dtrain eval / export --weights ema


def _saved(folder: str, fmt: str) -> tuple[dict[str, tuple[int, ...]], dict[str, Any] | None]:
    """The shapes of the average a checkpoint holds (empty: none), and a full one's data."""
    if fmt == "sharded":
        return dcp_model_shapes(folder, f"{KEY}."), None
    data = load_checked(os.path.join(folder, FULL_FILE), mmap=True)
    average = data.get(KEY) or {}
    return {k: tuple(v.shape) for k, v in average.items()}, data


def has_ema(path: str) -> bool:
    """Whether the checkpoint at `path` (its folder, or a bare checkpoint.pt) holds EMA weights.
    UserError when it is not a complete checkpoint."""
    folder, fmt = open_checkpoint(path)
    if fmt == "sharded":
        return bool(dcp_model_shapes(folder, f"{KEY}."))
    data = load_file(os.path.join(folder, FULL_FILE), mmap=True)  # the digests: on loading
    return bool(data.get(KEY))


def load_ema_into(model: nn.Module, path: str) -> None:
    """Replace `model`'s averaged parameters with the checkpoint's EMA weights. Everything else
    (buffers, parameters that were frozen) stays as the model holds it: load the checkpoint's
    own weights first. The model may be plain (one process; any checkpoint, saved at any world
    size) or wrapped as in training (DDP, FSDP: under the process group, every rank calls it).
    UserError (exit 2) when the checkpoint holds no average or one of another model."""
    folder, fmt = open_checkpoint(path)
    params = dict(unwrap(model).named_parameters())
    shapes, data = _saved(folder, fmt)
    if not shapes:
        raise UserError(
            f"checkpoint error: {folder} was saved without EMA weights (train.ema.decay "
            f"unset); use --weights model"
        )
    unknown = sorted(shapes.keys() - params.keys())
    problem = shape_mismatch({n: tuple(p.shape) for n, p in params.items()}, shapes, strict=False)
    if unknown or problem:
        problem = problem or f"its EMA weights name parameters this model lacks, e.g. {unknown[:3]}"
        raise UserError(f"checkpoint error: {folder}: {problem}")
    if data is None:
        values: dict[str, torch.Tensor] = {n: torch.empty_like(params[n]) for n in shapes}
        read_sharded(folder, {KEY: values})
        values = {n: _local([v])[0] for n, v in values.items()}
    else:
        values = {n: _placed(v, params[n]) for n, v in data[KEY].items()}
    with torch.no_grad():
        for name, value in values.items():
            target = _local([params[name]])[0]
            target.copy_(value.to(device=target.device, dtype=target.dtype))
    reshard(model)  # no FSDP unit computes with values gathered before
