"""Code that dtrain reads but the user did not write into this command: a model folder's own code
(transformers' `auto_map`) and a `module:function` named by a run's saved config. Neither is
imported unless the user says so (`model.trust_remote_code: true`, `--trust-remote-code`): each
is refused in one line, exit 2, before anything is imported, and no library asks on stdin.

Each piece of code here appends a line to a marker file when it is imported: the marker tells
whether it ran."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import transformers
import yaml
from conftest import REPO, TINY, child_env, dtrain, launch
from test_chat_data import conversation, save_tokenizer

# What transformers asks on stdin when a folder's code is neither trusted nor refused.
PROMPT = "Do you wish to run the custom code?"
LLAMA = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
             num_key_value_heads=1, vocab_size=300, max_position_embeddings=64)
# A model folder's own config and model classes (Llama's, renamed), and a tokenizer class.
CONFIGURATION = ("from transformers import LlamaConfig\n"
                 "class EvilConfig(LlamaConfig):\n    model_type = 'evil'\n")
MODELING = ("from transformers import LlamaForCausalLM\n"
            "from .configuration_evil import EvilConfig\n"
            "class EvilForCausalLM(LlamaForCausalLM):\n    config_class = EvilConfig\n")
TOKENIZATION = ("from transformers import PreTrainedTokenizerFast\n"
                "class EvilTokenizer(PreTrainedTokenizerFast):\n    pass\n")
# A user's model, as a saved config names it.
EVILMOD = ("from dtrain.models import SimpleCNN\n"
           "def build(cfg):\n    return SimpleCNN(num_classes=10, **cfg.args)\n")
LM = ["task.name=language_model", "model.args={}", "data.name=text", "data.batch_size=4",
      "data.text.corpus=python_docs",
      "data.text.seq_len=32", "data.text.val_fraction=0.01", "train.max_steps=1",
      "ckpt.monitor=val_loss", "ckpt.monitor_mode=min", "train.eval_every_epochs=0"]


def with_code(file: Path, source: str, marker: Path) -> None:
    """`source` as a module that appends its name to `marker` when imported."""
    file.write_text(f"open({str(marker)!r}, 'a').write({file.stem!r} + '\\n')\n{source}")


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    """`model`: a Llama folder whose config.json names its own config and model classes;
    `tokenizer`: a tokenizer folder (with a chat template) whose tokenizer_config.json names
    its own tokenizer class; `chats`: conversations; each folder's `marker` is written by its
    code."""
    root = tmp_path_factory.mktemp("trust")
    model = root / "model"
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA)).save_pretrained(model)
    config = json.loads((model / "config.json").read_text())
    config.update(model_type="evil", architectures=["EvilForCausalLM"], auto_map={
        "AutoConfig": "configuration_evil.EvilConfig",
        "AutoModelForCausalLM": "modeling_evil.EvilForCausalLM"})
    (model / "config.json").write_text(json.dumps(config))
    with_code(model / "configuration_evil.py", CONFIGURATION, model / "marker")
    with_code(model / "modeling_evil.py", MODELING, model / "marker")
    tokenizer = save_tokenizer(root / "tokenizer")
    settings = json.loads((tokenizer / "tokenizer_config.json").read_text())
    settings.update(tokenizer_class="EvilTokenizer",
                    auto_map={"AutoTokenizer": [None, "tokenization_evil.EvilTokenizer"]})
    (tokenizer / "tokenizer_config.json").write_text(json.dumps(settings))
    with_code(tokenizer / "tokenization_evil.py", TOKENIZATION, tokenizer / "marker")
    chats = root / "chats.jsonl"
    chats.write_text("".join(json.dumps({"messages": conversation(k)}) + "\n" for k in range(40)))
    return {"model": model, "tokenizer": tokenizer, "chats": chats}


def answered_y(*args: str) -> subprocess.CompletedProcess:
    """`dtrain ARGS` with "y" on its stdin, as a user would answer a prompt."""
    return subprocess.run([sys.executable, "-m", "dtrain", *args], input="y\n", cwd=REPO,
                          env=child_env(), capture_output=True, text=True, timeout=120)


def last_line(result: subprocess.CompletedProcess) -> str:
    return result.stderr.strip().splitlines()[-1]


def test_a_model_folders_code_is_refused_whatever_stdin_says(folders, tmp_path) -> None:
    model = folders["model"]
    result = answered_y("train", *TINY, *LM, f"model.name=hf:{model}",
                        f"run.out_dir={tmp_path}", "run.name=r")
    assert result.returncode == 2, result.stderr[-3000:]
    assert last_line(result) == (
        f"dtrain: config error: model.name: hf:{model}: {model} names code of its own to run "
        f"(config.json: configuration_evil.EvilConfig, config.json: "
        f"modeling_evil.EvilForCausalLM); dtrain runs a model folder's code only with "
        f"model.trust_remote_code: true")
    assert PROMPT not in result.stdout + result.stderr
    assert not (model / "marker").exists()
    assert not (tmp_path / "r").exists()


def test_a_tokenizer_folders_code_is_refused_by_tokenize_chat(folders, tmp_path) -> None:
    tokenizer = folders["tokenizer"]
    result = answered_y("tokenize", str(folders["chats"]), "--chat", "--tokenizer",
                        str(tokenizer), "--out", str(tmp_path / "out"))
    assert result.returncode == 2, result.stderr[-3000:]
    assert last_line(result) == (
        f"dtrain: input error: --tokenizer: {tokenizer} names code of its own to run "
        f"(tokenizer_config.json: tokenization_evil.EvilTokenizer); dtrain runs a model "
        f"folder's code only with --trust-remote-code")
    assert PROMPT not in result.stdout + result.stderr
    assert not (tokenizer / "marker").exists()
    assert not (tmp_path / "out").exists()


def test_trusted_folder_code_runs_without_a_prompt(folders, tmp_path) -> None:
    """Said explicitly, the folder's own classes are used: the config's, the model's, the
    tokenizer's; the banner says so."""
    model, tokenizer = folders["model"], folders["tokenizer"]
    trained = launch(tmp_path / "runs" / "r", [*LM, f"model.name=hf:{model}",
                                               "model.trust_remote_code=true"])
    assert trained.returncode == 0, trained.stderr[-3000:]
    assert "model.trust_remote_code on: the model folder's own code (auto_map) may run" in (
        trained.stderr)
    assert PROMPT not in trained.output
    assert set((model / "marker").read_text().split()) == {"configuration_evil", "modeling_evil"}
    tokenized = dtrain("tokenize", str(folders["chats"]), "--chat", "--tokenizer",
                       str(tokenizer), "--seq-len", "128", "--val-fraction", "0.3", "--out",
                       str(tmp_path / "out"), "--trust-remote-code")
    assert tokenized.returncode == 0, tokenized.stderr[-3000:]
    assert PROMPT not in tokenized.stdout + tokenized.stderr
    assert (tokenizer / "marker").read_text().split() == ["tokenization_evil"]
    assert (tmp_path / "out" / "train.bin").exists()


# ---------------------------------------------------------------------------------------------
# A run's saved config that names a user's code


@pytest.fixture(scope="module")
def user_code_run(tmp_path_factory) -> dict[str, Path]:
    """A run whose model is `evilmod:build` (trained, so that it has a checkpoint), its marker
    removed after training; `env`'s PYTHONPATH finds evilmod."""
    root = tmp_path_factory.mktemp("user_code")
    code = root / "code"
    code.mkdir()
    marker = root / "marker"
    with_code(code / "evilmod.py", EVILMOD, marker)
    env = {"PYTHONPATH": child_env()["PYTHONPATH"] + f":{code}"}
    run = root / "runs" / "r"
    trained = launch(run, ["model.name=evilmod:build", "train.max_steps=2"], env=env)
    assert trained.returncode == 0, trained.stderr[-3000:]
    marker.unlink()
    return {"run": run, "marker": marker, "code": code, "env": env}


def test_a_saved_configs_code_is_refused_by_eval_and_export(user_code_run, tmp_path) -> None:
    run, marker, env = user_code_run["run"], user_code_run["marker"], user_code_run["env"]
    evaluated = dtrain("eval", "--run-dir", str(run), env=env)
    assert evaluated.returncode == 2, evaluated.stderr[-3000:]
    assert last_line(evaluated) == (
        f"dtrain: config error: --run-dir {run}: its config.yaml names code to run (model.name: "
        f"evilmod:build); code that a saved config names runs only with --trust-remote-code")
    exported = dtrain("export", "--run-dir", str(run), "--out", str(tmp_path / "m.pt"), env=env)
    assert exported.returncode == 2, exported.stderr[-3000:]
    assert last_line(exported).endswith(
        ": its config names code to run (model.name: evilmod:build); code that a saved config "
        "names runs only with --trust-remote-code")
    assert not marker.exists()
    assert not (tmp_path / "m.pt").exists() and not (run / "evals").exists()
    # What the user names on the command line is theirs: the same weights, by dtrain's model.
    overridden = dtrain("eval", "--run-dir", str(run), "model.name=simple_cnn", env=env)
    assert overridden.returncode == 0, overridden.stderr[-3000:]
    assert not marker.exists()


def test_a_saved_configs_code_runs_with_the_switch(user_code_run, tmp_path) -> None:
    run, marker, env = user_code_run["run"], user_code_run["marker"], user_code_run["env"]
    evaluated = dtrain("eval", "--run-dir", str(run), "--trust-remote-code", env=env)
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    exported = dtrain("export", "--run-dir", str(run), "--out", str(tmp_path / "m.pt"),
                      "--trust-remote-code", env=env)
    assert exported.returncode == 0, exported.stderr[-3000:]
    assert marker.read_text().split() == ["evilmod", "evilmod"]
    marker.unlink()


def test_a_run_in_the_store_is_refused_before_its_code_is_imported(user_code_run, s3) -> None:
    bucket = s3.bucket()
    s3.fs().put(str(user_code_run["run"]), f"{bucket}/runs/r", recursive=True)
    url = f"s3://{bucket}/runs/r"
    evaluated = dtrain("eval", "--run-dir", url, env={**s3.env, **user_code_run["env"]})
    assert evaluated.returncode == 2, evaluated.stderr[-3000:]
    assert last_line(evaluated) == (
        f"dtrain: config error: --run-dir {url}: its config.yaml names code to run (model.name: "
        f"evilmod:build); code that a saved config names runs only with --trust-remote-code")
    assert not user_code_run["marker"].exists()


def test_a_saved_config_that_trusts_a_folder_is_refused(folders, tmp_path) -> None:
    """model.trust_remote_code in a run's config.yaml is not the user's say-so."""
    run = tmp_path / "run"
    run.mkdir()
    saved = {"model": {"name": f"hf:{folders['model']}", "trust_remote_code": True}}
    (run / "config.yaml").write_text(yaml.safe_dump(saved))
    marker = folders["model"] / "marker"
    before = marker.read_text() if marker.exists() else None
    evaluated = dtrain("eval", "--run-dir", str(run))
    assert evaluated.returncode == 2, evaluated.stderr[-3000:]
    assert last_line(evaluated) == (
        f"dtrain: config error: --run-dir {run}: its config.yaml names code to run "
        f"(model.trust_remote_code: True); code that a saved config names runs only with "
        f"--trust-remote-code")
    assert (marker.read_text() if marker.exists() else None) == before
