"""`dtrain export --format onnx`: the model through torch.onnx's dynamo exporter, checked under
onnxruntime on a real validation batch.

The ONNX model takes what the model itself takes: the batch after the data's on-device step
(normalised float images, not the uint8 ones the loader hands over; token ids for a language
model), with a dynamic batch dimension (and a dynamic sequence length, up to the trained one, for
a language model). The check builds the run's validation set from the checkpoint's config, takes
its first batch (at most CHECK_BATCH samples), and runs it through PyTorch and onnxruntime, whole,
as its first sample alone and (a language model) as that sample's first half of tokens, the
dynamic dimensions at work: the largest absolute difference must be at most TOLERANCE (fp32), or
the file is removed and the command exits 1.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import time
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

import dtrain
from dtrain import data, tasks
from dtrain.commands.export.check import CheckFailed, discard
from dtrain.commands.export.checkpoint_model import config_with_data
from dtrain.core.errors import UserError, first_line
from dtrain.data import Normalize
from dtrain.process import compat

TOLERANCE = 1e-4
CHECK_BATCH = 32


@dataclass
class CheckBatch:
    """The model's input for the check, and what a serving team needs to know about it."""

    inputs: Any
    source: str  # what the inputs are, for the report line
    language: bool  # a language model's: the sequence length may vary too
    preprocess: dict[str, str] = field(default_factory=dict)  # the data's on-device step


@dataclass(frozen=True)
class Written:
    """What the check needs of the writing: the batch traced, and the report line's facts."""

    batch: CheckBatch
    opset: int | str
    seconds: float


def write(
    model: nn.Module, meta: dict, out: str, overrides: list[str], weights: str = "model"
) -> Written:
    """Export `model` to `out` on the first validation batch (`overrides`: data.* keys that
    say where it is read from); `weights`: which of the checkpoint's, for the metadata."""
    batch = validation_inputs(meta, overrides)
    inputs = batch.inputs
    seq_len = meta["model_info"].get("seq_len") if batch.language else None
    started = time.perf_counter()
    program = _onnx_program(model, inputs, dynamic_shapes(inputs, seq_len))
    program.model.metadata_props.update(_metadata(meta, weights, batch))
    program.save(out)
    return Written(batch, _opset(program), time.perf_counter() - started)


def read_back(model: nn.Module, path: str, out: str, written: Written) -> tuple[float, str]:
    """Check `out` under onnxruntime on the traced batch and smaller ones; returns the largest
    absolute difference to PyTorch's outputs and the verdict's line."""
    batch = written.batch
    others = smaller(batch.inputs, batch.language)
    found = check(model, out, [batch.inputs, *(each for each, _ in others)])
    items = [batch.source, *(what for _, what in others)]
    checked = ", ".join(items[:-1]) + " and " + items[-1]
    if not found <= TOLERANCE:  # NaN fails too
        discard(out, out + ".data")
        raise CheckFailed(
            f"export error: onnxruntime's outputs differ from PyTorch's by {found:.3g} "
            f"(> {TOLERANCE}) on {checked}; {out} was not written"
        )
    return found, (
        f"exported {path} -> {out} (onnx, opset {written.opset}, {written.seconds:.1f} s); "
        f"onnxruntime agrees with PyTorch on {checked}: "
        f"max abs difference {found:.2g} <= {TOLERANCE}"
    )


def _opset(program: Any) -> int | str:
    for entry in program.model_proto.opset_import:
        if entry.domain in ("", "ai.onnx"):
            return int(entry.version)
    return "?"


def _metadata(meta: dict, weights: str, batch: CheckBatch) -> dict[str, str]:
    """The ONNX model's metadata_props: what the model is, where its weights come from, and the
    preprocessing its input needs (the data's on-device step, which is not in the graph)."""
    model = meta["config"].get("model", {})
    return {
        "dtrain_version": dtrain.__version__,
        "model_name": json.dumps(model.get("name")),
        "model_args": json.dumps(model.get("args"), default=str),
        "weights": weights,
        "step": str(meta.get("train_state", {}).get("step", "")),
        **batch.preprocess,
    }


# ---------------------------------------------------------------------------------------------
# The model's input: a real validation batch after the on-device step


def validation_inputs(meta: dict, overrides: list[str]) -> CheckBatch:
    """The model's input for the first validation batch of the run's data, built from the
    checkpoint's config with `data.*` overrides on top."""
    cfg = config_with_data(meta, overrides, "the check's validation batch")
    try:
        datasets = data.build(cfg.data, cfg.run.seed, cfg.model.args)
    except UserError as e:
        raise UserError(
            f"{e} (the ONNX check runs a batch of the run's validation data: give its place "
            f"with data.* overrides, e.g. data.root=PATH)"
        ) from None
    task = tasks.build(cfg.task, datasets.info)
    size = min(cfg.data.eval_batch_size or cfg.data.batch_size, len(datasets.val), CHECK_BATCH)
    val: Any = datasets.val  # map-style, batched by its own __getitems__ where it has one
    loader = DataLoader(val, batch_size=size, shuffle=False, collate_fn=data.collate)
    batch = data.to_device(next(iter(loader)), torch.device("cpu"), datasets.on_device)
    inputs = model_input(task, batch)
    language = isinstance(task, tasks.LanguageModel)
    preprocess = _preprocess(datasets.on_device)
    if inputs is not None:
        source = f"the first validation batch ({size} sample{'s' if size > 1 else ''})"
        return CheckBatch(_at_least_two(inputs), source, language, preprocess)
    make = getattr(task, "example_input", None)
    if make is None:
        raise UserError(
            f"export error: --format onnx needs the model's input, and the "
            f"{type(task).__name__} task does not say which part of a batch that is: give it "
            f"a model_input(batch) method (or example_input(info, batch_size))"
        )
    source = "the task's example input (it has no model_input(batch))"
    return CheckBatch(make(datasets.info, 4), source, language, preprocess)


def _preprocess(on_device: Any) -> dict[str, str]:
    """What the serving side must do to raw images before the model: the data's normalisation
    (uint8 pixels in, float out), as metadata."""
    if not isinstance(on_device, Normalize):
        return {}
    mean = (on_device.mean / 255).flatten().tolist()
    std = (1 / (on_device.inv_std * 255)).flatten().tolist()
    return {
        "input": "float32 images (batch, channels, height, width): (pixel - 255 mean) / "
        "(255 std) per channel, pixels 0-255 in the data's channel order",
        "input_mean": json.dumps([round(v, 6) for v in mean]),
        "input_std": json.dumps([round(v, 6) for v in std]),
    }


def model_input(task: Any, batch: Any) -> Any:
    """What the model is called with for `batch`: the task's `model_input(batch)` where it has
    one; the inputs of a classification batch; a language model's token ids; the whole batch
    for a model that computes its own loss. None when the task cannot say."""
    own = getattr(task, "model_input", None)
    if callable(own):
        return own(batch)
    if isinstance(task, tasks.Classification):
        return batch[0]
    if isinstance(task, tasks.LanguageModel):
        return batch[:, :-1].long()  # as LanguageModel._split: ids in, the next ids as targets
    if isinstance(task, tasks.ModelLoss):
        return batch
    return None


def _at_least_two(inputs: Any) -> Any:
    """A batch of one sample repeated to two: torch.export fixes a dimension traced at size 1."""
    if tasks.batch_size(inputs) > 1:
        return inputs
    return compat.tree_map_tensors(lambda t: torch.cat([t, t]) if t.dim() else t, inputs)


def dynamic_shapes(inputs: Any, seq_len: int | None) -> Any:
    """Dimension 0 of every input tensor is the batch; with `seq_len` (a language model),
    dimension 1 is the sequence, up to the length the model was built for."""
    batch = torch.export.Dim("batch", min=1)
    tokens = torch.export.Dim("tokens", min=1, max=seq_len) if seq_len else None

    def dims(t: torch.Tensor) -> dict[int, Any] | None:
        if t.dim() == 0:
            return None
        return {0: batch, 1: tokens} if tokens is not None and t.dim() >= 2 else {0: batch}

    if isinstance(inputs, torch.Tensor):
        return (dims(inputs),)
    if isinstance(inputs, dict):
        return {k: dims(v) if isinstance(v, torch.Tensor) else None for k, v in inputs.items()}
    return (compat.tree_map_tensors(dims, inputs),)


# ---------------------------------------------------------------------------------------------
# Exporting, and an operator the exporter cannot convert


def _onnx_program(model: nn.Module, inputs: Any, dynamic: Any) -> Any:
    args, kwargs = ((), inputs) if isinstance(inputs, dict) else ((inputs,), None)
    names = ["input"] if isinstance(inputs, torch.Tensor) else None
    with torch.no_grad():
        outputs = _output_names(tasks.call(model, inputs))
    # The exporter reports its progress and advice on stdout and as warnings: the command's own
    # line says what came of it.
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()), torch.no_grad():
        warnings.simplefilter("ignore")
        try:
            return torch.onnx.export(
                model,
                args,
                kwargs=kwargs,
                dynamo=True,
                dynamic_shapes=dynamic,
                verbose=False,
                input_names=names,
                output_names=outputs,
            )
        except Exception as e:  # noqa: BLE001 - whatever the exporter met is the user's to fix
            raise CheckFailed(export_failure(e)) from None


def _output_names(output: Any) -> list[str] | None:
    """The graph's output names: `logits` for a model that returns one tensor, the keys of a
    dict of tensors; the exporter's own otherwise."""
    if isinstance(output, torch.Tensor):
        return ["logits"]
    if isinstance(output, dict) and all(isinstance(v, torch.Tensor) for v in output.values()):
        return [str(k) for k in output]
    return None


_TARGET = re.compile(r"target=(?:torch\.ops\.)?([\w.]+)")
_OVERLOAD = re.compile(r"OpOverload\(op='([\w.]+)', overload='(\w+)'\)")


def export_failure(error: BaseException) -> str:
    """One line for an export that failed: the operator the exporter could not convert where it
    names one, else what torch.export or the exporter reported."""
    chain = [error]
    while chain[-1].__cause__ is not None and len(chain) < 20:
        chain.append(chain[-1].__cause__)
    text = "\n".join(str(e) for e in chain)
    found = _OVERLOAD.search(text)
    operator = f"{found[1]}.{found[2]}" if found else None
    if operator is None and (found := _TARGET.search(text)):
        operator = found[1]
    reason = f"{type(chain[-1]).__name__}: {_plain(first_line(chain[-1]))}"
    if operator is not None:
        return (
            f"export error: the ONNX exporter cannot convert the operator {operator} "
            f"({reason}); keep it out of the exported forward, or export another format"
        )
    return f"export error: torch.onnx.export failed: {reason}"


def _plain(text: str) -> str:
    """`text` without terminal colour codes (the exporter's messages carry some)."""
    return re.sub(r"\x1b\[[0-9;]*m", "", text)


# ---------------------------------------------------------------------------------------------
# The check under onnxruntime


def smaller(inputs: Any, language: bool) -> list[tuple[Any, str]]:
    """Inputs of other sizes than the traced batch, and what they are: its first sample alone
    (the batch dimension is dynamic) and, for a language model, that sample's first half of
    tokens (so is the sequence length)."""
    first = compat.tree_map_tensors(lambda t: t[:1] if t.dim() else t, inputs)
    found = [(first, "its first sample alone")]
    if language and isinstance(inputs, torch.Tensor) and inputs.shape[1] > 1:
        half = inputs.shape[1] // 2
        found.append((first[:, :half], f"that sample's first {half} tokens"))
    return found


def check(model: nn.Module, path: str, inputs: list[Any]) -> float:
    """The largest absolute difference between PyTorch's and onnxruntime's outputs over every
    input of `inputs`."""
    import onnxruntime

    session = onnxruntime.InferenceSession(path, providers=["CPUExecutionProvider"])
    return max(_difference(model, session, each) for each in inputs)


def run_session(session: Any, inputs: Any) -> list[Any]:
    """onnxruntime's outputs for `inputs` (a tensor, a dict by input name, or a structure whose
    tensors are the graph's inputs in order)."""
    names = [i.name for i in session.get_inputs()]
    if isinstance(inputs, dict):
        feed = {k: v.numpy() for k, v in inputs.items() if k in names}
    else:
        feed = {n: t.numpy() for n, t in zip(names, compat.tensor_leaves(inputs), strict=False)}
    return session.run(None, feed)


def _difference(model: nn.Module, session: Any, inputs: Any) -> float:
    with torch.no_grad():
        expected = compat.tensor_leaves(tasks.call(model, inputs))
    got = run_session(session, inputs)
    if len(got) != len(expected):
        raise CheckFailed(
            f"export error: the ONNX model gives {len(got)} output(s), PyTorch "
            f"{len(expected)}; the export is not the model"
        )
    return max(
        (torch.from_numpy(g).float() - e.float()).abs().max().item()
        for g, e in zip(got, expected, strict=True)
    )
