"""Memory of `dtrain export --format hf` on a Llama of about 150 M parameters (bench/hf_memory.py's,
float32: about 600 MB of weights): from a sharded checkpoint, written file by file
(`--max-shard-size 100MB`, the checkpoint's tensors read one file's worth at a time), against the
same checkpoint converted to one `checkpoint.pt` (`dtrain convert --to full`), which the export
builds whole (the model, its state dict, transformers' save and the reloaded copy for the check).
The same for a LoRA fine-tune of that Llama (r=8 on q_proj, v_proj): its sharded checkpoint
merged file by file (the base's files plus the adapters, hf_merge.py) against its full
checkpoint, whose export builds the base whole and merges with peft's merge_and_unload.

The checkpoint comes from one step of FSDP on 2 ranks (`ckpt.format=sharded`). Each export is
its own process, whose anonymous memory (RssAnon: what the process itself allocates, not the
page cache of the files it maps, such as those it hashes to check their digests) is sampled
every 10 ms; the figure is its peak.
Sides alternate, ROUNDS times; figures are the medians, with the range. Each pair's folders'
tensors are compared too (equal; the LoRA pair's within float32 rounding).

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


def export(source: Path, out: Path, extra: list[str]) -> float:
    """The peak anonymous memory (MiB) of exporting the checkpoint `source` to `out`."""
    shutil.rmtree(out, ignore_errors=True)
    return peak_anonymous(dtrain("export", "--checkpoint", str(source), "--format", "hf",
                                 "--out", str(out), *extra)) / 2**20


def measure(work: Path, rounds: int) -> list[common.Figure]:
    model, data = work / "llama", work / "tokens"
    params = common.make_llama(model, data, LLAMA, {"train": 40_000, "val": 8_000})
    figures = []
    for kind, extra in (("", []), ("lora_", ["model.lora.r=8", "model.lora.alpha=16"])):
        run_dir = work / "runs" / f"{kind}sharded"
        common.run(common.dtrain_cmd(run_dir, [*TRAIN, *extra, f"model.name=hf:{model}",
                                               f"data.root={data}"], nproc=2), timeout=1200)
        sharded = checkpoint_of(run_dir)
        full = work / f"{kind}full"
        common.run(dtrain("convert", "--checkpoint", str(sharded), "--to", "full", "--out",
                          str(full)), timeout=1200)
        streamed, whole = common.alternate(
            rounds,
            lambda _, source=sharded, out=work / f"{kind}streamed": export(
                source, out, ["--max-shard-size", "100MB"]),
            lambda _, source=full, out=work / f"{kind}whole": export(source, out, []),
        )
        a, b = tensors(work / f"{kind}streamed"), tensors(work / f"{kind}whole")
        same = a.keys() == b.keys()
        apart = max(float((a[k] - b[k]).abs().max()) for k in a) if same else float("inf")
        files = len(list((work / f"{kind}streamed").glob("*.safetensors")))
        note = (f"{params / 1e6:.0f}M-parameter Llama, {rounds} rounds; {files} files of at "
                f"most 100 MB; largest difference from the whole export's tensors: {apart:.1e}")
        figures += [
            common.Figure(f"hf_export_{kind}streamed_peak_anon_mib", common.median(streamed),
                          "MiB", detail=f"{min(streamed):.0f}-{max(streamed):.0f}; {note}"),
            common.Figure(f"hf_export_{kind}whole_peak_anon_mib", common.median(whole), "MiB",
                          detail=f"{min(whole):.0f}-{max(whole):.0f}"),
        ]
    return figures


if __name__ == "__main__":
    ROUNDS = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    with tempfile.TemporaryDirectory(prefix="dtrain-bench-") as tmp:
        for figure in measure(Path(tmp), ROUNDS):
            print(figure.line(), flush=True)
