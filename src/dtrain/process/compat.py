"""torch's private internals that dtrain relies on, in one place.

Each of these is outside torch's public API and may change in any release; tests/test_compat.py
checks every one of them against the installed torch, so that a change fails there, by name,
instead of somewhere in a training run.
"""

from __future__ import annotations

import contextlib
import datetime
import os
from collections.abc import Callable, Iterator
from typing import IO, Any

import torch
import torch.distributed as torch_dist
import torch.utils._pytree as pytree
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = [
    "NORM_LAYERS",
    "ReadThrough",
    "TorchDispatchMode",
    "aten_ops",
    "dcp_planner",
    "dcp_reader",
    "dcp_writer",
    "default_store",
    "inductor_settings",
    "is_in_place",
    "masked_step",
    "masked_step_supported",
    "missing_aten_ops",
    "scaler_found_inf",
    "set_default_timeout",
    "shutdown_workers",
    "tensor_leaves",
    "tree_map_tensors",
]

# ---------------------------------------------------------------------------------------------
# Optimizers

# Normalisation layers, by their common base class where torch has one (BatchNorm, InstanceNorm).
NORM_LAYERS: tuple[type[nn.Module], ...] = (
    nn.modules.batchnorm._NormBase,
    nn.LayerNorm,
    nn.GroupNorm,
    nn.LocalResponseNorm,
    *((nn.RMSNorm,) if hasattr(nn, "RMSNorm") else ()),
)


def masked_step_supported(optimizer: torch.optim.Optimizer) -> bool:
    """Whether `optimizer.step()` honours a `found_inf` device flag that turns the whole step
    into a no-op (what the grad scaler uses): fused optimizers do. torch has no DTensor rule for
    fused SGD, so SGD over FSDP's sharded parameters is not one."""
    if not getattr(optimizer, "_step_supports_amp_scaling", False):
        return False
    if isinstance(optimizer, torch.optim.SGD):
        return not any(hasattr(p, "to_local") for g in optimizer.param_groups for p in g["params"])
    return True


def masked_step(optimizer: torch.optim.Optimizer, found_inf: torch.Tensor) -> None:
    """One optimizer step that changes nothing where `found_inf` (a 0-d float tensor on the
    device) is non-zero: the decision stays on the device, with no wait for the host."""
    optimizer.found_inf = found_inf  # type: ignore[attr-defined]
    optimizer.grad_scale = None  # type: ignore[attr-defined]
    try:
        optimizer.step()
    finally:
        del optimizer.found_inf, optimizer.grad_scale  # type: ignore[attr-defined]


def foreach_norms(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each tensor's 2-norm in one foreach call: the operation `get_total_norm(foreach=True)`
    makes per group of tensors of one device and dtype."""
    return list(torch._foreach_norm(tensors, 2.0))


def wrapper_subclass(cls: type, shape: torch.Size, like: torch.Tensor) -> Any:
    """A tensor of subclass `cls` with `shape` and `like`'s dtype and device that holds no
    storage of its own (what `__torch_dispatch__` subclasses are made with)."""
    return torch.Tensor._make_wrapper_subclass(cls, shape, dtype=like.dtype, device=like.device)


def foreach_copy(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    """dst[i] <- src[i], in one fused pass."""
    torch._foreach_copy_(dst, src)


def foreach_lerp(average: list[torch.Tensor], values: list[torch.Tensor], weight: float) -> None:
    """average[i] += weight * (values[i] - average[i]), in one fused pass."""
    torch._foreach_lerp_(average, values, weight)


def foreach_move_towards(
    average: list[torch.Tensor], values: list[torch.Tensor], weight: torch.Tensor
) -> None:
    """lerp with a 0-d tensor weight, which lerp itself does not take: read on the device, so
    that a weight decided there (a skipped step) never makes the host wait."""
    deltas = torch._foreach_sub(values, average)
    torch._foreach_mul_(deltas, weight)
    torch._foreach_add_(average, deltas)


def flag_nonfinite(tensors: list[torch.Tensor], found: torch.Tensor, one: torch.Tensor) -> None:
    """Sets `found` (a float tensor) to 1 where any of `tensors` holds an inf or a nan, in one
    fused pass: the grad scaler's check, here with a scale `one` of exactly 1.0, so that no
    tensor changes a bit. The tensors must be dense, of one device and dtype."""
    torch._amp_foreach_non_finite_check_and_unscale_(tensors, found, one)


def scaler_found_inf(scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer) -> list[Any]:
    """What the grad scaler found when it unscaled `optimizer`'s gradients for this step: one
    flag per device (non-zero: an inf or a nan, the step skipped), read before `update()`
    forgets them. Empty where this torch's scaler does not say, or did not unscale it."""
    per_device = getattr(scaler, "_found_inf_per_device", None)
    if per_device is None:
        return []
    try:
        return list(per_device(optimizer).values())
    except (KeyError, RuntimeError):
        return []


# ---------------------------------------------------------------------------------------------
# Process group and loaders


def default_store() -> Any:
    """The default process group's rendezvous store (every rank can reach it)."""
    return torch_dist.distributed_c10d._get_default_store()


def set_default_timeout(timeout: datetime.timedelta) -> None:
    """The timeout of the default process group's collectives, from now on."""
    if hasattr(torch_dist, "set_timeout"):
        torch_dist.set_timeout(timeout)
    else:  # torch < 2.8
        torch_dist.distributed_c10d._set_pg_timeout(timeout)


def shutdown_workers(loader: torch.utils.data.DataLoader) -> None:
    """Stop a loader's worker processes now (persistent workers otherwise live until the
    interpreter's clean-up, which a process that ends with os._exit skips)."""
    iterator = getattr(loader, "_iterator", None)
    if iterator is not None and hasattr(iterator, "_shutdown_workers"):
        iterator._shutdown_workers()


# ---------------------------------------------------------------------------------------------
# Trees of tensors (batches, states): dicts, lists, tuples, namedtuples, nested


def stream_load_weights_only(stream: Any) -> Any:
    """A state streamed by `torch.distributed`'s streaming save (a replica group's heal), read
    with torch's weights-only unpickler: tensors and plain values, never code."""
    from torch.distributed._serialization import _streaming_load

    return _streaming_load(stream, weights_only=True)


def tree_map_tensors(fn: Callable[[torch.Tensor], Any], tree: Any) -> Any:
    """`tree` with `fn` applied to every tensor in it, its containers rebuilt alike."""
    return pytree.tree_map(lambda leaf: fn(leaf) if isinstance(leaf, torch.Tensor) else leaf, tree)


def local_part(tensor: torch.Tensor) -> torch.Tensor:
    """The part of a tensor this rank holds: a DTensor's local shard (no copy), a plain tensor
    itself."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if to_local is not None else tensor


def like_param(value: Any, param: torch.Tensor) -> Any:
    """`value`, a parameter's optimizer state as a rank's local part, placed as `param` is: a
    DTensor with the parameter's mesh and placements where the parameter is one and the value
    has its local shape (a moment), else the value itself (a step count, a plain tensor)."""
    from torch.distributed.tensor import DTensor

    if not isinstance(param, DTensor) or not isinstance(value, torch.Tensor):
        return value
    if value.shape != param.to_local().shape:
        return value
    return DTensor.from_local(
        value.to(param.device),
        param.device_mesh,
        param.placements,
        shape=param.shape,
        stride=param.stride(),
    )


def tensor_leaves(tree: Any) -> list[torch.Tensor]:
    """Every tensor in `tree`, in order."""
    return [leaf for leaf in pytree.tree_leaves(tree) if isinstance(leaf, torch.Tensor)]


# ---------------------------------------------------------------------------------------------
# Dispatch modes (building FSDP shards without the whole model)

_missing_ops: list[str] = []


def aten_ops(*names: str) -> set:
    """The aten overloads named 'op.overload' that this torch has; the others are noted for
    `missing_aten_ops`."""
    found = set()
    for name in names:
        packet, overload = name.split(".")
        op = getattr(getattr(torch.ops.aten, packet, None), overload, None)
        if op is None:
            _missing_ops.append(name)
        else:
            found.add(op)
    return found


def missing_aten_ops() -> list[str]:
    """The overloads asked of `aten_ops` that this torch does not have."""
    return list(_missing_ops)


def is_in_place(func: Any) -> bool:
    """Whether an aten overload writes into its first argument (its name ends with '_')."""
    return func._schema.name.split("::")[-1].endswith("_")


# ---------------------------------------------------------------------------------------------
# Distributed checkpoints: reading without unpickling arbitrary objects


# A read step of DCP's: given the files it opens (relative to the reader's folder) and the read
# (which returns once every byte is read), it calls the read and returns what that returned.
ReadThrough = Callable[[list[str], Callable[[], Any]], Any]


def dcp_reader(
    path: str, read_metadata: Callable[[IO[bytes]], Any], read_through: ReadThrough | None = None
) -> Any:
    """DCP's file-system reader of `path`, reading its `.metadata` file with `read_metadata`
    instead of pickle.load; with `read_through`, each read step goes through it, given the
    files that the rank's read plan opens (to check them while DCP reads them: an error raised
    there is DCP's to report to every rank)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class Reader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            with open(os.path.join(path, ".metadata"), "rb") as f:
                metadata = read_metadata(f)
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

        def read_data(self, plan: Any, planner: Any) -> Any:
            if read_through is None:
                return super().read_data(plan, planner)
            names = sorted({self.storage_data[i.storage_index].relative_path for i in plan.items})
            read = super().read_data

            def read_and_wait() -> Any:
                future = read(plan, planner)
                future.wait()
                return future

            return read_through(names, read_and_wait)

    return Reader(path)


def dcp_writer(path: str, file_system: Any) -> Any:
    """DCP's file-system writer of `path` (each file fsynced), creating and renaming its files
    through `file_system` (a `torch.distributed.checkpoint.filesystem.FileSystem`)."""
    from torch.distributed.checkpoint import FileSystemWriter

    writer = FileSystemWriter(path, sync_files=True)
    writer.fs = file_system
    return writer


def dcp_set_element(state: dict[str, Any], path: Any, value: Any) -> None:
    """Put `value` at DCP's object path `path` (as its metadata's planner data gives it) into
    the nested `state`, making the dicts and lists on the way."""
    from torch.distributed.checkpoint._traverse import set_element

    set_element(state, path, value)


@contextlib.contextmanager
def pretended_mesh(size: int) -> Iterator[Any]:
    """A one-dimensional device mesh of `size` ranks on a process group whose collectives do
    nothing (torch's fake backend: no other process, no port), this process its rank 0: a model
    split over it traces the forward that rank 0 of a real group runs. Destroyed on leaving."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    torch_dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=size)
    try:
        yield init_device_mesh("cpu", (size,))
    finally:
        torch_dist.destroy_process_group()


def fake_tensor_mode() -> Any:
    """A mode in which tensors have shapes and dtypes but no memory (inputs that are not fake
    are taken too): a model's forward traced at any size, for what it saves for backward."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode(allow_non_fake_inputs=True)


def dcp_planner(load_bytes: Callable[[IO[bytes]], Any]) -> Any:
    """DCP's default load planner, reading the values it stored as bytes (anything that is not a
    tensor) with `load_bytes` instead of torch.load(weights_only=False)."""
    from torch.distributed.checkpoint import DefaultLoadPlanner
    from torch.distributed.checkpoint._traverse import set_element

    class Planner(DefaultLoadPlanner):
        def load_bytes(self, read_item: Any, value: IO[bytes]) -> None:
            loaded = load_bytes(value)
            fqn = read_item.dest_index.fqn
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[fqn], loaded)
            else:
                self.state_dict[fqn] = loaded

    return Planner()


# ---------------------------------------------------------------------------------------------
# Compilation


def inductor_settings(settings: dict[str, Any]) -> Any:
    """A context in which inductor's config has `settings`. torch.compile's `options` do not
    reach every reader of them: `freezing` given there leaves the x86 int8 weight-packing ops
    to run on fake tensors, which they cannot."""
    import torch._inductor.config

    return torch._inductor.config.patch(settings)
