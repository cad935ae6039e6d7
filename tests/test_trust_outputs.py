"""Credentials and outputs as trust boundaries: a credential in the config (by its option's name,
at any depth of run.storage_options, or as a URL's `user:password@`) is refused in one line that
never shows it, and nothing holding it is written; an export never replaces what it did not make
(an existing file or folder at --out, a file it would write beside --out, a link at --out) and
never copies a file from outside the model folder it names. One small trained run serves every
export case; the refusals come before anything is read or written."""

from __future__ import annotations

import os
import shutil
import stat
from pathlib import Path

import pytest
import transformers
from conftest import REPO, dtrain, launch
from test_tokens import token_folder

from dtrain import cli, config

SECRET = "n0t-for-any-log-7f3c"
STORE = ("credentials are never put in the config (it is saved with the run); set "
         "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (and AWS_SESSION_TOKEN), or AWS_PROFILE "
         "with a credentials file, in the environment instead")
IN_URL = ("credentials are never put in a URL (the config is saved with the run, and messages "
          "show URLs); ")
STORE_ENV = ("set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (and AWS_SESSION_TOKEN), or "
             "AWS_PROFILE with a credentials file, in the environment instead")
MLFLOW_ENV = ("set MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD (or "
              "MLFLOW_TRACKING_TOKEN) in the environment instead")
SSE = ("encryption keys are never put in the config (it is saved with the run); let the bucket "
       "encrypt its objects instead (SSE-S3, or SSE-KMS: s3_additional_kwargs: "
       "{ServerSideEncryption: aws:kms, SSEKMSKeyId: ...})")
OPTIONS = "run.storage_options"

# (the override, or overrides; the line after `dtrain: config error: `)
CREDENTIALS = {
    **{name: (f"{OPTIONS}={{{name}: {SECRET}}}", f"{OPTIONS}.{name}: {STORE}")
       for name in ("key", "secret", "token", "session_token", "password", "passwords",
                    "username", "aws_access_key_id", "aws_secret_access_key",
                    "aws_session_token", "Secret", "AWS_SESSION_TOKEN")},
    **{f"{section}.{name}": (f"{OPTIONS}={{{section}: {{{name}: {SECRET}}}}}",
                             f"{OPTIONS}.{section}.{name}: {STORE}")
       for section, name in (("client_kwargs", "aws_secret_access_key"),
                             ("client_kwargs", "aws_session_token"),
                             ("config_kwargs", "SessionToken"),
                             ("s3_additional_kwargs", "Password"))},
    **{f"s3_additional_kwargs.{name}": (
        f"{OPTIONS}={{s3_additional_kwargs: {{{name}: {SECRET}}}}}",
        f"{OPTIONS}.s3_additional_kwargs.{name}: {SSE}")
       for name in ("SSECustomerKey", "CopySourceSSECustomerKey")},
    "client_kwargs.endpoint_url": (
        f"{OPTIONS}={{client_kwargs: {{endpoint_url: 'http://me:{SECRET}@127.0.0.1:9'}}}}",
        f"{OPTIONS}.client_kwargs.endpoint_url: http://me:***@127.0.0.1:9: {IN_URL}{STORE_ENV}"),
    "endpoint_url": (
        f"{OPTIONS}={{endpoint_url: 'http://{SECRET}@127.0.0.1:9'}}",
        f"{OPTIONS}.endpoint_url: http://***@127.0.0.1:9: {IN_URL}{STORE_ENV}"),
    "out_dir": (f"run.out_dir=s3://me:{SECRET}@bucket/exp",
                f"run.out_dir: s3://me:***@bucket/exp: {IN_URL}{STORE_ENV}"),
    "a mistyped value": (f"{OPTIONS}=http://me:{SECRET}@127.0.0.1:9",
                         f"{OPTIONS}: expected a mapping, got 'http://me:***@127.0.0.1:9'"),
    "mlflow": ([f"log.mlflow.tracking_uri=http://me:{SECRET}@127.0.0.1:5999",
                "log.mlflow.enabled=true"],
               f"log.mlflow.tracking_uri: http://me:***@127.0.0.1:5999: {IN_URL}{MLFLOW_ENV}"),
}


def files_holding(folder: Path, text: str) -> list[Path]:
    return [p for p in folder.rglob("*") if p.is_file() and text.encode() in p.read_bytes()]


@pytest.mark.parametrize("case", CREDENTIALS)
def test_a_credential_in_the_config_is_one_line_that_never_shows_it(case, tmp_path) -> None:
    override, line = CREDENTIALS[case]
    overrides = override if isinstance(override, list) else [override]
    result = launch(tmp_path / "runs" / "r", overrides)
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr.strip().splitlines() == [f"dtrain: config error: {line}"]
    assert SECRET not in result.stdout + result.stderr
    assert not (tmp_path / "runs").exists() and not (REPO / "s3:").exists()
    assert files_holding(tmp_path, SECRET) == []


@pytest.mark.parametrize("case", ["endpoint", "location"])
def test_a_url_with_userinfo_outside_the_config_is_shown_without_it(case, tmp_path) -> None:
    """AWS_ENDPOINT_URL, or a command's own URL: refused before any request, shown redacted."""
    if case == "endpoint":
        env = {"AWS_ENDPOINT_URL": f"http://me:{SECRET}@127.0.0.1:9"}
        result = dtrain("verify", "s3://bucket/exp/r", env=env, timeout=60)
        line = f"AWS_ENDPOINT_URL: http://me:***@127.0.0.1:9: {IN_URL}{STORE_ENV}"
    else:
        result = dtrain("verify", f"s3://me:{SECRET}@bucket/exp/r", timeout=60)
        line = f"object store: s3://me:***@bucket/exp/r: {IN_URL}{STORE_ENV}"
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr.strip().splitlines() == [f"dtrain: storage error: {line}"]
    assert SECRET not in result.stdout + result.stderr


# -- exports -----------------------------------------------------------------------------------

GPT2 = dict(n_embd=32, n_layer=1, n_head=2, vocab_size=600, n_positions=64, bos_token_id=0,
            eos_token_id=0)
FORMATS = ("state_dict", "torchscript", "exported", "onnx", "safetensors", "hf", "peft")
FOLDERS = ("hf", "peft")


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[Path, Path]:
    """(A Hugging Face model folder, a one-step run of it): every format exports from it."""
    root = tmp_path_factory.mktemp("trained")
    transformers.GPT2LMHeadModel(transformers.GPT2Config(**GPT2)).save_pretrained(root / "gpt2")
    run = launch(root / "runs" / "r", [
        f"model.name=hf:{root / 'gpt2'}", "model.args={}", "task.name=language_model",
        "data.name=tokens", f"data.root={token_folder(root / 'tokens')}", "data.batch_size=4",
        "data.tokens.seq_len=16", "train.max_steps=1", "train.eval_every_epochs=0",
        "ckpt.format=full", "ckpt.monitor=val_loss", "ckpt.monitor_mode=min"])
    assert run.returncode == 0, run.stderr[-3000:]
    return root / "gpt2", run.run_dir


def export(capsys, run_dir: Path, out: Path, fmt: str) -> tuple[int, str]:
    """`dtrain export` through the CLI's own entry, in this process (no torch start-up)."""
    code = cli.main(["export", "--run-dir", str(run_dir), "--out", str(out), "--format", fmt])
    captured = capsys.readouterr()
    return code, captured.err


def snapshot(folder: Path) -> dict[str, bytes | str]:
    """Every entry below `folder`: a file's bytes, a link's target, a folder as such."""
    found: dict[str, bytes | str] = {}
    for path in sorted(folder.rglob("*")):
        name = str(path.relative_to(folder))
        if path.is_symlink():
            found[name] = "-> " + os.readlink(path)
        else:
            found[name] = path.read_bytes() if path.is_file() else "folder"
    return found


def target(fmt: str, name: str = "model") -> str:
    """A file name of the format (safetensors: a file, not a folder)."""
    return {"onnx": f"{name}.onnx", "safetensors": f"{name}.safetensors"}.get(fmt, f"{name}.pt")


# (format, what is in the way); the formats that write a file beside --out: safetensors its
# config, ONNX its external data.
IN_THE_WAY = [(fmt, case) for fmt in FORMATS
              for case in ("a file", "a folder", "beside", "link", "dangling link")
              if case != "beside" or fmt in ("safetensors", "onnx")]


@pytest.mark.parametrize("fmt,case", IN_THE_WAY)
def test_an_export_never_replaces_what_is_there(trained, tmp_path, capsys, fmt, case) -> None:
    """Every format refuses an existing --out (another run's folder, a file), a file it would
    write beside --out, and a link at --out; the user's files stay byte for byte."""
    _, run_dir = trained
    place = tmp_path / "place"
    place.mkdir()
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_text("someone else's")
    kind = "folder" if fmt in FOLDERS else "file"
    if case == "a file":
        out = place / target(fmt)
        out.write_bytes(b"the user's own file")
        line = (f"--out {out} already exists (a file); --format {fmt} writes a new {kind}: name "
                f"one that is not there{' (or empty)' if fmt in FOLDERS else ''}")
    elif case == "a folder":  # another run's directory
        out = place / "b"
        shutil.copytree(run_dir, out)
        made = "folder" if fmt in (*FOLDERS, "safetensors") else "file"
        line = (f"--out {out} already exists (a folder); --format {fmt} writes a new {made}: "
                f"name one that is not there{' (or empty)' if made == 'folder' else ''}")
    elif case == "beside":
        out = place / target(fmt)
        beside = place / ("model.config.yaml" if fmt == "safetensors" else "model.onnx.data")
        beside.write_text("the user's own config")
        line = (f"--out {out}: --format {fmt} writes {beside} beside it, and that already exists "
                f"(a file); name another --out")
    else:
        out = place / "link"
        pointed = outside if case == "link" else tmp_path / "gone"
        out.symlink_to(pointed)
        dangling = ", which does not exist" if case == "dangling link" else ""
        line = (f"--out {out} is a symbolic link to {pointed}{dangling}; an export is a new file "
                f"or folder, never written through a link: name another --out")
    before = snapshot(tmp_path)
    code, err = export(capsys, run_dir, out, fmt)
    assert code == 2, err[-3000:]
    assert err.strip().splitlines() == [f"dtrain: export error: {line}"]
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("taken", ["model.safetensors", "model.config.yaml"])
def test_an_export_into_a_store_never_replaces_an_object(trained, s3, capsys, monkeypatch,
                                                         taken) -> None:
    _, run_dir = trained
    bucket = s3.bucket()
    s3.fs().pipe(f"{bucket}/exports/{taken}", b"the user's own object")
    for name, value in s3.env.items():
        monkeypatch.setenv(name, value)
    out = f"s3://{bucket}/exports/model.safetensors"
    code = cli.main(["export", "--run-dir", str(run_dir), "--out", out, "--format",
                     "safetensors"])
    assert code == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"dtrain: export error: --out s3://{bucket}/exports/{taken} already exists in the store; "
        f"an export never replaces: name a new one"]
    assert s3.fs().find(bucket) == [f"{bucket}/exports/{taken}"]
    assert s3.fs().cat(f"{bucket}/exports/{taken}") == b"the user's own object"


def test_the_safetensors_config_goes_under_a_name_made_from_the_file(trained, tmp_path,
                                                                     capsys) -> None:
    """Nothing is written beside the file but its own config: a config.yaml there (a run's,
    a project's) is left alone."""
    _, run_dir = trained
    (tmp_path / "config.yaml").write_text("the project's own config")
    code, err = export(capsys, run_dir, tmp_path / "model.safetensors", "safetensors")
    assert code == 0, err[-3000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "config.yaml", "model.config.yaml", "model.safetensors"]
    assert (tmp_path / "config.yaml").read_text() == "the project's own config"
    folder, _ = trained
    assert config.load(str(tmp_path / "model.config.yaml")).model.name == f"hf:{folder}"


def test_an_hf_export_copies_only_the_folders_own_files(trained, tmp_path, capsys) -> None:
    """A tokenizer file that links out of the model folder is refused before anything is
    written; the folder's own files (a link inside it too) are copied, no more readable than
    they are."""
    folder, run_dir = trained
    credentials = tmp_path / "credentials"
    credentials.write_text(f"aws_secret_access_key = {SECRET}\n")
    credentials.chmod(0o600)
    (folder / "vocab.txt").symlink_to(credentials)
    out = tmp_path / "exported"
    try:
        code, err = export(capsys, run_dir, out, "hf")
    finally:
        (folder / "vocab.txt").unlink()
    assert code == 2, err[-3000:]
    assert err.strip().splitlines() == [
        f"dtrain: export error: {folder / 'vocab.txt'} is a link to {credentials}, outside the "
        f"model folder {folder}; an export copies only the folder's own files: put the file "
        f"itself there"]
    assert not out.exists() and files_holding(tmp_path, SECRET) == [credentials]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["credentials"]

    (folder / "merges.txt").write_text("#version: 0.2\n")
    (folder / "merges.txt").chmod(0o600)
    (folder / "own").mkdir()
    (folder / "own" / "vocab.json").write_text("{}")
    (folder / "vocab.json").symlink_to(folder / "own" / "vocab.json")
    try:
        code, err = export(capsys, run_dir, out, "hf")
    finally:
        (folder / "vocab.json").unlink()
        (folder / "merges.txt").unlink()
    assert code == 0, err[-3000:]
    assert (out / "merges.txt").read_text() == "#version: 0.2\n"
    assert stat.S_IMODE((out / "merges.txt").stat().st_mode) == 0o600
    assert (out / "vocab.json").read_text() == "{}" and not (out / "vocab.json").is_symlink()
