"""Stragglers and stalls named: a rank slower than the others is named in the log and recorded
(`step_time_max`, `step_time_min`, `slowest_rank`); a balanced run names none; a rank that does
not arrive is named with its step and phase, its stack in its own log (the launch of that is in
test_faults.py)."""

from __future__ import annotations

import logging
import re
import socket
import threading
import time
from pathlib import Path

import pytest

from conftest import Result, launch

STRAGGLER = re.compile(r"straggler: rank (\d+) \(host (\S+)\) step time ([\d.]+)x the median, "
                       r"data wait (\d+) %")
KEYS = ("step_time_max", "step_time_min", "slowest_rank")


class Captured(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture
def captured():
    from dtrain.core.logs import log
    handler, level = Captured(), log.level
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    yield handler.lines
    log.removeHandler(handler)
    log.setLevel(level)


# -- the rule, in process ------------------------------------------------------------------------

def test_a_rank_is_named_after_three_slow_checks_once_per_episode(captured) -> None:
    from dtrain.observe.stragglers import Stragglers
    stragglers = Stragglers(lambda rank: f"h{rank}")
    fast, slow = [0.1, 0.1, 0.1, 0.1, 0.1], [0.1, 0.1, 0.1, 0.21, 0.1]
    for paces in (slow, slow, fast, slow, slow):  # broken by a fast check: no 3 in a row
        stragglers.check(paces, [0.0, 0.0, 0.0, 0.84, 0.0])
    assert captured == []
    for _ in range(4):
        stragglers.check(slow, [0.0, 0.0, 0.0, 0.84, 0.0])
    assert captured == ["straggler: rank 3 (host h3) step time 2.1x the median, data wait 84 %"]
    assert stragglers.figures == {"step_time_max": 0.21, "step_time_min": 0.1, "slowest_rank": 3}
    stragglers.check(fast, [0.0] * 5)
    assert captured[1:] == ["straggler: rank 3 is back to the median step time"]
    for _ in range(3):
        stragglers.check(slow, [0.0] * 5)
    assert len([line for line in captured if "step time 2.1x" in line]) == 2  # a new episode


def test_two_ranks_are_compared_with_each_other_and_tiny_gaps_are_ignored(captured) -> None:
    from dtrain.observe.stragglers import Stragglers
    stragglers = Stragglers(lambda rank: "h")
    for _ in range(3):
        stragglers.check([0.002, 0.006], [0.0, 0.0])  # 3x, but 4 ms: noise on a busy host
    assert captured == []
    for _ in range(3):
        stragglers.check([0.05, 0.2], [0.0, 0.5])
    assert captured == ["straggler: rank 1 (host h) step time 4.0x the median, data wait 50 %"]


def test_a_stalled_rank_answers_with_its_step_phase_and_stack(tmp_path, captured) -> None:
    """Through a real TCP store: the rank publishes its step and phase from a thread, and dumps
    every thread's stack into its log file when a waiting rank asks."""
    from torch.distributed import TCPStore

    from dtrain.core.logs import log
    from dtrain.process import whereabouts

    class State:
        step = 7

    store = TCPStore("127.0.0.1", 0, world_size=1, is_master=True, wait_for_workers=False)
    file_handler = logging.FileHandler(tmp_path / "log.rank1.txt")
    log.addHandler(file_handler)
    alive = threading.Event()
    alive.set()
    try:
        where = whereabouts.Whereabouts(State())
        where.publish(store, 1, alive=alive.is_set, period_s=0.2)
        where.phase = "forward/backward"
        time.sleep(0.5)
        [line] = whereabouts.report(store, [1], wait_s=3.0)
    finally:
        alive.clear()
        log.removeHandler(file_handler)
        file_handler.close()
    assert re.fullmatch(rf"rank 1 \(host {re.escape(socket.gethostname())}\) did not arrive: last "
                        r"step 7 completed, now in forward/backward \(for \d+ s\); its Python "
                        r"stack is in the run directory.s log.rank1.txt", line), line
    dumped = (tmp_path / "log.rank1.txt").read_text()
    assert "asked for its Python stack" in dumped
    assert "test_a_stalled_rank_answers_with_its_step_phase_and_stack" in dumped  # this thread
    assert "in _publish" in dumped  # and the publishing thread: every thread's stack


def test_a_rank_that_never_answers_is_still_named() -> None:
    from torch.distributed import TCPStore

    from dtrain.process import whereabouts
    store = TCPStore("127.0.0.1", 0, world_size=1, is_master=True, wait_for_workers=False)
    store.set("dtrain/where/at/2", "4|data|")
    started = time.monotonic()
    [line] = whereabouts.report(store, [2], wait_s=0.5)
    assert time.monotonic() - started < 2
    assert line == ("rank 2 (host ?) did not arrive: last step 4 completed, now in data; it did "
                    "not answer a request for its stack (its process is gone or stuck)")


# -- real 2-rank runs ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def straggling(tmp_path_factory: pytest.TempPathFactory) -> Result:
    """Rank 1 sleeps 0.1 s in every training forward; rank 0 does not."""
    run_dir = tmp_path_factory.mktemp("stragglers") / "runs" / "slow"
    result = launch(run_dir, ["model.name=observe_models:straggler_cnn",
                              "model.args={width: 8, delay_s: 0.1, slow_rank: 1}",
                              "train.max_steps=8", "log.tensorboard=true"], nproc=2)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


@pytest.mark.slow
def test_a_slow_rank_is_named_once_with_its_host_and_ratio(straggling: Result) -> None:
    log = (straggling.run_dir / "log.txt").read_text()
    named = STRAGGLER.findall(log)
    assert len(named) == 1, log[-3000:]  # once per episode: it stays slow to the end
    rank, host, ratio, wait = named[0]
    assert (rank, host) == ("1", socket.gethostname())
    assert float(ratio) > 1.5 and 0 <= int(wait) <= 100
    assert STRAGGLER.search(straggling.stderr)  # on the console too
    # Named at the third check in a row (one per step here), which comes before step 3's record.
    assert log.index("step 2 |") < log.index("straggler:") < log.index("step 3 |")


@pytest.mark.slow
def test_each_record_has_the_ranks_step_times_and_the_slowest(straggling: Result) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    records = [r for r in straggling.records() if "loss" in r]
    assert [r["step"] for r in records] == list(range(1, 9))
    for record in records:
        assert record["slowest_rank"] == 1, record
        assert record["step_time_max"] >= 0.1 > record["step_time_min"], record
    acc = EventAccumulator(str(straggling.run_dir / "tb"), size_guidance={"scalars": 0})
    acc.Reload()
    for key in KEYS:
        assert [e.step for e in acc.Scalars(f"train/{key}")] == list(range(1, 9)), key
    assert {e.value for e in acc.Scalars("train/slowest_rank")} == {1.0}


@pytest.mark.slow
def test_a_balanced_run_names_no_straggler(tmp_path: Path) -> None:
    """Both ranks sleep 0.05 s in every forward: the same pace, nobody named."""
    result = launch(tmp_path / "runs" / "even", ["model.name=observe_models:slow_cnn",
                                                 "model.args={width: 8, delay_s: 0.05}",
                                                 "train.max_steps=8"], nproc=2)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "straggler" not in (result.run_dir / "log.txt").read_text()
    assert "straggler" not in result.stderr
    records = [r for r in result.records() if "loss" in r]
    assert len(records) == 8 and all(set(KEYS) <= set(r) for r in records)
    assert all(r["slowest_rank"] in (0, 1) and 0.05 <= r["step_time_min"] <= r["step_time_max"]
               for r in records), records
    ratios = sorted(r["step_time_max"] / r["step_time_min"] for r in records)
    assert ratios[len(ratios) // 2] < 1.5, ratios  # a busy host may stretch a step, not most
