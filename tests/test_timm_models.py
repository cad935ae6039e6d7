"""timm models by name: `model.name: timm:NAME` (the 'timm' extra), with the data's classes and
channels; `model.pretrained` reads timm's weights from the local Hugging Face cache only."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import launch

from dtrain.config import ModelConfig
from dtrain.core.errors import UserError
from dtrain.models import build_timm


def test_a_timm_model_gets_the_datas_classes_and_a_misspelt_name_its_neighbour():
    model = build_timm(ModelConfig(name="timm:resnet18", args={}), {"num_classes": 7,
                                                                    "in_channels": 1})
    assert model(torch.randn(2, 1, 32, 32)).shape == (2, 7)
    with pytest.raises(UserError) as e:
        build_timm(ModelConfig(name="timm:resnt18", args={}), {"num_classes": 7})
    assert str(e.value) == ("config error: model.name: timm has no model 'resnt18' (did you mean "
                            "'timm:resnet18'?)")


def test_timm_trains_and_starts_from_its_cached_weights_only(tmp_path, monkeypatch):
    """A run of timm:resnet18 on the synthetic images learns; with model.pretrained it starts
    from the weights in the Hugging Face cache (a snapshot made here), its head left to the data
    (model.init_exclude); without them in the cache, one line naming the cache, exit 2."""
    import timm
    from safetensors.torch import save_file
    run = launch(tmp_path / "fresh", ["model.name=timm:resnet18", "model.args={}",
                                      "train.max_steps=6"])
    assert run.returncode == 0, run.stderr[-3000:]
    assert len(run.losses()) == 6

    cache = tmp_path / "hub"
    snapshot = cache / "models--timm--resnet18.a1_in1k" / "snapshots" / ("1" * 40)
    snapshot.mkdir(parents=True)
    (cache / "models--timm--resnet18.a1_in1k" / "refs").mkdir()
    (cache / "models--timm--resnet18.a1_in1k" / "refs" / "main").write_text("1" * 40)
    torch.manual_seed(3)
    weights = timm.create_model("resnet18", num_classes=1000).state_dict()
    save_file({k: v.contiguous() for k, v in weights.items()}, str(snapshot / "model.safetensors"))
    env = {"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    job = ["model.name=timm:resnet18", "model.args={}", "model.pretrained=true",
           "model.init_exclude=[fc.*]", "train.max_steps=1", "optim.lr=1e-30"]
    started = launch(tmp_path / "pretrained", job, env=env)
    assert started.returncode == 0, started.stderr[-3000:]
    saved = torch.load(next((started.run_dir / "checkpoints").glob("step_*")) / "checkpoint.pt",
                       weights_only=False)["model"]
    assert torch.equal(saved["conv1.weight"], weights["conv1.weight"])
    assert saved["fc.weight"].shape == (10, 512)

    empty = tmp_path / "empty"
    empty.mkdir()
    missing = launch(tmp_path / "missing", job, env={**env, "HF_HUB_CACHE": str(empty)})
    assert missing.returncode == 2
    assert missing.stderr.strip().splitlines()[-1] == (
        f"dtrain: config error: model.pretrained: timm's weights for timm:resnet18 are not in the "
        f"Hugging Face cache ({empty}); download them there first (hf download "
        f"timm/resnet18.a1_in1k): dtrain downloads nothing at run time")
    assert not (tmp_path / "missing").exists()
