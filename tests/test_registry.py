"""The extension points' tables: every name builds, unknown names are one line with a suggestion,
checked when the config loads, and the tables import nothing heavy."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest
import torch

from conftest import REPO
from dtrain import config, data
from dtrain.config import registry
from dtrain.config import DataConfig, SyntheticConfig, TextConfig
from dtrain.core.errors import UserError


@pytest.mark.parametrize("table", registry.TABLES, ids=lambda t: t.key)
def test_every_entry_names_a_builder_that_exists(table) -> None:
    names = [*table.entries, *(f"{prefix}anything" for prefix in table.prefixes), "pkg.mod:fn"]
    for name in names:
        assert callable(table.builder(name)), name
    assert table.entry("pkg.mod:fn") is table.user


# The package allowed to build each table's entries: a table in config/ names builders of the
# layers above it as strings, and each string points into its own package only.
BUILDERS = {"model.name": "dtrain.models", "data.name": "dtrain.data", "task.name": "dtrain.tasks",
            "optim.name": "dtrain.loop", "sched.name": "dtrain.loop"}


@pytest.mark.parametrize("table", registry.TABLES, ids=lambda t: t.key)
def test_every_entry_points_into_the_package_that_builds_it(table) -> None:
    entries = [*table.entries.values(), *table.prefixes.values(), table.user]
    targets = [target for e in entries for target in (e.target, e.sizes) if target]
    for target in targets:
        module, _, name = target.partition(":")
        assert module == BUILDERS[table.key] or module.startswith(BUILDERS[table.key] + "."), target
        assert callable(getattr(importlib.import_module(module), name)), target


@pytest.mark.parametrize("key,name,message", [
    ("model.name", "resnet", "config error: model.name: unknown model 'resnet'; use one of "
                             "simple_cnn, resnet_small, transformer, gpt, tv:NAME, timm:NAME, hf:PATH, "
                             "hf-config:PATH or module:function "
                             "(did you mean 'resnet_small'?)"),
    ("data.name", "cifar", "config error: data.name: unknown dataset 'cifar'; use one of synthetic, "
                           "cifar10, mnist, fashion_mnist, imagefolder, text, tokens, hf or module:function "
                           "(did you mean 'cifar10'?)"),
    ("task.name", "translation", "config error: task.name: unknown task 'translation'; use one of "
                                 "classification, language_model, model_loss or module:function"),
    ("optim.name", "adamm", "unknown optimizer 'adamm'"),
    ("sched.name", "cosin", "unknown schedule 'cosin'"),
])
def test_unknown_names_are_one_line_naming_the_choices(key, name, message) -> None:
    table = next(t for t in registry.TABLES if t.key == key)
    with pytest.raises(UserError) as err:
        table.builder(name)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_a_bare_prefix_is_not_a_name() -> None:
    with pytest.raises(UserError, match="unknown model 'tv:'"):
        registry.MODELS.check("tv:")


@pytest.mark.parametrize("override,message", [
    ("model.name=resnet", "unknown model 'resnet'"),
    ("data.name=imagefolders", "or module:function (did you mean 'imagefolder'?)"),
    ("task.name=classify", "unknown task 'classify'"),
])
def test_the_config_check_refuses_unknown_names(override, message) -> None:
    with pytest.raises(UserError) as err:
        config.load(None, [override])
    assert message in str(err.value)


def test_user_paths_and_prefixes_pass_the_config_check() -> None:
    cfg = config.load(None, ["model.name=tv:resnet18", "data.name=mine:data",
                             "task.name=mine:task", "optim.name=mine:opt", "sched.name=mine:sched"])
    registry.check_names(cfg)


def test_checking_names_imports_no_torch() -> None:
    code = ("import sys; from dtrain import config; from dtrain.config import registry; "
            "registry.check_names(config.Config()); "
            "registry.describe(); "
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('dtrain.')))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            cwd=REPO, env={"PYTHONPATH": str(REPO / "src")}, check=True)
    assert "'torch'" not in result.stdout and "dtrain.models" not in result.stdout


def test_describe_lists_every_name_once() -> None:
    lines = registry.describe()
    for table in registry.TABLES:
        assert f"{table.key}: {', '.join(table.forms())}" in lines
        for name in table.entries:
            assert sum(line.split()[0] == name for line in lines if line.startswith("  ")) == 1


def test_builtin_metrics_come_from_the_task_table() -> None:
    assert registry.builtin_metrics("language_model") == (
        "val_loss", "val_perplexity", "val_bits_per_byte")
    assert registry.builtin_metrics("pkg:task") is None


# -- the data seams: one Datasets type from every builder, Loaders by name ----------------------

def test_every_dataset_builder_returns_datasets() -> None:
    sys.path.insert(0, str(REPO / "tests"))
    synthetic = DataConfig(name="synthetic", synthetic=SyntheticConfig(train_size=64, val_size=16))
    text = DataConfig(name="text", text=TextConfig(corpus="python_docs"))
    user = DataConfig(name="user_tasks:points",
                      synthetic=SyntheticConfig(train_size=32, val_size=8))
    built = {cfg.name: data.build(cfg, seed=0, model_args={"seq_len": 32})
             for cfg in (synthetic, text, user)}
    assert all(isinstance(d, data.Datasets) for d in built.values())
    assert (len(built["synthetic"].train), built["synthetic"].info["num_classes"]) == (64, 10)
    assert built["synthetic"].on_device is not None
    # the model's seq_len; bytes are their own tokens
    assert built["text"].info == {"vocab_size": 256, "seq_len": 32, "bytes_per_token": 1.0}
    assert built["text"].train[0].shape == (33,) and built["text"].notes
    assert (len(built["user_tasks:points"].train), len(built["user_tasks:points"].val)) == (32, 8)


def test_loaders_are_named_and_close() -> None:
    cfg = DataConfig(batch_size=4, num_workers=1, synthetic=SyntheticConfig(train_size=32, val_size=8))
    sets = data.build(cfg, seed=0)
    loaders = data.loaders(sets.train, sets.val, cfg=cfg, seed=0, rank=1, world_size=2,
                           device=torch.device("cpu"), workers=1)
    assert isinstance(loaders, data.Loaders)
    assert len(loaders.train) == 32 // 2 // 4 and loaders.train.sampler is loaders.train_sampler
    assert loaders.val.sampler is loaders.val_sampler and loaders.val_sampler.valid_count == 4
    images, labels = next(iter(loaders.train))
    assert images.shape == (4, 3, 32, 32) and labels.shape == (4,)
    data.close_loaders(loaders)
    data.close_loaders(None)
    with pytest.raises(TypeError):
        data.loaders(sets.train, sets.val, cfg, 0, 0, 1, torch.device("cpu"))  # keywords only
