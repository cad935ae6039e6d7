"""Quantization-aware training (train.qat): the config refuses what cannot train, fake
quantization switches on at its step and resumes exactly, a checkpoint keeps the plain model's
keys, a QAT model converts to the int8 model it trained for, and the drop after QAT is measured
beside the drop after post-training quantization, whatever it shows."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from conftest import dtrain, final_weights, launch
from dtrain import config, models
from dtrain.config import ModelConfig, QatConfig
from dtrain.core.errors import UserError
from dtrain.models import quantize
from dtrain.models.spec import spec_of

GPT_ARGS = {"vocab_size": 64, "seq_len": 32, "dim": 64, "depth": 2, "heads": 4}
QAT = QatConfig(scheme="int8-dynamic")


@pytest.mark.parametrize(("overrides", "message"), [
    (["train.qat.scheme=int8-dinamic"], "config error: train.qat.scheme: unknown scheme "
     "'int8-dinamic' (did you mean 'int8-dynamic'?); quantization-aware training trains for "
     "int8-dynamic"),
    (["train.qat.scheme=int8-static"], "config error: train.qat.scheme: int8-static has no fake "
     "quantization to train with; quantization-aware training trains for int8-dynamic (quantize "
     "a trained run with int8-static by dtrain export instead)"),
    (["train.qat.scheme=int8-dynamic", "train.qat.start_step=-1"],
     "config error: train.qat.start_step: must be >= 0, got -1"),
    (["train.qat.start_step=3"], "config error: train.qat.start_step is set but "
     "train.qat.scheme is not; name the scheme (int8-dynamic) or drop train.qat"),
])
def test_a_config_qat_cannot_train_is_one_line(overrides, message) -> None:
    with pytest.raises(UserError) as e:
        config.load(None, overrides)
    assert str(e.value) == message


def test_the_config_names_the_schemes_quantize_implements() -> None:
    assert tuple(quantize.SCHEMES) == config.QUANTIZATION_SCHEMES
    assert set(config.QAT_SCHEMES) <= set(quantize.SCHEMES)


def test_lora_and_qat_together_are_refused() -> None:
    section = ModelConfig(name="gpt", args=GPT_ARGS, lora=config.LoraConfig(r=4))
    with pytest.raises(UserError, match="train.qat with model.lora"):
        spec_of(section, QAT)


def gpt() -> nn.Module:
    return models.build(ModelConfig(name="gpt", args=GPT_ARGS), {}, seed=0)


def test_fake_quantization_is_off_until_its_step_and_keeps_the_plain_keys() -> None:
    spec = spec_of(ModelConfig(name="gpt", args=GPT_ARGS), QatConfig("int8-dynamic", 5))
    plain, model = gpt().eval(), gpt().eval()
    keys = {k: v.shape for k, v in model.state_dict().items()}
    spec.fake_quantize(model)
    assert {k: v.shape for k, v in model.state_dict().items()} == keys
    assert "after 5 step(s) in float" in spec.describe(model)
    batch = torch.randint(0, 64, (4, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert not spec.switch_fake_quantization(model, 4)
        assert torch.equal(model(batch), plain(batch))  # off: the plain layers, bit for bit
        assert spec.switch_fake_quantization(model, 5)
        assert not torch.equal(model(batch), plain(batch))
    assert spec_of(ModelConfig(name="gpt", args=GPT_ARGS)).qat is None


# -- resuming: the step alone decides whether fake quantization is on ---------------------------

RESUME = ["train.qat.scheme=int8-dynamic", "train.qat.start_step=4", "parallel.mode=ddp",
          "ckpt.every_epochs=0", "train.eval_every_epochs=0"]


@pytest.fixture(scope="module")
def resumed_runs(tmp_path_factory) -> dict:
    """A 2-rank DDP run of 10 steps fake-quantized after 4, made straight; the same run
    stopped after 2 steps (before the start step) and after 6 (after it), resumed each time;
    and the checkpoint of step 2 resumed on one process."""
    root = tmp_path_factory.mktemp("qat")
    straight = launch(root / "runs" / "straight", [*RESUME, "train.max_steps=10"], nproc=2)
    assert straight.returncode == 0, straight.stderr[-3000:]
    parts = root / "runs" / "parts"
    runs = {"straight": straight}
    for name, steps in (("to_2", 2), ("to_6", 6), ("to_10", 10)):
        runs[name] = launch(parts, [*RESUME, f"train.max_steps={steps}"], nproc=2)
        assert runs[name].returncode == 0, runs[name].stderr[-3000:]
        if steps == 2:  # the checkpoint of step 2, for a resume at another world size
            shutil.copytree(parts, root / "runs" / "other_world")
    other = root / "runs" / "other_world"
    runs["other_world"] = launch(other, [*RESUME, "train.max_steps=6"], nproc=0)
    assert runs["other_world"].returncode == 0, runs["other_world"].stderr[-3000:]
    return runs


@pytest.mark.slow
def test_a_qat_run_stopped_before_and_after_its_start_resumes_bit_exactly(resumed_runs) -> None:
    straight, last = resumed_runs["straight"], resumed_runs["to_10"]
    assert "fake-quantized after 4 step(s) in float" in straight.stderr
    assert "step 4: fake quantization on from here" in straight.stderr
    assert "step 4: fake quantization on from here" in resumed_runs["to_6"].stderr
    resumed = {**resumed_runs["to_2"].losses(), **resumed_runs["to_6"].losses(), **last.losses()}
    assert resumed == straight.losses()  # bitwise, every step
    a, b = final_weights(straight.run_dir), final_weights(last.run_dir)  # the plain model's keys
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


@pytest.mark.slow
def test_a_qat_run_resumes_on_another_world_size(resumed_runs) -> None:
    run = resumed_runs["other_world"]
    assert "world size changed from 2 to 1" in run.stderr, run.stderr[-3000:]
    assert "step 4: fake quantization on from here" in run.stderr
    assert max(run.losses()) == 6


# -- under FSDP: prepared before sharding, the sharded run trains what DDP's does ----------------

GPT_RUN = ["task.name=language_model", "model.name=gpt",
           "model.args={dim: 32, depth: 2, heads: 2, seq_len: 32}", "data.name=text",
           "data.text.corpus=python_docs", "data.batch_size=8", "ckpt.monitor=val_loss",
           "ckpt.monitor_mode=min"]
FSDP = [*GPT_RUN, *RESUME, "parallel.mode=fsdp"]


def test_fake_quantization_prepared_shard_by_shard_is_the_whole_models(monkeypatch) -> None:
    """Prepared within FSDP's shard-by-shard construction, the swapped layers draw the same
    random numbers as on the whole model and keep its values and ties; a preparation that
    unties a parameter is refused (the whole-model build follows)."""
    from dtrain.parallel import sharded_init

    monkeypatch.setattr(sharded_init, "FULL_BYTES", 1000)  # the tiny GPT's matrices in rows
    spec = spec_of(ModelConfig(name="gpt", args=GPT_ARGS), QAT)
    torch.manual_seed(5)
    whole = gpt()
    spec.fake_quantize(whole)
    after = torch.rand(3)
    for index in (0, 1):
        torch.manual_seed(5)
        model, params, _ = sharded_init.build_local(gpt, 2, index, prepare=spec.fake_quantize)
        assert torch.equal(torch.rand(3), after)  # the same random stream from here on
        assert len(quantize.fake_quantized_layers(model)) == 9
        assert model.head.weight is model.tok_emb.weight
        for name, param in whole.named_parameters(remove_duplicate=False):
            got = params[name]
            if isinstance(got, sharded_init.Rows):
                got, param = got.local, param[got.start:got.stop]
            assert torch.equal(got, param.detach()), name

    def untie(model: nn.Module) -> None:
        model.head = nn.Linear(GPT_ARGS["dim"], GPT_ARGS["vocab_size"], bias=False)

    with pytest.raises(sharded_init.NotReplayable, match="untied its tied parameters"):
        sharded_init.build_local(gpt, 2, 0, prepare=untie)


@pytest.fixture(scope="module")
def fsdp_runs(tmp_path_factory) -> dict:
    """The tiny GPT, 2 ranks, 10 steps fake-quantized after 4: under FSDP (sharded checkpoints)
    straight, and stopped after 2 and 6 steps and resumed each time; under DDP straight; and
    `dtrain eval` of the straight FSDP run."""
    root = tmp_path_factory.mktemp("qat_fsdp") / "runs"
    runs = {"ddp": launch(root / "ddp", [*GPT_RUN, *RESUME, "train.max_steps=10"], nproc=2),
            "straight": launch(root / "straight", [*FSDP, "train.max_steps=10"], nproc=2)}
    for steps in (2, 6, 10):
        runs[f"to_{steps}"] = launch(root / "parts", [*FSDP, f"train.max_steps={steps}"], nproc=2)
    for name, run in runs.items():
        assert run.returncode == 0, (name, run.stderr[-3000:])
    runs["eval"] = dtrain("eval", "--run", str(root / "straight"), timeout=300)
    assert runs["eval"].returncode == 0, runs["eval"].stderr[-3000:]
    return runs


@pytest.mark.slow
def test_an_fsdp_qat_run_resumes_bit_exactly_and_trains_as_ddp_does(fsdp_runs) -> None:
    straight, last = fsdp_runs["straight"], fsdp_runs["to_10"]
    assert "Linear layer(s) fake-quantized after 4 step(s) in float" in straight.stderr
    assert "step 4: fake quantization on from here" in fsdp_runs["to_6"].stderr
    resumed = {**fsdp_runs["to_2"].losses(), **fsdp_runs["to_6"].losses(), **last.losses()}
    assert resumed == straight.losses()  # bitwise, every step
    # FSDP reduce-scatters the gradients where DDP all-reduces them, but over 2 ranks each sum
    # has two terms (no order to differ) and averaging halves exactly: the same run, bit for
    # bit (more ranks would round their sums in another order, and need a tolerance).
    assert straight.losses() == fsdp_runs["ddp"].losses()
    sharded, whole = final_weights(straight.run_dir), final_weights(fsdp_runs["ddp"].run_dir)
    resumed_weights = final_weights(last.run_dir)
    assert sharded.keys() == whole.keys()  # the plain model's keys
    for name in sharded:
        assert torch.equal(sharded[name], resumed_weights[name]), name
        assert torch.equal(sharded[name], whole[name]), name


@pytest.mark.slow
def test_dtrain_eval_of_an_fsdp_qat_run_equals_its_final_evaluation(fsdp_runs) -> None:
    result = json.loads(Path(fsdp_runs["eval"].stdout.strip().splitlines()[-1].split(" -> ")[1])
                        .read_text())
    trained = [r for r in fsdp_runs["straight"].records() if "val_loss" in r][-1]
    assert result["val_loss"] == trained["val_loss"]


# -- QAT against PTQ, the same run length -------------------------------------------------------

STEPS, BATCH = 150, 16


def batches(n: int, seed: int) -> list[torch.Tensor]:
    """Sequences of a fixed random walk over the vocabulary (each token picks among 4 next
    ones): something a tiny model learns in a few hundred steps."""
    table = torch.randint(0, 64, (64, 4), generator=torch.Generator().manual_seed(0))
    generator = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        seq = [torch.randint(0, 64, (BATCH,), generator=generator)]
        for _ in range(GPT_ARGS["seq_len"]):
            pick = torch.randint(0, 4, (BATCH,), generator=generator)
            seq.append(table[seq[-1], pick])
        out.append(torch.stack(seq, 1))
    return out


def val_loss(model: nn.Module, val: list[torch.Tensor]) -> float:
    with torch.no_grad():
        return sum(F.cross_entropy(model(b[:, :-1]).flatten(0, 1), b[:, 1:].flatten()).item()
                   for b in val) / len(val)


def trained(qat: QatConfig | None) -> nn.Module:
    spec = spec_of(ModelConfig(name="gpt", args=GPT_ARGS), qat)
    model = gpt()
    spec.fake_quantize(model)
    spec.switch_fake_quantization(model, 0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    torch.manual_seed(0)
    model.train()
    for b in batches(STEPS, seed=1):
        loss = F.cross_entropy(model(b[:, :-1]).flatten(0, 1), b[:, 1:].flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model.eval()


def test_qat_and_ptq_drops_on_the_same_validation_batches(capsys) -> None:
    val = batches(8, seed=2)
    plain = trained(None)
    with_qat = trained(QAT)
    float_loss = val_loss(plain, val)
    ptq_loss = val_loss(quantize.quantize(plain, "int8-dynamic", []), val)
    # The QAT run as a checkpoint gives it back: a plain model with its weights.
    rebuilt = gpt().eval()
    rebuilt.load_state_dict(with_qat.state_dict())
    converted = spec_of(ModelConfig(name="gpt", args=GPT_ARGS), QAT).quantized(rebuilt)
    assert not quantize.fake_quantized_layers(rebuilt)  # the caller's model is left plain
    qat_fake_loss, qat_loss = val_loss(with_qat, val), val_loss(converted, val)
    with torch.no_grad():  # converted, it computes what training's fake quantization computed
        fake, real = with_qat(val[0][:, :-1]), converted(val[0][:, :-1])
    # Within a rounding step here and there (int8 kernels against float fake quantization).
    conversion_error = ((real - fake).abs().max() / fake.abs().max()).item()
    assert conversion_error < 1e-2
    ptq_drop, qat_drop = ptq_loss - float_loss, qat_loss - float_loss
    recovered = 100 * (ptq_drop - qat_drop) / ptq_drop if ptq_drop else float("nan")
    with capsys.disabled():
        print(f"\nval loss after {STEPS} steps: float {float_loss:.4f}; PTQ int8-dynamic "
              f"{ptq_loss:.4f} (drop {ptq_drop:+.4f}); QAT fake-quantized {qat_fake_loss:.4f}, "
              f"converted {qat_loss:.4f} (drop {qat_drop:+.4f} against the float run); "
              f"recovered {recovered:.0f} %; converted against fake-quantized logits "
              f"{100 * conversion_error:.2f} % of the largest")
    assert math.isfinite(ptq_drop) and math.isfinite(qat_drop)
