"""The language model of configs/gpt_text.yaml on the built-in corpus, 2 ranks on this machine's
CPUs, under DDP and FSDP: validation bits per byte against the byte-unigram entropy of the same
validation text (the bits a model without context gets), and when the run first reached 0.6 of it.

Time is wall time from launching torchrun, read from each evaluation's TensorBoard event.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from common import Figure  # noqa: E402

CONFIG = str(common.REPO / "configs" / "gpt_text.yaml")
TARGET = 0.6


def unigram_entropy() -> float:
    import torch
    from dtrain.config import load
    from dtrain.data import text
    cfg = load(CONFIG).data
    data = text.python_docs()
    cut = len(data) - int(len(data) * cfg.text.val_fraction)
    return text.unigram_entropy(torch.frombuffer(bytearray(data[cut:]), dtype=torch.uint8))


def run_mode(work: Path, mode: str, entropy: float, overrides: list[str]) -> dict:
    run_dir = work / "runs" / f"lm-{mode}"
    launched = time.time()
    common.run(common.dtrain_cmd(run_dir, [f"parallel.mode={mode}", "log.tensorboard=true",
                                           *overrides], nproc=2, config=CONFIG), timeout=1800)
    finished = time.time() - launched
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    accumulator = EventAccumulator(str(run_dir / "tb"), size_guidance={"scalars": 0})
    accumulator.Reload()
    events = accumulator.Scalars("val/bits_per_byte")  # step, dtrain's wall time, value
    reached = next((e.wall_time - launched for e in events if e.value <= TARGET * entropy), None)
    return {"final": events[-1].value, "reached": reached, "total": finished,
            "steps": events[-1].step, "evals": [(e.step, e.value) for e in events]}


def run(work: Path, rounds: int = 1, overrides: tuple[str, ...] = ()) -> list[Figure]:
    entropy = unigram_entropy()
    figures = []
    for mode in ("ddp", "fsdp"):
        result = run_mode(work, mode, entropy, list(overrides))
        reached = f"{result['reached']:.0f} s" if result["reached"] is not None else "never"
        figures.append(Figure(
            f"language model ({mode}): val bits per byte / unigram entropy",
            result["final"] / entropy, "x", f"<= {TARGET}",
            f"{result['final']:.3f} vs {entropy:.3f} bits after {result['steps']} steps, "
            f"{result['total']:.0f} s from launch; first below {TARGET} x entropy at {reached}"))
    return figures


if __name__ == "__main__":
    common.run_standalone(lambda work: run(work, overrides=tuple(sys.argv[1:])))
