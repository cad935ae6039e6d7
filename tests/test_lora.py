"""LoRA (`model.lora`): adapters on a frozen base, for `hf:` models and the built-in `gpt`, under
none/DDP/FSDP; checkpoints that hold only what trains, resumed exactly (also onto another world
size), checked against the base they were trained on, and exported as peft's adapter folder or
merged into the base. The models are made here from small configs, never downloaded."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
import transformers
from conftest import dtrain, latest, launch
from safetensors.torch import load_file

from dtrain import models
from dtrain.checkpoint.state import dcp_model_shapes
from dtrain.commands.export.command import load_model
from dtrain.config import LoraConfig, ModelConfig
from dtrain.core.errors import UserError
from test_hf_models import GPT2, LLAMA, LM
from test_tokens import token_folder

pytestmark = pytest.mark.slow
LORA = ["model.lora.r=4", "model.lora.alpha=8", "ckpt.every_steps=3", "train.max_steps=6",
        "optim.lr=0.01"]


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> dict[str, Path]:
    """A small Llama saved as save_pretrained writes it, and token files for it."""
    root = tmp_path_factory.mktemp("lora")
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA)).save_pretrained(root / "llama")
    return {"llama": root / "llama", "tokens": token_folder(root / "tokens")}


@pytest.fixture(scope="module")
def runs(base, tmp_path_factory) -> dict:
    """The same LoRA fine-tune under FSDP (sharded checkpoints), DDP (full ones) and HSDP (2
    replicas of 1 shard) on 2 ranks, and in one process with the 2 ranks' batch; and its first
    3 steps alone under FSDP."""
    root = tmp_path_factory.mktemp("lora_runs")
    job = [*LM, *LORA, f"model.name=hf:{base['llama']}", f"data.root={base['tokens']}"]
    made = {
        "fsdp": launch(root / "fsdp", [*job, "parallel.mode=fsdp", "ckpt.format=sharded"], nproc=2),
        "ddp": launch(root / "ddp", [*job, "parallel.mode=ddp"], nproc=2),
        "hsdp": launch(root / "hsdp", [*job, "parallel.mode=fsdp", "ckpt.format=sharded",
                                       "parallel.fsdp.hybrid_replicas=2"], nproc=2),
        "none": launch(root / "none", [*job, "data.batch_size=16"]),
        "short": launch(root / "short", [*job, "parallel.mode=fsdp", "ckpt.format=sharded",
                                         "train.max_steps=3"], nproc=2),
    }
    for run in made.values():
        assert run.returncode == 0, run.stderr[-3000:]
    return {**made, "job": job, "root": root}


def test_only_the_adapters_train_alike_under_fsdp_ddp_and_one_process(runs):
    """peft's default targets for Llama (q_proj, v_proj) get adapters; the FSDP units are the
    model's own blocks; the four modes give the same losses, which fall."""
    fsdp = runs["fsdp"]
    assert "LoRA r=4, alpha 8 on q_proj, v_proj: 3,584 of 1,347,712 " in fsdp.stderr
    assert "FSDP units: 2 LlamaDecoderLayer (the model's _no_split_modules)" in fsdp.stderr
    losses = {mode: runs[mode].losses() for mode in ("fsdp", "ddp", "hsdp", "none")}
    assert len(losses["fsdp"]) == 6 and losses["fsdp"][6] < losses["fsdp"][1]
    for mode in ("ddp", "hsdp", "none"):
        assert losses[mode] == pytest.approx(losses["fsdp"], rel=1e-5), mode


def test_a_checkpoint_holds_the_adapters_and_their_optimizer_state_only(runs):
    """The sharded checkpoint's model tensors are the adapters' (nothing of the frozen base),
    and the whole checkpoint is a few percent of what the model with Adam's state would be."""
    folder = latest(runs["fsdp"].run_dir)
    shapes = dcp_model_shapes(folder)
    assert shapes and all(".lora_A." in k or ".lora_B." in k for k in shapes)
    assert len(shapes) == 2 * 2 * 2  # 2 layers x (q_proj, v_proj) x (A, B)
    optimizer = dcp_model_shapes(folder, prefix="optimizer.state.")
    assert optimizer and all(".lora_" in k for k in optimizer)
    on_disk = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
    params = sum(t.numel() for t in _base_weights(runs).values())
    assert on_disk < 0.05 * params * 4 * 3  # weights, Adam's two moments, in float32
    full = latest(runs["ddp"].run_dir) / "checkpoint.pt"
    saved = torch.load(full, weights_only=True)
    assert sorted(saved["model"]) == sorted(shapes)
    assert saved["model_info"]["lora_base"]["weights"].endswith("llama")


def _base_weights(runs) -> dict[str, torch.Tensor]:
    name = next(a for a in runs["job"] if a.startswith("model.name=hf:"))
    return load_file(str(Path(name.split(":", 1)[1]) / "model.safetensors"))


def test_resume_continues_exactly_also_onto_another_world_size(runs):
    """The 3-step run resumed to step 6 on its 2 ranks has the straight run's losses, bit for
    bit; resumed on 1 rank with the 2 ranks' batch, the same within float32's rounding."""
    root = runs["root"]
    for name in ("same", "one"):
        shutil.copytree(runs["short"].run_dir, root / name)
    same = launch(root / "same", [*runs["job"], "parallel.mode=fsdp", "ckpt.format=sharded"],
                  nproc=2)
    one = launch(root / "one", [*runs["job"], "data.batch_size=16",
                                "ckpt.resume_config_change=allow"])
    for run in (same, one):
        assert run.returncode == 0, run.stderr[-3000:]
        assert "resumed from" in run.stderr
    straight = runs["fsdp"].losses()
    after = {s: v for s, v in straight.items() if s > 3}
    assert {s: v for s, v in same.losses().items() if s > 3} == after
    assert "world size changed from 2 to 1" in one.stderr
    assert {s: v for s, v in one.losses().items() if s > 3} == pytest.approx(after, rel=1e-5)


def test_export_peft_loads_onto_the_base_and_hf_holds_the_merged_model(runs, base, tmp_path):
    """`--format peft` is a folder PeftModel.from_pretrained(base, DIR) loads with the run's
    logits; `--format hf` the model merged as peft's merge_and_unload merges it."""
    import peft

    run_dir = runs["fsdp"].run_dir
    adapters, merged = tmp_path / "adapters", tmp_path / "merged"
    made = dtrain("export", "--run-dir", str(run_dir), "--format", "peft", "--out", str(adapters))
    assert made.returncode == 0, made.stderr[-3000:]
    assert "outputs match the checkpoint on a batch" in made.stdout
    made = dtrain("export", "--run-dir", str(run_dir), "--format", "hf", "--out", str(merged))
    assert made.returncode == 0, made.stderr[-3000:]
    assert "1 safetensors file, no tokenizer files, the adapters merged into the base file by " \
        "file" in made.stdout  # the sharded checkpoint's merge: never the whole model
    # In files of at most 1 MB, with an index; the full checkpoint of the DDP run (the same
    # adapters) merges through the whole model.
    in_parts, whole = tmp_path / "in_parts", tmp_path / "whole"
    made = dtrain("export", "--run-dir", str(run_dir), "--format", "hf", "--out", str(in_parts),
                  "--max-shard-size", "1MB")
    assert made.returncode == 0, made.stderr[-3000:]
    assert len(list(in_parts.glob("model-*-of-*.safetensors"))) > 2
    assert (in_parts / "model.safetensors.index.json").is_file()
    made = dtrain("export", "--run-dir", str(runs["ddp"].run_dir), "--format", "hf", "--out",
                  str(whole))
    assert made.returncode == 0, made.stderr[-3000:]
    assert "merged into the base file by file" not in made.stdout

    tokens = torch.randint(0, LLAMA["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(1))
    theirs = peft.PeftModel.from_pretrained(
        transformers.AutoModelForCausalLM.from_pretrained(base["llama"]), adapters).eval()
    ours, _ = load_model(str(latest(run_dir)), adapters=True)
    with torch.no_grad():
        expected = ours(tokens).logits
        assert torch.allclose(theirs(tokens).logits, expected, atol=1e-6, rtol=0)
        by_peft = theirs.merge_and_unload()(tokens).logits
        for folder in (merged, in_parts, whole):
            exported = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
            assert (exported(tokens).logits - by_peft).abs().max() <= 1e-5, folder.name
    # dtrain eval puts the adapters on their base as resuming does: the run's own val_loss.
    evaluated = dtrain("eval", "--run-dir", str(run_dir))
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    last = [r for r in runs["fsdp"].records() if "val_loss" in r][-1]
    reported = float(evaluated.stdout.split("val_loss ")[1].split()[0])
    assert reported == pytest.approx(last["val_loss"], rel=1e-5)
    # The adapters moved the model off its base.
    plain = transformers.AutoModelForCausalLM.from_pretrained(base["llama"]).eval()
    with torch.no_grad():
        assert (plain(tokens).logits - expected).abs().max() > 1e-4
    # A base changed since training (one byte of its weights): the merge is refused.
    weights = base["llama"] / "model.safetensors"
    original = weights.read_bytes()
    try:
        weights.write_bytes(original[:-1] + bytes([original[-1] ^ 1]))
        refused = dtrain("export", "--run-dir", str(run_dir), "--format", "hf", "--out",
                         str(tmp_path / "refused"))
    finally:
        weights.write_bytes(original)
    assert refused.returncode == 2, refused.stderr[-2000:]
    assert "the base changed" in refused.stderr.strip().splitlines()[-1]
    assert not (tmp_path / "refused").exists()


GPT = ["task.name=language_model", "model.name=gpt", "model.args={dim: 32, depth: 2, heads: 2}",
       "data.name=text", "data.text.corpus=python_docs", "data.text.seq_len=32",
       "data.batch_size=8", "optim.name=adamw", "optim.lr=0.003", "optim.weight_decay=0.0",
       "ckpt.monitor=val_loss", "ckpt.monitor_mode=min", "train.eval_every_epochs=0",
       "train.max_steps=3", "ckpt.format=full"]


def test_gpt_fine_tunes_from_its_pretraining_and_a_changed_base_is_refused(tmp_path):
    """The built-in gpt, pretrained, then LoRA on it (model.init_from): the frozen base holds
    the pretrained weights, a resume continues, and once the base file changes, resuming,
    evaluating and exporting the adapters each end with one line (exit 2)."""
    pretrained = launch(tmp_path / "pre", GPT)
    assert pretrained.returncode == 0, pretrained.stderr[-3000:]
    weights = tmp_path / "base.pt"
    pre_model, _ = load_model(str(latest(pretrained.run_dir)))
    torch.save(pre_model.state_dict(), weights)  # as `dtrain export --format state_dict` writes
    job = [*GPT, "model.lora.r=2", f"model.init_from={weights}", "ckpt.every_steps=3"]
    tuned = launch(tmp_path / "tuned", job)
    assert tuned.returncode == 0, tuned.stderr[-3000:]
    assert "LoRA r=2, alpha 16 on proj, qkv:" in tuned.stderr
    adapted, _ = load_model(str(latest(tuned.run_dir)), adapters=True)
    frozen = {name: t for name, t in adapted.state_dict().items() if ".lora_" not in name}
    assert torch.equal(frozen["base_model.model.blocks.0.attn.qkv.base_layer.weight"],
                       pre_model.state_dict()["blocks.0.attn.qkv.weight"])
    longer = launch(tmp_path / "tuned", [*job, "train.max_steps=5"])
    assert longer.returncode == 0 and "resumed from" in longer.stderr, longer.stderr[-3000:]
    # dtrain eval puts the adapters on the init_from base they trained on: the run's val_loss.
    evaluated = dtrain("eval", "--run-dir", str(tmp_path / "tuned"))
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    last = [r for r in longer.records() if "val_loss" in r][-1]
    assert float(evaluated.stdout.split("val_loss ")[1].split()[0]) == pytest.approx(
        last["val_loss"], rel=1e-5)

    changed = torch.load(weights, weights_only=True)
    changed["norm.weight"] += 1
    torch.save(changed, weights)
    again = launch(tmp_path / "tuned", [*job, "train.max_steps=7"])
    assert again.returncode == 2
    line = again.stderr.strip().splitlines()[-1]
    assert "its LoRA adapters were trained on the base" in line and "the base changed" in line
    assert str(weights) in line
    for command in (["eval", "--run-dir", str(tmp_path / "tuned")],
                    ["export", "--run-dir", str(tmp_path / "tuned"), "--format", "peft",
                     "--out", str(tmp_path / "adapters")]):
        refused = dtrain(*command)
        assert refused.returncode == 2, refused.stderr[-2000:]
        assert "the base changed" in refused.stderr.strip().splitlines()[-1]
    assert not (tmp_path / "adapters").exists()


def test_gpt2_in_several_files_merges_file_by_file_as_peft_merges_it(base, tmp_path):
    """Another family: GPT-2 (Conv1D layers, weights stored (in, out); the head tied to the
    token embedding), saved in several files. Its sharded LoRA checkpoint merges file by file,
    equal to peft's merge_and_unload, and the head stays tied."""
    import peft

    torch.manual_seed(0)
    folder = tmp_path / "gpt2"
    transformers.GPT2LMHeadModel(transformers.GPT2Config(**GPT2)).save_pretrained(
        folder, max_shard_size="200KB")
    assert len(list(folder.glob("model-*-of-*.safetensors"))) > 1
    tuned = launch(tmp_path / "tuned", [*LM, *LORA, f"model.name=hf:{folder}", "train.max_steps=3",
                                        f"data.root={base['tokens']}", "parallel.mode=fsdp",
                                        "ckpt.format=sharded"], nproc=2)
    assert tuned.returncode == 0, tuned.stderr[-3000:]
    assert "LoRA r=4, alpha 8 on c_attn:" in tuned.stderr
    adapters, merged = tmp_path / "adapters", tmp_path / "merged"
    for fmt, out in (("peft", adapters), ("hf", merged)):
        made = dtrain("export", "--run-dir", str(tuned.run_dir), "--format", fmt, "--out", str(out))
        assert made.returncode == 0, made.stderr[-3000:]
    assert "the adapters merged into the base file by file" in made.stdout
    tokens = torch.randint(0, GPT2["vocab_size"], (2, 16),
                           generator=torch.Generator().manual_seed(3))
    plain = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    exported = transformers.AutoModelForCausalLM.from_pretrained(merged).eval()
    assert exported.lm_head.weight is exported.transformer.wte.weight
    with torch.no_grad():
        expected = plain(tokens).logits
        by_peft = peft.PeftModel.from_pretrained(
            transformers.AutoModelForCausalLM.from_pretrained(folder), adapters
        ).merge_and_unload()(tokens).logits
        assert (exported(tokens).logits - by_peft).abs().max() <= 1e-5
        assert (by_peft - expected).abs().max() > 1e-4  # the adapters moved it


def test_an_hf_base_from_init_from_merges_onto_those_weights(runs, base, tmp_path):
    """LoRA on an `hf:` model whose starting weights are another file's (model.init_from: say,
    a full fine-tune of it): eval and `--format hf` put the adapters on those weights, not on
    the folder's."""
    start = {k: v + 0.01 for k, v in _base_weights(runs).items()}
    weights = tmp_path / "start.pt"
    torch.save(start, weights)
    tuned = launch(tmp_path / "tuned", [*runs["job"], f"model.init_from={weights}",
                                        "parallel.mode=fsdp", "ckpt.format=sharded",
                                        "train.max_steps=3"], nproc=2)
    assert tuned.returncode == 0, tuned.stderr[-3000:]
    evaluated = dtrain("eval", "--run-dir", str(tuned.run_dir))
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    last = [r for r in tuned.records() if "val_loss" in r][-1]
    assert float(evaluated.stdout.split("val_loss ")[1].split()[0]) == pytest.approx(
        last["val_loss"], rel=1e-5)
    merged = tmp_path / "merged"
    made = dtrain("export", "--run-dir", str(tuned.run_dir), "--format", "hf", "--out",
                  str(merged))
    assert made.returncode == 0, made.stderr[-3000:]
    assert "merged into the base file by file" not in made.stdout  # (the folder's is not it)
    assert "torch.distributed is disabled" not in made.stderr
    exported = load_file(str(merged / "model.safetensors"))
    name = "model.embed_tokens.weight"  # no adapter: the starting weights as they were
    assert torch.equal(exported[name], start[name])
    ours, _ = load_model(str(latest(tuned.run_dir)))
    tokens = torch.randint(0, LLAMA["vocab_size"], (2, 16),
                           generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        theirs = transformers.AutoModelForCausalLM.from_pretrained(merged).eval()
        assert (theirs(tokens).logits - ours(tokens).logits).abs().max() <= 1e-5


def test_targets_that_match_nothing_are_one_line_and_a_classifier_head_trains(base):
    """A misspelt target module names the nearest module; by default a classifier's head
    (the last linear layer with a unit per class) trains in full beside the adapters."""
    def build(name: str, **lora) -> torch.nn.Module:
        cfg = ModelConfig(name=name, lora=LoraConfig(r=2, **lora))
        return models.build(cfg, {"vocab_size": 64, "seq_len": 16, "num_classes": 5,
                                  "in_channels": 3}, seed=0)

    with pytest.raises(UserError) as e:
        build(f"hf:{base['llama']}", target_modules=["q_projj"])
    assert str(e.value).startswith("config error: model.lora.target_modules: no module of "
                                   f"hf:{base['llama']} is named 'q_projj' (did you mean 'q_proj'?)")
    with pytest.raises(UserError) as e:
        build("simple_cnn")
    assert str(e.value).startswith("config error: model.lora.target_modules: there is no default "
                                   "for simple_cnn; name the layers that get adapters")
    cnn = build("transformer", target_modules=["all-linear"])
    trained = sorted({n.split(".default.")[0] for n, p in cnn.named_parameters() if p.requires_grad})
    assert "base_model.model.head.modules_to_save" in trained
    assert not any("head.lora_" in n for n in trained)
    assert any("mlp.0.lora_A" in n for n in trained)


def test_plan_counts_no_gradients_or_optimizer_state_for_the_frozen_base(base):
    """`dtrain plan` of a LoRA run: its checkpoints are the adapters' size, and
    --memory-limit shows its modes beside full fine-tuning of the same model."""
    job = [f"model.name=hf:{base['llama']}", f"data.root={base['tokens']}", "task.name=language_model",
           "data.name=tokens", "data.tokens.seq_len=32", "optim.name=adamw", "model.args={}",
           "ckpt.monitor=val_loss", "ckpt.monitor_mode=min"]
    tuned = dtrain("plan", *job, "model.lora.r=4", "--memory-limit", "8GiB", "--nproc", "2")
    full = dtrain("plan", *job, "--memory-limit", "8GiB", "--nproc", "2")
    assert tuned.returncode == 0 and full.returncode == 0, tuned.stderr[-2000:] + full.stderr[-2000:]
    rows = {line.split()[0] + " " + line.split()[1]: line for line in tuned.stdout.splitlines()
            if line.startswith(("  LoRA ", "  full ")) and "fits" not in line and "," in line}
    assert set(rows) == {f"{kind} {mode}" for kind in ("LoRA", "full")
                         for mode in ("ddp", "fsdp", "fsdp+ac")}
    assert "grads 0, optimizer 0" in rows["LoRA ddp"] and "grads 5, optimizer 10" in rows["full ddp"]
    lora_size, full_size = (_checkpoint_size(dtrain("plan", *job, *more).stdout)
                            for more in (["model.lora.r=4"], []))
    assert 10_000 < lora_size < 0.01 * full_size  # 66 KiB (metadata, mostly) of 15.4 MiB


def _checkpoint_size(text: str) -> float:
    """The bytes of one checkpoint, as the plan's `checkpoint` line gives them."""
    import re
    number, unit = re.search(r"checkpoint  \w+, about ([\d.]+) (\w+) each", text).groups()
    return float(number) * {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}[unit]
