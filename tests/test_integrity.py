"""Never lose a run, round 2: the order of saves, one owner per run directory, config changes on
resume, non-finite gradients, sharded checkpoints that fail like full ones, and fresh states after
a failed fallback. Every run is a real launch; faults come from users' code or from the files."""

from __future__ import annotations

import json
import os
import pickle
import re
import shutil
import signal
import subprocess
from pathlib import Path

import pytest
import torch

from conftest import REPO, Result, kill_tree, latest, launch, start, wait_for_step

SAVES = ["ckpt.every_steps=5", "train.eval_every_epochs=0", "ckpt.every_epochs=0"]


def checkpoint_dirs(run_dir: Path) -> dict[int, Path]:
    """Complete checkpoints by step."""
    folder = run_dir / "checkpoints"
    found = {}
    for path in folder.iterdir():
        if path.is_dir() and (path / "COMPLETE").exists():
            found[json.loads((path / "COMPLETE").read_text())["step"]] = path
    return found


def superseded(run_dir: Path) -> list[Path]:
    root = run_dir / "superseded"
    return sorted(root.iterdir()) if root.exists() else []


# ---------------------------------------------------------------------------------------------
# Checkpoint order is save order

LONG = [*SAVES, "train.max_steps=20", "ckpt.keep_last=10"]


@pytest.fixture(scope="module")
def long_run(tmp_path_factory) -> Result:
    """Checkpoints at steps 5, 10, 15 and 20 (copied and resumed by the tests of save order, of
    config changes on resume and of links in the run directory)."""
    run_dir = tmp_path_factory.mktemp("long") / "runs" / "run"
    result = launch(run_dir, LONG)
    assert result.returncode == 0, result.stderr[-3000:]
    assert sorted(checkpoint_dirs(run_dir)) == [5, 10, 15, 20]
    return result


def test_fresh_start_in_a_used_directory_moves_the_old_history_aside(long_run, tmp_path) -> None:
    run_dir = tmp_path / "runs" / "run"
    shutil.copytree(long_run.run_dir, run_dir)
    fresh = launch(run_dir, [*SAVES, "train.max_steps=10", "ckpt.keep_last=2", "ckpt.resume=none"])
    assert fresh.returncode == 0, fresh.stderr[-3000:]
    # The new saves survive rotation, `latest` names the newest of them...
    assert sorted(checkpoint_dirs(run_dir)) == [5, 10]
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == checkpoint_dirs(run_dir)[10].name
    # ...and the abandoned run is kept aside, with its records: nothing deleted, nothing mixed.
    [aside] = superseded(run_dir)
    assert sorted(p.name[:11] for p in (aside / "checkpoints").iterdir()) == \
        ["step_000005", "step_000010", "step_000015", "step_000020"]
    assert [r["step"] for r in map(json.loads, (aside / "metrics.jsonl").read_text().splitlines())
            if "loss" in r][-1] == 20
    assert [r["step"] for r in fresh.records() if "loss" in r] == list(range(1, 11))
    assert "fresh start (ckpt.resume=none): moved" in (run_dir / "log.txt").read_text()
    # The next automatic resume continues the new run, not the abandoned one at step 20.
    again = launch(run_dir, [*SAVES, "train.max_steps=10", "ckpt.keep_last=2"])
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"resumed from {checkpoint_dirs(run_dir)[10]}" in again.stderr


def test_rewind_moves_later_checkpoints_aside_and_continues_exactly(long_run, tmp_path) -> None:
    run_dir = tmp_path / "runs" / "run"
    shutil.copytree(long_run.run_dir, run_dir)
    ten = checkpoint_dirs(run_dir)[10]
    rewound = launch(run_dir, [*SAVES, "train.max_steps=20", "ckpt.keep_last=10", f"ckpt.resume={ten}"])
    assert rewound.returncode == 0, rewound.stderr[-3000:]
    log = (run_dir / "log.txt").read_text()
    assert f"rewound to {ten.name}: moved" in log
    [aside] = superseded(run_dir)
    assert sorted(p.name[:11] for p in (aside / "checkpoints").iterdir()) == ["step_000015", "step_000020"]
    # Records after step 10 belong to the abandoned history: moved aside, each step once here.
    assert [r["step"] for r in rewound.records() if "loss" in r] == list(range(1, 21))
    assert [json.loads(line)["step"] for line in (aside / "metrics.jsonl").read_text().splitlines()][0] == 11
    # The same data and seed: the rewound run repeats steps 11..20 exactly.
    assert rewound.losses() == long_run.losses()
    new = checkpoint_dirs(run_dir)
    assert sorted(new) == [5, 10, 15, 20]
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == new[20].name
    assert json.loads((new[20] / "COMPLETE").read_text())["seq"] > \
        json.loads((new[10] / "COMPLETE").read_text())["seq"]


def test_damaged_newest_checkpoint_is_moved_aside_not_rotated_over(long_run, tmp_path) -> None:
    run_dir = tmp_path / "runs" / "run"
    shutil.copytree(long_run.run_dir, run_dir)
    newest = checkpoint_dirs(run_dir)[20]
    (newest / "checkpoint.pt").write_bytes(os.urandom((newest / "checkpoint.pt").stat().st_size))
    result = launch(run_dir, [*SAVES, "train.max_steps=20", "ckpt.keep_last=2"])
    assert result.returncode == 0, result.stderr[-3000:]
    [aside] = superseded(run_dir)
    assert [p.name for p in (aside / "checkpoints").iterdir()] == [newest.name]
    assert sorted(checkpoint_dirs(run_dir)) == [15, 20]  # the re-done 20 is the newest
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == newest.name
    assert torch.load(newest / "checkpoint.pt", weights_only=True)["train_state"]["step"] == 20


# ---------------------------------------------------------------------------------------------
# One run directory, one owner

SLOW_RUN = ["model.name=user_code:slow_cnn", "model.args={width: 8, sleep_s: 0.1}",
            "train.epochs=100", "ckpt.every_steps=10", "train.log_every=1"]


def test_a_second_launch_on_a_busy_run_directory_exits_2_and_harms_nothing(tmp_path) -> None:
    run_dir = tmp_path / "runs" / "busy"
    first = start(run_dir, SLOW_RUN, nproc=0)
    try:
        wait_for_step(run_dir / "metrics.jsonl", 12, first, timeout=120)
        second = launch(run_dir, SLOW_RUN, nproc=2)
        assert second.returncode != 0
        assert "exitcode  : 2" in second.stderr
        line = f"dtrain: run error: the run directory {run_dir} is in use by another run (host "
        assert second.stderr.count(line) == 1, second.stderr[-3000:]
        assert f"pid {first.pid}" in second.stderr and "another run.name" in second.stderr
        assert first.poll() is None, "the first run must still be running"
        first.send_signal(signal.SIGTERM)  # it saves at the next step and ends
        assert first.wait(timeout=120) == 0
    finally:
        kill_tree(first.pid, signal.SIGKILL)
    # The first run was not disturbed: every record once and in order, its checkpoints, its log.
    steps = [r["step"] for r in Result(0, "", "", run_dir).records() if "loss" in r]
    assert steps == list(range(1, steps[-1] + 1))
    # Every 10 steps, at each epoch's end (32 steps) and at the SIGTERM: the last three kept
    # (keep_last 3), and the best one. (How many steps ran while the second launch was refused
    # depends on the machine's load.)
    saved = sorted(checkpoint_dirs(run_dir))
    made = sorted({*range(10, steps[-1], 10), *range(32, steps[-1], 32), steps[-1]})
    assert saved[-1] == steps[-1] and set(made[-3:]) <= set(saved), (made, saved)
    assert len(saved) <= 4 and set(saved) <= set(made), (made, saved)
    assert "in use by another run" not in (run_dir / "log.txt").read_text()


def test_a_killed_run_leaves_no_stale_lock(tmp_path) -> None:
    run_dir = tmp_path / "runs" / "killed"
    first = start(run_dir, [*SLOW_RUN, "data.num_workers=2"], nproc=0)
    wait_for_step(run_dir / "metrics.jsonl", 12, first, timeout=120)
    kill_tree(first.pid, signal.SIGKILL)
    first.wait(timeout=30)
    # At once, even though loader workers of the killed run may still be exiting.
    again = launch(run_dir, [*SLOW_RUN, "data.num_workers=2", "train.max_steps=14",
                             "ckpt.resume_config_change=allow"])
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resumed from" in again.stderr and "step_000010" in again.stderr


def test_resuming_with_a_config_that_trains_something_else_is_refused(long_run, tmp_path) -> None:
    run_dir = tmp_path / "runs" / "run"
    shutil.copytree(long_run.run_dir, run_dir)
    table = run_dir.parent / "runs.csv"
    shutil.copy(long_run.run_dir.parent / "runs.csv", table)
    saved_config, saved_table = (run_dir / "config.yaml").read_bytes(), table.read_bytes()
    assert ",finished," in saved_table.decode()
    before = {p: p.stat().st_mtime_ns for p in run_dir.rglob("*")}
    refused = launch(run_dir, [*LONG, "train.max_steps=24", "optim.lr=0.01"])
    assert refused.returncode == 2
    # The refused launch wrote nothing of the run's: its config and its record (finished) stay.
    assert (run_dir / "config.yaml").read_bytes() == saved_config
    assert table.read_bytes() == saved_table
    assert refused.stderr.count("dtrain: checkpoint error:") == 1 and "Traceback" not in refused.stderr
    # Only what changes what is learned is named: a longer run alone would be allowed.
    assert ("was saved by a config that trains something else (optim.lr: 0.05 -> 0.01); to "
            "continue it on purpose set ckpt.resume_config_change=allow") in refused.stderr
    changed = [p for p in run_dir.rglob("*") if p.exists() and p.stat().st_mtime_ns != before.get(p)
               and p.name not in ("log.txt", ".lock")]
    assert changed == [] and not superseded(run_dir)  # nothing of the run was touched
    # Keys that do not change what is trained may change freely (here: logging and loaders).
    allowed = launch(run_dir, [*LONG, "log.every_s=5", "data.num_workers=1"])
    assert allowed.returncode == 0, allowed.stderr[-3000:]
    # On purpose: logged, and the run goes on to the new length.
    extended = launch(run_dir, [*LONG, "train.max_steps=24", "optim.lr=0.01",
                                "ckpt.resume_config_change=allow"])
    assert extended.returncode == 0, extended.stderr[-3000:]
    assert "with a changed config (ckpt.resume_config_change=allow): optim.lr: 0.05 -> 0.01" in \
        extended.stderr
    assert [r["step"] for r in extended.records() if "loss" in r][-1] == 24


def test_an_unnamed_run_is_named_after_its_slurm_job_or_its_config() -> None:
    from dtrain import config
    from dtrain.process.env import Env
    from dtrain.run import resolve_run_name
    for path in sorted((REPO / "configs").glob("*.yaml")):
        assert config.load(str(path)).run.name is None, f"{path.name} names its run"
    cfg = config.load(str(REPO / "configs" / "default.yaml"))
    cfg = resolve_run_name(cfg, Env(launcher="slurm", slurm_job_id="4711"), "configs/default.yaml")
    assert cfg.run.name == "job_4711"
    cfg = config.load(str(REPO / "configs" / "default.yaml"))
    cfg = resolve_run_name(cfg, Env(launcher="torchrun"), "configs/default.yaml")
    assert cfg.run.name == "default"
    cfg = config.load(None, ["run.name=mine"])
    cfg = resolve_run_name(cfg, Env(launcher="slurm", slurm_job_id="4711"), None)
    assert cfg.run.name == "mine"


def test_ports_of_jobs_sharing_a_first_node_rarely_collide() -> None:
    from dtrain.process.env import port_for_job
    assert port_for_job("12345") != port_for_job("22345")  # equal last four digits
    ports = {port_for_job(str(j)) for j in range(123456, 143456)}
    assert len(ports) == 20000  # any two jobs less than 20000 apart
    assert all(15000 <= p < 35000 for p in ports)
    assert 15000 <= port_for_job("123_4") < 35000


def test_monitor_must_name_a_reported_metric(tmp_path) -> None:
    result = launch(tmp_path / "runs" / "r", ["ckpt.monitor=val_accuracy"])
    assert result.returncode == 2
    assert ("config error: ckpt.monitor: 'val_accuracy' is not a metric the classification task "
            "reports; use one of val_loss, val_acc (did you mean 'val_acc'?)") in result.stderr
    assert not (tmp_path / "runs").exists()


def test_the_torch_floor_covers_what_the_scripts_use() -> None:
    import re
    floor = re.search(r'"torch>=([0-9.]+)"', (REPO / "pyproject.toml").read_text()).group(1)
    # torchrun forwards SIGUSR1 (--signals-to-handle) from torch 2.9 on.
    if "--signals-to-handle" in (REPO / "slurm" / "train_torchrun.sbatch").read_text():
        assert tuple(map(int, floor.split("."))) >= (2, 9)


# ---------------------------------------------------------------------------------------------
# Non-finite gradients, every time

INF_GRAD = "model.name=user_code:inf_grad_cnn"


@pytest.mark.slow
def test_infinite_gradients_with_a_finite_loss_are_skipped_and_never_saved(tmp_path) -> None:
    result = launch(tmp_path / "runs" / "r", [INF_GRAD, "model.args={width: 8, at_call: 4, on_rank: 1}",
                                              "train.nan_policy=skip", "ckpt.every_steps=1",
                                              "train.max_steps=6", "ckpt.keep_last=10"], nproc=2)
    assert result.returncode == 0, result.stderr[-3000:]
    log = (result.run_dir / "log.txt").read_text()
    assert "step 4: non-finite loss or gradients, optimizer step skipped (1 in a row, 1 in all)" in log
    assert "step 4: non-finite" in (result.run_dir / "log.rank1.txt").read_text()  # every rank agrees
    losses = result.losses()
    assert all(torch.isfinite(torch.tensor(v)) for s, v in losses.items() if s != 4)
    by_step = {s: torch.load(p / "checkpoint.pt", weights_only=True)
               for s, p in checkpoint_dirs(result.run_dir).items()}
    assert sorted(by_step) == [1, 2, 3, 4, 5, 6]
    for step, ckpt in by_step.items():
        assert all(torch.isfinite(w).all() for w in ckpt["model"].values()), step
    assert all(torch.equal(by_step[3]["model"][k], by_step[4]["model"][k]) for k in by_step[3]["model"])
    stopped = launch(tmp_path / "runs" / "s", [INF_GRAD, "model.args={width: 8, at_call: 4}",
                                               "ckpt.every_steps=1"])
    assert stopped.returncode == 1
    assert "dtrain: non-finite loss or gradients at step 4; stopping (train.nan_policy=stop)" in stopped.stderr
    assert latest(stopped.run_dir).name.startswith("step_000003")


# ---------------------------------------------------------------------------------------------
# Sharded checkpoints: errors and safety like full ones

SHARDED = ["ckpt.format=sharded", "train.max_steps=10", "ckpt.every_steps=2", "ckpt.keep_last=5",
           *SAVES[1:]]


@pytest.fixture(scope="module")
def sharded_run(tmp_path_factory) -> Result:
    """A 2-rank FSDP run with sharded checkpoints at steps 2, 4, 6, 8 and 10."""
    run_dir = tmp_path_factory.mktemp("sharded") / "runs" / "run"
    result = launch(run_dir, [*SHARDED, "parallel.mode=fsdp"], nproc=2)
    assert result.returncode == 0, result.stderr[-3000:]
    assert sorted(checkpoint_dirs(run_dir)) == [2, 4, 6, 8, 10]
    return result


# Each damage on a checkpoint of its own, newest first: one 2-rank resume tries them in turn, each
# found unusable and the previous one tried next, and goes on from step 2, the newest intact one.
DAMAGED_AT = {"truncated_shard": 10, "random_bytes_in_shard": 8, "no_metadata": 6,
              "random_metadata": 4}


@pytest.fixture(scope="module")
def damaged_sharded(sharded_run, tmp_path_factory) -> Result:
    run_dir = tmp_path_factory.mktemp("damaged_sharded") / "runs" / "run"
    shutil.copytree(sharded_run.run_dir, run_dir)
    for damage, step in DAMAGED_AT.items():
        dcp = checkpoint_dirs(run_dir)[step] / "dcp"
        shard, metadata = dcp / "__1_0.distcp", dcp / ".metadata"
        if damage == "truncated_shard":
            shard.write_bytes(shard.read_bytes()[:100])
        elif damage == "random_bytes_in_shard":
            shard.write_bytes(os.urandom(shard.stat().st_size))
        elif damage == "no_metadata":
            metadata.unlink()
        else:
            metadata.write_bytes(os.urandom(metadata.stat().st_size))
    return launch(run_dir, [*SHARDED, "parallel.mode=fsdp"], nproc=2)


@pytest.mark.slow
def test_a_2_rank_sharded_sgd_checkpoint_resumes_in_one_process(sharded_run, tmp_path) -> None:
    """A single process builds fused SGD (no shards to forbid it); the checkpoint's optimizer
    settings, saved by a sharded run whose SGD could not be fused, must not switch that off
    under the trainer's masked step (it did: an assertion inside SGD.step)."""
    run_dir = tmp_path / "runs" / "run"
    shutil.copytree(sharded_run.run_dir, run_dir)
    result = launch(run_dir, [*SHARDED[:1], "train.max_steps=14", "ckpt.every_steps=4",
                              *SAVES[1:], "parallel.mode=fsdp"])
    assert result.returncode == 0, result.stderr[-3000:]
    assert "(world size 2 -> 1)" in result.stderr
    assert [r["step"] for r in result.records() if "loss" in r][-4:] == [11, 12, 13, 14]


@pytest.mark.slow
def test_the_marker_of_a_sharded_save_lists_every_ranks_files(sharded_run) -> None:
    marker = json.loads((latest(sharded_run.run_dir) / "COMPLETE").read_text())
    assert {"dcp/__0_0.distcp", "dcp/__1_0.distcp", "dcp/.metadata", "meta.pt"} <= set(marker["files"])


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["truncated_shard", "random_bytes_in_shard", "no_metadata",
                                    "random_metadata"])
def test_damaged_sharded_checkpoint_falls_back_to_the_previous_one(
        sharded_run, damaged_sharded, damage) -> None:
    result, step = damaged_sharded, DAMAGED_AT[damage]
    assert result.returncode == 0, result.stderr[-3000:]
    # What the resume tried, in order: each damaged checkpoint, then the previous one.
    tried = [line for line in result.stderr.splitlines()
             if " is unusable (" in line or "resumed from" in line]
    damaged, previous = (checkpoint_dirs(sharded_run.run_dir)[s].name for s in (step, step - 2))
    [mine] = [i for i, line in enumerate(tried) if f"checkpoint {damaged} is unusable (" in line]
    assert previous in tried[mine + 1], tried
    assert "resumed from" in result.stderr and "step_000002" in result.stderr.split("resumed from")[1]
    assert [r["step"] for r in result.records() if "loss" in r] == list(range(1, 11))
    assert result.losses() == sharded_run.losses()  # steps 3..10 again, exactly


class _RunsCode:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


# One single-process sharded run of 3 steps, for the four tests below: each test that damages it
# damages a copy; one compares its losses with a fresh start after a failed fallback.
@pytest.fixture(scope="module")
def one_process_sharded(tmp_path_factory) -> Result:
    result = launch(tmp_path_factory.mktemp("one_process_sharded") / "runs" / "run",
                    ["ckpt.format=sharded", "train.max_steps=3"])
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def test_sharded_metadata_that_would_run_code_is_refused(one_process_sharded, tmp_path) -> None:
    run_dir = tmp_path / "runs" / "first"
    shutil.copytree(one_process_sharded.run_dir, run_dir)
    folder = latest(run_dir)
    pwned = tmp_path / "pwned"
    (folder / "dcp" / ".metadata").write_bytes(pickle.dumps(_RunsCode(str(pwned))))
    marker = json.loads((folder / "COMPLETE").read_text())
    marker["files"]["dcp/.metadata"] = (folder / "dcp" / ".metadata").stat().st_size
    # Whoever can write the files can write the marker's digests too: they find accidents, and
    # the allow-list is what stops a crafted file.
    from dtrain.files.digests import file_digest, seal
    marker["digests"]["dcp/.metadata"] = file_digest(str(folder / "dcp" / ".metadata"))
    (folder / "COMPLETE").write_text(json.dumps(seal(marker)))
    result = launch(tmp_path / "runs" / "victim", ["ckpt.format=sharded", f"ckpt.resume={folder}"])
    assert result.returncode == 2, result.stderr[-2000:]
    assert "checkpoint error" in result.stderr and "is not allowed in checkpoint metadata" in result.stderr
    assert "Traceback" not in result.stderr
    assert not pwned.exists()


def test_sharded_checkpoint_of_another_model_names_the_keys(one_process_sharded, tmp_path) -> None:
    result = launch(tmp_path / "runs" / "resnet", ["model.name=resnet_small", "ckpt.format=sharded",
                                                   f"ckpt.resume={latest(one_process_sharded.run_dir)}",
                                                   "ckpt.resume_config_change=allow"])
    assert result.returncode == 2, result.stderr[-2000:]
    assert "checkpoint is from a different model: 54 key(s) missing (e.g. ['layers.0.0.bn1.bias'" in \
        result.stderr
    assert "Traceback" not in result.stderr


def test_disk_full_during_a_sharded_save_keeps_the_previous_checkpoint(one_process_sharded,
                                                                        tmp_path) -> None:
    common = ["ckpt.format=sharded", "ckpt.every_steps=2", "train.log_every=100"]
    # The size of one checkpoint of this job (the saves of steps 2 and 3 are alike).
    size = sum(f.stat().st_size for f in latest(one_process_sharded.run_dir).rglob("*") if f.is_file())
    disk = tmp_path / "disk"
    disk.mkdir()
    kib = (size * 3 // 2 + 48 * 1024) // 1024
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={kib}k", "tmpfs", str(disk)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a size-limited tmpfs here: {mounted.stderr.strip()}")
    try:
        result = launch(disk / "runs" / "r", [*common, "train.max_steps=6"])
        assert result.returncode == 1, result.stderr[-3000:]
        assert "dtrain: checkpoint error: disk full while saving step_000004" in result.stderr
        assert "Traceback" not in result.stderr and "the previous checkpoint is kept" in result.stderr
        assert latest(result.run_dir).name.startswith("step_000002")
        assert not [p for p in (result.run_dir / "checkpoints").iterdir() if p.name.startswith(".tmp")]
    finally:
        subprocess.run(["umount", str(disk)], capture_output=True)


def test_a_fallback_chain_that_ends_fresh_starts_from_fresh_state(one_process_sharded, tmp_path) -> None:
    """The model part of the only checkpoint reads fine, its optimizer part does not: the fresh
    start must not keep the weights read before the failure."""
    first = one_process_sharded
    run_dir = tmp_path / "runs" / "run"
    shutil.copytree(first.run_dir, run_dir)
    shard = next((latest(run_dir) / "dcp").glob("__0_*.distcp"))
    data = bytearray(shard.read_bytes())
    data[-2000:] = os.urandom(2000)  # the last items written: the optimizer's
    shard.write_bytes(bytes(data))
    again = launch(run_dir, ["ckpt.format=sharded", "train.max_steps=3"])
    assert again.returncode == 0, again.stderr[-3000:]
    assert "unusable" in again.stderr and "fresh start" in again.stderr
    # The first run was a fresh start of the same job: the relaunch has its numbers.
    assert sorted(first.losses()) == [1, 2, 3]
    assert again.losses() == first.losses()


# ---------------------------------------------------------------------------------------------
# The schedule keeps its length across a change of world size

@pytest.mark.slow
def test_resuming_on_another_world_size_keeps_the_schedule(tmp_path) -> None:
    import math
    run_dir = tmp_path / "runs" / "run"
    common = ["model.name=user_code:slow_cnn", "model.args={width: 8, sleep_s: 0.05}",
              "train.epochs=2", "sched.name=cosine", "ckpt.every_steps=4"]
    proc = start(run_dir, common, nproc=2)
    try:
        wait_for_step(run_dir / "metrics.jsonl", 6, proc, timeout=180)
    finally:
        kill_tree(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    resumed = launch(run_dir, common)  # one process: 32 steps per epoch instead of 16
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "world size changed from 2 to 1" in resumed.stderr
    total = 2 * 512 // (16 * 2)  # the schedule's length when the run started: 32 steps
    records = [r for r in resumed.records() if "lr" in r]
    assert len(records) > 40
    for r in records:
        expected = 0.05 * 0.5 * (1 + math.cos(math.pi * min(1.0, (r["step"] - 1) / total)))
        assert r["lr"] == pytest.approx(expected, rel=1e-9, abs=1e-12), r


# ---------------------------------------------------------------------------------------------
# BatchNorm statistics under FSDP

RESNET = ["model.name=resnet_small", "model.args={width: 8}", "train.max_steps=10",
          "ckpt.format=full", "train.eval_every_epochs=0"]


def evaluate_on_one_process(weights: dict, width: int = 8) -> tuple[float, float]:
    """The validation loss and accuracy of `weights`, computed here by hand."""
    from dtrain.data import synthetic
    from dtrain.models import ResNetSmall
    model = ResNetSmall(num_classes=10, width=width)
    model.load_state_dict(weights)
    images, labels = synthetic.generate(100, "val")
    mean = torch.tensor([0.5] * 3).view(3, 1, 1) * 255
    inv_std = 1.0 / (torch.tensor([0.25] * 3).view(3, 1, 1) * 255)
    with torch.no_grad():
        logits = model.eval()((images.float() - mean) * inv_std)
    loss = torch.nn.functional.cross_entropy(logits, labels).item()
    return loss, (logits.argmax(1) == labels).float().mean().item()


@pytest.mark.slow
def test_batchnorm_statistics_are_the_same_on_every_rank_and_in_the_checkpoint(tmp_path) -> None:
    result = launch(tmp_path / "runs" / "bn", [*RESNET, "parallel.mode=fsdp"], nproc=2)
    assert result.returncode == 0, result.stderr[-3000:]
    final = result.evals()[-1]
    weights = torch.load(latest(result.run_dir) / "checkpoint.pt", weights_only=True)["model"]
    loss, accuracy = evaluate_on_one_process(weights)
    assert final["val_loss"] == pytest.approx(loss, abs=1e-5)
    assert final["val_acc"] == pytest.approx(accuracy, abs=1e-6)


@pytest.fixture(scope="module")
def one_process_both_batches(tmp_path_factory) -> Result:
    result = launch(tmp_path_factory.mktemp("bn") / "runs" / "single",
                    [*RESNET, "train.max_steps=6", "data.batch_size=32"])
    assert result.returncode == 0, result.stderr[-3000:]
    return result


@pytest.mark.slow
@pytest.mark.parametrize("mode,sync", [("ddp", True), ("fsdp", True), ("ddp", False)])
def test_sync_batchnorm_over_two_ranks_equals_one_process_with_both_batches(
        one_process_both_batches, tmp_path, mode, sync) -> None:
    """With sync_batchnorm the statistics of each step cover both ranks' 16 samples: the same as
    one process with a batch of 32 (the same samples). Without it, each rank normalises its own
    16 and the losses differ from the first step on."""
    two = launch(tmp_path / "runs" / "two", [*RESNET, "train.max_steps=6", f"parallel.mode={mode}",
                                             f"parallel.sync_batchnorm={str(sync).lower()}"], nproc=2)
    assert two.returncode == 0, two.stderr[-3000:]
    a, b = two.losses(), one_process_both_batches.losses()
    assert sorted(a) == sorted(b) == list(range(1, 7))
    # The first steps: later ones amplify rounding differences chaotically (a ReLU flips).
    difference = max(abs(a[step] - b[step]) for step in (1, 2, 3))
    if sync:
        assert difference <= 1e-5, (a, b)
    else:
        assert abs(a[1] - b[1]) > 1e-3, (a, b)


@pytest.mark.parametrize("damage", ["config_link", "dangling_checkpoints"])
def test_a_run_directory_with_a_link_to_write_through_is_refused_untouched(
        long_run, tmp_path, damage) -> None:
    """A link where dtrain writes (config.yaml, log.txt, checkpoints/, ...) would take the
    writes outside the run: one line, exit 2, and the link's target as it was."""
    run_dir = tmp_path / "runs" / "run"
    shutil.copytree(long_run.run_dir, run_dir)
    outside = tmp_path / "outside.txt"
    outside.write_text("not dtrain's\n")
    if damage == "config_link":
        (run_dir / "config.yaml").unlink()
        (run_dir / "config.yaml").symlink_to(outside)
        named = run_dir / "config.yaml"
    else:
        shutil.rmtree(run_dir / "checkpoints")
        (run_dir / "checkpoints").symlink_to(tmp_path / "nowhere")
        named = run_dir / "checkpoints"
    refused = launch(run_dir, LONG)
    assert refused.returncode == 2
    assert refused.stderr.strip().splitlines()[-1] == (
        f"dtrain: run error: {named} is a symbolic link; dtrain writes inside its run directory "
        f"and never through a link: remove the link (or give the run another run.name)")
    assert "Traceback" not in refused.stderr
    assert outside.read_text() == "not dtrain's\n" and not (tmp_path / "nowhere").exists()


def test_what_a_run_writes_in_its_directory_is_a_file_or_a_folder_of_its_own(tmp_path) -> None:
    from dtrain.core.errors import UserError
    from dtrain.files.store import check_run_dir_entries

    check_run_dir_entries(str(tmp_path / "absent"))  # a new run directory: nothing to check
    for name, kind, said in [("log.txt", "dir", "is a directory where dtrain writes a file"),
                             ("log.rank3.txt", "link", "is a symbolic link"),
                             (".lock", "dir", "is a directory where dtrain writes a file"),
                             ("checkpoints", "file", "is a file where dtrain keeps its "
                                                     "checkpoints/ folder"),
                             ("tb", "link", "is a symbolic link")]:
        run_dir = tmp_path / name.strip(".")
        run_dir.mkdir()
        (run_dir / "notes.txt").symlink_to(tmp_path)  # not dtrain's: left alone
        path = run_dir / name
        if kind == "dir":
            path.mkdir()
        elif kind == "file":
            path.write_text("x")
        else:
            path.symlink_to(tmp_path)
        with pytest.raises(UserError, match=f"run error: {re.escape(str(path))} {said}"):
            check_run_dir_entries(str(run_dir))
    evals_link = tmp_path / "evals_run"
    evals_link.mkdir()
    (evals_link / "config.yaml").symlink_to(tmp_path)
    check_run_dir_entries(str(evals_link), only=("evals",))  # eval writes evals/ alone


@pytest.mark.parametrize("marker", ['{"save": 1}', '{"format": "zip", "files": {}}',
                                    '{"format": "full", "files": {"checkpoint.pt": "12"}}', "[]"])
def test_a_marker_that_is_not_a_saves_is_one_line(tmp_path, marker) -> None:
    from dtrain.checkpoint.load import open_checkpoint
    from dtrain.core.errors import UserError

    folder = tmp_path / "step_000004"
    folder.mkdir()
    (folder / "COMPLETE").write_text(marker)
    for given in (folder, folder / "COMPLETE"):
        with pytest.raises(UserError, match=rf"^checkpoint error: {re.escape(str(folder))}/"
                                            rf"COMPLETE is damaged or not a dtrain marker"):
            open_checkpoint(str(given))
