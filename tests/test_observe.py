"""What a run shows: TensorBoard (read back with TensorBoard's own reader), console output on a
pipe and on a terminal, per-rank log files, the profiler, and curves across a kill-and-resume."""

from __future__ import annotations

import csv
import fcntl
import json
import math
import os
import pty
import re
import signal
import struct
import subprocess
import sys
import termios
import threading
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
from tensorboard.compat.proto.event_pb2 import SessionLog
from tensorboard.plugins.hparams import plugin_data_pb2

import forkserver
from conftest import REPO, TINY, TRAIN, Result, child_env, kill_tree, launch, wait_for_step

TRAIN_TAGS = ["train/loss", "train/lr", "train/grad_norm", "train/samples_per_s",
              "train/step_time_s", "train/data_wait_pct"]
LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d step (\d+) \| epoch \d+ \| (?:loss|lr) ", re.M)


def read_tb(run_dir: Path) -> EventAccumulator:
    acc = EventAccumulator(str(run_dir / "tb"), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return acc


def scalar_steps(acc: EventAccumulator, tag: str) -> list[int]:
    return [event.step for event in acc.Scalars(tag)]


def event_files(run_dir: Path) -> list[Path]:
    return sorted(run_dir.rglob("events.out.tfevents.*"))


# ---------------------------------------------------------------------------------------------
# One 2-rank run with TensorBoard and the profiler on, its output on a pipe (as under SLURM).
# The tests that share it are marked slow: the launch alone takes 10-30 s on two busy cores.

@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> Result:
    run_dir = tmp_path_factory.mktemp("observe") / "runs" / "two"
    result = launch(run_dir, ["log.tensorboard=true", "train.max_steps=8", "train.log_every=2",
                              "train.eval_every_steps=4", "log.every_s=1000",
                              "log.profile.enabled=true", "log.profile.wait=1",
                              "log.profile.warmup=1", "log.profile.active=2"], nproc=2)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


@pytest.mark.slow
def test_tensorboard_has_every_tag_and_matches_metrics(two_ranks: Result) -> None:
    acc = read_tb(two_ranks.run_dir)
    tags = set(acc.Tags()["scalars"])
    assert set(TRAIN_TAGS + ["val/loss", "val/acc", "mem/rss_gb"]) <= tags, tags
    assert "mem/cuda_max_allocated_gb" not in tags  # a CPU run reports its resident memory
    for tag in TRAIN_TAGS + ["mem/rss_gb"]:
        assert scalar_steps(acc, tag) == [2, 4, 6, 8], tag
    assert scalar_steps(acc, "val/acc") == [4, 8]
    losses = two_ranks.losses()
    for event in acc.Scalars("train/loss"):
        assert math.isclose(event.value, losses[event.step], rel_tol=1e-6)
    # Clipping is off: the norm is measured at logged steps, a real positive number.
    assert all(0 < e.value < 100 for e in acc.Scalars("train/grad_norm"))
    assert all(0 <= e.value <= 100 for e in acc.Scalars("train/data_wait_pct"))
    assert all(e.value > 0.05 for e in acc.Scalars("mem/rss_gb"))  # torch alone takes more


@pytest.mark.slow
def test_only_rank_zero_writes_one_event_file(two_ranks: Result) -> None:
    files = event_files(two_ranks.run_dir)
    assert [f.parent for f in files] == [two_ranks.run_dir / "tb"], files  # hparams included


@pytest.mark.slow
def test_hparams_hold_the_resolved_config_and_final_metrics(two_ranks: Result) -> None:
    acc = read_tb(two_ranks.run_dir)
    content = acc.PluginTagToContent("hparams")
    start = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/session_start_info"])
    hparams = start.session_start_info.hparams
    assert hparams["optim.lr"].number_value == pytest.approx(0.05)
    assert hparams["parallel.mode"].string_value == "ddp"
    assert hparams["train.max_steps"].number_value == 8
    experiment = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/experiment"])
    metric_tags = {m.name.tag for m in experiment.experiment.metric_infos}
    assert metric_tags == {"hparam/val_loss", "hparam/val_acc", "hparam/best_val_acc"}
    evals = two_ranks.evals()
    assert acc.Scalars("hparam/val_loss")[0].value == pytest.approx(evals[-1]["val_loss"], rel=1e-6)
    best = max(e["val_acc"] for e in evals)
    assert acc.Scalars("hparam/best_val_acc")[0].value == pytest.approx(best, rel=1e-6)


@pytest.mark.slow
def test_piped_output_is_plain_timestamped_lines(two_ranks: Result) -> None:
    stderr = two_ranks.stderr
    assert "\r" not in two_ranks.output
    assert [int(s) for s in LINE.findall(stderr)] == [2, 4, 6, 8]  # train.log_every=2
    assert "[rank 1]" not in stderr  # log.all_ranks is off: rank 1 writes only its own file
    log0 = (two_ranks.run_dir / "log.txt").read_text()
    assert [int(s) for s in LINE.findall(log0)] == [2, 4, 6, 8]
    log1 = (two_ranks.run_dir / "log.rank1.txt").read_text()
    assert "[rank 1]" in log1 and "val_acc" in log1


@pytest.mark.slow
def test_a_training_line_shows_what_a_person_reads_and_the_record_keeps_the_rest(
        two_ranks: Result) -> None:
    lines = [line for line in two_ranks.stderr.splitlines() if LINE.search(line)]
    assert len(lines) == 4
    for line in lines:
        keys = [part.split(" ")[0] for part in line.split(" | ")[2:]]
        assert keys == ["loss", "lr", "samples_per_s"], line
        assert len(line) < 100, line
    train = [r for r in two_ranks.records() if "loss" in r]
    assert all({"grad_norm", "step_time_s", "data_wait_pct"} <= set(r) for r in train)
    assert any("slowest_rank" in r and "step_time_max" in r for r in train)


@pytest.mark.slow
def test_banner_describes_the_run(two_ranks: Result) -> None:
    stderr = two_ranks.stderr
    assert "torchrun: 1 node(s) x 2 rank(s) = world size 2 | device cpu | backend gloo" in stderr
    assert re.search(r"model simple_cnn: \d+\.\d+ M parameters", stderr)
    assert "effective batch 32 = 16 per rank x 2 rank(s) x 1 accumulation | 16 steps per epoch" in stderr
    assert f"run directory {two_ranks.run_dir} | fresh start" in stderr


@pytest.mark.slow
def test_profiler_writes_a_trace_per_rank_and_one_table(two_ranks: Result) -> None:
    traces = sorted((two_ranks.run_dir / "profile").glob("*.pt.trace.json"))
    assert [t.name.split(".")[0] for t in traces] == ["rank0", "rank1"]
    events = json.loads(traces[0].read_text())["traceEvents"]
    steps = {e["name"] for e in events if e.get("name", "").startswith("ProfilerStep#")}
    assert steps == {"ProfilerStep#2", "ProfilerStep#3"}  # wait 1, warmup 1, active 2
    assert any(e.get("name", "").startswith("aten::") for e in events)
    stderr = two_ranks.stderr
    assert stderr.count("top 10 operators by CPU time of their own") == 1  # rank 0 only
    # Kineto's own "USDT:" lines from rank 1 may land anywhere in the shared stderr.
    lines = [line for line in stderr.split("top 10 operators by CPU time of their own:\n")[1]
             .splitlines() if not line.startswith("USDT:")]
    rules = [i for i, line in enumerate(lines) if line.strip() and set(line) <= {"-", " "}]
    assert "Self CPU" in lines[rules[0] + 1]
    assert len(lines[rules[1] + 1:rules[2]]) == 10


# ---------------------------------------------------------------------------------------------
# Grad norm without clipping, and the two rules for plain lines (steps and seconds); two
# launches, so slow too.

@pytest.fixture(scope="module")
def clip_pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Result, Result]:
    root = tmp_path_factory.mktemp("clip") / "runs"
    common = ["train.max_steps=6", "train.log_every=2"]
    measured = launch(root / "measured", [*common, "log.every_s=0.000001"])
    # This one also asks for a profile of steps 6-8 that a 6-step run never completes.
    clipped = launch(root / "clipped", [*common, "log.every_s=1000", "train.clip_grad_norm=1e6",
                                        "log.profile.enabled=true", "log.profile.wait=4",
                                        "log.profile.warmup=1", "log.profile.active=3"])
    assert measured.returncode == 0, measured.stderr[-3000:]
    assert clipped.returncode == 0, clipped.stderr[-3000:]
    return measured, clipped


@pytest.mark.slow
def test_grad_norm_without_clipping_equals_the_clipping_norm(clip_pair: tuple[Result, Result]) -> None:
    measured, clipped = clip_pair
    norms = {r["step"]: r["grad_norm"] for r in measured.records() if "grad_norm" in r}
    reference = {r["step"]: r["grad_norm"] for r in clipped.records() if "grad_norm" in r}
    assert sorted(norms) == [2, 4, 6]  # measured at logged steps only
    for step, value in norms.items():
        assert value == pytest.approx(reference[step], rel=1e-5)
    assert measured.losses() == pytest.approx(clipped.losses(), rel=1e-6)  # measuring changes nothing


@pytest.mark.slow
def test_plain_lines_every_log_every_steps_or_every_s_seconds(clip_pair: tuple[Result, Result]) -> None:
    measured, clipped = clip_pair
    assert [int(s) for s in LINE.findall(clipped.stderr)] == [2, 4, 6]
    # every_s of a microsecond: each step prints, logged or not.
    assert [int(s) for s in LINE.findall(measured.stderr)] == [1, 2, 3, 4, 5, 6]
    assert "\r" not in measured.output + clipped.output


@pytest.mark.slow
def test_profile_window_past_the_end_is_dropped_with_a_warning(clip_pair: tuple[Result, Result]) -> None:
    _, clipped = clip_pair
    assert "training ended before step 8 of this attempt, inside the profiling window" in clipped.stderr
    assert not (clipped.run_dir / "profile").exists()
    assert "top 10 operators" not in clipped.stderr


# ---------------------------------------------------------------------------------------------

def test_terminal_shows_a_progress_bar(tmp_path: Path) -> None:
    run_dir = tmp_path / "runs" / "tty"
    primary, secondary = pty.openpty()
    fcntl.ioctl(secondary, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    args = [*TINY, "train.log_every=8", f"run.out_dir={run_dir.parent}", f"run.name={run_dir.name}"]
    proc = forkserver.popen([sys.executable, TRAIN, *args], cwd=REPO, env=child_env(),
                            stdin=subprocess.DEVNULL, stdout=secondary, stderr=secondary)
    os.close(secondary)
    chunks: list[bytes] = []

    def drain() -> None:  # the terminal's buffer must be read, or the child blocks writing to it
        while True:
            try:
                data = os.read(primary, 65536)
            except OSError:  # the child closed the terminal
                return
            if not data:
                return
            chunks.append(data)

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    assert proc.wait(timeout=300) == 0
    reader.join(timeout=30)
    os.close(primary)
    out = b"".join(chunks).decode()
    assert "\r" in out
    final = re.search(r"epoch 0 100%\|#+\| 32/32 \[\d\d:\d\d<00:00\] loss \d\.\d{4} lr 0\.05 \d+ samples/s", out)
    assert final, out[-2000:]
    assert [int(s) for s in re.findall(r"\d\d:\d\d:\d\d step (\d+) \| epoch 0 \| loss", out)] == [8, 16, 24, 32]
    # Log lines first erase the bar, so that no line starts in the middle of one.
    assert re.search(r"\r\x1b\[K\d{4}-\d\d-\d\d \d\d:\d\d:\d\d step 8 ", out)


# ---------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_kill_and_resume_continues_curves_without_duplicates(tmp_path: Path) -> None:
    run_dir = tmp_path / "runs" / "killed"
    overrides = ["model.name=observe_models:slow_cnn", "model.num_classes=10",
                 "model.args={width: 8, delay_s: 0.15}", "log.tensorboard=true",
                 "train.epochs=2", "train.max_steps=24", "ckpt.every_steps=6",
                 "train.eval_every_epochs=0"]
    args = [*TINY, *overrides, f"run.out_dir={run_dir.parent}", f"run.name={run_dir.name}"]
    # One process: the curves are rank 0's alone, so a single-process run shows the same
    # kill-and-resume as a 2-rank one, for half the start-up.
    first = forkserver.popen([sys.executable, TRAIN, *args], cwd=REPO, env=child_env(),
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for_step(run_dir / "metrics.jsonl", 10, first, timeout=240)
    finally:
        kill_tree(first.pid, signal.SIGKILL)  # no chance to clean up
        first.wait(timeout=60)
    killed_files = event_files(run_dir)
    assert len(killed_files) == 1
    killed_steps = [e.step for e in EventFileLoader(str(killed_files[0])).Load()
                    if e.summary.value and e.summary.value[0].tag == "train/loss"]
    with open(run_dir.parent / "runs.csv", newline="") as f:
        (killed_row,) = list(csv.DictReader(f))
    assert killed_row["status"] == "running"  # a killed run cannot write its end

    second = launch(run_dir, overrides)
    assert second.returncode == 0, second.stderr[-3000:]
    resumed = int(re.search(r"resumed from \S+ \(step (\d+),", second.stderr).group(1))
    assert resumed % 6 == 0 and max(killed_steps) > resumed  # events past the checkpoint to purge

    acc = read_tb(run_dir)
    steps = scalar_steps(acc, "train/loss")
    assert steps == list(range(1, 25))  # each step once, in order
    losses = second.losses()  # metrics.jsonl, trimmed on resume the same way
    assert sorted(losses) == steps
    for event in acc.Scalars("train/loss"):
        assert math.isclose(event.value, losses[event.step], rel_tol=1e-6)
    # The mechanism: the resumed attempt's event file opens with a restart marker at resumed+1.
    new_file = [f for f in event_files(run_dir) if f not in killed_files]
    assert len(new_file) == 1
    starts = [e.step for e in EventFileLoader(str(new_file[0])).Load()
              if e.session_log.status == SessionLog.START]
    assert starts == [resumed + 1]
    with open(run_dir.parent / "runs.csv", newline="") as f:
        (row,) = list(csv.DictReader(f))
    assert (row["status"], row["attempts"], row["step"]) == ("finished", "2", "24")
    assert row["started"] == killed_row["started"]
    assert float(row["wall_time_s"]) > float(killed_row["wall_time_s"])
