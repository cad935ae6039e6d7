"""`dtrain train`: put the pieces together in the order of DESIGN.md's flow, and take them apart.

config -> env -> dist -> run directory (lock, shared storage) -> data -> model -> parallel ->
optimizer -> checkpoint resume -> Trainer.fit() -> records -> (requeue) -> dist.shutdown()
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import fields
from typing import Any, Optional

import torch
from torch import nn

from dtrain import (checkpoint, data, dist, env as env_mod, models, optim, parallel, profiling,
                    records, signals, slurm)
from dtrain.checkpoint.state import reseed
from dtrain.checkpoint.store import RunDirLock, Store, check_shared
from dtrain.config import Config, dump
from dtrain.errors import PeerFailure, UserError
from dtrain.observe import RunLog, log, setup_logging
from dtrain.trainer import Trainer, TrainState


def resolve_run_name(cfg: Config, env: env_mod.Env, config_path: Optional[str] = None) -> None:
    """An unnamed run is named after its SLURM job (`job_<id>`: a requeued job finds its run
    again, and two jobs of one config never share a directory), else after its config file
    (`configs/default.yaml` -> `default`), else `default`. The shipped configs name no run."""
    if cfg.run.name is not None:
        return
    if env.slurm_job_id:
        cfg.run.name = f"job_{env.slurm_job_id}"
    elif config_path:
        cfg.run.name = os.path.splitext(os.path.basename(config_path))[0] or "default"
    else:
        cfg.run.name = "default"


def check_layout(cfg: Config, env: env_mod.Env) -> None:
    """Combinations of config and launch that cannot work, caught before any process group."""
    if cfg.parallel.mode == "none" and env.world_size > 1:
        raise UserError(f"config error: parallel.mode: 'none' with {env.world_size} ranks would "
                        f"train {env.world_size} unrelated models; use ddp or fsdp")


def prepare_run_dir(cfg: Config) -> str:
    run_dir = cfg.run_dir
    try:
        os.makedirs(run_dir, exist_ok=True)
        probe = os.path.join(run_dir, f".write-test-{os.getpid()}")
        with open(probe, "w"):
            pass
        os.remove(probe)
    except OSError as e:
        raise UserError(f"output error: cannot write the run directory '{run_dir}' "
                        f"({e.strerror}); set run.out_dir to a writable place") from None
    return run_dir


def claim_run_dir(cfg: Config, lock: RunDirLock, env: env_mod.Env) -> str:
    """Before anything is written: rank 0 creates the run directory and takes its lock (a second
    launch on the same directory exits 2 naming the holder), and every rank checks that it sees
    the same directory. The same UserError on every rank when something is wrong."""
    if cfg.run.private:
        os.umask(0o077)  # every directory 0700 and file 0600 that this process creates

    def claim() -> None:
        prepare_run_dir(cfg)
        lock.acquire(env.slurm_job_id)

    dist.on_main(claim)
    os.makedirs(cfg.run_dir, exist_ok=True)  # ranks on other nodes, where it may not be shared
    check_shared(cfg.run_dir)
    return cfg.run_dir


def state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes this rank holds for parameters, gradients and optimizer state, and what the same
    state would take unsharded (DDP holds all of it on every rank)."""
    def local_and_full(t: torch.Tensor) -> tuple[int, int]:
        local = t.to_local() if hasattr(t, "to_local") else t
        return local.numel() * local.element_size(), t.numel() * t.element_size()

    totals = {"params": 0, "grads": 0, "optimizer": 0, "unsharded": 0}
    for p in model.parameters():
        local, full = local_and_full(p)
        totals["params"] += local
        totals["unsharded"] += full
        if p.grad is not None:
            local, full = local_and_full(p.grad)
            totals["grads"] += local
            totals["unsharded"] += full
    for per_param in optimizer.state.values():
        for value in per_param.values():
            if isinstance(value, torch.Tensor):
                local, full = local_and_full(value)
                totals["optimizer"] += local
                totals["unsharded"] += full
    totals["total"] = totals["params"] + totals["grads"] + totals["optimizer"]
    return totals


def make_scaler(cfg: Config, device: torch.device, is_fsdp: bool) -> Optional[Any]:
    if cfg.train.precision != "fp16":
        return None
    if is_fsdp:
        # Sharded gradients: an inf on one rank's shard must skip the step on every rank.
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
        return ShardedGradScaler(device=device.type, init_scale=cfg.train.loss_scale_init)
    return torch.amp.GradScaler(device.type, init_scale=cfg.train.loss_scale_init)


def train(cfg: Config, config_path: Optional[str] = None) -> str:
    """Run training; returns 'finished' or 'preempted'. Raises UserError for bad input."""
    env = env_mod.detect()
    resolve_run_name(cfg, env, config_path)
    check_layout(cfg, env)
    runtime = dist.init(env, cfg.dist)
    signals.install()
    lock = RunDirLock(cfg.run_dir)
    record = records.RunRecord(cfg, dist.world_size(), dist.is_main())
    try:
        claim_run_dir(cfg, lock, env)
        outcome = _train(cfg, runtime, record)
        if outcome == "preempted" and dist.is_main():
            slurm.after_preemption(cfg, env)  # the checkpoint is complete: requeue the job
        # No rank leaves before rank 0 has published the last checkpoint and requeued: under
        # srun --kill-on-bad-exit, a node whose processes end first would take rank 0 down.
        dist.barrier()
        return outcome
    except BaseException as e:
        record.fail(e)
        raise
    finally:
        signals.uninstall()
        lock.release()
        dist.shutdown()


def _train(cfg: Config, runtime: dist.Runtime, record: records.RunRecord) -> str:
    rank, world = dist.rank(), dist.world_size()
    run_dir = cfg.run_dir
    setup_logging(run_dir, rank, cfg.log.all_ranks)
    record.start(run_dir)
    if dist.is_main():
        with open(os.path.join(run_dir, "config.yaml"), "w", encoding="utf-8") as f:
            f.write(dump(cfg))
    _set_torch_flags(cfg)
    reseed(cfg.run.seed)

    overfit = cfg.train.overfit_batches
    data_cfg = cfg.data
    if overfit:  # overfitting a fixed set of batches: the same images every time
        data_cfg = dataclasses.replace(data_cfg, augment=False)
    datasets = data.build(data_cfg, cfg.run.seed)
    loaders = data.loaders(datasets, data_cfg, cfg.run.seed, rank, world, runtime.device, overfit)
    try:
        return _train_with(cfg, runtime, record, datasets, loaders)
    finally:
        data.close_loaders(loaders)


def _train_with(cfg: Config, runtime: dist.Runtime, record: records.RunRecord,
                datasets: data.Datasets, loaders: tuple) -> str:
    rank, overfit, run_dir = dist.rank(), cfg.train.overfit_batches, cfg.run_dir
    if overfit:
        log.info(f"overfit check: the same {overfit} batch(es) per rank every epoch, augmentation "
                 f"off; the training loss should fall towards 0")
    steps_per_epoch = len(loaders[0]) // cfg.train.grad_accum
    if steps_per_epoch < 1:
        raise UserError(f"data error: an epoch has {len(loaders[0])} batches per rank, fewer than "
                        f"train.grad_accum={cfg.train.grad_accum}; lower one of them")

    model = models.build(cfg.model, datasets, cfg.run.seed)
    num_params = sum(p.numel() for p in model.parameters())
    is_fsdp = cfg.parallel.mode == "fsdp" and runtime.env.distributed
    wrapped = parallel.wrap(model, cfg, runtime)
    optimizer = optim.build_optimizer(wrapped, cfg.optim)
    total_steps = cfg.train.epochs * steps_per_epoch
    if cfg.train.max_steps:
        total_steps = min(total_steps, cfg.train.max_steps)
    schedule = optim.LRSchedule(optimizer, cfg.sched, cfg.optim.lr, total_steps, cfg.ckpt.monitor_mode)
    scaler = make_scaler(cfg, runtime.device, is_fsdp)
    torch.manual_seed(cfg.run.seed + 1 + rank)  # per-rank randomness from here on (dropout)

    def extra_state() -> dict[str, Any]:
        return {"schedule": schedule.state_dict(),
                "scaler": scaler.state_dict() if scaler is not None else None}

    def load_extra_state(extra: dict[str, Any]) -> None:
        schedule.load_state_dict(extra["schedule"])
        if scaler is not None and extra.get("scaler"):
            scaler.load_state_dict(extra["scaler"])

    model_info = {"num_classes": cfg.model.num_classes or datasets.num_classes,
                  "in_channels": datasets.in_channels, "image_size": datasets.image_size}
    checkpoints = checkpoint.Checkpointer(cfg, Store(run_dir), wrapped, optimizer, extra_state,
                                          load_extra_state, runtime.device, is_fsdp, model_info)
    state = TrainState()
    resumed = checkpoints.resume()
    if resumed:
        state = TrainState(**{f.name: resumed[f.name] for f in fields(TrainState)})
        _reconcile_schedule(schedule, checkpoints.config_changes, total_steps)
    run_log = RunLog(cfg, run_dir, dist.is_main(), state.step, checkpoints.superseded)
    _banner(cfg, runtime, num_params, steps_per_epoch, run_dir, resumed)
    trainer = Trainer(cfg, wrapped, optimizer, schedule, scaler, loaders, runtime.device, is_fsdp,
                      run_log, checkpoints, state)
    trainer.on_first_step = lambda: _log_state_bytes(wrapped, optimizer, is_fsdp)
    trainer.after_save = record.update
    if runtime.env.slurm_job_id and dist.is_main():
        job_id = runtime.env.slurm_job_id
        trainer.before_stop_save = lambda last_save_s: slurm.check_grace(job_id, last_save_s)
    profiler = profiling.Profiler(cfg.log.profile, run_dir, rank, runtime.device)
    trainer.after_step = profiler.step
    try:
        profiler.start()
        outcome = _fit_naming_lost_peers(trainer, cfg)
        profiler.stop()
        run_log.hparams(state.step, {"val_loss": state.last_eval.get("val_loss"),
                                     "val_acc": state.last_eval.get("val_acc"),
                                     f"best_{cfg.ckpt.monitor}": state.best_metric})
    finally:
        run_log.close()
    record.update(state, outcome)
    log.info(f"{outcome} at step {state.step}: {run_dir}")
    return outcome


# Changes that make the length of a run different from the one its schedule was made for.
_SCHEDULE_KEYS = ("train.epochs", "train.max_steps", "data.batch_size", "train.grad_accum", "sched.")


def _reconcile_schedule(schedule: optim.LRSchedule, changes: list[str], total_steps: int) -> None:
    """A resumed schedule keeps the length it had when the run started (another world size does
    not bend it), unless the user changed the run's length on purpose."""
    if any(change.startswith(_SCHEDULE_KEYS) for change in changes):
        log.info(f"the learning-rate schedule now spans {total_steps} steps "
                 f"(was {schedule.total_steps}), following the changed config")
        schedule.total_steps = max(1, total_steps)


def _fit_naming_lost_peers(trainer: Trainer, cfg: Config) -> str:
    """Run the loop; a collective broken by another rank becomes one clear line naming it."""
    try:
        return trainer.fit()
    except Exception as e:  # noqa: BLE001 - re-raised unless it is a failed collective
        if not dist.is_distributed() or not dist.is_collective_failure(e):
            raise
        step = trainer.state.step + 1
        missing = dist.ranks_not_arriving(f"step{step}")
        who = (f"rank(s) {', '.join(map(str, missing))} did not arrive" if missing
               else "another rank failed")
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise PeerFailure(f"distributed error at step {step} on rank {dist.rank()}: {who} "
                          f"(collective timeout dist.timeout_s={cfg.dist.timeout_s:g} s); "
                          f"backend said: {first_line}") from None


def _set_torch_flags(cfg: Config) -> None:
    torch.backends.cudnn.benchmark = cfg.train.cudnn_benchmark
    if cfg.train.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    torch.autograd.set_detect_anomaly(cfg.train.detect_anomaly)


def _log_state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer, is_fsdp: bool) -> dict:
    sizes = state_bytes(model, optimizer)
    mib = {k: v / 2**20 for k, v in sizes.items()}
    log.info(f"state per rank: {mib['total']:.2f} MiB (params {mib['params']:.2f}, grads "
             f"{mib['grads']:.2f}, optimizer {mib['optimizer']:.2f}); unsharded, as under DDP: "
             f"{mib['unsharded']:.2f} MiB")
    return {"state_bytes": sizes["total"], "state_bytes_unsharded": sizes["unsharded"]}


def _banner(cfg: Config, runtime: dist.Runtime, num_params: int, steps_per_epoch: int,
            run_dir: str, resumed: Optional[dict]) -> None:
    env = runtime.env
    world = dist.world_size()
    effective = cfg.data.batch_size * world * cfg.train.grad_accum
    source = f"resumed from {resumed['path']} at step {resumed['step']}" if resumed else "fresh start"
    if resumed and resumed["world_size"] != world:
        source += f" (world size {resumed['world_size']} -> {world})"
    log.info(f"dtrain | {env.describe()} | device {runtime.device} | backend "
             f"{runtime.backend or 'none'} | mode {cfg.parallel.mode} | precision {cfg.train.precision}")
    log.info(f"model {cfg.model.name}: {num_params / 1e6:.3f} M parameters | data {cfg.data.name} | "
             f"effective batch {effective} = {cfg.data.batch_size} per rank x {world} rank(s) x "
             f"{cfg.train.grad_accum} accumulation | {steps_per_epoch} steps per epoch")
    log.info(f"run directory {run_dir} | {source}")
