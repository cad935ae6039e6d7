"""Memory, reads and time per rank while a Hugging Face model's weights load for FSDP on 2 ranks:
dtrain's `hf:PATH` (the model made on no memory, each rank then reading only its own rows of
each tensor from the safetensors files into its shards) against the usual way
(`from_pretrained` whole in every rank, then `fully_shard` per decoder layer and the root).

The model is a Llama of about 150 M parameters made here from a config with fresh weights and
saved with `save_pretrained` (float32 safetensors, about 600 MB). Each side runs in its own
`torchrun --nproc_per_node=2` launch; each rank samples its own anonymous memory (RssAnon: the
file's pages in the page cache are not counted, they are shared) every 5 ms from before the
model is made to after it is sharded, and reports its peak above where it started, the bytes
of tensors it read from the files, and the seconds it took. Sides alternate, ROUNDS times;
figures are the medians, with the range.

    python bench/hf_memory.py [ROUNDS]
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LLAMA = dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=16, num_attention_heads=12,
             num_key_value_heads=4, vocab_size=32768, max_position_embeddings=1024)


def memory() -> tuple[int, int]:
    """This process's anonymous memory and its proportional share of every page it maps (Pss:
    a page of the file that both ranks map counts half in each), in bytes."""
    with open("/proc/self/smaps_rollup") as f:
        fields = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f
                  if line.endswith("kB\n")}
    return fields["Anonymous"], fields["Pss"]


def rank_side(side: str, folder: str) -> None:
    """In a rank: build the model one way, sharded, and print this rank's peak (JSON)."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    start, peak, done = memory(), [0, 0], threading.Event()

    def sample() -> None:
        while not done.is_set():
            now = memory()
            peak[:] = [max(p, n) for p, n in zip(peak, now, strict=True)]
            time.sleep(0.005)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    began = time.perf_counter()
    if side == "dtrain":
        from dtrain import config
        from dtrain import parallel
        from dtrain.parallel.precision import Precision
        from dtrain.process.env import detect
        from dtrain.run.pieces import layout_of

        cfg = config.load(None, [f"model.name=hf:{folder}", "model.args={}",
                                 "parallel.mode=fsdp", "task.name=language_model",
                                 "ckpt.monitor=val_loss", "ckpt.monitor_mode=min"])
        env = detect()
        layout = layout_of(cfg, env, torch.device("cpu"))
        model, _, notes = parallel.strategy(cfg.parallel, layout).build(
            cfg.model, {}, cfg.run.seed, Precision("fp32", layout.device, True))
        assert any("shard by shard" in n for n in notes), notes
        read = [float(n.split("safetensors (")[1].split(" of ")[0]) * 2**20 for n in notes
                if "weights read by rows" in n][0]
    else:
        from torch.distributed.fsdp import fully_shard
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        read = float(sum(p.numel() * 4 for p in model.parameters()))  # every tensor, whole
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
    seconds = time.perf_counter() - began
    done.set()
    sampler.join()
    params = sum(p.to_local().numel() for p in model.parameters())
    print(json.dumps({"rank": dist.get_rank(), "anon": peak[0] - start[0],
                      "pss": peak[1] - start[1], "seconds": seconds, "local_params": params,
                      "read": read}),
          flush=True)
    dist.destroy_process_group()


def launch(side: str, folder: str) -> list[dict]:
    out = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", __file__,
         "--rank-side", side, folder],
        capture_output=True, text=True, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO / "src")},
        check=False)
    if out.returncode != 0:
        raise SystemExit(f"{side} failed:\n{out.stderr[-3000:]}")
    return sorted((json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")),
                  key=lambda r: r["rank"])


def main(rounds: int) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    with tempfile.TemporaryDirectory(prefix="dtrain-hf-memory-") as work:
        folder = os.path.join(work, "llama")
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(**LLAMA))
        count = sum(p.numel() for p in model.parameters())
        model.save_pretrained(folder)
        del model
        peaks: dict[tuple[str, str], list[float]] = {}
        for _ in range(rounds):
            for side in ("dtrain", "whole") if _ % 2 == 0 else ("whole", "dtrain"):
                ranks = launch(side, folder)
                for kind in ("anon", "pss", "read"):
                    peaks.setdefault((side, kind), []).append(
                        max(r[kind] for r in ranks) / 2**20)
                peaks.setdefault((side, "seconds"), []).append(max(r["seconds"] for r in ranks))
        print(f"Llama of {count / 1e6:.1f} M parameters ({count * 4 / 2**20:.0f} MiB in float32), "
              f"FSDP on 2 ranks, {rounds} rounds: the larger rank's peak while the model is made "
              f"and sharded, above where it started")
        for side, label in (("dtrain", "dtrain hf:PATH (rows per rank)"),
                            ("whole", "from_pretrained whole in every rank")):
            line = []
            for kind, unit in (("anon", "MiB"), ("pss", "MiB"), ("read", "MiB"), ("seconds", "s")):
                values = peaks[(side, kind)]
                line.append(f"{kind} median {statistics.median(values):5.1f} {unit} "
                            f"({min(values):.1f}-{max(values):.1f})")
            print(f"  {label:<38} " + ", ".join(line))
        for kind in ("anon", "pss", "read", "seconds"):
            ratio = (statistics.median(peaks[("dtrain", kind)])
                     / statistics.median(peaks[("whole", kind)]))
            print(f"  ratio dtrain / whole, {kind}: {ratio:.2f}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--rank-side"]:
        rank_side(sys.argv[2], sys.argv[3])
    else:
        main(int(sys.argv[1]) if len(sys.argv) > 1 else 3)
