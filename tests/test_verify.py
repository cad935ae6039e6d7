"""Checkpoints verified by content: a bit flipped in a checkpoint file after it was written (a bad
sector, a torn network-filesystem write, a flip in transit) is found by the file's digest in the
marker. Resuming falls back past it, `ckpt.resume=PATH`, `export` and `init_from` refuse it, and
`dtrain verify` names it offline. Every run is a real launch; the damage is done to the files."""

from __future__ import annotations

import json
import re
import shutil
import struct
import zipfile
from pathlib import Path

import pytest

from conftest import Result, dtrain, latest, launch

SAVES = ["ckpt.every_steps=5", "train.eval_every_epochs=0", "ckpt.every_epochs=0",
         "ckpt.keep_last=5"]
DIGEST_LINE = re.compile(r"(\S+) is damaged: content digest ([0-9a-f]{32}), the marker says "
                         r"([0-9a-f]{32}) \(xxh3_128\)")


def checkpoints(run_dir: Path) -> dict[int, Path]:
    found = {}
    for path in (run_dir / "checkpoints").iterdir():
        if (path / "COMPLETE").exists():
            found[json.loads((path / "COMPLETE").read_text())["step"]] = path
    return found


def flip(path: Path, offset: int) -> None:
    """XOR 4 bytes at `offset`: what a bad sector or a flip in transit does."""
    with open(path, "r+b") as f:
        f.seek(offset)
        data = f.read(4)
        f.seek(offset)
        f.write(bytes(b ^ 0xFF for b in data))


def flip_largest_tensor(checkpoint_pt: Path) -> None:
    """Flip 4 bytes in the middle of the largest tensor's data inside a torch.save zip file."""
    with zipfile.ZipFile(checkpoint_pt) as z:
        info = max((i for i in z.infolist() if "/data/" in i.filename), key=lambda i: i.file_size)
    with open(checkpoint_pt, "rb") as f:
        f.seek(info.header_offset)
        name_length, extra_length = struct.unpack("<HH", f.read(30)[26:30])
    flip(checkpoint_pt, info.header_offset + 30 + name_length + extra_length + info.file_size // 2)


def flip_shard_tensor(dcp: Path, shard: str) -> None:
    """Flip 4 bytes in the middle of the largest tensor stored in a DCP shard file."""
    from torch.distributed.checkpoint import FileSystemReader

    items = FileSystemReader(str(dcp)).read_metadata().storage_data.values()
    item = max((i for i in items if i.relative_path == shard), key=lambda i: i.length)
    flip(dcp / shard, item.offset + item.length // 2)


def marker(folder: Path) -> dict:
    return json.loads((folder / "COMPLETE").read_text())


def assert_damage_line(text: str, folder: Path, name: str) -> None:
    """One line names the file, the digest found and the one the marker holds."""
    match = DIGEST_LINE.search(text)
    assert match, text[-3000:]
    assert match.group(1) == name
    expected = marker(folder)["digests"][name]
    assert match.group(3) == expected and match.group(2) != expected


# ---------------------------------------------------------------------------------------------
# Full checkpoints (one process)

@pytest.fixture(scope="module")
def full_run(tmp_path_factory) -> Result:
    """Checkpoints at steps 5 and 10, with digests in their markers."""
    run_dir = tmp_path_factory.mktemp("full") / "runs" / "run"
    result = launch(run_dir, [*SAVES, "train.max_steps=10"])
    assert result.returncode == 0, result.stderr[-3000:]
    assert sorted(checkpoints(run_dir)) == [5, 10]
    return result


@pytest.fixture(scope="module")
def damaged_full(full_run, tmp_path_factory) -> Path:
    """A copy of the run whose newest checkpoint.pt has 4 bytes flipped inside a tensor."""
    run_dir = tmp_path_factory.mktemp("damaged") / "runs" / "run"
    shutil.copytree(full_run.run_dir, run_dir)
    flip_largest_tensor(checkpoints(run_dir)[10] / "checkpoint.pt")
    return run_dir


def test_the_marker_holds_the_digest_of_every_file(full_run) -> None:
    from dtrain.files.digests import file_digest

    for folder in checkpoints(full_run.run_dir).values():
        m = marker(folder)
        assert m["digest"] == "xxh3_128" and set(m["digests"]) == set(m["files"]) == {"checkpoint.pt"}
        assert m["digests"]["checkpoint.pt"] == file_digest(str(folder / "checkpoint.pt"))


def test_a_flipped_tensor_is_found_and_resuming_falls_back(full_run, damaged_full, tmp_path) -> None:
    run_dir = tmp_path / "runs" / "run"
    shutil.copytree(damaged_full, run_dir)
    newest = checkpoints(run_dir)[10]
    result = launch(run_dir, [*SAVES, "train.max_steps=10"])
    assert result.returncode == 0, result.stderr[-3000:]
    unusable = [line for line in result.stderr.splitlines() if f"checkpoint {newest.name} is unusable (" in line]
    assert len(unusable) == 1
    assert_damage_line(unusable[0], damaged_full / "checkpoints" / newest.name, "checkpoint.pt")
    assert f"resumed from {checkpoints(run_dir)[5]}" in result.stderr
    # The damaged checkpoint is kept aside, untouched; the run went on from step 5...
    [aside] = sorted((run_dir / "superseded").iterdir())
    assert [p.name for p in (aside / "checkpoints").iterdir()] == [newest.name]
    assert (aside / "checkpoints" / newest.name / "checkpoint.pt").read_bytes() == \
        (damaged_full / "checkpoints" / newest.name / "checkpoint.pt").read_bytes()
    # ...and steps 6..10 are those trained from the intact state, exactly.
    assert [r["step"] for r in result.records() if "loss" in r] == list(range(1, 11))
    assert result.losses() == full_run.losses()


def test_resuming_a_damaged_checkpoint_by_path_is_one_line_and_exit_2(damaged_full, tmp_path) -> None:
    folder = checkpoints(damaged_full)[10]
    result = launch(tmp_path / "runs" / "other", [*SAVES, "train.max_steps=12", f"ckpt.resume={folder}"])
    assert result.returncode == 2, result.stderr[-3000:]
    [line] = [line for line in result.stderr.splitlines() if line.startswith("dtrain:")]
    assert line.startswith("dtrain: checkpoint error: ckpt.resume:")
    assert_damage_line(line, folder, "checkpoint.pt")
    assert "Traceback" not in result.stderr


def test_export_and_init_from_refuse_a_damaged_checkpoint(damaged_full, tmp_path) -> None:
    folder = checkpoints(damaged_full)[10]
    exported = dtrain("export", "--checkpoint", str(folder), "--out", str(tmp_path / "w.pt"))
    assert exported.returncode == 2, exported.stderr[-2000:]
    assert_damage_line(exported.stderr, folder, "checkpoint.pt")
    assert not (tmp_path / "w.pt").exists()
    tuned = launch(tmp_path / "runs" / "tuned", ["train.max_steps=2", f"model.init_from={folder}"])
    assert tuned.returncode == 2, tuned.stderr[-2000:]
    assert_damage_line(tuned.stderr, folder, "checkpoint.pt")
    intact = dtrain("export", "--checkpoint", str(checkpoints(damaged_full)[5]),
                    "--out", str(tmp_path / "w.pt"))
    assert intact.returncode == 0, intact.stderr[-2000:]


def test_a_checkpoint_saved_before_digests_loads_unverified(full_run, tmp_path) -> None:
    run_dir = tmp_path / "runs" / "run"
    shutil.copytree(full_run.run_dir, run_dir)
    newest = checkpoints(run_dir)[10]
    old = {k: v for k, v in marker(newest).items() if k not in ("digest", "digests", "marker_digest")}
    (newest / "COMPLETE").write_text(json.dumps(old))
    result = launch(run_dir, [*SAVES, "train.max_steps=12"])
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"{newest} was saved without content digests" in result.stderr
    assert "loading it unverified" in result.stderr
    assert f"resumed from {newest}" in result.stderr
    # Its successor has digests again.
    assert marker(checkpoints(run_dir)[12])["digests"]


# ---------------------------------------------------------------------------------------------
# dtrain verify

def verify(*args: str):
    return dtrain("verify", *args, timeout=60)


def test_verify_says_intact_damaged_and_unverified(full_run, damaged_full, tmp_path) -> None:
    intact = verify(str(full_run.run_dir))
    assert intact.returncode == 0, intact.stderr
    lines = intact.stdout.splitlines()
    assert [line.split()[0] for line in lines[:2]] == ["intact", "intact"]
    assert lines[-1] == "2 checkpoints: 2 intact, 0 damaged, 0 unverified"
    damaged = verify("--run", str(damaged_full))
    assert damaged.returncode == 1, damaged.stderr
    newest = checkpoints(damaged_full)[10]
    [line] = [line for line in damaged.stdout.splitlines() if line.startswith("damaged")]
    expected = marker(newest)["digests"]["checkpoint.pt"]
    assert f"{newest}: checkpoint.pt: digest " in line and line.endswith(f"expected {expected}")
    one = verify("--checkpoint", str(checkpoints(damaged_full)[5]))
    assert one.returncode == 0 and one.stdout.startswith("intact"), one.stdout
    # A checkpoint written before digests: not damaged, but said to be unverified.
    copy = tmp_path / "old"
    shutil.copytree(checkpoints(full_run.run_dir)[5], copy)
    (copy / "COMPLETE").write_text(json.dumps({k: v for k, v in marker(copy).items()
                                               if k not in ("digest", "digests", "marker_digest")}))
    old = verify(str(copy / "checkpoint.pt"))
    assert old.returncode == 0 and old.stdout.startswith("unverified"), old.stdout
    # A truncated file is damaged too, found by its size.
    data = (copy / "checkpoint.pt").read_bytes()
    (copy / "checkpoint.pt").write_bytes(data[: len(data) // 2])
    cut = verify(str(copy))
    assert cut.returncode == 1 and "checkpoint.pt has" in cut.stdout, cut.stdout


def test_a_damaged_marker_is_moved_aside_never_deleted(full_run, tmp_path) -> None:
    """A flip inside COMPLETE itself (here in the step it records, still valid JSON): the
    marker's own digest finds it; `verify` calls it damaged, and a resume moves the folder aside
    (not deleted: it may be all there is) and goes on from the checkpoint before it."""
    run_dir = tmp_path / "runs" / "run"
    shutil.copytree(full_run.run_dir, run_dir)
    newest = checkpoints(run_dir)[10]
    text = (newest / "COMPLETE").read_text()
    assert '"step": 10' in text
    (newest / "COMPLETE").write_text(text.replace('"step": 10', '"step": 18'))
    found = verify(str(run_dir))
    assert found.returncode == 1, found.stdout
    assert f"damaged     {newest}: its COMPLETE marker is not what the save wrote" in found.stdout
    result = launch(run_dir, [*SAVES, "train.max_steps=10"])
    assert result.returncode == 0, result.stderr[-3000:]
    assert "no COMPLETE marker that can be trusted (damaged or missing): moved " in result.stderr
    assert f"resumed from {checkpoints(run_dir)[5]}" in result.stderr
    [aside] = sorted((run_dir / "superseded").iterdir())
    assert (aside / "checkpoints" / newest.name / "checkpoint.pt").read_bytes() == \
        (full_run.run_dir / "checkpoints" / newest.name / "checkpoint.pt").read_bytes()
    assert result.losses() == full_run.losses()


def test_verify_checks_every_run_of_a_folder_of_runs(full_run, damaged_full, tmp_path) -> None:
    """A sweep folder or a run.out_dir: every run's checkpoints, one line each."""
    shutil.copytree(full_run.run_dir, tmp_path / "sweep" / "a")
    shutil.copytree(damaged_full, tmp_path / "sweep" / "b")
    found = verify(str(tmp_path / "sweep"))
    assert found.returncode == 1, found.stdout
    lines = found.stdout.splitlines()
    assert [line.split()[0] for line in lines[:4]] == ["intact", "intact", "intact", "damaged"]
    assert f"{tmp_path / 'sweep' / 'b' / 'checkpoints'}" in lines[3]
    assert lines[-1] == "4 checkpoints: 3 intact, 1 damaged, 0 unverified"


def test_verify_usage_errors_exit_2(tmp_path) -> None:
    assert dtrain("verify", "--help").returncode == 0
    missing = verify(str(tmp_path / "nope"))
    assert missing.returncode == 2 and "not found" in missing.stderr, missing.stderr
    assert verify().returncode == 2
    assert verify(str(tmp_path)).returncode == 2  # not a checkpoint, a run or a folder of runs


def test_verify_imports_no_torch(full_run) -> None:
    import subprocess
    import sys

    code = ("import sys; from dtrain import cli; code = cli.main(['verify', sys.argv[1]]); "
            "assert 'torch' not in sys.modules; sys.exit(code)")
    from conftest import REPO, child_env
    proc = subprocess.run([sys.executable, "-c", code, str(full_run.run_dir)], cwd=REPO,
                          env=child_env(), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


# ---------------------------------------------------------------------------------------------
# Sharded checkpoints (2 ranks, FSDP): every rank's files

SHARDED = ["ckpt.format=sharded", "parallel.mode=fsdp", "train.max_steps=12", "ckpt.every_steps=4",
           "ckpt.keep_last=5", "train.eval_every_epochs=0", "ckpt.every_epochs=0"]


@pytest.fixture(scope="module")
def sharded_run(tmp_path_factory) -> Result:
    """Sharded checkpoints at steps 4, 8 and 12."""
    run_dir = tmp_path_factory.mktemp("sharded") / "runs" / "run"
    result = launch(run_dir, SHARDED, nproc=2)
    assert result.returncode == 0, result.stderr[-3000:]
    assert sorted(checkpoints(run_dir)) == [4, 8, 12]
    return result


@pytest.mark.slow
def test_every_ranks_files_have_digests_and_verify(sharded_run) -> None:
    newest = latest(sharded_run.run_dir)
    m = marker(newest)
    assert set(m["digests"]) == set(m["files"]) >= \
        {"meta.pt", "dcp/.metadata", "dcp/__0_0.distcp", "dcp/__1_0.distcp"}
    checked = verify(str(sharded_run.run_dir))
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert [line.split()[0] for line in checked.stdout.splitlines()[:2]] == ["intact", "intact"]


# Each flip in a checkpoint of its own, newest first (step: the file flipped): one 2-rank resume
# finds both, each named by its digest, and goes on from step 4.
FLIPPED = {"tensor_in_rank1_shard": (12, "dcp/__1_0.distcp"), "metadata": (8, "dcp/.metadata")}


@pytest.fixture(scope="module")
def flipped_sharded(sharded_run, tmp_path_factory) -> tuple[Path, dict, Result]:
    """A copy of the run with both flips, `dtrain verify` of each flipped checkpoint (before the
    resume moves them aside), and the resume."""
    run_dir = tmp_path_factory.mktemp("flipped_sharded") / "runs" / "run"
    shutil.copytree(sharded_run.run_dir, run_dir)
    offline = {}
    for damage, (step, name) in FLIPPED.items():
        folder = checkpoints(run_dir)[step]
        if damage == "tensor_in_rank1_shard":  # read by rank 1 alone: every rank must still agree
            flip_shard_tensor(folder / "dcp", "__1_0.distcp")
        else:
            flip(folder / name, (folder / name).stat().st_size // 2)
        offline[damage] = verify(str(folder))
    return run_dir, offline, launch(run_dir, SHARDED, nproc=2)


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["tensor_in_rank1_shard", "metadata"])
def test_a_flip_in_a_sharded_checkpoint_falls_back(sharded_run, flipped_sharded, damage) -> None:
    run_dir, offline, result = flipped_sharded
    step, name = FLIPPED[damage]
    damaged = checkpoints(sharded_run.run_dir)[step]
    assert offline[damage].returncode == 1 and f"{name}: digest" in offline[damage].stdout, \
        offline[damage].stdout
    assert result.returncode == 0, result.stderr[-3000:]
    [line] = [line for line in result.stderr.splitlines() if f"checkpoint {damaged.name} is unusable (" in line]
    assert_damage_line(line, sharded_run.run_dir / "checkpoints" / damaged.name, name)
    assert f"resumed from {checkpoints(run_dir)[4]}" in result.stderr
    [aside] = sorted((run_dir / "superseded").iterdir())
    assert sorted(p.name for p in (aside / "checkpoints").iterdir()) == \
        sorted(checkpoints(sharded_run.run_dir)[s].name for s, _ in FLIPPED.values())
    assert result.losses() == sharded_run.losses()  # steps 5..12 again, from the intact state


@pytest.mark.slow
def test_a_truncated_shard_is_damaged_offline_and_by_path(sharded_run, tmp_path) -> None:
    folder = tmp_path / "ckpt"
    shutil.copytree(checkpoints(sharded_run.run_dir)[8], folder)
    shard = folder / "dcp" / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:-8])
    offline = verify("--checkpoint", str(folder))
    assert offline.returncode == 1 and "dcp/__0_0.distcp has" in offline.stdout, offline.stdout
    result = launch(tmp_path / "runs" / "other", [*SHARDED, f"ckpt.resume={folder}"], nproc=2)
    # torchrun ends with 1 when a worker fails; the worker's own exit code is in its summary.
    assert result.returncode != 0 and "exitcode  : 2" in result.stderr, result.stderr[-3000:]
    [line] = [line for line in result.stderr.splitlines() if line.startswith("dtrain:")]
    assert line.startswith("dtrain: checkpoint error: ckpt.resume:") and "dcp/__0_0.distcp has" in line
