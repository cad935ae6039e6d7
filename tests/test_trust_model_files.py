"""A model folder's files are a stranger's: a safetensors file whose header contradicts itself
or the file (a shape that disagrees with its byte range, an unknown dtype, overlapping ranges, a
truncated file), weights of another shape than the folder's config.json describes, a config.json
value no model can be built with, an index that lists pickled weights: each is one line naming
the file and the tensor (or the key), exit 2, before anything is loaded or written, for
`model.name: hf:PATH` (also under FSDP, where each rank reads its own rows) and for
`model.init_from` a `.safetensors` file. A full disk under an export to safetensors is the
exporters' one line; a LoRA base whose config.json changed is refused as a changed base."""

from __future__ import annotations

import json
import shutil
import struct
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import transformers
from conftest import dtrain, launch
from test_hf_models import LM
from test_tokens import token_folder

LLAMA = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=512, max_position_embeddings=64)
WEIGHTS = "model.safetensors"
STEPS = ["train.max_steps=2"]


@pytest.fixture(scope="module")
def made(tmp_path_factory) -> dict[str, Path]:
    """A small Llama as save_pretrained writes it, token files for it, and a run trained from it
    (`run`)."""
    root = tmp_path_factory.mktemp("model_files")
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA)).save_pretrained(root / "llama")
    tokens = token_folder(root / "tokens")
    trained = launch(root / "runs" / "run", [*LM, *STEPS, f"model.name=hf:{root / 'llama'}",
                                             f"data.root={tokens}"])
    assert trained.returncode == 0, trained.stderr[-3000:]
    return {"root": root, "llama": root / "llama", "tokens": tokens, "run": trained.run_dir}


def header(file: Path) -> tuple[dict, bytes]:
    """The safetensors file's header (parsed) and the bytes after it."""
    data = file.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8:8 + length]), data[8 + length:]


def rewrite(file: Path, change: Callable[[dict], None]) -> None:
    """The file with its header changed by `change` (the tensors' bytes as they were)."""
    entries, data = header(file)
    change(entries)
    text = json.dumps(entries).encode()
    file.write_bytes(struct.pack("<Q", len(text)) + text + data)


def set_field(tensor: str, **fields) -> Callable[[Path], None]:
    return lambda folder: rewrite(folder / WEIGHTS, lambda entries: entries[tensor].update(fields))


def truncate(folder: Path) -> None:
    (folder / WEIGHTS).write_bytes((folder / WEIGHTS).read_bytes()[:300_000])


def config_field(**fields) -> Callable[[Path], None]:
    def change(folder: Path) -> None:
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**config, **fields}))
    return change


def index_listing(name: str) -> Callable[[Path], None]:
    """The weights moved to `name`, and an index that lists them there."""
    def change(folder: Path) -> None:
        (folder / WEIGHTS).rename(folder / name.rsplit("/", 1)[-1])
        (folder / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {}, "weight_map": {"lm_head.weight": name}}))
    return change


Q = "model.layers.0.self_attn.q_proj.weight"
# The damage to the safetensors file itself: the same for a folder's weights and for init_from.
# case -> (damage, the line's end after the file's path)
DAMAGED_FILES = {
    "shape against offsets": (set_field(Q, shape=[64, 32]), (
        f": tensor '{Q}': shape [64, 32] of F32 is 8,192 bytes, its data_offsets [385536, 401920] "
        f"hold 16,384: the header contradicts itself")),
    "unknown dtype": (set_field("model.norm.weight", dtype="EVIL"), (
        ": tensor 'model.norm.weight' has dtype 'EVIL', which safetensors does not know")),
    "overlapping ranges": (set_field("model.norm.weight", data_offsets=[549888, 550144]), (
        ": tensor 'model.layers.1.self_attn.v_proj.weight' at bytes [549888, 558080] overlaps "
        "tensor 'model.norm.weight'")),
    "truncated": (truncate, " is truncated (300,000 bytes of 560,488): download it again"),
    "bytes after the last tensor": (
        lambda folder: (folder / WEIGHTS).write_bytes((folder / WEIGHTS).read_bytes() + b"x" * 8),
        " has 8 bytes after its last tensor: damaged, or not written by safetensors"),
}
# case -> (damage, the file the line names, the line's end after it)
DAMAGED_FOLDERS = {
    **{case: (damage, WEIGHTS, end) for case, (damage, end) in DAMAGED_FILES.items()},
    "swapped shape": (set_field("lm_head.weight", shape=[64, 512]), WEIGHTS, (
        ": tensor 'lm_head.weight' has shape [64, 512] in the file, and [512, 64] in the model the "
        "folder's config.json describes (hidden_size 64, max_position_embeddings 64, vocab_size "
        "512): the weights and config.json are not of one model")),
    "vocab_size 1e12": (config_field(vocab_size=1e12), "config.json", (
        " cannot be read (Validation error for field 'vocab_size': TypeError: Field 'vocab_size' "
        "expected int, got float (value: 1000000000000.0))")),
    "vocab_size 10**12": (config_field(vocab_size=10**12), WEIGHTS, (
        ": tensor 'lm_head.weight' has shape [512, 64] in the file, and [1000000000000, 64] in "
        "the model the folder's config.json describes (vocab_size 1000000000000): the weights "
        "and config.json are not of one model")),
    "index lists a pickle": (index_listing("pytorch_model.bin"), "model.safetensors.index.json", (
        " lists pytorch_model.bin, not a safetensors file: dtrain does not load pickled weights "
        "(loading them can run code); convert the model to safetensors (save_pretrained writes "
        "them) where you trust it")),
    "index lists a file elsewhere": (index_listing("../elsewhere.safetensors"),
                                     "model.safetensors.index.json",
                                     " lists '../elsewhere.safetensors', which is not a file of "
                                     "the folder"),
}


def damaged_copy(made: dict[str, Path], case: str, damage: Callable[[Path], None]) -> Path:
    folder = made["root"] / "damaged" / case.replace(" ", "_").replace("*", "")
    shutil.copytree(made["llama"], folder)
    damage(folder)
    return folder


def assert_one_line(run, line: str) -> None:
    assert run.returncode == 2, run.stderr[-3000:]
    assert "Traceback (most recent call last)" not in run.stderr, run.stderr[-3000:]
    assert run.stderr.strip().splitlines()[-1] == line, run.stderr[-3000:]
    assert not run.run_dir.exists()


@pytest.mark.parametrize("case", list(DAMAGED_FOLDERS))
def test_a_damaged_model_folder_is_one_line_naming_the_file_and_tensor(made, case) -> None:
    damage, file, end = DAMAGED_FOLDERS[case]
    folder = damaged_copy(made, case, damage)
    run = launch(made["root"] / "runs" / case.replace(" ", "_").replace("*", ""),
                 [*LM, *STEPS, f"model.name=hf:{folder}", f"data.root={made['tokens']}"])
    assert_one_line(run, f"dtrain: config error: model.name: hf:{folder}: {folder / file}{end}")


@pytest.mark.parametrize("case", list(DAMAGED_FILES))
def test_a_damaged_init_from_safetensors_is_one_line_naming_the_file_and_tensor(made, case):
    damage, end = DAMAGED_FILES[case]
    file = damaged_copy(made, f"init_from {case}", damage) / WEIGHTS
    run = launch(made["root"] / "runs" / f"init_from_{case.replace(' ', '_')}",
                 [*LM, *STEPS, f"model.name=hf:{made['llama']}", f"model.init_from={file}",
                  f"data.root={made['tokens']}"])
    assert_one_line(run, f"dtrain: config error: model.init_from: {file}{end}")


def test_under_fsdp_every_rank_refuses_a_damaged_folder_in_one_line(made) -> None:
    """Each rank reads its own rows of the folder's files: every rank checks them first, and
    the job ends with rank 0's one line."""
    damage, file, end = DAMAGED_FOLDERS["unknown dtype"]
    folder = damaged_copy(made, "fsdp unknown dtype", damage)
    run = launch(made["root"] / "runs" / "fsdp", [*LM, *STEPS, f"model.name=hf:{folder}",
                                                  f"data.root={made['tokens']}",
                                                  "parallel.mode=fsdp"], nproc=2)
    line = f"dtrain: config error: model.name: hf:{folder}: {folder / file}{end}"
    assert run.returncode != 0 and "exitcode  : 2" in run.stderr  # (torchrun's summary of it)
    assert run.stderr.count("dtrain: config error") == 1, run.stderr[-3000:]
    assert line in run.stderr.splitlines(), run.stderr[-3000:]
    # No rank's traceback: torchrun's own report of the exit codes is the only one.
    frames = [line for line in run.stderr.splitlines() if line.strip().startswith("File ")]
    assert not [f for f in frames if "/dtrain/" in f or "safetensors" in f], run.stderr[-3000:]
    assert "SafetensorError" not in run.stderr
    assert not run.run_dir.exists()


@pytest.mark.parametrize("fmt", ["safetensors", "hf"])
def test_a_full_disk_under_an_export_is_one_line(made, tmpfs, fmt) -> None:
    disk = tmpfs("size=256k")  # room for the small files, not for the weights (547 KiB)
    out = disk / ("model.safetensors" if fmt == "safetensors" else "model")
    exported = dtrain("export", "--run-dir", str(made["run"]), "--format", fmt, "--out", str(out))
    assert exported.returncode == 2, exported.stderr[-3000:]
    assert "Traceback (most recent call last)" not in exported.stderr
    assert exported.stderr.strip().splitlines()[-1] == (
        f"dtrain: export error: cannot write into {disk} (the disk is full); nothing there was "
        f"changed: free space or choose another --out")
    assert not list(disk.rglob("*.safetensors"))


def test_a_lora_base_whose_config_changed_is_refused_as_a_changed_base(made) -> None:
    """The same weights under another activation or rotary base compute another model: the
    adapters trained on the base are refused on it (eval, export, resume), and accepted again
    once the config is back."""
    base = made["root"] / "lora_base"
    shutil.copytree(made["llama"], base)
    job = [*LM, *STEPS, f"model.name=hf:{base}", f"data.root={made['tokens']}",
           "model.lora.r=4", "model.lora.alpha=8"]
    tuned = launch(made["root"] / "runs" / "lora", job)
    assert tuned.returncode == 0, tuned.stderr[-3000:]
    original = (base / "config.json").read_text()
    config = json.loads(original)
    rope = {**config["rope_parameters"], "rope_theta": 500.0}
    changes = {"hidden_act": {"hidden_act": "gelu"}, "rope_theta": {"rope_parameters": rope}}
    for change, fields in changes.items():
        (base / "config.json").write_text(json.dumps({**config, **fields}))
        for command in (["eval", "--run-dir", str(tuned.run_dir)],
                        ["export", "--run-dir", str(tuned.run_dir), "--format", "hf", "--out",
                         str(made["root"] / "merged")]):
            refused = dtrain(*command)
            assert refused.returncode == 2, (change, refused.stderr[-3000:])
            line = refused.stderr.strip().splitlines()[-1]
            assert "its LoRA adapters were trained on the base" in line, (change, line)
            assert f"{base} now has config.json digest" in line and "the base changed" in line
        assert not (made["root"] / "merged").exists()
    resumed = launch(tuned.run_dir, [*job, "train.max_steps=3"])
    assert resumed.returncode == 2 and "the base changed" in resumed.stderr.splitlines()[-1]
    (base / "config.json").write_text(original)
    assert dtrain("eval", "--run-dir", str(tuned.run_dir)).returncode == 0


def test_a_checkpoint_saved_before_the_config_digest_is_checked_by_its_weights_alone() -> None:
    """Checkpoints whose record of the base has no config.json digest load as they did: the
    weights' digest decides."""
    from dtrain.checkpoint.load import ConfigChanged, check_base
    now = {"lora_base": {"weights": "base", "digest": "w1", "config_digest": "c1"}}
    check_base({"lora_base": {"weights": "base", "digest": "w1"}}, now, "old")
    with pytest.raises(ConfigChanged, match="now has digest w1: the base changed"):
        check_base({"lora_base": {"weights": "base", "digest": "w0"}}, now, "old")
    with pytest.raises(ConfigChanged, match="now has config.json digest c1: the base changed"):
        check_base({"lora_base": {"weights": "base", "digest": "w1", "config_digest": "c0"}}, now,
                   "new")
