"""The torch internals of dtrain.process.compat, each checked against the installed torch: when a torch
release renames or changes one, the test of that one fails here, by name."""

from __future__ import annotations

import datetime
import multiprocessing
from collections import OrderedDict, namedtuple

import pytest
import torch
import torch.distributed as torch_dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dtrain.process import compat, dist


# -- the optimizer's masked step ----------------------------------------------------------------

def _adam_after_one_step(fused: bool = True) -> tuple[nn.Parameter, torch.optim.Optimizer]:
    param = nn.Parameter(torch.ones(4))
    optimizer = torch.optim.Adam([param], lr=0.1, fused=fused)
    param.grad = torch.full((4,), 0.5)
    optimizer.step()
    param.grad = torch.tensor([0.5, -1.0, 2.0, 0.25])
    return param, optimizer


def test_fused_optimizers_take_a_masked_step_and_plain_ones_do_not() -> None:
    param = nn.Parameter(torch.ones(2))
    assert compat.masked_step_supported(torch.optim.Adam([param], fused=True))
    assert compat.masked_step_supported(torch.optim.AdamW([param], fused=True))
    assert compat.masked_step_supported(torch.optim.SGD([param], lr=0.1, fused=True))
    assert not compat.masked_step_supported(torch.optim.Adam([param], fused=False))
    assert not compat.masked_step_supported(torch.optim.SGD([param], lr=0.1))


def test_a_masked_step_with_found_inf_changes_neither_params_nor_state() -> None:
    param, optimizer = _adam_after_one_step()
    params_before = param.detach().clone()
    state_before = {k: v.clone() for k, v in optimizer.state[param].items()}
    compat.masked_step(optimizer, torch.tensor(1.0))
    assert torch.equal(param, params_before)
    assert all(torch.equal(optimizer.state[param][k], v) for k, v in state_before.items())
    assert not hasattr(optimizer, "found_inf") and not hasattr(optimizer, "grad_scale")


def test_a_masked_step_without_found_inf_is_an_ordinary_step() -> None:
    param, optimizer = _adam_after_one_step()
    reference, reference_optimizer = _adam_after_one_step()
    compat.masked_step(optimizer, torch.tensor(0.0))
    reference_optimizer.step()
    assert not torch.equal(param, torch.ones(4))
    assert torch.equal(param, reference)
    assert int(optimizer.state[param]["step"]) == 2


def test_foreach_norms_and_the_nonfinite_flag_leave_every_bit() -> None:
    grads = [torch.tensor([3.0, 4.0]), torch.tensor([[1.0, 2.0], [2.0, 4.0]])]
    kept = [g.clone() for g in grads]
    norms = compat.foreach_norms(grads)
    assert [float(n) for n in norms] == [5.0, 5.0]
    one = torch.ones(1)
    found = torch.zeros(())
    compat.flag_nonfinite(grads, found, one)
    assert float(found) == 0.0 and all(torch.equal(g, k) for g, k in zip(grads, kept))
    grads[1][0, 1] = float("nan")
    compat.flag_nonfinite(grads, found, one)
    assert float(found) == 1.0
    found.zero_()
    compat.flag_nonfinite([torch.tensor([1.0, float("-inf")])], found, one)
    assert float(found) == 1.0


# -- process group, loaders, timeouts ----------------------------------------------------------

@pytest.fixture
def one_rank_group():
    torch_dist.init_process_group("gloo", store=torch_dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        torch_dist.destroy_process_group()


def test_the_default_store_is_the_groups_rendezvous_store(one_rank_group) -> None:
    store = compat.default_store()
    store.set("dtrain/test", "value")
    assert store.check(["dtrain/test"]) and store.get("dtrain/test") == b"value"
    # what dist builds on it: the ranks that report back, and a rank's last word
    assert dist.ranks_not_arriving("t", wait_s=1.0) == []
    dist.announce_abort("data error: unreadable")
    assert dist.abort_message(wait_s=0.1) == "data error: unreadable"


def test_the_collective_timeout_can_be_changed_after_init(one_rank_group) -> None:
    compat.set_default_timeout(datetime.timedelta(seconds=7))
    tensor = torch.ones(1)
    torch_dist.all_reduce(tensor)
    assert tensor.item() == 1.0


def test_shutting_down_a_loaders_persistent_workers() -> None:
    loader = DataLoader(TensorDataset(torch.arange(8.0)), batch_size=2, num_workers=1,
                        persistent_workers=True)
    assert len(list(loader)) == 4
    assert multiprocessing.active_children()
    compat.shutdown_workers(loader)
    assert not multiprocessing.active_children()
    compat.shutdown_workers(DataLoader(TensorDataset(torch.arange(2.0))))  # never iterated: no-op


# -- trees of tensors -----------------------------------------------------------------------------

Pair = namedtuple("Pair", "x y")


def test_tree_helpers_walk_dicts_lists_tuples_and_namedtuples() -> None:
    tree = {"a": [torch.ones(1), (torch.zeros(2), "label")], "b": Pair(torch.ones(3), 4),
            "c": OrderedDict(d=torch.ones(4))}
    doubled = compat.tree_map_tensors(lambda t: t * 2, tree)
    assert isinstance(doubled["b"], Pair) and doubled["b"].y == 4
    assert isinstance(doubled["c"], OrderedDict) and doubled["a"][1][1] == "label"
    assert torch.equal(doubled["b"].x, torch.full((3,), 2.0))
    assert [t.numel() for t in compat.tensor_leaves(tree)] == [1, 2, 3, 4]
    assert compat.tensor_leaves(torch.ones(5))[0].numel() == 5


# -- dispatch modes ----------------------------------------------------------------------------

def test_every_aten_op_dtrain_names_exists(monkeypatch) -> None:
    import dtrain.parallel.sharded_init  # noqa: F401 - builds its op lists on import

    assert compat.missing_aten_ops() == []
    monkeypatch.setattr(compat, "_missing_ops", [])
    assert compat.aten_ops("no_such_op.default", "add.Tensor") == {torch.ops.aten.add.Tensor}
    assert compat.missing_aten_ops() == ["no_such_op.default"]


def test_a_dispatch_mode_sees_aten_overloads_with_their_schema_and_tags() -> None:
    seen = []

    class Record(compat.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            return func(*args, **(kwargs or {}))

    with Record():
        torch.empty(3).fill_(1.0).mul(2.0)
    assert torch.ops.aten.fill_.Scalar in seen and torch.ops.aten.mul.Tensor in seen
    assert compat.is_in_place(torch.ops.aten.fill_.Scalar)
    assert not compat.is_in_place(torch.ops.aten.mul.Tensor)
    assert torch.Tag.pointwise in torch.ops.aten.mul.Tensor.tags


# -- distributed checkpoints -------------------------------------------------------------------

def test_dcp_reads_metadata_and_byte_values_through_our_functions(tmp_path) -> None:
    import pickle

    saved = {"model": {"w": torch.arange(4.0)}, "meta": {"step": 7, "name": "run"}}
    dcp.save(saved, storage_writer=dcp.FileSystemWriter(str(tmp_path)), no_dist=True)
    calls = {"metadata": 0, "bytes": 0}

    def read_metadata(f):
        calls["metadata"] += 1
        return pickle.load(f)

    def load_bytes(value):
        calls["bytes"] += 1
        return torch.load(value, weights_only=True)

    state = {"model": {"w": torch.zeros(4)}, "meta": {"step": 0, "name": ""}}
    dcp.load(state, storage_reader=compat.dcp_reader(str(tmp_path), read_metadata),
             planner=compat.dcp_planner(load_bytes), no_dist=True)
    assert torch.equal(state["model"]["w"], torch.arange(4.0))
    assert state["meta"] == {"step": 7, "name": "run"}
    assert calls["metadata"] >= 1 and calls["bytes"] == 2


def test_norm_layers_cover_batch_instance_layer_and_group_norms() -> None:
    for layer in (nn.BatchNorm2d(2), nn.InstanceNorm2d(2), nn.LayerNorm(2), nn.GroupNorm(1, 2)):
        assert isinstance(layer, compat.NORM_LAYERS)
    assert not isinstance(nn.Linear(2, 2), compat.NORM_LAYERS)


def test_dcp_set_element_fills_a_nested_state_along_its_path() -> None:
    state: dict = {}
    compat.dcp_set_element(state, ("optimizer", "state", "0", "exp_avg"), torch.ones(2))
    compat.dcp_set_element(state, ("optimizer", "param_groups", 0, "lr"), 0.5)
    assert torch.equal(state["optimizer"]["state"]["0"]["exp_avg"], torch.ones(2))
    assert state["optimizer"]["param_groups"] == [{"lr": 0.5}]


def test_the_fake_tensor_mode_gives_shapes_without_memory() -> None:
    layer = torch.nn.Linear(4096, 4096)
    with compat.fake_tensor_mode():
        out = layer(torch.randn(64, 4096))
        assert out.shape == (64, 4096) and out.dtype == torch.float32
    assert type(out).__name__ == "FakeTensor"


def test_the_fused_average_updates_equal_their_formulas() -> None:
    torch.manual_seed(0)
    values = [torch.randn(3), torch.randn(2, 2)]
    start = [torch.randn(3), torch.randn(2, 2)]
    copied = [torch.empty(3), torch.empty(2, 2)]
    compat.foreach_copy(copied, values)
    assert all(torch.equal(c, v) for c, v in zip(copied, values))
    lerped = [s.clone() for s in start]
    compat.foreach_lerp(lerped, values, 0.25)
    assert all(torch.allclose(x, s + 0.25 * (v - s)) for x, s, v in zip(lerped, start, values))
    moved = [s.clone() for s in start]
    compat.foreach_move_towards(moved, values, torch.tensor(0.25))
    assert all(torch.allclose(m, x) for m, x in zip(moved, lerped))
    kept = [s.clone() for s in start]
    compat.foreach_move_towards(kept, values, torch.tensor(0.0))  # a skipped step
    assert all(torch.equal(k, s) for k, s in zip(kept, start))


def test_a_wrapper_subclass_has_the_shape_and_kind_but_no_storage_of_its_own() -> None:
    class Wrapped(torch.Tensor):
        @classmethod
        def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # never called here
            raise NotImplementedError

    like = torch.zeros(2, dtype=torch.float16)
    out = compat.wrapper_subclass(Wrapped, torch.Size([5, 4]), like)
    assert type(out) is Wrapped and out.shape == (5, 4)
    assert out.dtype == torch.float16 and out.device == like.device


# -- the grad scaler ----------------------------------------------------------------------------

def test_the_scalers_found_inf_flags_say_whether_it_skipped_the_step() -> None:
    param = nn.Parameter(torch.ones(2))
    optimizer = torch.optim.SGD([param], lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    assert compat.scaler_found_inf(scaler, optimizer) == []  # nothing unscaled yet
    for grad, skipped in ((torch.tensor([1.0, float("inf")]), 1.0), (torch.ones(2), 0.0)):
        scaler.scale(param.sum()).backward()
        param.grad = grad * scaler.get_scale()
        scaler.step(optimizer)
        found = compat.scaler_found_inf(scaler, optimizer)
        assert [float(f) for f in found] == [skipped]
        scaler.update()
        optimizer.zero_grad()


# -- what DCP reads and writes goes through our functions ---------------------------------------

def test_dcp_writes_through_our_file_system_and_reads_through_our_step(tmp_path) -> None:
    import pickle

    from torch.distributed.checkpoint.filesystem import FileSystem

    class Recording(FileSystem):
        def __init__(self) -> None:
            super().__init__()
            self.created: list[str] = []

        def create_stream(self, path, mode):
            if "w" in mode:
                self.created.append(str(path.name))
            return super().create_stream(path, mode)

    recording = Recording()
    dcp.save({"w": torch.arange(4.0)}, storage_writer=compat.dcp_writer(str(tmp_path), recording),
             no_dist=True)
    assert any(n.endswith(".distcp") for n in recording.created)
    assert any(n.startswith(".metadata") for n in recording.created)
    steps: list[list[str]] = []

    def read_through(names, read):
        steps.append(names)
        return read()

    state = {"w": torch.zeros(4)}
    dcp.load(state, storage_reader=compat.dcp_reader(str(tmp_path), pickle.load, read_through),
             no_dist=True)
    assert torch.equal(state["w"], torch.arange(4.0))
    assert steps == [sorted(n for n in recording.created if n.endswith(".distcp"))]


# -- a replica group's heal: the streamed state, read weights-only ----------------------------

def test_a_streamed_state_reads_back_weights_only_and_code_is_refused():
    import io
    import os

    from torch.distributed._serialization import _streaming_save

    state = {"user": {"model": {"w": torch.arange(6.0).view(2, 3)}, "step": 7},
             "torchft": {"step": 7, "batches_committed": 14}}
    buffer = io.BytesIO()
    _streaming_save(state, buffer)
    buffer.seek(0)
    back = compat.stream_load_weights_only(buffer)
    assert torch.equal(back["user"]["model"]["w"], state["user"]["model"]["w"])
    assert back["torchft"] == state["torchft"]

    class Runs:  # what a crafted peer could serve: an object whose unpickling runs code
        def __reduce__(self):
            return (os.system, ("echo crafted",))

    crafted = io.BytesIO()
    _streaming_save({"user": Runs()}, crafted)
    crafted.seek(0)
    with pytest.raises(Exception, match="(?i)weights.only|unsupported|global"):
        compat.stream_load_weights_only(crafted)


def test_like_param_leaves_the_state_of_a_plain_parameter_as_it_is():
    # (a DTensor parameter's: tests/test_replicas.py, FSDP groups healed shard by shard)
    plain = torch.zeros(3)
    moment = torch.ones(3)
    assert compat.like_param(moment, plain) is moment  # no DTensor: the value itself
    step = torch.tensor(5.0)
    assert compat.like_param(step, plain) is step
