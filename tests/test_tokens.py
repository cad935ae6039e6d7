"""Token files (`data.name: tokens`) and memory-mapped text: the files as users bring them
(dtrain tokenize's folder, nanoGPT's without meta.json), the order of a corpus of tens of
millions of windows in O(1) memory, exact resume, memory flat in the corpus size, bad input.
Token folders are written here with numpy, as any tokenizer would write them."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import time
from itertools import islice
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import dtrain, kill_then_resume, latest, launch, start, unwrapped

from dtrain import config
from dtrain.commands.plan import command as plan
from dtrain.config import DataConfig
from dtrain.core.errors import UserError
from dtrain.data import build
from dtrain.data import sampler as sampler_mod
from dtrain.data import windows as windows_mod
from dtrain.data.sampler import ResumableSampler, SeededBijection
from dtrain.data.text import python_docs

VOCAB, SEQ = 500, 32
GPT = f"model.args={{dim: 32, depth: 1, heads: 2, seq_len: {SEQ}}}"
LM = ["task.name=language_model", "model.name=gpt", GPT, "data.batch_size=8", "optim.name=adamw",
      "optim.lr=0.003", "optim.weight_decay=0.0", "ckpt.monitor=val_loss",
      "ckpt.monitor_mode=min", "train.eval_every_epochs=0"]
MiB = 1 << 20


def token_folder(path: Path, train_tokens: int = 20000, val_tokens: int = 3001,
                 meta: bool = True, dtype=np.uint16, seed: int = 0) -> Path:
    """train.bin, val.bin of random ids below VOCAB and (with `meta`) the meta.json that
    dtrain tokenize writes, claiming 3.5 and 4 bytes of text per token."""
    path.mkdir(parents=True, exist_ok=True)
    gen = np.random.default_rng(seed)
    for split, count in (("train", train_tokens), ("val", val_tokens)):
        gen.integers(0, VOCAB, count).astype(dtype).tofile(path / f"{split}.bin")
    if meta:
        (path / "meta.json").write_text(json.dumps({
            "dtype": np.dtype(dtype).name, "vocab_size": VOCAB, "eot_id": 0,
            "tokens": {"train": train_tokens, "val": val_tokens},
            "bytes": {"train": int(train_tokens * 3.5), "val": val_tokens * 4},
            "tokenizer": "tokenizer.json"}))
    return path


def sparse(path: Path, size: int) -> Path:
    """A file of `size` zero bytes that takes no disk (zeros are valid token ids and bytes)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        f.truncate(size)
    return path


def data_config(overrides: list[str]) -> DataConfig:
    return config.load(None, overrides).data


# ---------------------------------------------------------------------------------------------
# The order of a large dataset: a seeded bijection, computed per position


@pytest.mark.parametrize("n", [1, 2, 3, 5, 16, 17, 1000, 4097, 65537, 1 << 20])
def test_seeded_bijection_is_a_permutation_that_changes_with_the_epoch(n) -> None:
    positions = np.arange(n)
    order = SeededBijection(n, seed=3, epoch=0)(positions)
    assert order.dtype == np.int64 and sorted(order.tolist()) == list(range(n))
    assert np.array_equal(order, SeededBijection(n, seed=3, epoch=0)(positions))  # a pure function
    piecewise = np.concatenate([SeededBijection(n, 3, 0)(p) for p in np.array_split(positions, 7)])
    assert np.array_equal(order, piecewise)  # position by position, in any grouping
    if n >= 16:
        assert not np.array_equal(order, SeededBijection(n, seed=3, epoch=1)(positions))
        assert not np.array_equal(order, SeededBijection(n, seed=4, epoch=0)(positions))
        assert not np.array_equal(order, positions)


def reference_order(size: int, rank: int, world: int, drop_last: bool, consumed: int,
                    permutation: list[int]) -> list[int]:
    """What a rank serves with batches of one, written as lists: the rest after `consumed` less
    what does not divide over the ranks (drop_last), or DistributedSampler's padding and the
    rest padded from its start; every world-th from `rank`."""
    order = list(permutation)
    if drop_last:  # what is left after `consumed`, less what does not divide over the ranks
        rest = order[consumed:]
        return rest[:len(rest) - len(rest) % world][rank::world]
    order = order + order[:(-size) % world]
    rest = order[consumed:]
    uneven = len(rest) % world
    if uneven:
        rest = rest + rest[:world - uneven]
    return rest[rank::world][:len(rest) // world]


def test_the_lazy_order_serves_as_the_permutation_order_does(monkeypatch) -> None:
    """Above the threshold the order is the bijection's, served by the same rule (tail, resume
    position, uneven rest) as the permutation's below it; len() says what iterating serves."""
    monkeypatch.setattr(sampler_mod, "LAZY_ORDER_FROM", 1)
    for world in (1, 2, 3, 5):
        for size in (1, 7, 23, 100):
            for drop_last in (True, False):
                permutation = SeededBijection(size, 9, 2)(np.arange(size)).tolist()
                for consumed in range(0, size + 6, 5):
                    for rank in range(world):
                        sampler = ResumableSampler(size, rank, world, seed=9, drop_last=drop_last)
                        sampler.set_epoch(2, consumed)
                        served = list(sampler)
                        assert all(epoch == 2 for epoch, _ in served)
                        assert [i for _, i in served] == reference_order(
                            size, rank, world, drop_last, consumed, permutation)
                        assert len(served) == len(sampler)


def test_small_datasets_keep_distributed_samplers_order() -> None:
    from torch.utils.data import DistributedSampler
    assert sampler_mod.LAZY_ORDER_FROM == 1 << 22  # the documented threshold
    size = 5000
    for rank in range(3):
        ours = ResumableSampler(size, rank, 3, seed=5)
        theirs = DistributedSampler(range(size), 3, rank, shuffle=True, seed=5, drop_last=True)
        ours.set_epoch(4)
        theirs.set_epoch(4)
        assert [i for _, i in ours] == list(theirs)


@pytest.mark.parametrize("before,after", [(2, 1), (2, 3), (4, 2)])
def test_a_resume_onto_another_world_size_continues_the_same_order(before, after) -> None:
    """Rank r's j-th sample is position consumed + r + j * world: interleaving the ranks gives
    the epoch's order back, before and after the resume, whatever the world sizes."""
    size, steps, batch = 50_000_000, 3, 8

    def served(world: int, consumed: int, count: int) -> list[int]:
        ranks = []
        for rank in range(world):
            sampler = ResumableSampler(size, rank, world, seed=11)
            sampler.set_epoch(1, consumed)
            ranks.append([i for _, i in islice(sampler, count)])
        return [ranks[r][j] for j in range(count) for r in range(world)]

    first = served(before, 0, steps * batch)
    consumed = len(first)
    rest = served(after, consumed, steps * batch)
    order = SeededBijection(size, 11, 1)(np.arange(consumed + len(rest))).tolist()
    assert first + rest == order


def rss_anon(pid: int | str = "self") -> int:
    with open(f"/proc/{pid}/status") as f:
        line = next(line for line in f if line.startswith("RssAnon:"))
    return int(line.split()[1]) * 1024


def test_a_sampler_over_50_million_indices_serves_at_once_in_little_memory() -> None:
    size = 50_000_000
    before, began = rss_anon(), time.perf_counter()
    sampler = ResumableSampler(size, rank=1, world_size=2, seed=0)
    sampler.set_epoch(3, consumed=1_000_000)
    batches = list(islice(iter(sampler), 10 * 64))
    took, grown = time.perf_counter() - began, rss_anon() - before
    assert len(sampler) == (size - 1_000_000) // 2
    assert len({i for _, i in batches}) == 640 and all(0 <= i < size for _, i in batches)
    # a materialised order would be 400 MB as a tensor, gigabytes as a list, and take seconds
    assert grown < 16 * MiB, grown / MiB
    assert took < 1.0, took


# ---------------------------------------------------------------------------------------------
# Reading token folders


def test_windows_are_the_files_tokens_read_as_one_sequence(tmp_path) -> None:
    """Shards are one sequence in name order; windows of SEQ + 1 tokens every stride tokens
    cross shard boundaries; token ids come out exactly (uint32 files as int64)."""
    folder = tmp_path / "shards"
    folder.mkdir()
    gen = np.random.default_rng(1)
    train = gen.integers(0, 70000, 1000).astype(np.uint32)
    for k, part in enumerate(np.split(train, [100, 101, 640])):  # one shard of a single token
        part.tofile(folder / f"train_{k:03d}.bin")
    gen.integers(0, 70000, 300).astype(np.uint32).tofile(folder / "val_000.bin")
    (folder / "meta.json").write_text(json.dumps({"dtype": "uint32", "vocab_size": 70000}))
    sets = build(data_config(["data.name=tokens", f"data.root={folder}", "data.tokens.stride=7"]),
                 0, {"seq_len": SEQ})
    assert len(sets.train) == (1000 - (SEQ + 1)) // 7 + 1 and len(sets.val) == (300 - 1) // SEQ
    for index in (0, 13, len(sets.train) - 1):
        window = sets.train[(0, index)]
        assert window.dtype == torch.int64
        assert window.tolist() == train[index * 7:index * 7 + SEQ + 1].tolist()
    batch = sets.train.__getitems__([(0, 2), (0, 90)]).batch
    assert batch.tolist() == [train[14:14 + SEQ + 1].tolist(), train[630:630 + SEQ + 1].tolist()]
    assert sets.info == {"vocab_size": 70000, "seq_len": SEQ, "bytes_per_token": None,
                         "documents": False}


def test_a_folder_of_text_files_is_mapped_as_the_files_joined_by_newlines(tmp_path) -> None:
    """data.name=text reads each file through a memory map with an offset index: the windows are
    those of the files' bytes joined by a newline, as the text source always cut them."""
    corpus = python_docs()
    folder = tmp_path / "texts"
    folder.mkdir()
    # more files than a Span keeps mapped at once, one of them empty
    cuts = [0, 1000, 1000, *range(1100, 40000, 97)]
    pieces = [corpus[a:b] for a, b in zip(cuts, cuts[1:], strict=False)]
    assert len(pieces) > 2 * windows_mod._OPEN_MAPS
    for k, piece in enumerate(pieces):
        (folder / f"{k:04d}.txt").write_bytes(piece)
    joined = b"\n".join(pieces)
    sets = build(data_config(["data.name=text", f"data.root={folder}", "data.text.stride=5"]), 0,
                 {"seq_len": SEQ})
    cut = len(joined) - int(len(joined) * 0.1)
    for index in range(len(sets.train)):
        assert bytes(sets.train[(0, index)].tolist()) == joined[index * 5:index * 5 + SEQ + 1]
    val = sets.val.__getitems__(list(range(len(sets.val)))).batch
    assert val.dtype == torch.uint8 and len(val) == (len(joined) - cut - 1) // SEQ
    for i, window in enumerate(val):
        assert bytes(window.tolist()) == joined[cut + i * SEQ:cut + i * SEQ + SEQ + 1]
    assert sets.info["bytes_per_token"] == 1.0


def test_an_id_outside_the_vocabulary_in_a_loader_worker_is_one_line(tmp_path) -> None:
    """Past the start-up sample, a batch holding a bad id stops the run with the file named,
    raised in the loader worker and re-created in the training process as one line."""
    from torch.utils.data import DataLoader

    from dtrain.data.decode import BadSample
    from dtrain.data.loaders import collate
    folder = token_folder(tmp_path / "tokens")
    sets = build(data_config(["data.name=tokens", f"data.root={folder}"]), 0, {"seq_len": SEQ})
    ids = np.memmap(folder / "train.bin", dtype=np.uint16, mode="r+")
    ids[5 * SEQ + 3] = VOCAB + 7  # in window 5, after the start-up check has passed
    ids.flush()
    loader = DataLoader(sets.train, batch_size=4, sampler=[(0, i) for i in range(8)],
                        num_workers=1, collate_fn=collate)
    with pytest.raises(BadSample) as caught:
        list(loader)
    assert str(caught.value) == (
        f"data error: {folder / 'train.bin'} holds token id {VOCAB + 7} (token {5 * SEQ + 3} of "
        f"the file), not below the vocabulary size {VOCAB}; the vocabulary (meta.json's "
        f"vocab_size or data.tokens.vocab_size) does not fit these files")


def test_plan_counts_windows_of_a_4_gb_corpus_without_reading_it(tmp_path, monkeypatch) -> None:
    folder = tmp_path / "big"
    sparse(folder / "train.bin", 4 << 30)
    sparse(folder / "val.bin", 2 * 10_000)
    (folder / "meta.json").write_text(json.dumps({"dtype": "uint16", "vocab_size": VOCAB}))
    cfg = config.load(None, [*LM, "data.name=tokens", f"data.root={folder}",
                             "data.tokens.stride=16"])

    def no_reading(*args, **kwargs):
        raise AssertionError("dtrain plan mapped a token file")

    monkeypatch.setattr(np, "memmap", no_reading)
    estimate = plan.estimate(cfg, nproc=2)
    assert estimate.train_size == ((2 << 30) - (SEQ + 1)) // 16 + 1
    assert estimate.val_size == (10_000 - 1) // SEQ
    assert estimate.steps_per_epoch == estimate.train_size // 16


# ---------------------------------------------------------------------------------------------
# Real launches


def test_tokens_train_with_the_vocabulary_and_bytes_per_token_of_meta_json(tmp_path) -> None:
    folder = token_folder(tmp_path / "tokens")
    overrides = [*LM, "data.name=tokens", f"data.root={folder}", "train.max_steps=4"]
    result = launch(tmp_path / "runs" / "lm", overrides)  # one process: nothing here is per rank
    assert result.returncode == 0, result.stderr[-3000:]
    windows, val_windows = (20000 - (SEQ + 1)) // SEQ + 1, (3001 - 1) // SEQ
    assert (f"tokens from {folder} (uint16, vocabulary {VOCAB}, from {folder / 'meta.json'}): "
            f"{windows} training windows of {SEQ + 1} tokens (stride {SEQ}), {val_windows} "
            f"validation windows; 4.000 bytes of text per validation token") in unwrapped(result.stderr)
    final = [r for r in result.records() if "val_loss" in r][-1]
    assert final["val_bits_per_byte"] == pytest.approx(final["val_loss"] / math.log(2) / 4.0,
                                                       rel=1e-12)
    assert final["val_perplexity"] == pytest.approx(math.exp(final["val_loss"]), rel=1e-12)
    assert final["val_loss"] < math.log(VOCAB) + 0.5  # random ids: about ln(VOCAB)
    weights = torch.load(latest(result.run_dir) / "checkpoint.pt", weights_only=True)["model"]
    assert weights["head.weight"].shape == (VOCAB, 32)  # the vocabulary came from meta.json
    estimate = plan.estimate(config.load(None, overrides), nproc=2)
    assert (estimate.train_size, estimate.val_size) == (windows, val_windows)


def test_nanogpt_files_without_meta_json_train_with_dtype_and_vocab_size_given(tmp_path) -> None:
    folder = token_folder(tmp_path / "nanogpt", meta=False)
    result = launch(tmp_path / "runs" / "lm", [
        *LM, "data.name=tokens", f"data.root={folder}", "data.tokens.dtype=uint16",
        f"data.tokens.vocab_size={VOCAB}", "train.max_steps=2"])
    assert result.returncode == 0, result.stderr[-3000:]
    assert "from data.tokens.dtype and data.tokens.vocab_size" in result.stderr
    final = [r for r in result.records() if "val_loss" in r][-1]
    assert "val_perplexity" in final and "val_bits_per_byte" not in final


@pytest.mark.slow
def test_tokens_killed_and_resumed_is_bit_exact(tmp_path) -> None:
    folder = token_folder(tmp_path / "tokens")
    slow = [*(o for o in LM if not o.startswith(("model.name", "model.args"))),
            "model.name=user_tasks:slow_gpt", "data.name=tokens", f"data.root={folder}",
            f"model.args={{vocab_size: {VOCAB}, seq_len: {SEQ}, dim: 32, depth: 1, heads: 2}}",
            "train.max_steps=12", "ckpt.every_steps=4"]
    straight = launch(tmp_path / "runs" / "straight", slow, nproc=2)
    assert straight.returncode == 0, straight.stderr[-3000:]
    killed_at, resumed = kill_then_resume(tmp_path / "runs" / "killed", slow, at_step=4)
    assert killed_at < 12
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stderr
    assert resumed.losses() == straight.losses()  # bitwise
    assert sorted(resumed.losses()) == list(range(1, 13))


def served_tokens(cfg):
    """data.name=test_tokens:served_tokens: the token folder's windows, logging each training
    window served (tests/user_code.py's ServedLog)."""
    from user_code import ServedLog

    from dtrain.data import tokens
    sets = tokens.build(cfg, 0)
    return ServedLog(sets.train), sets.val


@pytest.mark.slow
def test_a_resume_onto_another_world_size_serves_the_uninterrupted_order(tmp_path) -> None:
    """Five million windows (stride 1): the lazy order. Two ranks for 4 steps, then one rank
    resumes for 4 more: together they served exactly the first 48 windows of the epoch's order,
    as an uninterrupted run would have."""
    folder = tmp_path / "tokens"
    size = 5_000_000
    sparse(folder / "train.bin", 2 * (size + SEQ))
    token_folder(tmp_path / "val").joinpath("val.bin").rename(folder / "val.bin")
    (folder / "meta.json").write_text(json.dumps({"dtype": "uint16", "vocab_size": VOCAB}))
    first, second = tmp_path / "served1", tmp_path / "served2"
    first.mkdir()
    second.mkdir()
    common = [*(o for o in LM if not o.startswith("model.args")),
              "data.name=test_tokens:served_tokens", f"data.root={folder}",
              f"data.tokens.seq_len={SEQ}", "data.tokens.stride=1",
              f"model.args={{vocab_size: {VOCAB}, seq_len: {SEQ}, dim: 32, depth: 1, heads: 2}}",
              "data.batch_size=4", "ckpt.every_steps=4"]
    run_dir = tmp_path / "runs" / "resize"
    a = launch(run_dir, [*common, "train.max_steps=4"], nproc=2, env={"SERVED_DIR": str(first)})
    assert a.returncode == 0, a.stderr[-3000:]
    b = launch(run_dir, [*common, "train.max_steps=8", "ckpt.resume_config_change=allow"],
               nproc=1, env={"SERVED_DIR": str(second)})
    assert b.returncode == 0, b.stderr[-3000:]
    assert "world size changed from 2 to 1" in (run_dir / "log.txt").read_text()

    def served(path: Path) -> list[int]:
        """Each rank's windows, less the first: window 0, which a user's dataset is asked for
        once at start-up (what it declares about its samples)."""
        lines = [f.read_text().split() for f in sorted(path.glob("rank*.txt"))]
        assert all(rank[0] == "0" for rank in lines)
        return [int(index) for rank in lines for index in rank[1:]]

    seed = config.load(None, []).run.seed
    order = SeededBijection(size, seed, 0)(np.arange(48)).tolist()
    assert size >= sampler_mod.LAZY_ORDER_FROM
    assert sorted(served(first)) == sorted(order[:32])
    assert served(second) == order[32:]


def peak_rss_anon_of_ranks(overrides: list[str], run_dir: Path, env: dict | None = None
                           ) -> list[int]:
    """Run 2 ranks and sample each rank's RssAnon while it runs: the peak of each rank (the
    agent's two children; which is rank 0 does not matter here)."""
    proc = start(run_dir, overrides, nproc=2, env=env)
    peaks: dict[int, int] = {}
    ranks: list[int] = []  # the agent's children, once seen (a rank keeps its process to the end)
    while proc.poll() is None:
        if len(ranks) < 2:
            ranks = sorted(set(ranks) | set(children_of(proc.pid)))[:2]
        for pid in ranks:
            try:
                peaks[pid] = max(peaks.get(pid, 0), rss_anon(pid))
            except (OSError, StopIteration):
                continue  # gone
        time.sleep(0.02)
    assert proc.returncode == 0 and json.loads(
        (latest(run_dir) / "COMPLETE").read_text())["step"] == 20
    assert len(peaks) == 2, peaks
    return sorted(peaks.values())


def children_of(pid: int) -> list[int]:
    """The processes `pid` started (read from /proc/<pid>/task/*/children: quick enough to ask
    every 20 ms)."""
    try:
        return [int(child) for task in Path(f"/proc/{pid}/task").iterdir()
                for child in (task / "children").read_text().split()]
    except OSError:
        return []


@pytest.mark.slow
@pytest.mark.parametrize("source", ["tokens", "text"])
def test_rank_memory_does_not_grow_with_the_corpus(tmp_path, source) -> None:
    """The same run on 40 MB and on 4 GB of training data (sparse files: zeros are valid ids
    and bytes): each rank's anonymous memory grows by at most 64 MiB."""
    peaks = {}
    for size in (40 << 20, 4 << 30):
        folder = tmp_path / f"{source}{size}"
        if source == "tokens":
            sparse(folder / "train.bin", size)
            token_folder(tmp_path / "val").joinpath("val.bin").rename(folder / "val.bin")
            (folder / "meta.json").write_text(json.dumps({"dtype": "uint16", "vocab_size": VOCAB}))
        else:
            sparse(folder / "train.txt", size)
            (folder / "val.txt").write_bytes(python_docs()[:20000])
        overrides = [*LM, f"data.name={source}", f"data.root={folder}", "train.max_steps=20"]
        peaks[size] = peak_rss_anon_of_ranks(overrides, tmp_path / "runs" / f"{source}{size}")
    grown = [big - small for big, small in zip(peaks[4 << 30], peaks[40 << 20], strict=True)]
    assert max(grown) <= 64 * MiB, [g / MiB for g in grown]


@pytest.mark.slow
def test_rank_memory_does_not_grow_with_a_corpus_in_the_store(s3, tmp_path) -> None:
    """Token files in an object store, 8 MB and 128 MB of them: read from the node's copy (one
    rank fetches it while the other waits) and by ranged requests (data.tokens.cache_gib=0),
    each rank's anonymous memory stays within 64 MiB of the small corpus's. (The ranged corpus
    is 16 shards: the test server reads a whole object to serve a range of it.)"""
    from dtrain.data import node_copy

    fs, bucket = s3.fs(), s3.bucket()
    val = token_folder(tmp_path / "val") / "val.bin"
    meta = json.dumps({"dtype": "uint16", "vocab_size": VOCAB}).encode()
    peaks = {}
    for where, shards, cache in (("small", {"train.bin": 8}, 16), ("big", {"train.bin": 128}, 16),
                                 ("ranged", {f"train_{i:03d}.bin": 8 for i in range(16)}, 0)):
        url = f"s3://{bucket}/{where}"
        for name, mb in shards.items():
            fs.put(str(sparse(tmp_path / where / name, mb << 20)), f"{url}/{name}")
        fs.put(str(val), f"{url}/val.bin")
        fs.pipe(f"{url}/meta.json", meta)
        copy = Path(node_copy.folder_for(url))
        overrides = [*LM, "data.name=tokens", f"data.root={url}", f"data.tokens.cache_gib={cache}",
                     "train.max_steps=20"]
        try:
            peaks[where] = peak_rss_anon_of_ranks(overrides, tmp_path / "runs" / where,
                                                  env=s3.env)
            copied = {f.name: f.stat().st_size for f in copy.glob("train*.bin")}
            assert copied == ({n: mb << 20 for n, mb in shards.items()} if cache else {})
        finally:
            shutil.rmtree(copy, ignore_errors=True)
    for where in ("big", "ranged"):
        grown = [big - small for big, small in zip(peaks[where], peaks["small"], strict=True)]
        assert max(grown) <= 64 * MiB, (where, [g / MiB for g in grown])


# ---------------------------------------------------------------------------------------------
# Bad input: one line naming the file or key, exit 2, nothing written


def bad_folders(tmp_path: Path) -> dict[str, tuple[list[str], str]]:
    good = token_folder(tmp_path / "good")
    odd = token_folder(tmp_path / "odd")
    with open(odd / "train.bin", "ab") as f:
        f.write(b"\0")
    no_meta = token_folder(tmp_path / "no_meta", meta=False)
    big_id = token_folder(tmp_path / "big_id")
    ids = np.fromfile(big_id / "val.bin", dtype=np.uint16)
    ids[1234] = VOCAB
    ids.tofile(big_id / "val.bin")
    empty = token_folder(tmp_path / "empty", val_tokens=0)
    short = token_folder(tmp_path / "short", val_tokens=SEQ)
    broken = token_folder(tmp_path / "broken")
    (broken / "meta.json").write_text("{not json")
    nine = tmp_path / "nine.txt"
    nine.write_bytes(b"123456789")
    return {
        "odd size": ([f"data.root={odd}"],
                     f"data error: {odd / 'train.bin'} has 40001 bytes, not a whole number of "
                     f"uint16 tokens (2 bytes each)"),
        "no meta.json": ([f"data.root={no_meta}"],
                         f"data error: {no_meta / 'meta.json'} not found: set data.tokens.dtype"),
        "id >= vocabulary": ([f"data.root={big_id}"],
                             f"data error: {big_id / 'val.bin'} holds token id {VOCAB} (token "
                             f"1234 of the file), not below the vocabulary size {VOCAB}"),
        "empty split": ([f"data.root={empty}"],
                        f"data error: {empty / 'val.bin'} has 0 tokens: 0 window(s) of seq_len + "
                        f"1 = {SEQ + 1}, fewer than one per rank (1)"),
        "shorter than a window": ([f"data.root={short}"],
                                  f"data error: {short / 'val.bin'} has {SEQ} tokens: 0 window(s)"),
        "meta.json not JSON": ([f"data.root={broken}"],
                               f"data error: cannot read {broken / 'meta.json'}: "),
        "model vocabulary too small": ([f"data.root={good}", "model.args={dim: 32, depth: 1, "
                                        f"heads: 2, seq_len: {SEQ}, vocab_size: 100}}"],
                                       "config error: model.args.vocab_size: 100 is smaller than "
                                       f"the data's vocabulary ({VOCAB})"),
        "dtype disagrees with meta.json": ([f"data.root={good}", "data.tokens.dtype=uint32"],
                                           "config error: data.tokens.dtype: 'uint32' disagrees "
                                           f"with {good / 'meta.json'}"),
        "9-byte text": (["data.name=text", f"data.root={nine}"],
                        f"data error: {nine}: the training text has 9 bytes, fewer than one "
                        f"window of seq_len + 1 = {SEQ + 1}"),
        "text window longer than the corpus": (
            ["data.name=text", "data.text.corpus=python_docs", "data.text.seq_len=100000"],
            "data error: data.text.corpus=python_docs: the validation text has 46627 bytes, "
            "fewer than one window of seq_len + 1 = 100001; add text or lower data.text.seq_len"),
    }


CASES = ["odd size", "no meta.json", "id >= vocabulary", "empty split", "shorter than a window",
         "meta.json not JSON", "model vocabulary too small", "dtype disagrees with meta.json",
         "9-byte text", "text window longer than the corpus"]


@pytest.mark.parametrize("case", CASES)
def test_bad_input_is_one_line_and_exit_2(tmp_path, case) -> None:
    overrides, message = bad_folders(tmp_path)[case]
    result = launch(tmp_path / "runs" / "r", [*LM, "data.name=tokens", *overrides])
    assert result.returncode == 2, result.stderr[-3000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"dtrain: {message}"), result.stderr[-3000:]
    assert not (tmp_path / "runs").exists()


@pytest.mark.slow
def test_a_split_shorter_than_one_window_per_rank_stops_every_rank(tmp_path) -> None:
    folder = token_folder(tmp_path / "tokens", val_tokens=SEQ + 1)  # one window, two ranks
    result = launch(tmp_path / "runs" / "r", [*LM, "data.name=tokens", f"data.root={folder}"],
                    nproc=2)
    assert result.returncode != 0 and "exitcode  : 2" in result.stderr
    assert result.stderr.count(
        f"dtrain: data error: {folder / 'val.bin'} has {SEQ + 1} tokens: 1 window(s) of seq_len "
        f"+ 1 = {SEQ + 1}, fewer than one per rank (2)") == 1
    assert not (tmp_path / "runs").exists()


def test_the_shipped_config_takes_its_vocabulary_from_the_token_folder(tmp_path) -> None:
    shipped = config.load("configs/gpt_tokens.yaml", [])
    assert shipped.data.name == "tokens" and "vocab_size" not in shipped.model.args
    folder = token_folder(tmp_path / "tokens", train_tokens=200_000, val_tokens=20_000)
    result = dtrain("plan", "--config", "configs/gpt_tokens.yaml", "--nproc", "2",
                    f"data.root={folder}")
    assert result.returncode == 0, result.stderr
    assert f"windows of {shipped.model.args['seq_len'] + 1} tokens (vocabulary {VOCAB})" \
        in result.stdout


def test_a_folder_of_validation_tokens_alone_builds_for_evaluation(tmp_path: Path) -> None:
    """dtrain eval builds the validation split alone (data.build(val_only=True)): a folder
    without train.bin can be evaluated; training still needs it."""
    from dtrain import data

    whole = token_folder(tmp_path / "whole")
    val_only = token_folder(tmp_path / "val_only")
    (val_only / "train.bin").unlink()
    cfg = data_config(["data.name=tokens", f"data.root={val_only}", "data.tokens.seq_len=64"])
    with pytest.raises(UserError, match=r"no train\.bin \(or train_\*\.bin shards\) in"):
        data.build(cfg, 0)
    built = data.build(cfg, 0, val_only=True)
    full = data.build(dataclasses.replace(cfg, root=str(whole)), 0)
    assert len(built.train) == 0 and len(built.val) == len(full.val) == 3000 // 64
    assert built.info == full.info
    assert all(torch.equal(built.val[i][0], full.val[i][0]) for i in (0, len(full.val) - 1))


def test_text_from_a_device_or_a_pipe_is_refused_unread(tmp_path: Path) -> None:
    import os

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for root in ("/dev/zero", str(fifo)):  # reading either would never end
        cfg = data_config(["data.name=text", f"data.root={root}", "data.text.seq_len=16"])
        with pytest.raises(UserError, match=rf"^data error: '{root}' is neither a file nor a "
                                            rf"folder \(a device, a pipe or a socket\)"):
            build(cfg, 0)
