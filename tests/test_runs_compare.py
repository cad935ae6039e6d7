"""`dtrain runs DIR`: a sweep folder's runs side by side (json, csv, table), and TensorBoard's
HParams tab over the same folder. The sweep folder is made by hand in the sweep's format (its
sweep.yaml, then each trial launched with run.out_dir=<sweep> run.name=<trial>): two trials
finish, one diverges and fails, one is never launched."""

from __future__ import annotations

import contextlib
import csv
import io
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.plugins.hparams import api_pb2, plugin_data_pb2

from conftest import dtrain, launch, run_facts

from dtrain import cli
from dtrain.config import load
from dtrain.observe import RunLog

FIXED = ["train.max_steps=6", "train.eval_every_steps=3", "ckpt.monitor=val_loss",
         "ckpt.monitor_mode=min", "log.tensorboard=true"]
# name -> swept values; an lr of 1e12 makes the loss non-finite at step 2 (exit 1, failed).
TRIALS = {
    "lr0.05-bs16": {"optim.lr": 0.05, "data.batch_size": 16},
    "lr0.01-bs32": {"optim.lr": 0.01, "data.batch_size": 32},
    "lr1e12-bs16": {"optim.lr": 1.0e12, "data.batch_size": 16},
    "lr0.001-bs16": {"optim.lr": 0.001, "data.batch_size": 16},  # pending: never launched
}
LAUNCHED = ["lr0.05-bs16", "lr0.01-bs32", "lr1e12-bs16"]
SWEPT = ["optim.lr", "data.batch_size"]


def write_sweep(folder: Path, trials: dict[str, dict[str, Any]]) -> None:
    """sweep.yaml as `dtrain sweep` writes it (the shared format)."""
    folder.mkdir(parents=True, exist_ok=True)
    data = {
        "version": 1, "name": folder.name, "config": None, "nproc": 1, "mode": "grid", "seed": 0,
        "random": None, "fixed": FIXED,
        "space": {key: {"values": list(dict.fromkeys(t[key] for t in trials.values()))}
                  for key in SWEPT},
        "swept": SWEPT,
        "trials": [{"index": i, "name": name, "overrides": values,
                    "run_dir": str((folder / name).resolve())}
                   for i, (name, values) in enumerate(trials.items())],
    }
    (folder / "sweep.yaml").write_text(yaml.safe_dump(data, sort_keys=False))


@pytest.fixture(scope="module")
def sweep(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("compare") / "S"
    write_sweep(folder, TRIALS)
    for name in LAUNCHED:
        values = [f"{key}={value}" for key, value in TRIALS[name].items()]
        result = launch(folder / name, [*FIXED, *values])
        if name == "lr1e12-bs16":
            assert result.returncode == 1 and "non-finite loss" in result.stderr, result.stderr
        else:
            assert result.returncode == 0, result.stderr[-3000:]
    return folder


def evals(run_dir: Path) -> list[dict[str, Any]]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "val_loss" in r]


def runs_output(*args: str) -> str:
    """`dtrain runs ...` in this process (the table test runs the command itself)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli.main(["runs", *args]) == 0
    return out.getvalue()


def runs_json(folder: Path) -> list[dict[str, Any]]:
    return json.loads(runs_output(str(folder), "--format", "json"))


@pytest.mark.slow
def test_json_rows_best_first_with_typed_swept_values(sweep: Path) -> None:
    rows = runs_json(sweep)
    finished = sorted(["lr0.05-bs16", "lr0.01-bs32"],
                      key=lambda n: min(e["val_loss"] for e in evals(sweep / n)))
    assert [r["name"] for r in rows] == [*finished, "lr1e12-bs16", "lr0.001-bs16"]
    for row in rows:
        assert {"name", "run_dir", "status", "step", "epoch", "monitor", "best", "best_step",
                "wall_time_s", *SWEPT} <= set(row)
        assert row["optim.lr"] == TRIALS[row["name"]]["optim.lr"]
        assert type(row["optim.lr"]) is float and type(row["data.batch_size"]) is int
        assert row["data.batch_size"] == TRIALS[row["name"]]["data.batch_size"]
        assert row["run_dir"] == str((sweep / row["name"]).resolve())
    by_name = {r["name"]: r for r in rows}
    for name in finished:
        row, seen = by_name[name], evals(sweep / name)
        best = min(seen, key=lambda e: e["val_loss"])
        assert (row["status"], row["step"], row["epoch"]) == ("finished", 6, 0)
        assert (row["monitor"], row["monitor_mode"]) == ("val_loss", "min")
        assert row["best"] == pytest.approx(best["val_loss"], rel=1e-12)
        assert row["best_step"] == best["step"] and [e["step"] for e in seen] == [3, 6]
        assert isinstance(row["wall_time_s"], float) and 0 < row["wall_time_s"] < 300
        assert row["error"] is None and Path(row["best_checkpoint"]).is_dir()
    failed = by_name["lr1e12-bs16"]
    assert failed["status"] == "failed" and failed["best"] is None and failed["best_step"] is None
    assert failed["error"].startswith("TrainingStopped: non-finite loss or gradients at step 2")
    assert failed["step"] == 1 and failed["monitor"] == "val_loss"  # its last record's step
    pending = by_name["lr0.001-bs16"]
    assert (pending["status"], pending["step"], pending["epoch"], pending["best"],
            pending["wall_time_s"], pending["monitor"]) == ("pending", 0, None, None, None, None)


@pytest.mark.slow
def test_csv_and_table_forms(sweep: Path) -> None:
    rows = runs_json(sweep)
    table = list(csv.reader(io.StringIO(runs_output(str(sweep), "--format=csv"))))
    assert table[0] == ["name", *SWEPT, "status", "step", "epoch", "monitor", "monitor_mode",
                        "best", "best_step", "wall_time_s", "error", "best_checkpoint", "run_dir"]
    assert [line[0] for line in table[1:]] == [r["name"] for r in rows]
    assert table[1][1:4] == [str(rows[0]["optim.lr"]), str(rows[0]["data.batch_size"]),
                             "finished"]
    assert float(table[1][8]) == rows[0]["best"]  # full precision
    assert table[4][3:8] == ["pending", "0", "", "", ""]

    result = dtrain("runs", str(sweep))  # table is the default form
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].split() == ["run", *SWEPT, "status", "step", "epoch", "best", "val_loss",
                                "at", "step", "wall"]
    cells = [line.split() for line in lines[1:5]]
    assert [c[0] for c in cells] == [r["name"] for r in rows]
    assert cells[0][1:7] == [str(rows[0]["optim.lr"]), str(rows[0]["data.batch_size"]),
                             "finished", "6", "0", f"{rows[0]['best']:.6g}"]
    assert cells[2][1:8] == ["1e+12", "16", "failed", "1", "0", "-", "-"]
    assert cells[3][1:] == ["0.001", "16", "pending", "0", "-", "-", "-", "-"]
    assert lines[5] == f"lr1e12-bs16: {rows[2]['error']}" and len(lines) == 6

    records = runs_output(f"--out-dir={sweep}")  # without DIR: the run records, as before
    assert records.split()[:3] == ["run", "status", "started"]
    assert json.loads(runs_output(f"--out-dir={sweep}", "--format", "json")) == rows


@pytest.mark.slow
def test_a_folder_without_sweep_yaml_shows_the_keys_that_differ(sweep: Path,
                                                                tmp_path: Path) -> None:
    plain = tmp_path / "plain"
    shutil.copytree(sweep, plain, ignore=shutil.ignore_patterns("sweep.yaml"))
    rows = runs_json(plain)
    assert [r["name"] for r in rows] == [r["name"] for r in runs_json(sweep)][:3]  # no pending
    assert all(set(r) - {"error", "best_checkpoint", "monitor_mode"} ==
               {"name", "run_dir", "status", "step", "epoch", "monitor", "best", "best_step",
                "wall_time_s", "data.batch_size", "optim.lr"} for r in rows)
    assert {r["name"]: (r["optim.lr"], r["data.batch_size"]) for r in rows} == {
        n: (TRIALS[n]["optim.lr"], TRIALS[n]["data.batch_size"]) for n in LAUNCHED}


# -- TensorBoard's HParams tab -------------------------------------------------------------------

def hparams_content(run_dir: Path) -> dict[str, plugin_data_pb2.HParamsPluginData]:
    acc = EventAccumulator(str(run_dir / "tb"), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return {tag: plugin_data_pb2.HParamsPluginData.FromString(content)
            for tag, content in acc.PluginTagToContent("hparams").items()}


def tensorboard_view(logdir: Path) -> tuple[api_pb2.Experiment, list[api_pb2.SessionGroup]]:
    """What the HParams tab of `tensorboard --logdir <logdir>` gets from its backend."""
    from tensorboard import context
    from tensorboard.backend.event_processing import data_provider, plugin_event_multiplexer
    from tensorboard.plugins import base_plugin
    from tensorboard.plugins.hparams import backend_context, get_experiment, list_session_groups

    mux = plugin_event_multiplexer.EventMultiplexer()
    mux.AddRunsFromDirectory(str(logdir))
    mux.Reload()
    provider = data_provider.MultiplexerDataProvider(mux, str(logdir))
    backend = backend_context.Context(base_plugin.TBContext(
        logdir=str(logdir), multiplexer=mux, data_provider=provider))
    ctx = context.RequestContext()
    experiment = get_experiment.Handler(ctx, backend, "", api_pb2.GetExperimentRequest()).run()
    request = api_pb2.ListSessionGroupsRequest(
        allowed_statuses=[api_pb2.STATUS_UNKNOWN, api_pb2.STATUS_SUCCESS,
                          api_pb2.STATUS_FAILURE, api_pb2.STATUS_RUNNING],
        col_params=[api_pb2.ColParams(hparam=h.name) for h in experiment.hparam_infos]
        + [api_pb2.ColParams(metric=m.name) for m in experiment.metric_infos],
        start_index=0, slice_size=100)
    groups = list_session_groups.Handler(ctx, backend, "", request).run()
    return experiment, list(groups.session_groups)


@pytest.mark.slow
def test_hparams_hold_the_swept_keys_of_every_trial(sweep: Path) -> None:
    rows = {r["name"]: r for r in runs_json(sweep)}
    for name in LAUNCHED:
        content = hparams_content(sweep / name)
        start = content["_hparams_/session_start_info"].session_start_info.hparams
        assert start["optim.lr"].number_value == TRIALS[name]["optim.lr"]
        assert start["data.batch_size"].number_value == TRIALS[name]["data.batch_size"]
        assert start["run.name"].string_value == name
        # The failed trial is a row of the tab (from its first record) without columns of its own.
        assert ("_hparams_/experiment" in content) == (name != "lr1e12-bs16")
    infos = hparams_content(sweep / "lr0.05-bs16")["_hparams_/experiment"].experiment.hparam_infos
    assert [(i.name, i.differs) for i in infos[:3]] == [("optim.lr", True),
                                                       ("data.batch_size", True),
                                                       ("model.name", False)]
    assert (infos[0].domain_interval.min_value, infos[0].domain_interval.max_value) == (0.001,
                                                                                      1e12)
    assert (infos[1].domain_interval.min_value, infos[1].domain_interval.max_value) == (16, 32)

    experiment, groups = tensorboard_view(sweep)
    # TensorBoard sorts the columns that differ first, then by name; it shows the first five.
    assert [(i.name, i.differs) for i in experiment.hparam_infos[:3]] == [
        ("data.batch_size", True), ("optim.lr", True), ("data.name", False)]
    assert {m.name.tag for m in experiment.metric_infos} == {
        "hparam/val_loss", "hparam/val_acc", "hparam/best_val_loss"}
    shown = {g.name.split("/")[0]: g for g in groups}
    assert sorted(shown) == sorted(LAUNCHED)
    for name, group in shown.items():
        assert group.hparams["optim.lr"].number_value == TRIALS[name]["optim.lr"]
        metrics = {m.name.tag: m.value for m in group.metric_values}
        if name == "lr1e12-bs16":
            assert metrics == {}
        else:
            assert metrics["hparam/best_val_loss"] == pytest.approx(rows[name]["best"], rel=1e-6)


def test_a_resumed_trial_keeps_its_hparams_row(tmp_path: Path) -> None:
    """A trial killed before its end has its row from the first record; the attempt that
    resumes and finishes adds the columns and metrics (in one process, no launch)."""
    folder = tmp_path / "S"
    write_sweep(folder, {"a": {"optim.lr": 0.1, "data.batch_size": 8},
                         "b": {"optim.lr": 0.2, "data.batch_size": 16}})
    cfg = load(None, [f"run.out_dir={folder}", "run.name=b", "optim.lr=0.2",
                      "data.batch_size=16", "log.tensorboard=true"])
    run_dir = folder / "b"
    run_dir.mkdir()
    run_log = RunLog(cfg.log, run_facts(cfg), str(run_dir), True, 0)
    assert not (run_dir / "tb").exists()  # nothing before the first record
    run_log.evaluation({"step": 3, "epoch": 0, "val_loss": 0.5, "val_acc": 0.3})
    run_log.close()  # killed: no hparams call
    content = hparams_content(run_dir)
    assert set(content) == {"_hparams_/session_start_info"}
    assert content["_hparams_/session_start_info"].session_start_info.hparams[
        "optim.lr"].number_value == 0.2

    run_log = RunLog(cfg.log, run_facts(cfg), str(run_dir), True, 3)
    run_log.evaluation({"step": 6, "epoch": 0, "val_loss": 0.25, "val_acc": 0.6})
    run_log.hparams(6, {"val_loss": 0.25, "val_acc": 0.6, "best_val_acc": 0.6})
    run_log.close()
    content = hparams_content(run_dir)
    experiment = content["_hparams_/experiment"].experiment
    assert [(i.name, i.differs) for i in experiment.hparam_infos[:2]] == [
        ("optim.lr", True), ("data.batch_size", True)]
    assert {m.name.tag for m in experiment.metric_infos} == {
        "hparam/val_loss", "hparam/val_acc", "hparam/best_val_acc"}
    _, groups = tensorboard_view(folder)
    [group] = groups
    assert group.hparams["data.batch_size"].number_value == 16
    assert {m.name.tag: m.value for m in group.metric_values}["hparam/best_val_acc"] == (
        pytest.approx(0.6))


def test_a_run_outside_a_sweep_has_main_keys_only(tmp_path: Path) -> None:
    cfg = load(None, [f"run.out_dir={tmp_path}", "run.name=solo", "log.tensorboard=true"])
    (tmp_path / "solo").mkdir()
    run_log = RunLog(cfg.log, run_facts(cfg), str(tmp_path / "solo"), True, 0)
    run_log.hparams(4, {"val_loss": 0.5, "best_val_acc": None})
    run_log.close()
    experiment = hparams_content(tmp_path / "solo")["_hparams_/experiment"].experiment
    names = [i.name for i in experiment.hparam_infos]
    assert names[:3] == ["model.name", "data.name", "data.batch_size"] and "optim.lr" in names
    assert not any(i.differs for i in experiment.hparam_infos)
    assert [m.name.tag for m in experiment.metric_infos] == ["hparam/val_loss"]


# -- bad input -----------------------------------------------------------------------------------

def test_a_folder_that_is_neither_is_one_line_and_2(tmp_path: Path,
                                                     capfd: pytest.CaptureFixture) -> None:
    def error(*args: str) -> list[str]:
        assert cli.main(["runs", *args]) == 2
        captured = capfd.readouterr()
        assert captured.out == ""
        return captured.err.splitlines()

    assert error(str(tmp_path / "nowhere")) == [
        f"dtrain: runs error: '{tmp_path / 'nowhere'}' is not a directory; pass a sweep folder "
        f"or the run.out_dir of your runs"]
    run_dir = tmp_path / "one_run"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text("run: {name: one_run}\n")
    assert error(str(run_dir)) == [
        f"dtrain: runs error: '{run_dir}' holds neither sweep.yaml nor runs.csv; pass a sweep "
        f"folder or the run.out_dir of your runs ('{run_dir}' is one run's directory: pass its "
        f"parent)"]
    (run_dir / "sweep.yaml").write_text("trials: [oops\n")
    [line] = error(str(run_dir), "--format", "json")
    assert line.startswith(f"dtrain: runs error: {run_dir / 'sweep.yaml'} cannot be read (")
    (run_dir / "sweep.yaml").write_text("name: S\n")
    assert error(str(run_dir)) == [
        f"dtrain: runs error: {run_dir / 'sweep.yaml'} is not a sweep description (it needs a "
        f"'trials' list, each with a 'name'); move it away or pass another folder"]
    assert error(str(tmp_path), f"--out-dir={tmp_path}") == [
        "dtrain: runs error: give the folder as DIR or as --out-dir, not both"]
    assert cli.main(["runs", str(tmp_path), "--format", "xml"]) == 2
    assert "argument --format: invalid choice: 'xml'" in capfd.readouterr().err


def test_help_and_an_empty_sweep(tmp_path: Path, capfd: pytest.CaptureFixture) -> None:
    assert cli.main(["runs", "--help"]) == 0
    assert "a sweep folder or a run.out_dir" in capfd.readouterr().out
    write_sweep(tmp_path / "S", {"x": {"optim.lr": 0.5, "data.batch_size": 4}})
    assert cli.main(["runs", str(tmp_path / "S"), "--format", "json"]) == 0
    [row] = json.loads(capfd.readouterr().out)
    assert (row["name"], row["status"], row["optim.lr"], row["data.batch_size"]) == (
        "x", "pending", 0.5, 4)
    assert (row["step"], row["best"], row["run_dir"]) == (0, None, str((tmp_path / "S" / "x")))
