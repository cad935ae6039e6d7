"""FSDP for models that do not fit one device: each rank builds only its own shard (with the
values of the whole model), full checkpoints and weight files are read once and broadcast,
fine-tuning from weights, and optimizer groups without weight decay."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

from pathlib import Path

import pytest
import torch

import forkserver
from conftest import REPO, child_env, latest, launch, torchrun_cmd
from dtrain.process import host_memory


def test_shard_by_shard_construction_gives_the_whole_models_weights() -> None:
    """Built-in models, a torchvision model and a user's model with init_weights(): the weights
    FSDP materialises equal, bit for bit, those of the same model built whole from the seed."""
    proc = forkserver.run([*torchrun_cmd(2), str(REPO / "tests" / "init_check.py")], cwd=REPO,
                          env=child_env(), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = {r["model"]: r for r in map(json.loads, (l for l in proc.stdout.splitlines()
                                                         if l.startswith("{")))}
    assert len(results) == 7
    for name, result in results.items():
        assert result["differ"] == [], (name, result["differ"])
    for name in ("simple_cnn", "resnet_small", "transformer", "gpt", "tv:resnet18",
                 "user_tasks:init_weights_net"):
        assert results[name]["notes"][0].startswith("model constructed shard by shard"), name
    # a constructor that cannot be replayed row by row is built whole, and the note says why
    assert results["user_tasks:orthogonal_net"]["notes"][0].startswith(
        "model built whole on every rank, then sharded (aten.new_empty")


WIDE = ["model.name=transformer", "model.args={dim: 384, depth: 2, heads: 4}", "train.max_steps=4",
        "ckpt.format=full", "data.batch_size=8"]


@pytest.mark.slow
def test_fsdp_built_by_shards_trains_like_ddp(tmp_path) -> None:
    """Large enough that its matrices (384 x 1536) are built row by row."""
    ddp = launch(tmp_path / "runs" / "ddp", [*WIDE, "parallel.mode=ddp"], nproc=2)
    fsdp = launch(tmp_path / "runs" / "fsdp", [*WIDE, "parallel.mode=fsdp"], nproc=2)
    assert ddp.returncode == 0, ddp.stderr[-3000:]
    assert fsdp.returncode == 0, fsdp.stderr[-3000:]
    assert "model constructed shard by shard" in fsdp.stderr
    assert "host memory: allocations above 128 KiB mapped on their own" in fsdp.stderr
    a, b = ddp.losses(), fsdp.losses()
    assert sorted(a) == sorted(b) == [1, 2, 3, 4]
    assert abs(a[1] - b[1]) <= 1e-6  # the same initial weights
    for step in a:
        assert abs(a[step] - b[step]) <= 1e-5, (step, a[step], b[step])


# ---------------------------------------------------------------------------------------------
# Host memory that FSDP frees goes back to the system

FREE_AFTER_USE = """
import json, sys
from dtrain.process import host_memory
note = host_memory.return_freed_memory() if sys.argv[1] == "call" else None
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * 4096
freed_once = bytearray(4 << 20)
del freed_once  # glibc's own policy: from here on, blocks this size come from its heaps
big, kept = [], []
for _ in range(200):  # 1 MiB buffers between small objects that stay, as gathers between states
    big.append(bytearray(1 << 20))
    kept.append(bytearray(2000))
before = rss()
big.clear()
print(json.dumps({"note": note, "returned_mib": (before - rss()) / 2**20}))
"""


@pytest.mark.parametrize("case", ["dtrain", "glibc_default", "user_setting"])
def test_freed_buffers_go_back_to_the_system(case) -> None:
    """With dtrain's policy the 200 MiB freed leave the process; with glibc's own they stay;
    a user's own malloc setting is kept, and dtrain says nothing."""
    env = child_env()
    for name in (*host_memory.USER_SETTINGS, "GLIBC_TUNABLES"):
        env.pop(name, None)
    if case == "user_setting":
        env["MALLOC_MMAP_THRESHOLD_"] = str(8 << 20)
    proc = subprocess.run([sys.executable, "-c", FREE_AFTER_USE,
                           "skip" if case == "glibc_default" else "call"],
                          env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout)
    if case == "dtrain":
        assert result["note"].startswith("host memory: allocations above 128 KiB")
        assert result["returned_mib"] > 150, result
    else:
        assert result["note"] is None
        assert result["returned_mib"] < 50, result


# ---------------------------------------------------------------------------------------------
# Reading a full checkpoint or weights file once

SITE = '''
import os, sys
def _record(event, args):
    if event == "open" and isinstance(args[0], str) and args[0].endswith("checkpoint.pt"):
        with open(os.path.join(os.environ["OPEN_LOG"], "rank" + os.environ.get("RANK", "0")), "a") as f:
            f.write(args[0] + "\\n")
sys.addaudithook(_record)
'''


# Two steps of a 2-rank run with a full checkpoint, per mode, launched once for the module: the
# run that test_rank_0_alone_reads_a_full_checkpoint resumes (from a copy) and whose optimizer
# groups test_no_weight_decay_for_biases_norms_and_embeddings reads.
FULL_CKPT = ["train.max_steps=4", "ckpt.every_steps=2", "ckpt.format=full"]


@pytest.fixture(scope="module")
def two_steps(tmp_path_factory):
    root = tmp_path_factory.mktemp("two_steps")
    made = {}

    def get(mode: str):
        if mode not in made:
            result = launch(root / "runs" / mode, [*FULL_CKPT, f"parallel.mode={mode}",
                                                   "train.max_steps=2"], nproc=2)
            assert result.returncode == 0, result.stderr[-3000:]
            made[mode] = result
        return made[mode]

    return get


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_rank_0_alone_reads_a_full_checkpoint(tmp_path, mode, two_steps) -> None:
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(SITE)
    opens = tmp_path / "opens"
    opens.mkdir()
    common = [*FULL_CKPT, f"parallel.mode={mode}"]
    first = two_steps(mode)  # train.max_steps=2: its last checkpoint is of step 2
    assert first.returncode == 0, first.stderr[-3000:]
    shutil.copytree(first.run_dir, tmp_path / "runs" / "r")  # the module's run stays as it was
    env = {"OPEN_LOG": str(opens), "PYTHONPATH": f"{hook}:{child_env()['PYTHONPATH']}"}
    resumed = launch(tmp_path / "runs" / "r", [*common, "ckpt.resume_config_change=allow"],
                     nproc=2, env=env)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stderr
    assert (opens / "rank0").read_text().count("checkpoint.pt") >= 1
    assert not (opens / "rank1").exists(), (opens / "rank1").read_text()
    straight = launch(tmp_path / "runs" / "straight", common, nproc=2)
    assert resumed.losses() == straight.losses()  # broadcast loading: the same state


# ---------------------------------------------------------------------------------------------
# Fine-tuning from weights

@pytest.fixture(scope="module")
def users_optimizer_run(tmp_path_factory):
    """Six steps of a user's optimizer and schedule: the run that
    test_a_users_optimizer_and_schedule_by_import_path checks, and whose last checkpoint the
    init_from tests fine-tune from (`trained`)."""
    return launch(tmp_path_factory.mktemp("src") / "runs" / "src",
                  ["optim.name=user_tasks:rmsprop", "optim.lr=0.01",
                   "sched.name=user_tasks:halving", "train.max_steps=6"])


@pytest.fixture(scope="module")
def trained(users_optimizer_run) -> Path:
    result = users_optimizer_run
    assert result.returncode == 0, result.stderr[-3000:]
    return latest(result.run_dir)


FIVE = ["data.name=user_tasks:five_classes", "train.max_steps=1", "optim.lr=1e-30", "sched.name=none"]


def test_init_from_takes_the_weights_and_leaves_the_excluded_head_fresh(trained, tmp_path) -> None:
    result = launch(tmp_path / "runs" / "ft", [*FIVE, f"model.init_from={trained}",
                                               "model.init_exclude=[head.*]"])
    assert result.returncode == 0, result.stderr[-3000:]
    assert (f"initial weights from {trained}/checkpoint.pt: 12 tensors, 2 left at their initial "
            f"values (head.*)") in result.stderr
    source = torch.load(trained / "checkpoint.pt", weights_only=True)["model"]
    tuned = torch.load(latest(result.run_dir) / "checkpoint.pt", weights_only=True)
    assert tuned["train_state"]["step"] == 1  # a fresh run: step, optimizer and schedule anew
    from dtrain.models import SimpleCNN
    torch.manual_seed(0)
    fresh = SimpleCNN(num_classes=5, in_channels=3, width=8).state_dict()
    for name, value in tuned["model"].items():  # lr 1e-30: the step changed nothing
        expected = fresh[name] if name.startswith("head.") else source[name]
        assert torch.equal(value, expected), name


@pytest.mark.parametrize("overrides,message", [
    (["model.num_classes=5"], "head.2.bias has shape [10] there, [5] here (2 such key(s)); "
                              "leave weights out with model.init_exclude (e.g. [fc.*] for another head)"),
    (["model.name=resnet_small", "model.args={width: 8}"], "checkpoint is from a different model: 54 key(s) missing"),
])
def test_init_from_is_strict_and_names_what_does_not_fit(trained, tmp_path, overrides, message) -> None:
    data = ["data.name=user_tasks:five_classes"] if "model.num_classes=5" in overrides else []
    result = launch(tmp_path / "runs" / "r", [*data, "train.max_steps=1", f"model.init_from={trained}",
                                              *overrides])
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr.strip().splitlines()[-1].startswith("dtrain: config error: model.init_from:")
    assert message in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "runs").exists()  # checked before anything is written


def test_pretrained_torchvision_weights_come_from_the_hub_cache_only(tmp_path) -> None:
    import torchvision
    hub = tmp_path / "torch_home"
    common = ["model.name=tv:resnet18", "model.args={}", "model.pretrained=true",
              "train.max_steps=1", "data.batch_size=8"]
    missing = launch(tmp_path / "runs" / "a", common, env={"TORCH_HOME": str(hub)})
    filename = "resnet18-f37072fd.pth"
    assert missing.returncode == 2
    assert (f"model.pretrained: torchvision's weights for tv:resnet18 are not in the torch hub "
            f"cache; put {filename} (from https://download.pytorch.org/models/{filename}) at "
            f"{hub}/hub/checkpoints/{filename} (dtrain downloads nothing at run time)") in missing.stderr
    # A file in the cache (here: weights of our own making) is what pretrained loads.
    (hub / "hub" / "checkpoints").mkdir(parents=True)
    torch.manual_seed(1)
    weights = torchvision.models.resnet18(num_classes=1000).state_dict()
    torch.save(weights, hub / "hub" / "checkpoints" / filename)
    loaded = launch(tmp_path / "runs" / "b", [*common, "model.init_exclude=[fc.*]", "optim.lr=1e-30",
                                              "sched.name=none"], env={"TORCH_HOME": str(hub)})
    assert loaded.returncode == 0, loaded.stderr[-3000:]
    saved = torch.load(latest(loaded.run_dir) / "checkpoint.pt", weights_only=True)["model"]
    assert torch.equal(saved["conv1.weight"], weights["conv1.weight"])
    assert saved["fc.weight"].shape == (10, 512)


# ---------------------------------------------------------------------------------------------
# Optimizer groups

def groups_of(run_dir: Path) -> list[tuple[float, set[str]]]:
    optimizer = torch.load(latest(run_dir) / "checkpoint.pt", weights_only=True)["optimizer"]
    return [(g["weight_decay"], set(g["params"])) for g in optimizer["param_groups"]]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_no_weight_decay_for_biases_norms_and_embeddings(tmp_path, mode, two_steps) -> None:
    result = two_steps(mode)  # train.max_steps=2, ckpt.format=full, parallel.mode=mode
    assert result.returncode == 0, result.stderr[-3000:]
    (decay, decayed), (zero, exempt) = groups_of(result.run_dir)
    assert (decay, zero) == (5e-4, 0.0)
    assert decayed == {f"features.{i}.0.weight" for i in range(4)} | {"head.2.weight"}
    assert exempt == {f"features.{i}.1.{p}" for i in range(4) for p in ("weight", "bias")} | {"head.2.bias"}
    assert "optimizer groups: 15,512 parameters with weight decay 0.0005; 186 parameters with weight decay 0" \
        in result.stderr
    explicit = launch(tmp_path / "runs" / "e", ["train.max_steps=2", "ckpt.format=full",
                                                "optim.no_decay=[head.*]", f"parallel.mode={mode}"], nproc=2)
    assert explicit.returncode == 0, explicit.stderr[-3000:]
    assert groups_of(explicit.run_dir)[1][1] == {"head.2.weight", "head.2.bias"}


def test_a_users_optimizer_and_schedule_by_import_path(users_optimizer_run) -> None:
    result = users_optimizer_run
    assert result.returncode == 0, result.stderr[-3000:]
    lrs = [r["lr"] for r in result.records() if "lr" in r]
    assert lrs == pytest.approx([0.01, 0.01, 0.005, 0.005, 0.0025, 0.0025])
    saved = torch.load(latest(result.run_dir) / "checkpoint.pt", weights_only=True)
    assert "square_avg" in next(iter(saved["optimizer"]["state"].values()))
    assert saved["extra"]["schedule"]["stepped"] == 5


