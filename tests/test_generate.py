"""`dtrain generate`: what a trained run's model says. Two tiny runs trained here, shared by the
module: the built-in gpt on a token folder of the built-in corpus (its checkpoint sharded), and
an `hf:` Llama overfit on chat data of one fixed exchange. Greedy decoding with the gpt's
key/value cache gives the tokens it gives without one; the `hf:` run's tokens are transformers'
`generate`'s on the folder `dtrain export --format hf` writes; the chat run answers with the
reply it learned; a seed fixes the sampled text; FSDP on 2 ranks generates what one process
does from the sharded checkpoint; bad input is one line, exit 2."""

from __future__ import annotations

import io
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from conftest import REPO, child_env, dtrain, latest, launch, torchrun_cmd, without_module
from test_chat_data import save_tiny_llama, write_jsonl

from dtrain.commands.export.checkpoint_model import load_model
from dtrain.commands.tokenize import command as tokenize
from dtrain.commands.tokenize.settings import Settings
from dtrain.data.text import python_docs
from dtrain.loop.decode import Sampling, gpt_generate

pytestmark = pytest.mark.filterwarnings("ignore:Unable to enable fault handler:UserWarning")

SEQ = 64
QUESTION, REPLY = "What is the answer?", "Forty-two."
LLAMA = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=SEQ)
LM = ["task.name=language_model", "model.args={}", "data.name=tokens", "optim.name=adamw",
      "optim.weight_decay=0.0", "sched.name=none", "ckpt.monitor=val_loss",
      "ckpt.monitor_mode=min", "train.eval_every_epochs=0", f"data.tokens.seq_len={SEQ}"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """`model`: a tokenizer with a chat template and a Llama of its vocabulary; `plain`: its
    tokens of the corpus; `chat`: its tokens of one exchange, many times; `gpt` and `hf`: the
    runs trained on them."""
    root = tmp_path_factory.mktemp("generate")
    model = save_tiny_llama(root / "model", LLAMA)
    corpus = root / "corpus.txt"
    corpus.write_text(python_docs()[:40_000].decode())
    tokenize.tokenize(Settings([str(corpus)], str(root / "plain"), tokenizer_path=str(model)),
                      io.StringIO())
    exchange = {"messages": [{"role": "user", "content": QUESTION},
                             {"role": "assistant", "content": REPLY}]}
    tokenize.tokenize(Settings([str(write_jsonl(root / "chat.jsonl", [exchange] * 64))],
                               str(root / "chat"), tokenizer_path=str(model), chat=True,
                               seq_len=SEQ, val_inputs=[str(write_jsonl(root / "v.jsonl",
                                                                        [exchange] * 4))]),
                      io.StringIO())
    gpt = launch(root / "runs" / "gpt", [
        *LM, "model.name=gpt", "model.args={dim: 32, depth: 2, heads: 2}",
        f"data.root={root / 'plain'}", "data.batch_size=8", "train.max_steps=30",
        "optim.lr=0.01", "ckpt.format=sharded", "train.ema.decay=0.9"])
    assert gpt.returncode == 0, gpt.stderr[-3000:]
    byte_level = launch(root / "runs" / "bytes", [
        *LM, "data.name=text", "data.text.corpus=python_docs", "model.name=gpt",
        "model.args={dim: 32, depth: 2, heads: 2, seq_len: 64}",
        "data.batch_size=8", "train.max_steps=20", "optim.lr=0.01"])
    assert byte_level.returncode == 0, byte_level.stderr[-3000:]
    hf = launch(root / "runs" / "hf", [
        *LM, f"model.name=hf:{model}", f"data.root={root / 'chat'}", "data.batch_size=4",
        "train.epochs=20", "train.max_steps=60", "optim.lr=0.01", "ckpt.format=full"])
    assert hf.returncode == 0, hf.stderr[-3000:]
    return {"root": root, "model": model, "plain": root / "plain", "chat": root / "chat",
            "gpt": gpt.run_dir, "hf": hf.run_dir, "bytes": byte_level.run_dir}


def generate(run_dir: Path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return dtrain("generate", "--run-dir", str(run_dir), *args, env=env)


def records(result: subprocess.CompletedProcess) -> list[dict]:
    assert result.returncode == 0, result.stderr[-3000:]
    return [json.loads(line) for line in result.stdout.splitlines()]


def test_greedy_with_the_cache_equals_greedy_without_it(runs) -> None:
    """The built-in gpt, token for token, greedy and sampled alike; and `dtrain generate`'s
    tokens are the cached ones."""
    model, _ = load_model(str(latest(runs["gpt"])))
    prompt = "The import statement"
    shown = records(generate(runs["gpt"], "--prompt", prompt, "--max-new-tokens", "40",
                             "--format", "jsonl"))
    ids = shown[0]["prompt_ids"]
    for sampling in (Sampling(40, 0.0, None, None, 0), Sampling(40, 0.8, 20, 0.9, 3)):
        cached = gpt_generate(model, ids, sampling, frozenset(), torch.device("cpu"))
        again = gpt_generate(model, ids, sampling, frozenset(), torch.device("cpu"), cached=False)
        assert cached == again and len(cached.ids) == 40 and cached.stop == "length"
    greedy = gpt_generate(model, ids, Sampling(40, 0.0, None, None, 0), frozenset(),
                          torch.device("cpu"))
    assert shown[0]["ids"][:len(greedy.ids)] == greedy.ids


def test_an_hf_run_generates_what_transformers_generates_on_its_exported_folder(runs,
                                                                                 tmp_path) -> None:
    """The chat run's prompt is rendered by the template as the exported folder's tokenizer
    renders it, and the new tokens are `generate`'s (greedy), up to the end of the turn."""
    out = tmp_path / "exported"
    exported = dtrain("export", "--run-dir", str(runs["hf"]), "--format", "hf", "--out", str(out))
    assert exported.returncode == 0, exported.stderr[-3000:]
    ours = records(generate(runs["hf"], "--prompt", QUESTION, "--max-new-tokens", "12",
                            "--format", "jsonl"))[0]
    tokenizer = transformers.AutoTokenizer.from_pretrained(out, local_files_only=True)
    model = transformers.AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": QUESTION}],
                                             add_generation_prompt=True, tokenize=True)
    prompt = list(rendered["input_ids"] if hasattr(rendered, "keys") else rendered)
    assert ours["prompt_ids"] == prompt
    with torch.no_grad():
        theirs = model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)
    new = theirs[0, len(prompt):].tolist()
    special = {i for i, t in tokenizer.added_tokens_decoder.items() if t.special}
    end = next((i for i, t in enumerate(new) if t in special), len(new))
    assert ours["ids"] == new[:end] and ours["stop"] == ("eos" if end < len(new) else "length")


def test_a_chat_run_answers_with_the_reply_it_learned(runs) -> None:
    said = generate(runs["hf"], "--prompt", QUESTION, "--max-new-tokens", "20")
    assert said.returncode == 0, said.stderr[-3000:]
    assert said.stdout == REPLY + "\n"


def test_the_same_seed_gives_the_same_text_and_another_seed_another(runs) -> None:
    def sampled(seed: int) -> list[str]:
        shown = generate(runs["gpt"], "--prompt", "The", "--temperature", "1.5", "--top-k", "100",
                         "--top-p", "0.95", "--seed", str(seed), "--max-new-tokens", "30")
        assert shown.returncode == 0, shown.stderr[-3000:]
        return shown.stdout

    first = sampled(1)
    assert first.startswith("The") and sampled(1) == first and sampled(2) != first


def test_a_byte_level_run_speaks_in_bytes(runs) -> None:
    """data.name text, no tokenizer file: a text's UTF-8 bytes are the tokens; the model's
    greedy bytes, decoded (a character cut short shown as U+FFFD), follow the prompt."""
    prompt = "The caf\u00e9 is"
    shown = records(generate(runs["bytes"], "--prompt", prompt, "--max-new-tokens", "20",
                             "--format", "jsonl"))[0]
    assert shown["prompt_ids"] == list(prompt.encode("utf-8"))
    model, _ = load_model(str(latest(runs["bytes"])))
    greedy = gpt_generate(model, shown["prompt_ids"], Sampling(20, 0.0, None, None, 0),
                          frozenset(), torch.device("cpu"), vocab=256)
    assert (shown["ids"], shown["stop"]) == (greedy.ids, "length")
    assert shown["text"] == bytes(greedy.ids).decode("utf-8", errors="replace")
    text = generate(runs["bytes"], "--prompt", prompt, "--max-new-tokens", "20")
    assert text.returncode == 0 and text.stdout == prompt + shown["text"] + "\n", text.stderr
    assert "with the run's bytes (data.name text" in text.stderr


def test_the_moving_average_speaks_with_its_own_weights(runs) -> None:
    """--weights ema: the checkpoint's moving average (train.ema) decodes, token for token what
    the average's weights give by hand (sampled with one seed: the tiny model's greedy text is
    one token again and again, whichever weights), where the trained weights give other tokens;
    a run without an average is one line, exit 2."""
    prompt = "The import statement"
    cpu, sampling = torch.device("cpu"), Sampling(30, 2.0, None, None, 1)
    shown = {weights: records(generate(runs["gpt"], "--weights", weights, "--prompt", prompt,
                                       "--max-new-tokens", "30", "--temperature", "2",
                                       "--seed", "1", "--format", "jsonl"))[0]
             for weights in ("model", "ema")}
    ids = shown["ema"]["prompt_ids"]
    by_hand = {weights: gpt_generate(load_model(str(latest(runs["gpt"])), weights)[0], ids,
                                     sampling, frozenset(), cpu).ids for weights in ("model", "ema")}
    assert by_hand["ema"] != by_hand["model"]  # (else the test could not tell them apart)
    for weights in ("model", "ema"):
        assert shown[weights]["ids"][:len(by_hand[weights])] == by_hand[weights], weights
    refused = generate(runs["hf"], "--weights", "ema", "--prompt", "x")
    assert refused.returncode == 2 and refused.stdout == "", refused.stderr[-2000:]
    assert refused.stderr.strip().splitlines() == [
        f"dtrain: generate error: {latest(runs['hf'])} was saved without EMA weights "
        f"(train.ema.decay unset); use --weights model"], refused.stderr


@pytest.mark.slow
def test_a_sharded_checkpoint_generates_under_fsdp_on_two_ranks_what_one_process_does(runs):
    args = ["generate", "--run-dir", str(runs["gpt"]), "--prompts", "", "--max-new-tokens", "25",
            "--format", "jsonl"]
    prompts = runs["root"] / "prompts.txt"
    prompts.write_text("The import statement\nA class\n")
    args[4] = str(prompts)
    one = dtrain(*args)
    two = subprocess.run([*torchrun_cmd(2), "-m", "dtrain", *args, "parallel.mode=fsdp"],
                         cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=300,
                         stdin=subprocess.DEVNULL)
    assert "at world size 2, mode fsdp" in two.stderr, two.stderr[-3000:]
    assert records(two) == records(one) and len(records(one)) == 2


def test_bad_input_is_one_line_and_exit_2(runs, tmp_path) -> None:
    untokenized = tmp_path / "untokenized"
    shutil.copytree(runs["plain"], untokenized)
    (untokenized / "tokenizer.json").unlink()
    latin = tmp_path / "latin.txt"
    latin.write_bytes("caf\u00e9\n".encode("latin-1"))
    gpt, hf = str(runs["gpt"]), str(runs["hf"])
    cases = [
        ([gpt, "--prompt", "x", f"data.root={untokenized}"], None,
         "generate error: the run has no tokenizer: its model (gpt) has no folder with one and "
         "its data (data.name tokens) is not a token folder with a tokenizer.json (dtrain "
         "tokenize writes one)"),
        ([gpt, "--prompt", "word " * 100], None,
         "tokens, and the model's window is 64: nothing could follow it; shorten it"),
        ([gpt, "--prompt", "x", "--max-new-tokens", "0"], None,
         "usage error: --max-new-tokens 0: generate at least 1 token"),
        ([gpt, "--prompts", str(latin)], None,
         f"generate error: --prompts {latin} is not UTF-8 text (line 1, byte 3); save it as "
         f"UTF-8"),
        ([gpt, "--interactive"], None,
         "generate error: --interactive reads prompts from a terminal and stdin is not one; give "
         "--prompt TEXT or --prompts FILE"),
        ([gpt, "--prompt", "x", "--top-k", "5"], None,
         "usage error: --top-k and --top-p limit sampling: give --temperature T above 0 (0, the "
         "default, is greedy)"),
        ([gpt, "--prompt", "x"], without_module(tmp_path / "no_tokenizers", "tokenizers"),
         "missing dependency: dtrain generate (the token folder's tokenizer) needs the 'tokens' "
         "extra: pip install 'dtrain[tokens]'"),
        ([hf, "--prompt", "x"], without_module(tmp_path / "no_transformers", "transformers"),
         "needs the 'transformers' extra: pip install 'dtrain[transformers]'"),
    ]
    for args, env, expected in cases:
        result = dtrain("generate", "--run-dir", *args, env=env)
        lines = result.stderr.strip().splitlines()
        assert result.returncode == 2 and len(lines) == 1, (args, result.stderr[-2000:])
        assert lines[0].endswith(expected), (args, lines[0])
        assert result.stdout == ""


def test_interactive_on_a_terminal_answers_each_line_until_ctrl_d(runs) -> None:
    """--interactive on a terminal (a pseudo-terminal here): a line typed, its reply printed;
    a line too long for the window is said so and the next is read; Ctrl-D ends with exit 0."""
    import os
    import pty
    import select
    import time

    pid, fd = pty.fork()
    if pid == 0:  # the child: dtrain with the terminal as its stdin and stdout
        os.chdir(REPO)
        os.execve(sys.executable, [sys.executable, "-m", "dtrain", "generate", "--run-dir",
                                   str(runs["hf"]), "--interactive", "--max-new-tokens", "20"],
                  child_env())
    said = b""

    def read_until(wanted: bytes, times: int = 1, timeout: float = 240) -> None:
        nonlocal said
        end = time.monotonic() + timeout
        while said.count(wanted) < times and time.monotonic() < end:
            if select.select([fd], [], [], 1)[0]:
                try:
                    said += os.read(fd, 4096)
                except OSError:
                    break
        assert said.count(wanted) >= times, said.decode(errors="replace")[-3000:]

    read_until(b"generating from")
    os.write(fd, (QUESTION + "\n").encode())
    read_until(REPLY.encode())
    os.write(fd, ("word " * 200 + "\n").encode())  # longer than the 64-token window
    read_until(b"window")
    os.write(fd, (QUESTION + "\n").encode())
    read_until(REPLY.encode(), times=2)
    os.write(fd, b"\x04")  # Ctrl-D
    _, status = os.waitpid(pid, 0)
    os.close(fd)
    assert os.waitstatus_to_exitcode(status) == 0, said.decode(errors="replace")[-3000:]
    assert said.decode(errors="replace").count(REPLY) == 2


def test_a_lora_run_generates_with_its_adapters_on_its_base(runs) -> None:
    """A LoRA run of the built-in gpt: `dtrain generate` reads its adapters onto the base
    (checked by the base's digest) and decodes what the merged model decodes, token for token."""
    lora = launch(runs["root"] / "runs" / "lora", [
        *LM, "model.name=gpt", "model.args={dim: 32, depth: 2, heads: 2}",
        f"data.root={runs['plain']}", "data.batch_size=8", "train.max_steps=10",
        "optim.lr=0.05", "model.lora.r=4", "model.lora.alpha=8"])
    assert lora.returncode == 0, lora.stderr[-3000:]
    merged, _ = load_model(str(latest(lora.run_dir)))
    assert not any("lora" in name for name in merged.state_dict())
    shown = records(generate(lora.run_dir, "--prompt", "The import statement",
                             "--max-new-tokens", "24", "--format", "jsonl"))
    greedy = gpt_generate(merged, shown[0]["prompt_ids"], Sampling(24, 0.0, None, None, 0),
                          frozenset(), torch.device("cpu"))
    assert shown[0]["ids"][:len(greedy.ids)] == greedy.ids and len(greedy.ids) == 24
    base = records(generate(runs["gpt"], "--prompt", "The import statement",
                            "--max-new-tokens", "24", "--format", "jsonl"))
    assert base[0]["prompt_ids"] == shown[0]["prompt_ids"]
