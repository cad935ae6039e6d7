"""The README's commands, run in the order it shows them, in a folder laid out as a fresh clone:
each exits 0, none trips over what an earlier one made. Each command runs as written, with only
overrides appended that shrink its job (a smaller model and dataset, fewer steps); the few that
need what is not here (a second node, SLURM, a viewer, the test suite itself) are named with the
reason. A command added to the README, changed or moved fails the test until it is listed
here."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import forkserver
import pytest
from conftest import REPO, child_env, free_port

# The default job, shrunk: the same run every time it is named, so each command that goes on
# with runs/default or reads it finds the config it was trained with.
SMALL = ["model.args.width=8", "data.synthetic.train_size=512", "data.synthetic.val_size=100",
         "data.batch_size=16", "data.num_workers=0", "log.tensorboard=false"]
GPT_SMALL = ["model.args.depth=1", "model.args.dim=32", "model.args.heads=2", "train.max_steps=8",
             "log.tensorboard=false", "data.num_workers=0"]
# Every command of the README, in its order: the overrides appended to it, or why it is not run.
COMMANDS: list[tuple[str, list[str] | str]] = [
    ("make train", SMALL),
    ("make test", "the whole test suite, this test among it"),
    ("torchrun --nproc_per_node=2 launch/train.py --config configs/default.yaml run.name=short "
     "train.epochs=3", SMALL),
    ("torchrun --nnodes=2 --nproc_per_node=8 --rdzv-backend=c10d --rdzv-endpoint=node0:29500 "
     "launch/train.py --config configs/fsdp_transformer.yaml", "a second node and 16 ranks"),
    ("sbatch slurm/train.sbatch configs/default.yaml optim.lr=0.05", "a SLURM cluster"),
    ("python launch/train.py --config configs/default.yaml run.name=single parallel.mode=none",
     SMALL),
    ("dtrain tokenize --corpus python_docs --out data/python_docs_bpe --vocab-size 2048", []),
    ("torchrun --nproc_per_node=2 launch/train.py --config configs/gpt_tokens.yaml", GPT_SMALL),
    ('dtrain sweep --config configs/default.yaml --name lr_sweep "optim.lr=[0.3,0.1,0.03,0.01]" '
     "train.max_steps=200", SMALL),
    ('dtrain sweep --config configs/default.yaml --random 4 --seed 0 '
     '"optim.lr=loguniform(1e-4,1e-1)"', [*SMALL, "train.max_steps=20"]),
    ("dtrain runs runs/lr_sweep", []),
    ("tensorboard --logdir runs/lr_sweep", "a viewer that serves until stopped"),
    ("dtrain eval --run-dir runs/default --checkpoint best", []),
    ("dtrain export --run-dir runs/default --format onnx --out model.onnx", []),
    ("dtrain export --run-dir runs/default --format safetensors --out exported/", []),
    ("dtrain convert --checkpoint runs/default/checkpoints/step_... --to sharded --out sharded/",
     []),
    ("make test", "the whole test suite, this test among it"),
    ('.venv/bin/python -m pytest -q -m "not slow" tests', "the test suite, this test among it"),
    (".venv/bin/python -m pytest -q tests/test_config.py", "the test suite's own module"),
]
PROGRAMS = ("make", "torchrun", "sbatch", "python", "dtrain", "tensorboard", ".venv/bin/python")
# What a fresh clone has that the commands read; what they write goes to the folder itself.
CLONE = ["Makefile", "pyproject.toml", "constraints.txt", "configs", "launch", "slurm", "src"]


def readme_commands() -> list[str]:
    """The README's shell commands: lines of its indented code blocks that start with a program,
    continuation lines joined, comments dropped."""
    commands: list[str] = []
    continued = False
    for line in (REPO / "README.md").read_text(encoding="utf-8").splitlines():
        code = line.split("  #")[0].strip() if line.startswith("    ") else ""
        if continued:
            commands[-1] += " " + code.rstrip("\\").strip()
        elif code.startswith(tuple(p + " " for p in PROGRAMS)):
            commands.append(code.rstrip("\\").strip())
        else:
            continue
        continued = code.endswith("\\")
    return [re.sub(r"\s+", " ", c) for c in commands]


def test_the_list_is_the_readmes() -> None:
    assert readme_commands() == [command for command, _ in COMMANDS]


def argv(command: str, clone: Path) -> list[str]:
    """The command's words with its program as this Python runs it; `step_...` is the run's
    newest checkpoint, as a reader fills it in."""
    words = shlex.split(command)
    words = [str(_newest(clone, w)) if w.endswith("/step_...") else w for w in words]
    program = {"torchrun": [sys.executable, "-m", "torch.distributed.run"],
               "dtrain": [sys.executable, "-m", "dtrain"], "python": [sys.executable]}
    return [*program.get(words[0], words[:1]), *words[1:]]


def _newest(clone: Path, placeholder: str) -> str:
    folder = clone / Path(placeholder).parent
    return str(Path(placeholder).parent / max(p.name for p in folder.glob("step_*")))


@pytest.mark.slow
def test_readme_commands_run_in_order(tmp_path) -> None:
    for name in CLONE:
        (tmp_path / name).symlink_to(REPO / name)
    venv = Path(sys.prefix)
    listed = dict(COMMANDS)
    done = []
    for command in readme_commands():
        assert command in listed, f"the README's {command!r} is not listed in COMMANDS"
        how = listed[command]
        if isinstance(how, str):
            continue
        words = argv(command, tmp_path)
        # torchrun's default rendezvous port, moved to a free one (tests run side by side).
        env = child_env({"PET_MASTER_PORT": str(free_port())})
        if words[0] == "make":
            # The clone is set up as this environment (tests run after `make test` set it up):
            # make's install step is not run again.
            words += [f"VENV={venv}", "-o", f"{venv}/.installed", f"ARGS={' '.join(how)}"]
            proc = subprocess.run(words, cwd=tmp_path, env=env, capture_output=True, text=True,
                                  timeout=300)
        else:
            proc = forkserver.run([*words, *how], cwd=tmp_path, env=env, timeout=300)
        assert proc.returncode == 0, (command, done, proc.stdout[-2000:], proc.stderr[-4000:])
        done.append(command)
