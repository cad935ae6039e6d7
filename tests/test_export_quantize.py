"""`dtrain export --quantize`: each format and scheme writes a file that its stock loader loads
(torch.export.load, onnxruntime), whose metric on the run's validation split is the one dtrain
printed and kept in evals/; a drop beyond --max-drop exits 1 and writes nothing; each bad input
is one line, exit 2, nothing written; a sharded FSDP checkpoint and a LoRA run quantize their
(merged) weights. Real launches and real `dtrain export` processes throughout."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
import torch

from conftest import REPO, TESTS, dtrain, launch
from test_checkpoint import assert_deflated_graph

onnxruntime = pytest.importorskip("onnxruntime")
pytest.importorskip("torchao")

CNN = ["train.max_steps=20", "data.synthetic.val_size=40"]
GPT = ["task.name=language_model", "model.name=gpt",
       "model.args={dim: 32, depth: 2, heads: 2, seq_len: 32}", "data.name=text",
       "data.text.corpus=python_docs", "data.batch_size=8", "ckpt.monitor=val_loss",
       "ckpt.monitor_mode=min", "train.max_steps=10"]
FIELDS = {"format", "scheme", "does", "metric", "before", "after", "drop", "drop_unit", "max_drop",
          "metrics_before", "metrics_after", "size_bytes_before", "size_bytes_after", "size_ratio",
          "latency_ms_before", "latency_ms_after", "latency_ratio", "latency_how",
          "latency_batches", "latency_batch_size", "calibration_batches", "checkpoint", "step",
          "weights", "data", "overrides", "time"}
CONV_ONLY = '''
from torch import nn


def conv_only(cfg):
    """A classifier without a Linear layer: int8-dynamic has nothing to quantize."""
    return nn.Sequential(nn.Conv2d(3, 10, 3), nn.AdaptiveAvgPool2d(1), nn.Flatten())
'''


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """name -> its trained run directory, each trained once for the whole module."""
    root = tmp_path_factory.mktemp("quantize")
    made: dict[str, Path] = {}

    def get(name: str, overrides: list[str], nproc: int = 0, env: dict | None = None) -> Path:
        if name not in made:
            result = launch(root / name, overrides, nproc=nproc, env=env)
            assert result.returncode == 0, result.stderr[-3000:]
            made[name] = root / name
        return made[name]

    return get


def export(*args: str, env: dict | None = None):
    return dtrain("export", *args, timeout=600, env=env)


def evals_of(run_dir: Path) -> list[dict]:
    folder = run_dir / "evals"
    return [json.loads(p.read_text()) for p in sorted(folder.glob("*.json"))] if folder.exists() else []


def recomputed(run_dir: Path, path: Path, fmt: str, metric: str) -> float:
    """The metric of the file at `path`, loaded by its stock loader, over the run's validation
    split (read as the run reads it, after the data's on-device step)."""
    from dtrain import config, data, tasks
    from dtrain.commands.export.onnx_file import model_input

    cfg = config.from_dict(config.read_yaml(str(run_dir / "config.yaml")))
    datasets = data.build(cfg.data, cfg.run.seed, cfg.model.args)
    task = tasks.build(cfg.task, datasets.info)
    if fmt == "onnx":
        session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        name = session.get_inputs()[0].name

        def model(x):
            return torch.from_numpy(session.run(None, {name: x.numpy()})[0])
    else:
        model = torch.export.load(str(path)).module()
    # The run's evaluation batches: a dynamic scheme's activation scales are each batch's own.
    size = cfg.data.eval_batch_size or cfg.data.batch_size
    loader = torch.utils.data.DataLoader(datasets.val, batch_size=size, collate_fn=data.collate)
    totals: dict[str, float] = {}
    count = 0
    with torch.no_grad():
        for batch in loader:
            batch = data.to_device(batch, torch.device("cpu"), datasets.on_device)
            inputs = model_input(task, batch)
            values = task.metrics(lambda _: model(inputs), batch)  # noqa: B023
            for key, value in values.items():
                totals[key] = totals.get(key, 0.0) + value.double().sum().item()
            count += tasks.batch_size(batch)
    return totals[metric.removeprefix("val_")] / count


CASES = [("cnn", "exported", "int8-static"), ("cnn", "onnx", "int8-static"),
         ("gpt", "onnx", "int8-dynamic"), ("gpt", "exported", "int8-dynamic"),
         pytest.param("cnn", "onnx", "int8-dynamic", marks=pytest.mark.slow),
         pytest.param("gpt", "exported", "int8-weight", marks=pytest.mark.slow),
         pytest.param("gpt", "onnx", "int8-weight", marks=pytest.mark.slow),
         pytest.param("gpt", "exported", "int8-static", marks=pytest.mark.slow)]


@pytest.mark.parametrize("family,fmt,scheme", CASES)
def test_each_format_and_scheme_loads_and_gives_the_metric_dtrain_printed(family, fmt, scheme,
                                                                           runs, tmp_path):
    run_dir = runs(family, CNN if family == "cnn" else GPT)
    before = len(evals_of(run_dir))
    out = tmp_path / f"m.{'onnx' if fmt == 'onnx' else 'pt2'}"
    calibration = ["--calibration-batches", "4"] if scheme == "int8-static" else []
    made = export("--run-dir", str(run_dir), "--format", fmt, "--quantize", scheme, "--out",
                  str(out), "--latency", "eager", *calibration)
    assert made.returncode == 0, made.stderr[-3000:]
    line = made.stdout.strip().splitlines()[-1]
    assert line.startswith(f"quantized {scheme} ({fmt}): ") and f"-> {out};" in line, line
    kept = evals_of(run_dir)
    assert len(kept) == before + 1
    result = next(r for r in kept if r["scheme"] == scheme and r["format"] == fmt)
    assert FIELDS <= set(result), FIELDS - set(result)
    metric = "val_acc" if family == "cnn" else "val_bits_per_byte"
    assert result["metric"] == metric
    assert f"{metric} {result['before']:.6g} -> {result['after']:.6g}" in line
    assert result["drop_unit"] == ("points" if family == "cnn" else "%")
    assert result["max_drop"] == (1.0 if family == "cnn" else 2.0)
    assert result["latency_how"] == ("onnxruntime" if fmt == "onnx" else "eager")
    assert result["size_bytes_after"] == os.path.getsize(out)
    if fmt == "exported":
        assert_deflated_graph(out)
    if scheme == "int8-static":
        assert result["calibration_batches"] == 4
    for name in ("val_acc", "val_loss") if family == "cnn" else ("val_loss",):
        found = recomputed(run_dir, out, fmt, name)
        assert found == pytest.approx(result["metrics_after"][name], abs=1e-5), name
    if family == "gpt" and scheme == "int8-dynamic":
        # The token table and the head tied to it: one int8 tensor in the file, no float copy.
        floats, int8 = token_tables(out, fmt)
        assert floats == [] and int8 == 1, (floats, int8)


# The GPT's token table: 256 byte ids x dim 32.
TOKEN_TABLE = [256, 32]


def token_tables(path: Path, fmt: str) -> tuple[list[str], int]:
    """The names of the file's float tensors shaped like the GPT's token table, and how many
    int8 ones it stores (tensors that share storage counted once)."""
    if fmt == "onnx":
        import onnx

        tables = [i for i in onnx.load(str(path)).graph.initializer if list(i.dims) == TOKEN_TABLE]
        floats = [i.name for i in tables if i.data_type == onnx.TensorProto.FLOAT]
        return floats, sum(i.data_type in (onnx.TensorProto.INT8, onnx.TensorProto.UINT8)
                           for i in tables)
    state = torch.export.load(str(path)).state_dict
    tables = {n: t for n, t in state.items() if list(t.shape) == TOKEN_TABLE}
    floats = [n for n, t in tables.items() if type(t) in (torch.Tensor, torch.nn.Parameter)
              and t.is_floating_point()]
    stored = {t.untyped_storage().data_ptr() for t in tables.values() if t.dtype == torch.int8}
    return floats, len(stored)


def test_a_run_in_an_object_store_quantizes_to_the_store(s3, runs, tmp_path):
    """A run in an object store (the S3 server): the quantized file goes up to --out in the
    store, its figures to the run's evals/ there (from --run-dir or from one of its checkpoints
    by URL); the file downloaded loads and its metric is the figures'; an --out that is already
    there is one line, exit 2, nothing written."""
    fs, bucket = s3.fs(), s3.bucket()
    local = runs("gpt", GPT)
    run = f"s3://{bucket}/runs/gpt"
    fs.put(str(local), f"{bucket}/runs/gpt", recursive=True)
    kept_here = len(evals_of(local))
    out = f"s3://{bucket}/exports/gpt-int8.onnx"
    args = ["--format", "onnx", "--quantize", "int8-dynamic", "--out", out]
    made = export("--run-dir", run, *args, env=s3.env)
    assert made.returncode == 0, made.stderr[-3000:]
    line = made.stdout.strip().splitlines()[-1]
    assert f"-> {out}; figures in {run}/evals/" in line and "dtrain-export-" not in line, line
    figures = line.rsplit("figures in ", 1)[1]
    result = json.loads(fs.cat(figures.removeprefix("s3://")))
    assert result["format"] == "onnx" and result["checkpoint"].startswith(f"{run}/checkpoints/")
    fs.get(out.removeprefix("s3://"), str(tmp_path / "m.onnx"))
    assert result["size_bytes_after"] == os.path.getsize(tmp_path / "m.onnx")
    assert recomputed(local, tmp_path / "m.onnx", "onnx", "val_loss") == pytest.approx(
        result["metrics_after"]["val_loss"], abs=1e-5)

    there = sorted(fs.find(bucket))
    again = export("--run-dir", run, *args, env=s3.env)
    assert again.returncode == 2, again.stderr[-3000:]
    assert again.stderr.strip().splitlines() == [
        f"dtrain: export error: --out {out} already exists in the store; an export never "
        f"replaces: name a new one"]
    assert sorted(fs.find(bucket)) == there

    checkpoint = result["checkpoint"]
    program = tmp_path / "m.pt2"
    made = export("--checkpoint", checkpoint, "--format", "exported", "--quantize",
                  "int8-weight", "--out", str(program), "--latency", "eager", env=s3.env)
    assert made.returncode == 0, made.stderr[-3000:]
    figures = made.stdout.strip().splitlines()[-1].rsplit("figures in ", 1)[1]
    assert figures.startswith(f"{run}/evals/"), figures
    result = json.loads(fs.cat(figures.removeprefix("s3://")))
    assert recomputed(local, program, "exported", "val_loss") == pytest.approx(
        result["metrics_after"]["val_loss"], abs=1e-5)
    assert len(evals_of(local)) == kept_here  # the copy here is not the run


def test_a_drop_beyond_max_drop_exits_1_with_the_figures_and_writes_nothing(runs, tmp_path):
    run_dir = runs("gpt", GPT)
    before = len(evals_of(run_dir))
    out = tmp_path / "m.onnx"
    failed = export("--run-dir", str(run_dir), "--format", "onnx", "--quantize", "int8-dynamic",
                    "--out", str(out), "--max-drop", "0.000001")
    assert failed.returncode == 1, failed.stderr[-3000:]
    line = failed.stderr.strip().splitlines()[-1]
    assert re.match(r"dtrain: export error: int8-dynamic costs val_bits_per_byte \S+ -> \S+ "
                    r"\(drop \S+ %, max 1e-06\); file .* \(> --max-drop 1e-06\); "
                    rf"{re.escape(str(out))} was not written$", line), line
    assert not any(tmp_path.iterdir())
    assert len(evals_of(run_dir)) == before


def _refused(run_dir: Path, tmp_path: Path, *args: str, env: dict | None = None) -> str:
    out = tmp_path / "out" / "m"
    kept = len(evals_of(run_dir))
    result = export("--run-dir", str(run_dir), "--out", str(out), *args, env=env)
    assert result.returncode == 2, result.stderr[-3000:]
    assert not (tmp_path / "out").exists() and len(evals_of(run_dir)) == kept
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


def test_bad_input_is_one_line_exit_2_and_nothing_written(runs, tmp_path):
    run_dir = runs("cnn", CNN)
    line = _refused(run_dir, tmp_path, "--format", "peft", "--quantize", "int8-dynamic")
    assert line == (
        "dtrain: export error: --quantize int8-dynamic: --format peft is not quantized "
        "(--format exported takes int8-dynamic, int8-weight, int8-static, int4-weight; "
        "--format onnx takes int8-dynamic, int8-weight, int8-static; "
        "--format hf takes int8-dynamic, int8-weight)")
    for fmt in ("state_dict", "torchscript", "safetensors"):
        line = _refused(run_dir, tmp_path, "--format", fmt, "--quantize", "int8-weight")
        assert f"--format {fmt} is not quantized" in line
    line = _refused(run_dir, tmp_path, "--format", "onnx", "--quantize", "int4-weight")
    assert "--format onnx takes only int8-dynamic, int8-weight, int8-static" in line
    assert _refused(run_dir, tmp_path, "--format", "exported", "--quantize", "int4-weight") == (
        "dtrain: export error: --quantize int4-weight needs a GPU (its kernel runs on CUDA) and "
        "export runs on the CPU; on the CPU use int8-weight or int8-dynamic")
    assert _refused(run_dir, tmp_path, "--format", "exported", "--quantize", "int8-static",
                    "--calibration-batches", "2") == (
        "dtrain: export error: --calibration-batches 2: int8-static calibrates on at least 4 "
        "training batches")
    assert _refused(run_dir, tmp_path, "--format", "onnx", "--quantize", "int8-dynamic",
                    "--calibration-batches", "8") == (
        "dtrain: export error: --calibration-batches goes with a scheme that calibrates "
        "(int8-static); int8-dynamic does not")
    assert _refused(run_dir, tmp_path, "--format", "onnx", "--max-drop", "1") == (
        "dtrain: export error: --calibration-batches and --max-drop go with --quantize")


def test_the_missing_extra_is_one_line_naming_it(runs, tmp_path):
    shim = tmp_path / "shim"
    shim.mkdir()
    (shim / "sitecustomize.py").write_text(
        "import sys\n"
        "class Hide:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'torchao' or name.startswith('torchao.'):\n"
        "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
        "sys.meta_path.insert(0, Hide())\n")
    env = {"PYTHONPATH": os.pathsep.join([str(shim), TESTS, str(REPO / "src")])}
    line = _refused(runs("cnn", CNN), tmp_path, "--format", "exported", "--quantize",
                    "int8-static", env=env)
    assert line == ("dtrain: missing dependency: dtrain export --quantize int8-static needs the "
                    "'quant' extra: pip install 'dtrain[quant]'")


def test_a_scheme_the_model_has_no_layer_for_is_one_line(runs, tmp_path):
    folder = tmp_path / "code"
    folder.mkdir()
    (folder / "quantize_users.py").write_text(CONV_ONLY)
    env = {"PYTHONPATH": os.pathsep.join([str(folder), TESTS, str(REPO / "src")])}
    run_dir = runs("conv-only", [*CNN, "model.name=quantize_users:conv_only", "model.args={}"],
                   env=env)
    line = _refused(run_dir, tmp_path, "--format", "onnx", "--quantize", "int8-dynamic",
                    "--trust-remote-code", env=env)
    assert line == ("dtrain: export error: --quantize int8-dynamic: Sequential has no nn.Linear "
                    "layer, the layers int8-dynamic quantizes")


@pytest.mark.slow
def test_a_sharded_fsdp_checkpoint_quantizes(runs, tmp_path):
    run_dir = runs("gpt-fsdp", [*GPT, "parallel.mode=fsdp", "ckpt.format=sharded"], nproc=2)
    out = tmp_path / "m.pt2"
    made = export("--run-dir", str(run_dir), "--format", "exported", "--quantize",
                  "int8-dynamic", "--out", str(out), "--latency", "eager")
    assert made.returncode == 0, made.stderr[-3000:]
    result = evals_of(run_dir)[-1]
    assert result["drop"] <= 2.0
    assert recomputed(run_dir, out, "exported", "val_loss") == pytest.approx(
        result["metrics_after"]["val_loss"], abs=1e-5)


@pytest.mark.slow
def test_a_lora_run_quantizes_its_merged_weights(runs, tmp_path):
    from dtrain.commands.export.command import load_model
    from conftest import latest

    run_dir = runs("gpt-lora", [*GPT, "model.lora.r=4", "model.lora.alpha=8", "optim.lr=0.01"])
    out = tmp_path / "m.onnx"
    made = export("--run-dir", str(run_dir), "--format", "onnx", "--quantize", "int8-dynamic",
                  "--out", str(out))
    assert made.returncode == 0, made.stderr[-3000:]
    result = evals_of(run_dir)[-1]
    # The full-precision side is the merged model: its metric is the merged model's own.
    merged, _ = load_model(str(latest(run_dir)))
    assert not any("lora" in name for name in merged.state_dict())
    assert recomputed(run_dir, out, "onnx", "val_loss") == pytest.approx(
        result["metrics_after"]["val_loss"], abs=1e-5)
    assert result["metrics_before"]["val_loss"] == pytest.approx(
        recomputed_model(run_dir, merged), abs=1e-5)


def recomputed_model(run_dir: Path, model: torch.nn.Module) -> float:
    """val_loss of a model in memory over the run's validation split."""
    from dtrain import config, data, tasks

    cfg = config.from_dict(config.read_yaml(str(run_dir / "config.yaml")))
    datasets = data.build(cfg.data, cfg.run.seed, cfg.model.args)
    task = tasks.build(cfg.task, datasets.info)
    loader = torch.utils.data.DataLoader(datasets.val, batch_size=16, collate_fn=data.collate)
    total, count = 0.0, 0
    with torch.no_grad():
        for batch in loader:
            total += task.metrics(model, batch)["loss"].double().sum().item()
            count += tasks.batch_size(batch)
    return total / count


def test_a_quantization_aware_run_exports_what_it_trained(runs, tmp_path):
    """A run trained with fake quantization (train.qat) converts it, not a fresh PTQ: the file's
    outputs are the converted model's (the model spec's `quantized`), and another scheme or a
    format whose own tools would quantize afresh is one line."""
    from dtrain import config
    from dtrain.commands.export.command import load_model
    from dtrain.models.spec import spec_of
    from conftest import latest

    run_dir = runs("gpt-qat", [*GPT, "train.qat.scheme=int8-dynamic"])
    out = tmp_path / "m.pt2"
    made = export("--run-dir", str(run_dir), "--format", "exported", "--quantize",
                  "int8-dynamic", "--out", str(out), "--latency", "eager")
    assert made.returncode == 0, made.stderr[-3000:]
    plain, meta = load_model(str(latest(run_dir)))
    cfg = config.from_dict(meta["config"])
    converted = spec_of(cfg.model, cfg.train.qat).quantized(plain)
    assert recomputed(run_dir, out, "exported", "val_loss") == pytest.approx(
        recomputed_model(run_dir, converted), abs=1e-5)
    # dtrain eval evaluates the checkpoint as training did, fake quantization on: exactly.
    evaluated = dtrain("eval", "--run-dir", str(run_dir), timeout=300)
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    result = json.loads(Path(evaluated.stdout.strip().splitlines()[-1].split(" -> ")[1])
                        .read_text())
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in records if "val_loss" in r][-1]
    assert result["val_loss"] == trained["val_loss"]
    for args, shown in ((["--format", "exported", "--quantize", "int8-weight"], "int8-weight"),
                        (["--format", "onnx", "--quantize", "int8-dynamic"], "int8-dynamic")):
        line = _refused(run_dir, tmp_path, *args)
        assert line == (
            f"dtrain: export error: --quantize {shown} --format {args[1]}: the run trained "
            f"quantization-aware for int8-dynamic (train.qat.scheme); export it with --format "
            f"exported --quantize int8-dynamic, which converts what it trained"), line


# A small Llama (hf:PATH) and token files for it: a language model run on its own validation split.
LLAMA = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=512, max_position_embeddings=64)
HF_LM = ["task.name=language_model", "model.args={}", "data.name=tokens", "data.batch_size=8",
         "data.tokens.seq_len=32", "optim.name=adamw", "optim.lr=0.003", "ckpt.monitor=val_loss",
         "ckpt.monitor_mode=min", "train.eval_every_epochs=0", "train.max_steps=10"]


@pytest.fixture(scope="module")
def llama_job(tmp_path_factory) -> list[str]:
    """The overrides of a run that fine-tunes a small saved Llama on token files."""
    transformers = pytest.importorskip("transformers")
    from test_tokens import token_folder

    root = tmp_path_factory.mktemp("hf_llama")
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA)).save_pretrained(
        root / "llama")
    tokens = token_folder(root / "tokens")
    return [*HF_LM, f"model.name=hf:{root / 'llama'}", f"data.root={tokens}"]


@pytest.fixture(scope="module")
def llama_run(runs, llama_job) -> Path:
    return runs("llama", llama_job)


def recomputed_folder(run_dir: Path, folder: Path) -> float:
    """val_loss of the Hugging Face folder, loaded by transformers as a user would, over the
    run's validation split (in the run's evaluation batches)."""
    from dtrain import config, data, tasks
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), device_map="cpu").eval()
    cfg = config.from_dict(config.read_yaml(str(run_dir / "config.yaml")))
    datasets = data.build(cfg.data, cfg.run.seed, cfg.model.args)
    task = tasks.build(cfg.task, datasets.info)
    size = cfg.data.eval_batch_size or cfg.data.batch_size
    loader = torch.utils.data.DataLoader(datasets.val, batch_size=size, collate_fn=data.collate)
    total, count = 0.0, 0
    with torch.no_grad():
        for batch in loader:
            total += task.metrics(model, batch)["loss"].double().sum().item()
            count += tasks.batch_size(batch)
    return total / count


@pytest.mark.parametrize("scheme", ["int8-dynamic",
                                    pytest.param("int8-weight", marks=pytest.mark.slow)])
def test_an_hf_run_exports_a_quantized_folder_that_transformers_loads(scheme, llama_run,
                                                                      tmp_path):
    """--format hf --quantize: a folder that transformers loads with torchao (its config.json
    says how it is quantized), smaller than the full-precision one, whose val_loss is the one
    dtrain kept in evals/; static int8 is not this path's (one line naming what is)."""
    out = tmp_path / "quantized"
    made = export("--run-dir", str(llama_run), "--format", "hf", "--quantize", scheme, "--out",
                  str(out), "--latency", "eager")
    assert made.returncode == 0, made.stderr[-3000:]
    line = made.stdout.strip().splitlines()[-1]
    assert line.startswith(f"quantized {scheme} (hf): val_bits_per_byte ") and f"-> {out};" in line
    result = evals_of(llama_run)[-1]
    assert set(result) == FIELDS and (result["format"], result["scheme"]) == ("hf", scheme)
    saved = json.loads((out / "config.json").read_text())["quantization_config"]
    assert saved["quant_method"] == "torchao" and saved["include_input_output_embeddings"]
    # The Linear layers (the output head among them) by the scheme's config, the untied input
    # embedding by the embeddings' int8 config.
    per_layer = saved["quant_type"]["default"]["_data"]["fqn_to_config"]
    assert per_layer["_default"]["_type"] == torchao_name(scheme)
    assert per_layer["model.embed_tokens"]["_type"] == "IntxWeightOnlyConfig"
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "generation_config.json",
                                                     "model.safetensors"]
    assert result["size_bytes_after"] == sum(p.stat().st_size for p in out.iterdir())
    assert result["size_bytes_after"] < 0.35 * result["size_bytes_before"]
    assert result["drop"] <= 2.0
    assert recomputed_folder(llama_run, out) == pytest.approx(
        result["metrics_after"]["val_loss"], abs=1e-5)
    line = _refused(llama_run, tmp_path, "--format", "hf", "--quantize", "int8-static")
    assert "--format hf takes only int8-dynamic, int8-weight" in line, line


def torchao_name(scheme: str) -> str:
    from dtrain.models import quantize

    return type(quantize.torchao_config(scheme)).__name__


def test_the_builtin_gpt_or_a_quantization_aware_run_is_one_line_with_format_hf(runs, llama_job,
                                                                                tmp_path):
    """The built-in gpt has no Hugging Face folder; transformers quantizes a folder afresh and
    cannot convert what a quantization-aware run trained."""
    line = _refused(runs("gpt", GPT), tmp_path, "--format", "hf", "--quantize", "int8-dynamic")
    assert line == ("dtrain: export error: --format hf writes Hugging Face models (model.name: "
                    "hf:PATH or hf-config:PATH); this checkpoint's model is gpt: use --format "
                    "safetensors")
    run_dir = runs("llama-qat", [*llama_job, "train.qat.scheme=int8-dynamic"])
    line = _refused(run_dir, tmp_path, "--format", "hf", "--quantize", "int8-dynamic")
    assert line == (
        "dtrain: export error: --quantize int8-dynamic --format hf: the run trained "
        "quantization-aware for int8-dynamic (train.qat.scheme); export it with --format "
        "exported --quantize int8-dynamic, which converts what it trained")
