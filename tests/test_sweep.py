"""`dtrain sweep` for real: a local grid whose trials train exactly as the same runs launched
directly, a re-run that launches nothing, --extend, a trial that dies while the others go on, bad
input that writes nothing, and a SLURM job array with %2 where one preempted task requeues itself
alone and resumes its own run bit for bit.
"""

from __future__ import annotations

import csv
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

import forkserver
from conftest import REPO, TINY, Result, child_env, dtrain, launch, wait_for_step
from slurm_jobs import Job, slurm_env, train_steps
from test_slurm import PACED, needs_cluster

from dtrain.commands.sweep import space as sweep_space
from dtrain.core.errors import UserError

CONFIG = "configs/default.yaml"
SWEPT = ("optim.lr", "data.batch_size")
# The tiny job without the keys the sweeps below vary, four steps long.
FIXED = [w for w in TINY if w.split("=", 1)[0] not in SWEPT] + ["train.max_steps=4"]


def sweep(out_dir: Path, *words: str, timeout: float = 600, env: dict | None = None):
    return dtrain("sweep", "--config", CONFIG, f"run.out_dir={out_dir}", *FIXED, *words,
                  timeout=timeout, env=env)


def rows(folder: Path) -> dict[str, dict[str, str]]:
    with open(folder / "runs.csv", newline="") as f:
        return {row["name"]: row for row in csv.DictReader(f)}


def compared(folder: Path, trials: list[dict]) -> list[dict]:
    """`dtrain runs FOLDER --format json` on a sweep the command made: one row per trial with its
    swept values, and the best monitored value (and its first step) that the run recorded."""
    import json

    proc = dtrain("runs", str(folder), "--format", "json")
    assert proc.returncode == 0, proc.stderr
    table = json.loads(proc.stdout)
    assert sorted(r["name"] for r in table) == sorted(t["name"] for t in trials)
    for row in table:
        trial = next(t for t in trials if t["name"] == row["name"])
        assert {k: row[k] for k in trial["overrides"]} == trial["overrides"]
        assert row["run_dir"] == trial["run_dir"] and row["status"] == "finished"
        records = [json.loads(line) for line in
                   (Path(trial["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
        values = [(r[row["monitor"]], r["step"]) for r in records if row["monitor"] in r]
        best = (max if row["monitor_mode"] == "max" else min)(v for v, _ in values)
        assert row["best"] == best
        assert row["best_step"] == next(step for v, step in values if v == best)
        assert row["step"] == max(r["step"] for r in records)
    signs = [r["best"] if r["monitor_mode"] == "max" else -r["best"] for r in table]
    assert signs == sorted(signs, reverse=True)  # best first
    return table


def losses(run_dir: Path) -> dict[int, float]:
    return Result(0, "", "", run_dir).losses()


def without_place(run_dir: Path) -> dict:
    """The resolved config.yaml without run.name/out_dir."""
    cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
    del cfg["run"]["name"], cfg["run"]["out_dir"]
    return cfg


# ---------------------------------------------------------------------------------------------
# Trials, names and values, in process


def test_grid_is_the_cartesian_product_in_word_order_and_lists_of_lists_sweep_list_keys() -> None:
    words = sweep_space.parse_words(
        ["optim.lr=[0.1,0.01]", "optim.betas=[[0.9,0.95],[0.9,0.99]]", "optim.no_decay=[bias]",
         "model.args.width=[4,8]", "data.batch_size=32"], random_mode=False)
    assert words.fixed == ["optim.no_decay=[bias]", "data.batch_size=32"]  # a plain list: fixed
    trials = sweep_space.grid(words.space)
    assert len(trials) == 8
    assert trials[0] == {"optim.lr": 0.1, "optim.betas": [0.9, 0.95], "model.args.width": 4}
    assert trials[-1] == {"optim.lr": 0.01, "optim.betas": [0.9, 0.99], "model.args.width": 8}
    names = sweep_space.trial_names(trials, list(words.space))
    assert names[0] == "lr=0.1,betas=0.9_0.95,width=4"
    assert len(set(names)) == 8 and all("/" not in n and " " not in n for n in names)
    # an override text reads back as the same value
    for trial in trials:
        for key, value in trial.items():
            assert yaml.safe_load(sweep_space.override(key, value).split("=", 1)[1]) == value


def test_random_trials_are_seeded_in_range_and_a_larger_draw_starts_with_the_smaller() -> None:
    words = sweep_space.parse_words(
        ["optim.lr=loguniform(1e-4,1e-1)", "data.batch_size=uniform(8,64)",
         "model.name=choice(simple_cnn,resnet18)"], random_mode=True)
    four = sweep_space.sample(words.space, 4, seed=3)
    assert four == sweep_space.sample(words.space, 4, seed=3)
    assert four != sweep_space.sample(words.space, 4, seed=4)
    assert sweep_space.sample(words.space, 9, seed=3)[:4] == four
    for trial in sweep_space.sample(words.space, 50, seed=0):
        assert 1e-4 <= trial["optim.lr"] <= 1e-1
        assert isinstance(trial["data.batch_size"], int) and 8 <= trial["data.batch_size"] <= 64
        assert trial["model.name"] in ("simple_cnn", "resnet18")
    # same-looking names still differ; model.name and data.name keep their sections
    names = sweep_space.trial_names([{"model.name": "a", "data.name": "b"}] * 2,
                                    ["model.name", "data.name"], taken=["model.name=a,data.name=b"])
    assert names == ["model.name=a,data.name=b_2", "model.name=a,data.name=b_3"]


def test_array_indices_and_the_name_of_an_array_task() -> None:
    from dtrain.commands.sweep import launch as sweep_launch
    from dtrain.process import slurm
    assert sweep_launch.array_spec([8, 0, 1, 2, 5, 7]) == "0-2,5,7-8"
    assert sweep_launch.array_spec([3]) == "3"
    array_task = {"SLURM_ARRAY_JOB_ID": "70", "SLURM_ARRAY_TASK_ID": "3"}
    assert slurm.job_label("77", array_task) == "70_3"  # what squeue and the requeue use
    assert slurm.job_label("77", {}) == "77" and slurm.job_label(None, array_task) is None


@pytest.mark.parametrize("words,random_mode,message", [
    (["optim.lr=[0.1,"], False, "optim.lr=[0.1,: malformed value"),
    (["optim.lrr=[0.1,0.2]"], False, "unknown key 'optim.lrr' (did you mean 'optim.lr'?)"),
    (["optim.lr=[]"], False, "optim.lr=[]: empty grid"),
    (["optim.lr=[0.1,0.1]"], False, "0.1 is listed twice"),
    (["optim.lr=[0.1,0.2]"], True, "write optim.lr=choice(0.1,0.2)"),
    (["optim.lr=loguniform(1e-4,1e-1)"], False, "a distribution needs --random N"),
    (["optim.lr=loguniform(0,1)"], True, "loguniform(a,b) needs 0 < a < b"),
    (["optim.lr=uniform(1)"], True, "uniform(a,b) takes two numbers"),
    (["data.batch_size=32"], False, "nothing to sweep"),
    (["optim.lr=0.1", "optim.lr=[0.1,0.2]"], False, "optim.lr is both fixed and swept"),
    (["run.name=[a,b]"], False, "run.name cannot be swept"),
    (["run.name=x", "optim.lr=[0.1,0.2]"], False, "name the sweep with --name"),
])
def test_bad_words_are_one_line_errors(words, random_mode, message) -> None:
    with pytest.raises(UserError) as error:
        sweep_space.parse_words(words, random_mode)
    assert message in str(error.value) and "\n" not in str(error.value)


# ---------------------------------------------------------------------------------------------
# The command: bad input writes nothing and launches nothing


def _no_sbatch_path(tmp_path: Path) -> dict:
    empty = tmp_path / "bin"
    empty.mkdir()
    return {"PATH": str(empty)}


BAD_COMMANDS = [
    (["optim.lr=[0.1,"], "sweep error: optim.lr=[0.1,: malformed value"),
    (["optim.lrr=[0.1,0.2]"], "config error: unknown key 'optim.lrr' (did you mean 'optim.lr'?)"),
    (["optim.lr=[]"], "empty grid"),
    (["--random", "3", "optim.lr=[0.1,0.2]"], "write optim.lr=choice(0.1,0.2)"),
    # a value of the wrong type in one trial: found before anything starts
    (["optim.lr=[0.1,fast]"], "config error: optim.lr: expected a number, got 'fast'"),
    (["optim.lr=[0.1,0.2]", "--max-parallel", "2"], "--max-parallel is an option of --slurm"),
    (["optim.lr=[0.1,0.2]", "--slurm"], "--slurm needs sbatch, and it is not on PATH"),
]


@pytest.mark.parametrize("words,message", BAD_COMMANDS, ids=[m[:30] for _, m in BAD_COMMANDS])
def test_bad_input_exits_2_with_one_line_and_nothing_written(tmp_path: Path, words,
                                                             message) -> None:
    out_dir = tmp_path / "runs"
    env = _no_sbatch_path(tmp_path) if "--slurm" in words else None
    result = sweep(out_dir, *words, env=env)
    assert result.returncode == 2, result.stderr
    assert message in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr
    assert not out_dir.exists()


def test_a_tracker_not_installed_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    from conftest import without_module

    out_dir = tmp_path / "runs"
    env = without_module(tmp_path / "shim", "mlflow")
    result = sweep(out_dir, "optim.lr=[0.1,0.2]", "log.mlflow.enabled=[false,true]", env=env)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [
        "dtrain: missing dependency: log.mlflow.enabled needs the 'mlflow' extra "
        "(no module 'mlflow'): pip install 'dtrain[mlflow]'"]
    assert not out_dir.exists()  # not even the trials that would not use it


def test_a_folder_holding_something_else_is_refused_untouched(tmp_path: Path) -> None:
    out_dir = tmp_path / "runs"
    folder = out_dir / "mine"
    folder.mkdir(parents=True)
    (folder / "notes.txt").write_text("not a sweep")
    result = sweep(out_dir, "--name", "mine", "optim.lr=[0.1,0.2]")
    assert result.returncode == 2
    assert f"{folder} has files but no sweep.yaml" in result.stderr
    (folder / "sweep.yaml").write_text("learning_rates: [0.1, 0.2]\n")
    result = sweep(out_dir, "--name", "mine", "optim.lr=[0.1,0.2]")
    assert result.returncode == 2
    assert f"{folder}/sweep.yaml is not a sweep description" in result.stderr
    assert sorted(os.listdir(folder)) == ["notes.txt", "sweep.yaml"]
    assert (folder / "sweep.yaml").read_text() == "learning_rates: [0.1, 0.2]\n"


# ---------------------------------------------------------------------------------------------
# Locally, for real


@pytest.fixture(scope="module")
def grid(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, subprocess.CompletedProcess]:
    """A 2x2 grid of tiny single-process runs."""
    out_dir = tmp_path_factory.mktemp("grid") / "runs"
    result = sweep(out_dir, "--name", "g", "optim.lr=[0.05,0.1]", "data.batch_size=[16,32]")
    return out_dir / "g", result


NAMES = ["lr=0.05,batch_size=16", "lr=0.05,batch_size=32", "lr=0.1,batch_size=16",
         "lr=0.1,batch_size=32"]


@pytest.mark.slow
def test_local_grid_runs_each_trial_as_the_same_run_launched_directly(grid, tmp_path: Path) -> None:
    folder, result = grid
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"sweep g: 4 trials: 4 finished ({folder}/runs.csv)" in result.stdout.splitlines()[-1]
    data = yaml.safe_load((folder / "sweep.yaml").read_text())
    assert data["version"] == 1 and data["name"] == "g" and data["mode"] == "grid"
    assert data["config"] == str(REPO / CONFIG) and data["nproc"] == 1
    assert data["swept"] == list(SWEPT)
    assert data["space"] == {"optim.lr": {"values": [0.05, 0.1]},
                             "data.batch_size": {"values": [16, 32]}}
    assert [t["index"] for t in data["trials"]] == [0, 1, 2, 3]
    assert [t["name"] for t in data["trials"]] == NAMES
    assert data["trials"][3]["overrides"] == {"optim.lr": 0.1, "data.batch_size": 32}
    assert data["trials"][3]["run_dir"] == str(folder / NAMES[3])
    records = rows(folder)
    assert {n: r["status"] for n, r in records.items()} == dict.fromkeys(NAMES, "finished")
    assert records[NAMES[3]]["lr"] == "0.1" and records[NAMES[3]]["effective_batch"] == "32"

    direct = launch(tmp_path / "runs" / "direct", ["train.max_steps=4", "optim.lr=0.1",
                                                   "data.batch_size=32"], config=CONFIG)
    assert direct.returncode == 0, direct.stderr[-3000:]
    trial = losses(folder / NAMES[3])
    assert sorted(trial) == [1, 2, 3, 4]
    assert trial == direct.losses()  # bitwise: the same process, the same config
    assert without_place(folder / NAMES[3]) == without_place(direct.run_dir)
    assert losses(folder / NAMES[0]) != trial  # the trials do differ
    compared(folder, data["trials"])


@pytest.mark.slow
def test_running_the_sweep_again_launches_nothing_and_a_changed_grid_is_refused(grid) -> None:
    folder, first = grid
    assert first.returncode == 0
    before = (folder / "sweep.yaml").read_bytes(), (folder / "runs.csv").read_bytes()
    again = sweep(folder.parent, "--name", "g", "optim.lr=[0.05,0.1]", "data.batch_size=[16,32]")
    assert again.returncode == 0, again.stderr
    assert again.stdout.strip() == (f"sweep g: 4 trial(s), all 4 finished earlier; nothing to "
                                    f"launch ({folder})")
    changed = sweep(folder.parent, "--name", "g", "optim.lr=[0.05,0.2]", "data.batch_size=[16,32]")
    assert changed.returncode == 2
    assert ("sweep error: sweep g was made with other trials (optim.lr: [0.05, 0.1] -> "
            "[0.05, 0.2]); add --extend") in changed.stderr
    other_fixed = sweep(folder.parent, "--name", "g", "optim.lr=[0.05,0.1]",
                        "data.batch_size=[16,32]", "optim.momentum=0.5")
    assert other_fixed.returncode == 2
    assert "fixed optim.momentum: unset -> 0.5" in other_fixed.stderr
    assert ((folder / "sweep.yaml").read_bytes(), (folder / "runs.csv").read_bytes()) == before


@pytest.mark.slow
def test_train_sweep_runs_one_trial_of_the_file_and_names_a_missing_one(grid) -> None:
    folder, first = grid
    assert first.returncode == 0
    missing = dtrain("train", "--sweep", str(folder / "sweep.yaml"), "--trial", "9")
    assert missing.returncode == 2
    assert "sweep error: sweep g has no trial 9 (it has 4: 0-3)" in missing.stderr
    unsaid = dtrain("train", "--sweep", str(folder))
    assert unsaid.returncode == 2 and "which trial? pass --trial I" in unsaid.stderr
    both = dtrain("train", "--sweep", str(folder), "--config", CONFIG, "--trial", "0")
    assert both.returncode == 2 and "drop --config" in both.stderr


@pytest.mark.slow
def test_extend_appends_the_new_trials_and_runs_them_under_torchrun(grid, tmp_path: Path) -> None:
    folder, first = grid
    assert first.returncode == 0
    result = sweep(folder.parent, "--name", "g", "optim.lr=[0.05,0.1,0.2]", "data.batch_size=[16]",
                   "--extend", "--nproc", "2")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "sweep g: 1 trial(s) added, 5 in all, 4 finished earlier; launching 1" in result.stdout
    assert "--nproc_per_node=2" in result.stdout
    data = yaml.safe_load((folder / "sweep.yaml").read_text())
    assert [t["name"] for t in data["trials"]] == [*NAMES, "lr=0.2,batch_size=16"]
    assert data["trials"][4]["index"] == 4 and data["nproc"] == 2
    records = rows(folder)
    assert records["lr=0.2,batch_size=16"]["status"] == "finished"
    assert records["lr=0.2,batch_size=16"]["world_size"] == "2"
    assert all(records[n]["attempts"] == "1" for n in NAMES)  # the others were not run again
    direct = launch(tmp_path / "runs" / "direct", ["train.max_steps=4", "optim.lr=0.2",
                                                   "data.batch_size=16"], config=CONFIG, nproc=2)
    assert direct.returncode == 0, direct.stderr[-3000:]
    assert losses(folder / "lr=0.2,batch_size=16") == direct.losses()


@pytest.mark.slow
def test_a_killed_trial_is_recorded_failed_and_the_sweep_goes_on(tmp_path: Path) -> None:
    """The first trial's model kills its own process at its second step (as the OOM killer
    would): its record cannot say so itself, the sweep's does; the second trial runs."""
    out_dir = tmp_path / "runs"
    words = ["--name", "crash", "model.name=user_code:faulty_cnn",
             "model.args={width: 8, fault: kill, on_rank: 0}", "model.args.at_call=[2,1000]",
             "optim.lr=0.05", "data.batch_size=16"]
    result = sweep(out_dir, *words)
    folder = out_dir / "crash"
    assert result.returncode == 1, result.stderr[-3000:]
    assert result.stdout.splitlines()[-1] == (
        f"sweep crash: 2 trials: 1 failed, 1 finished; failed: at_call=2 ({folder}/runs.csv)")
    records = rows(folder)
    assert records["at_call=2"]["status"] == "failed"
    assert records["at_call=2"]["error"] == "killed by SIGKILL"
    assert records["at_call=1000"]["status"] == "finished"
    assert sorted(losses(folder / "at_call=1000")) == [1, 2, 3, 4]

    again = sweep(out_dir, *words)  # only the failed trial is launched again
    assert again.returncode == 1
    assert "sweep crash: 2 trial(s), 1 finished earlier; launching 1" in again.stdout
    assert "trial 0 (1/1) at_call=2" in again.stdout and "trial 1 (" not in again.stdout
    assert rows(folder)["at_call=1000"]["attempts"] == "1"

    # a trial that another process runs now is left to it, not launched a second time
    from dtrain.files.store import RunDirLock
    lock = RunDirLock(str(folder / "at_call=2"))
    lock.acquire("77")
    try:
        busy = sweep(out_dir, *words)
    finally:
        lock.release()
    assert busy.returncode == 1
    assert (f"trial 0 at_call=2 skipped: run error: the run directory {folder}/at_call=2 is in "
            f"use by another run") in busy.stdout
    assert "trial 0 (1/1)" not in busy.stdout and rows(folder)["at_call=2"]["attempts"] == "1"


@pytest.mark.slow
def test_ctrl_c_checkpoints_the_running_trial_and_starts_no_other(tmp_path: Path) -> None:
    out_dir = tmp_path / "runs"
    folder = out_dir / "stop"
    words = ["--name", "stop", "model.name=user_code:slow_cnn", PACED, "train.max_steps=30",
             "optim.lr=[0.05,0.1]", "data.batch_size=16"]
    args = [sys.executable, "-m", "dtrain", "sweep", "--config", CONFIG, f"run.out_dir={out_dir}",
            *FIXED, *words]
    proc = forkserver.popen(args, cwd=REPO, env=child_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)
    wait_for_step(folder / "lr=0.05" / "metrics.jsonl", 3, proc, timeout=180)
    proc.send_signal(signal.SIGINT)
    stdout, _ = proc.communicate(timeout=120)
    assert proc.returncode == 1, stdout
    assert stdout.splitlines()[-1] == (
        f"sweep stop: 2 trials: 1 preempted, 1 not run; stopped by SIGINT: run the same command "
        f"again to continue ({folder}/runs.csv)")
    assert not (folder / "lr=0.1").exists()
    stopped_at = max(losses(folder / "lr=0.05"))
    assert 3 <= stopped_at < 30

    again = sweep(out_dir, *words)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resumed from" in again.stderr
    assert {r["status"] for r in rows(folder).values()} == {"finished"}
    assert train_steps(folder / "lr=0.05") == list(range(1, 31))


# ---------------------------------------------------------------------------------------------
# A SLURM job array


def signal_batch_shell(task: Job, signum: int) -> None:
    """What `--signal=B:USR1@...` does before the time limit, done by hand. Not `scancel
    --signal --batch` on an array task: while other tasks of a throttled array wait, the
    controller delivers the signal yet answers "try again later", and scancel's retries, seconds
    apart, reach the task again after its requeue."""
    own_id = task.fields()["JobId"]  # the task's own job id, as listpids knows it
    proc = subprocess.run(["scontrol", "listpids", own_id], env=slurm_env(), capture_output=True,
                          text=True, timeout=60, check=True)
    shells = [int(line.split()[0]) for line in proc.stdout.splitlines()[1:]
              if line.split()[2:4] == ["batch", "0"]]
    assert len(shells) == 1, proc.stdout
    os.kill(shells[0], signum)


def _running_tasks(job: str) -> int:
    proc = subprocess.run(["squeue", "-h", "-t", "RUNNING", "-o", "%i", "-j", job],
                          env=slurm_env(), capture_output=True, text=True, timeout=60)
    return len(proc.stdout.split()) if proc.returncode == 0 else 0


@pytest.mark.slurm
@pytest.mark.slow
@needs_cluster
def test_slurm_array_sweep_with_one_preempted_task_resumed_bitwise(tmp_path: Path) -> None:
    out_dir = tmp_path / "runs"
    folder = out_dir / "arr"
    steps = 32
    words = ["--name", "arr", "--slurm", "--max-parallel", "2",
             "--sbatch-args=--ntasks-per-node=1 --gpus-per-node=0 --cpus-per-task=1 --time=10",
             "model.name=user_code:slow_cnn", PACED, f"train.max_steps={steps}",
             "optim.lr=[0.05,0.1]", "run.seed=[0,1]", "data.batch_size=16"]
    result = sweep(out_dir, *words, env=slurm_env())
    assert result.returncode == 0, result.stderr
    submitted = [line for line in result.stdout.splitlines() if line.startswith("submitted")]
    assert len(submitted) == 1, result.stdout
    array = submitted[0].removeprefix("submitted array job ")
    assert array.isdigit(), submitted
    data = yaml.safe_load((folder / "sweep.yaml").read_text())
    assert data["jobs"][0]["id"] == array and data["jobs"][0]["trials"] == [0, 1, 2, 3]
    names = [t["name"] for t in data["trials"]]
    assert names == ["lr=0.05,seed=0", "lr=0.05,seed=1", "lr=0.1,seed=0", "lr=0.1,seed=1"]
    tasks = [Job(f"{array}_{i}", folder / f"slurm-{array}_{i}.out") for i in range(4)]
    assert tasks[0].fields().get("ArrayTaskThrottle") == "2"
    # while the array runs, the same sweep again would run its trials twice: refused
    meanwhile = sweep(out_dir, *words, env=slurm_env())
    assert meanwhile.returncode == 2
    assert f"array job {array} of sweep arr is still queued or running" in meanwhile.stderr

    # Task 0: the time-limit warning to its batch shell mid-run; it checkpoints and requeues
    # itself alone, then resumes its own trial.
    tasks[0].wait_for_step(folder / names[0], 4)
    signal_batch_shell(tasks[0], signal.SIGUSR1)
    most_running, deadline = 0, time.monotonic() + 400
    while time.monotonic() < deadline:
        most_running = max(most_running, _running_tasks(array))
        if all(t.fields().get("JobState") in ("COMPLETED", "FAILED", "CANCELLED") for t in tasks):
            break
        time.sleep(0.5)
    ends = [t.wait_end(timeout=60) for t in tasks]
    outputs = [t.output() for t in tasks]
    assert [(f["JobState"], f["ExitCode"]) for f in ends] == [("COMPLETED", "0:0")] * 4, \
        outputs[0][-4000:]
    assert [f["Restarts"] for f in ends] == ["1", "0", "0", "0"]
    assert 1 <= most_running <= 2

    out = outputs[0]
    job = f"{array}_0"
    assert f"dtrain: job {job} (restart 0)" in out and f"dtrain: job {job} (restart 1)" in out
    assert f"dtrain: sweep arr trial 0 {names[0]} as SLURM job {job}" in out
    assert f"dtrain: job {job} got SIGUSR1: asking every rank to checkpoint and stop" in out
    assert f"requeueing SLURM job {job}" in out
    assert f"resumed from {folder / names[0]}/checkpoints/step_" in out
    for i in (1, 2, 3):
        assert f"dtrain: job {array}_{i} (restart 0)" in outputs[i]
        assert "requeueing" not in outputs[i] and "resumed from" not in outputs[i]

    records = rows(folder)
    assert {n: records[n]["status"] for n in names} == dict.fromkeys(names, "finished")
    assert records[names[0]]["attempts"] == "2"
    assert [records[n]["slurm_job"] for n in names] == [f"{array}_{i}" for i in range(4)]
    compared(folder, data["trials"])
    # every step once, across both attempts; the numbers are those of an uninterrupted run
    assert train_steps(folder / names[0]) == list(range(1, steps + 1))
    direct = launch(tmp_path / "direct" / "run", [
        "model.name=user_code:slow_cnn", "model.args={width: 8, sleep_s: 0}",
        f"train.max_steps={steps}", "optim.lr=0.05", "run.seed=0", "data.batch_size=16"],
        config=CONFIG, nproc=1)
    assert direct.returncode == 0, direct.stderr[-3000:]
    assert losses(folder / names[0]) == direct.losses()

    # the whole sweep again: nothing left to submit
    again = sweep(out_dir, *words, env=slurm_env())
    assert again.returncode == 0, again.stderr
    assert "nothing to launch" in again.stdout and "submitted" not in again.stdout
