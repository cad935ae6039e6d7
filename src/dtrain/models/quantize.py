"""int8 quantization of a trained model for inference, and the fake quantization that
quantization-aware training inserts, through torchao (extra `[quant]`).

Post-training schemes (`SCHEMES`): torchao's `quantize_` configs for the Linear layers
(int8-dynamic, int8-weight, int4-weight; the int8 ones quantize the embeddings too, a Linear
layer tied to an embedding keeping one int8 tensor with it), and static int8 for convolutions
and Linear layers through torch.export and torchao's PT2E flow with its x86 inductor quantizer,
calibrated on batches the caller gives (int8-static). `quantize` works on a copy: the caller's
model is left as it was.

Any speed of an int8 model comes from a compiled path: run eagerly, the int8 tensors are
quantized and dequantized op by op and are slower than fp32; what inductor gains by fusing them
into int8 kernels (oneDNN's on x86) depends on the scheme and the model. So `latency` measures a
model the way the caller says it will be deployed: eagerly or compiled.
"""

from __future__ import annotations

import copy
import difflib
import logging
import statistics
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch
from torch import nn

from dtrain.config import QAT_SCHEMES
from dtrain.core.errors import UserError, first_line
from dtrain.process import compat

# A batch as the model takes it: one input tensor, or its positional inputs.
Batch = torch.Tensor | tuple[torch.Tensor, ...]

# Fewer calibration batches than this and the activation ranges that static int8 fixes are one
# batch's accident more than the data's.
MIN_CALIBRATION_BATCHES = 4
# inductor's settings for a quantized model on the CPU: `freezing` folds the weights into
# constants, which is what lets its passes fuse quantize/dequantize pairs into oneDNN's int8
# convolutions and matmuls; `force_fuse_int_mm_with_mul` fuses the int8 matmul with its scale.
# The fp32 model is compiled with the same settings, so both sides of a comparison are alike.
COMPILE_SETTINGS: dict[str, Any] = {"freezing": True, "force_fuse_int_mm_with_mul": True}


@dataclass(frozen=True)
class Scheme:
    """A quantization scheme: what it does, the layers it quantizes, whether it needs
    calibration batches, whether it runs on the CPU, whether it puts the embeddings in int8
    too (`quantize_embeddings`)."""

    name: str
    does: str
    layers: tuple[type[nn.Module], ...]
    calibrates: bool
    cpu: bool
    embeddings: bool = False

    @property
    def layer_names(self) -> str:
        return " or ".join(f"nn.{layer.__name__}" for layer in self.layers)


SCHEMES = {
    scheme.name: scheme
    for scheme in (
        Scheme(
            "int8-dynamic",
            "int8 weights per output channel, activations quantized to int8 per token as they "
            "come (torchao's Int8DynamicActivationInt8WeightConfig)",
            (nn.Linear,),
            calibrates=False,
            cpu=True,
            embeddings=True,
        ),
        Scheme(
            "int8-weight",
            "int8 weights per output channel, activations left in float "
            "(torchao's Int8WeightOnlyConfig)",
            (nn.Linear,),
            calibrates=False,
            cpu=True,
            embeddings=True,
        ),
        Scheme(
            "int8-static",
            "int8 weights and activations with ranges fixed by calibration batches "
            "(torch.export, torchao's PT2E flow with the x86 inductor quantizer)",
            (nn.Conv2d, nn.Linear),
            calibrates=True,
            cpu=True,
        ),
        Scheme(
            "int4-weight",
            "int4 weights in groups of 128 along the input, activations in bfloat16 "
            "(torchao's Int4WeightOnlyConfig, a CUDA kernel)",
            (nn.Linear,),
            calibrates=False,
            cpu=False,
        ),
    )
}
INT4_GROUP_SIZE = 128


def library(feature: str = "quantization") -> ModuleType:
    """torchao, imported; one line naming the extra when it is not installed."""
    from dtrain.core.imports import require

    logging.getLogger("torch.utils._pytree").addFilter(_enum_registration_filter)
    return require("torchao", "quant", feature)


def _enum_registration_filter(record: logging.LogRecord) -> bool:
    """False for torch's warning that an Enum is registered with its pytree the way torch now
    deprecates, which torchao's modules do as they are imported (some only when first used):
    nothing a user can act on."""
    return "is an Enum subclass" not in record.getMessage()


def scheme_of(name: str) -> Scheme:
    """The scheme called `name`; one line naming the schemes when there is none."""
    if name not in SCHEMES:
        close = difflib.get_close_matches(name, SCHEMES, n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        raise UserError(
            f"quantize: unknown scheme '{name}'{hint}; the schemes are {', '.join(SCHEMES)}"
        )
    return SCHEMES[name]


def quantize(model: nn.Module, scheme: str, example_batches: Sequence[Batch]) -> nn.Module:
    """A quantized copy of `model` for inference (in eval mode) by the scheme called `scheme`.
    `example_batches`: the static scheme's calibration batches (at least
    MIN_CALIBRATION_BATCHES), and the example whose shape torch.export traces; the other
    schemes need none. The caller's model is not changed."""
    chosen = _check(model, scheme_of(scheme), example_batches)
    quantized = copy.deepcopy(model).eval()
    if chosen.name == "int8-static":
        return _static_int8(quantized, example_batches)
    if chosen.name == "int4-weight":
        quantized = quantized.to(torch.bfloat16)  # the int4 kernel's activations
    tied = tied_heads(quantized)
    library(f"quantize {chosen.name}").quantization.quantize_(
        quantized, torchao_config(chosen.name)
    )
    return quantize_embeddings(quantized, chosen.name, tied)


def tied_heads(model: nn.Module) -> list[tuple[str, str]]:
    """(Linear layer, embedding) by their names, for each Linear layer whose weight is an
    embedding's (an output head tied to the token embedding): found before quantizing, which
    gives each Linear layer a weight of its own."""
    embeddings = {
        id(module.weight): name
        for name, module in model.named_modules()
        if isinstance(module, nn.Embedding)
    }
    return [
        (name, embeddings[id(module.weight)])
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear) and id(module.weight) in embeddings
    ]


def quantize_embeddings(model: nn.Module, scheme: str, tied: list[tuple[str, str]]) -> nn.Module:
    """`model` (its Linear layers quantized by `scheme`) with its embeddings in int8 too, when
    the scheme quantizes them (`embedding_config`). Each Linear layer of `tied` (tied_heads,
    found before quantizing) then takes its embedding's int8 tensor again, in place of its own
    int8 copy, and computes with it weight-only: the head's weights per output row are the
    embedding's rows, the granularity both use. Both layers hold that tensor through a
    parametrization to its plain int8 data and scales (torchao's UnwrapTensorSubclass):
    torch.export.save stores plain tensors that share storage once, and each tensor subclass
    on its own."""
    if not scheme_of(scheme).embeddings:
        return model
    ao = library(f"quantize {scheme}")
    from torch.nn.utils import parametrize
    from torchao.utils import UnwrapTensorSubclass

    ao.quantization.quantize_(
        model, embedding_config(), filter_fn=lambda module, _: isinstance(module, nn.Embedding)
    )
    for head_name, embedding_name in tied:
        head, embedding = model.get_submodule(head_name), model.get_submodule(embedding_name)
        head.weight = embedding.weight
        for layer in (embedding, head):
            parametrize.register_parametrization(layer, "weight", UnwrapTensorSubclass())
    return model


def torchao_config(scheme: str) -> Any:
    """The torchao `quantize_` config by which the scheme called `scheme` quantizes Linear
    layers (every scheme but int8-static, which goes through the PT2E flow): what `quantize`
    and quantization-aware training's conversion apply, and what transformers' TorchAoConfig
    takes to quantize a model as it loads it. int8-dynamic's activations are asymmetric per
    token: torchao's fake quantizer has no symmetric per-token mode, and a model trained with
    fake quantization must be converted to the same numerics it was trained with."""
    chosen = scheme_of(scheme)
    ao = library(f"quantize {chosen.name}").quantization
    if chosen.name == "int8-dynamic":
        return ao.Int8DynamicActivationInt8WeightConfig(
            act_mapping_type=ao.MappingType.ASYMMETRIC, set_inductor_config=False
        )
    if chosen.name == "int8-weight":
        return ao.Int8WeightOnlyConfig(set_inductor_config=False)
    if chosen.name == "int4-weight":
        return ao.Int4WeightOnlyConfig(
            group_size=INT4_GROUP_SIZE,
            int4_packing_format="tile_packed_to_4d",
            set_inductor_config=False,
        )
    raise ValueError(f"{chosen.name} has no torchao quantize_ config (it is torchao's PT2E flow)")


def embedding_config() -> Any:
    """The torchao `quantize_` config by which the int8 schemes quantize an embedding: int8
    weights per row (per axis 0, a token's vector its own scale), dequantized as they are looked
    up (torchao's IntxWeightOnlyConfig)."""
    ao = library("quantize an embedding")
    from torchao.quantization.granularity import PerAxis

    return ao.quantization.IntxWeightOnlyConfig(weight_dtype=torch.int8, granularity=PerAxis(0))


def _check(model: nn.Module, scheme: Scheme, batches: Sequence[Batch]) -> Scheme:
    """`scheme`, when it can quantize `model` with `batches`; one line saying why not."""
    device = next(model.parameters(), torch.empty(0)).device
    if not scheme.cpu and device.type != "cuda":
        raise UserError(
            f"quantize {scheme.name}: needs a GPU (its kernel runs on CUDA) and the model is on "
            f"the {device.type}; on the CPU use int8-weight or int8-dynamic"
        )
    if not any(isinstance(module, scheme.layers) for module in model.modules()):
        raise UserError(
            f"quantize {scheme.name}: {type(model).__name__} has no {scheme.layer_names} "
            f"layer, the layers {scheme.name} quantizes"
        )
    if scheme.calibrates and len(batches) < MIN_CALIBRATION_BATCHES:
        raise UserError(
            f"quantize {scheme.name}: calibration needs at least {MIN_CALIBRATION_BATCHES} "
            f"batches, got {len(batches)}"
        )
    return scheme


def _static_int8(model: nn.Module, batches: Sequence[Batch]) -> nn.Module:
    """`model` captured by torch.export (its batch dimension left free), observed on `batches`
    and converted to int8 by torchao's PT2E flow with the x86 inductor quantizer."""
    library("quantize int8-static")
    from torchao.quantization.pt2e import move_exported_model_to_eval
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e
    from torchao.quantization.pt2e.quantizer import x86_inductor_quantizer as x86

    example = _inputs(batches[0])
    dynamic = tuple({0: torch.export.Dim.AUTO} for _ in example)
    try:
        captured = torch.export.export(model, example, dynamic_shapes=dynamic).module()
    except Exception as e:  # torch.export's refusals have many types: its message says which
        raise UserError(
            f"quantize int8-static: torch.export cannot capture {type(model).__name__}: "
            f"{first_line(e)}"
        ) from None
    quantizer = x86.X86InductorQuantizer()
    quantizer.set_global(x86.get_default_x86_inductor_quantization_config())
    with warnings.catch_warnings():
        # Layers the quantizer leaves in float (a max-pool after an unquantized norm) are
        # named one warning each: what int8-static is, not something to act on.
        warnings.filterwarnings("ignore", message="The input of .* is not quantized")
        prepared = prepare_pt2e(captured, quantizer)
    with torch.no_grad():
        for batch in batches:
            prepared(*_inputs(batch))
    converted = convert_pt2e(prepared)
    move_exported_model_to_eval(converted)
    _drop_unused_tensors(converted)
    return converted


def _drop_unused_tensors(graph_module: torch.fx.GraphModule) -> None:
    """Delete the parameters and buffers that no node of the graph reads: the float weights
    that convert_pt2e replaced by int8 ones stay attached otherwise, and are saved with it."""
    graph_module.graph.eliminate_dead_code()
    read = {node.target for node in graph_module.graph.nodes if node.op == "get_attr"}
    tensors = [*graph_module.named_parameters(), *graph_module.named_buffers()]
    for name in {name for name, _ in tensors} - read:
        owner, _, attribute = name.rpartition(".")
        delattr(graph_module.get_submodule(owner), attribute)
    graph_module.recompile()


def _inputs(batch: Batch) -> tuple[torch.Tensor, ...]:
    return batch if isinstance(batch, tuple) else (batch,)


def latency(model: nn.Module, batches: Sequence[Batch], compiled: bool) -> float:
    """Median milliseconds per batch of `model` on `batches`, the way it would be deployed:
    compiled by torch.compile (inductor, COMPILE_SETTINGS) when `compiled`, else eagerly.
    Every batch runs once first (a compiled model compiles each shape there, untimed)."""
    if not batches:
        raise ValueError("latency needs at least one batch")
    times = []
    run = torch.compile(model) if compiled else model
    # torch.compile compiles at the first call, under the settings in force there.
    with torch.no_grad(), compat.inductor_settings(COMPILE_SETTINGS if compiled else {}):
        for batch in batches:
            run(*_inputs(batch))
        for batch in batches:
            start = time.perf_counter()
            run(*_inputs(batch))
            times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000


def prepare_qat(model: nn.Module, scheme: str) -> nn.Module:
    """`model`, changed in place for quantization-aware training: each Linear layer fake-
    quantizes its weights and inputs the way `scheme` will quantize them, in float (torchao's
    QATConfig). Its state dict keeps the same keys and shapes."""
    _qat_scheme(model, scheme)
    ao = library(f"quantization-aware training ({scheme})")
    fake_int8 = ao.quantization.qat.IntxFakeQuantizeConfig
    ao.quantization.quantize_(
        model,
        ao.quantization.qat.QATConfig(
            activation_config=fake_int8(torch.int8, "per_token", is_symmetric=False),
            weight_config=fake_int8(torch.int8, "per_channel", is_symmetric=True),
            step="prepare",
        ),
    )
    return model


def convert_qat(model: nn.Module, scheme: str) -> nn.Module:
    """A quantized copy (in eval mode) of a model that `prepare_qat` prepared for `scheme`: its
    fake-quantized layers back to Linear layers, then quantized by `scheme`."""
    _qat_scheme(model, scheme)
    return _converted(copy.deepcopy(model).eval(), scheme)


def _converted(prepared: nn.Module, scheme: str) -> nn.Module:
    """`prepared` (a model prepare_qat prepared for `scheme`), converted in place. Its
    embeddings stay in float, as training computed them: the converted model keeps the
    numerics that training saw, where `quantize` puts them in int8 too."""
    ao = library(f"quantization-aware training ({scheme})")
    ao.quantization.quantize_(
        prepared, ao.quantization.qat.QATConfig(torchao_config(scheme), step="convert")
    )
    return prepared


def fake_quantization(model: nn.Module, on: bool) -> int:
    """Switch the fake quantization of a model that `prepare_qat` prepared on or off (off, its
    layers compute as the plain Linear layers do, bit for bit); the number of layers switched."""
    ao = library("quantization-aware training")
    layers = fake_quantized_layers(model)
    for layer in layers:
        ao.quantization.qat.linear.enable_linear_fake_quant(layer, enabled=on)
    return len(layers)


def fake_quantized_layers(model: nn.Module) -> list[nn.Module]:
    """The layers of `model` that `prepare_qat` made fake-quantize."""
    ao = library("quantization-aware training")
    return [m for m in model.modules() if isinstance(m, ao.quantization.qat.FakeQuantizedLinear)]


def quantized_after_qat(model: nn.Module, scheme: str) -> nn.Module:
    """The int8 model of `model`, a plain model that holds the weights of a run trained with
    fake quantization for `scheme` (rebuilt from its checkpoint, whose keys are the plain
    model's): prepared as training prepared it, then converted. `model` is not changed."""
    return _converted(prepare_qat(copy.deepcopy(model), scheme).eval(), scheme)


def _qat_scheme(model: nn.Module, name: str) -> None:
    """One line unless quantization-aware training can fake-quantize `model` for `name`."""
    scheme = scheme_of(name)
    if name not in QAT_SCHEMES:
        raise UserError(
            f"quantization-aware training: scheme {name} has no fake quantization; "
            f"the schemes it has are {', '.join(QAT_SCHEMES)}"
        )
    _check(model, scheme, [])
