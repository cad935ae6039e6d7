"""LoRA on a Llama of about 150 M parameters (bench/hf_memory.py's, saved with save_pretrained):
what a checkpoint takes on disk with `model.lora.r=8` against full fine-tuning (AdamW, a full
checkpoint each), and the time of a training step of dtrain's LoRA run against peft's model in a
plain hand-written loop over the same batches (one process, the CPU).

Each side is its own process; sides alternate, ROUNDS times; the step time is each run's median
over its steps after the first two; figures are the medians over the rounds, with the range.

    python bench/lora.py [ROUNDS]
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
from hf_memory import LLAMA

REPO = Path(__file__).resolve().parents[1]
STEPS, BATCH, SEQ_LEN, RANK = 8, 4, 128, 8
TRAIN = ["task.name=language_model", "model.args={}", "data.name=tokens", "data.num_workers=0",
         f"data.batch_size={BATCH}", f"data.tokens.seq_len={SEQ_LEN}", "optim.name=adamw",
         "optim.lr=1e-4", "optim.weight_decay=0.0", "sched.name=none", "train.log_every=1",
         f"train.max_steps={STEPS}", "train.eval_every_epochs=0", "ckpt.format=full",
         "ckpt.monitor=val_loss", "ckpt.monitor_mode=min", "log.tensorboard=false"]


def dtrain_run(work: str, name: str, model: str, data: str, extra: list[str]) -> dict:
    """A dtrain run: its median step time and its checkpoint's bytes on disk."""
    run_dir = Path(work) / "runs" / name
    out = subprocess.run(
        [sys.executable, str(REPO / "launch" / "train.py"), *TRAIN, f"model.name=hf:{model}",
         f"data.root={data}", f"run.out_dir={run_dir.parent}", f"run.name={name}", *extra],
        capture_output=True, text=True, cwd=REPO, check=False,
        env={**os.environ, "PYTHONPATH": str(REPO / "src")})
    if out.returncode != 0:
        raise SystemExit(f"{name} failed:\n{out.stderr[-3000:]}")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    step_s = [BATCH / r["samples_per_s"] for r in records if "samples_per_s" in r][2:]
    checkpoint = run_dir / "checkpoints" / (run_dir / "checkpoints" / "latest").read_text().strip()
    size = sum(f.stat().st_size for f in checkpoint.rglob("*") if f.is_file())
    return {"step_s": statistics.median(step_s), "bytes": size}


def plain_loop(model_dir: str, data: str) -> None:
    """In its own process: peft's LoRA model trained by hand on the token file's windows in
    order; prints the median step time (JSON)."""
    import peft
    import torch
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    base.config.use_cache = False
    model = peft.get_peft_model(base, peft.LoraConfig(r=RANK, lora_alpha=16.0))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4,
                                  weight_decay=0.0)
    ids = torch.from_numpy(np.fromfile(os.path.join(data, "train.bin"), dtype=np.uint16)
                           .astype(np.int64))
    times = []
    for step in range(STEPS):
        window = SEQ_LEN + 1
        batch = ids[step * BATCH * window:(step + 1) * BATCH * window].view(BATCH, window)
        began = time.perf_counter()
        logits = model(input_ids=batch[:, :-1]).logits.float()
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - began)
    print(json.dumps({"step_s": statistics.median(times[2:])}), flush=True)


def plain_run(model_dir: str, data: str) -> dict:
    out = subprocess.run([sys.executable, __file__, "--plain", model_dir, data],
                         capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise SystemExit(f"plain loop failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(rounds: int) -> None:
    with tempfile.TemporaryDirectory(prefix="dtrain-lora-") as work:
        model_dir, data = os.path.join(work, "llama"), os.path.join(work, "tokens")
        count = common.make_llama(model_dir, data, LLAMA, {"train": 200_000, "val": 20_000})
        lora = [f"model.lora.r={RANK}", "model.lora.alpha=16"]
        full = dtrain_run(work, "full", model_dir, data, [])
        step: dict[str, list[float]] = {"dtrain": [], "plain": []}
        sizes = []
        for i in range(rounds):
            for side in ("dtrain", "plain") if i % 2 == 0 else ("plain", "dtrain"):
                if side == "dtrain":
                    found = dtrain_run(work, f"lora{i}", model_dir, data, lora)
                    sizes.append(found["bytes"])
                else:
                    found = plain_run(model_dir, data)
                step[side].append(found["step_s"])
        print(f"Llama of {count / 1e6:.1f} M parameters, LoRA r={RANK} on q_proj and v_proj, "
              f"AdamW, one process on the CPU, batch {BATCH} x {SEQ_LEN} tokens, {rounds} rounds")
        print(f"  checkpoint on disk: full fine-tuning {full['bytes'] / 2**20:.1f} MiB, LoRA "
              f"{statistics.median(sizes) / 2**20:.2f} MiB: "
              f"{100 * statistics.median(sizes) / full['bytes']:.2f} % of it")
        for side, label in (("dtrain", "dtrain model.lora"), ("plain", "peft in a plain loop")):
            values = step[side]
            print(f"  {label:<22} step median {statistics.median(values):.3f} s "
                  f"({min(values):.3f}-{max(values):.3f})")
        print(f"  full fine-tuning's step (dtrain): {full['step_s']:.3f} s")
        ratio = statistics.median(step["plain"]) / statistics.median(step["dtrain"])
        print(f"  steps/s dtrain / plain loop: {ratio:.3f}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--plain"]:
        plain_loop(sys.argv[2], sys.argv[3])
    else:
        main(int(sys.argv[1]) if len(sys.argv) > 1 else 3)
