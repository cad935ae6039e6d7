"""Bytes against BPE tokens on the same corpus, for the same wall time: configs/gpt_text.yaml
(byte-level windows) and configs/gpt_tokens.yaml (the built-in corpus through `dtrain tokenize
--vocab-size 2048`), the same GPT, 2 ranks on this machine's CPUs, each given BUDGET_S seconds
from launch. A run still going at the budget is stopped with SIGTERM (dtrain saves and exits);
its figure is the last evaluation before the budget. Validation bits per byte puts both on one
scale: the tokens' loss is divided by the bytes per token of the validation split (meta.json).
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from common import Figure  # noqa: E402

BUDGET_S = 600.0
VOCAB = 2048


def tokenize(work: Path) -> Path:
    out = work / "python_docs_bpe"
    common.run([sys.executable, "-m", "dtrain", "tokenize", "--corpus", "python_docs", "--out",
                str(out), "--vocab-size", str(VOCAB)], timeout=600)
    return out


def train_for(work: Path, name: str, config: str, overrides: list[str], budget: float) -> dict:
    """Launch, stop at the budget if still running; the evaluations made within it."""
    run_dir = work / "runs" / name
    cmd = common.dtrain_cmd(run_dir, ["log.tensorboard=true", "train.eval_every_steps=25",
                                      *overrides], nproc=2, config=str(common.REPO / config))
    launched = time.time()
    proc = subprocess.Popen(cmd, cwd=common.REPO, env=common.env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    try:
        _, stderr = proc.communicate(timeout=budget)
        stopped = False
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)  # torchrun passes it on: a checkpoint, then exit 0
        _, stderr = proc.communicate(timeout=300)
        stopped = True
    if proc.returncode != 0:
        raise RuntimeError(f"{name} exited {proc.returncode}:\n{stderr[-3000:]}")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    events = EventAccumulator(str(run_dir / "tb"), size_guidance={"scalars": 0})
    events.Reload()
    within = [e for e in events.Scalars("val/bits_per_byte") if e.wall_time - launched <= budget]
    return {"bpb": within[-1].value, "step": within[-1].step, "stopped": stopped,
            "wall": time.time() - launched}


def run(work: Path, budget: float = BUDGET_S) -> list[Figure]:
    folder = tokenize(work)
    text = train_for(work, "bytes", "configs/gpt_text.yaml", [], budget)
    bpe = train_for(work, "bpe", "configs/gpt_tokens.yaml", [f"data.root={folder}"], budget)

    def said(side: dict) -> str:
        how = "stopped at the budget" if side["stopped"] else f"finished in {side['wall']:.0f} s"
        return f"{side['bpb']:.3f} at step {side['step']} ({how})"

    return [Figure(
        f"language model: val bits per byte, BPE {VOCAB} / bytes, {budget:.0f} s each",
        bpe["bpb"] / text["bpb"], "x", "< 1",
        f"BPE {said(bpe)}; bytes {said(text)}")]


if __name__ == "__main__":
    seconds = float(sys.argv[1]) if len(sys.argv) > 1 else BUDGET_S
    common.run_standalone(lambda work: run(work, seconds))
