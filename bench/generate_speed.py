"""`dtrain generate` against transformers' `generate` on the same model: a Llama (about 4 M
parameters, made here from a config) trained one step by dtrain on the built-in corpus's BPE
tokens, then exported with `dtrain export --format hf`. Each round, greedy, from the same
prompt and for the same number of new tokens: `dtrain generate` on the run (its own figure of
decoding: new tokens over the seconds spent decoding, model loading left out, as its log
line says) and `generate` of the exported folder in this process (one thread, as the dtrain
process has); the sides alternate, ROUNDS times. The figure is the median ratio of tokens/s,
dtrain's over transformers', with the range.

And the built-in gpt's key/value cache: tokens/s with it over tokens/s without it (the whole
sequence again at every step), in this process, on a GPT of the same width and depth.

    python bench/generate_speed.py [ROUNDS]
"""

from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

ROUNDS = 5
NEW_TOKENS = 200
VOCAB = 2048
PROMPT = "The import statement"
LLAMA = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=512)


def dtrain(*args: str) -> list[str]:
    return [sys.executable, "-m", "dtrain", *args]


def prepare(work: Path) -> tuple[Path, Path]:
    """The trained run and its exported folder."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tokens = work / "tokens"
    common.run(dtrain("tokenize", "--corpus", "python_docs", "--out", str(tokens),
                      "--vocab-size", str(VOCAB)), timeout=1200)
    eot = json.loads((tokens / "meta.json").read_text())["eot_id"]
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**LLAMA, eos_token_id=eot)).save_pretrained(work / "llama")
    run_dir = work / "runs" / "llama"
    common.run(common.dtrain_cmd(run_dir, [
        f"model.name=hf:{work / 'llama'}", "model.args={}", "task.name=language_model",
        "data.name=tokens", f"data.root={tokens}", "data.tokens.seq_len=128",
        "data.batch_size=4", "train.max_steps=1", "optim.name=adamw", "optim.lr=1e-4",
        "ckpt.format=full", "log.tensorboard=false", "data.num_workers=0",
        "ckpt.monitor=val_loss", "ckpt.monitor_mode=min"]), timeout=1200)
    out = work / "exported"
    common.run(dtrain("export", "--run-dir", str(run_dir), "--format", "hf", "--out", str(out)),
               timeout=1200)
    return run_dir, out


def ours(run_dir: Path) -> tuple[float, list[int], list[int]]:
    """dtrain generate's tokens/s of decoding, the prompt's ids and the new ones."""
    proc = common.run(dtrain("generate", "--run-dir", str(run_dir), "--prompt", PROMPT,
                             "--max-new-tokens", str(NEW_TOKENS), "--format", "jsonl"))
    said = json.loads(proc.stdout.splitlines()[0])
    rate = re.search(r"of decoding: ([\d.]+) tokens/s", proc.stderr)
    assert rate, proc.stderr[-2000:]
    return float(rate[1]), said["prompt_ids"], said["ids"]


def theirs(model, prompt: list[int], eot: int) -> tuple[float, list[int]]:  # noqa: ANN001
    import torch

    ids = torch.tensor([prompt])
    started = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=NEW_TOKENS, eos_token_id=eot, pad_token_id=eot)
    seconds = time.perf_counter() - started
    new = out[0, len(prompt):].tolist()
    return len(new) / seconds, [t for t in new if t != eot]


def cache_speedup(rounds: int) -> tuple[list[float], list[float]]:
    """The built-in gpt's tokens/s with its cache and without, alternating."""
    import torch

    from dtrain.commands.generate.decode import Sampling, gpt_generate
    from dtrain.models import GPT

    torch.manual_seed(0)
    model = GPT(vocab_size=VOCAB, seq_len=512, dim=256, depth=4, heads=4).eval()
    greedy = Sampling(NEW_TOKENS, 0.0, None, None, 0)
    prompt = list(range(1, 17))

    def rate(cached: bool) -> float:
        started = time.perf_counter()
        made = gpt_generate(model, prompt, greedy, frozenset(), torch.device("cpu"),
                            cached=cached)
        return len(made.ids) / (time.perf_counter() - started)

    with_cache, without = common.alternate(rounds, lambda _: rate(True), lambda _: rate(False))
    return with_cache, without


def measure(work: Path, rounds: int = ROUNDS) -> list[common.Figure]:
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)  # as the dtrain process (OMP_NUM_THREADS=1)
    run_dir, out = prepare(work)
    eot = json.loads((work / "tokens" / "meta.json").read_text())["eot_id"]
    model = AutoModelForCausalLM.from_pretrained(out, local_files_only=True).eval()
    prompts: list[list[int]] = []
    same: list[bool] = []

    def dtrain_side(_: int) -> float:
        rate, prompt, new = ours(run_dir)
        prompts.append(prompt)
        same.append(new == theirs(model, prompt, eot)[1])
        return rate

    def transformers_side(_: int) -> float:
        return theirs(model, prompts[-1], eot)[0]

    a, b = common.alternate(rounds, dtrain_side, transformers_side)
    ratios = [x / y for x, y in zip(a, b)]
    cached, uncached = cache_speedup(rounds)
    speedups = [x / y for x, y in zip(cached, uncached)]
    return [
        common.Figure("generate: hf tokens/s dtrain/transformers", common.median(ratios), "x",
                      detail=f"{min(ratios):.3f}-{max(ratios):.3f}; {rounds} rounds of "
                             f"{NEW_TOKENS} greedy tokens; dtrain {common.median(a):.0f}, "
                             f"transformers {common.median(b):.0f} tokens/s; same tokens: "
                             f"{all(same)}"),
        common.Figure("generate: gpt tokens/s with/without KV cache", common.median(speedups),
                      "x", detail=f"{min(speedups):.2f}-{max(speedups):.2f}; "
                                  f"{common.median(cached):.0f} against "
                                  f"{common.median(uncached):.0f} tokens/s"),
    ]


if __name__ == "__main__":
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else ROUNDS
    common.run_standalone(lambda work: measure(work, rounds))
