"""The files of `dtrain export --quantize`: the quantized model made from the checkpoint's
(`quantized_model`, the one place where it is made), a program of it by torch.export, an ONNX
file quantized by onnxruntime's own tools and a Hugging Face folder quantized by transformers
with torchao, each from the full-precision export dtrain wrote and checked; and an ONNX file
loaded under onnxruntime, a folder by transformers, as a callable model, so that the run's
evaluation runs it as it runs a PyTorch model.
"""

from __future__ import annotations

import contextlib
import logging
import os
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from dtrain import config
from dtrain.commands.export.check import CheckFailed
from dtrain.commands.export.hf_files import TOKENIZER_FILES, copy_from_folder
from dtrain.commands.export.onnx_file import export_failure, run_session
from dtrain.commands.export.torch_files import save_compact
from dtrain.core.errors import UserError
from dtrain.core.imports import require
from dtrain.files import outputs
from dtrain.models import hf, quantize
from dtrain.models.spec import ModelSpec, spec_of
from dtrain.process import compat

# The ONNX operators that the schemes quantize: the Linear layers' (MatMul, Gemm), and for
# static int8 the convolutions' as well (as the PyTorch schemes' layers); dynamic int8 the
# embeddings' lookups too (Gather: its table in int8, one tensor with a head tied to it).
ONNX_LINEAR = ("MatMul", "Gemm")
ONNX_DYNAMIC = (*ONNX_LINEAR, "Gather")
ONNX_STATIC = ("Conv", *ONNX_LINEAR)
# int8 weights in blocks of this many inputs along each MatMul's input (onnxruntime's
# MatMulNBits with 8 bits, its weight-only format).
ONNX_WEIGHT_BLOCK = 32
ONNX_WEIGHT_LOGGER = "onnxruntime.quantization.matmul_nbits_quantizer"


def quantized_model(model: nn.Module, meta: dict, scheme: str, calibration: list[Any]) -> nn.Module:
    """The checkpoint's `model` quantized by `scheme` for inference (a copy; `calibration`: the
    model inputs that static int8 calibrates on). `meta`: the checkpoint's metadata, which says
    how the model was trained (a run trained with fake quantization converts here)."""
    spec = trained_spec(meta)
    if spec.qat is not None and spec.qat.scheme is not None:
        return spec.quantized(model)  # the fake quantization it trained with, made real
    return quantize.quantize(model, scheme, calibration)


def trained_spec(meta: dict) -> ModelSpec:
    """The model spec of the run the checkpoint's metadata comes from, quantization-aware
    training included."""
    cfg = config.from_dict(meta["config"])
    return spec_of(cfg.model, cfg.train.qat)


def write_program(model: nn.Module, meta: dict, out: str, example: Any) -> Any:
    """`model`'s program by torch.export on `example`, its batch dimension free (the evaluation's
    last batch may be smaller), saved at `out` without the source lines that traced each node
    (a debugging aid that names this machine's files and, for the many small operators of an
    int8 graph, weighs as much as a small model's int8 weights); returns `example`."""
    inputs = example if isinstance(example, tuple) else (example,)
    dynamic = tuple({0: torch.export.Dim.AUTO} for _ in inputs)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        try:
            program = torch.export.export(model, inputs, dynamic_shapes=dynamic)
        except Exception as e:  # noqa: BLE001 - torch.export's refusals have many types
            raise CheckFailed(export_failure(e).replace("ONNX exporter", "torch.export")) from None
        for node in program.graph.nodes:
            node.meta.pop("stack_trace", None)
        save_compact(program, out)
    return example


def write_onnx(plain: str, out: str, scheme: str, calibration: list[Any]) -> None:
    """The ONNX file `plain` quantized by `scheme` with onnxruntime's tools, at `out`:
    int8-dynamic by `quantize_dynamic` (int8 weights per channel, activations quantized as they
    come; an embedding's table in int8 per tensor, dequantized where it is read, one tensor with
    a head tied to it), int8-weight by MatMulNBits with 8 bits (int8 weights, float
    activations), int8-static by `quantize_static` (QDQ, ranges from the `calibration`
    inputs)."""
    ort = require("onnxruntime.quantization", "export", f"dtrain export --quantize {scheme}")
    with _quiet_logging():
        _quantize_onnx(ort, plain, out, scheme, calibration)


@contextlib.contextmanager
def _quiet_logging() -> Iterator[None]:
    """onnxruntime's quantization tools log advice and each node they skip to the root logger:
    the command's own line says what came of it."""
    loggers = [logging.getLogger(n) for n in ("", ONNX_WEIGHT_LOGGER)]
    levels = [each.level for each in loggers]
    for each in loggers:
        each.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for each, level in zip(loggers, levels, strict=True):
            each.setLevel(level)


def _quantize_onnx(ort: Any, plain: str, out: str, scheme: str, calibration: list[Any]) -> None:
    large = os.path.exists(plain + ".data")  # past 2 GB: the weights beside the graph
    if scheme == "int8-dynamic":
        ort.quantize_dynamic(
            plain,
            out,
            op_types_to_quantize=list(ONNX_DYNAMIC),
            per_channel=True,
            weight_type=ort.QuantType.QInt8,
            use_external_data_format=large,
        )
    elif scheme == "int8-weight":
        import onnx
        from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

        quantizer = MatMulNBitsQuantizer(
            onnx.load(plain), bits=8, block_size=ONNX_WEIGHT_BLOCK, is_symmetric=True
        )
        quantizer.process()
        quantizer.model.save_model_to_file(out, use_external_data_format=large)
    elif scheme == "int8-static":
        ort.quantize_static(
            plain,
            out,
            Calibration(plain, calibration),
            quant_format=ort.QuantFormat.QDQ,
            op_types_to_quantize=list(ONNX_STATIC),
            per_channel=True,
            activation_type=ort.QuantType.QUInt8,
            weight_type=ort.QuantType.QInt8,
            use_external_data_format=large,
        )
    else:
        raise UserError(f"export error: --format onnx has no --quantize {scheme}")


def write_hf_folder(plain: str, out: str, scheme: str, limit: int) -> None:
    """The Hugging Face folder `plain` quantized by `scheme` as transformers quantizes a model:
    loaded (float32, on the CPU) with a TorchAoConfig of the scheme's torchao config (the
    embeddings' too: `_torchao_config`), then saved
    by save_pretrained at `out` (safetensors files of at most `limit` bytes holding torchao's
    int8 tensors, config.json with the `quantization_config` that from_pretrained reads back),
    with `plain`'s tokenizer files."""
    config = _torchao_config(plain, scheme)
    model = _model_class(plain).from_pretrained(
        plain,
        quantization_config=config,
        dtype=torch.float32,
        device_map="cpu",
        local_files_only=True,
        trust_remote_code=False,
    )
    model.save_pretrained(out, max_shard_size=limit)
    copy_from_folder(plain, TOKENIZER_FILES, out)
    outputs.as_ordinary_files(out)


def _torchao_config(folder: str, scheme: str) -> Any:
    """transformers' TorchAoConfig that quantizes the folder's model by `scheme`: its Linear
    layers by the scheme's torchao config and, where the scheme quantizes embeddings and the
    model's output head is not tied to its input embedding, the input embedding by
    `quantize.embedding_config` and the head as a Linear layer. A tied pair stays in float:
    transformers cannot save a tied embedding quantized (it compares the tied tensors, which
    torchao's int8 tensor cannot), and untying it would store two copies."""
    transformers = hf.library(f"dtrain export --format hf --quantize {scheme}")
    linear = quantize.torchao_config(scheme)
    if not quantize.scheme_of(scheme).embeddings:
        return transformers.TorchAoConfig(linear)
    saved = transformers.AutoConfig.from_pretrained(
        folder, local_files_only=True, trust_remote_code=False
    )
    with torch.device("meta"):
        skeleton = _model_class(folder)(saved)
    embedding, head = skeleton.get_input_embeddings(), skeleton.get_output_embeddings()
    if head is None or head.weight is embedding.weight:
        return transformers.TorchAoConfig(linear)
    name = next(n for n, module in skeleton.named_modules() if module is embedding)
    ao = quantize.library(f"dtrain export --format hf --quantize {scheme}").quantization
    with _default_layers_accepted():
        per_layer = ao.FqnToConfig({name: quantize.embedding_config(), "_default": linear})
    return transformers.TorchAoConfig(per_layer, include_input_output_embeddings=True)


def load_hf_folder(path: str) -> nn.Module:
    """The Hugging Face folder at `path`, loaded by transformers as a user would (by the class
    its config.json's `architectures` names, what AutoModelFor... picks; a quantized folder's
    `quantization_config` applied as transformers reads it), in eval mode."""
    with _default_layers_accepted():  # the config is read back as it was written
        model = _model_class(path).from_pretrained(
            path, device_map="cpu", local_files_only=True, trust_remote_code=False
        )
    return model.eval()


@contextlib.contextmanager
def _default_layers_accepted() -> Iterator[None]:
    """torchao warns that `_default` (the config of every layer not named) is deprecated each
    time an FqnToConfig is made, written or read back; it is how transformers' TorchAoConfig
    takes the config of the layers it does not name: nothing a user can act on."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Config Deprecation: _default")
        yield


def _model_class(folder: str) -> Any:
    transformers = hf.library("dtrain export --format hf")
    saved = transformers.AutoConfig.from_pretrained(
        folder, local_files_only=True, trust_remote_code=False
    )
    return getattr(transformers, saved.architectures[0])


class Calibration:
    """onnxruntime's calibration data reader: each calibration input by the graph's input names."""

    def __init__(self, path: str, inputs: list[Any]) -> None:
        import onnxruntime

        session = onnxruntime.InferenceSession(path, providers=["CPUExecutionProvider"])
        self.names = [i.name for i in session.get_inputs()]
        self.feeds: Iterator[dict[str, Any]] = iter(
            [
                {n: t.numpy() for n, t in zip(self.names, compat.tensor_leaves(x), strict=False)}
                for x in inputs
            ]
        )

    def get_next(self) -> dict[str, Any] | None:
        return next(self.feeds, None)


class OnnxSession(nn.Module):
    """An ONNX file under onnxruntime (CPU), called as the model it was exported from: its
    outputs as tensors (one tensor for a graph of one output)."""

    def __init__(self, path: str) -> None:
        super().__init__()
        import onnxruntime

        self.session = onnxruntime.InferenceSession(path, providers=["CPUExecutionProvider"])

    def forward(self, *inputs: torch.Tensor) -> Any:
        got = [torch.from_numpy(o) for o in run_session(self.session, inputs)]
        return got[0] if len(got) == 1 else tuple(got)


class Program(nn.Module):
    """A program saved by torch.export, loaded by its own loader (`torch.export.load`) and
    called as the model it was exported from. Its module has no train/eval mode to switch (the
    program was captured in eval mode): the evaluation's `model.eval()` leaves it as it is."""

    def __init__(self, path: str) -> None:
        super().__init__()
        self.program = torch.export.load(path).module()

    def train(self, mode: bool = True) -> Program:
        return self

    def forward(self, *inputs: torch.Tensor) -> Any:
        return self.program(*inputs)
