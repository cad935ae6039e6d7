"""Beyond image classification: the built-in language model on text, a user's task on dict
batches, models that return dicts or their own loss, and the task seam's error messages. Real
launches throughout (2 ranks on gloo where it matters)."""

from __future__ import annotations

import json
import math
import pytest
import torch
import torch.nn.functional as F

from conftest import Result, dtrain, kill_then_resume, latest, launch

SEQ = 32
GPT_ARGS = f"model.args={{dim: 32, depth: 2, heads: 2, seq_len: {SEQ}}}"
LM = ["task.name=language_model", "model.name=gpt", GPT_ARGS, "data.name=text",
      "data.text.corpus=python_docs", "data.batch_size=8", "optim.name=adamw", "optim.lr=0.003",
      "optim.weight_decay=0.0", "ckpt.monitor=val_loss", "ckpt.monitor_mode=min",
      "train.max_steps=12", "ckpt.every_steps=4", "train.eval_every_epochs=0"]


def corpus_windows(split: str, stride: int = SEQ) -> torch.Tensor:
    """The built-in corpus cut as the run cuts it: 10 % held out, windows of SEQ + 1 bytes."""
    from dtrain.data.text import python_docs
    data = python_docs()
    cut = len(data) - int(len(data) * 0.1)
    part = data[:cut] if split == "train" else data[cut:]
    tokens = torch.frombuffer(bytearray(part), dtype=torch.uint8)
    return tokens.unfold(0, SEQ + 1, stride if split == "train" else SEQ)


def hand_written_lm_loop(steps: int, batch: int = 8) -> list[float]:
    """A plain PyTorch loop: dtrain's GPT class, the windows, DistributedSampler's order (one
    rank), AdamW, cross-entropy over every next byte."""
    from torch.utils.data import DistributedSampler
    from dtrain.models import GPT
    windows = corpus_windows("train")
    sampler = DistributedSampler(range(len(windows)), num_replicas=1, rank=0, shuffle=True, seed=0,
                                 drop_last=True)
    torch.manual_seed(0)
    model = GPT(vocab_size=256, seq_len=SEQ, dim=32, depth=2, heads=2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.003, weight_decay=0.0, fused=True)
    order = list(sampler)
    losses = []
    for step in range(steps):
        tokens = windows[order[step * batch:(step + 1) * batch]].long()
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, 256), tokens[:, 1:].reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def evaluate_by_hand(weights: dict) -> float:
    """Mean next-byte loss over every validation window, once each, in one process."""
    from dtrain.models import GPT
    model = GPT(vocab_size=256, seq_len=SEQ, dim=32, depth=2, heads=2)
    model.load_state_dict(weights)
    tokens = corpus_windows("val").long()
    with torch.no_grad():
        logits = model.eval()(tokens[:, :-1])
    per_token = F.cross_entropy(logits.transpose(1, 2), tokens[:, 1:], reduction="none")
    return per_token.mean(dim=1).double().mean().item()


@pytest.fixture(scope="module")
def lm_runs(tmp_path_factory) -> dict[str, Result]:
    runs = {}
    for mode in ("ddp", "fsdp"):
        run_dir = tmp_path_factory.mktemp(f"lm_{mode}") / "runs" / "lm"
        runs[mode] = launch(run_dir, [*LM, f"parallel.mode={mode}", "ckpt.format=full"], nproc=2)
        assert runs[mode].returncode == 0, runs[mode].stderr[-3000:]
    return runs


@pytest.fixture(scope="module")
def lm_single(tmp_path_factory) -> Result:
    """The LM job in one process, 12 steps: checked against a hand-written loop, and the run
    whose newest checkpoint (step 12) the export test exports."""
    result = launch(tmp_path_factory.mktemp("lm_single") / "runs" / "lm", LM)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def test_language_model_equals_a_hand_written_loop(lm_single) -> None:
    result = lm_single
    reference = hand_written_lm_loop(12)
    losses = result.losses()
    assert sorted(losses) == list(range(1, 13))
    for step, ref in enumerate(reference, start=1):
        assert abs(losses[step] - ref) <= 1e-6, (step, losses[step], ref)
    assert reference[-1] < reference[0]
    # the records an LM run adds, and the banner's line about the text
    from dtrain.models import GPT
    params = sum(p.numel() for p in GPT(vocab_size=256, seq_len=SEQ, dim=32, depth=2, heads=2).parameters())
    record = [r for r in result.records() if "loss" in r][-1]
    assert record["tokens_per_s"] == pytest.approx(record["samples_per_s"] * SEQ, rel=1e-9)
    assert record["flops_per_s"] == pytest.approx(6 * params * record["tokens_per_s"], rel=1e-9)
    assert "text from the built-in corpus (Python documentation, 466273 bytes)" in result.stderr
    final = [r for r in result.records() if "val_loss" in r][-1]
    assert final["val_bits_per_byte"] == pytest.approx(final["val_loss"] / math.log(2), rel=1e-12)
    assert final["val_perplexity"] == pytest.approx(math.exp(final["val_loss"]), rel=1e-12)


@pytest.mark.slow
def test_language_model_ddp_and_fsdp_agree(lm_runs) -> None:
    ddp, fsdp = lm_runs["ddp"].losses(), lm_runs["fsdp"].losses()
    assert sorted(ddp) == sorted(fsdp) == list(range(1, 13))
    for step in ddp:
        assert abs(ddp[step] - fsdp[step]) <= 1e-5, (step, ddp[step], fsdp[step])


@pytest.mark.slow
def test_language_model_evaluation_counts_every_window_once(lm_runs) -> None:
    windows = len(corpus_windows("val"))
    assert windows % 2 == 1  # one rank pads its last batch: the padding must not count
    for mode, result in lm_runs.items():
        reported = [r for r in result.records() if "val_loss" in r][-1]
        weights = torch.load(latest(result.run_dir) / "checkpoint.pt", weights_only=True)["model"]
        assert reported["val_loss"] == pytest.approx(evaluate_by_hand(weights), abs=1e-6), mode


@pytest.mark.slow
def test_language_model_killed_and_resumed_is_bit_exact(lm_runs, tmp_path) -> None:
    slow = [*(o for o in LM if not o.startswith(("model.name", "model.args"))),
            "model.name=user_tasks:slow_gpt",
            f"model.args={{vocab_size: 256, seq_len: {SEQ}, dim: 32, depth: 2, heads: 2}}"]
    # The straight run to match is lm_runs' DDP run: the slow model only sleeps, so the killed
    # run's steps before the kill (the slow model straight through) and those after the resume
    # must both be that run's, bit for bit.
    straight = lm_runs["ddp"]
    killed_at, resumed = kill_then_resume(tmp_path / "runs" / "killed",
                                          [*slow, "parallel.mode=ddp"], at_step=4)
    assert killed_at < 12
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stderr
    assert sorted(resumed.losses()) == list(range(1, 13))
    assert resumed.losses() == straight.losses()  # bitwise


# ---------------------------------------------------------------------------------------------
# A user's task: a regression on dict batches

REGRESSION = ["task.name=user_tasks:regression", "model.name=user_tasks:regressor",
              "data.name=user_tasks:points", "data.synthetic.train_size=512",
              "data.synthetic.val_size=101", "ckpt.monitor=val_loss", "ckpt.monitor_mode=min",
              "optim.lr=0.05", "train.max_steps=16", "ckpt.every_steps=4",
              "train.eval_every_epochs=0"]


@pytest.mark.slow
def test_a_users_regression_on_dict_batches_trains_evaluates_exactly_and_resumes(tmp_path) -> None:
    straight = launch(tmp_path / "runs" / "straight", REGRESSION, nproc=2)
    assert straight.returncode == 0, straight.stderr[-3000:]
    losses = straight.losses()
    assert losses[16] < 0.5 * losses[1], losses
    final = [r for r in straight.records() if "val_loss" in r][-1]
    assert set(final) >= {"val_loss", "val_abs_error"}
    # exact evaluation: the 101 validation points, each once, by hand
    from user_tasks import Points, Regressor
    model = Regressor()
    model.load_state_dict(torch.load(latest(straight.run_dir) / "checkpoint.pt",
                                     weights_only=True)["model"])
    points = Points(101, 2)
    with torch.no_grad():
        error = model.eval()(points.x) - points.y
    assert final["val_loss"] == pytest.approx(error.square().double().mean().item(), abs=1e-6)
    assert final["val_abs_error"] == pytest.approx(error.abs().double().mean().item(), abs=1e-6)
    # rank 1 dies at its 10th forward; torchrun restarts both, which resume from step 8
    restarted = launch(tmp_path / "runs" / "restarted", [*REGRESSION, "model.args={kill_at: 10}"],
                       nproc=2, torchrun_args=["--max-restarts=1"])
    assert restarted.returncode == 0, restarted.stderr[-3000:]
    assert "resumed from" in (restarted.run_dir / "log.txt").read_text()
    assert restarted.losses() == losses


# ---------------------------------------------------------------------------------------------
# What models return

def test_a_model_that_returns_a_dict_trains_as_a_classifier(tmp_path) -> None:
    result = launch(tmp_path / "runs" / "r", ["model.name=user_tasks:dict_output_cnn",
                                              "train.max_steps=4"])
    assert result.returncode == 0, result.stderr[-3000:]
    assert len(result.losses()) == 4 and "val_acc" in result.evals()[-1]


def test_a_model_that_computes_its_own_loss_on_keyword_inputs(tmp_path) -> None:
    result = launch(tmp_path / "runs" / "r", ["task.name=model_loss", "model.name=user_tasks:own_loss_gpt",
                                              "data.name=user_tasks:token_dicts", "data.batch_size=8",
                                              "optim.name=adamw", "optim.lr=0.003", "train.max_steps=10",
                                              "ckpt.monitor=val_loss", "ckpt.monitor_mode=min"])
    assert result.returncode == 0, result.stderr[-3000:]
    losses = result.losses()
    assert losses[10] < losses[1]
    assert [r for r in result.records() if "val_loss" in r][-1]["val_loss"] < 5.6  # ln 256 = 5.55


# ---------------------------------------------------------------------------------------------
# Bad task input: one line, exit 2, nothing written

@pytest.mark.parametrize("overrides,message", [
    (["task.name=translation"], "config error: task.name: unknown task 'translation'; use one of "
                                "classification, language_model, model_loss or module:function"),
    (["task.name=user_tasks:nothing"], "config error: task.name: 'user_tasks' has no callable 'nothing'"),
    (["task.name=user_tasks:no_metrics"], "config error: task.name: user_tasks:no_metrics returned "
                                          "Half, which has no metrics(model, batch) method"),
    (["task.name=user_tasks:not_scalar"], "task error: loss(model, batch) returned (16,), not a "
                                          "scalar tensor; reduce it to one number (e.g. .mean())"),
    (["task.name=user_tasks:not_per_sample"], "task error: metrics(model, batch)['loss'] has shape "
                                              "(); metrics must be per-sample, of shape (16,) for this batch"),
    (["task.name=user_tasks:regression", "ckpt.monitor=val_mse"],
     "config error: ckpt.monitor: 'val_mse' is not reported by the task; it reports val_loss, "
     "val_abs_error"),
    (["task.name=language_model", "ckpt.monitor=val_acc"],
     "config error: ckpt.monitor: 'val_acc' is not a metric the language_model task reports; use "
     "one of val_loss, val_perplexity, val_bits_per_byte"),
])
def test_bad_task_input_is_one_line_and_exit_2(tmp_path, overrides, message) -> None:
    common = ["model.name=user_tasks:regressor", "data.name=user_tasks:points",
              "data.synthetic.train_size=64", "data.synthetic.val_size=16", "ckpt.monitor=val_loss",
              "ckpt.monitor_mode=min"]
    result = launch(tmp_path / "runs" / "r", [*common, *overrides])
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr.strip().splitlines() == [f"dtrain: {message}"]
    assert not (tmp_path / "runs").exists()


@pytest.mark.slow
def test_a_task_error_under_torchrun_is_one_line_for_the_job(tmp_path) -> None:
    result = launch(tmp_path / "runs" / "r", ["task.name=user_tasks:not_scalar",
                                              "model.name=user_tasks:regressor",
                                              "data.name=user_tasks:points", "ckpt.monitor=val_loss",
                                              "ckpt.monitor_mode=min"], nproc=2)
    assert result.returncode != 0 and "exitcode  : 2" in result.stderr
    assert result.stderr.count("dtrain: task error: loss(model, batch) returned") == 1
    assert not (tmp_path / "runs").exists()


# ---------------------------------------------------------------------------------------------
# plan and export know the language model

def test_plan_and_export_of_a_language_model(lm_single, tmp_path) -> None:
    plan = dtrain("plan", "--config", "configs/gpt_text.yaml", "--nproc", "2")
    assert plan.returncode == 0, plan.stderr
    assert "windows of 129 tokens (vocabulary 256)" in plan.stdout
    assert "activations not estimated" not in plan.stdout
    result = lm_single  # its newest checkpoint is of its last step, 12
    for fmt in ("state_dict", "torchscript"):
        out = tmp_path / f"lm.{fmt}"
        exported = dtrain("export", "--checkpoint", str(latest(result.run_dir)), "--out", str(out),
                          "--format", fmt)
        assert exported.returncode == 0, exported.stderr[-3000:]
        assert "outputs match the checkpoint on a batch" in exported.stdout
    weights = torch.load(tmp_path / "lm.state_dict", weights_only=True)
    assert weights["head.weight"].shape == (256, 32)
    assert json.loads((latest(result.run_dir) / "COMPLETE").read_text())["step"] == 12
