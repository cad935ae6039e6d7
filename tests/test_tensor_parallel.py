"""Tensor parallelism (`parallel.tp`) on a device mesh with the data dimensions: real 4-rank
torchrun launches on gloo. dp 2 x tp 2 trains as DDP on 4 ranks does with the same global batch;
its checkpoint (DCP) resumes onto other layouts (DDP, one process, tp 4, FSDP x tp) at the same
sample (tp 4 with loss parallelism, FSDP x tp with sequence and loss parallelism), onto its own layout bitwise after a kill -9;
a Hugging Face model splits by its own plan; verify, convert, export, eval and generate read the checkpoint; layouts that cannot work
are one line and exit 2 before any process group."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
import forkserver
from conftest import (
    REPO,
    child_env,
    dtrain,
    kill_when,
    latest,
    launch,
    saved_step,
    start,
    torchrun_cmd,
)

from dtrain import cli
from dtrain.data.sampler import ResumableSampler
from test_tokens import token_folder

GPT = ["task.name=language_model", "model.name=gpt", "model.args={dim: 32, depth: 2, heads: 4}",
       "data.name=text", "data.text.corpus=python_docs", "data.text.seq_len=32",
       "optim.name=adamw", "optim.lr=0.003", "ckpt.monitor=val_loss", "ckpt.monitor_mode=min",
       "train.eval_every_epochs=0"]
# The same global batch of 16 under every layout: per rank (DDP) or per tp group.
DDP4 = ["data.batch_size=4"]
TP2 = ["data.batch_size=8", "parallel.tp.size=2"]


def _losses(run_dir: Path) -> dict[int, float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if "loss" in r and "loss_step" not in r}


def _close(a: dict[int, float], b: dict[int, float], steps: range, rel: float = 1e-5) -> None:
    assert all(s in a and s in b for s in steps), (sorted(a), sorted(b))
    for s in steps:
        assert a[s] == pytest.approx(b[s], rel=rel), (s, a[s], b[s])


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """DDP on 4 ranks for 40 steps, and dp 2 x tp 2 for 30 (its checkpoint at step 30)."""
    root = tmp_path_factory.mktemp("tp")
    made = {}
    for name, extra, steps in (("ddp4", DDP4, 40), ("tp2", TP2, 30)):
        result = launch(root / name, [*GPT, *extra, f"train.max_steps={steps}"], nproc=4)
        assert result.returncode == 0, result.stderr[-3000:]
        made[name] = root / name
        (root / f"{name}.stderr").write_text(result.stderr)
    return made


def test_dp2_tp2_trains_as_ddp_on_four_ranks(runs) -> None:
    """Losses within 1e-5 relative of DDP's over 30 steps; the banner names the mesh and each
    rank's place; the checkpoint is DCP's (sharded), whatever ckpt.format's auto says."""
    _close(_losses(runs["tp2"]), _losses(runs["ddp4"]), range(1, 31))
    stderr = (runs["tp2"].parent / "tp2.stderr").read_text()
    assert "mesh dp_replicate 2 x dp_shard 1 x tp 2; rank 0 at (0, 0, 0)" in stderr
    assert "effective batch 16 = 8 per group x 2 tp group(s) of 2 ranks" in stderr
    assert (latest(runs["tp2"]) / "dcp").is_dir()


@pytest.mark.parametrize("name, nproc, extra", [
    ("ddp4", 4, DDP4),
    ("one_process", 0, ["data.batch_size=16"]),
    # tp 4, the cross-entropy on logits split by vocabulary
    ("tp4_loss_parallel", 4, ["data.batch_size=16", "parallel.tp.size=4",
                              "parallel.tp.loss_parallel=true"]),
    # dp_shard 2 x tp 2, the norms and residual stream split by sequence, the loss by vocabulary
    ("fsdp_x_tp_sequence_loss", 4, [*TP2, "parallel.mode=fsdp", "parallel.tp.sequence_parallel=true",
                                    "parallel.tp.loss_parallel=true"]),
])
def test_a_tp_checkpoint_resumes_onto_another_layout_at_the_same_sample(runs, tmp_path, name,
                                                                          nproc, extra) -> None:
    """dp 2 x tp 2's checkpoint at step 30 continues to step 40 under another layout with the same
    global batch (no config change to allow: the layout is not what trains), as the
    uninterrupted DDP run did: the same samples in the same order, losses within float
    tolerance."""
    run_dir = tmp_path / "runs" / name
    shutil.copytree(runs["tp2"], run_dir, ignore=shutil.ignore_patterns("*.lock"))
    result = launch(run_dir, [*GPT, *extra, "train.max_steps=40"], nproc=nproc)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "resumed from" in result.stderr and "(step 30, epoch 0)" in result.stderr
    _close(_losses(run_dir), _losses(runs["ddp4"]), range(31, 41))


def test_kill_9_then_the_same_layout_continues_bitwise(runs, tmp_path) -> None:
    """dp 2 x tp 2 killed (torchrun and every rank) once a checkpoint of step 10 or later is
    saved, then launched again: the losses of the uninterrupted run, bit for bit."""
    run_dir = tmp_path / "runs" / "killed"
    job = [*GPT, *TP2, "train.max_steps=30", "ckpt.every_steps=5", "train.log_every=1",
           "log.tensorboard=false"]
    proc = start(run_dir, job, nproc=4)
    kill_when(proc, lambda: saved_step(run_dir) >= 10)
    killed_at = saved_step(run_dir)
    assert 10 <= killed_at < 30
    again = launch(run_dir, job, nproc=4)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"(step {killed_at}, epoch 0)" in again.stderr
    resumed, whole = _losses(run_dir), _losses(runs["tp2"])
    assert all(resumed[s] == whole[s] for s in range(killed_at + 1, 31)), (resumed, whole)


def test_the_checkpoint_reads_back_at_any_world_size(runs, tmp_path, capsys) -> None:
    """verify; convert to one file; export (the full shapes, the weights convert wrote); eval on
    one process and on 2 ranks with tp 2 (the run's own final val_loss both); generate."""
    checkpoint = latest(runs["tp2"])
    assert cli.main(["verify", str(checkpoint)]) == 0
    assert "intact" in capsys.readouterr().out
    converted = tmp_path / "one"
    code = cli.main(["convert", "--checkpoint", str(checkpoint), "--to", "full",
                     "--out", str(converted)])
    assert code == 0, capsys.readouterr().err
    whole = torch.load(converted / "checkpoint.pt", weights_only=False)["model"]
    out = tmp_path / "w"
    assert cli.main(["export", "--checkpoint", str(checkpoint), "--out", str(out),
                     "--format", "safetensors"]) == 0
    from safetensors.torch import load_file
    exported = load_file(str(out / "model.safetensors"))
    assert exported.keys() == whole.keys()
    assert all(torch.equal(exported[k], whole[k]) for k in exported)
    assert exported["blocks.0.attn.qkv.weight"].shape == (96, 32)  # whole, not a shard
    capsys.readouterr()
    final = [r for r in map(json.loads, (runs["tp2"] / "metrics.jsonl").read_text().splitlines())
             if "val_loss" in r][-1]
    shown = f"val_loss {final['val_loss']:.5f}"
    assert cli.main(["eval", str(runs["tp2"])]) == 0
    assert shown in capsys.readouterr().out
    on_two = forkserver.run([*torchrun_cmd(2), "-m", "dtrain", "eval", str(runs["tp2"]),
                             "parallel.tp.size=2"], cwd=REPO, env=child_env(), timeout=180)
    assert on_two.returncode == 0, on_two.stderr[-3000:]
    assert shown in on_two.stdout and "world size 2" in on_two.stdout
    generated = dtrain("generate", "--run-dir", str(runs["tp2"]), "--prompt", "def ",
                       "--max-new-tokens", "8", "--seed", "1")
    assert generated.returncode == 0, generated.stderr[-2000:]
    assert "8 new tokens" in generated.stderr


def test_a_hugging_face_model_splits_by_its_own_plan(tmp_path) -> None:
    """A Llama folder (grouped-query attention, a tied head) with its config's
    base_model_tp_plan: dp 2 x tp 2 trains as DDP on 4 ranks does, and so it does with loss
    parallelism (the head split by vocabulary, the tied embedding by the same rows, the logits
    left split for the loss); GPT-2, whose config has no plan, is refused in one line, and so is
    loss parallelism over a vocabulary that tp does not divide."""
    import transformers

    torch.manual_seed(0)
    llama = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                 tie_word_embeddings=True)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**llama, vocab_size=600)
                                  ).save_pretrained(tmp_path / "llama")
    transformers.LlamaConfig(**llama, vocab_size=601, architectures=["LlamaForCausalLM"]
                             ).save_pretrained(tmp_path / "odd")
    gpt2 = transformers.GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=600, n_positions=64)
    transformers.GPT2LMHeadModel(gpt2).save_pretrained(tmp_path / "gpt2")
    tokens = token_folder(tmp_path / "tokens")
    job = ["task.name=language_model", f"model.name=hf:{tmp_path / 'llama'}", "model.args={}",
           "data.name=tokens", f"data.root={tokens}", "data.tokens.seq_len=32",
           "optim.name=adamw", "optim.lr=0.003", "ckpt.monitor=val_loss",
           "ckpt.monitor_mode=min", "train.eval_every_epochs=0", "train.max_steps=8"]
    ddp = launch(tmp_path / "runs" / "ddp", [*job, "data.batch_size=2"], nproc=4)
    assert ddp.returncode == 0, ddp.stderr[-2000:]
    held = {}
    for name, extra in (("tp", []), ("tp_loss", ["parallel.tp.loss_parallel=true"])):
        tp = launch(tmp_path / "runs" / name,
                    [*job, "data.batch_size=4", "parallel.tp.size=2", *extra], nproc=4)
        assert tp.returncode == 0, tp.stderr[-2000:]
        _close(_losses(tp.run_dir), _losses(ddp.run_dir), range(1, 9))
        records = [json.loads(l) for l in (tp.run_dir / "metrics.jsonl").read_text().splitlines()]
        held[name] = next(r["state_bytes"] for r in records if "state_bytes" in r)
    # The tied embedding and head (600 x 64) split in two: half of their weight, gradient and
    # AdamW's two moments fewer bytes on each rank.
    assert held["tp"] - held["tp_loss"] == 600 * 64 // 2 * 4 * 4, held
    for model, extra, said in (
        (f"hf:{tmp_path / 'gpt2'}", [], "parallel.tp.size: model {} has no tensor-parallel plan (the built-in gpt "
                     "has one, a Hugging Face model its config's base_model_tp_plan); give one "
                     "(parallel.tp.plan=module:function) or set parallel.tp.size=1"),
        (f"hf-config:{tmp_path / 'odd'}", ["parallel.tp.loss_parallel=true"],
         "parallel.tp.loss_parallel: 2 does not divide model {}'s vocab_size (601); choose a "
         "size that divides it or drop the option"),
    ):
        refused = dtrain("plan", "--nproc", "4", *job, f"model.name={model}",
                         "parallel.tp.size=2", *extra)
        assert refused.returncode == 2
        assert refused.stderr.strip().splitlines()[-1] == (
            f"dtrain: config error: {said.format(model)}")


@pytest.mark.parametrize("nproc, extra, line", [
    (6, ["parallel.tp.size=4"], "parallel.tp.size: 4 does not divide the world size 6; launch a "
                                "multiple of 4 ranks"),
    (8, ["parallel.tp.size=8"], "parallel.tp.size: 8 does not divide model gpt's heads (4); "
                                "choose a size that divides it"),
    (4, ["parallel.tp.size=2", "model.name=simple_cnn", "model.args={}", "data.name=synthetic",
         "task.name=classification", "ckpt.monitor=val_acc", "ckpt.monitor_mode=max"],
     "parallel.tp.size: model simple_cnn has no tensor-parallel plan"),
    (4, ["parallel.tp.size=2", "model.lora.r=4"],
     "parallel.tp.size=2 with model.lora: the two do not compose in dtrain; drop model.lora or "
     "set parallel.tp.size=1"),
    (4, ["parallel.tp.size=2", "parallel.mode=fsdp", "parallel.fsdp.hybrid_replicas=3"],
     "parallel.fsdp.hybrid_replicas: 3 does not divide the 2 data ranks (4 ranks / tp 2)"),
    (4, ["parallel.tp.sequence_parallel=true"],
     "parallel.tp.sequence_parallel splits activations over the tp group, and parallel.tp.size "
     "is 1"),
    (4, ["parallel.tp.size=2", "parallel.tp.sequence_parallel=true", "parallel.tp.plan=os:getcwd"],
     "parallel.tp.sequence_parallel: dtrain splits the built-in gpt by sequence, not model gpt "
     "with its plan"),
    (4, ["parallel.tp.loss_parallel=true"],
     "parallel.tp.loss_parallel splits logits over the tp group, and parallel.tp.size is 1"),
    (4, ["parallel.tp.size=2", "parallel.tp.loss_parallel=true", "parallel.tp.plan=os:getcwd"],
     "parallel.tp.loss_parallel: dtrain splits the logits of the built-in gpt and of a Hugging "
     "Face model by its own plan, not model gpt with a plan function"),
    (4, ["parallel.tp.size=2", "parallel.tp.loss_parallel=true", "model.name=simple_cnn",
         "model.args={}", "data.name=synthetic", "task.name=classification",
         "ckpt.monitor=val_acc", "ckpt.monitor_mode=max"],
     "parallel.tp.loss_parallel: the split logits go to the built-in language_model task's "
     "cross-entropy, not to task classification; drop the option"),
])
def test_a_layout_that_cannot_work_is_one_line_before_any_process_group(nproc, extra, line,
                                                                        capsys) -> None:
    """`dtrain plan` refuses it (exit 2, one line), as the launch does."""
    code = cli.main(["plan", "--nproc", str(nproc), *GPT, *extra])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith(f"dtrain: config error: {line}"), err


@pytest.mark.parametrize("nproc, extra, line", [
    (2, ["parallel.tp.size=4"], "parallel.tp.size: 4 does not divide the world size 2"),
    # known only once a window reaches the model: its first forward
    (4, [*TP2, "parallel.tp.sequence_parallel=true", "data.text.seq_len=33"],
     "parallel.tp.sequence_parallel: a window of 33 tokens does not split over tp 2; choose a "
     "data seq_len that 2 divides"),
])
def test_a_launch_refuses_a_split_that_does_not_divide(tmp_path, nproc, extra, line) -> None:
    """Every rank exits 2 with the line (torchrun reports its workers' code), nothing written."""
    result = launch(tmp_path / "runs" / "bad", [*GPT, *extra, "train.max_steps=1"], nproc=nproc)
    assert result.returncode != 0 and "exitcode  : 2" in result.stderr
    assert f"dtrain: config error: {line}" in result.stderr
    assert not (tmp_path / "runs" / "bad" / "checkpoints").exists()


def test_each_sample_is_read_once_per_epoch_by_the_data_ranks() -> None:
    """The sampler is placed by the layout's data rank (run/pieces.py): the ranks of a tp group
    read the same batches, and the groups together read every sample of an epoch once (dp 2 x
    tp 2 and dp 1 x tp 4; the losses equal to DDP's above show the run reads them so)."""
    from dtrain import config
    from dtrain.process.env import Env
    from dtrain.run.pieces import layout_of

    for tp in (2, 4):
        cfg = config.load(None, [*GPT, "data.batch_size=4", f"parallel.tp.size={tp}"])
        read: dict[int, list[int]] = {}
        for rank in range(4):
            layout = layout_of(cfg, Env(launcher="torchrun", rank=rank, world_size=4,
                                        local_world_size=4, num_nodes=1), torch.device("cpu"))
            sampler = ResumableSampler(104, layout.data_rank, layout.data_ranks, 0, True, False,
                                       layout.batch_size)
            sampler.set_epoch(1, 0)
            read[rank] = [index for _epoch, index in sampler]  # (its keys: epoch, index)
        groups = [[read[r] for r in range(g * tp, (g + 1) * tp)] for g in range(4 // tp)]
        assert all(all(peer == group[0] for peer in group) for group in groups)
        every = sorted(i for group in groups for i in group[0])
        assert every == list(range(104))


def test_plan_counts_sequence_parallel_norms_as_replicated(capsys) -> None:
    """Sequence parallelism splits activations, not weights: plan's state per rank is the same."""
    lines = []
    for extra in ([], ["parallel.tp.sequence_parallel=true"]):
        assert cli.main(["plan", "--nproc", "4", *GPT, *TP2, *extra]) == 0
        lines.append([l for l in capsys.readouterr().out.splitlines() if "state per rank" in l])
    assert lines[0] and lines[0] == lines[1], lines


SAVED_ON_A_TP_RANK = """\
import json, sys
import torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from dtrain import config, models, tasks
from dtrain.commands.plan import facts as plan_facts
from dtrain.parallel.tensor import parallelize, plan_of
cfg = config.load(None, json.loads(sys.argv[1]))
info = plan_facts.model_facts(cfg, 2, 1).shapes.info
dist.init_process_group("gloo")
model = models.build(cfg.model, info, 0)
parallelize(model, plan_of(model, cfg.parallel.tp, "gpt"), init_device_mesh("cpu", (2,)))
params = {id(p) for p in model.parameters()}
saved = {}
def pack(t):
    base = t._base if t._base is not None else t
    if id(base) not in params:
        local = base.to_local() if isinstance(base, DTensor) else base
        saved[id(base)] = (base, local.numel() * local.element_size())
    return t
x = tasks.build(cfg.task, info).example_input(info, cfg.data.batch_size)
with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
    model(x)
print(json.dumps({"rank": dist.get_rank(), "saved": sum(size for _, size in saved.values())}))
dist.destroy_process_group()
"""


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp2", "tp2_sequence"])
def test_plan_counts_the_activations_a_tp_rank_keeps(tmp_path, capsys, sequence_parallel):
    """`dtrain plan`'s activations per rank under tp (the model split by its plan over a
    pretended group, traced on fake tensors) are what each real rank of a tp group on gloo
    saves for its backward, by its local parts (sequence parallelism's split norms too); the
    plan leaves no process group behind, and says nothing of the kind without tp."""
    from dtrain.commands.plan import command as plan
    overrides = [*GPT, "data.batch_size=6", "parallel.tp.size=2",
                 f"parallel.tp.sequence_parallel={str(sequence_parallel).lower()}"]
    script = tmp_path / "saved.py"
    script.write_text(SAVED_ON_A_TP_RANK)
    done = forkserver.run([*torchrun_cmd(2), str(script), json.dumps(overrides)], cwd=REPO,
                          env=child_env(), timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    # (the two ranks' lines may interleave)
    measured = [int(n) for n in re.findall(r'"saved": (\d+)\}', done.stdout)]
    assert len(measured) == 2 and measured[0] == measured[1] > 0, done.stdout
    assert cli.main(["plan", "--nproc", "2", *overrides]) == 0
    shown = capsys.readouterr().out
    assert (f"activations per rank: {plan.size_text(measured[0])} in fp32 for a batch of 6 "
            f"(a tp rank's part, traced)") in shown, shown
    assert not torch.distributed.is_initialized()
    whole = cli.main(["plan", "--nproc", "2", *GPT, "data.batch_size=6"])
    assert whole == 0 and "activations per rank" not in capsys.readouterr().out
