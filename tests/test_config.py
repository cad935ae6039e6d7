"""The config: strict loading, one clear line and exit 2 for every mistake, before anything runs."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import launch
from dtrain import config
from dtrain.core.errors import UserError


def write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "c.yaml"
    path.write_text(text)
    return str(path)


def test_defaults_yaml_and_overrides_combine(tmp_path) -> None:
    path = write(tmp_path, "optim:\n  lr: 0.5\ndata:\n  batch_size: 8\n")
    cfg = config.load(path, ["optim.lr=1e-3", "train.max_steps=7", "model.args={width: 4}",
                             "parallel.fsdp.wrap=[BasicBlock, TransformerBlock]", "ckpt.async=true"])
    assert cfg.optim.lr == 0.001 and isinstance(cfg.optim.lr, float)
    assert cfg.data.batch_size == 8 and cfg.train.max_steps == 7
    assert cfg.model.args == {"width": 4}
    assert cfg.parallel.fsdp.wrap == ["BasicBlock", "TransformerBlock"]
    assert cfg.ckpt.async_ is True and cfg.train.epochs == 10
    assert config.from_dict(config.to_dict(cfg)) == cfg
    assert "async: true" in config.dump(cfg)


@pytest.mark.parametrize("text,overrides,message", [
    ("optim:\n  lrr: 0.1\n", [], "unknown key 'optim.lrr' (did you mean 'optim.lr'?)"),
    ("", ["train.epoch=3"], "unknown key 'train.epoch' (did you mean 'train.epochs'?)"),
    ("", ["optimizer.lr=3"], "unknown key 'optimizer' (did you mean 'optim'?)"),
    ("train:\n  epochs: three\n", [], "train.epochs: expected an integer, got 'three'"),
    ("", ["train.grad_accum=1.5"], "train.grad_accum: expected an integer, got 1.5"),
    ("", ["data.augment=maybe"], "data.augment: expected true/false, got 'maybe'"),
    ("", ["optim.lr=0"], "optim.lr: must be > 0, got 0.0"),
    ("", ["optim.lr=-1"], "optim.lr: must be > 0, got -1.0"),
    ("", ["data.batch_size=0"], "data.batch_size: must be >= 1, got 0"),
    ("", ["parallel.mode=fdsp"], "parallel.mode: 'fdsp' is not one of ddp, fsdp, none (did you mean 'fsdp'?)"),
    ("", ["train.precision=fp8"], "train.precision: 'fp8' is not one of fp32, bf16, fp16"),
    ("optim: 3\n", [], "optim: expected a mapping, got 3"),
    ("", ["optim.betas=[0.9]"], "optim.betas: expected two numbers"),
    ("", ["lr"], "override 'lr' is not of the form section.key=value"),
])
def test_bad_values_name_the_key(tmp_path, text, overrides, message) -> None:
    with pytest.raises(UserError) as err:
        config.load(write(tmp_path, text), overrides)
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_malformed_yaml_reports_line_and_column(tmp_path) -> None:
    path = write(tmp_path, "train:\n  epochs: 3\n  max_steps: [1, 2\n")
    with pytest.raises(UserError, match=r"c\.yaml:4:1: malformed YAML"):
        config.load(path)


def test_python_tags_are_refused(tmp_path) -> None:
    path = write(tmp_path, "run:\n  name: !!python/object/apply:os.system ['echo pwned']\n")
    with pytest.raises(UserError, match=r"c\.yaml:2:9: .*python/object/apply:os\.system.*only plain YAML"):
        config.load(path)


def test_missing_config_file() -> None:
    with pytest.raises(UserError, match="config file 'nope.yaml' not found"):
        config.load("nope.yaml")


@pytest.mark.parametrize("text,overrides,expected", [
    ("optim:\n  lrr: 0.1\n", [], "unknown key 'optim.lrr'"),
    ("train: [\n", [], "malformed YAML"),
    ("run:\n  seed: !!python/name:os.system\n", [], "only plain YAML"),
    ("", ["data.batch_size=-2"], "data.batch_size: must be >= 1"),
    (None, [], "config file"),
])
def test_cli_exits_2_with_one_line_and_writes_nothing(tmp_path, text, overrides, expected) -> None:
    config_path = write(tmp_path, text) if text is not None else str(tmp_path / "absent.yaml")
    run_dir = tmp_path / "runs" / "r"
    result = launch(run_dir, overrides, config=config_path, tiny=False)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("dtrain: config error:") and expected in lines[0]
    assert not (tmp_path / "runs").exists()


def test_config_error_under_torchrun_is_one_line_per_job(tmp_path) -> None:
    result = launch(tmp_path / "runs" / "r", ["optim.lr=-1"], nproc=2)
    assert result.returncode != 0
    assert result.stderr.count("dtrain: config error: optim.lr: must be > 0") == 1
    assert "exitcode  : 2" in result.stderr  # torchrun's summary carries the worker's exit code
    assert not (tmp_path / "runs").exists()


def test_single_process_refuses_mode_none_with_many_ranks(tmp_path) -> None:
    result = launch(tmp_path / "runs" / "r", ["parallel.mode=none"], nproc=2)
    assert "would train 2 unrelated models" in result.stderr
    assert not (tmp_path / "runs").exists()


def test_a_loaded_config_is_read_only() -> None:
    import dataclasses

    cfg = config.load(None, ["optim.lr=0.05"])
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.optim.lr = 1.0  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.run = cfg.run  # type: ignore[misc]
    changed = dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, lr=0.2))
    assert (cfg.optim.lr, changed.optim.lr) == (0.05, 0.2)  # a changed copy; the loaded one stays


@pytest.mark.parametrize("overrides,line", [
    (["optim.betas=[1.5,0.999]"], "config error: optim.betas: each must be in [0, 1), got "
                                  "[1.5, 0.999]"),
    (["optim.betas=[true,0.9]"], "config error: optim.betas: expected two numbers, got "
                                 "[True, 0.9]"),
    (["optim.momentum=0", "optim.nesterov=true"], "config error: optim.nesterov: Nesterov "
                                                  "momentum needs optim.momentum > 0; set one "
                                                  "or drop optim.nesterov"),
    (["run.seed=18446744073709551616"], "config error: run.seed: at most 9223372036854775807 "
                                        "(2**63 - 1), got 18446744073709551616"),
    (["run.name=a\x00b"], "config error: run.name: 'a\\x00b' is not a plain directory name"),
    (["run.name=tab\there"], "config error: run.name: 'tab\\there' is not a plain directory "
                             "name"),
])
def test_values_the_types_allow_but_torch_or_the_disk_would_not_are_one_line(
        overrides, line) -> None:
    with pytest.raises(UserError) as raised:
        config.load(None, overrides)
    assert str(raised.value) == line


@pytest.mark.parametrize("width,reason", [(-1, "Trying to create tensor with negative dimension"),
                                          (0, "integer modulo by zero")])
def test_a_model_that_cannot_be_built_from_its_args_is_a_config_error(width, reason) -> None:
    from dtrain import models

    cfg = config.load(None, ["model.name=simple_cnn", f"model.args={{width: {width}}}"])
    with pytest.raises(UserError, match=rf"^config error: model.args: simple_cnn cannot be built "
                                        rf"with {{'width': {width}}} \({reason}"):
        models.build(cfg.model, {"num_classes": 10, "in_channels": 3, "image_size": 32}, 0)
