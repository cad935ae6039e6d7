"""Tensor parallelism (parallel.tp): dtrain's dp 2 x tp 2 on 4 ranks against a hand-written
loop of torch's own APIs and against Lightning's ModelParallelStrategy, on the same mesh and
model.

The job: the built-in GPT (dim 128, depth 4, 4 heads, sequences of 64 tokens, AdamW), a global
batch of 16 sequences (8 per tp group), FSDP over the 2 data ranks. Three sides, each one
torchrun of 4 ranks on gloo:

- dtrain: `launch/train.py` with parallel.tp.size=2, parallel.mode=fsdp on the python_docs
  corpus;
- plain: this file run with `--plain` under torchrun: the same GPT class and seed, a device
  mesh (dp 2, tp 2), `parallelize_module` with the Megatron split (the fused qkv regrouped by
  heads, as the model needs to compute the same function), then `fully_shard` on each block
  and the root over dp, AdamW, and a loop over token batches drawn in memory (one per tp
  group);
- lightning (where the optional bench extra is installed): this file with `--lightning`: the
  same split in a LightningModule's `configure_model` on the strategy's mesh, the same batches,
  `Trainer(strategy=ModelParallelStrategy(2, 2))` without logger, checkpoints or progress bar.

A run's step time is the median of its windows of LOG_EVERY steps after the first (dtrain:
the wall time of its TensorBoard events; the others: their own clock at the same steps); each
figure is the other side's step time over dtrain's within a round (its steps/s over the
other's), its median over rounds, the range beside it. The order of the sides rotates from
round to round.

    python bench/tensor_parallel.py [--rounds 3] [--json results.json]
"""

from __future__ import annotations

import argparse
import importlib.util
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
            f"parallel.tp.size={TP}", "parallel.mode=fsdp"]


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


def lightning_step_s(work: Path, round_: int) -> float:
    out = work / f"lightning{round_}.json"
    common.run([*common.launcher(NPROC), __file__, "--lightning", str(out)], timeout=900)
    return _windows(json.loads(out.read_text())["ends"])


def _split(model, mesh) -> None:
    """The Megatron split over mesh["tp"], then FSDP over the data dimensions: what both
    hand-written sides do with torch's own APIs."""
    from torch.distributed.fsdp import fully_shard

    tp_split(model, mesh["tp"])
    for block in model.blocks:
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])


def tp_split(model, tp_mesh) -> None:
    """The Megatron split of the GPT over `tp_mesh` (the fused qkv regrouped by heads), the
    head tied to the embedding again, the norms and positions replicated DTensors."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    from dtrain.parallel.styles import FusedColwise, Replicated

    plan = {"tok_emb": RowwiseParallel(input_layouts=Replicate()),
            "head": ColwiseParallel(output_layouts=Replicate())}
    for i in range(MODEL["depth"]):
        plan.update({f"blocks.{i}.attn.qkv": FusedColwise(3),
                     f"blocks.{i}.attn.proj": RowwiseParallel(),
                     f"blocks.{i}.mlp.0": ColwiseParallel(), f"blocks.{i}.mlp.2": RowwiseParallel()})
    parallelize_module(model, tp_mesh, plan)
    model.head.weight = model.tok_emb.weight
    # The norms and positions: whole on every rank of the group, as DTensors of the tp mesh.
    for sub in [model.pos_emb, model.norm, *(m for b in model.blocks for m in (b.norm1, b.norm2))]:
        Replicated()._apply(sub, tp_mesh)


def _tokens(data_rank: int):
    import torch

    gen = torch.Generator().manual_seed(data_rank)  # one stream of batches per tp group
    return torch.randint(0, 256, (64, BATCH, SEQ + 1), generator=gen)


def plain_loop(out: str) -> None:
    """The hand-written side, one rank of it."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh

    from dtrain.models import GPT

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (NPROC // TP, TP), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    model = GPT(vocab_size=256, seq_len=SEQ, **MODEL)
    _split(model, mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.003)
    tokens = _tokens(rank // TP)
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


def lightning_loop(out: str) -> None:
    """The peer's side, one rank of it: Lightning's ModelParallelStrategy (data parallel 2 x
    tensor parallel 2), the split in the module's configure_model as its docs show, the same
    model, seed, batches and optimizer; no logger, checkpoints or progress bar."""
    import lightning as L
    import torch
    import torch.nn.functional as F
    from lightning.pytorch.strategies import ModelParallelStrategy

    from dtrain.models import GPT

    ends: list[float] = []

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.model = GPT(vocab_size=256, seq_len=SEQ, **MODEL)

        def configure_model(self) -> None:
            mesh = self.device_mesh
            _split(self.model, {"tp": mesh["tensor_parallel"], "dp": mesh["data_parallel"]})

        def training_step(self, batch, _index):
            logits = self.model(batch[:, :-1])
            return F.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                   batch[:, 1:].reshape(-1))

        def on_train_batch_end(self, _outputs, _batch, index) -> None:
            if (index + 1) % LOG_EVERY == 0:
                ends.append(time.perf_counter())

        def configure_optimizers(self):
            return torch.optim.AdamW(self.model.parameters(), lr=0.003)

    rank = int(os.environ["RANK"])
    tokens = _tokens(rank // TP)
    batches = [tokens[step % len(tokens)] for step in range(STEPS)]
    loader = torch.utils.data.DataLoader(batches, batch_size=None)
    trainer = L.Trainer(
        accelerator="cpu", devices=NPROC, max_steps=STEPS, logger=False,
        strategy=ModelParallelStrategy(data_parallel_size=NPROC // TP, tensor_parallel_size=TP),
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        use_distributed_sampler=False,
    )
    trainer.fit(Module(), loader)
    if rank == 0:
        Path(out).write_text(json.dumps({"ends": ends}))


def run(work: Path, rounds: int = 3) -> list[Figure]:
    """Each round runs every side once, the order rotated from round to round."""
    sides = [("dtrain", dtrain_step_s), ("plain", plain_step_s)]
    if importlib.util.find_spec("lightning") is not None:  # (the optional bench extra)
        sides.append(("lightning", lightning_step_s))
    ratios: dict[str, list[float]] = {name: [] for name, _ in sides[1:]}
    detail = []
    for i in range(rounds):
        order = sides[i % len(sides):] + sides[:i % len(sides)]
        got = {name: measure(work, i) for name, measure in order}
        for name in ratios:
            ratios[name].append(got[name] / got["dtrain"])
        detail.append(f"round {i}: " + ", ".join(f"{n} {t * 1e3:.1f} ms" for n, t in got.items())
                      + f" a step; load {os.getloadavg()[0]:.1f}")
    named = {"plain": "parallelize_module + fully_shard",
             "lightning": "Lightning ModelParallelStrategy"}
    return [Figure(f"dp2 x tp2 steps/s vs {named[name]}", common.median(r), "x", ">= 0.97",
                   f"range {min(r):.3f}-{max(r):.3f}; " + "; ".join(detail))
            for name, r in ratios.items()]


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--plain", metavar="OUT")
    parser.add_argument("--lightning", metavar="OUT")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json")
    args = parser.parse_args()
    if args.plain:
        plain_loop(args.plain)
    elif args.lightning:
        lightning_loop(args.lightning)
    else:
        import tempfile
        with tempfile.TemporaryDirectory(prefix="dtrain-bench-") as tmp:
            figures = run(Path(tmp), args.rounds)
        for figure in figures:
            print(figure.line(), flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps([vars(f) for f in figures], indent=1))
