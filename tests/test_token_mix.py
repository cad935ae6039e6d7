"""Mixing token folders (`data.tokens.mix`): each source's share at every position and in a
real 2-rank run, the same losses twice, a resume that continues bit for bit (and onto one rank
within 1e-5), validation loss per source equal to an evaluation of that source alone, and one
line for each bad config. The two sources' token ids are disjoint ranges, so that a window
shows which source it came from."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import REPO, child_env, forkserver, launch

from dtrain import config, tasks
from dtrain.commands.plan import command as plan
from dtrain.config.data import MIX_PERIOD
from dtrain.core.errors import UserError
from dtrain.data import build
from dtrain.data.mix import Interleave, MixedWindows
from dtrain.models import GPT

VOCAB, SEQ, SPLIT = 500, 32, 250  # source A's ids are below SPLIT, B's from SPLIT on
GPT_ARGS = f"model.args={{vocab_size: {VOCAB}, seq_len: {SEQ}, dim: 32, depth: 1, heads: 2}}"
LM = ["task.name=language_model", "model.name=test_token_mix:logged_gpt", GPT_ARGS,
      "data.batch_size=8", "optim.name=adamw", "optim.lr=0.003", "optim.weight_decay=0.0",
      "ckpt.monitor=val_loss", "ckpt.monitor_mode=min",
      "data.name=tokens", "train.eval_every_epochs=0", "train.eval_every_steps=8",
      "ckpt.every_steps=4", "ckpt.keep_last=10", "train.epochs=2"]
WEIGHTS = (0.7, 0.3)


class LoggedGPT(GPT):
    """A GPT that writes, for each training micro-batch, how many of its windows came from
    source A and from B to $SERVED_DIR/rank<RANK>.txt."""

    def forward(self, tokens):  # type: ignore[override]
        if self.training and "SERVED_DIR" in os.environ:
            from_a = int((tokens[:, 0] < SPLIT).sum())
            path = Path(os.environ["SERVED_DIR"]) / f"rank{os.environ.get('RANK', '0')}.txt"
            with open(path, "a") as f:
                f.write(f"{from_a} {len(tokens) - from_a}\n")
        return super().forward(tokens)


def logged_gpt(cfg) -> GPT:
    return LoggedGPT(**cfg.args)


def folder(path: Path, low: int, high: int, train: int, val: int, vocab: int = VOCAB,
           mask: bool = False) -> Path:
    """A token folder of random ids in [low, high), with dtrain tokenize's meta.json."""
    path.mkdir(parents=True, exist_ok=True)
    gen = np.random.default_rng(low)
    for split, count in (("train", train), ("val", val)):
        gen.integers(low, high, count).astype(np.uint16).tofile(path / f"{split}.bin")
        if mask:
            np.ones(count, dtype=np.uint8).tofile(path / f"{split}.mask")
    (path / "meta.json").write_text(json.dumps({
        "dtype": "uint16", "vocab_size": vocab, "tokens": {"train": train, "val": val},
        "bytes": {"train": train * 4, "val": val * 4}}))
    return path


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("mix")
    # 93 and 46 training windows: an epoch of 139 samples, 8 steps of 16 on 2 ranks
    return (folder(root / "books", 0, SPLIT, 3000, 1100),
            folder(root / "code", SPLIT, VOCAB, 1500, 700))


def mix_of(sources, *extra: str) -> str:
    a, b = sources
    entries = [f"{{root: {a}, weight: {WEIGHTS[0]}}}", f"{{root: {b}, weight: {WEIGHTS[1]}}}",
               *extra]
    return f"data.tokens.mix=[{', '.join(entries)}]"


# ---------------------------------------------------------------------------------------------
# The interleave


@pytest.mark.parametrize("weights", [(0.7, 0.3), (1, 1, 1), (5, 3, 1, 0.2, 0.01), (0.001, 9)])
def test_every_source_is_within_one_sample_of_its_share_at_every_position(weights) -> None:
    interleave = Interleave(weights)
    shares = interleave.quotas / MIX_PERIOD
    assert interleave.quotas.sum() == MIX_PERIOD
    assert np.abs(shares - np.asarray(weights) / sum(weights)).max() <= 1 / MIX_PERIOD
    positions = np.arange(1, 3 * MIX_PERIOD)
    for s, share in enumerate(shares):
        drawn = interleave.drawn_before(positions, np.full_like(positions, s))
        assert np.abs(drawn - share * positions).max() < 1
        # so within ±0.5 % of the weight from 200 samples on
        assert np.abs(drawn / positions - share)[positions >= 200].max() < 0.005


def test_the_order_is_a_pure_function_of_seed_epoch_and_position(sources) -> None:
    cfg = config.load(None, [*LM, mix_of(sources), f"data.tokens.seq_len={SEQ}"]).data
    train = build(cfg, 7).train
    assert isinstance(train, MixedWindows) and len(train) == 93 + 46
    keys = [(epoch, p) for epoch in range(3) for p in range(len(train))]
    which, windows = train.locate(keys)
    again = MixedWindows(train.sources, WEIGHTS, 7).locate(keys[::-1])
    assert (again[0][::-1] == which).all() and (again[1][::-1] == windows).all()
    # each source's draws run through a permutation of its windows, then a fresh one
    for s, size in ((0, 93), (1, 46)):
        drawn = windows[which == s]
        for start in range(0, len(drawn) - size, size):
            assert sorted(drawn[start:start + size]) == list(range(size))
        assert list(drawn[:size]) != list(drawn[size:2 * size])
    # the windows served are the source's: A's ids below SPLIT, B's from it
    batch = train.__getitems__(keys[:64]).batch
    assert ((batch[:, 0] < SPLIT).numpy() == (which[:64] == 0)).all()
    assert MixedWindows(train.sources, WEIGHTS, 8).locate(keys)[1].tolist() != windows.tolist()


@pytest.mark.parametrize("weights, quotas", [(("7e-1", "3e-1"), [7000, 3000]),
                                             (("1.0e+308", "1.0e+308"), [5000, 5000])])
def test_weights_written_as_exponents_or_too_large_to_add_up_mix_by_their_ratio(
        sources, weights, quotas) -> None:
    """`7e-1` (text to YAML 1.1) is 0.7 as for any other number; two weights of 1e308, whose
    total overflows, are half and half."""
    a, b = sources
    mix = (f"data.tokens.mix=[{{root: {a}, weight: {weights[0]}}}, "
           f"{{root: {b}, weight: {weights[1]}}}]")
    train = build(config.load(None, [*LM, mix, f"data.tokens.seq_len={SEQ}"]).data, 0).train
    assert isinstance(train, MixedWindows)
    assert train.interleave.quotas.tolist() == quotas


def test_plan_counts_the_windows_of_every_source(sources) -> None:
    estimate = plan.estimate(config.load(None, [*LM, mix_of(sources)]), nproc=2)
    assert (estimate.train_size, estimate.val_size) == (93 + 46, (1100 - 1) // SEQ + 21)


def test_a_sources_validation_loss_can_pick_the_best_checkpoint(sources) -> None:
    cfg = config.load(None, [*LM, mix_of(sources), "ckpt.monitor=val_loss_code"])
    assert cfg.ckpt.monitor == "val_loss_code"
    with pytest.raises(UserError, match="did you mean 'val_loss_code'"):
        config.load(None, [*LM, mix_of(sources), "ckpt.monitor=val_loss_cod"])


@pytest.mark.parametrize("masked", [False, True])
def test_the_loss_per_source_is_each_sources_own_computed_by_hand(tmp_path, masked) -> None:
    """The task over the mix's validation windows gives, per source, what it gives over that
    source's windows alone; with loss masks too (half the targets counted)."""
    roots = [folder(tmp_path / "a", 0, SPLIT, 3000, 1100, mask=masked),
             folder(tmp_path / "b", SPLIT, VOCAB, 1500, 700, mask=masked)]
    if masked:
        for root in roots:
            for split in ("train", "val"):
                path = root / f"{split}.mask"
                (np.arange(path.stat().st_size) % 2).astype(np.uint8).tofile(path)
    mix = f"data.tokens.mix=[{{root: {roots[0]}, weight: 2}}, {{root: {roots[1]}, weight: 1}}]"
    cfg = config.load(None, [*LM, mix, f"data.tokens.seq_len={SEQ}"])
    sets = build(cfg.data, 0)
    task = tasks.build(cfg.task, sets.info)
    model = GPT(vocab_size=VOCAB, seq_len=SEQ, dim=32, depth=1, heads=2).eval()

    def means(dataset) -> dict[str, float]:
        values = task.metrics(model, dataset.__getitems__(list(range(len(dataset)))).batch)
        averaged = {k: float(v.double().mean()) for k, v in values.items()}
        return {**averaged, **task.summarize(dict(averaged))}

    with torch.no_grad():
        mixed = means(sets.val)
        for name, root in zip(("a", "b"), roots, strict=True):
            alone = build(config.load(None, [*LM, f"data.root={root}",
                                             f"data.tokens.seq_len={SEQ}"]).data, 0)
            assert mixed[f"loss_{name}"] == pytest.approx(means(alone.val)["loss"], rel=1e-6)
    assert isinstance(sets.train.__getitems__([(0, 0), (0, 1)]).batch, tuple) == masked


# ---------------------------------------------------------------------------------------------
# Real runs


def served(folder: Path) -> list[tuple[int, int]]:
    """Per step, the windows of A and of B the ranks trained on together."""
    ranks = [[tuple(map(int, line.split())) for line in p.read_text().splitlines()]
             for p in sorted(folder.glob("rank*.txt"))]
    return [(sum(r[i][0] for r in ranks), sum(r[i][1] for r in ranks))
            for i in range(len(ranks[0]))]


@pytest.fixture(scope="module")
def runs(sources, tmp_path_factory):
    """16 steps on 2 ranks straight; 8 steps, then resumed to 16 on 2 ranks; the same 8 steps
    resumed to 16 on one rank with twice the batch."""
    root = tmp_path_factory.mktemp("runs")
    common = [*LM, mix_of(sources)]
    logs = {name: root / f"served_{name}" for name in ("straight", "halves", "one")}
    for log in logs.values():
        log.mkdir()
    straight = launch(root / "straight", [*common, "train.max_steps=16"], nproc=2,
                      env={"SERVED_DIR": str(logs["straight"])})
    first = launch(root / "halves", [*common, "train.max_steps=8"], nproc=2,
                   env={"SERVED_DIR": str(logs["halves"])})
    assert first.returncode == 0, first.stderr[-3000:]
    first_losses = first.losses()  # before the resume adds its records to the same file
    shutil.copytree(root / "halves", root / "one")
    second = launch(root / "halves", [*common, "train.max_steps=16"], nproc=2,
                    env={"SERVED_DIR": str(logs["halves"])})
    one = launch(root / "one", [*common, "train.max_steps=16", "data.batch_size=16",
                                "ckpt.resume_config_change=allow"],
                 env={"SERVED_DIR": str(logs["one"])})
    return {"straight": straight, "first": first_losses, "halves": second, "one": one,
            "logs": logs}


def test_a_real_run_keeps_every_sources_share_at_every_checkpoint(runs) -> None:
    """Each epoch's positions are drawn in the interleave's order from its start (128 of the
    139 positions fit whole steps): source A's windows after each checkpoint's steps are the
    interleave's count, within one sample of 70 % per epoch begun."""
    straight = runs["straight"]
    assert straight.returncode == 0, straight.stderr[-3000:]
    assert "data: mix of books (70 %, 93 windows), code (30 %, 46 windows)" in straight.stderr
    steps = served(runs["logs"]["straight"])
    assert len(steps) == 16 and all(sum(step) == 16 for step in steps)
    interleave = Interleave(WEIGHTS)
    for step in (4, 8, 12, 16):
        assert any((straight.run_dir / "checkpoints").glob(f"step_{step:06d}-*"))
        epochs = [min(16 * step, 128)] + ([16 * (step - 8)] if step > 8 else [])
        expected = sum(int(interleave.drawn_before(np.array([n]), np.array([0]))[0])
                       for n in epochs)
        drawn_a = sum(s[0] for s in steps[:step])
        assert drawn_a == expected
        assert abs(drawn_a - 0.7 * 16 * step) < len(epochs)


def test_the_same_run_twice_and_a_resume_give_the_same_losses_bit_for_bit(runs) -> None:
    straight, first, halves = runs["straight"], runs["first"], runs["halves"]
    assert halves.returncode == 0, halves.stderr[-3000:]
    assert "resumed from" in halves.stderr
    losses = straight.losses()
    assert sorted(losses) == list(range(1, 17))
    assert first == {s: losses[s] for s in range(1, 9)}  # a second run: the same
    assert halves.losses() == losses
    assert served(runs["logs"]["halves"]) == served(runs["logs"]["straight"])


def test_a_resume_onto_one_rank_continues_within_1e_5(runs) -> None:
    one, straight = runs["one"], runs["straight"]
    assert one.returncode == 0, one.stderr[-3000:]
    assert "world size changed from 2 to 1" in (one.run_dir / "log.txt").read_text()
    expected = straight.losses()
    for step, loss in one.losses().items():
        assert loss == pytest.approx(expected[step], abs=1e-5), step
    assert served(runs["logs"]["one"]) == served(runs["logs"]["straight"])[8:]


def test_validation_loss_per_source_equals_each_source_evaluated_alone(runs, sources) -> None:
    straight = runs["straight"]
    final = [r for r in straight.records() if "val_loss" in r][-1]
    assert final["step"] == 16
    val_windows = {"books": (1100 - 1) // SEQ, "code": (700 - 1) // SEQ}
    total = sum(val_windows.values())
    for name, root in zip(("books", "code"), sources, strict=True):
        assert final[f"val_share_{name}"] == pytest.approx(val_windows[name] / total, rel=1e-12)
        evals = straight.run_dir / "evals"
        before = set(evals.glob("*.json"))
        command = [sys.executable, "-m", "dtrain", "eval", "--run", str(straight.run_dir), "--trust-remote-code",
                   "data.tokens.mix=null", f"data.root={root}"]
        proc = forkserver.run(command, cwd=REPO, env=child_env(), timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        (new,) = set(evals.glob("*.json")) - before
        alone = json.loads(new.read_text())
        assert str(root) == alone["data"]["root"]
        assert final[f"val_loss_{name}"] == pytest.approx(alone["val_loss"], rel=1e-6)
    overall = sum(final[f"val_loss_{n}"] * w for n, w in val_windows.items()) / total
    assert final["val_loss"] == pytest.approx(overall, rel=1e-9)


def test_a_source_in_an_object_store_mixes_as_its_local_copy(s3, sources, runs, tmp_path) -> None:
    """The code folder read from the store: the same 8 steps as the local mix's run."""
    from dtrain.data import node_copy

    fs, bucket = s3.fs(), s3.bucket()
    a, b = sources
    url = f"s3://{bucket}/code"
    for name in ("train.bin", "val.bin", "meta.json"):
        fs.put(str(b / name), f"{url}/{name}")
    mix = f"data.tokens.mix=[{{root: {a}, weight: 0.7}}, {{root: {url}, weight: 0.3}}]"
    try:
        stored = launch(tmp_path / "runs" / "s3", [*LM, mix, "train.max_steps=8"], nproc=2,
                        env=s3.env)
    finally:
        shutil.rmtree(node_copy.folder_for(url), ignore_errors=True)
    assert stored.returncode == 0, stored.stderr[-3000:]
    assert stored.losses() == runs["first"]
    final = [r for r in stored.records() if "val_loss" in r][-1]
    local = [r for r in runs["straight"].records() if r.get("step") == 8 and "val_loss" in r][0]
    assert final["val_loss_code"] == local["val_loss_code"]


# ---------------------------------------------------------------------------------------------
# Bad configs


def bad_cases(sources: tuple[Path, Path], root: Path) -> dict[str, tuple[list[str], str]]:
    a, b = sources
    other_vocab = folder(root / "wide", 0, 100, 3000, 1100, vocab=1000)
    masked = folder(root / "masked", 0, 100, 3000, 1100, mask=True)
    return {
        "with data.root": ([mix_of(sources), f"data.root={a}"],
                           f"config error: data.root ({a}) and data.tokens.mix both name"),
        "empty": (["data.tokens.mix=[]"], "config error: data.tokens.mix: an empty list"),
        "not tokens": ([mix_of(sources), "data.name=text"],
                       "config error: data.tokens.mix: mixes token folders"),
        "no weight": ([f"data.tokens.mix=[{{root: {a}}}]"],
                      "config error: data.tokens.mix[0].weight: missing"),
        "negative": ([mix_of(sources, f"{{root: {b}, weight: -1, name: c2}}")],
                     "config error: data.tokens.mix[2].weight: must be a finite number > 0"),
        "tiny": ([mix_of(sources, f"{{root: {b}, weight: 0.00001, name: c2}}")],
                 "config error: data.tokens.mix[2].weight: 1e-05 is less than 1/10000"),
        "same name": ([mix_of(sources, f"{{root: {b}, weight: 1}}")],
                      "config error: data.tokens.mix[2].name: 'code' names "
                      "data.tokens.mix[1] too; give each source its own name: {root: FOLDER, "
                      "weight: NUMBER, name: NAME}"),
        "unknown key": ([f"data.tokens.mix=[{{root: {a}, wieght: 1}}]"],
                        "config error: unknown key 'data.tokens.mix[0].wieght' (did you mean "
                        "'weight'?)"),
        "vocabulary": ([mix_of(sources, f"{{root: {other_vocab}, weight: 1}}")],
                       f"config error: data.tokens.mix[2].root: {other_vocab} has vocabulary "
                       f"1000, {a} (mix[0]) 500"),
        "masks": ([mix_of(sources, f"{{root: {masked}, weight: 1}}")],
                  f"config error: data.tokens.mix[2].root: {masked}: {masked} has loss masks"),
        "missing folder": ([mix_of(sources, f"{{root: {root / 'nowhere'}, weight: 1}}")],
                           f"data error: token folder not found at '{root / 'nowhere'}'"),
    }


@pytest.mark.parametrize("case", ["with data.root", "empty", "not tokens", "no weight",
                                  "negative", "tiny", "same name", "unknown key", "vocabulary",
                                  "masks", "missing folder"])
def test_a_bad_mix_is_one_line_and_exit_2(sources, tmp_path, case) -> None:
    overrides, message = bad_cases(sources, tmp_path)[case]
    overrides = [*LM, *overrides]
    try:
        config.load(None, overrides)
    except UserError as e:
        assert str(e).startswith(message), e
        return
    result = launch(tmp_path / "runs" / "r", overrides)
    assert result.returncode == 2, result.stderr[-3000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"dtrain: {message}"), result.stderr[-3000:]
    assert not (tmp_path / "runs").exists()


def test_config_errors_exit_2_through_the_launcher(sources, tmp_path) -> None:
    overrides, message = bad_cases(sources, tmp_path)["negative"]
    result = launch(tmp_path / "runs" / "r", [*LM, *overrides])
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr.strip() == f"dtrain: {message}, got -1"
