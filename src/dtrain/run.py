"""`dtrain train`: put the pieces together in the order of DESIGN.md's flow, and take them apart.

config -> env -> dist -> run directory (lock, shared storage) -> data -> model -> parallel ->
optimizer -> checkpoint resume -> Trainer.fit() -> records -> (requeue) -> dist.shutdown()
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, fields
from typing import Any

import torch
from torch import nn

from dtrain import (
    checkpoint,
    data,
    dist,
    models,
    optim,
    parallel,
    profiling,
    records,
    signals,
    slurm,
    tasks,
)
from dtrain import (
    env as env_mod,
)
from dtrain.checkpoint.state import reseed
from dtrain.checkpoint.store import RunDirLock, Store, check_shared
from dtrain.checkpoint.weights import StartingWeights
from dtrain.config import Config, dump
from dtrain.errors import PeerFailure, UserError
from dtrain.observe import (
    RunLog,
    StartupClock,
    Throughput,
    attach_log_files,
    log,
    peak_flops,
    setup_logging,
)
from dtrain.trainer import Callbacks, Trainer, TrainState


def resolve_run_name(cfg: Config, env: env_mod.Env, config_path: str | None = None) -> None:
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
        raise UserError(
            f"config error: parallel.mode: 'none' with {env.world_size} ranks would "
            f"train {env.world_size} unrelated models; use ddp or fsdp"
        )


def prepare_run_dir(cfg: Config) -> str:
    run_dir = cfg.run_dir
    try:
        os.makedirs(run_dir, exist_ok=True)
        probe = os.path.join(run_dir, f".write-test-{os.getpid()}")
        with open(probe, "w"):
            pass
        os.remove(probe)
    except OSError as e:
        raise UserError(
            f"output error: cannot write the run directory '{run_dir}' "
            f"({e.strerror}); set run.out_dir to a writable place"
        ) from None
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
        if p.requires_grad:  # its gradient, as large, exists from each backward to the step
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


def make_scaler(cfg: Config, device: torch.device, is_fsdp: bool) -> Any | None:
    if cfg.train.precision != "fp16":
        return None
    if is_fsdp:
        # Sharded gradients: an inf on one rank's shard must skip the step on every rank.
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        return ShardedGradScaler(device=device.type, init_scale=cfg.train.loss_scale_init)
    return torch.amp.GradScaler(device.type, init_scale=cfg.train.loss_scale_init)


@dataclass
class Pieces:
    """What a run trains, built and checked before anything is written."""

    datasets: data.Datasets
    loaders: tuple
    task: tasks.Task
    model: nn.Module  # wrapped for the parallel mode
    num_params: int
    is_fsdp: bool
    steps_per_epoch: int
    notes: list[str]  # what the banner adds: image sizes and transforms, loader workers, ...
    starting_weights: StartingWeights | None  # model.init_from / pretrained, checked


def train(cfg: Config, config_path: str | None = None) -> str:
    """Run training; returns 'finished' or 'preempted'. Raises UserError for bad input."""
    clock = StartupClock()
    clock.mark("imports")
    env = env_mod.detect()
    resolve_run_name(cfg, env, config_path)
    check_layout(cfg, env)
    runtime = dist.init(
        env, cfg.dist, cpu_collectives=cfg.parallel.mode == "fsdp" and cfg.parallel.fsdp.cpu_offload
    )
    clock.mark("process group")
    # The console from now on; the run directory's log files once the directory is this run's.
    setup_logging(dist.rank(), cfg.log.all_ranks)
    signals.install()
    lock = RunDirLock(cfg.run_dir)
    record = records.RunRecord(cfg, dist.world_size(), dist.is_main())
    loaders: tuple = ()
    try:
        pieces = build_pieces(cfg, runtime, clock)
        loaders = pieces.loaders
        claim_run_dir(cfg, lock, env)
        attach_log_files(cfg.run_dir, dist.rank())
        outcome = _train(cfg, runtime, record, pieces, clock)
        if outcome == "preempted" and dist.is_main():
            slurm.after_preemption(cfg, env)  # the checkpoint is complete: requeue the job
        # No rank leaves before rank 0 has published the last checkpoint and requeued: under
        # srun --kill-on-bad-exit, a node whose processes end first would take rank 0 down.
        dist.barrier()
        return outcome
    except BaseException as e:
        if isinstance(e, UserError):
            dist.announce_abort(str(e))  # the other ranks stop with the same line
        record.fail(e)
        raise
    finally:
        data.close_loaders(loaders)
        signals.uninstall()
        lock.release()
        dist.shutdown()


def build_pieces(cfg: Config, runtime: dist.Runtime, clock: StartupClock) -> Pieces:
    """Data, task and model, wrapped for the parallel mode, and the task tried once on a
    validation batch: a task or model that cannot work ends here, with nothing written."""
    rank, world = dist.rank(), dist.world_size()
    _set_torch_flags(cfg)
    reseed(cfg.run.seed)
    overfit = cfg.train.overfit_batches
    data_cfg = cfg.data
    if overfit:  # overfitting a fixed set of batches: the same samples every time
        data_cfg = dataclasses.replace(data_cfg, augment=False)
    datasets = data.build(data_cfg, cfg.run.seed, cfg.model.args)
    workers, why = data.workers_for(data_cfg, runtime.env.local_world_size)
    notes = [*datasets.notes, f"data.num_workers {workers} ({why})"]
    loaders = data.loaders(
        datasets.train,
        datasets.val,
        data_cfg,
        cfg.run.seed,
        rank,
        world,
        runtime.device,
        overfit,
        workers,
    )
    if overfit:
        notes.append(
            f"overfit check: the same {overfit} batch(es) per rank every epoch, "
            f"augmentation off; the training loss should fall towards 0"
        )
    steps_per_epoch = len(loaders[0]) // cfg.train.grad_accum
    if steps_per_epoch < 1:
        raise UserError(
            f"data error: an epoch has {len(loaders[0])} batches per rank, fewer than "
            f"train.grad_accum={cfg.train.grad_accum}; lower one of them"
        )
    task = tasks.build(cfg.task, datasets.info)
    clock.mark("data")
    is_fsdp = cfg.parallel.mode == "fsdp" and runtime.env.distributed
    wrapped, num_params, model_notes = parallel.build(cfg, datasets.info, runtime)
    notes += model_notes
    clock.mark("model and wrap")
    _check_task(cfg, task, wrapped, loaders[2], runtime.device, datasets.on_device, is_fsdp)
    if is_fsdp:
        parallel.reshard(wrapped)
    starting = (
        StartingWeights(wrapped, cfg.model) if cfg.model.init_from or cfg.model.pretrained else None
    )
    clock.mark("task check")
    return Pieces(
        datasets, loaders, task, wrapped, num_params, is_fsdp, steps_per_epoch, notes, starting
    )


def _check_task(
    cfg: Config,
    task: tasks.Task,
    model: nn.Module,
    val_loader: Any,
    device: torch.device,
    on_device: Any,
    is_fsdp: bool,
) -> None:
    """The task once on the first validation batch, on every rank; the first problem any rank
    finds ends every rank with the same line (exit 2)."""
    batch = data.to_device(next(iter(val_loader)), device, on_device, cfg.model.channels_last)
    try:
        with parallel.autocast(cfg.train.precision, is_fsdp, device):
            problem = tasks.check(task, model, batch, cfg.ckpt.monitor)
    except UserError as e:
        problem = str(e)
    problems = [p for p in dist.gather_objects(problem) if p]
    if problems:
        raise UserError(problems[0])


def _train(
    cfg: Config,
    runtime: dist.Runtime,
    record: records.RunRecord,
    pieces: Pieces,
    clock: StartupClock,
) -> str:
    rank, run_dir = dist.rank(), cfg.run_dir
    record.start(run_dir)
    if dist.is_main():
        with open(os.path.join(run_dir, "config.yaml"), "w", encoding="utf-8") as f:
            f.write(dump(cfg))
    wrapped, steps_per_epoch, is_fsdp = pieces.model, pieces.steps_per_epoch, pieces.is_fsdp
    optimizer = optim.build_optimizer(wrapped, cfg.optim)
    total_steps = cfg.train.epochs * steps_per_epoch
    if cfg.train.max_steps:
        total_steps = min(total_steps, cfg.train.max_steps)
    schedule = optim.build_schedule(
        optimizer, cfg.sched, cfg.optim.lr, total_steps, cfg.ckpt.monitor_mode
    )
    scaler = make_scaler(cfg, runtime.device, is_fsdp)
    torch.manual_seed(cfg.run.seed + 1 + rank)  # per-rank randomness from here on (dropout)

    def extra_state() -> dict[str, Any]:
        return {
            "schedule": schedule.state_dict(),
            "scaler": scaler.state_dict() if scaler is not None else None,
        }

    def load_extra_state(extra: dict[str, Any]) -> None:
        schedule.load_state_dict(extra["schedule"])
        if scaler is not None and extra.get("scaler"):
            scaler.load_state_dict(extra["scaler"])

    checkpoints = checkpoint.Checkpointer(
        cfg,
        Store(run_dir),
        wrapped,
        optimizer,
        extra_state,
        load_extra_state,
        runtime.device,
        is_fsdp,
        models.model_info(cfg.model, pieces.datasets.info),
    )
    state = TrainState()
    resumed = checkpoints.resume()
    if resumed:
        state = TrainState(**{f.name: resumed[f.name] for f in fields(TrainState)})
        _reconcile_schedule(schedule, checkpoints.config_changes, total_steps)
        if pieces.starting_weights:
            log.info("model.init_from/pretrained not used: the resumed checkpoint has the weights")
    elif pieces.starting_weights:
        log.info(pieces.starting_weights.load(wrapped))
    run_log = RunLog(cfg, run_dir, dist.is_main(), state.step, checkpoints.superseded)
    pieces.notes.append(optim.describe_groups(optimizer))
    clock.mark("run directory and resume")
    _banner(cfg, runtime, pieces, run_dir, resumed)
    profiler = profiling.Profiler(cfg.log.profile, run_dir, rank, runtime.device)

    def first_step() -> dict[str, Any]:
        clock.mark("first step")
        log.info(clock.line())
        return _log_state_bytes(wrapped, optimizer, is_fsdp)

    callbacks = Callbacks(first_step=first_step, step_end=profiler.step, saved=record.update)
    if runtime.env.slurm_job_id and dist.is_main():
        job_id = runtime.env.slurm_job_id
        callbacks.before_stop_save = lambda last_save_s: slurm.check_grace(job_id, last_save_s)
    peak = peak_flops(runtime.device, cfg.train.precision)
    throughput = Throughput(
        getattr(pieces.task, "tokens_per_sample", None),
        pieces.num_params,
        peak * dist.world_size() if peak else None,
    )
    trainer = Trainer(
        cfg,
        wrapped,
        pieces.task,
        optimizer,
        schedule,
        scaler,
        pieces.loaders,
        runtime.device,
        is_fsdp,
        run_log,
        checkpoints,
        state,
        callbacks,
        throughput,
        pieces.datasets,
    )
    try:
        profiler.start()
        outcome = _fit_naming_lost_peers(trainer, cfg)
        profiler.stop()
        final = {k: v for k, v in state.last_eval.items() if k.startswith("val_")}
        run_log.hparams(state.step, {**final, f"best_{cfg.ckpt.monitor}": state.best_metric})
    finally:
        run_log.close()
    record.update(state, outcome)
    log.info(f"{outcome} at step {state.step}: {run_dir}")
    return outcome


# Changes that make the length of a run different from the one its schedule was made for.
_SCHEDULE_KEYS = (
    "train.epochs",
    "train.max_steps",
    "data.batch_size",
    "train.grad_accum",
    "sched.",
)


def _reconcile_schedule(schedule: Any, changes: list[str], total_steps: int) -> None:
    """A resumed schedule keeps the length it had when the run started (another world size does
    not bend it), unless the user changed the run's length on purpose."""
    if any(change.startswith(_SCHEDULE_KEYS) for change in changes):
        log.info(
            f"the learning-rate schedule now spans {total_steps} steps "
            f"(was {schedule.total_steps}), following the changed config"
        )
        schedule.total_steps = max(1, total_steps)


def _fit_naming_lost_peers(trainer: Trainer, cfg: Config) -> str:
    """Run the loop; a collective broken by another rank becomes one clear line naming it."""
    try:
        return trainer.fit()
    except Exception as e:  # noqa: BLE001 - re-raised unless it is a failed collective
        if not dist.is_distributed() or not dist.is_collective_failure(e):
            raise
        announced = dist.abort_message()
        if announced is not None:  # another rank stopped on bad input: the same line, exit 2
            raise UserError(announced) from None
        step = trainer.state.step + 1
        missing = dist.ranks_not_arriving(f"step{step}")
        who = (
            f"rank(s) {', '.join(map(str, missing))} did not arrive"
            if missing
            else "another rank failed"
        )
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise PeerFailure(
            f"distributed error at step {step} on rank {dist.rank()}: {who} "
            f"(collective timeout dist.timeout_s={cfg.dist.timeout_s:g} s); "
            f"backend said: {first_line}"
        ) from None


def _set_torch_flags(cfg: Config) -> None:
    torch.backends.cudnn.benchmark = cfg.train.cudnn_benchmark
    if cfg.train.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    torch.autograd.set_detect_anomaly(cfg.train.detect_anomaly)


def _log_state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer, is_fsdp: bool) -> dict:
    sizes = state_bytes(model, optimizer)
    mib = {k: v / 2**20 for k, v in sizes.items()}
    log.info(
        f"state per rank: {mib['total']:.2f} MiB (params {mib['params']:.2f}, grads "
        f"{mib['grads']:.2f}, optimizer {mib['optimizer']:.2f}); unsharded, as under DDP: "
        f"{mib['unsharded']:.2f} MiB"
    )
    return {"state_bytes": sizes["total"], "state_bytes_unsharded": sizes["unsharded"]}


def _banner(
    cfg: Config, runtime: dist.Runtime, pieces: Pieces, run_dir: str, resumed: dict | None
) -> None:
    env = runtime.env
    world = dist.world_size()
    effective = cfg.data.batch_size * world * cfg.train.grad_accum
    source = (
        f"resumed from {resumed['path']} at step {resumed['step']}" if resumed else "fresh start"
    )
    if resumed and resumed["world_size"] != world:
        source += f" (world size {resumed['world_size']} -> {world})"
    log.info(
        f"dtrain | {env.describe()} | device {runtime.device} | backend "
        f"{runtime.backend or 'none'} | mode {cfg.parallel.mode} | precision {cfg.train.precision}"
    )
    log.info(
        f"model {cfg.model.name}: {pieces.num_params / 1e6:.3f} M parameters | task "
        f"{cfg.task.name} | data {cfg.data.name} | effective batch {effective} = "
        f"{cfg.data.batch_size} per rank x {world} rank(s) x {cfg.train.grad_accum} "
        f"accumulation | {pieces.steps_per_epoch} steps per epoch"
    )
    for note in pieces.notes:
        log.info(note)
    log.info(f"run directory {run_dir} | {source}")
