"""The cost of a task evaluation inside dtrain against lm-eval's own run on the exported folder:
a Llama (about 4 M parameters, made here from a config, with a byte-level BPE of 2048 ids
trained on the built-in corpus) trained one step by dtrain, then exported with `dtrain export
--format hf`. Two local tasks in lm-eval's format: multiple choice (48 questions of 4 choices,
by log-likelihood) and generation (12 prompts, greedy, exact match). Each round, the wall time
of a process: `dtrain eval --tasks` on the run's checkpoint (the model built from it as a run
builds it, the run's tokenizer), and a Python process calling `lm_eval.simple_evaluate(model=
"hf", ...)` on the exported folder; both one thread, the same batch size, alternating ROUNDS
times. The figure is the median ratio, dtrain's time over lm-eval's, with the range; the
metrics of the two sides are compared too.

    python bench/task_eval_cost.py [ROUNDS]
"""

from __future__ import annotations

import io
import json
import subprocess
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

ROUNDS = 3
VOCAB = 2048
BATCH = 8
LLAMA = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=512)
WORDS = ["the module", "a function", "the import statement", "a class", "the loop", "a string",
         "the list", "a dictionary", "the file", "an exception", "the value", "a method"]
MC_TASK = """\
task: bench_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: mc.jsonl
test_split: test
output_type: multiple_choice
doc_to_text: "{{question}}"
doc_to_choice: "{{choices}}"
doc_to_target: "{{answer}}"
metric_list:
  - metric: acc
  - metric: acc_norm
"""
GEN_TASK = """\
task: bench_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: gen.jsonl
test_split: test
output_type: generate_until
doc_to_text: "{{prompt}}"
doc_to_target: "{{answer}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 16
  do_sample: false
metric_list:
  - metric: exact_match
"""
REFERENCE = """\
import json, sys
import lm_eval
from lm_eval.tasks import TaskManager
out = lm_eval.simple_evaluate(model="hf", model_args="pretrained=" + sys.argv[1] + ",dtype=float32",
                              tasks=["bench_mc", "bench_gen"], device="cpu", batch_size=int(sys.argv[3]),
                              task_manager=TaskManager(include_path=sys.argv[2], include_defaults=False),
                              bootstrap_iters=0, log_samples=False)
print(json.dumps(out["results"]))
"""


def dtrain(*args: str) -> list[str]:
    return [sys.executable, "-m", "dtrain", *args]


def write_tasks(folder: Path) -> None:
    folder.mkdir(parents=True)
    (folder / "mc.yaml").write_text(MC_TASK)
    (folder / "gen.yaml").write_text(GEN_TASK)
    rows = [{"question": f"Question {i}: what does Python call {w}?",
             "choices": [f" {w}", f" {WORDS[(i + 3) % 12]}", " zq xv", f" {WORDS[(i + 7) % 12]}"],
             "answer": i % 4} for i, w in enumerate(WORDS * 4)]
    (folder / "mc.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    rows = [{"prompt": f"In Python, {w} is", "answer": " the"} for w in WORDS]
    (folder / "gen.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def prepare(work: Path) -> tuple[Path, Path, Path]:
    """The trained run, its exported folder and the tasks' folder."""
    import tokenizers
    import torch
    import transformers

    from dtrain.commands.tokenize import command as tokenize
    from dtrain.commands.tokenize.settings import Settings
    from dtrain.data.text import python_docs

    text = python_docs()[:400_000].decode()
    bpe = tokenizers.Tokenizer(tokenizers.models.BPE())
    bpe.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = tokenizers.decoders.ByteLevel()
    bpe.train_from_iterator([text], tokenizers.trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=["<|endoftext|>"], show_progress=False,
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet()))
    own = transformers.PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>")
    model = work / "llama"
    own.save_pretrained(model)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(
        **LLAMA, vocab_size=len(own), eos_token_id=own.eos_token_id)).save_pretrained(model)
    corpus = work / "corpus.txt"
    corpus.write_text(text)
    tokens = work / "tokens"
    tokenize.tokenize(Settings([str(corpus)], str(tokens), tokenizer_path=str(model)),
                      io.StringIO())
    run_dir = work / "runs" / "llama"
    common.run(common.dtrain_cmd(run_dir, [
        f"model.name=hf:{model}", "model.args={}", "task.name=language_model",
        "data.name=tokens", f"data.root={tokens}", "data.tokens.seq_len=128",
        f"data.batch_size={BATCH}", "train.max_steps=1", "optim.name=adamw", "optim.lr=1e-4",
        "ckpt.format=full", "log.tensorboard=false", "data.num_workers=0",
        "ckpt.monitor=val_loss", "ckpt.monitor_mode=min"]), timeout=1200)
    out = work / "exported"
    common.run(dtrain("export", "--run-dir", str(run_dir), "--format", "hf", "--out", str(out)),
               timeout=1200)
    write_tasks(work / "tasks")
    return run_dir, out, work / "tasks"


def measure(work: Path, rounds: int = ROUNDS) -> list[common.Figure]:
    run_dir, out, tasks = prepare(work)
    ours: list[dict[str, float]] = []
    theirs: list[dict[str, float]] = []

    def dtrain_side(_: int) -> float:
        started = time.perf_counter()
        common.run(dtrain("eval", "--run-dir", str(run_dir), "--tasks", str(tasks)),
                   timeout=1200)
        seconds = time.perf_counter() - started
        saved = max((run_dir / "evals").glob("*.json"), key=lambda p: p.stat().st_mtime)
        ours.append({k: v for k, v in json.loads(saved.read_text()).items()
                     if k.startswith("task_")})
        return seconds

    def lm_eval_side(_: int) -> float:
        started = time.perf_counter()
        # (lm-eval reads a task's data files from the working directory)
        proc = subprocess.run([sys.executable, "-c", REFERENCE, str(out), str(tasks), str(BATCH)],
                              cwd=tasks, env=common.env(), text=True, capture_output=True,
                              timeout=1200, check=True)
        seconds = time.perf_counter() - started
        results = json.loads(proc.stdout.strip().splitlines()[-1])
        theirs.append({f"task_{task}_{key.split(',')[0]}": float(v)
                       for task, row in results.items() for key, v in row.items()
                       if key.endswith(",none") and "_stderr" not in key})
        return seconds

    a, b = common.alternate(rounds, dtrain_side, lm_eval_side)
    ratios = [x / y for x, y in zip(a, b)]
    return [common.Figure(
        "task eval: wall time dtrain eval --tasks / lm-eval hf", common.median(ratios), "x",
        detail=f"{min(ratios):.2f}-{max(ratios):.2f}; {rounds} rounds; dtrain "
               f"{common.median(a):.1f} s, lm-eval {common.median(b):.1f} s a process (48 "
               f"multiple-choice questions, 12 generations); the same metrics: "
               f"{ours[-1] == theirs[-1]} ({ours[-1]})")]


if __name__ == "__main__":
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else ROUNDS
    common.run_standalone(lambda work: measure(work, rounds))
