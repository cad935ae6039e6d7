"""Token files (`data.name: tokens`): rank memory flat in the corpus size, and a loader far faster
than the model it feeds.

- Memory: the same 2-rank run (a small GPT, 30 steps) on 40 MB and on 4 GB of token ids (real
  files of random ids, uint16, vocabulary 2048). Each rank's anonymous memory (RssAnon in
  /proc/<pid>/status: what the process itself allocated, not the mapped file's pages) is sampled
  from outside while it runs; the figure is the largest growth of a rank's peak.
- Throughput: the tokens per second one rank's training loader delivers (the run's own loader:
  `data.loaders`, the lazy order over the 4 GB file, no worker processes) against the tokens per
  second the default `gpt` (model.name=gpt, no args: dim 256, depth 4, windows of 256) consumes
  per rank in a 2-rank run on the same files (its records' `tokens_per_s`, halved).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from common import Figure  # noqa: E402

VOCAB = 2048
SIZES = {"40 MB": 40 << 20, "4 GB": 4 << 30}
LM = ["task.name=language_model", "model.name=gpt", "data.name=tokens", "data.num_workers=0",
      "optim.name=adamw", "optim.lr=0.001", "ckpt.monitor=val_loss", "ckpt.monitor_mode=min",
      "train.log_every=1", "train.eval_every_epochs=0", "ckpt.every_epochs=0",
      "log.tensorboard=false"]
SMALL_GPT = ["model.args={dim: 64, depth: 2, heads: 2, seq_len: 128}", "data.batch_size=8",
             "train.max_steps=30"]
DEFAULT_GPT = ["data.batch_size=16", "train.max_steps=12"]
MiB = 1 << 20


def token_folder(folder: Path, size: int) -> Path:
    """`size` bytes of random uint16 ids below VOCAB as train.bin, 1 MB as val.bin, meta.json."""
    import numpy as np
    folder.mkdir(parents=True)
    gen = np.random.default_rng(0)
    chunk = 32 << 20  # tokens written at a time
    for name, tokens in (("train.bin", size // 2), ("val.bin", 1 << 19)):
        with open(folder / name, "wb") as f:
            for start in range(0, tokens, chunk):
                gen.integers(0, VOCAB, min(chunk, tokens - start), dtype=np.uint16).tofile(f)
    (folder / "meta.json").write_text(json.dumps({
        "dtype": "uint16", "vocab_size": VOCAB, "tokens": {"train": size // 2, "val": 1 << 19}}))
    return folder


def _rss_anon(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return int(next(line for line in f if line.startswith("RssAnon:")).split()[1]) * 1024


def peak_rss_anon(run_dir: Path, overrides: list[str]) -> list[int]:
    """Each rank's peak RssAnon over a 2-rank run, sampled every 20 ms."""
    cmd = common.dtrain_cmd(run_dir, overrides, nproc=2)
    proc = subprocess.Popen(cmd, cwd=common.REPO, env=common.env(timing_malloc=False),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    peaks: dict[int, int] = {}
    while proc.poll() is None:
        for pid in _children(proc.pid):
            try:
                environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
                rank = int(next(v for v in environ if v.startswith(b"RANK="))[5:])
                peaks[rank] = max(peaks.get(rank, 0), _rss_anon(pid))
            except (OSError, StopIteration, ValueError):
                continue
        time.sleep(0.02)
    if proc.returncode != 0:
        raise RuntimeError(f"the run exited {proc.returncode}:\n{proc.stderr.read()[-3000:]}")
    return [peaks[0], peaks[1]]


def _children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
    return found


def loader_tokens_per_s(folder: Path, batches: int = 300) -> float:
    """Tokens per second one rank's training loader (of a 2-rank run) delivers."""
    import torch

    from dtrain import config, data
    from dtrain.data.sampler import LAZY_ORDER_FROM
    cfg = config.load(None, [*LM, *DEFAULT_GPT, f"data.root={folder}"])
    sets = data.build(cfg.data, cfg.run.seed, cfg.model.args)
    assert len(sets.train) >= LAZY_ORDER_FROM  # the order a large corpus gets
    loaders = data.loaders(sets.train, sets.val, cfg=cfg.data, seed=cfg.run.seed, rank=0,
                           world_size=2, device=torch.device("cpu"))
    loaders.train_sampler.set_epoch(0)
    began, tokens = time.perf_counter(), 0
    for served, batch in enumerate(loaders.train, start=1):
        tokens += batch.shape[0] * (batch.shape[1] - 1)  # what the model predicts of a window
        if served == batches:
            break
    return tokens / (time.perf_counter() - began)


def run(work: Path, rounds: int = 1) -> list[Figure]:
    folders = {label: token_folder(work / label.replace(" ", ""), size)
               for label, size in SIZES.items()}
    peaks = {label: peak_rss_anon(work / "runs" / f"rss{label.replace(' ', '')}",
                                  [*LM, *SMALL_GPT, f"data.root={folder}"])
             for label, folder in folders.items()}
    grown = [big - small for big, small in zip(peaks["4 GB"], peaks["40 MB"], strict=True)]
    big = folders["4 GB"]
    run_dir = work / "runs" / "default_gpt"
    common.run(common.dtrain_cmd(run_dir, [*LM, *DEFAULT_GPT, f"data.root={big}"], nproc=2))
    speeds = [r["tokens_per_s"] for r in common.records(run_dir) if "tokens_per_s" in r][2:]
    consumed = common.median(speeds) / 2  # per rank
    delivered = loader_tokens_per_s(big)
    shown = ", ".join(f"rank {r}: {peaks['40 MB'][r] / MiB:.0f} -> {peaks['4 GB'][r] / MiB:.0f} MiB"
                      for r in range(2))
    return [
        Figure("tokens: rank RssAnon growth, 40 MB -> 4 GB of ids", max(grown) / MiB, "MiB",
               "<= 64", f"peak RssAnon {shown}"),
        Figure("tokens: loader tokens/s / default gpt's, per rank", delivered / consumed, "x",
               ">= 5", f"{delivered:,.0f} tokens/s delivered (no workers) vs {consumed:,.0f} "
                       f"consumed (median of {len(speeds)} steps)"),
    ]


if __name__ == "__main__":
    common.run_standalone(run)
