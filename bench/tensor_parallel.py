"""Tensor parallelism (parallel.tp): dtrain's dp 2 x tp 2 on 4 ranks against a hand-written
loop of torch's own APIs on the same mesh and model.

The job: the built-in GPT (dim 128, depth 4, 4 heads, sequences of 64 tokens, AdamW), a global
batch of 16 sequences (8 per tp group), mode ddp over the 2 data ranks. Two sides, each one
torchrun of 4 ranks on gloo:

- dtrain: `launch/train.py` with parallel.tp.size=2 on the python_docs corpus;
- plain: this file run with `--plain` under torchrun: the same GPT class and seed, a device
  mesh (dp_replicate 2, dp_shard 1, tp 2), `parallelize_module` with the Megatron split (the
  fused qkv regrouped by heads, as the model needs to compute the same function), then
  `fully_shard` on each block and the root over the data dimensions, AdamW, and a loop over
  token batches drawn in memory (one per tp group).

A run's step time is the median of its windows of LOG_EVERY steps after the first (dtrain:
the wall time of its TensorBoard events; plain: its own clock at the same steps); the figure is
plain/dtrain steps per second within each round, its median over rounds, the range beside it.
The sides alternate within a round, each round starting with the other.

    python bench/tensor_parallel.py [--rounds 3] [--json results.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from common import Figure  # noqa: E402

NPROC, TP, BATCH, SEQ, STEPS, LOG_EVERY = 4, 2, 8, 64, 150, 25
MODEL = {"dim": 128, "depth": 4, "heads": 4}


def _dtrain_job() -> list[str]:
    args = ", ".join(f"{k}: {v}" for k, v in MODEL.items())
    return ["task.name=language_model", "model.name=gpt", f"model.args={{{args}}}",
            "data.name=text", "data.text.corpus=python_docs", f"data.text.seq_len={SEQ}",
            f"data.batch_size={BATCH}", "data.num_workers=0", "optim.name=adamw",
            "optim.lr=0.003", "ckpt.monitor=val_loss", "ckpt.monitor_mode=min", "sched.name=none", f"train.max_steps={STEPS}",
            f"train.log_every={LOG_EVERY}", "train.eval_every_epochs=0", "log.tensorboard=true",
            f"parallel.tp.size={TP}", "parallel.mode=ddp"]


def _windows(ends: list[float]) -> float:
    """Seconds a step, the median over the windows after the first."""
    windows = [b - a for a, b in zip(ends, ends[1:])]
    return common.median(windows[1:] or windows) / LOG_EVERY


def dtrain_step_s(work: Path, round_: int) -> float:
    run_dir = work / f"dtrain{round_}"
    common.run(common.dtrain_cmd(run_dir, _dtrain_job(), NPROC), timeout=900)
    ends = [t for step, t in common.scalar_events(run_dir) if step % LOG_EVERY == 0]
    return _windows(ends)


def plain_step_s(work: Path, round_: int) -> float:
    out = work / f"plain{round_}.json"
    common.run([*common.launcher(NPROC), __file__, "--plain", str(out)], timeout=900)
    return _windows(json.loads(out.read_text())["ends"])


def plain_loop(out: str) -> None:
    """The hand-written side, one rank of it."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    from dtrain.models import GPT
    from dtrain.parallel.tensor import FusedColwise, Replicated

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (NPROC // TP, 1, TP),
                            mesh_dim_names=("dp_replicate", "dp_shard", "tp"))
    torch.manual_seed(0)
    model = GPT(vocab_size=256, seq_len=SEQ, **MODEL)
    plan = {"tok_emb": RowwiseParallel(input_layouts=Replicate()),
            "head": ColwiseParallel(output_layouts=Replicate())}
    for i in range(MODEL["depth"]):
        plan.update({f"blocks.{i}.attn.qkv": FusedColwise(3),
                     f"blocks.{i}.attn.proj": RowwiseParallel(),
                     f"blocks.{i}.mlp.0": ColwiseParallel(), f"blocks.{i}.mlp.2": RowwiseParallel()})
    parallelize_module(model, mesh["tp"], plan)
    model.head.weight = model.tok_emb.weight
    # The norms and positions: whole on every rank of the group, as DTensors of the tp mesh.
    for sub in [model.pos_emb, model.norm, *(m for b in model.blocks for m in (b.norm1, b.norm2))]:
        Replicated()._apply(sub, mesh["tp"])
    data_mesh = mesh["dp_replicate", "dp_shard"]
    for block in model.blocks:
        fully_shard(block, mesh=data_mesh)
    fully_shard(model, mesh=data_mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.003)
    gen = torch.Generator().manual_seed(rank // TP)  # one stream of batches per tp group
    tokens = torch.randint(0, 256, (64, BATCH, SEQ + 1), generator=gen)
    ends = []
    for step in range(STEPS):
        batch = tokens[step % len(tokens)]
        logits = model(batch[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if (step + 1) % LOG_EVERY == 0:
            ends.append(time.perf_counter())
    if rank == 0:
        Path(out).write_text(json.dumps({"ends": ends, "last_loss": float(loss)}))
    dist.destroy_process_group()


def run(work: Path, rounds: int = 3) -> list[Figure]:
    ratios, detail = [], []
    for i in range(rounds):
        sides = [("dtrain", dtrain_step_s), ("plain", plain_step_s)]
        got = dict((name, measure(work, i)) for name, measure in (sides if i % 2 == 0
                                                                  else sides[::-1]))
        ratios.append(got["plain"] / got["dtrain"])
        detail.append(f"round {i}: dtrain {got['dtrain'] * 1e3:.1f} ms, plain "
                      f"{got['plain'] * 1e3:.1f} ms a step; load {os.getloadavg()[0]:.1f}")
    return [Figure("dp2 x tp2 steps/s vs parallelize_module + fully_shard", common.median(ratios),
                   "x", ">= 0.97", f"range {min(ratios):.3f}-{max(ratios):.3f}; "
                   + "; ".join(detail))]


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--plain", metavar="OUT")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json")
    args = parser.parse_args()
    if args.plain:
        plain_loop(args.plain)
    else:
        import tempfile
        with tempfile.TemporaryDirectory(prefix="dtrain-bench-") as tmp:
            figures = run(Path(tmp), args.rounds)
        for figure in figures:
            print(figure.line(), flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps([vars(f) for f in figures], indent=1))
