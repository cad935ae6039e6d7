"""Store keys and marker names are a stranger's: every reader that copies out of a store (a
verify, an eval, a resume, the records a resume pulls, a Hugging Face dataset, token files) and a
verify of a local run refuse a name that would reach outside their folder, in one line naming it,
exit 2, with nothing written outside. Against a real S3 server (moto's); one trained run in the
store serves every case (each case reads its own copy of it)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from conftest import dtrain, launch

from dtrain.core.errors import OutsideName
from dtrain.files.digests import seal
from dtrain.files.keys import local_path

RUN = ["train.max_steps=2", "ckpt.every_steps=2", "ckpt.format=sharded"]
VICTIM = b"the user's own file\n"
PLANTED = b"written by whoever can write to the bucket\n"


@pytest.fixture(scope="module")
def trained(s3, tmp_path_factory):
    """A run trained into the store (one sharded checkpoint): (its bucket, its prefix in it)."""
    fs, bucket = s3.fs(), s3.bucket()
    stage = tmp_path_factory.mktemp("stage")
    first = launch(stage / "x" / "r", [*RUN, f"run.out_dir=s3://{bucket}/trained",
                                       f"run.staging_dir={stage}"], env=s3.env)
    assert first.returncode == 0, first.stderr[-3000:]
    assert fs.exists(f"{bucket}/trained/r/checkpoints/latest")
    return bucket, "trained/r"


def _copy(fs, bucket: str, source: str, target: str) -> str:
    """The run at `source` copied to `target` (server-side); the URL of the copy."""
    for key in fs.find(f"{bucket}/{source}"):
        fs.copy(key, f"{bucket}/{target}" + key.removeprefix(f"{bucket}/{source}"))
    return f"s3://{bucket}/{target}"


def _checkpoint(fs, run_url: str) -> str:
    """The key prefix (bucket/...) of the run's checkpoint."""
    folders = [p for p in fs.ls(run_url.removeprefix("s3://") + "/checkpoints")
               if not p.endswith("/latest")]
    assert len(folders) == 1, folders
    return folders[0]


def _listing(marker: dict, name: str, data: bytes) -> dict:
    """The marker, resealed, listing the file `name` with the content `data`: whoever can write
    the files can write the marker (its seal finds accidents, not tampering)."""
    from dtrain.files.digests import new_hash

    digest = new_hash()
    digest.update(data)
    marker = {k: v for k, v in marker.items() if k != "marker_digest"}
    marker["files"] = {**marker["files"], name: len(data)}
    marker["digests"] = {**marker["digests"], name: digest.hexdigest()}
    return seal(marker)


def _plant_in_marker(fs, checkpoint: str, name: str) -> None:
    """An entry `name` in the checkpoint's marker, with an object where a reader fetches it."""
    marker = json.loads(fs.cat(f"{checkpoint}/COMPLETE"))
    fs.pipe(f"{checkpoint}/{name.lstrip('/')}", PLANTED)
    fs.pipe(f"{checkpoint}/COMPLETE", json.dumps(_listing(marker, name, PLANTED)).encode())


# Each case: makes its store content and its victim, returns (command, victims, the line).
# `case` is the case's own folder on the disk, `run_url` its copy of the trained run.


def _verify_store(fs, s3, case: Path, run_url: str):
    victim = case / "abs" / "victim.txt"
    checkpoint = _checkpoint(fs, run_url)
    _plant_in_marker(fs, checkpoint, str(victim))
    line = f"the store holds a key outside the run: s3://{checkpoint}/{victim} (an absolute name)"
    return ["dtrain", "verify", run_url], [victim], line


def _eval_store(fs, s3, case: Path, run_url: str):
    # The copy is made in TMPDIR/dtrain-eval-*/checkpoint/<name>/: four '..' reach `case`.
    checkpoint = _checkpoint(fs, run_url)
    _plant_in_marker(fs, checkpoint, "../../../../victim.txt")
    line = (f"the store holds a key outside the run: s3://{checkpoint}/../../../../victim.txt "
            f"(a '..' part)")
    return ["dtrain", "eval", "--run-dir", run_url], [case / "victim.txt"], line


def _resume(fs, s3, case: Path, run_url: str):
    # The copy is made in <staging>/<digest>/r/checkpoints/.fetched-<host>/<name>/: five '..'
    # reach stage/.
    checkpoint = _checkpoint(fs, run_url)
    _plant_in_marker(fs, checkpoint, "../../../../../victim.txt")
    line = (f"the store holds a key outside the run: s3://{checkpoint}/../../../../../victim.txt "
            f"(a '..' part)")
    return ["train", run_url], [case / "stage" / "victim.txt"], line


def _records(fs, s3, case: Path, run_url: str):
    # The records are pulled into <staging>/<digest>/r/: tb/ and four '..' reach `case`.
    fs.pipe(run_url.removeprefix("s3://") + "/tb/../../../../victim.txt", PLANTED)
    line = (f"the store holds a key outside the run: {run_url}/tb/../../../../victim.txt "
            f"(a '..' part)")
    return ["train", run_url], [case / "victim.txt"], line


def _hf_dataset(fs, s3, case: Path, run_url: str):
    # The node's copy is TMPDIR/dtrain-data-<uid>/<digest>/: x/ and four '..' reach `case`.
    data = run_url.removeprefix("s3://").rsplit("/", 1)[0] + "/ds"
    fs.pipe(f"{data}/state.json", b"{}")
    fs.pipe(f"{data}/x/../../../../victim.txt", PLANTED)
    line = (f"the store holds a key outside the run: s3://{data}/x/../../../../victim.txt "
            f"(a '..' part)")
    command = ["data", "data.name=hf", f"data.root=s3://{data}",
               "data.hf.columns={input: image, target: label}"]
    # its record of the copy's version would go to TMPDIR/victim.txt.version
    return command, [case / "victim.txt", case / "tmp" / "victim.txt.version"], line


def _token_files(fs, s3, case: Path, run_url: str):
    from test_tokens import token_folder

    data = run_url.removeprefix("s3://").rsplit("/", 1)[0] + "/tokens"
    folder = token_folder(case / "tokens", train_tokens=3000, val_tokens=1000)
    tokens = (folder / "train.bin").read_bytes()
    (folder / "train.bin").unlink()
    (folder / "train_000.bin").write_bytes(tokens[:4000])
    for file in folder.iterdir():
        fs.put(str(file), f"{data}/{file.name}")
    name = "train_001\\..\\..\\victim.bin"  # a path elsewhere, on another system
    fs.pipe(f"{data}/{name}", tokens[4000:])
    line = f"the store holds a key outside the run: s3://{data}/{name} (a backslash)"
    return ["data", "data.name=tokens", f"data.root=s3://{data}"], [case / "victim.bin"], line


def _verify_local(fs, s3, case: Path, run_url: str):
    run = case / "local" / "r"
    fs.get(run_url.removeprefix("s3://") + "/checkpoints", str(run / "checkpoints"),
           recursive=True)
    checkpoint = next(p for p in (run / "checkpoints").iterdir() if p.is_dir())
    victim = run / "victim"  # its size and digest in the marker: a verify would hash it
    victim.write_bytes(VICTIM)
    marker = json.loads((checkpoint / "COMPLETE").read_text())
    (checkpoint / "COMPLETE").write_text(json.dumps(_listing(marker, "../../victim", VICTIM)))
    line = (f"checkpoint error: {checkpoint}/COMPLETE lists a file outside its checkpoint: "
            f"../../victim (a '..' part)")
    return ["dtrain", "verify", str(run)], [], line


def _dcp_metadata(fs, s3, case: Path, run_url: str):
    import pickle

    run = case / "local" / "r"
    fs.get(run_url.removeprefix("s3://"), str(run), recursive=True)
    checkpoint = next(p for p in (run / "checkpoints").iterdir() if p.is_dir())
    victim = run / "victim"  # DCP would read its bytes into the model's tensors
    victim.write_bytes(VICTIM * 100_000)
    file = checkpoint / "dcp" / ".metadata"
    metadata = pickle.loads(file.read_bytes())  # a test's own file: plain pickle
    for stored in metadata.storage_data.values():
        stored.relative_path = "../../../victim"
    file.write_bytes(pickle.dumps(metadata))
    marker = json.loads((checkpoint / "COMPLETE").read_text())
    (checkpoint / "COMPLETE").write_text(json.dumps(
        _listing(marker, "dcp/.metadata", file.read_bytes())))
    line = (f"checkpoint error: {checkpoint}/dcp/.metadata lists a file outside its checkpoint: "
            f"../../../victim (a '..' part)")
    return ["dtrain", "eval", "--run-dir", str(run)], [], line


READERS = {
    "verify s3://": _verify_store,
    "eval --run-dir s3://": _eval_store,
    "resume onto a run in the store": _resume,
    "records pulled on resume": _records,
    "data.name=hf data.root=s3://": _hf_dataset,
    "token files in the store": _token_files,
    "verify of a local run": _verify_local,
    "DCP metadata of a local checkpoint": _dcp_metadata,
}


@pytest.mark.parametrize("reader", READERS)
def test_every_reader_refuses_a_name_outside_its_folder(s3, trained, tmp_path: Path,
                                                        reader: str) -> None:
    fs = s3.fs()
    bucket, source = trained
    case = tmp_path / "case"
    (case / "tmp").mkdir(parents=True)
    (case / "stage").mkdir()
    run_url = _copy(fs, bucket, source, f"{tmp_path.name}/r")
    command, victims, line = READERS[reader](fs, s3, case, run_url)
    for victim in victims:  # a file of the user's where there is one to overwrite
        if victim.parent.is_dir():
            victim.write_bytes(VICTIM)
    before = {p: p.read_bytes() for p in case.rglob("*") if p.is_file()}
    history = _history(fs, run_url)
    env = {**s3.env, "TMPDIR": str(case / "tmp")}
    job = [*RUN, "train.max_steps=4", f"run.staging_dir={case / 'stage'}"]
    if command[0] == "dtrain":
        result = dtrain(*command[1:], env=env)
    elif command[0] == "train":
        out_dir, name = command[1].rsplit("/", 1)
        result = launch(case / "x" / name, [*job, f"run.out_dir={out_dir}"], env=env)
    else:
        result = launch(case / "runs" / "r", [*job, *command[1:]], env=env)
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert line in last, last
    after = {p: p.read_bytes() for p in case.rglob("*") if p.is_file()}
    written = {p for p in after if before.get(p) != after[p]}
    assert all(p.read_bytes() == VICTIM for p in victims if p.exists())
    assert not any(PLANTED == data for p, data in after.items() if p in written), written
    assert _history(fs, run_url) == history  # nothing of the run set aside or replaced


def _history(fs, run_url: str) -> dict[str, bytes]:
    """The run's objects in the store (but its logs, where an attempt adds its lines)."""
    keys = fs.find(run_url.removeprefix("s3://"))
    return {k: fs.cat(k) for k in keys if not k.rsplit("/", 1)[-1].startswith("log")}


@pytest.mark.parametrize(
    "name, problem",
    [
        ("/etc/passwd", "an absolute name"),
        ("../victim", "a '..' part"),
        ("tb/../../victim", "a '..' part"),
        ("dcp/./x", "a '.' part"),
        ("tb//x", "an empty part"),
        ("tb/", "an empty part"),
        ("", "an empty name"),
        ("..\\victim", "a backslash"),
        ("x\x00y", "a control character"),
        ("log\n.txt", "a control character"),
        ("x\x7f", "a control character"),
        ("link/victim", "it resolves outside through a link"),
    ],
)
def test_a_name_outside_its_folder_is_refused(tmp_path: Path, name: str, problem: str) -> None:
    folder = tmp_path / "folder"
    folder.mkdir()
    (tmp_path / "elsewhere").mkdir()
    (folder / "link").symlink_to(tmp_path / "elsewhere")
    shown = name.replace("\x00", "\\x00").replace("\n", "\\n").replace("\x7f", "\\x7f")
    with pytest.raises(OutsideName) as store:
        local_path(str(folder), name, "s3://bucket/run")
    assert str(store.value).startswith(
        f"storage error: the store holds a key outside the run: s3://bucket/run/{shown} "
        f"({problem}); ")
    with pytest.raises(OutsideName) as marker:
        local_path(str(folder), name, f"{folder}/COMPLETE")
    assert str(marker.value).startswith(
        f"checkpoint error: {folder}/COMPLETE lists a file outside its checkpoint: {shown} "
        f"({problem}); ")
    assert "\n" not in str(store.value) + str(marker.value)
    assert sorted(os.listdir(tmp_path)) == ["elsewhere", "folder"]
    assert os.listdir(tmp_path / "elsewhere") == []


@pytest.mark.parametrize("name", ["checkpoint.pt", "dcp/__0_0.distcp", "dcp/.metadata",
                                  "tb/events.out.tfevents.1.host", "a..b", "...", "données.bin",
                                  "train_000.bin", "state.json", "train/data-00000-of-00001.arrow",
                                  "link-not-followed/x"])
def test_a_name_inside_its_folder_is_its_path(tmp_path: Path, name: str) -> None:
    assert local_path(str(tmp_path), name, "s3://bucket/run") == str(tmp_path / name)
