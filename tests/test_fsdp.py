"""FSDP2 against DDP on 2 CPU ranks: same numbers, half the state, and the loop features around it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from conftest import launch

pytestmark = pytest.mark.slow

STEPS = 10
TRANSFORMER = ["model.name=transformer", "model.args={dim: 32, depth: 2, heads: 2}",
               f"train.max_steps={STEPS}", "ckpt.format=full", "train.clip_grad_norm=0.5"]


def run(tmp_path: Path, name: str, *overrides: str):
    result = launch(tmp_path / "runs" / name, [*TRANSFORMER, *overrides], nproc=2)
    assert result.returncode == 0, result.stderr[-4000:]
    return result


def weights(result) -> dict:
    latest = (result.run_dir / "checkpoints" / "latest").read_text().strip()
    return torch.load(result.run_dir / "checkpoints" / latest / "checkpoint.pt", weights_only=True)["model"]


def assert_close_runs(a, b, tol: float = 1e-5) -> None:
    losses_a, losses_b = a.losses(), b.losses()
    assert sorted(losses_a) == sorted(losses_b) == list(range(1, STEPS + 1))
    for step in losses_a:
        assert abs(losses_a[step] - losses_b[step]) <= tol, (step, losses_a[step], losses_b[step])
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys()
    for name in wa:
        torch.testing.assert_close(wa[name], wb[name], atol=tol, rtol=0, msg=name)


@pytest.fixture(scope="module")
def ddp(tmp_path_factory):
    return run(tmp_path_factory.mktemp("ddp"), "ddp", "parallel.mode=ddp")


@pytest.fixture(scope="module")
def fsdp(tmp_path_factory):
    return run(tmp_path_factory.mktemp("fsdp"), "fsdp", "parallel.mode=fsdp")


def test_fsdp_matches_ddp_losses_weights_and_grad_norms(ddp, fsdp) -> None:
    assert_close_runs(ddp, fsdp)
    norms_ddp = {r["step"]: r["grad_norm"] for r in ddp.records() if "grad_norm" in r}
    norms_fsdp = {r["step"]: r["grad_norm"] for r in fsdp.records() if "grad_norm" in r}
    assert len(norms_ddp) == STEPS and norms_ddp.keys() == norms_fsdp.keys()
    for step, norm in norms_ddp.items():
        assert norm > 0 and abs(norm - norms_fsdp[step]) <= 1e-5


def test_fsdp_holds_half_the_state_per_rank(ddp, fsdp) -> None:
    first_ddp, first_fsdp = ddp.records()[0], fsdp.records()[0]
    assert first_ddp["state_bytes"] == first_ddp["state_bytes_unsharded"]
    assert first_fsdp["state_bytes_unsharded"] == first_ddp["state_bytes"]
    ratio = first_fsdp["state_bytes"] / first_ddp["state_bytes"]
    assert 0.49 <= ratio <= 0.51, ratio
    assert "unsharded, as under DDP" in (fsdp.run_dir / "log.txt").read_text()


# Activation checkpointing and accumulating two half batches each leave the numbers as they
# are, so one run of each mode has both, and is compared with the plain runs by the tests of
# either: ddp_ac_accum by the DDP activation checkpointing and the DDP accumulation tests,
# fsdp_keep_ac_accum (no resharding too) by the FSDP ones.
ACCUMULATE = ["train.grad_accum=2", "data.batch_size=8"]


@pytest.fixture(scope="module")
def ddp_ac_accum(tmp_path_factory):
    return run(tmp_path_factory.mktemp("ddp_ac_accum"), "ddp_ac_accum", "parallel.mode=ddp",
               "model.activation_checkpointing=true", *ACCUMULATE)


@pytest.fixture(scope="module")
def fsdp_keep_ac_accum(tmp_path_factory):
    return run(tmp_path_factory.mktemp("fsdp_keep_ac_accum"), "fsdp_keep_ac_accum",
               "parallel.mode=fsdp", "parallel.fsdp.reshard_after_forward=false",
               "model.activation_checkpointing=true", *ACCUMULATE)


def test_fsdp_without_resharding_and_with_activation_checkpointing_matches(
        ddp, fsdp_keep_ac_accum) -> None:
    assert_close_runs(ddp, fsdp_keep_ac_accum)


def test_activation_checkpointing_gives_the_same_losses_under_ddp(ddp, ddp_ac_accum) -> None:
    assert_close_runs(ddp, ddp_ac_accum)


def test_hybrid_sharding_matches_ddp(ddp, tmp_path) -> None:
    other = run(tmp_path, "hsdp", "parallel.mode=fsdp", "parallel.fsdp.hybrid_replicas=2")
    assert_close_runs(ddp, other)


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_accumulating_two_half_batches_equals_one_full_batch(request, ddp, fsdp, mode) -> None:
    reference = ddp if mode == "ddp" else fsdp
    accumulated = request.getfixturevalue("ddp_ac_accum" if mode == "ddp" else "fsdp_keep_ac_accum")
    assert_close_runs(reference, accumulated)


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_bf16_trains(tmp_path, mode) -> None:
    result = run(tmp_path, f"bf16_{mode}", f"parallel.mode={mode}", "train.precision=bf16",
                 "train.overfit_batches=1", "train.epochs=25", "train.max_steps=25", "optim.name=adam", "optim.lr=0.003")
    losses = [result.losses()[s] for s in sorted(result.losses())]
    assert losses[-1] < 0.5 * losses[0], losses


@pytest.mark.parametrize("mode, optim", [("ddp", "sgd"), ("fsdp", "sgd"), ("fsdp", "adamw")])
def test_fp16_scaler_skips_overflowing_steps(tmp_path, mode, optim) -> None:
    # A first loss scale of 2^40 overflows fp16 gradients: the scaler must skip those steps and
    # lower the scale on every rank until the gradients fit, and training then goes on. (FSDP
    # with a fused AdamW: its step takes the scaler's flag of every rank.)
    result = run(tmp_path, f"fp16_{mode}_{optim}", f"parallel.mode={mode}", f"optim.name={optim}",
                 "train.precision=fp16", "train.loss_scale_init=1099511627776")
    scales = [r["loss_scale"] for r in result.records() if "loss_scale" in r]
    assert len(scales) == STEPS
    assert scales[-1] < 2.0 ** 40
    assert all(b <= a for a, b in zip(scales, scales[1:]))
    assert all(torch.isfinite(torch.tensor(v)) for v in result.losses().values())
    for tensor in weights(result).values():
        assert torch.isfinite(tensor).all()
