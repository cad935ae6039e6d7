"""One resolved layout: what a launch means, worked out once from (Env, the parallel strategy's
mesh), read by the run, the plan, the trainer and the checkpointer."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from conftest import TINY, launch

from dtrain import config, parallel
from dtrain.commands.plan import command as plan
from dtrain.core.errors import UserError
from dtrain.data.sampler import epoch_steps
from dtrain.process import layout as layout_mod
from dtrain.process.env import Env
from dtrain.run.pieces import layout_of


def _env(world: int, rank: int = 0, nodes: int = 1) -> Env:
    return Env(launcher="torchrun" if world > 1 else "single", rank=rank, world_size=world,
               local_world_size=world // nodes, num_nodes=nodes)


def _cfg(*overrides: str) -> config.Config:
    return config.load(None, [*TINY, *overrides])


def resolve(cfg: config.Config, env: Env, device: torch.device | None = None) -> layout_mod.Layout:
    """The layout of `cfg` launched as `env`, as the run resolves it."""
    return layout_of(cfg, env, device)


def test_layout_of_each_mode() -> None:
    ddp = resolve(_cfg(), _env(4), torch.device("cpu"))
    assert (ddp.mode, ddp.shards, ddp.replicas, ddp.checkpoint_format) == ("ddp", 1, 1, "full")
    assert ddp.backend == "gloo" and ddp.effective_batch == 16 * 4
    fsdp = resolve(_cfg("parallel.mode=fsdp", "train.grad_accum=3"), _env(4, rank=3),
                   torch.device("cpu"))
    assert (fsdp.shards, fsdp.shard_index, fsdp.replicas) == (4, 3, 1)
    assert fsdp.checkpoint_format == "sharded" and fsdp.effective_batch == 16 * 4 * 3
    hsdp = resolve(_cfg("parallel.mode=fsdp", "parallel.fsdp.hybrid_replicas=2"),
                   _env(4, rank=3, nodes=2), torch.device("cpu"))
    assert (hsdp.replicas, hsdp.shards, hsdp.shard_index) == (2, 2, 1)
    # one process: nothing to wrap the model in, whatever the config says; a full checkpoint
    single = resolve(_cfg("parallel.mode=fsdp"), _env(1), torch.device("cpu"))
    assert (single.mode, single.backend, single.checkpoint_format) == ("none", None, "full")
    forced = resolve(_cfg("parallel.mode=fsdp", "ckpt.format=full"), _env(2), torch.device("cpu"))
    assert forced.checkpoint_format == "full"


def test_layouts_that_cannot_work_are_one_line() -> None:
    with pytest.raises(UserError, match="hybrid_replicas: 3 does not divide the world size 4"):
        resolve(_cfg("parallel.mode=fsdp", "parallel.fsdp.hybrid_replicas=3"), _env(4))
    with pytest.raises(UserError, match="'none' with 2 ranks"):
        resolve(_cfg("parallel.mode=none"), _env(2))
    with pytest.raises(UserError, match="nccl needs CUDA"):
        resolve(_cfg("dist.backend=nccl"), _env(2), torch.device("cpu"))


def test_steps_follow_the_loaders_rule() -> None:
    """Steps by arithmetic equal what the run's own loader yields, for uneven sizes too."""
    from dtrain import data

    for size, world, batch, accum, drop_last in [(512, 2, 16, 1, False), (517, 3, 16, 2, False),
                                                 (517, 3, 16, 2, True), (100, 4, 7, 1, False)]:
        cfg = _cfg(f"data.batch_size={batch}", f"train.grad_accum={accum}",
                   f"data.drop_last={str(drop_last).lower()}", "train.epochs=3")
        layout = resolve(cfg, _env(world), torch.device("cpu"))
        steps = epoch_steps(layout, cfg.train, cfg.data, size)
        train = torch.utils.data.TensorDataset(torch.zeros(size))
        for rank in range(world):
            loaders = data.loaders(train, train, cfg=cfg.data, seed=0, rank=rank, world_size=world,
                                   device=torch.device("cpu"))
            assert len(loaders.train) == steps.batches_per_epoch, (size, world, rank)
        assert steps.per_epoch == steps.batches_per_epoch // accum
        assert steps.total == 3 * steps.per_epoch
    cfg = _cfg("train.max_steps=5")
    layout = resolve(cfg, _env(2), torch.device("cpu"))
    assert epoch_steps(layout, cfg.train, cfg.data, 512).total == 5
    cfg = _cfg("train.grad_accum=64")
    with pytest.raises(UserError, match="fewer than train.grad_accum=64"):
        epoch_steps(resolve(cfg, _env(2), torch.device("cpu")), cfg.train, cfg.data, 512)


def test_plan_and_layout_agree_with_the_launch_they_describe() -> None:
    cfg = _cfg("parallel.mode=fsdp", "parallel.fsdp.hybrid_replicas=2", "train.grad_accum=2")
    estimate = plan.estimate(cfg, nproc=2, nnodes=2)
    layout = resolve(cfg, _env(4, nodes=2), torch.device("cpu"))
    assert estimate.fsdp_shards == layout.shards == 2
    assert estimate.checkpoint_format == layout.checkpoint_format == "sharded"
    assert estimate.effective_batch == layout.effective_batch == 16 * 4 * 2
    assert estimate.steps_per_epoch == epoch_steps(layout, cfg.train, cfg.data, 512).per_epoch


def test_console_lines_between_agreements_show_the_last_loss_read(run_dir: Path) -> None:
    """log.every_s lines fall between the ranks' agreements: they show the last loss read, with
    its step, never 'loss nan' for a finite loss."""
    result = launch(run_dir, ["log.every_s=0.001", "train.log_every=1000", "train.max_steps=12",
                              "train.check_every_steps=4", "log.progress=lines"])
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [line for line in result.stderr.splitlines() if re.search(r"\| step \d+ \| epoch", line)
             or re.search(r"\bstep \d+ \| epoch \d+ \| ", line)]
    assert len(lines) >= 6, result.stderr[-3000:]
    assert not any("loss nan" in line for line in lines), "\n".join(lines)
    for line in lines:
        step = int(re.search(r"step (\d+) \| epoch", line).group(1))
        if step < 4:  # before the first agreement no loss has been read: none is shown
            assert " loss " not in line, line
        elif step < 12:  # the loss read at the last agreement (every 4 steps), with its step
            assert f"loss_step {step - step % 4}" in line, line


def test_one_strategy_per_mode_answers_what_differs() -> None:
    """parallel/ picks the strategy from the section and the launch; nothing else names a mode."""
    from dtrain.parallel import strategies

    cases = [((), 4, strategies.DDP), (("parallel.mode=fsdp",), 4, strategies.FSDP),
             (("parallel.mode=fsdp", "parallel.fsdp.hybrid_replicas=2"), 4, strategies.HSDP),
             (("parallel.mode=fsdp",), 1, strategies.SingleProcess)]
    for overrides, world, expected in cases:
        cfg = _cfg(*overrides)
        layout = resolve(cfg, _env(world, nodes=2 if world == 4 else 1), torch.device("cpu"))
        chosen = parallel.strategy(cfg.parallel, layout)
        assert type(chosen) is expected and layout.sharded == expected.sharded
    # evaluation at a world size the replica groups do not divide shards over all ranks
    hsdp = _cfg("parallel.mode=fsdp", "parallel.fsdp.hybrid_replicas=2").parallel
    assert parallel.for_world_size(hsdp, 3).fsdp.hybrid_replicas == 1
    assert parallel.for_world_size(hsdp, 4) is hsdp
    # what plan counts: replicated and sharded, and the one the section asks for
    rows, asked = parallel.counted(hsdp, _env(4, nodes=2))
    assert [(r.row, r.shards, r.sharded) for r in rows] == [("ddp", 1, False), ("fsdp", 2, True)]
    assert asked is rows[1]
    # a single process syncs every micro-batch: nothing to switch
    single = resolve(_cfg(), _env(1), torch.device("cpu"))
    assert parallel.gradient_sync(single, torch.nn.Linear(2, 2), False) is parallel.NOTHING


def test_planning_builds_no_weights() -> None:
    from dtrain import models

    cfg = _cfg()
    info = {"num_classes": 10, "in_channels": 3, "image_size": 32}
    planned = models.build(cfg.model, info, 0, models.Weights.NONE)
    assert all(p.device.type == "meta" for p in planned.parameters())
    assert all(p.device.type == "cpu" for p in models.build(cfg.model, info, 0).parameters())
