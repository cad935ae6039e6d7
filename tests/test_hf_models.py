"""Hugging Face models by path: `model.name: hf:PATH` (a folder save_pretrained wrote, or a model
id in the local cache) and `hf-config:PATH` (its architecture, fresh weights). The models are
made here from small configs of two families (Llama: rotary positions, untied head; GPT-2:
learned positions, tied embeddings), never downloaded."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
import transformers
from conftest import latest, launch

from dtrain.config import ModelConfig
from dtrain.core.errors import UserError
from dtrain.models import hf
from dtrain.tasks import LanguageModel
from test_tokens import token_folder

# Large enough that the embedding and head (4096 x 128 floats, 2 MiB) are built shard by shard.
LLAMA = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=4096, max_position_embeddings=128)
GPT2 = dict(n_embd=64, n_layer=2, n_head=4, vocab_size=600, n_positions=128, bos_token_id=0,
            eos_token_id=0)
LM = ["task.name=language_model", "model.args={}", "data.name=tokens", "data.batch_size=8",
      "data.tokens.seq_len=32", "optim.name=adamw", "optim.lr=0.003", "optim.weight_decay=0.0",
      "ckpt.monitor=val_loss", "ckpt.monitor_mode=min", "train.eval_every_epochs=0",
      "ckpt.format=full"]


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    """Saved models (`llama`, `gpt2`, `llama_cls`: a sequence classifier) and token files."""
    root = tmp_path_factory.mktemp("hf")
    made = {}
    torch.manual_seed(0)
    for name, model in (
        ("llama", transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA))),
        ("gpt2", transformers.GPT2LMHeadModel(transformers.GPT2Config(**GPT2))),
        ("llama_cls", transformers.LlamaForSequenceClassification(
            transformers.LlamaConfig(**LLAMA, num_labels=2, pad_token_id=0))),
    ):
        model.save_pretrained(root / name)
        made[name] = root / name
    made["tokens"] = token_folder(root / "tokens")
    return made


def file_weights(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file
    return load_file(str(folder / "model.safetensors"))


def checkpoint_model(run_dir: Path) -> dict[str, torch.Tensor]:
    return torch.load(latest(run_dir) / "checkpoint.pt", weights_only=False)["model"]


@pytest.mark.slow
def test_a_folder_fine_tunes_under_ddp_and_fsdp_alike_from_the_files_weights(folders, tmp_path):
    """FSDP on 2 ranks builds the model shard by shard with the file's weights, bit for bit,
    wraps the model's own blocks, and trains as DDP does. (A step at lr 1e-30 saves the weights
    it started from: the update is far below float32's resolution of every weight, none of
    which is 0.)"""
    job = [*LM, f"model.name=hf:{folders['llama']}", f"data.root={folders['tokens']}"]
    still = launch(tmp_path / "still", [*job, "parallel.mode=fsdp", "optim.lr=1e-30",
                                        "train.max_steps=1"], nproc=2)
    assert still.returncode == 0, still.stderr[-3000:]
    assert "model constructed shard by shard" in still.stderr
    read = re.search(r"each rank read only its own rows of the folder's safetensors "
                     r"\(([\d.]+) of ([\d.]+) MiB here\)", still.stderr)
    assert read and float(read[1]) < float(read[2])  # (the embedding and head by halves)
    assert "FSDP units: 2 LlamaDecoderLayer (the model's _no_split_modules), then the root" \
        in still.stderr
    saved, original = checkpoint_model(still.run_dir), file_weights(folders["llama"])
    assert saved.keys() == original.keys()
    assert all(torch.equal(saved[k], original[k]) for k in original)

    runs = {mode: launch(tmp_path / mode, [*job, f"parallel.mode={mode}", "train.max_steps=4"],
                         nproc=2) for mode in ("ddp", "fsdp")}
    for run in runs.values():
        assert run.returncode == 0, run.stderr[-3000:]
    ddp, fsdp = runs["ddp"].losses(), runs["fsdp"].losses()
    assert len(ddp) == 4 and ddp[4] < ddp[1]
    assert fsdp == pytest.approx(ddp, rel=1e-5)


@pytest.mark.slow
def test_tied_embeddings_stay_tied_export_to_hf_and_fresh_weights_follow_the_seed(folders,
                                                                                 tmp_path):
    """GPT-2 (its head is its token embedding) under FSDP on 2 ranks: after training both names
    hold one tensor, and `dtrain export --format hf` writes a folder transformers loads with
    the same logits. `hf-config:` starts the architecture from fresh weights drawn from
    run.seed: the same seed trains alike, another seed and the file's weights differently."""
    job = [*LM, f"data.root={folders['tokens']}", "train.max_steps=3"]
    tied = launch(tmp_path / "tied", [*job, f"model.name=hf:{folders['gpt2']}",
                                      "parallel.mode=fsdp"], nproc=2)
    assert tied.returncode == 0, tied.stderr[-3000:]
    weights = checkpoint_model(tied.run_dir)
    assert torch.equal(weights["lm_head.weight"], weights["transformer.wte.weight"])
    assert not torch.equal(weights["transformer.wte.weight"],
                           file_weights(folders["gpt2"])["transformer.wte.weight"])

    # Back to a Hugging Face folder: transformers loads it, with the trained weights (tied
    # still) and the same logits; a model of dtrain's own has no such folder.
    from conftest import dtrain
    out = tmp_path / "exported"
    exported = dtrain("export", "--run-dir", str(tied.run_dir), "--format", "hf", "--out", str(out))
    assert exported.returncode == 0, exported.stderr[-3000:]
    assert "outputs match the checkpoint on a batch" in exported.stdout
    back = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert back.config.use_cache and back.lm_head.weight is back.transformer.wte.weight
    assert torch.equal(back.transformer.wte.weight, weights["transformer.wte.weight"])
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "generation_config.json",
                                                     "model.safetensors"]
    # The same checkpoint, sharded (`dtrain convert`), exports file by file in files of at most
    # 100 KB: an index, the same tensors, the same logits, the head still the embedding.
    sharded = tmp_path / "sharded"
    converted = dtrain("convert", "--checkpoint", str(latest(tied.run_dir)), "--to", "sharded",
                       "--out", str(sharded))
    assert converted.returncode == 0, converted.stderr[-3000:]
    streamed = tmp_path / "streamed"
    exported = dtrain("export", "--checkpoint", str(sharded), "--format", "hf", "--out",
                      str(streamed), "--max-shard-size", "100KB")
    assert exported.returncode == 0, exported.stderr[-3000:]
    assert "written file by file" in exported.stdout
    index = json.loads((streamed / "model.safetensors.index.json").read_text())
    files = sorted(p.name for p in streamed.glob("*.safetensors"))
    assert len(files) > 3 and sorted(set(index["weight_map"].values())) == files
    assert all((streamed / f).stat().st_size < 100_000 + 80_000 for f in files)  # (the embedding)
    whole = transformers.AutoModelForCausalLM.from_pretrained(out).state_dict()
    parts = transformers.AutoModelForCausalLM.from_pretrained(streamed)
    assert parts.lm_head.weight is parts.transformer.wte.weight and parts.config.use_cache
    assert parts.state_dict().keys() == whole.keys()
    assert all(torch.equal(parts.state_dict()[k], whole[k]) for k in whole)
    batch = torch.randint(0, GPT2["vocab_size"], (2, 16))
    with torch.no_grad():
        assert torch.equal(parts(batch).logits, back(batch).logits)
    assert (streamed / "config.json").read_text() == (out / "config.json").read_text()
    refused = dtrain("export", "--checkpoint", str(sharded), "--format", "onnx", "--out",
                     str(tmp_path / "x.onnx"), "--max-shard-size", "1GB")
    assert refused.returncode == 2
    assert refused.stderr.strip().endswith("--max-shard-size goes with --format hf")

    again = dtrain("export", "--run-dir", str(tied.run_dir), "--format", "hf", "--out", str(out))
    assert again.returncode == 2 and again.stderr.strip().endswith(
        f"--out {out} already exists (a folder); --format hf writes a new folder: name one that "
        f"is not there (or empty)")

    fresh = [*job, f"model.name=hf-config:{folders['gpt2']}"]
    first, again, other = (launch(tmp_path / name, [*fresh, f"run.seed={seed}"])
                           for name, seed in (("first", 1), ("again", 1), ("other", 2)))
    for run in (first, again, other):
        assert run.returncode == 0, run.stderr[-3000:]
    pretrained = launch(tmp_path / "pretrained", [*job, f"model.name=hf:{folders['gpt2']}"])
    assert pretrained.returncode == 0, pretrained.stderr[-3000:]
    assert first.losses() == again.losses()
    assert first.losses() != other.losses() and first.losses() != pretrained.losses()
    cnn = launch(tmp_path / "cnn", ["train.max_steps=1"])
    assert cnn.returncode == 0, cnn.stderr[-2000:]
    builtin = dtrain("export", "--run-dir", str(cnn.run_dir), "--format", "hf", "--out",
                     str(tmp_path / "cnn_hf"))
    assert builtin.returncode == 2 and builtin.stderr.strip().endswith(
        "--format hf writes Hugging Face models (model.name: hf:PATH or hf-config:PATH); this "
        "checkpoint's model is simple_cnn: use --format safetensors")
    assert not (tmp_path / "cnn_hf").exists()


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_the_language_model_loss_is_the_models_own_labels_loss(folders, family):
    """Within float32's rounding (relative 1e-6): the model sums its products in another order
    for a window one token longer."""
    model = hf.build(ModelConfig(name=f"hf:{folders[family]}", args={}), {"vocab_size": 500})
    batch = torch.randint(0, 500, (4, 33), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = LanguageModel(32).loss(model, batch)
        theirs = model(input_ids=batch, labels=batch).loss
    assert abs(ours.item() - theirs.item()) <= 1e-6 * theirs.item()


def test_the_head_follows_the_architecture_and_args_override_the_config(folders):
    """A sequence classifier gets the data's classes; model.args sets config fields (a fresh
    model of one layer); a misspelt field is one line with the close name."""
    classifier = hf.build(ModelConfig(name=f"hf:{folders['llama_cls']}", args={}, num_classes=3),
                          {})
    assert classifier.config.num_labels == 3
    assert classifier(torch.randint(1, 500, (2, 16))).logits.shape == (2, 3)
    shallow = hf.build_from_config(ModelConfig(name=f"hf-config:{folders['llama']}",
                                               args={"num_hidden_layers": 1}), {})
    assert len(shallow.model.layers) == 1
    with pytest.raises(UserError) as e:
        hf.build(ModelConfig(name=f"hf:{folders['llama']}", args={"num_hiden_layers": 1}), {})
    assert str(e.value) == ("config error: model.args.num_hiden_layers: LlamaConfig has no such "
                            "field (did you mean 'num_hidden_layers'?)")


def test_a_model_id_is_found_in_the_local_cache_only(folders, tmp_path, monkeypatch):
    """`hf:org/name` is read from the Hugging Face cache's snapshot of it; one not there is one
    line naming the cache (nothing is downloaded)."""
    import huggingface_hub
    cache = tmp_path / "hub"
    snapshot = cache / "models--tiny--llama" / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    for file in folders["llama"].iterdir():
        (snapshot / file.name).write_bytes(file.read_bytes())
    (cache / "models--tiny--llama" / "refs").mkdir()
    (cache / "models--tiny--llama" / "refs" / "main").write_text("0" * 40)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model = hf.build(ModelConfig(name="hf:tiny/llama", args={}), {})
    assert torch.equal(model.model.embed_tokens.weight,
                       file_weights(folders["llama"])["model.embed_tokens.weight"])
    with pytest.raises(UserError) as e:
        hf.build(ModelConfig(name="hf:tiny/missing", args={}), {})
    assert str(e.value).startswith(
        "config error: model.name: hf:tiny/missing: no folder 'tiny/missing', and no model "
        f"'tiny/missing' in the Hugging Face cache ({cache});")


def bad_folders(folders: dict[str, Path], root: Path) -> dict[str, tuple[str, list[str], str]]:
    """name -> (model.name, more overrides, the line's end)."""
    def copy(name: str) -> Path:
        target = root / name
        target.mkdir()
        for file in folders["llama"].iterdir():
            (target / file.name).write_bytes(file.read_bytes())
        return target

    empty = root / "empty"
    empty.mkdir()
    unknown = copy("unknown")
    config = json.loads((unknown / "config.json").read_text())
    (unknown / "config.json").write_text(json.dumps({**config, "architectures": ["NoSuchLM"]}))
    truncated = copy("truncated")
    weights = (truncated / "model.safetensors").read_bytes()
    (truncated / "model.safetensors").write_bytes(weights[: len(weights) // 2])
    return {
        "no config": (f"hf:{empty}", [], f"{empty} has no config.json; name the folder that "
                                          f"save_pretrained wrote"),
        "unknown architecture": (f"hf:{unknown}", [], "has no model class 'NoSuchLM' (the "
                                                      "architecture config.json names)"),
        "truncated weights": (f"hf:{truncated}", [], f"{truncated}/model.safetensors is truncated "
                              f"({len(weights) // 2:,} bytes of {len(weights):,}): download it "
                              f"again"),
        "vocabulary": (f"hf:{folders['gpt2']}", [f"data.root={root / 'big_vocab'}"],
                       "the model's vocabulary has 600 ids, the data's 5000; encode the data "
                       f"with the model's own tokenizer (dtrain tokenize --tokenizer "
                       f"{folders['gpt2']})"),
        "window": (f"hf:{folders['llama']}", ["data.tokens.seq_len=200"],
                   "the data's windows (200 tokens) are longer than the model's "
                   "max_position_embeddings (128); set the data's seq_len (data.tokens.seq_len, "
                   "data.text.seq_len) to at most 128"),
    }


def test_bad_model_folders_are_one_line_exit_2_and_nothing_written(folders, tmp_path):
    big_vocab = token_folder(tmp_path / "big_vocab")
    meta = json.loads((big_vocab / "meta.json").read_text())
    (big_vocab / "meta.json").write_text(json.dumps({**meta, "vocab_size": 5000}))
    for case, (name, more, end) in bad_folders(folders, tmp_path).items():
        run = launch(tmp_path / "runs" / case.replace(" ", "_"),
                     [*LM, f"data.root={folders['tokens']}", f"model.name={name}", *more])
        assert run.returncode == 2, (case, run.stderr[-2000:])
        last = run.stderr.strip().splitlines()[-1]
        assert last.startswith(f"dtrain: config error: model.name: {name}: "), (case, last)
        assert last.endswith(end), (case, last)
        assert not run.run_dir.exists(), case


def test_without_transformers_one_line_names_the_extra(folders, monkeypatch):
    import sys
    monkeypatch.setitem(sys.modules, "transformers", None)  # as if it were not installed
    with pytest.raises(UserError) as e:
        hf.build(ModelConfig(name=f"hf:{folders['llama']}", args={}), {})
    assert str(e.value) == (f"missing dependency: model.name: hf:{folders['llama']} needs the "
                            f"'transformers' extra: pip install 'dtrain[transformers]'")


def test_tokenize_with_a_models_tokenizer_gives_its_own_ids_and_eos(tmp_path):
    """`dtrain tokenize --tokenizer MODEL_DIR`: the folder's tokenizer.json encodes, each document
    ends with the folder's eos_token (one no built-in name matches), and the ids are the ones the
    model's own tokenizer gives; a folder without tokenizer.json is one line."""
    import tokenizers
    from conftest import dtrain
    from dtrain.data.text import python_docs

    text = python_docs().decode("utf-8")
    bpe = tokenizers.Tokenizer(tokenizers.models.BPE())
    bpe.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = tokenizers.decoders.ByteLevel()
    bpe.train_from_iterator([text[:200_000]], tokenizers.trainers.BpeTrainer(
        vocab_size=600, special_tokens=["<|eot_id|>"], show_progress=False,
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet()))
    folder = tmp_path / "model"
    transformers.PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|eot_id|>"
                                         ).save_pretrained(folder)
    docs = {"train": [text[i:i + 3000] for i in range(0, 30000, 3000)],
            "val": [text[40000:43000], text[50000:52000]]}
    for split, texts in docs.items():
        (tmp_path / f"{split}.jsonl").write_text("".join(json.dumps({"text": t}) + "\n"
                                                         for t in texts))
    made = dtrain("tokenize", str(tmp_path / "train.jsonl"), "--val", str(tmp_path / "val.jsonl"),
                  "--tokenizer", str(folder), "--out", str(tmp_path / "tokens"))
    assert made.returncode == 0, made.stderr[-2000:]
    own = transformers.AutoTokenizer.from_pretrained(folder)
    meta = json.loads((tmp_path / "tokens" / "meta.json").read_text())
    assert meta["eot"] == "<|eot_id|>" and meta["eot_id"] == own.eos_token_id
    import numpy as np
    for split, texts in docs.items():
        expected = [i for t in texts for i in [*own(t, add_special_tokens=False).input_ids,
                                               own.eos_token_id]]
        got = np.fromfile(tmp_path / "tokens" / f"{split}.bin", dtype=meta["dtype"]).tolist()
        assert got == expected, split

    (folder / "tokenizer.json").unlink()
    missing = dtrain("tokenize", str(tmp_path / "train.jsonl"), "--tokenizer", str(folder),
                     "--out", str(tmp_path / "again"))
    assert missing.returncode == 2
    assert missing.stderr.strip().splitlines()[-1] == (
        f"dtrain: input error: --tokenizer: {folder} has no tokenizer.json (a fast tokenizer's "
        f"file: save the tokenizer with save_pretrained, or name the file)")
    assert not (tmp_path / "again").exists()


@pytest.mark.slow
def test_the_shipped_fine_tune_config_runs_as_its_comment_says(tmp_path):
    """configs/hf_finetune.yaml's commands, a few steps each: tokens of the built-in corpus, a
    small Llama pretrained from configs/hf/tiny-llama and exported as a Hugging Face folder,
    then fine-tuned from that folder under FSDP on 2 ranks, starting where the base ended."""
    from conftest import REPO, dtrain
    config = str(REPO / "configs" / "hf_finetune.yaml")
    tokens = dtrain("tokenize", "--corpus", "python_docs", "--out", str(tmp_path / "tokens"),
                    "--vocab-size", "2048")
    assert tokens.returncode == 0, tokens.stderr[-2000:]
    steps = ["train.max_steps=4", f"data.root={tmp_path / 'tokens'}", "train.log_every=1",
             "train.eval_every_steps=4"]
    base = launch(tmp_path / "runs" / "tiny-llama-base", [
        *steps, f"model.name=hf-config:{REPO / 'configs' / 'hf' / 'tiny-llama'}",
        "train.max_steps=12", "sched.warmup_steps=0", "optim.lr=3e-3"],
        nproc=2, config=config, tiny=False)
    assert base.returncode == 0, base.stderr[-3000:]
    model = tmp_path / "models" / "tiny-llama"
    exported = dtrain("export", "--run-dir", str(base.run_dir), "--format", "hf", "--out",
                      str(model))
    assert exported.returncode == 0, exported.stderr[-3000:]
    tuned = launch(tmp_path / "runs" / "tiny-llama-tuned", [*steps, f"model.name=hf:{model}"],
                   nproc=2, config=config, tiny=False)
    assert tuned.returncode == 0, tuned.stderr[-3000:]
    assert "FSDP units: 4 LlamaDecoderLayer (the model's _no_split_modules)" in tuned.stderr
    base_val = [r["val_loss"] for r in base.records() if "val_loss" in r][-1]
    first_val = [r["val_loss"] for r in tuned.records() if "val_loss" in r]
    assert len(tuned.losses()) == 4 and first_val
    # The fine-tune starts from the base's trained weights: its first loss is near the base's
    # last evaluation, far below a fresh model's first loss (the base's).
    fresh, start = base.losses()[1], tuned.losses()[1]
    assert abs(start - base_val) < 0.25 * (fresh - base_val), (fresh, base_val, start)


def test_plan_sizes_an_hf_model_by_its_own_blocks(folders):
    """dtrain plan builds the model on the meta device (its shapes, not its weights) and counts
    the model's own blocks, as FSDP wraps them."""
    from conftest import dtrain
    planned = dtrain("plan", *[a for a in LM if not a.startswith("ckpt.format")],
                     f"model.name=hf:{folders['llama']}", f"data.root={folders['tokens']}",
                     "parallel.mode=fsdp", "--nproc", "2")
    assert planned.returncode == 0, planned.stderr[-2000:]
    count = sum(p.numel() for p in transformers.LlamaForCausalLM(
        transformers.LlamaConfig(**LLAMA)).parameters())
    assert f"model       hf:{folders['llama']}: {count / 1e6:.3f} M parameters in 2 block(s)" \
        in planned.stdout
