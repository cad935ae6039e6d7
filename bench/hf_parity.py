"""A Hugging Face Llama (`hf:PATH`) under dtrain against hand-written loops over the same model
and batches: the first 10 losses of dtrain's DDP and FSDP runs on 2 ranks against one process
training the 2 ranks' batches together, and the time of a step of dtrain's FSDP against a plain
FSDP2 loop (`fully_shard` per decoder layer, then the root) and Accelerate's FSDP2, and of
dtrain's DDP against a plain DDP loop and Accelerate's DDP.

On the CPU, Accelerate never chooses FSDP by itself: its state picks FSDP only for GPU-like
devices and otherwise wraps the model in DDP, whatever the plugin says. The Accelerate FSDP side
therefore sets its state's distributed type to FSDP after `Accelerator(cpu=True, fsdp_plugin=...)`
and before `prepare`; everything after that (the wrap policy, `fully_shard` of the blocks and
the root, backward, the optimizer) is Accelerate's own code.

The model (about 7 M parameters) is made here from a config and saved with save_pretrained;
the batches are the windows of a token file in the order dtrain's sampler gives them (seeded by
run.seed, rank r taking every 2nd position), so every side sees the same samples. Sides
alternate, ROUNDS times; a run's step time is its median after the first two steps; figures are
medians over the rounds, with the range.

    python bench/hf_parity.py [ROUNDS]
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import common
import numpy as np

REPO = Path(__file__).resolve().parents[1]
LLAMA = dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=8192, max_position_embeddings=256)
STEPS, BATCH, SEQ_LEN, SEED, LR = 10, 8, 128, 0, 1e-3  # BATCH: per rank, 2 ranks
TRAIN = ["task.name=language_model", "model.args={}", "data.name=tokens", "data.num_workers=0",
         f"data.batch_size={BATCH}", f"data.tokens.seq_len={SEQ_LEN}",
         f"data.tokens.stride={SEQ_LEN}", "optim.name=adamw", f"optim.lr={LR}",
         "optim.weight_decay=0.0", "sched.name=none", "train.log_every=1",
         f"train.max_steps={STEPS}", "train.eval_every_epochs=0",
         "ckpt.monitor=val_loss", "ckpt.monitor_mode=min", "log.tensorboard=false",
         f"run.seed={SEED}"]


def torchrun(*args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", *args]


def env() -> dict[str, str]:
    """The benchmarks' own (bench/common.py): one thread a rank and the same malloc settings on
    every side. (With glibc's defaults, dtrain's FSDP returns freed host memory to the system,
    process/host_memory.py, and pays page faults for it on the CPU: see docs/benchmarks.md.)"""
    return common.env()


def dtrain(work: str, name: str, model: str, data: str, mode: str) -> dict:
    run_dir = Path(work) / "runs" / name
    out = subprocess.run(
        torchrun(str(REPO / "launch" / "train.py"), *TRAIN, f"model.name=hf:{model}",
                 f"data.root={data}", f"parallel.mode={mode}", f"run.out_dir={run_dir.parent}",
                 f"run.name={name}"),
        capture_output=True, text=True, cwd=REPO, env=env(), check=False)
    if out.returncode != 0:
        raise SystemExit(f"dtrain {mode} failed:\n{out.stderr[-3000:]}")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in records if "samples_per_s" in r]
    return {"losses": [r["loss"] for r in trained],
            "step_s": statistics.median(2 * BATCH / r["samples_per_s"] for r in trained[2:])}


def batches(data: str, rank: int | None) -> list[np.ndarray]:
    """Each step's windows: rank `rank`'s, or with None the 2 ranks' together (rank 0's, then
    rank 1's), in the order of dtrain's sampler for epoch 0."""
    import torch

    ids = np.fromfile(os.path.join(data, "train.bin"), dtype=np.uint16).astype(np.int64)
    count = (len(ids) - 1) // SEQ_LEN
    order = torch.randperm(count, generator=torch.Generator().manual_seed(SEED)).numpy()
    steps = []
    for step in range(STEPS):
        positions = step * 2 * BATCH + np.arange(2 * BATCH)
        by_rank = [positions[r::2] for r in (0, 1)]
        chosen = by_rank[rank] if rank is not None else np.concatenate(by_rank)
        steps.append(np.stack([ids[i * SEQ_LEN:i * SEQ_LEN + SEQ_LEN + 1] for i in order[chosen]]))
    return steps


def plain(kind: str, model_dir: str, data: str) -> None:
    """In this process (or a rank of it): one hand-written loop, printing its figures (JSON).
    `single`: one process, both ranks' batches at once; `fsdp`, `ddp`: plain torch on 2 ranks;
    `accelerate-ddp`, `accelerate-fsdp`: Accelerate's loop (its prepare, its backward) on 2
    ranks."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM

    rank = None
    if kind in ("fsdp", "ddp"):
        dist.init_process_group("gloo")
        rank = dist.get_rank()
    torch.manual_seed(SEED)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.config.use_cache = False
    accelerator = None
    if kind == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
    elif kind == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    if kind.startswith("accelerate"):
        accelerator = accelerate(kind)
        model, optimizer = accelerator.prepare(model, optimizer)
        rank = accelerator.process_index
    losses, times = [], []
    for batch in batches(data, rank):
        tokens = torch.from_numpy(batch)
        began = time.perf_counter()
        logits = model(input_ids=tokens[:, :-1]).logits.float()
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
        if accelerator is not None:
            accelerator.backward(loss)
        else:
            loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if rank is not None:  # the step's loss over both ranks, as dtrain records it
            mean = loss.detach().clone()
            torch.distributed.all_reduce(mean)
            losses.append(mean.item() / 2)
        else:
            losses.append(loss.item())
        times.append(time.perf_counter() - began)
    if not rank:
        print(json.dumps({"losses": losses, "step_s": statistics.median(times[2:])}), flush=True)
    if dist.is_initialized():  # gloo torn down at interpreter exit can abort a rank
        dist.barrier()
        dist.destroy_process_group()


def accelerate(kind: str):
    """Accelerate on the CPU: DDP as it chooses, or its FSDP2 with the CPU gate lifted (above)."""
    from accelerate import Accelerator, FullyShardedDataParallelPlugin
    from accelerate.utils import DistributedType

    if kind == "accelerate-ddp":
        return Accelerator(cpu=True)
    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2, auto_wrap_policy="transformer_based_wrap",
        transformer_cls_names_to_wrap=["LlamaDecoderLayer"], reshard_after_forward=True)
    accelerator = Accelerator(cpu=True, fsdp_plugin=plugin)
    accelerator.state.distributed_type = DistributedType.FSDP
    accelerator.state.fsdp_plugin = plugin
    return accelerator


def run_plain(kind: str, model_dir: str, data: str) -> dict:
    command = [__file__, "--plain", kind, model_dir, data]
    out = subprocess.run([sys.executable, *command] if kind == "single" else torchrun(*command),
                         capture_output=True, text=True, env=env(), check=False)
    if out.returncode != 0:
        raise SystemExit(f"plain {kind} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(rounds: int) -> None:
    with tempfile.TemporaryDirectory(prefix="dtrain-hf-parity-") as work:
        model_dir, data = os.path.join(work, "llama"), os.path.join(work, "tokens")
        count = common.make_llama(model_dir, data, LLAMA, {"train": 200_000, "val": 20_000})
        single = run_plain("single", model_dir, data)
        found: dict[str, list[dict]] = {}
        sides = ["dtrain fsdp", "plain fsdp", "accelerate fsdp", "dtrain ddp", "plain ddp",
                 "accelerate ddp"]
        for i in range(rounds):
            for side in sides if i % 2 == 0 else sides[::-1]:
                kind, _, mode = side.partition(" ")
                result = (dtrain(work, f"{mode}{i}", model_dir, data, mode) if kind == "dtrain"
                          else run_plain(mode if kind == "plain" else f"{kind}-{mode}",
                                         model_dir, data))
                found.setdefault(side, []).append(result)
        print(f"Llama of {count / 1e6:.1f} M parameters, 2 ranks on the CPU (gloo), {BATCH} x "
              f"{SEQ_LEN} tokens per rank, AdamW, {rounds} rounds")
        reference = single["losses"]
        for side in sides:
            losses = found[side][0]["losses"]
            worst = max(abs(a - b) / abs(b) for a, b in zip(losses, reference, strict=True))
            print(f"  first {STEPS} losses, {side} against one process on both ranks' batches: "
                  f"largest relative difference {worst:.1e}")
        print("  losses: " + ", ".join(f"{v:.5f}" for v in reference))
        medians = {side: statistics.median(r["step_s"] for r in runs)
                   for side, runs in found.items()}
        for side, runs in found.items():
            values = [r["step_s"] for r in runs]
            print(f"  {side:<15} step median {medians[side] * 1000:7.1f} ms "
                  f"({min(values) * 1000:.1f}-{max(values) * 1000:.1f})")
        for ours, theirs in (("dtrain fsdp", "plain fsdp"), ("dtrain fsdp", "accelerate fsdp"),
                             ("dtrain ddp", "plain ddp"), ("dtrain ddp", "accelerate ddp")):
            print(f"  steps/s {ours} / {theirs}: {medians[theirs] / medians[ours]:.3f}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--plain"]:
        plain(sys.argv[2], sys.argv[3], sys.argv[4])
    else:
        main(int(sys.argv[1]) if len(sys.argv) > 1 else 3)
