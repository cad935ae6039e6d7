"""`dtrain eval`: a checkpoint's metrics, computed by the evaluation that training runs.

    dtrain eval --run-dir DIR [--checkpoint latest|best|PATH] [--weights model|ema]
                [--profile [--profile-dir DIR]] [--config X] [section.key=value ...]

The run's pieces are built from `DIR/config.yaml` (with the keys of `--config X` and the
overrides on top) by the training code itself (`run.pieces`, the validation split alone); the
checkpoint's model weights are loaded the way a resume loads them (every file read is checked
against the marker's digests; a sharded checkpoint is resharded by DCP to this launch's world
size); and training's own evaluation (`loop.evaluation.evaluate`) computes the metrics, each
validation sample counted once over all ranks.

Read-only: the run's lock is not taken (the training job may hold it), the checkpoint store is
only listed (never `prepare`d, which moves folders), and nothing in DIR is written but
`DIR/evals/<checkpoint>-<time>.json`, by rank 0 (and with `--profile`, the traces: profiled.py).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import tempfile
from typing import Any

from dtrain import data
from dtrain.commands.evaluate import profiled
from dtrain.commands.evaluate import tasks as task_eval
from dtrain.config import Config
from dtrain.core.errors import UserError
from dtrain.core.urls import is_url
from dtrain.files import names, outputs, remote_copies
from dtrain.files.store import check_run_dir_entries, fsync_dir
from dtrain.loop import evaluation
from dtrain.observe import StartupClock, log, setup_logging
from dtrain.process import dist
from dtrain.process import env as env_mod
from dtrain.process.layout import Layout
from dtrain.run.pieces import EvalPieces, build_eval_pieces
from dtrain.run.trained import (
    Chosen,
    check_ema,
    choose,
    fetched,
    layout_here,
    load_weights,
    run_config,
    run_dir_and_overrides,
)

EVALS = names.EVALS


# ---------------------------------------------------------------------------------------------
# The evaluation training runs


def evaluate(
    cfg: Config, layout: Layout, pieces: EvalPieces, profile: profiled.EvalProfile | None = None
) -> dict[str, float]:
    """Training's own evaluation (`loop.evaluation`) of the loaded model (with `profile`, its
    loader timed). A checkpoint's buffers are the same on every rank already (averaged before
    the save): they are not averaged again, which could only add rounding at some world sizes."""
    device, on_device = layout.device, pieces.datasets.on_device
    return evaluation.evaluate(
        pieces.model,
        pieces.task,
        pieces.val_loader if profile is None else profile.loader(pieces.val_loader),
        pieces.val_sampler.valid_count,
        device,
        lambda batch: data.to_device(batch, device, on_device, cfg.model.channels_last),
        pieces.precision.autocast,
    )


# ---------------------------------------------------------------------------------------------
# The result


def describe_data(cfg: Config, val_samples: int) -> dict[str, Any]:
    described: dict[str, Any] = {"name": cfg.data.name}
    if cfg.data.name == "synthetic":
        described["val_size"] = cfg.data.synthetic.val_size
    elif cfg.data.tokens.mix is not None:  # the mix's folders, not data.root (left unset)
        described["mix"] = [dict(entry) for entry in cfg.data.tokens.mix]
    else:
        described["root"] = os.path.abspath(cfg.data.root)
    described["val_samples"] = val_samples
    return described


def write_result(run_dir: str, name: str, result: dict[str, Any]) -> str:
    """`DIR/evals/<name>-<time>.json`, atomically, never over an earlier result (a second
    evaluation in the same second gets `-2`, ...)."""
    check_run_dir_entries(run_dir, only=(EVALS,))  # never written through a link
    folder = os.path.join(run_dir, EVALS)
    os.makedirs(folder, exist_ok=True)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    tmp = os.path.join(folder, f".tmp-{name}-{stamp}-{os.getpid()}.json")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=1)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    suffix = 1
    try:
        while True:
            again = "" if suffix == 1 else f"-{suffix}"
            final = os.path.join(folder, f"{name}-{stamp}{again}.json")
            try:
                os.link(tmp, final)  # complete the moment it has its name; fails if taken
                break
            except FileExistsError:
                suffix += 1
            except OSError:  # a filesystem without hard links: a rename, after looking
                if os.path.exists(final):
                    suffix += 1
                    continue
                os.replace(tmp, final)
                break
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    fsync_dir(folder)
    return final


def _line(chosen: Chosen, metrics: dict[str, float], samples: int | None, path: str) -> str:
    """`samples`: the validation samples evaluated (None: tasks were scored)."""
    shown = " ".join(f"{k} {v:.6g}" for k, v in metrics.items())
    what = "tasks" if samples is None else f"{samples} validation samples"
    return f"{chosen.name}: {shown} | {what}, world size {dist.world_size()} -> {path}"


# ---------------------------------------------------------------------------------------------
# The command


def main(args: argparse.Namespace) -> int:
    run_dir, overrides = run_dir_and_overrides(args.run, args.overrides, "eval")
    if args.profile_dir is not None and not args.profile:
        raise UserError("usage error: --profile-dir DIR goes with --profile")
    if args.tasks is not None and args.profile:
        raise UserError(
            "usage error: --profile times the validation split's evaluation, not --tasks"
        )
    args.task_set = task_eval.task_files(args.tasks) if args.tasks is not None else None
    with tempfile.TemporaryDirectory(prefix="dtrain-eval-") as copies:
        return _evaluate_run(args, run_dir, overrides, copies)


def _evaluate_run(args: argparse.Namespace, run_dir: str, overrides: list[str], copies: str) -> int:
    """`copies`: this process's folder for what it reads of a run in an object store (its
    config.yaml, the checkpoint) and for the result before it is uploaded."""
    records = run_dir  # the folder that holds config.yaml and gets evals/
    if is_url(run_dir):
        records = os.path.join(copies, "run")
        saved = os.path.join(records, names.CONFIG)
        remote_copies.fetch_file(run_dir, names.CONFIG, saved, {}, "eval")
    cfg = run_config(records, args.config, overrides, args.trust_remote_code, run_dir, "eval")
    options = dict(cfg.run.storage_options)
    env = env_mod.detect()
    cfg, layout = layout_here(cfg, env)
    dist.init(layout, cfg.dist)
    setup_logging(dist.rank(), cfg.log.all_ranks)
    val_loader: Any = None
    profile: profiled.EvalProfile | None = None
    try:
        listing = os.path.join(copies, "listing")  # rank 0 picks for all (a run may save now)
        chosen = dist.on_main(lambda: choose(run_dir, args.checkpoint, cfg, listing, "eval"))
        chosen = fetched(chosen, os.path.join(copies, "checkpoint"), options)
        if args.weights == "ema":
            dist.on_main(lambda: check_ema(chosen, "eval"))
        if args.task_set is not None:
            return _score_tasks(args, cfg, layout, chosen, (run_dir, records, options), overrides)
        if args.profile:
            made = dist.on_main(
                lambda: profiled.trace_folder(run_dir, chosen.name, args.profile_dir)
            )
            profile = profiled.EvalProfile(profiled.joined(made), dist.rank(), layout.device)
        pieces = build_eval_pieces(cfg, layout, StartupClock())
        val_loader = pieces.val_loader
        _load(pieces, chosen, cfg, args.weights)
        samples = len(pieces.datasets.val)
        log.info(
            f"evaluating {chosen.shown} (step {chosen.step}, {chosen.fmt}, saved at world size "
            f"{chosen.saved_world_size}; {args.weights} weights) on {cfg.data.name} "
            f"({samples} validation samples) at world size {dist.world_size()}"
            + (f"; profiled, traces in {profile.folder}" if profile else "")
        )
        with profile.running() if profile else contextlib.nullcontext():
            metrics = evaluate(cfg, layout, pieces, profile)
        metrics = _named_for(args.weights, metrics)
        if dist.is_main():
            result = {
                **metrics,
                "checkpoint": chosen.url or os.path.abspath(chosen.folder),
                "step": chosen.step,
                "weights": args.weights,
                "data": describe_data(cfg, samples),
                "world_size": dist.world_size(),
                "config": args.config,
                "overrides": overrides,
                "time": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            }
            if profile is not None:
                result["profile"] = summary = profile.summary()
                print(
                    "\n".join(profiled.lines(summary, dist.world_size(), profile.folder, run_dir))
                )
            path = _keep_result(run_dir, records, chosen, result, options, metrics, samples)
            print(_line(chosen, metrics, samples, path), flush=True)
        dist.barrier()
        return 0
    except UserError as e:
        dist.announce_abort(str(e))  # ranks left waiting in a collective stop with this line
        raise
    finally:
        if profile is not None:
            profile.close()
        data.close_loader(val_loader)
        dist.shutdown()


def _load(pieces: EvalPieces, chosen: Chosen, cfg: Config, weights: str) -> None:
    """The checkpoint's weights (`weights`: model or ema) into the model, which is then as
    training evaluated it at the checkpoint's step."""
    load_weights(pieces.model, chosen, cfg, "eval")
    pieces.as_trained_at(chosen.step)
    if weights == "ema":
        from dtrain.loop import ema

        # The checkpoint's buffers (BatchNorm statistics) stay: training evaluates its
        # average with the model's own, as here.
        ema.load_ema_into(pieces.model, chosen.folder)


def _named_for(weights: str, metrics: dict[str, float]) -> dict[str, float]:
    """The metrics as the run's own evaluations name them: those of the moving average (`weights`
    ema) with the suffix `_ema` (`val_loss_ema`, `task_<name>_<metric>_ema`)."""
    if weights != "ema":
        return metrics
    from dtrain.loop.ema import SUFFIX

    return {k + SUFFIX: v for k, v in metrics.items()}


def _score_tasks(
    args: argparse.Namespace,
    cfg: Config,
    layout: Layout,
    chosen: Chosen,
    where: tuple[str, str, dict[str, Any]],
    overrides: list[str],
) -> int:
    """--tasks: the checkpoint scored on the tasks; the result kept as any evaluation's.
    `where`: the run directory, the folder that holds its records here, the store's options."""
    scored = task_eval.scored(cfg, layout, chosen, args.task_set, args.weights)
    metrics = _named_for(args.weights, scored)
    if dist.is_main():
        result = task_eval.result_of(args, chosen, metrics, overrides)
        path = _keep_result(*where[:2], chosen, result, where[2], metrics, None)
        print(_line(chosen, metrics, None, path), flush=True)
    dist.barrier()
    return 0


def _keep_result(
    run_dir: str,
    records: str,
    chosen: Chosen,
    result: dict[str, Any],
    options: dict[str, Any],
    metrics: dict[str, float],
    samples: int | None,
) -> str:
    """`result` in `records/evals/` and, for a run in an object store, uploaded beside its
    checkpoints: where it went. A failure prints the metrics first (they were computed: they
    are shown even when they cannot be kept), then raises its one line."""
    where = remote_copies.join(run_dir, EVALS) if is_url(run_dir) else None
    try:
        path = write_result(records, chosen.name, result)
        if where is not None:  # a run in a store: its result goes there, a new object
            url = remote_copies.join(where, os.path.basename(path))
            remote_copies.upload_file(path, url, options, "eval")
            path = url
    except OSError as e:
        print(_line(chosen, metrics, samples, "not saved"), flush=True)
        raise outputs.output_error("eval", os.path.join(run_dir, EVALS), e) from None
    except UserError:
        print(_line(chosen, metrics, samples, "not saved"), flush=True)
        raise
    return path
