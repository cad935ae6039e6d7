"""Which samples an epoch consumes when the world size changes in its middle (data.drop_last=true,
the default).

The rule: every position of the epoch's order is consumed at most once; whole steps go on while
the rest of the epoch fills them; of the part step left over, what a fresh epoch at the new world
size would drop (size mod (ranks x batch)) is dropped and anything beyond it is kept as one short
last step. So an epoch never drops more than a fresh epoch at the world size that finishes it.

Runs: one process stopped by train.max_steps mid-epoch, resumed by torchrun on two ranks (and the
reverse), on a user dataset that writes what each process served, in order; checked against the
epoch's order (torch.randperm seeded with run.seed + epoch, docs/data.md).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from conftest import Result, launch
from dtrain.data.sampler import ResumableSampler

SIZE, BATCH, SEED = 196, 8, 3  # a fresh epoch: 24 steps on one rank, 12 on two (4 dropped by each)
JOB = [f"data.synthetic.train_size={SIZE}", f"data.batch_size={BATCH}", f"run.seed={SEED}",
       "data.name=user_code:attempt_served_synthetic", "train.epochs=2", "ckpt.every_epochs=0",
       "train.eval_every_epochs=0"]


def order(epoch: int) -> list[int]:
    return torch.randperm(SIZE, generator=torch.Generator().manual_seed(SEED + epoch)).tolist()


def served(folder: Path) -> list[dict[int, list[int]]]:
    """What each attempt served, by rank, in order (files named <start ns>.<host>.ws<W>.rank<R>)."""
    files = sorted(folder.glob("*.txt"), key=lambda f: int(f.name.split(".")[0]))
    attempts: list[dict[int, list[int]]] = []
    while files:
        world = int(re.search(r"\.ws(\d+)\.", files[0].name).group(1))
        group, files = files[:world], files[world:]
        attempts.append({int(re.search(r"\.rank(\d+)\.", f.name).group(1)):
                         [int(x) for x in f.read_text().split()] for f in group})
    return attempts


def run_across(tmp_path: Path, before: int, after: int, steps: int) -> tuple[Result, list]:
    """`steps` steps on `before` ranks (stopped by train.max_steps, a checkpoint at the stop),
    then the run resumed on `after` ranks to the end of epoch 2."""
    run_dir, folder = tmp_path / "runs" / "run", tmp_path / "served"
    folder.mkdir()
    env = {"SERVED_DIR": str(folder)}
    first = launch(run_dir, [*JOB, f"train.max_steps={steps}"], nproc=before if before > 1 else 0,
                   env=env)
    assert first.returncode == 0, first.stderr[-3000:]
    second = launch(run_dir, JOB, nproc=after if after > 1 else 0, env=env)
    assert second.returncode == 0, second.stderr[-3000:]
    assert f"world size changed from {before} to {after}" in second.stderr, second.stderr[-3000:]
    return second, served(folder)


@pytest.fixture(scope="module")
def one_to_two(tmp_path_factory) -> tuple[Result, list]:
    return run_across(tmp_path_factory.mktemp("one_to_two"), 1, 2, steps=5)


@pytest.fixture(scope="module")
def two_to_one(tmp_path_factory) -> tuple[Result, list]:
    return run_across(tmp_path_factory.mktemp("two_to_one"), 2, 1, steps=3)


def test_one_rank_to_two_keeps_the_part_step_the_change_left(one_to_two) -> None:
    """5 steps on one rank consume positions 0-39 of epoch 0. Two ranks then share 40-195: 9
    whole steps (144), and 12 left over, of which a fresh two-rank epoch drops 4 (196 mod 16):
    the other 8 are a short last step of 4 a rank. Epoch 1 is a fresh two-rank epoch."""
    result, attempts = one_to_two
    assert [sorted(a) for a in attempts] == [[0], [0, 1]]
    zero, one = order(0), order(1)
    assert attempts[0][0] == zero[:40]
    for rank in (0, 1):
        got = attempts[1][rank]
        assert got[:76] == zero[40 + rank:192:2], rank  # 9 batches of 8 and one of 4
        assert got[76:] == one[rank:192:2], rank  # 12 batches of 8
    consumed = attempts[0][0] + attempts[1][0][:76] + attempts[1][1][:76]
    assert sorted(consumed) == sorted(zero[:192])  # each once; only a fresh epoch's 4 dropped
    # one history (both attempts write the run's metrics.jsonl): 5 steps, 10 to the end of
    # epoch 0, 12 in epoch 1, each once
    assert [r["step"] for r in result.records() if "loss" in r] == list(range(1, 5 + 10 + 12 + 1))


def test_two_ranks_to_one_consumes_what_a_fresh_epoch_does(two_to_one) -> None:
    """3 steps on two ranks consume positions 0-47; one rank takes 48-191 in 18 steps (the 4
    left are what a fresh one-rank epoch drops too), then a fresh epoch of 24 steps."""
    result, attempts = two_to_one
    assert [sorted(a) for a in attempts] == [[0, 1], [0]]
    zero, one = order(0), order(1)
    for rank in (0, 1):
        assert attempts[0][rank] == zero[rank:48:2]
    assert attempts[1][0] == zero[48:192] + one[:192]
    assert [r["step"] for r in result.records() if "loss" in r] == list(range(1, 3 + 18 + 24 + 1))


# ---------------------------------------------------------------------------------------------
# The rule, for every small case

def share(size: int, world: int, batch: int, consumed: int) -> list[list[int]]:
    """The positions each rank serves after `consumed` (shuffle off: index = position)."""
    ranks = []
    for rank in range(world):
        sampler = ResumableSampler(size, rank, world, 0, shuffle=False, batch_size=batch)
        sampler.set_epoch(1, consumed)
        got = [index for _, index in sampler]
        assert len(got) == len(sampler)
        ranks.append(got)
    return ranks


def test_a_changed_world_size_drops_no_more_than_a_fresh_epoch() -> None:
    for size in range(1, 70):
        for before in (1, 2, 3):
            for world in (1, 2, 3, 4):
                for batch in (1, 2, 3, 8):
                    for steps in range(0, size // (before * batch) + 1):
                        consumed = steps * before * batch
                        case = (size, before, world, batch, consumed)
                        ranks = share(size, world, batch, consumed)
                        # every rank runs the same number of batches (collectives line up)
                        assert len({-(-len(r) // batch) for r in ranks}) == 1, case
                        # step k takes the k-th block of world x batch positions; all positions
                        # served make one run from `consumed` on, none twice
                        step_of = {}
                        for r in ranks:
                            for j, position in enumerate(r):
                                step_of[position] = j // batch
                        kept = sorted(step_of)
                        assert kept == list(range(consumed, consumed + len(kept))), case
                        assert sum(map(len, ranks)) == len(kept), case
                        for position, step in step_of.items():
                            assert (position - consumed) // (world * batch) == step, case
                        rest, step = size - consumed, world * batch
                        fresh_drop = size % step
                        dropped = rest - len(kept)
                        if (rest - min(rest % step, fresh_drop)) % step in range(1, world):
                            # a part step of fewer samples than ranks cannot give each a batch
                            assert dropped == rest % step < world + fresh_drop, case
                        else:
                            assert dropped == min(rest % step, fresh_drop), case
                        if consumed % step == 0:  # no change: exactly a fresh epoch's tail
                            assert len(kept) % step == 0 and dropped == fresh_drop, case
