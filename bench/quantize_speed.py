"""int8 quantization's latency on this CPU: each scheme of models/quantize.py against fp32, run
eagerly and compiled (torch.compile, inductor), on the default config's CNN (configs/default.yaml:
simple_cnn width 16, batches of 64 images 3x32x32) and the built-in GPT (its default size: dim
256, 4 blocks, 256 tokens; batches of 8 sequences).

Every model is quantized once; then rounds alternate the variants (each round starting with
another), and a variant's latency in a round is the median over the batches of
models/quantize.py's `latency`. A figure is the median over rounds of scheme/fp32 within each
round, the detail its range over rounds; beside it the size of the model saved by
torch.export.save, quantized against fp32. Latency is not accuracy: the error against fp32 is
shown as a sanity check only (the largest logit difference on one batch).

    python bench/quantize_speed.py [--rounds 5] [--batches 8] [--threads 1]
"""

from __future__ import annotations

import argparse
import io
import sys
from collections.abc import Callable
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from common import Figure  # noqa: E402

SCHEMES = ("int8-dynamic", "int8-weight", "int8-static")
GPT_ARGS = {"vocab_size": 256, "seq_len": 256, "dim": 256, "depth": 4, "heads": 4}


def _models() -> dict[str, tuple[Callable, Callable]]:
    """name -> (a builder of the fp32 model in eval mode, a maker of n batches)."""
    import torch

    from dtrain import config, models

    default = config.load(str(common.REPO / "configs" / "default.yaml"), [])
    batch_size = default.data.batch_size
    info = {"num_classes": 10, "in_channels": 3, "image_size": 32}

    def cnn() -> torch.nn.Module:
        return models.build(default.model, info, seed=0).eval()

    def gpt() -> torch.nn.Module:
        return models.build(config.ModelConfig(name="gpt", args=GPT_ARGS), {}, seed=0).eval()

    def images(n: int) -> list:
        generator = torch.Generator().manual_seed(0)
        return [torch.randn(batch_size, 3, 32, 32, generator=generator) for _ in range(n)]

    def tokens(n: int) -> list:
        generator = torch.Generator().manual_seed(0)
        return [torch.randint(0, 256, (8, 256), generator=generator) for _ in range(n)]

    return {"default CNN": (cnn, images), "GPT": (gpt, tokens)}


def _saved_bytes(model, batch) -> int:
    import torch

    buffer = io.BytesIO()
    torch.export.save(torch.export.export(model, (batch,)), buffer)
    return len(buffer.getvalue())


def measure(name: str, rounds: int, batches: int) -> list[Figure]:
    """The figures of one model: each scheme's eager and compiled latency against fp32's."""
    import torch

    from dtrain.models import quantize

    build, data = _models()[name]
    fp32 = build()
    calibration, timed = data(quantize.MIN_CALIBRATION_BATCHES * 2), data(batches)
    variants = {"fp32": fp32, **{s: quantize.quantize(fp32, s, calibration) for s in SCHEMES}}
    times: dict[tuple[str, bool], list[float]] = {(v, c): [] for v in variants for c in (0, 1)}
    for i in range(rounds):
        order = [*variants][i % len(variants):] + [*variants][: i % len(variants)]
        for variant in order:
            for compiled in (False, True):
                ms = quantize.latency(variants[variant], timed, compiled=compiled)
                times[variant, compiled].append(ms)
    figures = []
    fp32_size = _saved_bytes(fp32, timed[0])
    with torch.no_grad():
        reference = fp32(timed[0])
    for scheme in SCHEMES:
        with torch.no_grad():
            error = (variants[scheme](timed[0]) - reference).abs().max().item()
        size = _saved_bytes(variants[scheme], timed[0]) / fp32_size
        for compiled in (False, True):
            ratios = [a / b for a, b in zip(times[scheme, compiled], times["fp32", compiled],
                                            strict=True)]
            how = "compiled" if compiled else "eager"
            figures.append(Figure(
                f"quantize: {name} {scheme}/fp32 latency, {how}", common.median(ratios), "x",
                detail=f"{common.median(times[scheme, compiled]):.1f} vs "
                       f"{common.median(times['fp32', compiled]):.1f} ms a batch; per round "
                       f"{min(ratios):.2f}-{max(ratios):.2f}; file {size:.2f}x; "
                       f"max error {error:.3g}"))
    compiled_gain = [a / b for a, b in zip(times["fp32", True], times["fp32", False],
                                           strict=True)]
    figures.append(Figure(
        f"quantize: {name} fp32 compiled/eager latency", common.median(compiled_gain), "x",
        detail=f"per round {min(compiled_gain):.2f}-{max(compiled_gain):.2f}"))
    return figures


def run(rounds: int = 5, batches: int = 8) -> list[Figure]:
    return [figure for name in _models() for figure in measure(name, rounds, batches)]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--batches", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch's intra-op threads (1: steady on a shared machine)")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    for figure in run(args.rounds, args.batches):
        print(figure.line(), flush=True)
