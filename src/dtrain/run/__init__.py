"""`dtrain train`: the assembly of a run. It builds each component from its config section and
hands it over, in the order of a run, and takes them apart at the end:

config -> env -> layout -> dist -> run directory (lock, shared storage) -> pieces (data, task,
model wrapped for the parallel mode, starting weights) -> optimizer and schedule -> checkpointer
and its parts -> resume or start -> the run's record and config.yaml -> callbacks, the replica
groups and the trainer's components -> Trainer.fit() -> the record's last update -> (requeue)
-> dist.shutdown()

`components` builds the trainer's components, `resume` what a resume changes beyond the
checkpoint, `pieces` what is trained, `records` the runs table, `remote` a run in an object store,
`replica_groups` this launch's place among the replica groups (where it writes, where it
starts, what a healing group receives).
"""

from __future__ import annotations

import dataclasses
import os

import torch

from dtrain import checkpoint, data
from dtrain.config import DEFAULT_RUN_NAME, Config, dump, flatten, to_dict
from dtrain.core import signals
from dtrain.core.errors import Interrupted, PeerFailure, UserError, first_line
from dtrain.core.logs import log_fitted
from dtrain.files import names, outputs
from dtrain.files.objstore import StoreUnanswered
from dtrain.files.store import RunDirLock, Store, check_run_dir_entries, write_atomic
from dtrain.files.store_protocol import CheckpointStore
from dtrain.loop import optim
from dtrain.loop.ema import EmaWeights
from dtrain.loop.state import TrainState
from dtrain.loop.trainer import Trainer
from dtrain.observe import (
    RunFacts,
    RunLog,
    StartupClock,
    attach_log_files,
    log,
    profiling,
    setup_logging,
)
from dtrain.observe.sinks import EVALUATED
from dtrain.observe.trackers import check_installed as check_trackers
from dtrain.process import dist, slurm
from dtrain.process import env as env_mod
from dtrain.process.layout import Layout
from dtrain.run import records
from dtrain.run.components import (
    build_callbacks,
    build_checkpointer,
    build_learner,
    build_trainer,
)
from dtrain.run.eval_tasks import EvalTasks, read_eval_tasks
from dtrain.run.pieces import Pieces, build_pieces, layout_of
from dtrain.run.remote import RemoteRun
from dtrain.run.replica_groups import GroupLaunch
from dtrain.run.resume import already_past, resume_or_start


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


def train(cfg: Config, config_path: str | None = None) -> str:
    """Run training; returns 'finished', 'preempted' or 'stopped_early' (train.early_stop).
    Raises UserError for bad input."""
    clock = StartupClock()
    clock.mark("imports")
    env = env_mod.detect()
    cfg = resolve_run_name(cfg, env, config_path)
    group = GroupLaunch.of(cfg)  # parallel.replicas: this launch's group (or the run alone)
    cfg = group.config(cfg)
    layout = layout_of(cfg, env)
    check_trackers(cfg.log)  # a tracker without its library: exit 2 before any process group
    eval_tasks = read_eval_tasks(cfg)  # and task files that are not tasks, a missing tokenizer
    dist.init(layout, cfg.dist)
    clock.mark("process group")
    # The console from now on; the run directory's log files once the directory is this run's.
    setup_logging(dist.rank(), cfg.log.all_ranks)
    if group.lighthouse_line:
        log.info(group.lighthouse_line)
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
        outcome = _train(cfg, layout, record, pieces, clock, remote, eval_tasks, group)
        if outcome == "preempted" and dist.is_main() and group.requeues_its_job(env):
            # The checkpoint is complete (group 0's; another group keeps none): requeue.
            slurm.after_preemption(cfg.slurm.requeue, env, saved=group.keeps_the_run)
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


def _interrupted(store: CheckpointStore | None) -> Interrupted:
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
    eval_tasks: EvalTasks | None,
    group: GroupLaunch,
) -> str:
    """Build the trainer's components, resume or start, and hand them to the loop (`group`:
    this launch's place among the replica groups)."""
    run_dir = cfg.run_dir
    store = (  # the storage options also for a ckpt.resume in a store
        remote.store(run_dir)
        if remote
        else Store(run_dir, cfg.run.storage_options, cfg.run.store_timeout_s)
    )
    learner = build_learner(cfg, pieces)
    # Per-rank randomness from here on (dropout), by the rank's place among every group's ranks.
    torch.manual_seed(cfg.run.seed + 1 + group.global_rank(layout))
    state = TrainState()
    ema = EmaWeights.build(cfg.train.ema, learner.model)  # None unless train.ema.decay is set
    spec = pieces.spec
    cfg = group.start_point(cfg)  # another group's: group 0's newest checkpoint
    checkpoints = build_checkpointer(cfg, layout, store, pieces, learner, spec, state, ema)
    resumed = resume_or_start(checkpoints, cfg, layout, pieces, spec, state, learner.schedule)
    if resumed and state.reached(cfg.train.epochs, cfg.train.max_steps):
        # Nothing trains: config.yaml and the run's record keep saying what was trained.
        log.info(already_past(cfg, state, cfg.run_url or run_dir))
        return "finished"
    # Every check has passed (a resume refused for a changed config ends above): the run's
    # record and its config.yaml are written only now.
    record.start(store, resuming=resumed is not None)
    if dist.is_main():
        try:
            write_atomic(os.path.join(run_dir, names.CONFIG), dump(cfg).encode("utf-8"))
        except OSError as e:  # a full disk at the start of a resume: one line, nothing lost
            raise outputs.output_error("train", run_dir, e) from None
    monitor = (cfg.ckpt.monitor, cfg.ckpt.monitor_mode)
    facts = RunFacts(cfg.run_name, cfg.run.out_dir, monitor, flatten(to_dict(cfg)))
    run_log = RunLog(cfg.log, facts, run_dir, dist.is_main(), state.step, checkpoints.superseded)
    if remote is not None:
        remote.mirror.start()  # and before each checkpoint's marker (RemoteRun.store)
    pieces.notes.append(optim.describe_groups(learner.optimizer))
    if eval_tasks is not None:
        pieces.notes.append(eval_tasks.line())
    clock.mark("run directory and resume")
    shown = f"{cfg.run_url} (staged in {run_dir})" if cfg.run_url else run_dir
    _banner(cfg, layout, pieces, shown, resumed)
    profiler = profiling.Profiler(cfg.log.profile, run_dir, dist.rank(), layout.device)
    callbacks = build_callbacks(
        layout, record, clock, resumed, learner, ema, profiler, spec, state, eval_tasks
    )
    replicas = group.replicas(cfg, layout, checkpoints.contents, state.step)
    trainer = build_trainer(
        cfg, layout, pieces, learner, state, ema, checkpoints, run_log, callbacks, replicas
    )
    try:
        profiler.start()
        outcome = _fit_naming_lost_peers(trainer, cfg.dist.timeout_s)
        profiler.stop()
        final = {k: v for k, v in state.last_eval.items() if k.startswith(EVALUATED)}
        run_log.hparams(state.step, {**final, f"best_{cfg.ckpt.monitor}": state.best_metric})
    finally:
        replicas.close()
        run_log.close()
    record.update(state, outcome)
    log.info(f"{outcome} at step {state.step}: {cfg.run_url or run_dir}")
    return outcome


def _fit_naming_lost_peers(trainer: Trainer, timeout_s: float) -> str:
    """Run the loop; a collective broken by another rank becomes one clear line naming it
    (`timeout_s`: dist.timeout_s, how long the ranks waited)."""
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
            f"(collective timeout dist.timeout_s={timeout_s:g} s); "
            f"backend said: {first_line(e)}"
        ) from e


def _banner(
    cfg: Config, layout: Layout, pieces: Pieces, run_dir: str, resumed: checkpoint.Resumed | None
) -> None:
    world = layout.world_size
    source = f"resumed from {resumed.path} at step {resumed.step}" if resumed else "fresh start"
    if resumed and resumed.world_size != world:
        source += f" (world size {resumed.world_size} -> {world})"
    # The mode that runs: a single process wraps the model in nothing, whatever the config says.
    mode = layout.shown_mode(cfg.parallel.mode)
    log_fitted(
        f"dtrain | {layout.env.describe()} | device {layout.device} | backend "
        f"{layout.backend or 'none'} | mode {mode} | precision {cfg.train.precision}"
    )
    log_fitted(
        f"model {cfg.model.name}: {pieces.num_params / 1e6:.3f} M parameters | task "
        f"{cfg.task.name} | data {cfg.data.name} | effective batch {layout.effective_batch} = "
        f"{layout.batch_terms()} | {pieces.steps.per_epoch} steps per epoch"
    )
    if cfg.model.trust_remote_code:
        log.info("model.trust_remote_code on: the model folder's own code (auto_map) may run")
    for note in pieces.notes:
        log_fitted(note)
    log_fitted(f"run directory {run_dir} | {source}")
