"""`dtrain export --format onnx|safetensors`: an ONNX model of each built-in model family agrees
with PyTorch under onnxruntime on real validation batches of any size; safetensors round-trips
into the model dtrain builds (tied weights included); both from full checkpoints and from a
sharded 2-rank FSDP one; an operator the exporter cannot convert, an export that does not agree,
a missing extra and bad input are each one line with their exit code. Real launches and real
`dtrain export` processes throughout."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
import torch

from conftest import REPO, TESTS, dtrain, latest, launch

onnxruntime = pytest.importorskip("onnxruntime")
safetensors_torch = pytest.importorskip("safetensors.torch")

SEQ = 32
LM = ["task.name=language_model", "model.name=gpt",
      f"model.args={{dim: 32, depth: 2, heads: 2, seq_len: {SEQ}}}", "data.name=text",
      "data.text.corpus=python_docs", "data.batch_size=8", "ckpt.monitor=val_loss",
      "ckpt.monitor_mode=min"]
# A few steps of each family, so that no weight is left at its initial value.
FAMILIES = {
    # With EMA weights as well, so that the EMA tests export from the runs that the others do
    # (a checkpoint without EMA weights: gpt's).
    "simple_cnn": ["train.max_steps=3", "train.ema.decay=0.5"],
    "resnet_small": ["model.name=resnet_small", "model.args={}", "train.max_steps=3"],
    "gpt": [*LM, "train.max_steps=3"],
    # torchvision's smallest classifier, on the 32 px synthetic images
    "tv:mobilenet_v3_small": ["model.name=tv:mobilenet_v3_small", "model.args={}",
                              "data.synthetic.train_size=64", "data.synthetic.val_size=20",
                              "train.max_steps=3"],
}
ONNX_LINE = re.compile(r"\(onnx, opset \d+, ([\d.]+) s\); onnxruntime agrees with PyTorch on "
                       r"the first validation batch \((\d+) samples?\).*: max abs difference "
                       r"(\S+) <= 0\.0001$")
# User models for the failure cases, importable by the training and export processes.
USER_MODELS = '''
import torch
from torch import nn


class CumMax(nn.Module):
    """cummax: an operator torch.onnx's exporter has no ONNX function for."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3 * 32 * 32, 10)

    def forward(self, x):
        return torch.cummax(self.fc(x.flatten(1)), dim=1)[0]


class Counting(nn.Module):
    """A forward that counts its calls into its output: the export bakes in the count at
    tracing time, so the ONNX model's outputs are not PyTorch's."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3 * 32 * 32, 10)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return self.fc(x.flatten(1)) * self.calls


def cummax(cfg):
    return CumMax()


def counting(cfg):
    return Counting()
'''


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """family -> its trained run directory, each trained once for the whole module."""
    root = tmp_path_factory.mktemp("export")
    made: dict[str, Path] = {}

    def get(family: str, nproc: int = 0, extra: tuple[str, ...] = ()) -> Path:
        key = f"{family}-{nproc}-{'-'.join(extra)}"
        if key not in made:
            run_dir = root / "runs" / re.sub(r"\W", "_", key)
            result = launch(run_dir, [*FAMILIES[family], *extra], nproc=nproc)
            assert result.returncode == 0, result.stderr[-3000:]
            made[key] = run_dir
        return made[key]

    return get


@pytest.fixture(scope="module")
def user_models(tmp_path_factory) -> dict:
    """The environment under which `export_users:...` models import."""
    folder = tmp_path_factory.mktemp("user_models")
    (folder / "export_users.py").write_text(USER_MODELS)
    return {"PYTHONPATH": os.pathsep.join([str(folder), TESTS, str(REPO / "src")])}


def export(*args: str, env: dict | None = None):
    return dtrain("export", *args, timeout=300, env=env)


@pytest.fixture(scope="module")
def simple_cnn_onnx(runs, tmp_path_factory):
    """The ONNX export of the simple_cnn run, its check on a validation batch of 5 (a data.*
    override): made once, read by the simple_cnn case of the family test and by
    test_onnx_check_reads_the_batch_that_data_overrides_name."""
    out = tmp_path_factory.mktemp("simple_cnn_onnx") / "m.onnx"
    result = export("--run", str(runs("simple_cnn")), "--out", str(out), "--format", "onnx",
                    "data.eval_batch_size=5")
    return result, out


def validation_batch(checkpoint: Path, size: int) -> torch.Tensor:
    """The model's input for `size` samples of the run's validation data, after the on-device
    step, as `dtrain export` builds it."""
    from dtrain.commands.export.command import load_model
    from dtrain.commands.export.onnx_file import validation_inputs

    _, meta = load_model(str(checkpoint))
    inputs = validation_inputs(meta, [f"data.eval_batch_size={size}"]).inputs
    assert inputs.shape[0] == size
    return inputs


# -- ONNX, each built-in family --------------------------------------------------------------------

@pytest.mark.parametrize("family", [
    "simple_cnn",
    pytest.param("resnet_small", marks=pytest.mark.slow),
    pytest.param("gpt", marks=pytest.mark.slow),
    pytest.param("tv:mobilenet_v3_small", marks=pytest.mark.slow),
])
def test_onnx_of_each_family_agrees_with_pytorch_under_onnxruntime(family, runs, tmp_path,
                                                                   request) -> None:
    import onnx

    from dtrain.commands.export.command import load_model

    run_dir = runs(family)
    if family == "simple_cnn":  # the module's export of it (checked on a batch of 5)
        result, out = request.getfixturevalue("simple_cnn_onnx")
    else:
        out = tmp_path / "model.onnx"
        result = export("--run", str(run_dir), "--out", str(out), "--format", "onnx")
    assert result.returncode == 0, result.stderr[-3000:]
    line = result.stdout.strip().splitlines()[-1]
    found = ONNX_LINE.search(line)
    assert found, line
    print(f"\n{family}: ONNX export {found[1]} s")  # the figure docs/after_training.md quotes
    assert float(found[3]) <= 1e-4
    onnx.checker.check_model(str(out))
    # Again here, on another batch size than the command's check: the batch is dynamic.
    session = onnxruntime.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    (graph_input,) = session.get_inputs()
    assert graph_input.shape[0] == "batch"
    assert [o.name for o in session.get_outputs()] == ["logits"]
    about = session.get_modelmeta().custom_metadata_map
    assert json.loads(about["model_name"]) == family
    assert about["weights"] == "model" and about["step"] == "3"
    model, meta = load_model(str(latest(run_dir)))
    inputs = validation_batch(latest(run_dir), 3)
    if family == "gpt":  # token ids, and a sequence shorter than the trained one
        assert graph_input.type == "tensor(int64)" and graph_input.shape[1] == "tokens"
        assert "input_mean" not in about
        inputs = inputs[:, :5]
    else:  # the normalised images the model sees, not the loader's uint8 ones
        assert graph_input.type == "tensor(float)"
        assert inputs.dtype == torch.float32 and inputs.min() < 0
        # The metadata says how a serving team gets them from the raw pixels.
        from dtrain import config, data

        cfg = config.from_dict(meta["config"])
        raw = data.collate([data.build(cfg.data, cfg.run.seed).val[i] for i in range(3)])[0]
        mean, std = (torch.tensor(json.loads(about[k])).view(-1, 1, 1)
                     for k in ("input_mean", "input_std"))
        assert raw.dtype == torch.uint8
        torch.testing.assert_close((raw.float() - 255 * mean) / (255 * std), inputs)
    (got,) = session.run(None, {graph_input.name: inputs.numpy()})
    with torch.no_grad():
        expected = model(inputs)
    assert got.shape == tuple(expected.shape)
    assert (torch.from_numpy(got) - expected).abs().max().item() <= 1e-4
    assert expected.abs().max().item() > 1e-3  # outputs with something in them to compare


def test_onnx_check_reads_the_batch_that_data_overrides_name(runs, simple_cnn_onnx,
                                                            tmp_path) -> None:
    run_dir = runs("simple_cnn")
    result, out = simple_cnn_onnx  # exported with data.eval_batch_size=5
    assert result.returncode == 0, result.stderr[-3000:]
    assert out.is_file()
    assert ONNX_LINE.search(result.stdout.strip())[2] == "5"
    bad = export("--run", str(run_dir), "--out", str(tmp_path / "n.onnx"), "--format", "onnx",
                 "model.name=gpt")
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert bad.stderr.strip() == (
        "dtrain: export error: override 'model.name=gpt': only data.* keys are taken (they say "
        "where the check's validation batch comes from; the model is the checkpoint's)")
    moved = export("--run", str(run_dir), "--out", str(tmp_path / "o.onnx"), "--format", "onnx",
                   "data.name=imagefolder", f"data.root={tmp_path / 'nowhere'}")
    assert moved.returncode == 2 and len(moved.stderr.strip().splitlines()) == 1
    assert moved.stderr.startswith("dtrain: data error: ")
    assert "give its place with data.* overrides, e.g. data.root=PATH" in moved.stderr
    assert [p.name for p in tmp_path.iterdir()] == []  # neither n.onnx nor o.onnx


# -- safetensors -----------------------------------------------------------------------------------

def test_safetensors_round_trip_into_the_model_dtrain_builds(runs, tmp_path) -> None:
    """GPT's head is tied to its token embedding: both names are in the file, and a strict
    load_state_dict into the model built from config.yaml gives the checkpoint's outputs."""
    from safetensors import safe_open

    from dtrain import config, models
    from dtrain.commands.export.command import load_model

    checkpoint = latest(runs("gpt"))
    out = tmp_path / "hf"
    result = export("--checkpoint", str(checkpoint), "--out", str(out), "--format", "safetensors")
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.startswith(f"exported {checkpoint} -> {out / 'model.safetensors'} ")
    assert sorted(p.name for p in out.iterdir()) == ["config.yaml", "model.safetensors"]
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        meta = f.metadata()
    assert json.loads(meta["model_name"]) == "gpt"
    assert json.loads(meta["model_args"]) == {"dim": 32, "depth": 2, "heads": 2, "seq_len": SEQ}
    assert meta["dtrain_version"] == __import__("dtrain").__version__
    assert json.loads(meta["tied"]) == [["tok_emb.weight", "head.weight"]]
    assert meta["weights"] == "model" and meta["step"] == "3"
    tensors = safetensors_torch.load_file(str(out / "model.safetensors"))
    cfg = config.load(str(out / "config.yaml"))
    rebuilt = models.build(cfg.model, json.loads(meta["model_info"]), seed=123)
    rebuilt.load_state_dict(tensors, strict=True)
    assert rebuilt.head.weight is rebuilt.tok_emb.weight  # still tied after the load
    original, _ = load_model(str(checkpoint))
    for name, value in original.state_dict().items():
        assert torch.equal(tensors[name], value), name
    tokens = validation_batch(checkpoint, 4)
    with torch.no_grad():
        assert torch.equal(rebuilt.eval()(tokens), original(tokens))


def test_safetensors_to_a_named_file_puts_its_config_beside_it(runs, tmp_path) -> None:
    checkpoint = latest(runs("simple_cnn"))
    out = tmp_path / "w" / "cnn.safetensors"
    result = export("--checkpoint", str(checkpoint), "--out", str(out), "--format", "safetensors")
    assert result.returncode == 0, result.stderr[-3000:]
    assert sorted(p.name for p in out.parent.iterdir()) == ["cnn.config.yaml", "cnn.safetensors"]
    saved = torch.load(checkpoint / "checkpoint.pt", weights_only=True)["model"]
    tensors = safetensors_torch.load_file(str(out))
    assert tensors.keys() == saved.keys()
    assert all(torch.equal(tensors[k], saved[k]) for k in saved)


# -- from a sharded checkpoint ---------------------------------------------------------------------

@pytest.mark.slow
def test_both_formats_from_a_sharded_two_rank_fsdp_checkpoint(runs, tmp_path) -> None:
    """One process, no process group: the DCP shards of 2 ranks read into the whole model.
    torch's own DCP-to-file conversion is the independent reference for the weights."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    run_dir = runs("simple_cnn", nproc=2, extra=("parallel.mode=fsdp",))
    checkpoint = latest(run_dir)
    assert (checkpoint / "dcp").is_dir() and not (checkpoint / "checkpoint.pt").exists()
    st = export("--checkpoint", str(checkpoint), "--out", str(tmp_path / "st"),
                "--format", "safetensors")
    assert st.returncode == 0, st.stderr[-3000:]
    dcp_to_torch_save(str(checkpoint / "dcp"), str(tmp_path / "whole.pt"))
    reference = torch.load(tmp_path / "whole.pt", weights_only=True)["model"]
    tensors = safetensors_torch.load_file(str(tmp_path / "st" / "model.safetensors"))
    assert tensors.keys() == reference.keys()
    assert all(torch.equal(tensors[k], reference[k]) for k in reference)
    onnx_out = tmp_path / "m.onnx"
    result = export("--run", str(run_dir), "--out", str(onnx_out), "--format", "onnx")
    assert result.returncode == 0, result.stderr[-3000:]
    assert float(ONNX_LINE.search(result.stdout.strip())[3]) <= 1e-4
    session = onnxruntime.InferenceSession(str(onnx_out), providers=["CPUExecutionProvider"])
    from dtrain.models import SimpleCNN

    model = SimpleCNN(num_classes=10, in_channels=3, width=8)
    model.load_state_dict(reference)
    images = validation_batch(checkpoint, 7)
    (got,) = session.run(None, {"input": images.numpy()})
    with torch.no_grad():
        assert (torch.from_numpy(got) - model.eval()(images)).abs().max().item() <= 1e-4


# -- failures: one line each -----------------------------------------------------------------------

@pytest.fixture(scope="module")
def user_runs(tmp_path_factory, user_models) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("user_runs")
    made = {}
    for name in ("cummax", "counting"):
        run_dir = root / "runs" / name
        result = launch(run_dir, [f"model.name=export_users:{name}", "model.args={}",
                                  "train.max_steps=1"], env=user_models)
        assert result.returncode == 0, result.stderr[-3000:]
        made[name] = run_dir
    return made


def test_an_operator_the_exporter_cannot_convert_is_named_exit_1(user_runs, user_models,
                                                                  tmp_path) -> None:
    out = tmp_path / "m.onnx"
    result = export("--run", str(user_runs["cummax"]), "--out", str(out), "--format", "onnx",
                    "--trust-remote-code", env=user_models)
    assert result.returncode == 1, result.stderr[-3000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr
    assert lines[0].startswith("dtrain: export error: the ONNX exporter cannot convert the "
                               "operator aten.cummax.default (")
    assert lines[0].endswith("keep it out of the exported forward, or export another format")
    assert not out.exists() and result.stdout == ""


def test_onnx_outputs_that_differ_exit_1_with_the_figure_and_no_file(user_runs, user_models,
                                                                     tmp_path) -> None:
    out = tmp_path / "m.onnx"
    result = export("--run", str(user_runs["counting"]), "--out", str(out), "--format", "onnx",
                    "--trust-remote-code", env=user_models)
    assert result.returncode == 1, result.stderr[-3000:]
    (line,) = result.stderr.strip().splitlines()
    found = re.fullmatch(r"dtrain: export error: onnxruntime's outputs differ from PyTorch's by "
                         r"(\S+) \(> 0\.0001\) on the first validation batch \(16 samples\) "
                         r"and its first sample alone; (.*) was not written", line)
    assert found, line
    assert float(found[1]) > 1e-4 and found[2] == str(out)
    assert not out.exists()


@pytest.mark.parametrize("fmt,module", [("onnx", "onnxruntime"), ("onnx", "onnxscript"),
                                        ("safetensors", "safetensors")])
def test_a_missing_extra_is_one_line_naming_it_exit_2(fmt, module, runs, tmp_path) -> None:
    shim = tmp_path / "shim"
    shim.mkdir()
    # In the child only: `module` cannot be found, as when the extra was not installed.
    (shim / "sitecustomize.py").write_text(
        "import sys\n"
        "class Hide:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        f"        if name == {module!r} or name.startswith({module + '.'!r}):\n"
        "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
        "sys.meta_path.insert(0, Hide())\n")
    out = tmp_path / "out" / "m"
    result = export("--run", str(runs("simple_cnn")), "--out", str(out), "--format", fmt,
                    env={"PYTHONPATH": os.pathsep.join([str(shim), TESTS, str(REPO / "src")])})
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"dtrain: missing dependency: dtrain export --format {fmt} ({module}) needs the "
        f"'export' extra: pip install 'dtrain[export]'"]
    assert not (tmp_path / "out").exists()


def test_bad_export_arguments_are_one_line_exit_2(runs, tmp_path) -> None:
    run_dir = str(runs("simple_cnn"))
    unknown = export("--run", run_dir, "--out", str(tmp_path / "m"), "--format", "tflite")
    assert unknown.returncode == 2 and "Traceback" not in unknown.stderr
    assert "argument --format: invalid choice: 'tflite'" in unknown.stderr.splitlines()[-1]
    weights = export("--run", run_dir, "--out", str(tmp_path / "m"), "--weights", "best")
    assert weights.returncode == 2
    assert "argument --weights: invalid choice: 'best'" in weights.stderr.splitlines()[-1]
    missing = export("--checkpoint", str(tmp_path / "gone"), "--out", str(tmp_path / "m"),
                     "--format", "safetensors")
    assert missing.returncode == 2 and missing.stderr.strip() == (
        f"dtrain: export error: --checkpoint {tmp_path / 'gone'}: no such checkpoint folder or "
        f"file")
    run = export("--checkpoint", run_dir, "--out", str(tmp_path / "m.onnx"), "--format", "onnx")
    assert run.returncode == 2 and run.stderr.strip() == (
        f"dtrain: export error: --checkpoint {run_dir} is a run directory; give it as --run-dir "
        f"{run_dir} (its newest checkpoint) or name one of its checkpoints")
    stray = export("--run", run_dir, "--out", str(tmp_path / "m.pt"), "data.root=x")
    assert stray.returncode == 2
    assert stray.stderr.strip() == (
        "dtrain: export error: data.* overrides steer the validation batch of --format onnx's "
        "check only; drop them")
    assert not any(tmp_path.iterdir())


# -- EMA weights -----------------------------------------------------------------------------------

def test_weights_ema_without_ema_in_the_checkpoint_is_one_line_exit_2(runs, tmp_path) -> None:
    checkpoint = latest(runs("gpt"))  # trained without train.ema
    result = export("--checkpoint", str(checkpoint), "--out", str(tmp_path / "m.onnx"),
                    "--format", "onnx", "--weights", "ema")
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr.strip() == (
        f"dtrain: export error: {checkpoint} was saved without EMA weights (train.ema.decay "
        f"unset); use --weights model")
    assert not (tmp_path / "m.onnx").exists()


@pytest.mark.slow
def test_weights_ema_exports_the_average_in_both_formats(runs, tmp_path) -> None:
    """From a full and from a sharded FSDP checkpoint: safetensors holds the checkpoint's
    average (not the trained weights), and the ONNX model computes with it."""
    from dtrain.loop.ema import load_ema_into
    from dtrain.commands.export.command import load_model

    run_dir = runs("simple_cnn")  # trained with train.ema.decay=0.5
    checkpoint = latest(run_dir)
    saved = torch.load(checkpoint / "checkpoint.pt", weights_only=True)
    out = tmp_path / "st"
    result = export("--checkpoint", str(checkpoint), "--out", str(out), "--format", "safetensors",
                    "--weights", "ema")
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.startswith(f"exported {checkpoint} (ema weights) -> ")
    tensors = safetensors_torch.load_file(str(out / "model.safetensors"))
    assert saved["ema"].keys() and saved["ema"].keys() <= tensors.keys()
    for name, value in saved["model"].items():
        expected = saved["ema"].get(name, value)  # buffers are the model's own
        assert torch.equal(tensors[name], expected), name
    assert any(not torch.equal(saved["ema"][k], saved["model"][k]) for k in saved["ema"])
    onnx_out = tmp_path / "ema.onnx"
    result = export("--checkpoint", str(checkpoint), "--out", str(onnx_out), "--format", "onnx",
                    "--weights", "ema")
    assert result.returncode == 0, result.stderr[-3000:]
    model, _ = load_model(str(checkpoint))
    load_ema_into(model, str(checkpoint))
    images = validation_batch(checkpoint, 3)
    session = onnxruntime.InferenceSession(str(onnx_out), providers=["CPUExecutionProvider"])
    (got,) = session.run(None, {"input": images.numpy()})
    with torch.no_grad():
        assert (torch.from_numpy(got) - model(images)).abs().max().item() <= 1e-4
        trained, _ = load_model(str(checkpoint))
        assert (torch.from_numpy(got) - trained(images)).abs().max().item() > 1e-3


@pytest.mark.slow
def test_weights_ema_from_a_sharded_fsdp_checkpoint(runs, tmp_path) -> None:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    # The sharded run test_both_formats_from_a_sharded_two_rank_fsdp_checkpoint exports too.
    run_dir = runs("simple_cnn", nproc=2, extra=("parallel.mode=fsdp",))  # with EMA weights
    checkpoint = latest(run_dir)
    result = export("--checkpoint", str(checkpoint), "--out", str(tmp_path / "st"),
                    "--format", "safetensors", "--weights", "ema")
    assert result.returncode == 0, result.stderr[-3000:]
    dcp_to_torch_save(str(checkpoint / "dcp"), str(tmp_path / "whole.pt"))
    whole = torch.load(tmp_path / "whole.pt", weights_only=True)
    tensors = safetensors_torch.load_file(str(tmp_path / "st" / "model.safetensors"))
    assert whole["ema"].keys() and whole["ema"].keys() <= tensors.keys()
    for name, value in whole["model"].items():
        assert torch.equal(tensors[name], whole["ema"].get(name, value)), name
