"""EMA weights (train.ema): the average a run keeps follows its parameters exactly, skips the
steps that changed nothing, is evaluated beside them, saved in every checkpoint, resumes
bitwise after kill -9 (DDP and FSDP), and `dtrain plan` counts it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from conftest import TINY, Result, dtrain, kill_then_resume, latest, launch
from test_speed import QUIET, reads_per_step
from dtrain import config
from dtrain.commands.plan import command as plan
from dtrain.loop.ema import EmaWeights, has_ema, load_ema_into
from dtrain.core.errors import UserError
from dtrain.commands.export.command import load_model

EMA = ["train.ema.decay=0.5"]


def by_step(run_dir: Path) -> dict[int, dict]:
    """Every full checkpoint of a run, by step (checkpoint folders are named step_NNNNNN-...)."""
    folder = run_dir / "checkpoints"
    return {int(p.name[5:11]): torch.load(p / "checkpoint.pt", weights_only=True)
            for p in folder.iterdir() if p.is_dir() and p.name.startswith("step_")}


def ema_of(checkpoint: Path) -> dict[str, torch.Tensor]:
    """The averaged parameters of a checkpoint (full or sharded), read in this one process."""
    model, _ = load_model(str(checkpoint))
    load_ema_into(model, str(checkpoint))
    return {name: p.detach().clone() for name, p in model.named_parameters()}


# ---------------------------------------------------------------------------------------------
# The average itself, in this process


def _linear() -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(4, 3)


def test_update_is_the_moving_average_every_n_steps_and_a_skipped_step_changes_nothing() -> None:
    model = _linear()
    ema = EmaWeights(model, decay=0.75, every_steps=2, evaluates=True)
    expected = [p.detach().clone() for p in model.parameters()]
    no_skip, skip = torch.tensor(False), torch.tensor(True)
    for step in range(1, 7):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p))
        before = [a.clone() for a in ema.average]
        masked = step % 4 == 0  # the device-side weight; the others take the plain update
        ema.update(step, (skip if step == 4 else no_skip) if masked else None)
        if step % 2 or step == 4:  # not an update step / the skipped step: unchanged, bitwise
            assert all(torch.equal(a, b) for a, b in zip(ema.average, before))
            continue
        expected = [0.75 * e + 0.25 * p.detach() for e, p in zip(expected, model.parameters())]
        for average, want in zip(ema.average, expected):
            torch.testing.assert_close(average, want, rtol=0, atol=1e-6)
    assert not torch.equal(ema.average[0], next(model.parameters()))


def test_evaluating_the_average_swaps_in_place_and_back_bitwise() -> None:
    model = _linear()
    ema = EmaWeights(model, decay=0.5, every_steps=1, evaluates=True)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(3.0)
    ema.update(1, None)
    weights = [p.detach().clone() for p in model.parameters()]
    average = [a.clone() for a in ema.average]
    x = torch.randn(2, 4)
    with ema.swapped():
        inside = model(x)
        assert all(torch.equal(p, a) for p, a in zip(model.parameters(), average))
    assert torch.equal(inside, nn.functional.linear(x, average[0], average[1]))
    assert all(torch.equal(p, w) for p, w in zip(model.parameters(), weights))
    assert all(torch.equal(a, b) for a, b in zip(ema.average, average))


@pytest.mark.parametrize("mode,nproc,extra", [
    ("none", 0, ["train.nan_policy=skip"]),  # the update weighted by "not skipped" on the device
    ("fsdp", 2, ["optim.name=adamw", "optim.lr=0.001"]),  # DTensors' local shards
])
def test_steps_that_update_the_average_read_nothing_on_the_host(tmp_path: Path, mode: str,
                                                               nproc: int, extra: list) -> None:
    reads = tmp_path / "reads"
    reads.mkdir()
    result = launch(tmp_path / "runs" / "r", [*QUIET, f"parallel.mode={mode}", *extra,
                                              "train.ema.decay=0.99"],
                    nproc=nproc, env={"READS_DIR": str(reads)})
    assert result.returncode == 0, result.stderr[-3000:]
    for rank in range(max(1, nproc)):
        steady = reads_per_step(reads, rank)[2:12]  # steps 3..12
        assert steady and all(n == 0 for n in steady), (rank, steady)
    assert [r["step"] for r in result.records() if "val_loss_ema" in r] == [14]


# ---------------------------------------------------------------------------------------------
# Config and plan


@pytest.mark.parametrize("override,message", [
    ("train.ema.decay=1", "train.ema.decay: must be in (0, 1), e.g. 0.999, got 1.0"),
    ("train.ema.decay=0", "train.ema.decay: must be in (0, 1), e.g. 0.999, got 0.0"),
    ("train.ema.decay=-0.5", "train.ema.decay: must be in (0, 1)"),
    ("train.ema.every_steps=0", "train.ema.every_steps: must be >= 1, got 0"),
    ("train.ema.decay=fast", "train.ema.decay: expected a number, got 'fast'"),
    ("train.ema.evaluate=true", "unknown key 'train.ema.evaluate' (did you mean 'train.ema.eval'?)"),
])
def test_bad_ema_values_are_refused_with_the_key(override: str, message: str) -> None:
    with pytest.raises(UserError, match=None) as error:
        config.load(None, [override])
    assert message in str(error.value)


def test_a_bad_decay_on_the_command_line_exits_2_before_anything_is_written(run_dir: Path) -> None:
    result = launch(run_dir, ["train.ema.decay=1.5"])
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1] == (
        "dtrain: config error: train.ema.decay: must be in (0, 1), e.g. 0.999, got 1.5")
    assert not run_dir.exists()


def test_monitoring_an_ema_metric_needs_the_average_evaluated() -> None:
    with pytest.raises(UserError) as error:
        config.load(None, ["ckpt.monitor=val_acc_ema"])
    assert "ckpt.monitor: 'val_acc_ema' is not a metric" in str(error.value)
    cfg = config.load(None, ["ckpt.monitor=val_acc_ema", "train.ema.decay=0.99"])
    assert cfg.ckpt.monitor == "val_acc_ema"


def test_plan_counts_the_average_as_one_more_copy_of_the_trainable_parameters() -> None:
    without = plan.estimate(config.load(None, TINY), nproc=2)
    with_ema = plan.estimate(config.load(None, [*TINY, "train.ema.decay=0.999"]), nproc=2)
    for mode in ("ddp", "fsdp"):
        a, b = without.memory_for(mode, "fp32"), with_ema.memory_for(mode, "fp32")
        assert b.optimizer - a.optimizer == a.grads > 0  # gradients: the trainable parameters
        assert b.total - a.total == a.grads
    fsdp = with_ema.memory_for("fsdp", "fp32")
    ddp = with_ema.memory_for("ddp", "fp32")
    assert with_ema.checkpoint_bytes > without.checkpoint_bytes + ddp.grads // 2
    text = plan.report(config.load(None, [*TINY, "train.ema.decay=0.999"]), nproc=2)
    assert (f"the optimizer column holds the EMA weights (train.ema): ddp {ddp.grads} bytes, "
            f"fsdp {fsdp.grads} bytes per rank") in text
    assert "EMA weights" not in plan.report(config.load(None, TINY), nproc=2)


# ---------------------------------------------------------------------------------------------
# One process: the average over the run's own parameter trajectory, a skipped step, evaluation


@pytest.fixture(scope="module")
def skipping_run(tmp_path_factory) -> Result:
    """Gradients made infinite at step 4 (train.nan_policy=skip): a checkpoint after every step,
    evaluations at steps 3 and 6, TensorBoard on."""
    run_dir = tmp_path_factory.mktemp("ema") / "runs" / "skip"
    result = launch(run_dir, [*EMA, "model.name=user_code:inf_grad_cnn",
                              "model.args={width: 8, at_call: 4}", "train.nan_policy=skip",
                              "ckpt.every_steps=1", "ckpt.keep_last=10", "train.max_steps=6",
                              "train.eval_every_steps=3", "log.tensorboard=true"])
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def test_the_average_follows_the_parameters_and_leaves_out_the_skipped_step(skipping_run) -> None:
    assert "step 4: non-finite loss or gradients, optimizer step skipped" in skipping_run.stderr
    saved = by_step(skipping_run.run_dir)
    assert sorted(saved) == [1, 2, 3, 4, 5, 6]
    names = list(saved[1]["ema"])
    assert names and set(names) <= set(saved[1]["model"])
    for step in range(2, 7):
        before, now = saved[step - 1], saved[step]
        for name in names:
            if step == 4:  # the skipped step: parameters and average both unchanged, bitwise
                assert torch.equal(now["model"][name], before["model"][name]), name
                assert torch.equal(now["ema"][name], before["ema"][name]), name
            else:
                want = 0.5 * before["ema"][name] + 0.5 * now["model"][name]
                torch.testing.assert_close(now["ema"][name], want, rtol=0, atol=1e-6)
    assert not torch.equal(saved[6]["ema"][names[0]], saved[6]["model"][names[0]])


def test_an_fp16_overflow_that_the_grad_scaler_skips_leaves_the_average_as_it_was(
        run_dir: Path) -> None:
    result = launch(run_dir, [*EMA, "model.name=user_code:inf_grad_cnn",
                              "model.args={width: 8, at_call: 3}", "train.precision=fp16",
                              "train.max_steps=4", "ckpt.every_steps=1", "ckpt.keep_last=10"])
    assert result.returncode == 0, result.stderr[-3000:]
    saved = by_step(run_dir)
    assert saved[3]["extra"]["scaler"]["scale"] == saved[2]["extra"]["scaler"]["scale"] / 2
    for name in saved[3]["ema"]:
        assert torch.equal(saved[3]["model"][name], saved[2]["model"][name]), name
        assert torch.equal(saved[3]["ema"][name], saved[2]["ema"][name]), name
        want = 0.5 * saved[3]["ema"][name] + 0.5 * saved[4]["model"][name]
        torch.testing.assert_close(saved[4]["ema"][name], want, rtol=0, atol=1e-6)


def test_each_evaluation_reports_the_average_too_in_metrics_and_tensorboard(skipping_run) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    evals = [r for r in skipping_run.records() if "val_loss" in r]
    assert [r["step"] for r in evals] == [3, 6]
    for record in evals:
        assert {"val_loss", "val_acc", "val_loss_ema", "val_acc_ema"} <= set(record)
        assert record["val_loss_ema"] != record["val_loss"]  # other weights, other loss
    assert "val_loss_ema" in skipping_run.stderr  # the console line
    acc = EventAccumulator(str(skipping_run.run_dir / "tb"), size_guidance={"scalars": 0})
    acc.Reload()
    for tag, key in (("val/loss_ema", "val_loss_ema"), ("val/acc_ema", "val_acc_ema")):
        events = acc.Scalars(tag)
        assert [e.step for e in events] == [r["step"] for r in evals]
        assert [e.value for e in events] == pytest.approx([r[key] for r in evals])


def test_has_ema_and_load_ema_into_read_a_full_checkpoint(skipping_run) -> None:
    folder = latest(skipping_run.run_dir)
    assert has_ema(str(folder)) and has_ema(str(folder / "checkpoint.pt"))
    saved = torch.load(folder / "checkpoint.pt", weights_only=True)
    model, _ = load_model(str(folder))
    load_ema_into(model, str(folder))
    for name, value in model.state_dict().items():
        expected = saved["ema"].get(name, saved["model"][name])  # buffers: the model's own
        assert torch.equal(value, expected), name


@pytest.mark.slow
def test_turning_the_average_on_and_off_on_resume(tmp_path: Path) -> None:
    """Saved without EMA: has_ema says so and --weights ema is refused in one line. Resumed with
    EMA on, the average starts from the resumed weights (and the other way, it is dropped)."""
    run_dir = tmp_path / "runs" / "r"
    first = launch(run_dir, ["train.max_steps=3"])
    assert first.returncode == 0, first.stderr[-3000:]
    plain = latest(run_dir)
    assert not has_ema(str(plain))
    model, _ = load_model(str(plain))
    with pytest.raises(UserError) as error:
        load_ema_into(model, str(plain))
    assert str(error.value) == (f"checkpoint error: {plain} was saved without EMA weights "
                                f"(train.ema.decay unset); use --weights model")

    second = launch(run_dir, [*EMA, "train.max_steps=5", "ckpt.every_steps=1",
                              "ckpt.resume_config_change=allow"])
    assert second.returncode == 0, second.stderr[-3000:]
    assert "no EMA weights for this model (it holds none (train.ema was off)): the average " \
           "starts from the resumed weights" in second.stderr
    saved = by_step(run_dir)
    for name, value in saved[5]["ema"].items():
        p3, p4, p5 = (saved[s]["model"][name] for s in (3, 4, 5))
        torch.testing.assert_close(value, 0.25 * p3 + 0.25 * p4 + 0.5 * p5, rtol=0, atol=1e-6)

    third = launch(run_dir, ["train.max_steps=6", "ckpt.resume_config_change=allow"])
    assert third.returncode == 0, third.stderr[-3000:]
    assert "val_loss_ema" not in third.stderr and not has_ema(str(latest(run_dir)))


USER_TASK = ["task.name=user_tasks:regression", "model.name=user_tasks:regressor",
             "data.name=user_tasks:points", "data.synthetic.val_size=101"]


@pytest.mark.parametrize("task", ["classification", "user"])
def test_ckpt_monitor_may_name_an_ema_metric(run_dir: Path, task: str) -> None:
    """The newest checkpoint and the best by the average's metric are kept, named by it; for a
    built-in task (checked with the config) and a user's (checked on a batch at the start)."""
    metric = "val_loss_ema" if task == "classification" else "val_abs_error_ema"
    result = launch(run_dir, [*EMA, *(USER_TASK if task == "user" else []), "train.max_steps=4",
                              "train.eval_every_steps=2", "ckpt.every_steps=2",
                              f"ckpt.monitor={metric}", "ckpt.monitor_mode=min",
                              "ckpt.keep_last=1", "ckpt.keep_best=1"])
    assert result.returncode == 0, result.stderr[-3000:]
    evals = {r["step"]: r[metric] for r in result.records() if metric in r}
    assert sorted(evals) == [2, 4]
    best_step = min(evals, key=lambda s: evals[s])
    markers = [json.loads((p / "COMPLETE").read_text())
               for p in (run_dir / "checkpoints").iterdir() if (p / "COMPLETE").exists()]
    assert {m["step"] for m in markers} == {best_step, 4}  # the newest and the best by the average
    for marker in markers:
        assert marker["metric"] == metric
        assert marker["value"] == pytest.approx(evals[marker["step"]])


# ---------------------------------------------------------------------------------------------
# Two ranks: kill -9 and resume, DDP and FSDP


STEPS = 16
SLOW = ["model.name=user_code:slow_cnn", "model.args={width: 8, sleep_s: 0.03}",
        "data.synthetic.train_size=1024", f"train.max_steps={STEPS}", "ckpt.every_steps=4",
        "ckpt.keep_last=10", "train.eval_every_steps=4", "train.ema.decay=0.9"]
# FSDP with units left gathered after a forward: an evaluation of the average must not compute
# with the weights gathered before the exchange.
MODES = {"ddp": ["parallel.mode=ddp"],
         "fsdp": ["parallel.mode=fsdp", "parallel.fsdp.reshard_after_forward=false",
                  "optim.name=adamw", "optim.lr=0.001"]}


def _figures(result_dir: Path) -> list[dict]:
    """Every loss and evaluation record, without the timings."""
    keep = ("step", "loss", "val_loss", "val_acc", "val_loss_ema", "val_acc_ema")
    lines = (json.loads(line) for line in (result_dir / "metrics.jsonl").read_text().splitlines())
    return [{k: r[k] for k in keep if k in r} for r in lines if "loss" in r or "val_loss" in r]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_kill_9_then_resume_continues_the_average_bitwise(tmp_path: Path, mode: str) -> None:
    overrides = [*SLOW, *MODES[mode]]
    straight = launch(tmp_path / "runs" / "straight", overrides, nproc=2)
    assert straight.returncode == 0, straight.stderr[-3000:]
    killed_at, resumed = kill_then_resume(tmp_path / "runs" / "killed", overrides, at_step=4)
    assert 4 <= killed_at < STEPS
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"step_{killed_at:06d}" in resumed.stderr

    figures = _figures(straight.run_dir)
    assert _figures(resumed.run_dir) == figures  # losses and both evaluations, bitwise
    evals = [r for r in figures if "val_loss_ema" in r]
    assert [r["step"] for r in evals] == [4, 8, 12, 16]
    assert all(r["val_loss_ema"] != r["val_loss"] for r in evals)
    a, b = ema_of(latest(straight.run_dir)), ema_of(latest(resumed.run_dir))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    marker = json.loads((latest(straight.run_dir) / "COMPLETE").read_text())
    assert marker["format"] == ("sharded" if mode == "fsdp" else "full")

    # What the run logs as its state and writes as a checkpoint is what the plan says.
    estimate = plan.estimate(config.load(None, [*TINY, *overrides]), nproc=2)
    first = straight.records()[0]
    assert estimate.memory_for(mode, "fp32").state == first["state_bytes"]
    on_disk = sum(f.stat().st_size for f in latest(straight.run_dir).rglob("*") if f.is_file())
    assert abs(estimate.checkpoint_bytes - on_disk) <= max(0.05 * on_disk, 24 * 1024)
    if mode == "fsdp":
        _resume_the_average_on_one_rank(straight.run_dir, overrides, tmp_path / "runs" / "one")


def _resume_the_average_on_one_rank(two_ranks: Path, overrides: list[str], run_dir: Path) -> None:
    """The 2-rank sharded checkpoint of step 8 goes on in one process: DCP reshards the average
    with the parameters, and step 9 averages on from it."""
    step8 = next((two_ranks / "checkpoints").glob("step_000008-*"))
    one = launch(run_dir, [*overrides, "train.max_steps=9", "ckpt.every_steps=1",
                           f"ckpt.resume={step8}"])
    assert one.returncode == 0, one.stderr[-3000:]
    assert "world size changed from 2 to 1" in one.stderr and "no EMA weights" not in one.stderr
    step9 = latest(run_dir)
    assert step9.name.startswith("step_000009")
    params9 = dict(load_model(str(step9))[0].named_parameters())
    ema8, ema9 = ema_of(step8), ema_of(step9)
    assert ema8.keys() == ema9.keys()
    for name, value in ema9.items():
        want = 0.9 * ema8[name] + 0.1 * params9[name].detach()
        torch.testing.assert_close(value, want, rtol=0, atol=1e-6)


def test_a_pipeline_keeps_the_average_of_its_stages(tmp_path: Path) -> None:
    """pp 2 x dp 2 (each stage rank averaging its own stages, the tied embedding on both ends):
    the average's val_loss_ema of DDP on 4 ranks at step 5; its checkpoint resumes as pp 2 on 2
    ranks and at step 10 the average is still DDP's; `dtrain eval --weights ema` reads it whole."""
    from test_pipeline import GPT
    from test_tensor_parallel import _close
    every = [*GPT, "train.ema.decay=0.9", "train.eval_every_steps=5"]
    ddp = launch(tmp_path / "ddp", [*every, "data.batch_size=4", "train.max_steps=10"], nproc=4)
    pp = launch(tmp_path / "pp", [*every, "data.batch_size=8", "parallel.pp.size=2",
                                  "train.max_steps=5"], nproc=4)
    assert ddp.returncode == 0 and pp.returncode == 0, (ddp.stderr[-2000:], pp.stderr[-2000:])
    resumed = launch(tmp_path / "pp", [*every, "data.batch_size=16", "parallel.pp.size=2",
                                       "train.max_steps=10"], nproc=2)
    assert resumed.returncode == 0 and "(step 5, epoch 0)" in resumed.stderr, resumed.stderr[-2000:]

    def evaluated(run_dir: Path) -> dict[int, float]:
        records = map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
        return {r["step"]: r["val_loss_ema"] for r in records if "val_loss_ema" in r}

    ours, theirs = evaluated(tmp_path / "pp"), evaluated(tmp_path / "ddp")
    assert sorted(ours) == [5, 10]
    _close(ours, theirs, range(5, 11, 5))
    shown = dtrain("eval", str(tmp_path / "pp"), "--weights", "ema")
    assert shown.returncode == 0, shown.stderr[-2000:]
    assert f"val_loss_ema {ours[10]:.5f}" in shown.stdout
