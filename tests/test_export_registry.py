"""The export formats are a registry of objects (commands/export/formats.py): each is registered
by its name, does its own steps, and is what the CLI's `--format` offers; the registry imports no
torch, since every command's parser is built from it."""

from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import REPO
from dtrain import cli
from dtrain.commands.export.formats import FORMATS, ExportFormat


def test_every_format_is_registered_by_its_name_and_does_its_own_steps() -> None:
    assert list(FORMATS) == ["state_dict", "torchscript", "exported", "onnx", "safetensors",
                             "hf", "peft"]
    for name, form in FORMATS.items():
        assert form.name == name
        for step in ("write", "read_back"):  # the base class's only raise NotImplementedError
            assert getattr(type(form), step) is not getattr(ExportFormat, step), (name, step)
        for step in ("check_out", "load", "beside", "writes_folder", "require"):
            assert callable(getattr(form, step)), (name, step)


def test_the_clis_format_choices_are_the_registrys_names(capsys) -> None:
    with pytest.raises(SystemExit) as stop:
        cli.parse(["export", "--help"])
    assert stop.value.code == 0
    assert "{" + ",".join(FORMATS) + "}" in capsys.readouterr().out
    for name in FORMATS:
        _, args = cli.parse(["export", "--checkpoint", "c", "--out", "o", "--format", name])
        assert args.format == name


def test_what_each_format_writes_beside_out_and_whether_out_is_a_folder() -> None:
    folders = {n for n, f in FORMATS.items() if f.writes_folder("out")}
    assert folders == {"safetensors", "hf", "peft"}
    assert not FORMATS["safetensors"].writes_folder("m.safetensors")
    assert FORMATS["safetensors"].beside("m.safetensors") == ["m.config.yaml"]
    assert FORMATS["onnx"].beside("m.onnx") == ["m.onnx.data"]
    assert {n for n, f in FORMATS.items() if f.beside("m.x")} == {"onnx"}
    assert [n for n, f in FORMATS.items() if f.shards] == ["hf"]
    assert [n for n, f in FORMATS.items() if f.keeps_adapters] == ["peft"]
    assert [n for n, f in FORMATS.items() if "data.name" in f.runs_code] == ["onnx"]


def test_the_registry_imports_no_torch() -> None:
    code = "import sys, dtrain.commands.export.formats; print('torch' in sys.modules)"
    found = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           cwd=REPO, env={"PYTHONPATH": str(REPO / "src")}, check=True)
    assert found.stdout.strip() == "False"


def test_the_quantize_schemes_are_models_quantizes_and_each_format_says_its_own() -> None:
    from dtrain.commands.export.formats import QUANTIZE_SCHEMES
    from dtrain.models.quantize import SCHEMES

    assert QUANTIZE_SCHEMES == tuple(SCHEMES)
    assert {n for n, f in FORMATS.items() if f.quantizes} == {"exported", "onnx", "hf"}
    # Only dtrain's own quantization converts what a quantization-aware run trained.
    assert [n for n, f in FORMATS.items() if f.quantizes and f.converts_qat] == ["exported"]
