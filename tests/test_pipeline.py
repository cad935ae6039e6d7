"""Pipeline parallelism (`parallel.pp`) on the device mesh (pp, dp_replicate, dp_shard, tp):
real torchrun launches on gloo. pp 2 x dp 2 (1F1B, 4 micro-batches) trains as DDP on 4 ranks
does with the same global batch, and so do the other schedules and pp 2 x tp 2 x dp 2 on 8
ranks; its checkpoint (DCP) resumes onto other layouts at the same sample, and a DDP checkpoint
onto it; a kill -9 and a relaunch continue bit for bit; verify, convert, export, eval and
generate read it as one model; layouts that cannot work are one line
and exit 2 before any process group."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from conftest import dtrain, kill_when, latest, launch, saved_step, start
from test_tensor_parallel import _close, _losses

GPT = ["task.name=language_model", "model.name=gpt", "model.args={dim: 32, depth: 4, heads: 4}",
       "data.name=text", "data.text.corpus=python_docs", "data.text.seq_len=32",
       "optim.name=adamw", "optim.lr=0.003", "ckpt.monitor=val_loss", "ckpt.monitor_mode=min",
       "train.eval_every_epochs=0"]
# The same global batch of 16 under every layout: per rank (DDP) or per pipeline.
DDP4 = ["data.batch_size=4"]
PP2 = ["data.batch_size=8", "parallel.pp.size=2"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """DDP on 4 ranks for 40 steps (a checkpoint at 30 too), and pp 2 x dp 2 for 30."""
    root = tmp_path_factory.mktemp("pp")
    made = {}
    for name, extra, steps in (("ddp4", [*DDP4, "ckpt.every_steps=30"], 40), ("pp2", PP2, 30)):
        # Up to 900 s to start: a fresh-clone suite once kept this launch waiting past 300 s
        # while 2 cores ran the other files' launches (alone it takes 20 s).
        result = launch(root / name, [*GPT, *extra, f"train.max_steps={steps}",
                                      "dist.init_timeout_s=900"], nproc=4, timeout=900)
        assert result.returncode == 0, result.stderr[-3000:]
        made[name] = root / name
        (root / f"{name}.stderr").write_text(result.stderr)
    return made


def test_pp2_dp2_trains_as_ddp_on_four_ranks(runs) -> None:
    """1F1B over 2 stages with 4 micro-batches, replicated over 2 pipelines: the losses of DDP
    within 1e-5 relative over 30 steps (clipping over the stages' norm, the tied head summed
    between the first and last stage); the banner names the mesh and the cut; DCP checkpoints;
    the evaluation's val_loss is DDP's."""
    _close(_losses(runs["pp2"]), _losses(runs["ddp4"]), range(1, 31))
    # (the banner's lines joined where it wraps them)
    stderr = re.sub(r"\n\S+ \S+ +", " ", (runs["pp2"].parent / "pp2.stderr").read_text())
    assert "mesh pp 2 x dp_replicate 2 x dp_shard 1 x tp 1; rank 0 at (0, 0, 0)" in stderr
    assert "stage(s) [0] of 2, schedule 1f1b, 4 micro-batches a step" in stderr
    assert "effective batch 16 = 8 per group x 2 pipeline(s) of 2 ranks" in stderr
    assert (latest(runs["pp2"]) / "dcp").is_dir()


@pytest.mark.parametrize("name, nproc, extra", [
    ("gpipe", 2, ["data.batch_size=16", "parallel.pp.size=2", "parallel.pp.schedule=gpipe",
                  "parallel.pp.microbatches=2"]),
    ("interleaved", 2, ["data.batch_size=16", "parallel.pp.size=2",
                        "parallel.pp.schedule=interleaved_1f1b"]),
    ("zero_bubble", 2, ["data.batch_size=16", "parallel.pp.size=2",
                        "parallel.pp.schedule=zero_bubble"]),
    # Eight ranks on this two-core machine, beside other files' launches, can take minutes to
    # all reach the process group: a rendezvous that waits longer than the default 300 s.
    ("pp2_tp2_dp2", 8, [*PP2, "parallel.tp.size=2", "dist.init_timeout_s=900"]),
    ("pp2_tp2_sequence_loss", 4, ["data.batch_size=16", "parallel.pp.size=2",
                                  "parallel.tp.size=2", "parallel.tp.sequence_parallel=true",
                                  "parallel.tp.loss_parallel=true"]),
    ("pp2_fsdp2_accum_clip", 4, ["data.batch_size=4", "train.grad_accum=2",
                                 "parallel.pp.size=2", "parallel.mode=fsdp",
                                 "parallel.pp.microbatches=2", "train.clip_grad_norm=0.05"]),
])
def test_every_schedule_and_layout_trains_as_ddp(runs, tmp_path, name, nproc, extra) -> None:
    """GPipe, interleaved 1F1B (2 stages per rank), zero bubble, pp 2 x tp 2 x dp 2 on 8 ranks,
    pp 2 x tp 2 with sequence and loss parallelism (the tied embedding's gradient laid out as
    the weight on both ends before they are summed), and pp 2 x FSDP 2 with accumulation and
    clipping (over the stages' norm, a maximum every step reaches): the same losses as DDP on 4
    ranks over 10 steps."""
    run_dir = tmp_path / name
    result = launch(run_dir, [*GPT, *extra, "train.max_steps=10"], nproc=nproc, timeout=1200)
    assert result.returncode == 0, result.stderr[-3000:]
    if "train.clip_grad_norm=0.05" in extra:
        ddp = launch(tmp_path / "ddp_clip", [*GPT, *DDP4, "train.clip_grad_norm=0.05",
                                            "train.max_steps=10"], nproc=4)
        assert ddp.returncode == 0, ddp.stderr[-3000:]
        _close(_losses(run_dir), _losses(tmp_path / "ddp_clip"), range(1, 11))
        assert _losses(run_dir) != {s: v for s, v in _losses(runs["ddp4"]).items() if s <= 10}
        return
    _close(_losses(run_dir), _losses(runs["ddp4"]), range(1, 11))


@pytest.mark.parametrize("name, nproc, extra", [
    ("ddp4", 4, DDP4),
    ("one_process", 0, ["data.batch_size=16"]),
    ("tp2", 4, ["data.batch_size=8", "parallel.tp.size=2"]),
    ("interleaved_pp2", 2, ["data.batch_size=16", "parallel.pp.size=2",
                            "parallel.pp.schedule=interleaved_1f1b"]),
])
def test_a_pp_checkpoint_resumes_onto_another_layout_at_the_same_sample(runs, tmp_path, name,
                                                                          nproc, extra) -> None:
    """pp 2 x dp 2's checkpoint at step 30 continues to step 40 as DDP, one process, dp 2 x tp 2
    or a pipeline of 4 stages on 2 ranks, with the uninterrupted DDP run's losses."""
    run_dir = tmp_path / "runs" / name
    shutil.copytree(runs["pp2"], run_dir, ignore=shutil.ignore_patterns("*.lock"))
    result = launch(run_dir, [*GPT, *extra, "train.max_steps=40"], nproc=nproc)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "resumed from" in result.stderr and "(step 30, epoch 0)" in result.stderr
    _close(_losses(run_dir), _losses(runs["ddp4"]), range(31, 41))


def test_a_ddp_checkpoint_resumes_as_a_pipeline(runs, tmp_path) -> None:
    """DDP's checkpoint at step 30 (the later one removed) continues as pp 2 x dp 2 with DDP's
    own losses to step 40."""
    run_dir = tmp_path / "runs" / "from_ddp"
    shutil.copytree(runs["ddp4"], run_dir, ignore=shutil.ignore_patterns("*.lock"))
    checkpoints = run_dir / "checkpoints"
    for folder in checkpoints.glob("step_000040*"):
        shutil.rmtree(folder)
    thirty = next(checkpoints.glob("step_000030*")).name
    (checkpoints / "latest").write_text(thirty)
    # The records of DDP's own steps 31-40 go with its checkpoint of step 40.
    records = (run_dir / "metrics.jsonl").read_text().splitlines()
    kept = [line for line in records if json.loads(line)["step"] <= 30]
    (run_dir / "metrics.jsonl").write_text("".join(f"{line}\n" for line in kept))
    result = launch(run_dir, [*GPT, *PP2, "train.max_steps=40"], nproc=4)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "(step 30, epoch 0)" in result.stderr
    _close(_losses(run_dir), _losses(runs["ddp4"]), range(31, 41))


def test_kill_9_then_the_same_layout_continues_bitwise(runs, tmp_path) -> None:
    """pp 2 x dp 2 killed (torchrun and every rank) once a checkpoint of step 10 or later is
    saved, then launched again: the losses of the uninterrupted run, bit for bit."""
    run_dir = tmp_path / "runs" / "killed"
    job = [*GPT, *PP2, "train.max_steps=30", "ckpt.every_steps=5", "train.log_every=1",
           "log.tensorboard=false"]
    proc = start(run_dir, job, nproc=4)
    kill_when(proc, lambda: saved_step(run_dir) >= 10)
    killed_at = saved_step(run_dir)
    assert 10 <= killed_at < 30
    again = launch(run_dir, job, nproc=4)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"(step {killed_at}, epoch 0)" in again.stderr
    resumed, whole = _losses(run_dir), _losses(runs["pp2"])
    assert all(resumed[s] == whole[s] for s in range(killed_at + 1, 31)), (resumed, whole)


def test_the_checkpoint_reads_back_whole(runs, tmp_path) -> None:
    """verify; convert to one file and export hold the whole model (every block, the full
    shapes, the same weights); eval on one process gives the run's own final val_loss from its
    stages' parts; generate runs the whole model."""
    checkpoint = latest(runs["pp2"])
    assert dtrain("verify", str(checkpoint)).returncode == 0
    converted = dtrain("convert", "--checkpoint", str(checkpoint), "--to", "full", "--out",
                       str(tmp_path / "one"))
    assert converted.returncode == 0, converted.stderr[-2000:]
    whole = torch.load(tmp_path / "one" / "checkpoint.pt", weights_only=False)["model"]
    assert {f"blocks.{i}.attn.qkv.weight" for i in range(4)} <= whole.keys()
    assert whole["tok_emb.weight"].shape == (256, 32) and "norm.weight" in whole
    exported = dtrain("export", "--checkpoint", str(checkpoint), "--out", str(tmp_path / "w"),
                      "--format", "safetensors")
    assert exported.returncode == 0, exported.stderr[-2000:]
    from safetensors.torch import load_file
    weights = load_file(str(tmp_path / "w" / "model.safetensors"))
    assert weights.keys() == whole.keys()
    assert all(torch.equal(weights[k], whole[k]) for k in weights)
    final = [r for r in map(json.loads, (runs["pp2"] / "metrics.jsonl").read_text().splitlines())
             if "val_loss" in r][-1]
    result = dtrain("eval", str(runs["pp2"]))
    assert result.returncode == 0, result.stderr[-2000:]
    assert f"val_loss {final['val_loss']:.5f}" in result.stdout
    generated = dtrain("generate", "--run-dir", str(runs["pp2"]), "--prompt", "def ",
                       "--max-new-tokens", "8", "--seed", "1")
    assert generated.returncode == 0, generated.stderr[-2000:]
    assert "8 new tokens" in generated.stderr


def test_fp16_skips_the_steps_that_accumulation_skips(tmp_path) -> None:
    """fp16 from a loss scale that overflows: pp 2 x dp 2 (4 micro-batches of 4) skips the same
    steps as DDP on 2 ranks accumulating 4 micro-batches of 4 (every stage rank skips the
    step one rank's gradients overflow in), and then gives its losses within 1e-4."""
    fp16 = ["train.precision=fp16", "train.loss_scale_init=1e9", "train.max_steps=16"]
    ddp = launch(tmp_path / "ddp", [*GPT, *fp16, "data.batch_size=4", "train.grad_accum=4"],
                 nproc=2)
    pp = launch(tmp_path / "pp", [*GPT, *fp16, "data.batch_size=16", "parallel.pp.size=2"],
                nproc=4)
    assert ddp.returncode == 0 and pp.returncode == 0, (ddp.stderr[-2000:], pp.stderr[-2000:])

    def scales(run_dir: Path) -> list[float]:
        records = map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
        return [r["loss_scale"] for r in records if "loss_scale" in r]

    assert scales(pp.run_dir) == scales(ddp.run_dir) and len(scales(ddp.run_dir)) == 16
    assert scales(ddp.run_dir)[-1] < 1e9 / 2 ** 8  # (overflowed at least 8 times)
    _close(_losses(pp.run_dir), _losses(ddp.run_dir), range(1, 17), rel=1e-4)


@pytest.mark.parametrize("extra, nproc, message", [
    (["parallel.pp.size=3"], 4, "pp 3 x tp 1 does not divide the world size 4"),
    (["parallel.pp.size=2", "parallel.pp.stages_per_rank=3", "parallel.pp.schedule="
      "interleaved_1f1b"], 2, "6 stages (pp 2 x 3 per rank) for the 4 blocks"),
    (["parallel.pp.size=2", "parallel.pp.microbatches=1"], 2,
     "1f1b needs at least one micro-batch per stage rank (2), got 1"),
    (["parallel.pp.size=2", "parallel.pp.schedule=looped"], 2, "parallel.pp.schedule"),
    (["parallel.pp.size=2", "parallel.pp.microbatches=3"], 2,
     "3 does not divide data.batch_size 16"),
    (["parallel.pp.size=2", "model.lora.r=4"], 2, "parallel.pp.size=2 with model.lora"),
])
def test_layouts_that_cannot_work_are_one_line(extra, nproc, message) -> None:
    """`dtrain plan` refuses each before any process group: one line, exit 2."""
    planned = dtrain("plan", "--nproc", str(nproc), *GPT, "data.batch_size=16", *extra)
    lines = planned.stderr.strip().splitlines()
    assert planned.returncode == 2 and len(lines) == 1 and message in lines[0], planned.stderr


@pytest.mark.parametrize("extra, nproc, message", [
    (["parallel.pp.size=3"], 4, "pp 3 x tp 1 does not divide the world size 4"),
    (["parallel.pp.size=2", "parallel.pp.stages_per_rank=3", "parallel.pp.schedule="
      "interleaved_1f1b"], 2, "6 stages (pp 2 x 3 per rank) for the 4 blocks"),
])
def test_a_launch_refuses_them_alike(tmp_path, extra, nproc, message) -> None:
    """Every rank exits 2 with the line (torchrun reports its workers' code), nothing written."""
    result = launch(tmp_path / "r", [*GPT, "data.batch_size=16", *extra, "train.max_steps=2"],
                    nproc=nproc)
    assert result.returncode != 0 and "exitcode  : 2" in result.stderr
    assert "dtrain: config error: parallel.pp" in result.stderr and message in result.stderr
    assert not (tmp_path / "r" / "checkpoints").exists()


def test_each_sample_is_trained_once_an_epoch_across_a_change_of_layout(tmp_path) -> None:
    """The sample log (parallel.replicas.sample_log, here without replica groups): pp 2 x dp 2
    to step 20, then the run resumed as dp 2 x tp 2 to step 45 (into the second epoch). At each
    step the ranks of a pipeline or tp group log the same samples, the 2 data ranks different
    ones, and each sample of the first epoch is trained once."""
    from collections import Counter
    from test_tokens import token_folder
    tokens = token_folder(tmp_path / "tokens")
    job = [*GPT, "data.name=tokens", f"data.root={tokens}", "data.tokens.seq_len=32",
           "parallel.replicas.sample_log=true", "train.epochs=2"]
    run_dir = tmp_path / "run"
    first = launch(run_dir, [*job, "data.batch_size=8", "parallel.pp.size=2",
                             "train.max_steps=20"], nproc=4)
    assert first.returncode == 0, first.stderr[-2000:]
    then = launch(run_dir, [*job, "data.batch_size=8", "parallel.tp.size=2",
                            "train.max_steps=45"], nproc=4)
    assert then.returncode == 0 and "(step 20, epoch 0)" in then.stderr, then.stderr[-2000:]
    by_step: dict[int, list[tuple]] = {}
    for path in sorted(run_dir.glob("replica_samples.rank*.jsonl")):
        for line in map(json.loads, path.read_text().splitlines()):
            by_step.setdefault(line["step"], []).append(tuple(map(tuple, line["samples"])))
    assert sorted(by_step) == list(range(1, 46))
    per_epoch: dict[int, Counter] = {}
    for step, logged in by_step.items():
        groups = Counter(logged)  # each data rank's samples, and how many ranks logged them
        assert len(logged) == 4 and sorted(groups.values()) == [2, 2], (step, groups)
        for samples in groups:
            for epoch, index in samples:
                per_epoch.setdefault(epoch, Counter())[index] += 1
    windows = (20000 - 1) // 32
    assert max(per_epoch[0].values()) == 1 and windows - 16 < len(per_epoch[0]) <= windows
    assert max(per_epoch[1].values()) == 1
