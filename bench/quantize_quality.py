"""What int8 costs a trained run and what it gains, through dtrain's own commands: short runs of
the default CNN and of the built-in GPT on BPE tokens trained by launch/train.py (2-rank
torchrun), then `dtrain export --quantize` into each format, whose evals JSON holds the metric on
the run's validation split before and after, both files' sizes and both latencies (the median
over the validation batches, both sides timed in the same process).

- The default CNN (configs/default.yaml shortened: CNN_OVERRIDES): `int8-static` as a
  torch.export file (latency compiled by inductor) and as ONNX (onnxruntime's static
  quantization, timed under onnxruntime): accuracy before and after, file and latency ratios.
- The GPT (configs/gpt_tokens.yaml shortened: GPT_OVERRIDES, on `dtrain tokenize --corpus
  python_docs`): `int8-dynamic` and `int8-weight` as torch.export files, `int8-dynamic` as ONNX:
  the rise of validation bits per byte, file and latency ratios.
- An `hf:` Llama (LLAMA: a LlamaForCausalLM saved from its config, drawn from seed 0, on the
  GPT's tokens and steps): `int8-dynamic` and `int8-weight` as Hugging Face folders that
  transformers loads with torchao: the rise of validation bits per byte, folder and latency
  ratios.
- QAT against PTQ: the same GPT trained for the same steps with `train.qat.scheme=int8-dynamic`
  (fake quantization from QAT_START on), exported with `--quantize int8-dynamic`; both drops
  against the float run's full-precision bits per byte, and the share of the post-training drop
  that QAT recovered (torchao's "recovered %": 1 - QAT drop / PTQ drop).

Every export runs `rounds` times, the exports alternating (each round starts with another one);
a ratio is the median over rounds, its detail the range. The metrics do not depend on the round
(the calibration batches come from the run's seed); a round that disagreed would be said.
Exports time with one intra-op thread (common.env), as every benchmark here.

    python bench/quantize_quality.py [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from common import Figure  # noqa: E402

CNN_CONFIG = str(common.REPO / "configs" / "default.yaml")
GPT_CONFIG = str(common.REPO / "configs" / "gpt_tokens.yaml")
# 2 epochs of 8,000 images (the default's 8 of 20,000): 126 steps of 2 x 64, the warm-up cut to
# match; 46 % validation accuracy (chance: 10 %) in the run measured, a model that has learnt
# something to lose.
CNN_OVERRIDES = ["train.epochs=2", "data.synthetic.train_size=8000", "sched.warmup_steps=40"]
# 120 steps of 2 x 32 windows of 129 tokens (the config's 4 epochs are about 220 steps).
GPT_STEPS = 120
GPT_OVERRIDES = [f"train.max_steps={GPT_STEPS}", "train.eval_every_steps=60",
                 "sched.warmup_steps=20"]
QAT_START = GPT_STEPS // 2
# About 4 M parameters, the head untied from the token embedding as in Llama's own checkpoints.
LLAMA = dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False)
LLAMA_OVERRIDES = ["model.args={}", "optim.lr=0.001"]
# (model, format, scheme): every export measured.
EXPORTS = [("cnn", "exported", "int8-static"), ("cnn", "onnx", "int8-static"),
           ("gpt", "exported", "int8-dynamic"), ("gpt", "exported", "int8-weight"),
           ("gpt", "onnx", "int8-dynamic"), ("qat", "exported", "int8-dynamic"),
           ("llama", "hf", "int8-dynamic"), ("llama", "hf", "int8-weight")]
SUFFIX = {"exported": ".pt2", "onnx": ".onnx", "hf": ""}


def dtrain(*args: str) -> list[str]:
    return [sys.executable, "-m", "dtrain", *args]


def train(work: Path) -> dict[str, Path]:
    """The three runs: the CNN, the GPT in float and the GPT with QAT; name -> run directory."""
    tokens = work / "python_docs_bpe"
    common.run(dtrain("tokenize", "--corpus", "python_docs", "--out", str(tokens),
                      "--vocab-size", "2048"))
    gpt = [f"data.root={tokens}", *GPT_OVERRIDES]
    llama = [*gpt, f"model.name=hf:{save_llama(work / 'llama', tokens)}", *LLAMA_OVERRIDES]
    runs = {"cnn": (CNN_CONFIG, CNN_OVERRIDES), "gpt": (GPT_CONFIG, gpt),
            "qat": (GPT_CONFIG, [*gpt, "train.qat.scheme=int8-dynamic",
                                 f"train.qat.start_step={QAT_START}"]),
            "llama": (GPT_CONFIG, llama)}
    dirs = {}
    for name, (config, overrides) in runs.items():
        dirs[name] = work / "runs" / name
        print(f"training {name}", file=sys.stderr, flush=True)
        common.run(common.dtrain_cmd(dirs[name], overrides, nproc=2, config=config), timeout=1200)
    return dirs


def save_llama(folder: Path, tokens: Path) -> Path:
    """The `hf:` model folder: a Llama of LLAMA's sizes and the token files' vocabulary."""
    import torch
    import transformers

    vocab = json.loads((tokens / "meta.json").read_text())["vocab_size"]
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA, vocab_size=vocab)) \
        .save_pretrained(folder)
    return folder


def export(run_dir: Path, form: str, scheme: str, out: Path) -> dict:
    """One `dtrain export --quantize`; the evals JSON it wrote."""
    evals = run_dir / "evals"
    before = set(evals.glob("*.json")) if evals.exists() else set()
    print(f"exporting {run_dir.name} {form} {scheme}", file=sys.stderr, flush=True)
    common.run(dtrain("export", "--run-dir", str(run_dir), "--out", str(out), "--format", form,
                      "--quantize", scheme), timeout=1200)
    (written,) = set(evals.glob("*.json")) - before
    return json.loads(written.read_text())


def _span(values: list[float], digits: int = 2) -> str:
    return f"{min(values):.{digits}f}-{max(values):.{digits}f}"


def figures_of(key: tuple[str, str, str], results: list[dict]) -> list[Figure]:
    """One export's figures over its rounds: the metric's drop, the file and latency ratios."""
    model, form, scheme = key
    first = results[0]
    label = f"quantize: {model} {scheme} ({form})"
    same = all((r["before"], r["after"]) == (first["before"], first["after"]) for r in results)
    metric = first["metric"]
    goal = {"points": "<= 1", "%": "<= 2"}.get(first["drop_unit"], "")
    detail = (f"{metric} {first['before']:.5g} -> {first['after']:.5g}, step {first['step']}"
              + ("" if same else f"; differed by round: {[r['after'] for r in results]}"))
    size = [r["size_ratio"] for r in results]
    latency = [r["latency_ratio"] for r in results]
    before = [r["latency_ms_before"] for r in results]
    after = [r["latency_ms_after"] for r in results]
    return [
        Figure(f"{label}: drop", first["drop"], first["drop_unit"],
               goal="" if model == "qat" else goal, detail=detail),
        Figure(f"{label}: file int8/fp32", common.median(size), "x",
               goal="<= 0.3x" if model == "llama" or (model, form) == ("gpt", "exported")
               else "",
               detail=f"{first['size_bytes_after'] / 1e6:.3f} vs "
                      f"{first['size_bytes_before'] / 1e6:.3f} MB"),
        Figure(f"{label}: latency int8/fp32", common.median(latency), "x",
               detail=f"{common.median(after):.2f} vs {common.median(before):.2f} ms a batch of "
                      f"{first['latency_batch_size']} ({first['latency_how']}, median of "
                      f"{first['latency_batches']}); per round {_span(latency)}"),
    ]


def qat_against_ptq(results: dict[tuple[str, str, str], list[dict]]) -> list[Figure]:
    """Both drops against the float run's full-precision bits per byte, in %."""
    ptq = results["gpt", "exported", "int8-dynamic"][0]
    qat = results["qat", "exported", "int8-dynamic"][0]
    float_bpb = ptq["before"]
    ptq_drop = 100 * (ptq["after"] - float_bpb) / float_bpb
    qat_drop = 100 * (qat["after"] - float_bpb) / float_bpb
    # Where post-training quantization lost nothing, there is nothing for QAT to recover.
    recovered = 100 * (1 - qat_drop / ptq_drop) if ptq_drop > 0 else float("nan")
    return [
        Figure("quantize: gpt int8-dynamic after PTQ, rise vs float", ptq_drop, "%",
               detail=f"{ptq['metric']} {float_bpb:.5f} -> {ptq['after']:.5f}"),
        Figure("quantize: gpt int8-dynamic after QAT, rise vs float", qat_drop, "%",
               detail=f"QAT run {qat['before']:.5f} (its own full precision) -> "
                      f"{qat['after']:.5f}; QAT from step {QAT_START} of {GPT_STEPS}"),
        Figure("quantize: QAT recovered of the PTQ drop", recovered, "%",
               detail="1 - QAT drop / PTQ drop" if ptq_drop > 0 else
               "none to recover: PTQ lost nothing"),
    ]


def run(work: Path, rounds: int = 2) -> list[Figure]:
    dirs = train(work)
    results: dict[tuple[str, str, str], list[dict]] = {key: [] for key in EXPORTS}
    for i in range(rounds):
        for j, key in enumerate(EXPORTS[i % len(EXPORTS):] + EXPORTS[:i % len(EXPORTS)]):
            model, form, scheme = key
            out = work / "exports" / f"{model}-{scheme}-{i}-{j}{SUFFIX[form]}"
            out.parent.mkdir(parents=True, exist_ok=True)
            results[key].append(export(dirs[model], form, scheme, out))
            if out.is_dir():
                shutil.rmtree(out)
            else:
                out.unlink()
    figures = [Figure(f"quantize: {name} run, final {metric}", value, "",
                      detail=f"step {step}")
               for name, (metric, value, step) in _finals(dirs).items()]
    for key in EXPORTS:
        figures += figures_of(key, results[key])
    return figures + qat_against_ptq(results)


def _finals(dirs: dict[str, Path]) -> dict[str, tuple[str, float, int]]:
    """Each run's last validation figure as its training logged it."""
    out = {}
    for name, run_dir in dirs.items():
        metric = "val_acc" if name == "cnn" else "val_bits_per_byte"
        last = [r for r in common.records(run_dir) if metric in r][-1]
        out[name] = (metric, last[metric], last["step"])
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2, help="rounds of the exports (default 2)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="dtrain-bench-") as tmp:
        for figure in run(Path(tmp), args.rounds):
            print(figure.line(), flush=True)
