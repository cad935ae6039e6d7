"""Records behind the sink interface, in one process (no launch): what metrics.jsonl and
TensorBoard hold, what any other sink receives, and what a resumed run drops."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
from tensorboard.compat.proto.event_pb2 import SessionLog
from tensorboard.plugins.hparams import plugin_data_pb2

from conftest import run_facts
from dtrain.config import flatten, load, to_dict
from dtrain.observe import Record, RunLog, build_sinks, clock, log, setup_logging


class Spy:
    """A sink that keeps what it is given."""

    def __init__(self) -> None:
        self.records: list[Record] = []
        self.hparams_calls: list[tuple[int, dict[str, Any], dict[str, float]]] = []
        self.closed = 0

    def write(self, record: Record) -> None:
        self.records.append(record)

    def hparams(self, step: int, config: Any, final: Any) -> None:
        self.hparams_calls.append((step, dict(config), dict(final)))

    def close(self) -> None:
        self.closed += 1


def feed(run_log: RunLog, steps: range, loss_shift: float = 0.0) -> None:
    """Training steps as the loop reports them: a record at every second step (others reach
    only the console), an evaluation every third step."""
    run_log.progress.start_epoch(0, 100)
    for step in steps:
        record = {"step": step, "epoch": 0, "loss": 2.0 / step + loss_shift, "lr": 0.05,
                  "samples_per_s": 100.0 + step, "grad_norm": 1.5, "step_time_s": 0.01,
                  "data_wait_pct": 3.0, "tokens_per_s": 640.0, "flops_per_s": 1e9, "mfu": 0.25,
                  "skipped_steps": 1}
        logged = step % 2 == 0
        run_log.train(record, {"mem/rss_gb": 0.5 + step} if logged else {}, step, logged)
        if step % 3 == 0:
            run_log.evaluation({"step": step, "epoch": 0, "val_loss": 1.0 / step,
                                "val_acc": 0.1 * step})


def records(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def read_tb(run_dir: Path) -> EventAccumulator:
    acc = EventAccumulator(str(run_dir / "tb"), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return acc


def test_a_custom_sink_gets_exactly_the_records_of_metrics_jsonl(tmp_path: Path) -> None:
    cfg = load(None, ["log.tensorboard=false", "optim.lr=0.05"])
    spy = Spy()
    run_log = RunLog(cfg.log, run_facts(cfg), str(tmp_path), True, 0,
                     sinks=[*build_sinks(cfg.log, run_facts(cfg), str(tmp_path), 0, None), spy])
    feed(run_log, range(1, 7))
    run_log.hparams(6, {"val_loss": 0.5, "best_val_acc": None})
    run_log.close()
    run_log.close()  # a second close (after a failure in the first) must not reach the sinks

    written = records(tmp_path / "metrics.jsonl")
    assert [dict(r.values) for r in spy.records] == written
    assert [(r["step"], "val_loss" in r) for r in written] == [
        (2, False), (3, True), (4, False), (6, False), (6, True)]
    assert [r.kind for r in spy.records] == ["train", "val", "train", "train", "val"]
    # metrics.jsonl keeps the loop's keys in order; dashboard-only scalars stay out of it.
    assert list(written[0]) == ["step", "epoch", "loss", "lr", "samples_per_s", "grad_norm",
                                "step_time_s", "data_wait_pct", "tokens_per_s", "flops_per_s",
                                "mfu", "skipped_steps"]
    assert written[0]["loss"] == 1.0 and written[1] == {"step": 3, "epoch": 0,
                                                        "val_loss": pytest.approx(1 / 3),
                                                        "val_acc": pytest.approx(0.3)}
    assert [dict(r.scalars) for r in spy.records] == [
        {"mem/rss_gb": 2.5}, {}, {"mem/rss_gb": 4.5}, {"mem/rss_gb": 6.5}, {}]
    [(step, config, final)] = spy.hparams_calls
    assert step == 6 and final == {"val_loss": 0.5}  # an unknown best is left out
    assert set(config) == set(flatten(to_dict(cfg))) and config["optim.lr"] == 0.05
    assert all(isinstance(v, (int, float, str, bool)) for v in config.values())
    assert spy.closed == 1


def test_other_ranks_write_nothing_but_log_evaluations(tmp_path: Path) -> None:
    class Lines(logging.Handler):
        def __init__(self) -> None:
            super().__init__()
            self.lines: list[str] = []

        def emit(self, record: logging.LogRecord) -> None:
            self.lines.append(record.getMessage())

    setup_logging(rank=1, all_ranks=False)
    handler = Lines()
    log.addHandler(handler)
    try:
        spy = Spy()
        cfg = load(None, ["log.tensorboard=true"])
        run_log = RunLog(cfg.log, run_facts(cfg), str(tmp_path), False, 0, sinks=[spy])
        feed(run_log, range(1, 7))
        run_log.hparams(6, {"val_loss": 0.5})
        run_log.close()
    finally:
        log.removeHandler(handler)
    assert spy.records == [] and spy.hparams_calls == [] and spy.closed == 0
    assert list(tmp_path.iterdir()) == []
    assert handler.lines == ["step 3 | epoch 0 | val_loss 0.3333 | val_acc 0.3",
                     "step 6 | epoch 0 | val_loss 0.1667 | val_acc 0.6"]


def test_resume_drops_later_records_and_keeps_them_aside(tmp_path: Path) -> None:
    cfg = load(None, ["log.tensorboard=false"])
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "epoch": 0, "loss": 1.0}) + "\n"
                            for s in range(1, 7)) + '{"step": 7, "epo')  # torn by a kill
    aside = tmp_path / "superseded" / "20250101-000000"
    aside.mkdir(parents=True)
    run_log = RunLog(cfg.log, run_facts(cfg), str(tmp_path), True, 3, str(aside))
    assert [r["step"] for r in records(path)] == [1, 2, 3]
    assert [r["step"] for r in records(aside / "metrics.jsonl")] == [4, 5, 6]
    feed(run_log, range(4, 5))
    assert [r["step"] for r in records(path)] == [1, 2, 3, 4]  # on disk before close
    run_log.close()

    # No rewind: the dropped records just go.
    RunLog(cfg.log, run_facts(cfg), str(tmp_path), True, 2).close()
    assert [r["step"] for r in records(path)] == [1, 2]
    assert [r["step"] for r in records(aside / "metrics.jsonl")] == [4, 5, 6]


def test_tensorboard_tags_and_a_resume_that_purges(tmp_path: Path) -> None:
    cfg = load(None, ["log.tensorboard=true"])
    run_log = RunLog(cfg.log, run_facts(cfg), str(tmp_path), True, 0)
    assert not (tmp_path / "tb").exists()  # made at the first record, not before
    feed(run_log, range(1, 7))
    acc = read_tb(tmp_path)  # flushed at every record: readable while the run goes on
    assert [e.step for e in acc.Scalars("train/loss")] == [2, 4, 6]
    run_log.hparams(6, {"val_loss": 1 / 6, "best_val_acc": 0.6})
    run_log.close()

    acc = read_tb(tmp_path)
    train = ["loss", "lr", "grad_norm", "samples_per_s", "step_time_s", "data_wait_pct",
             "tokens_per_s", "flops_per_s", "mfu"]
    assert set(acc.Tags()["scalars"]) == {*(f"train/{k}" for k in train), "mem/rss_gb",
                                          "val/loss", "val/acc", "hparam/val_loss",
                                          "hparam/best_val_acc"}
    assert [(e.step, e.value) for e in acc.Scalars("mem/rss_gb")] == [(2, 2.5), (4, 4.5),
                                                                      (6, 6.5)]
    assert [e.step for e in acc.Scalars("val/acc")] == [3, 6]
    assert acc.Scalars("hparam/best_val_acc")[0].value == pytest.approx(0.6)
    content = acc.PluginTagToContent("hparams")
    start = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/session_start_info"])
    assert start.session_start_info.hparams["parallel.mode"].string_value == cfg.parallel.mode
    assert start.session_start_info.hparams["optim.lr"].number_value == pytest.approx(0.1)
    [first_file] = (tmp_path / "tb").iterdir()

    # A second attempt resumed at step 4 replaces what the first wrote after it.
    run_log = RunLog(cfg.log, run_facts(cfg), str(tmp_path), True, 4)
    feed(run_log, range(5, 7), loss_shift=10.0)
    run_log.close()
    acc = read_tb(tmp_path)
    assert [(e.step, e.value) for e in acc.Scalars("train/loss")] == [
        (2, 1.0), (4, 0.5), (6, pytest.approx(2 / 6 + 10))]
    [second_file] = set((tmp_path / "tb").iterdir()) - {first_file}
    starts = [e.step for e in EventFileLoader(str(second_file)).Load()
              if e.session_log.status == SessionLog.START]
    assert starts == [5]


def test_clock() -> None:
    assert clock(65.9) == "01:05"
    assert clock(3725) == "1:02:05"
    assert clock(65, always_hours=True) == "0:01:05"


def test_a_damaged_metrics_file_is_kept_readable_and_never_stops_a_resume(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Bytes that are not UTF-8, a NUL, a line that is not a record: left out with a warning;
    every readable record up to the resumed step stays, in order."""
    path = tmp_path / "metrics.jsonl"
    good = [json.dumps({"step": s, "epoch": 0, "loss": 1.0}) + "\n" for s in range(1, 6)]
    path.write_bytes("".join(good[:2]).encode() + b"\xff\xfe garbage\n" + good[2].encode()
                     + b"\x00\x00\n" + b"[1, 2]\n" + "".join(good[3:]).encode()
                     + b'{"step": true}\n\x89PNG')
    cfg = load(None, ["log.tensorboard=false"])
    RunLog(cfg.log, run_facts(cfg), str(tmp_path), True, 4).close()
    assert path.read_text(encoding="utf-8") == "".join(good[:4])
    assert [r.getMessage() for r in caplog.records if "cannot be read" in r.getMessage()] == [
        f"{path}: left out 5 line(s) that cannot be read (torn by a kill, or damaged); the "
        f"other records are kept"]
