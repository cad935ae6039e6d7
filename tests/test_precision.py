"""The precision object on its own: what each train.precision autocasts, scales and reports
(the runs in test_fsdp/test_ema train with it end to end)."""

from __future__ import annotations

import torch
from torch import nn

from dtrain.parallel.precision import Precision

CPU = torch.device("cpu")


def _step(precision: Precision, loss_factor: float) -> tuple[torch.Tensor | None, bool]:
    """One step; whether it changed the weights."""
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    start = model.weight.detach().clone()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with precision.autocast():
        loss = model(torch.ones(3, 4)).float().sum() * loss_factor
    precision.backward(loss)
    precision.unscale(optimizer)
    return precision.step(optimizer), not torch.equal(model.weight.detach(), start)


def test_bf16_autocasts_except_under_fsdp_whose_policy_casts() -> None:
    x, w = torch.ones(2, 4), torch.ones(3, 4)
    bf16 = Precision("bf16", CPU, sharded=False)
    with bf16.autocast():
        assert (x @ w.T).dtype == torch.bfloat16
    sharded = Precision("bf16", CPU, sharded=True)
    with sharded.autocast():
        assert (x @ w.T).dtype == torch.float32
    policy = sharded.fsdp_policy()
    assert (policy.param_dtype, policy.reduce_dtype) == (torch.bfloat16, torch.float32)
    assert not bf16.scaled and bf16.loss_scale() is None and bf16.checkpoint_parts() == {}


def test_fp32_neither_casts_nor_scales() -> None:
    fp32 = Precision("fp32", CPU, sharded=False)
    with fp32.autocast():
        assert (torch.ones(2, 4) @ torch.ones(4, 3)).dtype == torch.float32
    assert not fp32.scaled and fp32.checkpoint_parts() == {}


def test_fp16_scales_steps_and_reports_an_overflow_it_skipped() -> None:
    fp16 = Precision("fp16", CPU, sharded=False, loss_scale_init=1024.0)
    assert fp16.scaled and set(fp16.checkpoint_parts()) == {"scaler"}
    skipped, changed = _step(fp16, 1.0)
    assert skipped is not None and not bool(skipped) and changed
    assert fp16.loss_scale() == 1024.0

    fp16_overflow = Precision("fp16", CPU, sharded=False, loss_scale_init=1024.0)
    skipped, changed = _step(fp16_overflow, float("inf"))
    assert skipped is not None and bool(skipped) and not changed
    assert fp16_overflow.loss_scale() == 512.0  # an overflow halves the scale
