"""What `dtrain tokenize` and a token folder trust: a chat template that loops, a conversation
too long for any window, JSON nested a hundred thousand deep, rows without a reply, flags that
cannot be meant, a stop signal mid-work; masks that are not what meta.json's digests say, or
hold undefined flags, or count nothing; a token file that is a device. Each: its exit code, its
one line, no traceback, and no `*.partial` file left."""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import time
from pathlib import Path

import forkserver
import pytest
import transformers
from conftest import REPO, child_env, dtrain
from test_chat_data import SEQ, TEMPLATE, conversation, save_tokenizer, write_jsonl

# Two loops of 100,000, which the sandbox's own bound on `range` lets through.
LOOPING = ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
           + TEMPLATE)
GPT_ARGS = f"model.args={{dim: 32, depth: 1, heads: 2, seq_len: {SEQ}}}"


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> dict:
    """Tokenizer folders (a plain template, a looping one), a tokenizer.json, inputs, and one
    `tokenize --chat` folder whose copies the token-folder cases damage."""
    root = tmp_path_factory.mktemp("trust_tokenize")
    model = save_tokenizer(root / "model")
    save_tokenizer(root / "looping", template=LOOPING)
    own = transformers.AutoTokenizer.from_pretrained(model, local_files_only=True)
    rows = [{"messages": conversation(k)} for k in range(60)]
    chat = write_jsonl(root / "chat.jsonl", rows)
    out = root / "tokens"
    code = dtrain("tokenize", str(chat), "--tokenizer", str(model), "--chat", "--seq-len",
                  str(SEQ), "--out", str(out)).returncode
    assert code == 0
    # Text enough to be mid-work seconds after the first .partial file appears.
    big = root / "big.txt"
    line = "The sampler draws windows; every rank reads its own share of the corpus. "
    big.write_text("".join(f"{k} {line}\n" for k in range(400_000)))
    return {"root": root, "model": model, "looping": root / "looping", "own": own, "chat": chat,
            "out": out, "big": big, "tokenizer": model / "tokenizer.json"}


def partial_files(folder: Path) -> list[str]:
    return [str(p) for p in folder.rglob("*.partial")] if folder.exists() else []


# ---------------------------------------------------------------------------------------------
# dtrain tokenize: bad input and bounds, one line before any work


def tokenize_cases(setup: dict) -> dict[str, tuple[list[str], str]]:
    """Each case: the arguments after `tokenize` (--out added), and its one line."""
    root, model, chat = setup["root"], str(setup["model"]), str(setup["chat"])
    nested = root / "nested.jsonl"
    nested.write_text("[" * 100_000 + "\n")
    long_row = write_jsonl(root / "long.jsonl", [{"messages": [
        {"role": "user", "content": "why? " * 400_000},
        {"role": "assistant", "content": "because."}]}])
    longest = max(map(len, setup["own"].get_vocab()))
    silent = write_jsonl(root / "silent.jsonl", [{"messages": [
        {"role": "user", "content": f"question {k}"}]} for k in range(30)])
    plain = ["--tokenizer", str(setup["tokenizer"])]
    with_chat = ["--tokenizer", model, "--chat", "--seq-len", str(SEQ)]
    return {
        "workers": ([chat, *plain, "--workers", "1000000000"],
                    f"usage error: --workers must be from 1 to {len(os.sched_getaffinity(0))} "
                    f"(the cores this process may use), not 1000000000"),
        "seq-len": ([chat, *plain, "--column", "messages", "--pack", "--seq-len",
                     "1099511627776"],
                    "usage error: --seq-len must be from 1 to 16777216 (2**24), not "
                    "1099511627776"),
        "render-timeout": ([chat, *with_chat, "--render-timeout", "inf"],
                           "usage error: --render-timeout must be above 0 and at most 86400 "
                           "seconds, not inf"),
        "looping template": ([chat, "--tokenizer", str(setup["looping"]), "--chat",
                              "--render-timeout", "0.5"],
                             f"input error: {chat}:1: the chat template took more than 0.5 s "
                             f"to render the conversation (a template that loops without end?); "
                             f"fix the template, leave the conversation out, or raise "
                             f"--render-timeout"),
        "long conversation": ([str(long_row), *with_chat],
                              f"input error: {long_row}:1: the conversation's text is "
                              f"2,000,008 characters, more than a window of --seq-len {SEQ} "
                              f"tokens can hold (the tokenizer's tokens spell at most {longest} "
                              f"characters); raise --seq-len, or leave the conversation out"),
        "nested JSON, chat": ([str(nested), *with_chat],
                              f"input error: {nested}:1: JSON nested too deeply to read (arrays "
                              f"or objects inside one another hundreds of levels deep); a row "
                              f"is an object of text or of messages"),
        "nested JSON, text": ([str(nested), *plain],
                              f"input error: {nested}:1: JSON nested too deeply to read (arrays "
                              f"or objects inside one another hundreds of levels deep); a row "
                              f"is an object of text or of messages"),
        "no assistant reply": ([str(silent), *with_chat],
                               "input error: no assistant reply in the 30 conversation(s) of the "
                               "training inputs: nothing to learn (--chat counts the assistant's "
                               "replies)"),
    }


CASES = ["workers", "seq-len", "render-timeout", "looping template", "long conversation",
         "nested JSON, chat", "nested JSON, text", "no assistant reply"]


@pytest.mark.parametrize("case", CASES)
def test_bad_tokenize_input_is_one_line_exit_2_at_once_and_nothing_written(setup, case) -> None:
    args, line = tokenize_cases(setup)[case]
    out = setup["root"] / f"out_{case.replace(' ', '_').replace(',', '')}"
    started = time.monotonic()
    result = dtrain("tokenize", *args, "--out", str(out), timeout=60)
    elapsed = time.monotonic() - started
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1] == f"dtrain: {line}"
    assert not out.exists()
    assert elapsed < 20, elapsed  # (on main, --workers ran minutes and the long row 2 min)


# ---------------------------------------------------------------------------------------------
# A stop signal mid-work: nothing partial left, one line, the shell's exit code


@pytest.mark.parametrize(("what", "sig", "code"), [
    ("text", signal.SIGINT, 130),
    ("text", signal.SIGTERM, 143),
    ("looping template", signal.SIGTERM, 143),
])
def test_a_stopped_tokenize_leaves_nothing_partial(setup, tmp_path, what, sig, code) -> None:
    out = tmp_path / "out"
    if what == "text":
        args = [str(setup["big"]), "--tokenizer", str(setup["tokenizer"])]
    else:  # rendering for as long as the (default) time bound lets it
        args = [str(setup["chat"]), "--tokenizer", str(setup["looping"]), "--chat"]
    err = tmp_path / "stderr"
    with open(err, "w") as stderr:
        proc = forkserver.popen([sys.executable, "-m", "dtrain", "tokenize", *args, "--out",
                                 str(out)], cwd=REPO, env=child_env(), stdout=stderr,
                                stderr=stderr)
        deadline = time.monotonic() + 60
        while not (out / "train.bin.partial").exists():
            assert proc.poll() is None, err.read_text()
            assert time.monotonic() < deadline, "no train.bin.partial within 60 s"
            time.sleep(0.02)
        time.sleep(0.3)  # mid-work: tokens (or a render) under way
        proc.send_signal(sig)
        assert proc.wait(timeout=30) == code, err.read_text()
    lines = err.read_text().strip().splitlines()
    assert "Traceback" not in err.read_text()
    assert lines[-1] == (f"dtrain: tokenize stopped by {signal.Signals(sig).name}: nothing "
                         f"written to {out} (the unfinished files removed)")
    assert not out.exists(), sorted(os.listdir(out))
    assert not partial_files(tmp_path)


# ---------------------------------------------------------------------------------------------
# A token folder's masks and files: what meta.json's digests say, defined flags, some counted


def damaged_folder(setup: dict, folder: Path, case: str) -> str:
    """A copy of the chat folder, damaged as `case` says; the line training it must end with."""
    shutil.copytree(setup["out"], folder)
    if case.endswith("without digests"):
        meta = json.loads((folder / "meta.json").read_text())
        del meta["digest"], meta["digests"]
        (folder / "meta.json").write_text(json.dumps(meta))
    train_mask, val_mask = folder / "train.mask", folder / "val.mask"
    if case.startswith("train.mask 0xff"):
        train_mask.write_bytes(b"\xff" * train_mask.stat().st_size)
    if case.startswith("val.mask zeroed"):
        val_mask.write_bytes(b"\0" * val_mask.stat().st_size)
    if case == "train.bin is /dev/zero":
        (folder / "train.bin").unlink()
        (folder / "train.bin").symlink_to("/dev/zero")
    digest = ("differs from the digest meta.json holds for it (changed or damaged since dtrain "
              "tokenize wrote the folder); make the folder again with dtrain tokenize, or "
              "restore the file")
    return {
        "train.mask 0xff": f"data error: {train_mask} {digest}",
        "val.mask zeroed": f"data error: {val_mask} {digest}",
        "train.mask 0xff, without digests": (
            f"data error: {train_mask}: byte 0 is 0xff, not a loss mask's: its flags are 1 "
            f"(counted) and 2 (starts a document) alone; the file is damaged, or not a mask "
            f"(make the folder again with dtrain tokenize)"),
        "val.mask zeroed, without digests": (
            f"data error: the loss masks of {folder / 'val.bin'} count no token: the val loss "
            f"would have nothing to measure"),
        "train.bin is /dev/zero": (
            f"data error: {folder / 'train.bin'} is not a regular file (a folder or a device); "
            f"a token folder holds files of token ids, masks and meta.json"),
    }[case]


@pytest.mark.parametrize("case", ["train.mask 0xff", "val.mask zeroed",
                                  "train.mask 0xff, without digests",
                                  "val.mask zeroed, without digests", "train.bin is /dev/zero"])
def test_a_damaged_token_folder_is_one_line_before_training(setup, tmp_path, case) -> None:
    line = damaged_folder(setup, tmp_path / "tokens", case)
    result = dtrain("train", "task.name=language_model", "model.name=gpt", GPT_ARGS,
                    "data.name=tokens", f"data.root={tmp_path / 'tokens'}",
                    f"data.tokens.seq_len={SEQ}", "data.batch_size=2", "data.num_workers=0",
                    "train.max_steps=2", "ckpt.monitor=val_loss", "ckpt.monitor_mode=min",
                    "log.tensorboard=false", f"run.out_dir={tmp_path}",
                    "run.name=run", timeout=120)
    assert result.returncode == 2, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1] == f"dtrain: {line}"

