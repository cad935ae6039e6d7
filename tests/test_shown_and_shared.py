"""What a user sees and shares: every file dtrain writes (a run's records and checkpoints, exports
in every format, a converted checkpoint, token files) has the mode the user's umask gives an
ordinary file; the lines a person reads (the banner, `dtrain runs`' tables) fit 120 columns; on
a terminal no line is printed into the progress bar; the banner says what runs; and on a tie
both `dtrain runs` forms name the same best checkpoint. One 2-rank run on a pseudo-terminal
under umask 027 serves most of it."""

from __future__ import annotations

import contextlib
import fcntl
import os
import pty
import re
import select
import stat
import struct
import subprocess
import termios
import time
from pathlib import Path

import pytest
import torch
import transformers
from conftest import (REPO, STAMP, TINY, TRAIN, child_env, dtrain, launch, torchrun_cmd,
                      unwrapped)
from test_hf_models import GPT2, LM
from test_tokens import token_folder

from dtrain import cli

COLUMNS = 120
BAR = re.compile(r"epoch \d+ +\d+%\|")
ESCAPE = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
TERMINAL_UMASK = 0o027  # the shared run's


def on_a_terminal(cmd: list[str], umask: int, timeout: float = 240) -> str:
    """`cmd` run with its stdout and stderr on a pseudo-terminal of 120 columns, under `umask`
    (set by the shell, as a user's is); what the terminal received."""
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 40, COLUMNS, 0, 0))
    shell = ["sh", "-c", f'umask {umask:03o} && exec "$0" "$@"', *cmd]
    proc = subprocess.Popen(shell, cwd=REPO, env=child_env(), stdin=subprocess.DEVNULL,
                            stdout=follower, stderr=follower, start_new_session=True)
    os.close(follower)
    received, deadline = b"", time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if select.select([leader], [], [], 1.0)[0]:
                try:
                    chunk = os.read(leader, 65536)
                except OSError:  # the terminal is gone: every process on it has ended
                    break
                if not chunk:
                    break
                received += chunk
            elif proc.poll() is not None:
                break
        assert proc.wait(timeout=max(1.0, deadline - time.monotonic())) == 0, received[-3000:]
    finally:
        os.close(leader)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, 9)
    return received.decode(errors="replace")


@pytest.fixture(scope="module")
def terminal_run(tmp_path_factory) -> tuple[Path, str]:
    """2 ranks, 2 epochs of the tiny job on a terminal under umask 027, run.private off; a
    learning rate too small to change a prediction, so that both epochs' val_acc tie."""
    run_dir = tmp_path_factory.mktemp("shown") / "runs" / "r"
    args = [*TINY, "train.epochs=2", "optim.lr=1e-9", "run.private=false", "log.progress=auto",
            f"run.out_dir={run_dir.parent}", f"run.name={run_dir.name}"]
    screen = on_a_terminal([*torchrun_cmd(2), TRAIN, *args], TERMINAL_UMASK)
    return run_dir, screen


@contextlib.contextmanager
def umask(mask: int):
    before = os.umask(mask)
    try:
        yield
    finally:
        os.umask(before)


def modes(folder: Path) -> dict[str, int]:
    """The permission bits of every file below `folder`, by relative path."""
    return {str(p.relative_to(folder)): stat.S_IMODE(p.stat().st_mode)
            for p in folder.rglob("*") if p.is_file()}


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory) -> Path:
    """A one-step LoRA fine-tune of a small GPT-2 folder, in sharded checkpoints."""
    root = tmp_path_factory.mktemp("lora_modes")
    torch.manual_seed(0)
    transformers.GPT2LMHeadModel(transformers.GPT2Config(**GPT2)).save_pretrained(root / "gpt2")
    run = launch(root / "runs" / "lora", [
        *LM, f"model.name=hf:{root / 'gpt2'}", f"data.root={token_folder(root / 'tokens')}",
        "model.lora.r=4", "model.lora.alpha=8", "train.max_steps=1", "ckpt.format=sharded",
        "data.tokens.seq_len=16", "log.tensorboard=false"], tiny=False)
    assert run.returncode == 0, run.stderr[-3000:]
    return run.run_dir


@pytest.mark.parametrize("mask", [0o022, 0o027], ids=["umask 022", "umask 027"])
def test_every_file_dtrain_writes_follows_the_umask(terminal_run, lora_run, tmp_path, capsys,
                                                    mask) -> None:
    """Every export format (hf from a sharded checkpoint file by file, and from a full one
    through transformers), converted checkpoints (full and sharded), token files, and under the shared run's
    umask that run's records and checkpoints: 0666 less the umask, whatever the library writing
    them does."""
    cnn, _ = terminal_run
    out = tmp_path / "out"
    converted = tmp_path / "converted"
    checkpoint = lora_run / "checkpoints" / (lora_run / "checkpoints" / "latest").read_text().strip()
    calls = [
        *(["export", "--run-dir", str(cnn), "--format", fmt, "--out", str(out / f"cnn.{fmt}")]
          for fmt in ("state_dict", "torchscript", "exported", "onnx", "safetensors")),
        ["export", "--run-dir", str(cnn), "--format", "safetensors", "--out", str(out / "st")],
        ["export", "--run-dir", str(lora_run), "--format", "peft", "--out", str(out / "peft")],
        ["export", "--run-dir", str(lora_run), "--format", "hf", "--out", str(out / "hf_parts")],
        ["convert", "--checkpoint", str(checkpoint), "--to", "full", "--out", str(converted)],
        ["export", "--checkpoint", str(converted), "--format", "hf", "--out", str(out / "hf")],
        ["convert", "--checkpoint", str(converted), "--to", "sharded", "--out",
         str(out / "sharded")],
        ["tokenize", "--corpus", "python_docs", "--vocab-size", "300", "--val-fraction", "0.5",
         "--out", str(out / "tokens")],
    ]
    with umask(mask):
        for call in calls:
            assert cli.main(call) == 0, (call, capsys.readouterr().err[-3000:])
    found = {**modes(out), **{f"converted/{k}": v for k, v in modes(converted).items()}}
    if mask == TERMINAL_UMASK:
        found.update({f"run/{k}": v for k, v in modes(cnn.parent).items()})
        # the lock is the run's own, not a record: it names the process that holds the run
        del found["run/r/.lock"]
        for name in ("run/r/metrics.jsonl", "run/runs.csv", "run/r/config.yaml"):
            assert name in found, sorted(found)
        assert any(name.endswith("checkpoint.pt") for name in found)
    for name in ("hf/model.safetensors", "hf_parts/model.safetensors",
                 "peft/adapter_model.safetensors", "cnn.safetensors", "st/model.safetensors",
                 "cnn.onnx", "converted/checkpoint.pt", "sharded/meta.pt", "sharded/dcp/.metadata",
                 "tokens/train.bin"):
        assert name in found, sorted(found)
    assert {name: oct(m) for name, m in found.items() if m != 0o666 & ~mask} == {}


# -- what a person reads ---------------------------------------------------------------------

def screen_lines(screen: str, run_dir: Path) -> list[str]:
    """The terminal's lines as a person sees them: a carriage return starts the line again,
    escape codes show nothing; the run's folder (a path the user chose) as RUN."""
    lines = []
    for raw in screen.replace("\r\n", "\n").split("\n"):
        lines.append(ESCAPE.sub("", raw.split("\r")[-1]).replace(str(run_dir.parent), "RUN"))
    return lines


def test_lines_fit_120_columns_and_none_runs_into_the_progress_bar(terminal_run) -> None:
    run_dir, screen = terminal_run
    lines = screen_lines(screen, run_dir)
    assert [line for line in lines if len(line) > COLUMNS] == []
    # Each bar ends as a line of its own: one per epoch, on rank 0's terminal only.
    bars = [line for line in lines if BAR.search(line)]
    assert len(bars) == 2 and all(line.startswith("epoch ") for line in bars), bars
    for raw in screen.split("\n"):  # no log line starts inside what the bar drew
        for piece in raw.split("\r"):
            assert not (BAR.search(piece) and re.search(STAMP, piece)), piece
    text = "\n".join(lines)
    assert re.search(STAMP + r"start-up: imports [\d.]+ s, ", text)  # cut into lines that fit
    assert re.search(STAMP + r"  .*\([\d.]+ s since the process started\)", text)
    for listing in (dtrain("runs", "--out-dir", str(run_dir.parent)),
                    dtrain("runs", str(run_dir.parent))):
        assert listing.returncode == 0, listing.stderr
        assert [line for line in listing.stdout.splitlines() if len(line) > COLUMNS] == []


def test_the_banner_says_what_runs(tmp_path) -> None:
    """One process wraps the model in nothing, whatever parallel.mode says; two parameter groups
    of the same weight decay are said as one."""
    result = launch(tmp_path / "runs" / "one", ["train.max_steps=2", "parallel.mode=ddp",
                                                "optim.weight_decay=0"])
    assert result.returncode == 0, result.stderr[-3000:]
    banner = unwrapped(result.stderr)
    assert "| backend none | mode none (one process) | precision fp32" in banner
    assert re.search(STAMP + r"optimizer: 15,698 parameters with weight decay 0\n", banner)
    assert "optimizer groups" not in result.stderr
    assert all(len(line) <= COLUMNS for line in result.stderr.replace(str(tmp_path), "T")
               .splitlines())


def test_on_a_tie_both_runs_forms_name_the_earliest_best_checkpoint(terminal_run) -> None:
    """Both epochs reach the same val_acc: the best checkpoint is the first to reach it, in the
    run's record (`dtrain runs`: the checkpoints' own rule, which rotation and `eval --checkpoint
    best` follow) and in the comparison (`dtrain runs DIR`: the records')."""
    run_dir, _ = terminal_run
    evals = [r for r in (run_dir / "metrics.jsonl").read_text().splitlines() if "val_acc" in r]
    assert len(evals) == 2 and len({re.search(r'"val_acc": ([\d.]+)', r)[1] for r in evals}) == 1
    records = dtrain("runs", "--out-dir", str(run_dir.parent)).stdout
    row = next(line for line in records.splitlines() if line.startswith("r "))
    assert "step_000016-epoch_01-" in row, records
    table = dtrain("runs", str(run_dir.parent)).stdout.splitlines()
    at = table[0].split().index("at") - 1  # "at step" is one heading of two words
    assert table[1].split()[at] == "16", table


# -- the command line ------------------------------------------------------------------------

def test_version_is_the_package_s() -> None:
    result = dtrain("--version")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"dtrain {__import__('dtrain').__version__}"


def test_every_option_says_what_it_is_and_epilogs_name_only_options_there_are() -> None:
    for name, (parser, _) in cli._commands().items():
        for action in parser._actions:
            assert action.help, (name, action.option_strings or action.dest)
        options = {o for action in parser._actions for o in action.option_strings}
        mentioned = set(re.findall(r"(--[a-z][a-z-]*)", parser.epilog or ""))
        assert mentioned <= options, (name, mentioned - options)
