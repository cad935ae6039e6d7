"""Building a model for FSDP without building it whole: each rank keeps only its own shard.

FSDP2 splits every parameter along its first dimension into `shards` equal chunks (the last ones
may be shorter or empty) and rank r keeps chunk r. `build_local` runs the model's own constructor,
unchanged, under a dispatch mode in which every large tensor it creates holds only those rows:

- random initialisation (`uniform_`, `normal_`, a random factory, ...) is drawn for the whole
  tensor, one tensor at a time, from the same random stream as an ordinary construction, and
  only this rank's rows are kept: the values are bit-identical to the eager model's;
- element-wise operations (`fill_`, `mul_`, `erfinv_`, `clamp_`, `copy_`, conversions, ...) are
  applied to the rows alone;
- small tensors (biases, norms, buffers: up to `FULL_BYTES`) are ordinary tensors.

Anything else done to a large tensor during construction (a matrix decomposition, writing into a
view) cannot be replayed row by row: `build_local` raises `NotReplayable` and the caller builds
the model eagerly instead, saying why. `materialize` then copies the kept values into the sharded
model that `fully_shard` made of the same model on the meta device. Peak memory: the rows of
every parameter, plus one full tensor at a time.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch import nn

from dtrain.process import compat, dist
from dtrain.process.compat import TorchDispatchMode, aten_ops, is_in_place, tree_map_tensors

FULL_BYTES = 1 << 20  # tensors up to this size are built whole


RANDOM_IN_PLACE = aten_ops(
    "uniform_.default",
    "normal_.default",
    "bernoulli_.float",
    "bernoulli_.Tensor",
    "random_.default",
    "random_.from",
    "random_.to",
    "exponential_.default",
    "log_normal_.default",
    "cauchy_.default",
    "geometric_.default",
)
RANDOM_FACTORIES = aten_ops(
    "randn.default",
    "randn.generator",
    "rand.default",
    "rand.generator",
    "randint.default",
    "randint.low",
    "normal.float_float",
    "randperm.default",
)
FACTORIES = aten_ops(
    "empty.memory_format", "zeros.default", "ones.default", "full.default", "empty_strided.default"
)
VIEWS = aten_ops(
    "select.int",
    "slice.Tensor",
    "t.default",
    "view.default",
    "reshape.default",
    "unsqueeze.default",
    "transpose.int",
    "permute.default",
    "expand.default",
)
DETACH = aten_ops("detach.default", "alias.default")
LIKE = aten_ops(
    "empty_like.default", "zeros_like.default", "ones_like.default", "full_like.default"
)
# Reductions of a whole tensor to one value: this rank's rows, then all ranks' results combined.
REDUCTIONS = {
    op: how
    for names, how in (
        (("any.default", "max.default", "amax.default"), "max"),
        (("all.default", "min.default", "amin.default"), "min"),
        (("sum.default",), "sum"),
    )
    for op in aten_ops(*names)
}
ROW_WISE = aten_ops(
    "copy_.default",
    "_to_copy.default",
    "clone.default",
    "fill_.Scalar",
    "fill_.Tensor",
    "zero_.default",
)


class NotReplayable(Exception):
    """The constructor did something to a large tensor that rows alone cannot reproduce."""


def shard_rows(rows: int, shards: int, index: int) -> tuple[int, int]:
    """The rows [start, stop) of dim 0 that shard `index` of `shards` holds (torch.chunk's split,
    which is FSDP2's)."""
    chunk = math.ceil(rows / shards) if rows else 0
    start = min(rows, index * chunk)
    return start, min(rows, start + chunk)


class Rows(torch.Tensor):
    """A tensor of `shape` of which only rows [start, stop) exist, in `local`."""

    local: torch.Tensor
    start: int
    stop: int

    @staticmethod
    def __new__(cls, shape: torch.Size, local: torch.Tensor, start: int, stop: int) -> Rows:
        out = compat.wrapper_subclass(cls, shape, local)
        out.local, out.start, out.stop = local, start, stop
        return out

    # mypy rejects any annotated override of Tensor.__repr__ (its keyword-only argument),
    # even one with the same signature; torch's own subclasses ignore it the same way.
    def __repr__(self) -> str:  # type: ignore[override]  # pragma: no cover - debugging only
        return f"Rows(shape={tuple(self.shape)}, rows={self.start}:{self.stop})"

    # torch's stub types Tensor.__torch_dispatch__ as the plain disabled function it is set to;
    # the dispatcher calls a subclass's as a classmethod (torch's own subclasses ignore it too).
    @classmethod
    def __torch_dispatch__(  # type: ignore[override]
        cls, func: Any, types: Any, args: tuple = (), kwargs: Any = None
    ) -> Any:
        raise NotReplayable(f"{func} outside the construction")


class _Construction(TorchDispatchMode):
    def __init__(self, shards: int, index: int, values: bool = True) -> None:
        super().__init__()
        self.shards, self.index, self.values = shards, index, values
        self.views: set[int] = set()  # meta tensors that stand for views of rows

    def _rows_of(self, full: torch.Tensor) -> Rows:
        start, stop = shard_rows(full.shape[0], self.shards, self.index)
        if not self.values:  # no memory: the values come later (build_local)
            local = torch.empty((stop - start, *full.shape[1:]), dtype=full.dtype, device="meta")
            return Rows(full.shape, local, start, stop)
        return Rows(full.shape, full[start:stop].clone(), start, stop)

    @staticmethod
    def _large(shape: Any, dtype: torch.dtype | None) -> bool:
        shape = list(shape)
        if not shape or shape[0] < 2:
            return False
        return math.prod(shape) * (dtype or torch.get_default_dtype()).itemsize > FULL_BYTES

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        rows = [a for a in (*args, *kwargs.values()) if isinstance(a, Rows)]
        if not rows:
            if (
                args
                and isinstance(args[0], torch.Tensor)
                and id(args[0]) in self.views
                and is_in_place(func)
            ):
                raise NotReplayable(f"{func} writes into a view of a large tensor")
            out = func(*args, **kwargs)
            if (
                (func in FACTORIES or func in RANDOM_FACTORIES)
                and isinstance(out, torch.Tensor)
                and self._large(out.shape, out.dtype)
            ):
                return self._rows_of(out)  # built whole once (random draws as usual), rows kept
            return out
        target = args[0] if args and isinstance(args[0], Rows) else rows[0]
        if func in RANDOM_IN_PLACE and args[0] is target:
            full = torch.empty(target.shape, dtype=target.dtype)
            func(full, *args[1:], **kwargs)  # the same draws as on the whole tensor
            target.local.copy_(full[target.start : target.stop])
            return target
        if func in DETACH:
            return Rows(target.shape, target.local, target.start, target.stop)
        if func in LIKE and args[0] is target:  # a new tensor of the same rows
            return Rows(
                target.shape, func(target.local, *args[1:], **kwargs), target.start, target.stop
            )
        if func in REDUCTIONS and args[0] is target and len(args) == 1:
            return self._reduce(func, target)
        if func in VIEWS:
            # Read for its shape only (fan-in/fan-out); a later write into it is refused.
            stand_in = func(
                torch.empty(target.shape, dtype=target.dtype, device="meta"), *args[1:], **kwargs
            )
            self.views.add(id(stand_in))
            return stand_in
        if torch.Tag.pointwise in func.tags or func in ROW_WISE:
            return self._pointwise(func, target, args, kwargs)
        raise NotReplayable(f"{func} on a {list(target.shape)} tensor")

    @staticmethod
    def _reduce(func: Any, target: Rows) -> torch.Tensor:
        """A whole-tensor reduction (as `trunc_normal_`'s `mask.any()`): every rank reduces its
        rows, and the ranks combine theirs, so that all decide the same, as on the whole tensor.
        Every rank builds the model at the same time, so the collectives meet."""
        import torch.distributed as torch_dist

        how = REDUCTIONS[func]
        local = target.local
        if local.numel():
            value = func(local).double()
        else:  # a rank without rows of this tensor contributes the neutral element
            value = torch.tensor(
                {"max": -math.inf, "min": math.inf, "sum": 0.0}[how], dtype=torch.float64
            )
        if dist.is_distributed():
            op = {
                "max": torch_dist.ReduceOp.MAX,
                "min": torch_dist.ReduceOp.MIN,
                "sum": torch_dist.ReduceOp.SUM,
            }[how]
            value = value.reshape(1)
            torch_dist.all_reduce(value, op=op)
        dtype = torch.bool if func.__name__.startswith(("any", "all")) else target.dtype
        return value.reshape(()).to(dtype)

    def _pointwise(self, func: Any, target: Rows, args: tuple, kwargs: dict) -> Any:
        def local(value: Any) -> Any:
            if isinstance(value, Rows):
                if (value.shape[0], value.start, value.stop) != (
                    target.shape[0],
                    target.start,
                    target.stop,
                ):
                    raise NotReplayable(f"{func} mixes tensors of different rows")
                return value.local
            if (
                isinstance(value, torch.Tensor)
                and value.dim() == target.dim()
                and value.shape[0] == target.shape[0]
                and value.shape[0] > 1
            ):
                return value[target.start : target.stop]  # a whole tensor of the same rows
            return value  # a scalar, or a tensor that broadcasts along the rows

        out = func(*tree_map_tensors(local, args), **tree_map_tensors(local, kwargs))
        if is_in_place(func) and args and args[0] is target:
            return target
        if (
            isinstance(out, torch.Tensor)
            and out.dim()
            and out.shape[0] == target.stop - target.start
        ):
            return Rows(
                torch.Size([target.shape[0], *out.shape[1:]]), out, target.start, target.stop
            )
        raise NotReplayable(f"{func} gives a result that is not row-wise")


def build_local(
    build: Callable[[], nn.Module],
    shards: int,
    index: int,
    values: bool = True,
    prepare: Callable[[nn.Module], object] | None = None,
) -> tuple[nn.Module, dict[str, Any], dict[str, Any]]:
    """Run `build`, then `prepare` on the model it built (layers swapped: their new tensors are
    made the same way), with large tensors holding only the rows of shard `index` of `shards`.
    Returns the model with meta tensors in place of its parameters and buffers (ready for
    fully_shard), and the values kept for them by name. Without `values` (the weights are read
    afterwards, into the shards: `materialize`), large tensors keep no rows either. Raises
    NotReplayable (for any failure: the eager build that follows raises the constructor's own
    errors; and where `prepare` left a tied parameter untied, as a layer swapped on a tensor
    without values may)."""
    try:
        with _Construction(shards, index, values):
            model = build()
            if prepare is not None:
                ties = _ties(model)
                prepare(model)
                if _ties(model) != ties:
                    raise NotReplayable("preparing the model untied its tied parameters")
    except NotReplayable:
        raise
    except Exception as e:  # noqa: BLE001 - see the docstring
        raise NotReplayable(f"{type(e).__name__}: {e}") from None
    params = dict(model.named_parameters(remove_duplicate=False))
    buffers = dict(model.named_buffers(remove_duplicate=False))
    large_buffers = [name for name, b in buffers.items() if isinstance(b, Rows)]
    if large_buffers:
        raise NotReplayable(
            f"buffer {large_buffers[0]} is larger than {FULL_BYTES} bytes "
            f"(FSDP does not shard buffers)"
        )
    to_meta(model)
    return model, params, buffers


def _ties(model: nn.Module) -> list[list[str]]:
    """The names of each parameter held under more than one name."""
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    return sorted(same for same in names.values() if len(same) > 1)


class WeightReader(Protocol):
    """Where `fill_from` reads a model's weights by name (models/hf.py's WeightFiles)."""

    def shape(self, key: str) -> tuple[int, ...] | None: ...
    def rows(self, key: str, start: int, stop: int) -> torch.Tensor: ...
    def whole(self, key: str) -> torch.Tensor: ...


def materialize(
    sharded: nn.Module,
    params: dict[str, Any],
    buffers: dict[str, Any],
    weights: WeightReader | None = None,
) -> None:
    """Copy the values `build_local` kept into `sharded` (the same model, wrapped by fully_shard
    and materialised with `to_empty`): each rank's parameter shards, and whole buffers. With
    `weights`, the values of every tensor `weights` holds under its name are read from there
    instead, straight into the shard: of a sharded parameter, this rank's rows alone."""
    names: dict[int, list[str]] = {}  # a tensor tied under two names is one tensor
    tensors = dict(sharded.named_parameters(remove_duplicate=False))
    for name, param in tensors.items():
        names.setdefault(id(param), []).append(name)
    with torch.no_grad():
        for same in names.values():
            param = tensors[same[0]]
            source, target = params[same[0]], compat.local_part(param)
            shape = tuple(param.shape)
            held = [n for n in same if weights is not None and weights.shape(n) == shape]
            if weights is not None and held:
                if hasattr(param, "to_local"):
                    target.copy_(weights.rows(held[0], *_rows_of_dtensor(param)))
                else:
                    target.copy_(weights.whole(held[0]))
            elif isinstance(source, Rows):
                target.copy_(source.local)
            elif hasattr(param, "to_local"):
                start, stop = _rows_of_dtensor(param)
                target.copy_(source[start:stop])
            else:
                target.copy_(source)
        for name, buffer in sharded.named_buffers(remove_duplicate=False):
            if weights is not None and weights.shape(name) == tuple(buffer.shape):
                buffer.copy_(weights.whole(name))
            else:
                buffer.copy_(buffers[name])


def _rows_of_dtensor(param: Any) -> tuple[int, int]:
    """The rows of dim 0 this rank holds of an FSDP2 parameter (a DTensor sharded on dim 0 over
    the mesh's last dimension)."""
    mesh = param.device_mesh
    shards = mesh.size(mesh.ndim - 1)
    index = mesh.get_local_rank(mesh.ndim - 1)
    return shard_rows(param.shape[0], shards, index)


def to_meta(model: nn.Module) -> None:
    """Replace every parameter and buffer by a meta tensor of its shape (ties kept), so that
    fully_shard and to_empty can make the sharded model."""
    replaced: dict[int, Any] = {}
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is None:
                continue
            if id(param) not in replaced:
                replaced[id(param)] = nn.Parameter(
                    torch.empty(param.shape, dtype=param.dtype, device="meta"),
                    requires_grad=param.requires_grad,
                )
            module._parameters[name] = replaced[id(param)]
        for name, buffer in list(module._buffers.items()):
            if buffer is not None:
                module._buffers[name] = torch.empty(buffer.shape, dtype=buffer.dtype, device="meta")
