"""int8 quantization (models/quantize.py): each scheme on the built-in CNN and GPT stays close to
fp32 and passes torch.export, the caller's model is left as it was, bad input gets one line, and
quantization-aware training's fake quantization goes in and comes out."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from dtrain import models
from dtrain.config import ModelConfig
from dtrain.core.errors import UserError
from dtrain.models import quantize

GPT_ARGS = {"vocab_size": 256, "seq_len": 32, "dim": 64, "depth": 2, "heads": 4}
# Largest error against fp32 relative to the largest fp32 logit, with margin (seen on these
# models: int8-dynamic 1.2 %, int8-weight 1.0 %, int8-static 0.6 % on the CNN, 1.5 % on the GPT).
MAX_ERROR = {"int8-dynamic": 0.04, "int8-weight": 0.03, "int8-static": 0.05}


def error(got: torch.Tensor, expected: torch.Tensor) -> float:
    return ((got - expected).abs().max() / expected.abs().max()).item()


def cnn() -> nn.Module:
    cfg = ModelConfig(name="simple_cnn", args={"width": 8})
    return models.build(cfg, {"num_classes": 10, "in_channels": 3}, seed=0).eval()


def gpt() -> nn.Module:
    return models.build(ModelConfig(name="gpt", args=GPT_ARGS), {}, seed=0).eval()


def images(n: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randn(8, 3, 32, 32, generator=generator) for _ in range(n)]


def tokens(n: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(0, 256, (4, 32), generator=generator) for _ in range(n)]


CASES = [
    ("int8-dynamic", gpt, tokens),
    ("int8-weight", gpt, tokens),
    ("int8-static", cnn, images),
    ("int8-static", gpt, tokens),
]


@pytest.mark.parametrize(("scheme", "make", "data"), CASES)
def test_a_scheme_stays_close_to_fp32_and_exports(scheme, make, data) -> None:
    model = make()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    batches = data(quantize.MIN_CALIBRATION_BATCHES)
    quantized = quantize.quantize(model, scheme, batches)
    # A held-out batch, of another size than the calibration's (the batch dimension is free).
    held_out = data(quantize.MIN_CALIBRATION_BATCHES + 1)[-1][:3]
    with torch.no_grad():
        expected, got = model(held_out), quantized(held_out)
    assert error(got, expected) < MAX_ERROR[scheme]
    assert quantized is not model
    # int8-static's is a graph of the model in eval mode (torch.export's capture).
    assert scheme == "int8-static" or not quantized.training
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    if scheme == "int8-static":
        # The float weights that int8 ones replaced are not kept beside them: what stays float
        # is the embeddings, norms and biases (18 % of this GPT's parameters).
        kept = [t for t in [*quantized.parameters(), *quantized.buffers()] if t.is_floating_point()]
        assert sum(t.numel() for t in kept) < 0.25 * sum(p.numel() for p in model.parameters())
    exported = torch.export.export(quantized, (held_out,))
    with torch.no_grad():
        assert torch.allclose(exported.module()(held_out), got)


def test_linear_schemes_quantize_the_linear_weights() -> None:
    for scheme in ("int8-dynamic", "int8-weight"):
        quantized = quantize.quantize(gpt(), scheme, [])
        weight = quantized.blocks[0].attn.qkv.weight
        assert type(weight).__name__ == "Int8Tensor", scheme


def test_int8_schemes_quantize_the_embeddings_and_a_tied_head_keeps_one_tensor(tmp_path) -> None:
    """The token embedding and the head tied to it share one int8 tensor, which the saved
    program stores once and loads back shared; the position embedding is int8 too."""
    for scheme in ("int8-dynamic", "int8-weight"):
        model = gpt()
        quantized = quantize.quantize(model, scheme, [])
        assert model.head.weight is model.tok_emb.weight  # the caller's tie is left as it was
        assert type(quantized.pos_emb.weight).__name__ == "IntxUnpackedToInt8Tensor"
        int8 = [layer.parametrizations.weight.original0 for layer in (quantized.tok_emb,
                                                                      quantized.head)]
        assert int8[0].dtype == torch.int8 and int8[0].shape == model.tok_emb.weight.shape
        assert int8[0].data_ptr() == int8[1].data_ptr()
        batch = tokens(1)[0]
        path = tmp_path / f"{scheme}.pt2"
        torch.export.save(torch.export.export(quantized, (batch,)), path)
        loaded = torch.export.load(path)
        tables = [loaded.state_dict[f"{layer}.parametrizations.weight.original0"]
                  for layer in ("tok_emb", "head")]
        assert tables[0].untyped_storage().data_ptr() == tables[1].untyped_storage().data_ptr()
        with torch.no_grad():
            assert torch.equal(loaded.module()(batch), quantized(batch))
            assert error(quantized(batch), model(batch)) < MAX_ERROR[scheme]


def test_latency_is_a_median_in_milliseconds() -> None:
    assert quantize.latency(cnn(), images(2), compiled=False) > 0


@pytest.mark.slow
def test_static_int8_compiles_to_inductor() -> None:
    """The compiled path packs int8 weights for oneDNN, which needs inductor's freezing."""
    model = cnn()
    quantized = quantize.quantize(model, "int8-static", images(quantize.MIN_CALIBRATION_BATCHES))
    assert quantize.latency(quantized, images(2), compiled=True) > 0


@pytest.mark.parametrize(
    ("model", "scheme", "batches", "message"),
    [
        (cnn, "int8-dinamic", [], "quantize: unknown scheme 'int8-dinamic' (did you mean "
         "'int8-dynamic'?); the schemes are int8-dynamic, int8-weight, int8-static, int4-weight"),
        (lambda: nn.Sequential(nn.Conv2d(3, 4, 3)), "int8-dynamic", [],
         "quantize int8-dynamic: Sequential has no nn.Linear layer, the layers int8-dynamic "
         "quantizes"),
        (lambda: nn.Sequential(nn.LayerNorm(4)), "int8-static", images(4),
         "quantize int8-static: Sequential has no nn.Conv2d or nn.Linear layer, the layers "
         "int8-static quantizes"),
        (cnn, "int8-static", images(3),
         "quantize int8-static: calibration needs at least 4 batches, got 3"),
        (gpt, "int4-weight", [],
         "quantize int4-weight: needs a GPU (its kernel runs on CUDA) and the model is on the "
         "cpu; on the CPU use int8-weight or int8-dynamic"),
    ],
)
def test_bad_input_is_one_line(model, scheme, batches, message) -> None:
    with pytest.raises(UserError) as e:
        quantize.quantize(model(), scheme, batches)
    assert str(e.value) == message


def test_qat_fake_quantizes_and_converts() -> None:
    model = gpt()
    keys = {k: v.shape for k, v in model.state_dict().items()}
    prepared = quantize.prepare_qat(model, "int8-dynamic")
    assert prepared is model
    assert type(model.blocks[0].attn.qkv).__name__ == "FakeQuantizedLinear"
    # Checkpoints of a prepared model have the keys and shapes of the plain model's.
    assert {k: v.shape for k, v in model.state_dict().items()} == keys
    model.train()
    loss = model(tokens(1)[0]).logsumexp(-1).mean()
    loss.backward()  # fake quantization lets gradients through
    assert model.blocks[0].attn.qkv.weight.grad is not None
    model.eval()
    batch = tokens(1)[0]
    with torch.no_grad():
        fake = model(batch)
        converted = quantize.convert_qat(model, "int8-dynamic")
        real = converted(batch)
    assert not any("FakeQuantized" in type(m).__name__ for m in converted.modules())
    assert type(converted.blocks[0].attn.qkv.weight).__name__ == "Int8Tensor"
    # Converting keeps the numerics that training saw.
    assert error(real, fake) < 1e-4
    # The prepared model goes on fake-quantizing (training may continue from it).
    assert type(model.blocks[0].attn.qkv).__name__ == "FakeQuantizedLinear"


def test_qat_of_a_scheme_without_fake_quantization_is_one_line() -> None:
    with pytest.raises(UserError) as e:
        quantize.prepare_qat(gpt(), "int8-static")
    assert str(e.value) == (
        "quantization-aware training: scheme int8-static has no fake quantization; the "
        "schemes it has are int8-dynamic")


def test_without_torchao_one_line_names_the_extra(tmp_path: Path) -> None:
    from conftest import child_env, without_module

    code = (
        "import torch\n"
        "from dtrain.core.errors import UserError\n"
        "from dtrain.models import quantize\n"
        "try:\n"
        "    quantize.quantize(torch.nn.Linear(2, 2), 'int8-dynamic', [])\n"
        "except UserError as e:\n"
        "    print(e)\n"
    )
    env = child_env(without_module(tmp_path / "shim", "torchao"))
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.splitlines() == [
        "missing dependency: quantize int8-dynamic needs the 'quant' extra: "
        "pip install 'dtrain[quant]'"]
