"""`dtrain train`: put the pieces together in the order of DESIGN.md's flow, and take them apart.

config -> env -> dist -> run directory (lock, shared storage) -> data -> model -> parallel ->
optimizer -> checkpoint resume -> Trainer.fit() -> records -> (requeue) -> dist.shutdown()
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import torch
from torch import nn

from dtrain import checkpoint, data, models, parallel
from dtrain.config import DEFAULT_RUN_NAME, Config, dump, to_dict
from dtrain.core import signals
from dtrain.core.errors import Interrupted, PeerFailure, UserError, first_line
from dtrain.core.logs import log_fitted
from dtrain.files import names, outputs
from dtrain.files.objstore import StoreUnanswered
from dtrain.files.resume_policy import is_length_change
from dtrain.files.store import RunDirLock, Store, check_run_dir_entries, write_atomic
from dtrain.loop import optim
from dtrain.loop.ema import EmaWeights
from dtrain.loop.state import TrainState
from dtrain.loop.trainer import Callbacks, Trainer
from dtrain.models import lora
from dtrain.observe import (
    RunLog,
    StartupClock,
    Throughput,
    attach_log_files,
    log,
    peak_flops,
    profiling,
    setup_logging,
)
from dtrain.observe.trackers import check_installed as check_trackers
from dtrain.process import compat, dist, slurm
from dtrain.process import env as env_mod
from dtrain.process import layout as layout_mod
from dtrain.process.layout import Layout, Steps
from dtrain.run import records
from dtrain.run.pieces import Pieces, build_pieces
from dtrain.run.remote import RemoteRun
from dtrain.run.weights import base_identity


def resolve_run_name(cfg: Config, env: env_mod.Env, config_path: str | None = None) -> Config:
    """The config with its run named: an unnamed run is named after its SLURM job (`job_<id>`:
    a requeued job finds its run again, and two jobs of one config never share a directory),
    else after its config file (`configs/default.yaml` -> `default`), else `default`. The
    shipped configs name no run."""
    if cfg.run.name is not None:
        return cfg
    if env.slurm_job_id:
        name = f"job_{env.slurm_job_id}"
    elif config_path:
        name = os.path.splitext(os.path.basename(config_path))[0] or DEFAULT_RUN_NAME
    else:
        name = DEFAULT_RUN_NAME
    return dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, name=name))


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


def claim_run_dir(
    cfg: Config, lock: RunDirLock, env: env_mod.Env, remote: RemoteRun | None = None
) -> str:
    """Before anything is written: rank 0 creates the run directory and takes its lock (a second
    launch on the same directory exits 2 naming the holder), and every rank checks that it sees
    the same directory. A run in an object store: rank 0 reaches the store first, takes the run's
    lease there, and each node's staging folder is the run directory here (not shared); every
    rank fetches the records it keeps. The same UserError on every rank when something is
    wrong."""
    if cfg.run.private:
        os.umask(0o077)  # every directory 0700 and file 0600 that this process creates
    job = slurm.job_label(env.slurm_job_id)

    def claim() -> None:
        if remote is not None:
            remote.out.check()  # endpoint, bucket and credentials, before anything is written
        prepare_run_dir(cfg)
        check_run_dir_entries(cfg.run_dir)  # no link to write through, before the lock's file
        if remote is not None:  # the lease first: a second launch hears of the run's holder
            remote.lease.acquire(job)
        lock.acquire(job)
        if remote is not None:
            remote.mirror.clear()

    dist.on_main(claim)
    os.makedirs(cfg.run_dir, exist_ok=True)  # ranks on other nodes, where it may not be shared
    if remote is None:
        dist.check_shared(cfg.run_dir)
        return cfg.run_dir
    with remote.run.failing_as("read the records of"):
        remote.mirror.pull()
    remote.claimed = True
    return cfg.run_dir


def state_bytes(
    model: nn.Module, optimizer: torch.optim.Optimizer, ema: EmaWeights | None = None
) -> dict[str, int]:
    """Bytes this rank holds for parameters, gradients and optimizer state (EMA weights count
    as such), and what the same state would take unsharded (DDP holds all of it on every rank)."""

    def local_and_full(t: torch.Tensor) -> tuple[int, int]:
        local = compat.local_part(t)
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
    for average in ema.average if ema is not None else []:
        local, full = local_and_full(average)
        totals["optimizer"] += local
        totals["unsharded"] += full
    totals["total"] = totals["params"] + totals["grads"] + totals["optimizer"]
    return totals


def train(cfg: Config, config_path: str | None = None) -> str:
    """Run training; returns 'finished', 'preempted' or 'stopped_early' (train.early_stop).
    Raises UserError for bad input."""
    clock = StartupClock()
    clock.mark("imports")
    env = env_mod.detect()
    cfg = resolve_run_name(cfg, env, config_path)
    layout = layout_mod.resolve(
        env,
        parallel.mesh(cfg.parallel, env),
        backend=cfg.dist.backend,
        batch_size=cfg.data.batch_size,
        grad_accum=cfg.train.grad_accum,
        checkpoint_format=cfg.ckpt.format,
    )
    check_trackers(cfg)  # an enabled tracker without its library: exit 2 before any process group
    dist.init(layout, cfg.dist)
    clock.mark("process group")
    # The console from now on; the run directory's log files once the directory is this run's.
    setup_logging(dist.rank(), cfg.log.all_ranks)
    signals.install()
    lock = RunDirLock(cfg.run_dir, shown=cfg.run_url)  # a staging folder: named as its run
    remote = RemoteRun(cfg, dist.rank()) if cfg.run_url else None
    record = records.RunRecord(
        cfg.run.out_dir,
        cfg.run_name,
        records.describe(cfg, layout),
        cfg.ckpt,
        layout.world_size,
        dist.is_main(),
        remote.out if remote else None,
    )
    loaders: data.Loaders | None = None
    answering = True  # the store (nothing more is asked of one that stopped answering)
    try:
        pieces = build_pieces(cfg, layout, clock)
        loaders = pieces.loaders
        claim_run_dir(cfg, lock, env, remote)
        attach_log_files(os.path.join(cfg.run_dir, names.log_file(dist.rank())))
        outcome = _train(cfg, layout, record, pieces, clock, remote)
        if outcome == "preempted" and dist.is_main():
            slurm.after_preemption(
                cfg.slurm.requeue, env
            )  # the checkpoint is complete: requeue the job
        # No rank leaves before rank 0 has published the last checkpoint and requeued: under
        # srun --kill-on-bad-exit, a node whose processes end first would take rank 0 down.
        dist.barrier()
        return outcome
    except KeyboardInterrupt:  # a second Ctrl-C (core/signals.py): one line, not a traceback
        stopped = _interrupted(record.store)
        record.fail(stopped)
        raise stopped from None
    except BaseException as e:
        if isinstance(e, UserError):
            dist.announce_abort(str(e))  # the other ranks stop with the same line
        answering = not isinstance(e, StoreUnanswered)
        if answering:
            record.fail(e)
        raise
    finally:
        data.close_loaders(loaders)
        signals.uninstall()
        if remote is not None:
            remote.close(answering)
        lock.release()
        dist.shutdown()


def _interrupted(store: Store | None) -> Interrupted:
    """The line of a run stopped at once: what it keeps is its last complete checkpoint (a save
    under way is left incomplete, and the next start clears it)."""
    stopped = "stopped at once by a second Ctrl-C"
    if store is None:
        return Interrupted(f"{stopped}; training had not started: nothing of it was saved")
    try:
        saved = store.complete()
    except Exception:  # noqa: BLE001 - a store out of reach: say what is known
        return Interrupted(f"{stopped}; the last complete checkpoint in {store.location} is kept")
    if not saved:
        return Interrupted(f"{stopped}; no checkpoint was complete: the same command starts afresh")
    return Interrupted(
        f"{stopped}; the last complete checkpoint is kept: {saved[0].path} (step "
        f"{saved[0].step}); the same command resumes from it"
    )


def _train(
    cfg: Config,
    layout: Layout,
    record: records.RunRecord,
    pieces: Pieces,
    clock: StartupClock,
    remote: RemoteRun | None,
) -> str:
    run_dir = cfg.run_dir
    store = remote.store(run_dir) if remote else Store(run_dir)
    store.options = dict(cfg.run.storage_options)  # also for a ckpt.resume in a store
    store.timeout_s = cfg.run.store_timeout_s
    model = pieces.model
    optimizer = optim.build_optimizer(model, cfg.optim)
    schedule = optim.build_schedule(
        optimizer, cfg.sched, cfg.optim.lr, pieces.steps.total, cfg.ckpt.monitor_mode
    )
    torch.manual_seed(cfg.run.seed + 1 + dist.rank())  # per-rank randomness from here on (dropout)
    parts: dict[str, checkpoint.Stateful] = {"schedule": schedule}
    parts.update(pieces.precision.checkpoint_parts())
    state = TrainState()
    ema = EmaWeights.build(cfg.train.ema, model)  # None unless train.ema.decay is set
    adapters_only = lora.enabled(cfg.model)
    checkpoints = checkpoint.Checkpointer(
        ckpt=cfg.ckpt,
        seed=cfg.run.seed,
        config=to_dict(cfg),
        layout=layout,
        store=store,
        model=model,
        optimizer=optimizer,
        state=state,
        parts=parts,
        model_info={
            **models.model_info(cfg.model, pieces.datasets.info),
            **base_identity(cfg.model, cfg.run.seed, pieces.starting_weights),
        },
        ema=ema,
        adapters_only=adapters_only,
    )
    if pieces.starting_weights and adapters_only:  # a LoRA checkpoint holds no base weights
        log.info(pieces.starting_weights.load(model))
    resumed = checkpoints.resume()
    if resumed and state.reached(cfg.train.epochs, cfg.train.max_steps):
        # Nothing trains: config.yaml and the run's record keep saying what was trained.
        log.info(_already_past(cfg, state, cfg.run_url or run_dir))
        return "finished"
    if resumed:
        _reconcile_schedule(schedule, checkpoints.config_changes, cfg, state, layout, pieces.steps)
        if pieces.starting_weights and not adapters_only:
            log.info("model.init_from/pretrained not used: the resumed checkpoint has the weights")
    elif pieces.starting_weights and not adapters_only:
        log.info(pieces.starting_weights.load(model))
    # Every check has passed (a resume refused for a changed config ends above): the run's
    # record and its config.yaml are written only now.
    record.start(store, resuming=resumed is not None)
    if dist.is_main():
        try:
            write_atomic(os.path.join(run_dir, names.CONFIG), dump(cfg).encode("utf-8"))
        except OSError as e:  # a full disk at the start of a resume: one line, nothing lost
            raise outputs.output_error("train", run_dir, e) from None
    run_log = RunLog(cfg, run_dir, dist.is_main(), state.step, checkpoints.superseded)
    if remote is not None:
        remote.mirror.start()  # and before each checkpoint's marker (RemoteRun.store)
    pieces.notes.append(optim.describe_groups(optimizer))
    clock.mark("run directory and resume")
    shown = f"{cfg.run_url} (staged in {run_dir})" if cfg.run_url else run_dir
    _banner(cfg, layout, pieces, shown, resumed)
    profiler = profiling.Profiler(cfg.log.profile, run_dir, dist.rank(), layout.device)

    # Each attempt's first record says the world size it trains at (metrics.jsonl, TensorBoard),
    # and where it changed since the checkpoint, from what: an elastic run shows its changes.
    world: dict[str, Any] = {"world_size": layout.world_size}
    if resumed and resumed.world_size != layout.world_size:
        world["world_size_from"] = resumed.world_size
        record.world_size_changed(resumed.world_size, layout.world_size, resumed.step)

    def first_step() -> dict[str, Any]:
        clock.mark("first step")
        log_fitted(clock.line())
        return {**world, **_log_state_bytes(model, optimizer, ema)}

    callbacks = Callbacks(first_step=[first_step], step_end=[profiler.step], saved=[record.update])
    if layout.env.slurm_job_id and dist.is_main():
        job_id = layout.env.slurm_job_id
        callbacks.before_stop_save.append(
            lambda last_save_s: slurm.check_grace(job_id, last_save_s)
        )
    peak = peak_flops(layout.device, cfg.train.precision)
    throughput = Throughput(
        getattr(pieces.task, "tokens_per_sample", None),
        pieces.num_params,
        peak * layout.world_size if peak else None,
    )
    trainer = Trainer(
        train=cfg.train,
        ckpt=cfg.ckpt,
        channels_last=cfg.model.channels_last,
        sync_batchnorm=cfg.parallel.sync_batchnorm,
        layout=layout,
        model=model,
        task=pieces.task,
        optimizer=optimizer,
        schedule=schedule,
        precision=pieces.precision,
        datasets=pieces.datasets,
        loaders=pieces.loaders,
        checkpoints=checkpoints,
        run_log=run_log,
        callbacks=callbacks,
        throughput=throughput,
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
    log.info(f"{outcome} at step {state.step}: {cfg.run_url or run_dir}")
    return outcome


# Changes of what a step is (allowed only with ckpt.resume_config_change=allow): the schedule
# made for the old steps cannot continue as it was. train.epochs and train.max_steps are the
# run's length: ckpt.on_length_change.
_SCHEDULE_KEYS = (
    "data.batch_size",
    "train.grad_accum",
    "sched.",
)


def _reconcile_schedule(
    schedule: Any, changes: list[str], cfg: Config, state: TrainState, layout: Layout, steps: Steps
) -> None:
    """A resumed schedule keeps the length it had when the run started (another world size does
    not bend it), unless the user changed the run's length on purpose: changes of what a step is
    (allowed with ckpt.resume_config_change=allow) re-span it; a changed train.epochs or
    train.max_steps does what ckpt.on_length_change says, in one line."""
    if any(c.startswith(_SCHEDULE_KEYS) for c in changes):
        log.info(
            f"the learning-rate schedule now spans {steps.total} steps "
            f"(was {schedule.total_steps}), following the changed config"
        )
        schedule.total_steps = max(1, steps.total)
        return
    length = [c for c in changes if is_length_change(c)]
    if length:
        log.info(_length_change(schedule, length, cfg, state, layout, steps))


def _length_change(
    schedule: Any, length: list[str], cfg: Config, state: TrainState, layout: Layout, steps: Steps
) -> str:
    """Applies ckpt.on_length_change to the schedule and says what the run now does."""
    step_samples = layout.effective_batch
    done_in_epoch = state.samples_in_epoch // step_samples
    left = steps.per_epoch * (cfg.train.epochs - state.epoch) - done_in_epoch
    end = state.step + max(0, left)
    if cfg.train.max_steps:
        end = min(end, cfg.train.max_steps)
    said = (
        f"run length changed on resume ({'; '.join(length)}): training continues from step "
        f"{state.step} to step {end}"
    )
    lr_at = getattr(schedule, "lr_at", None)
    if lr_at is None:  # a user's scheduler: built for the new length, then given its saved state
        return f"{said}; the user schedule {cfg.sched.name} was built for {steps.total} steps"
    old_total, before = schedule.total_steps, lr_at(state.step)
    if cfg.ckpt.on_length_change == "keep":
        return (
            f"{said}; the learning-rate schedule keeps its {old_total} steps "
            f"(ckpt.on_length_change=keep): lr {before:.4g} at step {state.step}, and "
            f"{lr_at(old_total):.4g} from step {old_total} on"
        )
    schedule.total_steps = max(1, steps.total)
    return (
        f"{said}; the learning-rate schedule is re-spanned from {old_total} to "
        f"{schedule.total_steps} steps, as if the run had been this long from the start "
        f"(ckpt.on_length_change=respan): lr at step {state.step} {before:.4g} -> "
        f"{lr_at(state.step):.4g}"
    )


def _already_past(cfg: Config, state: TrainState, shown: str) -> str:
    asked = f"train.epochs={cfg.train.epochs}"
    if cfg.train.max_steps:
        asked += f", train.max_steps={cfg.train.max_steps}"
    return (
        f"{shown} is already at or past the asked length ({asked}): it trained to step "
        f"{state.step}, epoch {state.epoch}; nothing to train, and its config.yaml and record "
        f"are unchanged"
    )


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
        raise PeerFailure(
            f"distributed error at step {step} on rank {dist.rank()}: {who} "
            f"(collective timeout dist.timeout_s={cfg.dist.timeout_s:g} s); "
            f"backend said: {first_line(e)}"
        ) from e


def _log_state_bytes(
    model: nn.Module, optimizer: torch.optim.Optimizer, ema: EmaWeights | None
) -> dict[str, int]:
    sizes = state_bytes(model, optimizer, ema)
    mib = {k: v / 2**20 for k, v in sizes.items()}
    log_fitted(
        f"state per rank: {mib['total']:.2f} MiB (params {mib['params']:.2f}, grads "
        f"{mib['grads']:.2f}, optimizer {mib['optimizer']:.2f}); unsharded, as under DDP: "
        f"{mib['unsharded']:.2f} MiB"
    )
    return {"state_bytes": sizes["total"], "state_bytes_unsharded": sizes["unsharded"]}


def _banner(
    cfg: Config, layout: Layout, pieces: Pieces, run_dir: str, resumed: checkpoint.Resumed | None
) -> None:
    world = layout.world_size
    source = f"resumed from {resumed.path} at step {resumed.step}" if resumed else "fresh start"
    if resumed and resumed.world_size != world:
        source += f" (world size {resumed.world_size} -> {world})"
    # The mode that runs: a single process wraps the model in nothing, whatever the config says.
    mode = layout.mode if layout.mode == cfg.parallel.mode else f"{layout.mode} (one process)"
    log_fitted(
        f"dtrain | {layout.env.describe()} | device {layout.device} | backend "
        f"{layout.backend or 'none'} | mode {mode} | precision {cfg.train.precision}"
    )
    log_fitted(
        f"model {cfg.model.name}: {pieces.num_params / 1e6:.3f} M parameters | task "
        f"{cfg.task.name} | data {cfg.data.name} | effective batch {layout.effective_batch} = "
        f"{layout.batch_size} per rank x {world} rank(s) x {layout.grad_accum} "
        f"accumulation | {pieces.steps.per_epoch} steps per epoch"
    )
    if cfg.model.trust_remote_code:
        log.info("model.trust_remote_code on: the model folder's own code (auto_map) may run")
    for note in pieces.notes:
        log_fitted(note)
    log_fitted(f"run directory {run_dir} | {source}")
