"""Experiment trackers (MLflow, W&B offline) as sinks: one tracker run per dtrain run across
kills and resumes, each step sent once with metrics.jsonl's values, a tracker that fails or
hangs never stopping the run, and a missing library refused before anything starts."""

from __future__ import annotations

import json
import logging
import struct
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import Result, kill_when, launch, run_facts, saved_step, start

from dtrain.config import Config, load
from dtrain.observe import JsonlSink, Record, RunLog, log, setup_logging, trackers
from dtrain.observe.trackers import CLOSE_WAIT_S, RunInfo, StateFile, TrackerSink

# No tracker may try the network, nor write outside the test's folders.
def tracker_env(tmp: Path) -> dict[str, str]:
    return {"WANDB_SILENT": "true", "WANDB_CONFIG_DIR": str(tmp / "wandb-config"),
            "WANDB_CACHE_DIR": str(tmp / "wandb-cache"), "WANDB_DATA_DIR": str(tmp / "wandb-data"),
            "WANDB_DISABLE_CODE": "true", "WANDB_API_KEY": "", "MLFLOW_TRACKING_URI": ""}


# Figures that do not measure time: a resumed run replays them bit-exactly.
EXACT = ("loss", "lr", "grad_norm", "epoch", "world_size", "val_loss", "val_acc")


def jsonl(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def expected_metrics(run_dir: Path) -> dict[str, dict[int, float]]:
    """metric -> {step: value} as the trackers must hold it: every number of metrics.jsonl but
    `step`, and `epoch` from the training records only (an evaluation's counts finished ones)."""
    out: dict[str, dict[int, float]] = {}
    for record in jsonl(run_dir):
        is_val = any(k.startswith("val_") for k in record)
        for key, value in record.items():
            if key == "step" or (key == "epoch" and is_val) or not isinstance(value, (int, float)):
                continue
            assert record["step"] not in out.get(key, {}), "metrics.jsonl repeats a step"
            out.setdefault(key, {})[record["step"]] = float(value)
    return out


def mlflow_history(db: Path, run_id: str) -> dict[str, list[tuple[int, float]]]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{db}")
    return {key: [(m.step, m.value) for m in client.get_metric_history(run_id, key)]
            for key in client.get_run(run_id).data.metrics}


def sent(run_dir: Path, name: str) -> dict[str, Any]:
    try:
        return json.loads((run_dir / "trackers.json").read_text()).get(name, {})
    except (OSError, ValueError):
        return {}


# -- MLflow, a real 2-rank run killed with -9 and resumed ------------------------------------------

@pytest.mark.slow
def test_mlflow_run_killed_and_resumed_is_one_run_with_each_step_once(tmp_path: Path) -> None:
    from mlflow.tracking import MlflowClient

    run_dir = tmp_path / "runs" / "killed"
    overrides = ["model.name=user_code:slow_cnn", "model.args={width: 8, sleep_s: 0.02}",
                 "train.epochs=4", "ckpt.every_steps=4", "log.mlflow.enabled=true"]
    env = tracker_env(tmp_path)
    # Training waits in step 7 (after the step-4 checkpoint) until MLflow, however slow to start
    # on a loaded machine, holds steps past the checkpoint; killed then, the resumed run replays them.
    hold = tmp_path / "hold"
    hold.touch()
    proc = start(run_dir, overrides, nproc=2,
                 env={**env, "PAUSE_TRAIN_FILE": str(hold), "PAUSE_TRAIN_AFTER": "6"})
    kill_when(proc, lambda: 4 <= saved_step(run_dir) < sent(run_dir, "mlflow").get("sent", {})
              .get("loss", 0))
    hold.unlink()
    killed_at, sent_at_kill = saved_step(run_dir), sent(run_dir, "mlflow")
    assert sent_at_kill["sent"]["loss"] > killed_at
    resumed = launch(run_dir, overrides, nproc=2, env=env)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stderr and "mlflow:" not in resumed.stderr

    db = tmp_path / "runs" / "mlflow.db"  # the default: beside the runs, no server
    client = MlflowClient(tracking_uri=f"sqlite:///{db}")
    experiment = client.get_experiment_by_name("killed")  # the run's name (not in a sweep)
    [run] = client.search_runs([experiment.experiment_id])
    assert run.info.run_id == sent_at_kill["run_id"] == sent(run_dir, "mlflow")["run_id"]
    assert run.info.run_name == "killed" and run.info.status == "FINISHED"

    expected, held = expected_metrics(run_dir), mlflow_history(db, run.info.run_id)
    assert set(held) == set(expected) and {"loss", "val_acc", "world_size"} <= set(held)
    assert [s for s, _ in sorted(held["loss"])] == list(range(1, 65))
    for key, points in held.items():
        steps = [step for step, _ in points]
        assert len(steps) == len(set(steps)), f"{key}: a step sent twice"
        assert set(steps) == set(expected[key]), key
        for step, value in points:
            # Timing figures of the steps replayed after the checkpoint keep what was measured
            # when they were sent first; everything else is metrics.jsonl's, bit for bit.
            if key in EXACT or step <= killed_at:
                assert value == expected[key][step], (key, step)
    assert held["world_size"] and {s for s, v in held["world_size"]} == {1, killed_at + 1}

    params, tags = run.data.params, run.data.tags
    assert params["optim.lr"] == "0.05" and params["model.name"] == "user_code:slow_cnn"
    assert params["train.epochs"] == "4" and params["log.mlflow.enabled"] == "true"
    assert tags["dtrain.world_size"] == "2" and tags["dtrain.host"]
    assert tags["dtrain.run_dir"] == str(run_dir.resolve())
    assert tags["dtrain.torch_version"].startswith("2.") and tags["dtrain.dtrain_version"]
    best = Path(tags["dtrain.best_checkpoint"])
    assert best.parent == (run_dir / "checkpoints").resolve() and best.is_dir()
    assert float(tags["dtrain.best_val_acc"]) == max(r["val_acc"] for r in jsonl(run_dir)
                                                     if "val_acc" in r)
    assert not (tmp_path / "runs" / "mlartifacts").exists()  # nothing uploaded


# -- W&B offline: the resumed run opens the same run id -------------------------------------------

def wandb_records(path: Path) -> list[Any]:
    """The records of a `.wandb` file: W&B's header, then LevelDB-log framed protobufs."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, pos, block, parts, out = path.read_bytes(), 7, 32768, b"", []
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        if block - pos % block < 7:
            pos += block - pos % block  # a block's padding
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind in (1, 2):  # full, first
            parts = chunk
        elif kind in (3, 4):  # middle, last
            parts += chunk
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(parts)
            out.append(record)
    return out


def item_key(item: Any) -> str:
    return item.key or "/".join(item.nested_key)


WANDB = ["log.wandb.enabled=true", "ckpt.keep_last=1"]


@pytest.fixture(scope="module")
def wandb_first(tmp_path_factory: pytest.TempPathFactory) -> tuple[Result, Path]:
    """The first attempt of the W&B run (one epoch), launched where mlflow cannot be imported:
    the W&B test resumes it, and the missing-dependency test reads from it that W&B, installed,
    starts without mlflow. Returns the launch and the folder of the trackers' own files."""
    from conftest import without_module

    tmp = tmp_path_factory.mktemp("wandb")
    env = {**tracker_env(tmp), **without_module(tmp / "shim", "mlflow")}
    return launch(tmp / "runs" / "w", [*WANDB, "train.epochs=1"], env=env), tmp


@pytest.mark.slow
def test_wandb_offline_run_resumed_into_the_same_run_id(wandb_first: tuple[Result, Path]) -> None:
    first, tmp = wandb_first
    run_dir = first.run_dir
    env = tracker_env(tmp)
    assert first.returncode == 0, first.stderr[-3000:]
    run_id = sent(run_dir, "wandb")["run_id"]
    resumed = launch(run_dir, [*WANDB, "train.epochs=2"], env=env)  # the same run, 2 epochs
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stderr and "wandb:" not in resumed.stderr
    assert sent(run_dir, "wandb") | {"sent": None, "updated": None} == {
        "run_id": run_id, "project": "w", "mode": "offline", "sent": None, "updated": None}

    # One offline folder per attempt, both of the one W&B run id (`wandb sync` merges them).
    folders = sorted((run_dir / "wandb").glob("offline-run-*"))
    assert [f.name.rsplit("-", 1)[1] for f in folders] == [run_id, run_id]
    history: dict[int, dict[str, Any]] = {}
    for index, folder in enumerate(folders):
        records = wandb_records(folder / f"run-{run_id}.wandb")
        [run] = [r.run for r in records if r.WhichOneof("record_type") == "run"]
        assert (run.run_id, run.project, run.display_name) == (run_id, "w", "w")
        assert "world_size=1" in run.tags and any(t.startswith("host=") for t in run.tags)
        config = {item_key(i): json.loads(i.value_json) for r in records
                  if r.WhichOneof("record_type") == "config" for i in r.config.update}
        assert config["optim.lr"] == "0.05"  # the resolved config, flattened
        assert config["train.epochs"] == str(index + 1)  # changed by the resume
        summary = {item_key(i): json.loads(i.value_json) for r in records
                   if r.WhichOneof("record_type") == "summary" for i in r.summary.update}
        assert summary["run_dir"] == str(run_dir.resolve())
        assert Path(summary["best_checkpoint"]).parent == (run_dir / "checkpoints").resolve()
        for r in records:
            if r.WhichOneof("record_type") == "history":
                row = {item_key(i): json.loads(i.value_json) for i in r.history.item}
                assert r.history.step.num not in history, "a step logged twice"
                history[r.history.step.num] = row
    expected = expected_metrics(run_dir)
    assert sorted(history) == sorted({s for values in expected.values() for s in values})
    assert sorted(history) == list(range(1, 65))
    for key, values in expected.items():
        for step, value in values.items():
            assert history[step].get(key) == value, (key, step, history[step])  # every figure, unchanged
    assert {k for k in history[32] if not k.startswith("_")} >= {"loss", "val_acc", "val_loss"}


# -- a tracker that cannot be reached, or not installed --------------------------------------------

@pytest.mark.slow
def test_unreachable_tracker_is_one_warning_and_the_run_finishes(tmp_path: Path) -> None:
    run_dir = tmp_path / "runs" / "r"
    began = time.monotonic()
    result = launch(run_dir, ["log.mlflow.enabled=true", "log.mlflow.tracking_uri=http://127.0.0.1:9"],
                    env=tracker_env(tmp_path))
    elapsed = time.monotonic() - began
    assert result.returncode == 0, result.stderr[-3000:]
    warnings = [line for line in result.stderr.splitlines() if "mlflow" in line.lower()]
    assert len(warnings) == 1, result.stderr[-3000:]
    assert "mlflow: cannot start the tracker run" in warnings[0]
    assert "127.0.0.1" in warnings[0] and "metrics.jsonl" in warnings[0]
    assert "Traceback" not in result.stderr and "Retrying" not in result.stderr
    assert [r["step"] for r in jsonl(run_dir) if "loss" in r] == list(range(1, 33))
    assert [r["step"] for r in jsonl(run_dir) if "val_acc" in r] == [32]
    # The end of the run does not wait for the tracker: from the last line that names val_acc
    # (the final checkpoint's save) to the "finished" line, less than the CLOSE_WAIT_S (10 s) a
    # sender still busy would be waited for. Whole seconds: a wait of 10 s reads 10 or more; a
    # loaded machine's few seconds of exit work stay below.
    lines = result.stderr.splitlines()
    last_eval = next(line for line in reversed(lines) if "val_acc" in line)
    done = next(line for line in lines if "finished at step 32" in line)
    gap = [time.mktime(time.strptime(line[:19], "%Y-%m-%d %H:%M:%S")) for line in (last_eval, done)]
    assert gap[1] - gap[0] < CLOSE_WAIT_S, (last_eval, done)
    assert elapsed < 120


def test_enabled_but_not_installed_is_one_line_and_exit_2(
        tmp_path: Path, wandb_first: tuple[Result, Path]) -> None:
    from conftest import without_module

    env = {**tracker_env(tmp_path), **without_module(tmp_path / "shim", "mlflow")}
    run_dir = tmp_path / "runs" / "r"
    result = launch(run_dir, ["log.mlflow.enabled=true"], env=env)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "dtrain: missing dependency: log.mlflow.enabled needs the 'mlflow' extra "
        "(no module 'mlflow'): pip install 'dtrain[mlflow]'"]
    assert not (tmp_path / "runs").exists()  # nothing written, no process group made
    # The check refuses only what is missing: W&B, installed, starts (the W&B test's first
    # attempt, launched with mlflow hidden the same way).
    first, _ = wandb_first
    assert first.returncode == 0, first.stderr[-3000:]


# -- in one process: a tracker that fails, hangs, or misses records --------------------------------

class FakeTracker:
    """Keeps what it is sent; with `fail`, every send raises; with `hang`, sends block."""

    def __init__(self, fail: bool = False, hang: threading.Event | None = None) -> None:
        self.rows: list[tuple[int, dict[str, float]]] = []
        self.fail, self.hang = fail, hang
        self.ended: list[dict[str, Any]] = []
        self.finished: list[str] = []
        self.starts: list[Any] = []

    @staticmethod
    def requires(settings: Any) -> tuple[str, ...]:
        return ()

    def start(self, info: RunInfo, saved: Any) -> tuple[dict[str, Any], bool]:
        self.starts.append(saved)
        return {"run_id": saved["run_id"] if saved else "fake-1"}, saved is not None

    def sent_steps(self) -> None:
        return None

    def log(self, rows: list[tuple[int, dict[str, float]]]) -> None:
        if self.hang is not None:
            self.hang.wait()
        if self.fail:
            raise ConnectionError("tracker went away")
        self.rows.extend(rows)

    def end(self, summary: Any) -> None:
        self.ended.append(dict(summary))

    def finish(self, status: str) -> None:
        self.finished.append(status)


def by_step(rows: list[tuple[int, dict[str, float]]]) -> dict[int, dict[str, float]]:
    """Rows merged by step (a step's evaluation is sent with its training record when both
    are queued at once, else right after it)."""
    merged: dict[int, dict[str, float]] = {}
    for step, metrics in rows:
        assert not set(metrics) & set(merged.get(step, {})), "a metric sent twice"
        merged.setdefault(step, {}).update(metrics)
    return merged


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture
def warnings() -> Any:
    setup_logging(rank=0, all_ranks=False)
    handler = Lines()
    log.addHandler(handler)
    yield handler.lines
    log.removeHandler(handler)


def attempt(run_dir: Path, tracker: FakeTracker, resumed_step: int, steps: range,
            end: bool = True) -> float:
    """One attempt of a run with metrics.jsonl and the fake tracker; the longest write()."""
    cfg = load(None, [f"run.out_dir={run_dir.parent}", f"run.name={run_dir.name}"])
    info = trackers.run_info(run_facts(cfg), str(run_dir))
    state = StateFile(str(run_dir / "trackers.json"))
    jsonl_sink = JsonlSink(str(run_dir / "metrics.jsonl"), resumed_step)
    sink = TrackerSink("fake", tracker, info, state.data.get("fake"), state, resumed_step)
    sink.begin()
    slowest = 0.0
    for step in steps:
        for record in (Record("train", {"step": step, "epoch": 0, "loss": 1.0 / step}),) + (
                (Record("val", {"step": step, "epoch": 1, "val_acc": step / 100}),)
                if step % 5 == 0 else ()):
            jsonl_sink.write(record)
            began = time.perf_counter()
            sink.write(record)
            slowest = max(slowest, time.perf_counter() - began)
    if end:
        sink.hparams(steps[-1], {}, {"best_val_acc": 0.5})
    jsonl_sink.close()
    sink.close()
    return slowest


def test_a_failing_tracker_is_one_warning_and_a_resume_sends_what_it_missed(
        tmp_path: Path, warnings: list[str]) -> None:
    run_dir = tmp_path / "runs" / "r"
    run_dir.mkdir(parents=True)
    first = FakeTracker()
    attempt(run_dir, first, 0, range(1, 9), end=False)  # killed after step 8
    assert list(by_step(first.rows)) == list(range(1, 9)) and first.finished == ["failed"]
    assert by_step(first.rows)[5] == {"epoch": 0.0, "loss": 0.2, "val_acc": 0.05}
    assert sent(run_dir, "fake")["sent"] == {"epoch": 8, "loss": 8, "val_acc": 5}

    # Resumed from step 4's checkpoint; the tracker fails: one warning, the run goes on.
    broken = FakeTracker(fail=True)
    attempt(run_dir, broken, 4, range(5, 13), end=False)
    assert broken.rows == [] and broken.finished == []  # left alone after the failure
    assert warnings == ["fake: cannot send metrics (ConnectionError: tracker went away); not "
                        "sending to fake for the rest of this attempt (metrics.jsonl and "
                        "TensorBoard have every record)"]
    assert sent(run_dir, "fake")["sent"] == {"epoch": 8, "loss": 8, "val_acc": 5}

    # Resumed from step 10's: 9 and 10 come from metrics.jsonl, the replayed 11 and 12 and the
    # new 13..15 from the training; nothing of 1..8 again.
    again = FakeTracker()
    attempt(run_dir, again, 10, range(11, 16))
    assert again.starts == [{"run_id": "fake-1", "sent": {"epoch": 8, "loss": 8, "val_acc": 5},
                             "updated": pytest.approx(time.time(), abs=60)}]
    assert list(by_step(again.rows)) == [9, 10, 11, 12, 13, 14, 15]
    assert again.rows[1] == (10, {"epoch": 0.0, "loss": 0.1, "val_acc": 0.1})  # one send
    assert again.finished == ["finished"]
    assert again.ended == [{"best_val_acc": 0.5}]  # no checkpoint in this run directory
    assert len(warnings) == 1
    # Over the attempts, the tracker got each record of metrics.jsonl once.
    got = [(s, k, v) for s, m in first.rows + again.rows for k, v in m.items()]
    assert sorted(got) == sorted((s, k, v) for k, values in expected_metrics(run_dir).items()
                                 for s, v in values.items())


def test_a_hanging_tracker_never_slows_training_and_the_end_waits_a_bounded_time(
        tmp_path: Path, warnings: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(trackers, "CLOSE_WAIT_S", 1.0)
    run_dir = tmp_path / "runs" / "r"
    run_dir.mkdir(parents=True)
    hang = threading.Event()
    began = time.monotonic()
    slowest_write = attempt(run_dir, FakeTracker(hang=hang), 0, range(1, 201))
    # A write that waited for the hanging tracker would take CLOSE_WAIT_S or forever: 0.5 s is
    # far below either and above what a loaded machine adds to a file write.
    assert time.monotonic() - began < 5 and slowest_write < 0.5
    assert warnings == ["fake: still sending 1 s after the end of the run; leaving it "
                        "(metrics.jsonl has every record; a resume of this run sends what the "
                        "tracker misses)"]
    hang.set()
    assert len(jsonl(run_dir)) == 240  # metrics.jsonl has every record


def test_a_new_history_gets_a_new_mlflow_run_holding_what_metrics_jsonl_keeps(
        tmp_path: Path, warnings: list[str]) -> None:
    """A rewind (`superseded`) leaves the tracker run of the abandoned history as it is and
    starts one with metrics.jsonl's kept records; a key changed on resume is a tag."""
    from mlflow.tracking import MlflowClient

    run_dir = tmp_path / "runs" / "r"
    run_dir.mkdir(parents=True)
    overrides = ["log.tensorboard=false", "log.mlflow.enabled=true", "log.mlflow.experiment=e",
                 f"run.out_dir={run_dir.parent}", f"run.name={run_dir.name}"]

    def feed(run_log: RunLog, steps: range, shift: float) -> None:
        for step in steps:
            run_log.train({"step": step, "epoch": 0, "loss": shift + 1.0 / step}, {}, step, True)

    def run_log(cfg: Config, resumed_step: int, superseded: str | None = None) -> RunLog:
        return RunLog(cfg.log, run_facts(cfg), str(run_dir), True, resumed_step, superseded)

    first = run_log(load(None, overrides), 0)
    feed(first, range(1, 9), 0.0)
    first.close()
    old_id = sent(run_dir, "mlflow")["run_id"]
    aside = run_dir / "superseded" / "t"
    aside.mkdir(parents=True)
    rewound = run_log(load(None, [*overrides, "train.epochs=3"]), 4, str(aside))
    feed(rewound, range(5, 7), 10.0)  # a different history from step 5 on
    rewound.close()
    assert warnings == []

    client = MlflowClient(tracking_uri=f"sqlite:///{run_dir.parent / 'mlflow.db'}")
    new_id = sent(run_dir, "mlflow")["run_id"]
    assert new_id != old_id and json.loads((aside / "trackers.json").read_text())["mlflow"][
        "run_id"] == old_id
    new = client.get_run(new_id)
    assert new.data.tags["dtrain.previous_run_id"] == old_id
    assert [(m.step, m.value) for m in client.get_metric_history(new_id, "loss")] == [
        (s, r["loss"]) for s, r in ((r["step"], r) for r in jsonl(run_dir))]
    assert [m.step for m in client.get_metric_history(old_id, "loss")] == list(range(1, 9))
    assert new.data.params["train.epochs"] == "3"

    # Resumed again without a rewind, with a changed key: the same run, the param kept.
    again = run_log(load(None, [*overrides, "train.epochs=4"]), 6)
    feed(again, range(7, 8), 10.0)
    again.close()
    run = client.get_run(new_id)
    assert sent(run_dir, "mlflow")["run_id"] == new_id and warnings == []
    assert run.data.params["train.epochs"] == "3" and run.data.tags[
        "dtrain.param.train.epochs"] == "4"
    assert [m.step for m in client.get_metric_history(new_id, "loss")] == [1, 2, 3, 4, 5, 6, 7]


def test_tags_name_the_slurm_job_and_a_sweeps_trials_share_its_experiment(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    sweep = tmp_path / "runs" / "lr-sweep"
    sweep.mkdir(parents=True)
    (sweep / "sweep.yaml").write_text("version: 1\nname: lr-sweep\ntrials: []\n")
    for var, value in (("SLURM_JOB_ID", "1234"), ("SLURM_ARRAY_JOB_ID", "1200"),
                       ("SLURM_ARRAY_TASK_ID", "3")):
        monkeypatch.setenv(var, value)
    monkeypatch.delenv("SLURM_RESTART_COUNT", raising=False)
    cfg = load(None, [f"run.out_dir={sweep}", "run.name=optim.lr=0.1", "optim.lr=0.1"])
    info = trackers.run_info(run_facts(cfg), str(sweep / "optim.lr=0.1"))
    assert (info.name, info.experiment, info.group) == ("optim.lr=0.1", "lr-sweep", "lr-sweep")
    assert {k: v for k, v in info.tags.items() if k.startswith("slurm")} == {
        "slurm_job_id": "1234", "slurm_array_job_id": "1200", "slurm_array_task_id": "3"}
    assert info.tags["world_size"] == "1" and info.params["optim.lr"] == "0.1"
    assert info.params["run.name"] == "optim.lr=0.1" and info.params["sched.warmup_steps"] == "0"
    # Not in a sweep: the run's own name.
    alone = trackers.run_info(run_facts(load(None, [f"run.out_dir={tmp_path}", "run.name=r"])), "x")
    assert (alone.experiment, alone.group) == ("r", None)
