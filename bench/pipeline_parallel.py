"""Pipeline parallelism (parallel.pp): dtrain's 2 stages (1F1B, 4 micro-batches) on 2 ranks
against a hand-written loop of torch's own pipelining APIs on the same model and cut, and the
bubble it measures against the schedule's; with `--layout pp2_tp2_dp2`, the same against a
hand-written pp 2 x tp 2 x dp 2 loop on 8 ranks.

The job: the built-in GPT (dim 128, depth 4, 4 heads, sequences of 64 tokens, AdamW), 16
sequences a step. Three sides:

- dtrain: `launch/train.py` with parallel.pp.size=2 under torchrun (2 ranks);
- plain: this file with `--plain` under torchrun: the same GPT class and seed, cut by hand
  after its second block into two modules of its own, `PipelineStage` and `Schedule1F1B`, the
  tied embedding's gradient summed between the two ranks, AdamW, token batches in memory;
- whole: dtrain as one process on the same batch (no pipeline): the compute of the whole model.

pp2_tp2_dp2: dtrain with parallel.tp.size=2 and parallel.mode=fsdp besides, 8 ranks, 16
sequences per pipeline (32 a step); plain: a device mesh (pp 2, dp 2, tp 2), the Megatron split
of bench/tensor_parallel.py over tp, the same cut, `fully_shard` over dp on each stage's blocks
and the stage, `PipelineStage` on the pp group, the tied embedding's gradient shards summed over
it. (On 2 cores, 8 ranks take turns: the ratio says what dtrain adds to the same work under the
same contention, not how either would scale.)

A run's step time is the median of its windows of LOG_EVERY steps after the first. The figures:
plain/dtrain steps per second within each round (its median over rounds, the range beside it),
and the measured bubble, 1 - (whole / 2) / dtrain: the share of a pipelined step beyond each
stage's half of the compute (communication included), beside the schedule's (p - 1) / (m + p - 1).

    python bench/pipeline_parallel.py [--layout pp2|pp2_tp2_dp2] [--rounds 3] [--json results.json]
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

PP, MICRO, BATCH, SEQ, STEPS, LOG_EVERY = 2, 4, 16, 64, 100, 20
MODEL = {"dim": 128, "depth": 4, "heads": 4}


def _dtrain_job(pp: int, three_d: bool = False) -> list[str]:
    args = ", ".join(f"{k}: {v}" for k, v in MODEL.items())
    job = ["task.name=language_model", "model.name=gpt", f"model.args={{{args}}}",
           "data.name=text", "data.text.corpus=python_docs", f"data.text.seq_len={SEQ}",
           f"data.batch_size={BATCH}", "data.num_workers=0", "optim.name=adamw",
           "optim.lr=0.003", "ckpt.monitor=val_loss", "ckpt.monitor_mode=min",
           "sched.name=none", f"train.max_steps={STEPS}", f"train.log_every={LOG_EVERY}",
           "train.eval_every_epochs=0", "log.tensorboard=true"]
    if pp > 1:
        job += [f"parallel.pp.size={pp}", f"parallel.pp.microbatches={MICRO}"]
    if three_d:
        job += ["parallel.tp.size=2", "parallel.mode=fsdp"]
    return job


def _windows(ends: list[float]) -> float:
    """Seconds a step, the median over the windows after the first."""
    windows = [b - a for a, b in zip(ends, ends[1:])]
    return common.median(windows[1:] or windows) / LOG_EVERY


def dtrain_step_s(work: Path, round_: int, pp: int = PP) -> float:
    run_dir = work / f"dtrain{pp}_{round_}"
    common.run(common.dtrain_cmd(run_dir, _dtrain_job(pp), pp if pp > 1 else 0), timeout=900)
    ends = [t for step, t in common.scalar_events(run_dir) if step % LOG_EVERY == 0]
    return _windows(ends)


def plain_step_s(work: Path, round_: int) -> float:
    out = work / f"plain{round_}.json"
    common.run([*common.launcher(PP), __file__, "--plain", str(out)], timeout=900)
    return _windows(json.loads(out.read_text())["ends"])


def dtrain_3d_step_s(work: Path, round_: int) -> float:
    run_dir = work / f"dtrain3d_{round_}"
    common.run(common.dtrain_cmd(run_dir, _dtrain_job(PP, three_d=True), 8), timeout=900)
    ends = [t for step, t in common.scalar_events(run_dir) if step % LOG_EVERY == 0]
    return _windows(ends)


def plain_3d_step_s(work: Path, round_: int) -> float:
    out = work / f"plain3d_{round_}.json"
    common.run([*common.launcher(8), __file__, "--plain-3d", str(out)], timeout=900)
    return _windows(json.loads(out.read_text())["ends"])


def _stages(gpt, first: bool):
    """The GPT cut by hand after its second block: the embeddings and the first half of the
    blocks, or the rest with the final norm and the head (still tied to the embedding)."""
    import torch
    from torch import nn

    half = MODEL["depth"] // 2

    class First(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tok_emb, self.pos_emb = gpt.tok_emb, gpt.pos_emb
            self.blocks = nn.ModuleList(gpt.blocks[:half])

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            x = self.tok_emb(tokens) + self.pos_emb(torch.arange(tokens.shape[1]))
            for block in self.blocks:
                x = block(x)
            return x

    class Last(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(gpt.blocks[half:])
            self.norm, self.head = gpt.norm, gpt.head

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for block in self.blocks:
                x = block(x)
            return self.head(self.norm(x))

    return First() if first else Last()


def _loss_fn(logits, target):
    import torch.nn.functional as F

    flat = logits.reshape(-1, logits.shape[-1])
    return F.cross_entropy(flat, target[:, 1:].reshape(-1)) / MICRO


def _steps(stage, part, data_rank: int, sum_tied) -> list[float]:
    """STEPS of 1F1B over `stage` (the first stage feeds the tokens, the last the targets), the
    tied weight's gradients summed by `sum_tied`, AdamW; the clock at every LOG_EVERY steps."""
    import torch
    from torch.distributed.pipelining import Schedule1F1B

    schedule = Schedule1F1B(stage, MICRO, loss_fn=_loss_fn, scale_grads=False)
    optimizer = torch.optim.AdamW(part.parameters(), lr=0.003)
    gen = torch.Generator().manual_seed(data_rank)  # one stream of batches per pipeline
    tokens = torch.randint(0, 256, (64, BATCH, SEQ + 1), generator=gen)
    ends = []
    for step in range(STEPS):
        batch = tokens[step % len(tokens)]
        if stage.is_first:
            schedule.step(batch[:, :-1])
        else:
            schedule.step(target=batch, losses=[])
        sum_tied()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if (step + 1) % LOG_EVERY == 0:
            ends.append(time.perf_counter())
    return ends


def plain_loop(out: str) -> None:
    """The hand-written side, one rank of it."""
    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage

    from dtrain.models import GPT

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    gpt = GPT(vocab_size=256, seq_len=SEQ, **MODEL)
    part = _stages(gpt, rank == 0)
    tied = gpt.tok_emb.weight
    stage = PipelineStage(part, rank, PP, torch.device("cpu"))
    # The embedding's and the head's gradients of the tied weight, summed between the two ends.
    ends = _steps(stage, part, 0, lambda: dist.all_reduce(tied.grad))
    if rank == 0:
        Path(out).write_text(json.dumps({"ends": ends}))
    dist.destroy_process_group()


def plain_3d_loop(out: str) -> None:
    """The hand-written pp 2 x tp 2 x dp 2 side, one rank of it."""
    import tensor_parallel
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.pipelining import PipelineStage

    from dtrain.models import GPT

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (PP, 2, 2), mesh_dim_names=("pp", "dp", "tp"))
    pp_rank, data_rank = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    torch.manual_seed(0)
    gpt = GPT(vocab_size=256, seq_len=SEQ, **MODEL)
    tensor_parallel.tp_split(gpt, mesh["tp"])
    part = _stages(gpt, pp_rank == 0)
    for block in part.blocks:
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(part, mesh=mesh["dp"])
    tied = part.tok_emb.weight if pp_rank == 0 else part.head.weight
    pp_group = mesh["pp"].get_group()
    stage = PipelineStage(part, pp_rank, PP, torch.device("cpu"), group=pp_group)
    # The two ends' gradients of the tied weight, shard by shard (the same layout on both).
    ends = _steps(stage, part, data_rank, lambda: dist.all_reduce(tied.grad.to_local(),
                                                                  group=pp_group))
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps({"ends": ends}))
    dist.destroy_process_group()


def run_3d(work: Path, rounds: int = 3) -> list[Figure]:
    ratios, detail = [], []
    for i in range(rounds):
        sides = [("dtrain", dtrain_3d_step_s), ("plain", plain_3d_step_s)]
        order = sides if i % 2 == 0 else sides[::-1]
        got = {name: measure(work, i) for name, measure in order}
        ratios.append(got["plain"] / got["dtrain"])
        detail.append(f"round {i}: dtrain {got['dtrain'] * 1e3:.1f} ms, plain "
                      f"{got['plain'] * 1e3:.1f} ms a step; load {os.getloadavg()[0]:.1f}")
    return [Figure("pp2 x tp2 x dp2 steps/s vs PipelineStage + parallelize_module + "
                   "fully_shard", common.median(ratios), "x", ">= 0.97",
                   f"range {min(ratios):.3f}-{max(ratios):.3f}; 8 ranks on this machine's "
                   f"{os.cpu_count()} cores; " + "; ".join(detail))]


def run(work: Path, rounds: int = 3) -> list[Figure]:
    ratios, bubbles, detail = [], [], []
    for i in range(rounds):
        sides = [("dtrain", dtrain_step_s), ("plain", plain_step_s),
                 ("whole", lambda w, r: dtrain_step_s(w, r, pp=1))]
        order = sides if i % 2 == 0 else sides[::-1]
        got = {name: measure(work, i) for name, measure in order}
        ratios.append(got["plain"] / got["dtrain"])
        bubbles.append(100 * (1 - got["whole"] / PP / got["dtrain"]))
        detail.append(f"round {i}: dtrain {got['dtrain'] * 1e3:.1f} ms, plain "
                      f"{got['plain'] * 1e3:.1f} ms, whole model on one process "
                      f"{got['whole'] * 1e3:.1f} ms a step; load {os.getloadavg()[0]:.1f}")
    schedule_bubble = 100 * (PP - 1) / (MICRO + PP - 1)
    return [
        Figure("pp2 1f1b steps/s vs PipelineStage + Schedule1F1B", common.median(ratios), "x",
               ">= 0.97", f"range {min(ratios):.3f}-{max(ratios):.3f}; " + "; ".join(detail)),
        Figure("pp2 1f1b measured bubble", common.median(bubbles), "%", "",
               f"range {min(bubbles):.1f}-{max(bubbles):.1f}; the schedule's "
               f"(p - 1) / (m + p - 1) = {schedule_bubble:.1f} %"),
    ]


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--plain", metavar="OUT")
    parser.add_argument("--plain-3d", metavar="OUT")
    parser.add_argument("--layout", choices=["pp2", "pp2_tp2_dp2"], default="pp2")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json")
    args = parser.parse_args()
    if args.plain:
        plain_loop(args.plain)
    elif args.plain_3d:
        plain_3d_loop(args.plain_3d)
    else:
        import tempfile
        with tempfile.TemporaryDirectory(prefix="dtrain-bench-") as tmp:
            measure = run if args.layout == "pp2" else run_3d
            figures = measure(Path(tmp), args.rounds)
        for figure in figures:
            print(figure.line(), flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps([vars(f) for f in figures], indent=1))
