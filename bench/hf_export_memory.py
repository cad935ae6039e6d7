"""Memory of `dtrain export --format hf` on a Llama of about 150 M parameters (bench/hf_memory.py's,
float32: about 600 MB of weights): from a sharded checkpoint, written file by file
(`--max-shard-size 100MB`, the checkpoint's tensors read one file's worth at a time), against the
same checkpoint converted to one `checkpoint.pt` (`dtrain convert --to full`), which the export
builds whole (the model, its state dict, transformers' save and the reloaded copy for the check).

The checkpoint comes from one step of FSDP on 2 ranks (`ckpt.format=sharded`). Each export is
its own process, whose anonymous memory (RssAnon: what the process itself allocates, not the
page cache of the files it maps, such as those it hashes to check their digests) is sampled
every 10 ms; the figure is its peak.
Sides alternate, ROUNDS times; figures are the medians, with the range. The two folders'
tensors are compared too (they must be equal).

    python bench/hf_export_memory.py [ROUNDS]
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import common
from hf_memory import LLAMA

SEQ_LEN = 64
TRAIN = ["task.name=language_model", "model.args={}", "data.name=tokens", "data.num_workers=0",
         "data.batch_size=2", f"data.tokens.seq_len={SEQ_LEN}", "optim.name=adamw",
         "optim.lr=1e-4", "optim.weight_decay=0.0", "sched.name=none", "train.max_steps=1",
         "train.eval_every_epochs=0", "ckpt.format=sharded", "ckpt.monitor=val_loss",
         "ckpt.monitor_mode=min", "log.tensorboard=false", "parallel.mode=fsdp"]


def dtrain(*args: str) -> list[str]:
    return [sys.executable, "-m", "dtrain", *args]


def peak_anonymous(cmd: list[str]) -> int:
    """Run `cmd`; the peak of its anonymous memory, in bytes."""
    proc = subprocess.Popen(cmd, cwd=common.REPO, env=common.env(timing_malloc=False),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    peak = 0
    while proc.poll() is None:
        try:
            with open(f"/proc/{proc.pid}/status") as f:
                for line in f:
                    if line.startswith("RssAnon:"):
                        peak = max(peak, int(line.split()[1]) * 1024)
        except OSError:
            pass
        time.sleep(0.01)
    out, err = proc.communicate()
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd[:6])} ... exited {proc.returncode}:\n{err[-3000:]}")
    return peak


def checkpoint_of(run_dir: Path) -> Path:
    latest = (run_dir / "checkpoints" / "latest").read_text().strip()
    return run_dir / "checkpoints" / latest


def tensors(folder: Path) -> dict:
    from safetensors.torch import load_file

    found: dict = {}
    for path in sorted(folder.glob("*.safetensors")):
        found.update(load_file(path))
    return found


def measure(work: Path, rounds: int) -> list[common.Figure]:
    model, data = work / "llama", work / "tokens"
    params = common.make_llama(model, data, LLAMA, {"train": 40_000, "val": 8_000})
    run_dir = work / "runs" / "sharded"
    common.run(common.dtrain_cmd(run_dir, [*TRAIN, f"model.name=hf:{model}",
                                           f"data.root={data}"], nproc=2), timeout=1200)
    sharded = checkpoint_of(run_dir)
    full = work / "full"
    common.run(dtrain("convert", "--checkpoint", str(sharded), "--to", "full", "--out",
                      str(full)), timeout=1200)

    def export(source: Path, name: str, extra: list[str]) -> float:
        out = work / name
        shutil.rmtree(out, ignore_errors=True)
        return peak_anonymous(dtrain("export", "--checkpoint", str(source), "--format", "hf",
                                     "--out", str(out), *extra)) / 2**20

    streamed, whole = common.alternate(
        rounds,
        lambda _: export(sharded, "streamed", ["--max-shard-size", "100MB"]),
        lambda _: export(full, "whole", []),
    )
    a, b = tensors(work / "streamed"), tensors(work / "whole")
    equal = a.keys() == b.keys() and all(bool((a[k] == b[k]).all()) for k in a)
    files = len(list((work / "streamed").glob("*.safetensors")))
    note = (f"{params / 1e6:.0f}M-parameter Llama, {rounds} rounds; {files} files of at most "
            f"100 MB; tensors equal to the whole export's: {equal}")
    return [
        common.Figure("hf_export_streamed_peak_anon_mib", common.median(streamed), "MiB",
                      detail=f"{min(streamed):.0f}-{max(streamed):.0f}; {note}"),
        common.Figure("hf_export_whole_peak_anon_mib", common.median(whole), "MiB",
                      detail=f"{min(whole):.0f}-{max(whole):.0f}"),
    ]


if __name__ == "__main__":
    ROUNDS = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    with tempfile.TemporaryDirectory(prefix="dtrain-bench-") as tmp:
        for figure in measure(Path(tmp), ROUNDS):
            print(figure.line(), flush=True)
