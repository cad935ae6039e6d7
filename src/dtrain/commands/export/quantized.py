"""`dtrain export --quantize SCHEME`: the export quantized (models/quantize.py's schemes; for
ONNX, onnxruntime's tools), then measured against the same format's full-precision export on
the run's own validation split with the run's own evaluation (loop/evaluation.py, as `dtrain
eval` computes a checkpoint's metrics): both files loaded as a user would, the metric before and
after, the drop, both files' sizes and their latency per batch on this machine (the median over
the same validation batches, both in this one process). A drop beyond `--max-drop` exits 1 with
the figures and writes nothing; else the figures go to the run's `evals/` as JSON.

The drop is the task's: points of accuracy for classification (default at most 1), else the
relative rise of bits per byte (a language model on text) or of the loss, in % (default 2).
Static int8 calibrates on the run's training batches, read as the run reads them (its train
loader: its transforms, its shuffled order from the run's seed).
"""

from __future__ import annotations

import contextlib
import datetime
import itertools
import json
import os
import shutil
import tempfile
import warnings
from dataclasses import dataclass
from typing import Any

import torch

from dtrain import config, data, tasks
from dtrain.commands.export import quantized_files
from dtrain.commands.export.check import CheckFailed, discard
from dtrain.commands.export.checkpoint_model import config_with_data
from dtrain.commands.export.formats import ExportFormat, Job
from dtrain.commands.export.onnx_file import model_input
from dtrain.core.errors import UserError
from dtrain.core.urls import is_url
from dtrain.files import names, remote_copies
from dtrain.files.store import check_run_dir_entries, fsync_dir
from dtrain.loop import evaluation
from dtrain.models import quantize

# Training batches that static int8 calibrates on unless --calibration-batches says.
CALIBRATION_BATCHES = 16
# Validation batches timed on each side (each run once untimed first).
LATENCY_BATCHES = 10
LATENCY = ("compiled", "eager")


@dataclass(frozen=True)
class Request:
    """What --quantize asks for: the scheme, its calibration batches (None: the default), the
    largest drop accepted (None: the task's default) and how latency is measured."""

    scheme: str
    calibration_batches: int | None = None
    max_drop: float | None = None
    latency: str = "compiled"


@dataclass(frozen=True)
class Drop:
    """How a task's drop is measured: the metric, its unit, the default limit."""

    metric: str
    unit: str
    default: float

    def of(self, before: float, after: float) -> float:
        if self.unit == "points":  # accuracy: a fraction, the drop in points
            return (before - after) * 100
        return (after - before) / abs(before) * 100 if before else float("inf")


ACCURACY = Drop("val_acc", "points", 1.0)
BITS_PER_BYTE = Drop("val_bits_per_byte", "%", 2.0)
LOSS = Drop("val_loss", "%", 2.0)


def check_request(form: ExportFormat, request: Request) -> None:
    """--quantize's refusals that need no checkpoint: one line each."""
    scheme = quantize.scheme_of(request.scheme)
    form.check_quantize(scheme.name)
    if not form.runtime:  # quantized by torchao (else by the format's runtime's own tools)
        quantize.library(f"dtrain export --quantize {scheme.name}")
    if not scheme.cpu:
        raise UserError(
            f"export error: --quantize {scheme.name} needs a GPU (its kernel runs on CUDA) and "
            f"export runs on the CPU; on the CPU use int8-weight or int8-dynamic"
        )
    asked = request.calibration_batches
    if asked is not None and not scheme.calibrates:
        raise UserError(
            f"export error: --calibration-batches goes with a scheme that calibrates "
            f"(int8-static); {scheme.name} does not"
        )
    if asked is not None and asked < quantize.MIN_CALIBRATION_BATCHES:
        raise UserError(
            f"export error: --calibration-batches {asked}: {scheme.name} calibrates on at least "
            f"{quantize.MIN_CALIBRATION_BATCHES} training batches"
        )
    if request.latency not in LATENCY:
        raise UserError(f"export error: --latency {request.latency}: one of {', '.join(LATENCY)}")


def check_layers(model: torch.nn.Module, meta: dict, scheme_name: str, form: ExportFormat) -> None:
    """One line when the model has no layer that the scheme quantizes, or when the run trained
    quantization-aware for another scheme (or for a format whose own tools quantize)."""
    scheme = quantize.scheme_of(scheme_name)
    qat = quantized_files.trained_spec(meta).qat
    if (
        qat is not None
        and qat.scheme is not None
        and (qat.scheme != scheme.name or not form.converts_qat)
    ):
        raise UserError(
            f"export error: --quantize {scheme.name} --format {form.name}: the run trained "
            f"quantization-aware for {qat.scheme} (train.qat.scheme); export it with "
            f"--format exported --quantize {qat.scheme}, which converts what it trained"
        )
    if not any(isinstance(module, scheme.layers) for module in model.modules()):
        raise UserError(
            f"export error: --quantize {scheme.name}: {type(model).__name__} has no "
            f"{scheme.layer_names} layer, the layers {scheme.name} quantizes"
        )


@dataclass
class RunData:
    """The run's data as the run reads it, from the checkpoint's config: the task, the
    validation loader (world size 1) and the training loader."""

    cfg: config.Config
    task: Any
    datasets: data.Datasets
    loaders: data.Loaders

    def inputs(self, batch: Any) -> Any:
        """The model's input for a loader's batch, after the data's on-device step."""
        moved = data.to_device(batch, torch.device("cpu"), self.datasets.on_device)
        found = model_input(self.task, moved)
        if found is None:
            raise UserError(
                f"export error: --quantize runs the model on the run's batches, and the "
                f"{type(self.task).__name__} task does not say which part of a batch is the "
                f"model's input: give it a model_input(batch) method"
            )
        return found

    def calibration(self, count: int) -> list[Any]:
        batches: list[Any] = []
        for batch in self.loaders.train:
            if len(batches) == count:
                break
            batches.append(self.inputs(batch))
        if len(batches) < quantize.MIN_CALIBRATION_BATCHES:
            raise UserError(
                f"export error: calibration needs at least {quantize.MIN_CALIBRATION_BATCHES} "
                f"training batches and the run's training set gives {len(batches)}"
            )
        return batches

    def evaluate(self, model: Any) -> dict[str, float]:
        """The run's evaluation (loop/evaluation.py) of `model` on the validation split, in
        float32 on the CPU."""
        return evaluation.evaluate(
            model,
            self.task,
            self.loaders.val,
            self.loaders.val_sampler.valid_count,
            torch.device("cpu"),
            lambda b: data.to_device(b, torch.device("cpu"), self.datasets.on_device),
            contextlib.nullcontext,
        )

    def latency_batches(self) -> list[Any]:
        found: list[Any] = []
        for batch in self.loaders.val:
            if len(found) == LATENCY_BATCHES:
                break
            found.append(self.inputs(batch))
        return found


def run_data(meta: dict, overrides: list[str]) -> RunData:
    """The run's data from the checkpoint's config, with `data.*` overrides on top."""
    cfg = config_with_data(meta, overrides, "the run's data")
    datasets = data.build(cfg.data, cfg.run.seed, cfg.model.args)
    cpu = torch.device("cpu")
    loaders = data.loaders(
        datasets.train,
        datasets.val,
        cfg=cfg.data,
        seed=cfg.run.seed,
        rank=0,
        world_size=1,
        device=cpu,
    )
    return RunData(cfg, tasks.build(cfg.task, datasets.info), datasets, loaders)


def drop_of(metrics: dict[str, float]) -> Drop:
    for drop in (ACCURACY, BITS_PER_BYTE, LOSS):
        if drop.metric in metrics:
            return drop
    raise UserError("export error: --quantize measures val_acc or val_loss; the task gives neither")


def size_of(path: str) -> int:
    """Bytes of the file at `path` (with its `.data` beside it), or of the folder."""
    if os.path.isdir(path):
        return sum(size_of(os.path.join(path, n)) for n in os.listdir(path))
    extra = path + ".data"
    return os.path.getsize(path) + (os.path.getsize(extra) if os.path.exists(extra) else 0)


@dataclass(frozen=True)
class Measured:
    """The line to print and the result to keep in evals/ (once the file is in place)."""

    line: str
    name: str
    result: dict[str, Any]


def export(form: ExportFormat, job: Job, out: str, request: Request) -> Measured:
    """The quantized export at `out`, and its figures against the full-precision one. A drop
    beyond the limit removes it and exits 1 with the figures."""
    scheme = quantize.scheme_of(request.scheme)
    run = run_data(job.meta, job.overrides)
    count = request.calibration_batches or CALIBRATION_BATCHES
    calibration = run.calibration(count) if scheme.calibrates else []
    timed = run.latency_batches()
    plain_folder = os.path.join(os.path.dirname(out), ".plain")
    os.makedirs(plain_folder)
    try:
        plain = os.path.join(plain_folder, os.path.basename(out))
        written = form.write_plain(job, plain, timed[0])
        form.write_quantized(job, out, written, scheme.name, calibration)
        sides = {"before": plain, "after": out}
        metrics = {side: run.evaluate(form.load_file(p)) for side, p in sides.items()}
        compiled = request.latency == "compiled" and not form.runtime
        how = form.runtime or ("compiled (inductor)" if compiled else "eager")
        with warnings.catch_warnings():  # inductor's notes on the code it generates
            warnings.simplefilter("ignore")
            latency = {
                side: quantize.latency(form.load_file(p), timed, compiled)
                for side, p in sides.items()
            }
        sizes = {side: size_of(p) for side, p in sides.items()}
    finally:
        shutil.rmtree(plain_folder, ignore_errors=True)
    drop = drop_of(metrics["before"])
    lost = drop.of(metrics["before"][drop.metric], metrics["after"][drop.metric])
    limit = drop.default if request.max_drop is None else request.max_drop
    figures = _figures(drop, metrics, lost, limit, sizes, latency, how, timed)
    if not lost <= limit:  # NaN fails too
        discard(out, out + ".data")
        shutil.rmtree(out, ignore_errors=True)
        raise CheckFailed(
            f"export error: {scheme.name} costs {figures} (> --max-drop {limit:g}); "
            f"{out} was not written"
        )
    result = {
        "format": form.name,
        "scheme": scheme.name,
        "does": scheme.does if not form.runtime else f"{scheme.name} by {form.runtime}",
        "metric": drop.metric,
        "before": metrics["before"][drop.metric],
        "after": metrics["after"][drop.metric],
        "drop": lost,
        "drop_unit": drop.unit,
        "max_drop": limit,
        "metrics_before": metrics["before"],
        "metrics_after": metrics["after"],
        "size_bytes_before": sizes["before"],
        "size_bytes_after": sizes["after"],
        "size_ratio": sizes["after"] / sizes["before"],
        "latency_ms_before": latency["before"],
        "latency_ms_after": latency["after"],
        "latency_ratio": latency["after"] / latency["before"],
        "latency_how": how,
        "latency_batches": len(timed),
        "latency_batch_size": tasks.batch_size(timed[0]),
        "calibration_batches": len(calibration),
        "checkpoint": job.shown,
        "step": job.meta.get("train_state", {}).get("step"),
        "weights": job.weights,
        "data": {"name": run.cfg.data.name, "val_samples": len(run.datasets.val)},
        "overrides": job.overrides,
        "time": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
    }
    line = f"quantized {scheme.name} ({form.name}): {figures}"
    name = f"{os.path.basename(job.shown.rstrip(os.sep))}-{form.name}-{scheme.name}"
    return Measured(line, name, result)


def _figures(
    drop: Drop,
    metrics: dict[str, dict[str, float]],
    lost: float,
    limit: float,
    sizes: dict[str, int],
    latency: dict[str, float],
    how: str,
    timed: list[Any],
) -> str:
    before, after = metrics["before"][drop.metric], metrics["after"][drop.metric]
    return (
        f"{drop.metric} {before:.6g} -> {after:.6g} (drop {lost:.3g} {drop.unit}, max {limit:g}); "
        f"file {sizes['before'] / 1e6:.3g} MB -> {sizes['after'] / 1e6:.3g} MB "
        f"({sizes['after'] / sizes['before']:.2f}x); latency {latency['before']:.3g} -> "
        f"{latency['after']:.3g} ms a batch of {tasks.batch_size(timed[0])} "
        f"({latency['after'] / latency['before']:.2f}x, {how}, median of {len(timed)})"
    )


def evals_folder_of(checkpoint: str, out: str, run: str | None = None) -> str:
    """The run directory (or its URL in an object store) that holds the checkpoint, whose
    evals/ gets the figures: `run` when given (--run-dir), else the one above the checkpoint's
    checkpoints/ folder; else the folder of --out (here or in the store)."""
    if run is not None:
        return run
    if is_url(checkpoint):
        folder = remote_copies.checkpoint_folder(checkpoint)
        above, _, _ = folder.rpartition("/")
        run_url, _, parent = above.rpartition("/")
        if parent == names.CHECKPOINTS and run_url:
            return run_url
    else:
        folder = checkpoint if os.path.isdir(checkpoint) else os.path.dirname(checkpoint)
        parent = os.path.dirname(os.path.abspath(folder))
        run_dir = os.path.dirname(parent)
        if os.path.basename(parent) == names.CHECKPOINTS and os.path.isfile(
            os.path.join(run_dir, names.CONFIG)
        ):
            return run_dir
    if is_url(out):
        return out.rstrip("/").rsplit("/", 1)[0]
    return os.path.dirname(os.path.abspath(out))


def keep(measured: Measured, run_dir: str) -> str:
    """The figures written to `run_dir`/evals/<name>-<time>.json, never over an earlier file (a
    second one in the same second gets `-2`, ...); `run_dir` in an object store: written here,
    then uploaded as a new object. Returns its path or URL."""
    if not is_url(run_dir):
        return _write(measured, run_dir)
    with tempfile.TemporaryDirectory(prefix="dtrain-export-") as here:
        path = _write(measured, here)
        url = remote_copies.join(run_dir, names.EVALS, os.path.basename(path))
        remote_copies.upload_file(path, url, {}, "export")
    return url


def _write(measured: Measured, run_dir: str) -> str:
    check_run_dir_entries(run_dir, only=(names.EVALS,))  # never written through a link
    folder = os.path.join(run_dir, names.EVALS)
    os.makedirs(folder, exist_ok=True)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    for suffix in itertools.count(1):
        path = os.path.join(
            folder, f"{measured.name}-{stamp}{'' if suffix == 1 else f'-{suffix}'}.json"
        )
        try:
            with open(path, "x", encoding="utf-8") as f:
                json.dump(measured.result, f, indent=1)
                f.write("\n")
                f.flush()
                os.fsync(f.fileno())
            break
        except FileExistsError:
            continue
    fsync_dir(folder)
    return path
