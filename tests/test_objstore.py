"""Runs whose directory is in an object store, against a real S3 server (moto's, on 127.0.0.1):
checkpoints written by each rank straight to the store with the marker last, exact resume and
rewind from the store, records uploaded, one owner per run, and each fault one line."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import forkserver
from conftest import REPO, TINY, dtrain, launch, without_module

pytestmark = pytest.mark.slow


def _metrics(fs, url: str) -> list[dict]:
    text = fs.cat(url.removeprefix("s3://") + "/metrics.jsonl").decode()
    return [json.loads(line) for line in text.splitlines()]


def _losses(records: list[dict]) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in records if "loss" in r}


def _weights(fs, checkpoint_url: str, into: Path) -> dict:
    local = into / "checkpoint.pt"
    fs.get(checkpoint_url.removeprefix("s3://") + "/checkpoint.pt", str(local))
    return torch.load(local, weights_only=True)["model"]


def _lease(fs, run_url: str, host: str, renewed: float) -> None:
    body = {"host": host, "pid": 1, "job": None, "started": "earlier", "ttl_s": 60,
            "renewed": renewed}
    fs.pipe(run_url.removeprefix("s3://") + "/.lock", json.dumps(body).encode())


def test_run_in_the_store_resumes_and_rewinds_exactly(s3, tmp_path: Path) -> None:
    """A run in the store: every checkpoint is there with its marker; a rewind from the store
    continues the run bit for bit (equal to the same run on a local disk); an interrupted save
    is never resumed and is removed; a live lease refuses a second launch, a stale one is taken
    over; records, `dtrain runs` and `dtrain verify` read the store; no credential anywhere."""
    fs, bucket = s3.fs(), s3.bucket()
    out = f"s3://{bucket}/exp"
    run = f"{out}/r"
    stage = tmp_path / "stage"
    common = ["train.max_steps=6", "ckpt.every_steps=3", "ckpt.keep_last=5",
              f"run.staging_dir={stage}"]
    local = launch(tmp_path / "local" / "r", common)
    assert local.returncode == 0, local.stderr[-3000:]

    _lease(fs, run, "another-host", renewed=time.time())  # a live run elsewhere holds it
    refused = launch(tmp_path / "x" / "r", [*common, f"run.out_dir={out}"], env=s3.env)
    assert refused.returncode == 2, refused.stderr[-3000:]
    assert "in use by another run (host another-host" in refused.stderr
    assert not fs.exists(f"{bucket}/exp/r/checkpoints")

    _lease(fs, run, "another-host", renewed=time.time() - 3600)  # killed an hour ago
    first = launch(tmp_path / "x" / "r", [*common, f"run.out_dir={out}"], env=s3.env)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "taking over the lease" in first.stderr
    assert not fs.exists(f"{bucket}/exp/r/.lock")  # released at the end
    names = sorted(p.rsplit("/", 1)[1] for p in fs.ls(f"{bucket}/exp/r/checkpoints"))
    assert names == ["latest", "step_000003-epoch_00", "step_000006-epoch_00"]
    marker = json.loads(fs.cat(f"{bucket}/exp/r/checkpoints/step_000006-epoch_00/COMPLETE"))
    assert marker["seq"] == 2 and set(marker["files"]) == {"checkpoint.pt"}
    straight = _metrics(fs, run)
    assert _losses(straight) == local.losses()
    assert sorted(_losses(straight)) == [1, 2, 3, 4, 5, 6]

    # An interrupted save (files, no marker) must never be resumed: removed at the next start.
    fs.pipe(f"{bucket}/exp/r/checkpoints/step_000099-epoch_00/checkpoint.pt", b"partial")
    rewind = f"{run}/checkpoints/step_000003-epoch_00"
    again = launch(tmp_path / "x" / "r", [*common, f"run.out_dir={out}", f"ckpt.resume={rewind}"],
                   env=s3.env)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"resumed from {rewind} (step 3" in again.stderr
    assert "removing incomplete checkpoint" in again.stderr
    assert not fs.exists(f"{bucket}/exp/r/checkpoints/step_000099-epoch_00")
    assert "rewound to step_000003-epoch_00" in again.stderr
    rewound = _metrics(fs, run)
    assert [r["step"] for r in rewound if "loss" in r] == [1, 2, 3, 4, 5, 6]  # no gap, no repeat
    assert _losses(rewound) == local.losses()
    latest = fs.cat(f"{bucket}/exp/r/checkpoints/latest").decode().strip()
    assert latest == "step_000006-epoch_00"
    weights = _weights(fs, f"{run}/checkpoints/{latest}", tmp_path)
    reference = torch.load(local.run_dir / "checkpoints" / latest / "checkpoint.pt",
                           weights_only=True)["model"]
    assert all(torch.equal(weights[k], reference[k]) for k in reference)
    aside = fs.find(f"{bucket}/exp/r/superseded")
    assert any(p.endswith("step_000006-epoch_00/COMPLETE") for p in aside)
    assert any(p.endswith("metrics.jsonl") for p in aside)  # the rewound records, kept

    listed = dtrain("runs", "--out-dir", out, env=s3.env)
    assert listed.returncode == 0, listed.stderr
    row = next(line for line in listed.stdout.splitlines() if line.startswith("r "))
    assert "finished" in row and " 6 " in row
    verified = dtrain("verify", run, env=s3.env)
    assert verified.returncode == 0, verified.stdout + verified.stderr
    assert "2 checkpoints: 2 intact" in verified.stdout

    # Starting weights from the store.
    started = launch(tmp_path / "local" / "from_store",
                     ["train.max_steps=1", f"model.init_from={run}/checkpoints/{latest}"],
                     env=s3.env)
    assert started.returncode == 0, started.stderr[-3000:]
    assert f"initial weights from {run}/checkpoints/{latest}: " in started.stderr
    commands = _eval_export_convert_from_the_store(s3, run, local.run_dir, latest, tmp_path)

    # No credential in anything the runs wrote or said.
    for path in fs.find(bucket):
        assert s3.secret.encode() not in fs.cat(path), path
    for file in stage.rglob("*"):
        if file.is_file():
            assert s3.secret.encode() not in file.read_bytes(), file
    for said in (refused, first, again, listed, verified, started, *commands):
        assert s3.secret not in said.stdout + said.stderr


def _eval_export_convert_from_the_store(s3, run: str, local_run: Path, latest: str,
                                        tmp_path: Path) -> list:
    """eval, export and convert of the run in the store give what they give for the same run on
    a disk; their outputs go to the store, never over what is there."""
    fs, bucket = s3.fs(), run.removeprefix("s3://").split("/", 1)[0]
    evaluated = dtrain("eval", "--run-dir", run, env=s3.env)
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    on_disk = dtrain("eval", "--run-dir", str(local_run))
    assert on_disk.returncode == 0, on_disk.stderr[-3000:]
    metrics, where = evaluated.stdout.strip().split(" -> ")
    assert metrics == on_disk.stdout.strip().split(" -> ")[0]  # the same weights, bit for bit
    assert where.startswith(f"{run}/evals/{latest}-") and where.endswith(".json")
    result = json.loads(fs.cat(where.removeprefix("s3://")))
    assert result["checkpoint"] == f"{run}/checkpoints/{latest}" and result["step"] == 6
    best = dtrain("eval", "--run-dir", run, "--checkpoint", f"{run}/checkpoints/step_000003-epoch_00",
                  env=s3.env)
    assert best.returncode == 0 and best.stdout.startswith("step_000003-epoch_00: "), best.stderr

    exported = dtrain("export", "--run-dir", run, "--out", f"s3://{bucket}/exports/model.pt",
                      env=s3.env)
    assert exported.returncode == 0, exported.stderr[-3000:]
    assert f"s3://{bucket}/exports/model.pt" in exported.stdout
    assert f"{tmp_path}" not in exported.stdout and "dtrain-export-" not in exported.stdout
    fs.get(f"{bucket}/exports/model.pt", str(tmp_path / "exported.pt"))
    weights = torch.load(tmp_path / "exported.pt", weights_only=True)
    reference = torch.load(local_run / "checkpoints" / latest / "checkpoint.pt",
                           weights_only=True)["model"]
    assert weights.keys() == reference.keys()
    assert all(torch.equal(weights[k], reference[k]) for k in reference)

    converted_url = f"s3://{bucket}/converted/{latest}"
    converted = dtrain("convert", "--checkpoint", f"{run}/checkpoints/{latest}", "--to", "sharded",
                       "--out", converted_url, env=s3.env)
    assert converted.returncode == 0, converted.stderr[-3000:]
    assert "(sharded); read back and equal to the source (" in converted.stdout
    assert f"-> {converted_url} (sharded)" in converted.stdout
    marker = json.loads(fs.cat(f"{bucket}/converted/{latest}/COMPLETE"))
    assert marker["format"] == "sharded" and marker["converted_from"] == f"{run}/checkpoints/{latest}"
    verified = dtrain("verify", converted_url, env=s3.env)
    assert verified.returncode == 0 and "intact" in verified.stdout, verified.stdout
    again = dtrain("convert", "--checkpoint", f"{run}/checkpoints/{latest}", "--to", "sharded",
                   "--out", converted_url, env=s3.env)
    assert again.returncode == 2
    assert again.stderr.strip().splitlines()[-1] == (
        f"dtrain: convert error: --out {converted_url} already exists in the store; convert "
        f"never overwrites: name a new one")
    missing = dtrain("export", "--checkpoint", f"{run}/checkpoints/step_000009-epoch_00", "--out",
                     str(tmp_path / "m.pt"), env=s3.env)
    assert missing.returncode == 2
    assert f"--checkpoint {run}/checkpoints/step_000009-epoch_00 not found" in missing.stderr
    return [evaluated, best, exported, converted, verified, again, missing]


def test_sharded_checkpoints_from_each_rank_and_another_world_size(s3, tmp_path: Path) -> None:
    """FSDP on 2 ranks with sharded, asynchronous saves: each rank's shard is in the store, the
    marker lists both with their digests, the losses equal the same run on a local disk, and
    the run resumes from the store on 1 rank."""
    fs, bucket = s3.fs(), s3.bucket()
    out = f"s3://{bucket}/exp"
    job = ["parallel.mode=fsdp", "ckpt.format=sharded", "ckpt.async=true", "train.max_steps=4",
           "ckpt.every_steps=2", f"run.staging_dir={tmp_path / 'stage'}"]
    local = launch(tmp_path / "local" / "r", job, nproc=2)
    assert local.returncode == 0, local.stderr[-3000:]
    remote = launch(tmp_path / "x" / "r", [*job, f"run.out_dir={out}"], nproc=2, env=s3.env)
    assert remote.returncode == 0, remote.stderr[-3000:]
    assert _losses(_metrics(fs, f"{out}/r")) == local.losses()
    folder = f"{bucket}/exp/r/checkpoints/step_000004-epoch_00"
    marker = json.loads(fs.cat(f"{folder}/COMPLETE"))
    assert {"dcp/__0_0.distcp", "dcp/__1_0.distcp", "dcp/.metadata", "meta.pt"} <= set(
        marker["files"])
    assert set(marker["digests"]) == set(marker["files"])
    assert {p.rsplit("/", 1)[1] for p in fs.find(folder)} == {
        "COMPLETE", ".metadata", "__0_0.distcp", "__1_0.distcp", "meta.pt"}
    assert fs.exists(f"{bucket}/exp/r/log.rank1.txt")  # every rank's own log, uploaded

    resumed = launch(tmp_path / "x" / "r", [*job, "train.max_steps=6", f"run.out_dir={out}"],
                     env=s3.env)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from {out}/r/checkpoints/step_000004-epoch_00 (step 4" in resumed.stderr
    assert "world size changed from 2 to 1" in resumed.stderr
    assert sorted(_losses(_metrics(fs, f"{out}/r"))) == [1, 2, 3, 4, 5, 6]
    # Back on 2 ranks of one node: the node fetches the checkpoint once (one rank, while the
    # other waits and reads its copy), and the copy is gone once both applied it.
    again = launch(tmp_path / "x" / "r", [*job, "train.max_steps=8", f"run.out_dir={out}"],
                   nproc=2, env=s3.env)
    assert again.returncode == 0, again.stderr[-3000:]
    assert sorted(_losses(_metrics(fs, f"{out}/r"))) == list(range(1, 9))
    fetches = [fs.cat(f"{bucket}/exp/r/{log}").decode().count(
        f"fetched {out}/r/checkpoints/step_000006-epoch_00 (") for log in ("log.txt", "log.rank1.txt")]
    assert sorted(fetches) == [0, 1], fetches
    assert not [p for p in (tmp_path / "stage").rglob(".fetched-*")]

    # The 2 ranks' sharded checkpoint, fetched and evaluated in one process: as on the disk.
    shards = f"{out}/r/checkpoints/step_000004-epoch_00"
    evaluated = dtrain("eval", "--run-dir", f"{out}/r", "--checkpoint", shards, env=s3.env)
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    on_disk = dtrain("eval", "--run-dir", str(local.run_dir))
    assert on_disk.returncode == 0, on_disk.stderr[-3000:]
    assert evaluated.stdout.split(" -> ")[0] == on_disk.stdout.split(" -> ")[0]
    assert f"evaluating {shards} (step 4, sharded, saved at world size 2" in evaluated.stderr


@pytest.mark.parametrize("case", ["mistyped", "scheme", "secret", "no bucket", "unreachable",
                                  "credentials", "no s3fs"])
def test_a_bad_store_is_one_line_and_nothing_written(s3, tmp_path: Path, case: str,
                                                     request, monkeypatch) -> None:
    bucket = s3.bucket()
    env = dict(s3.env)
    overrides = [f"run.out_dir=s3://{bucket}/exp", f"run.staging_dir={tmp_path / 'stage'}"]
    expected = ""
    if case == "mistyped":
        overrides[0] = "run.out_dir=s3:/bucket/exp"
        expected = "config error: run.out_dir: 's3:/bucket/exp' looks like a mistyped URL"
    elif case == "scheme":
        overrides[0] = "run.out_dir=gs://bucket/exp"
        expected = "config error: run.out_dir: gs://bucket/exp: the 'gs' scheme is not supported"
    elif case == "secret":
        overrides.append(f"run.storage_options={{secret: {s3.secret}}}")
        expected = "config error: run.storage_options.secret: credentials are never put in the"
    elif case == "no bucket":
        overrides[0] = "run.out_dir=s3://no-such-bucket/exp"
        expected = f"storage error: bucket 'no-such-bucket' does not exist at {s3.endpoint}"
    elif case == "unreachable":
        env["AWS_ENDPOINT_URL"] = "http://127.0.0.1:9"  # nothing listens there
        expected = "storage error: cannot reach the object store at http://127.0.0.1:9"
    elif case == "credentials":  # a server that checks them; its own key passes the check
        import s3server
        from dtrain.files.objstore import ObjectStore
        checking = s3server.start(auth=True)
        request.addfinalizer(lambda: s3server.stop(checking))
        bucket = checking.bucket()
        monkeypatch.setattr(os, "environ", {**os.environ, **checking.env})
        ObjectStore(f"s3://{bucket}/exp").check()
        env = {**checking.env, "AWS_SECRET_ACCESS_KEY": "not-the-secret"}
        overrides[0] = f"run.out_dir=s3://{bucket}/exp"
        expected = (f"storage error: the object store at {checking.endpoint} refused the "
                    f"credentials for bucket '{bucket}'")
    else:
        env.update(without_module(tmp_path / "hide", "s3fs"))
        expected = "missing dependency: an object-store location"
    began = time.monotonic()
    result = launch(tmp_path / "runs" / "r", overrides, env=env)
    assert result.returncode == 2, result.stderr[-3000:]
    assert time.monotonic() - began < 60
    assert any(expected in line for line in result.stderr.splitlines()), result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    assert s3.secret not in result.stdout + result.stderr
    assert not (REPO / "s3:").exists() and not (tmp_path / "stage").exists()
    if case != "credentials":
        assert s3.fs().find(bucket) == []


def test_runs_csv_in_the_store_keeps_every_run_row(s3) -> None:
    """Runs of one out_dir in the store rewrite runs.csv at the same time: conditional writes
    keep every row (none lost to another run's rewrite)."""
    from dtrain.files import runs_table
    from dtrain.files.objstore import ObjectStore

    bucket = s3.bucket()
    os.environ.update(s3.env)

    def writer(prefix: str) -> None:
        table = runs_table.Table(f"s3://{bucket}/exp/runs.csv", ObjectStore(f"s3://{bucket}/exp"))
        for i in range(8):
            table.change(lambda rows, i=i: rows.__setitem__(f"{prefix}{i}", {"name": f"{prefix}{i}",
                                                                              "status": "running"}))

    threads = [threading.Thread(target=writer, args=(p,)) for p in "abc"]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    rows = runs_table.Table("x", ObjectStore(f"s3://{bucket}/exp")).read()
    assert sorted(rows) == sorted(f"{p}{i}" for p in "abc" for i in range(8))


def test_the_lease_has_one_holder(s3) -> None:
    from dtrain.core.errors import UserError
    from dtrain.files.lease import Lease
    from dtrain.files.objstore import ObjectStore

    os.environ.update(s3.env)
    bucket = s3.bucket()
    run = ObjectStore(f"s3://{bucket}/exp/r")
    first = Lease(run, ttl_s=2.0)
    first.acquire("7")
    time.sleep(2.5)  # renewed meanwhile: still held
    with pytest.raises(UserError, match=r"in use by another run .*SLURM job 7"):
        Lease(ObjectStore(f"s3://{bucket}/exp/r"), ttl_s=2.0).acquire("8")  # pid alive here
    requeued = Lease(ObjectStore(f"s3://{bucket}/exp/r"), ttl_s=2.0)
    requeued.acquire("7")  # the same job, requeued: its old run is gone
    time.sleep(1.5)
    assert first.lost  # its next renewal found another holder
    first.release()  # never deletes the lease another run holds now
    assert run.exists(".lock")
    requeued.release()
    assert not run.exists(".lock")


def test_a_store_lost_during_saves_costs_those_saves_only(s3, tmp_path: Path) -> None:
    """The endpoint lost while the run saves (the test cuts every connection through a proxy
    in front of the store): each save meanwhile fails with one warning, training goes on, the
    previous checkpoint stays the latest; once the store is back the next saves land, the run
    finishes with its last checkpoint complete, and nothing in the store is half a checkpoint
    that a resume would take. Before that, the run's first request is answered "503 Slow Down"
    (as a busy bucket answers): retried, it costs nothing."""
    import subprocess
    import sys

    from conftest import TRAIN, child_env
    from tcp_proxy import Proxy

    from dtrain.core.urls import staging_dir

    fs, bucket = s3.fs(), s3.bucket()
    proxy = Proxy(s3.host, s3.port)
    out, stage = f"s3://{bucket}/exp", tmp_path / "stage"
    args = [*TINY, f"run.out_dir={out}", "run.name=r", f"run.staging_dir={stage}",
            "ckpt.every_steps=2", "ckpt.keep_last=2",
            "run.storage_options={config_kwargs: {connect_timeout: 1, retries: "
            "{max_attempts: 2}}}"]
    log = Path(staging_dir(f"{out}/r", str(stage))) / "log.txt"
    proxy.slow_down(1)  # the run's first request: "503 Slow Down", retried (max_attempts 2)
    proc = forkserver.popen([sys.executable, TRAIN, *args], cwd=REPO, text=True,
                            env=child_env({**s3.env, "AWS_ENDPOINT_URL": proxy.endpoint}),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while not fs.exists(f"{bucket}/exp/r/checkpoints/latest"):
            assert proc.poll() is None and time.monotonic() < deadline, "no first checkpoint"
            time.sleep(0.02)
        proxy.cut()
        deadline = time.monotonic() + 180
        cut_at = _latest_step(fs, bucket)
        while "the next save tries again" not in (log.read_text() if log.exists() else ""):
            assert proc.poll() is None and time.monotonic() < deadline, "no failed save"
            time.sleep(0.1)
        latest_while_cut = fs.cat(f"{bucket}/exp/r/checkpoints/latest").decode().strip()
        proxy.restore()
        output, _ = proc.communicate(timeout=300)
    finally:
        proxy.close()
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, output[-3000:]
    # The store's 503 was retried unseen (step lines are left out: their figures may read 503).
    said = "\n".join(line for line in output.splitlines() if " | loss " not in line)
    assert proxy.slowed_down == 1 and "SlowDown" not in said and "503" not in said
    failed = [line for line in output.splitlines() if "the next save tries again" in line]
    assert failed and all("checkpoint error: cannot write step_" in line for line in failed)
    assert "Traceback" not in output
    # The checkpoint before the cut stayed the latest while saves failed.
    assert latest_while_cut.startswith(f"step_{cut_at:06d}-")
    assert _latest_step(fs, bucket) == 32  # the last step (1 epoch of 32 steps)
    verified = dtrain("verify", f"{out}/r", env=s3.env)
    assert verified.returncode == 0, verified.stdout
    assert "damaged" not in verified.stdout.replace("0 damaged", "")
    rows = dtrain("runs", "--out-dir", out, env=s3.env).stdout
    assert "finished" in rows and " 32 " in rows


def _latest_step(fs, bucket: str) -> int:
    latest = fs.cat(f"{bucket}/exp/r/checkpoints/latest").decode().strip()
    return json.loads(fs.cat(f"{bucket}/exp/r/checkpoints/{latest}/COMPLETE"))["step"]


def test_token_files_from_the_store_train_as_the_local_copy(s3, tmp_path: Path) -> None:
    """Token shards in the store: read through a node-local copy (the default) and by ranged
    requests (data.tokens.cache_gib=0, with loader workers), the losses equal the local
    folder's."""
    from test_tokens import LM, token_folder

    fs, bucket = s3.fs(), s3.bucket()
    folder = token_folder(tmp_path / "tokens", train_tokens=6000, val_tokens=1500)
    train = (folder / "train.bin").read_bytes()
    (folder / "train.bin").unlink()
    (folder / "train_000.bin").write_bytes(train[:5000])  # two shards, read as one sequence
    (folder / "train_001.bin").write_bytes(train[5000:])
    for file in folder.iterdir():
        fs.put(str(file), f"{bucket}/tokens/{file.name}")
    job = [*LM, "data.name=tokens", "train.max_steps=5"]
    local = launch(tmp_path / "runs" / "local", [*job, f"data.root={folder}"])
    assert local.returncode == 0, local.stderr[-3000:]
    url = f"s3://{bucket}/tokens"
    copied = launch(tmp_path / "runs" / "copied", [*job, f"data.root={url}"], env=s3.env)
    assert copied.returncode == 0, copied.stderr[-3000:]
    assert f"tokens from {url}" in copied.stderr
    ranged = launch(tmp_path / "runs" / "ranged", [*job, f"data.root={url}",
                                                   "data.tokens.cache_gib=0",
                                                   "data.num_workers=2"], env=s3.env)
    assert ranged.returncode == 0, ranged.stderr[-3000:]
    assert len(local.losses()) == 5
    assert copied.losses() == local.losses() == ranged.losses()

    # A shard rewritten in the store with other tokens of the same size: the node's copy is of
    # another version (ETag), fetched again, and the run trains on the new tokens.
    from dtrain.data import node_copy
    new = np.frombuffer(train[:5000], dtype=np.uint16)[::-1].tobytes()  # the same ids, reordered
    (folder / "train_000.bin").write_bytes(new)
    fs.put(str(folder / "train_000.bin"), f"{bucket}/tokens/train_000.bin")
    again = launch(tmp_path / "runs" / "again", [*job, f"data.root={url}"], env=s3.env)
    assert again.returncode == 0, again.stderr[-3000:]
    assert (Path(node_copy.folder_for(url)) / "train_000.bin").read_bytes() == new
    rewritten = launch(tmp_path / "runs" / "rewritten", [*job, f"data.root={folder}"])
    assert rewritten.returncode == 0, rewritten.stderr[-3000:]
    assert again.losses() == rewritten.losses() != local.losses()

    # With the digests dtrain tokenize writes in meta.json, a shard damaged in the store (one
    # byte, the size unchanged) is refused as the node fetches it, never trained on.
    from dtrain.files.digests import file_digest
    meta = json.loads((folder / "meta.json").read_text())
    meta.update(digest="xxh3_128", digests={
        f.name: file_digest(str(f)) for f in folder.iterdir() if f.suffix == ".bin"})
    fs.pipe(f"{bucket}/tokens/meta.json", json.dumps(meta).encode())
    fs.pipe(f"{bucket}/tokens/train_001.bin", bytes([train[5000] ^ 0xFF]) + train[5001:])
    damaged = launch(tmp_path / "runs" / "damaged", [*job, f"data.root={url}"], env=s3.env)
    assert damaged.returncode == 2, damaged.stderr[-3000:]
    assert damaged.stderr.strip().splitlines()[-1].endswith(
        f"data error: {url}/train_001.bin is not the file its meta.json describes (its content "
        f"digest differs: damaged, or replaced without a new meta.json); upload the folder "
        f"dtrain tokenize wrote again")


def test_a_saved_hugging_face_dataset_in_the_store_trains_as_on_a_disk(s3, tmp_path: Path) -> None:
    """A Dataset that save_to_disk wrote, uploaded: 2 ranks read one node copy of it and train
    as from the local folder; parquet files and an image folder in a store are one line each."""
    pytest.importorskip("datasets")
    from test_hf import LEARN, STRIPES, parquet_bytes, saved_images

    fs, bucket = s3.fs(), s3.bucket()
    saved = saved_images(tmp_path / "saved", 200, STRIPES)
    fs.put(str(saved), f"{bucket}/saved", recursive=True)
    job = ["data.name=hf", "data.hf.columns={input: image, target: label}", *LEARN,
           "train.max_steps=6"]
    local = launch(tmp_path / "runs" / "local", [*job, f"data.root={saved}"], nproc=2)
    assert local.returncode == 0, local.stderr[-3000:]
    url = f"s3://{bucket}/saved"
    remote = launch(tmp_path / "runs" / "remote", [*job, f"data.root={url}"], nproc=2, env=s3.env)
    assert remote.returncode == 0, remote.stderr[-3000:]
    assert len(local.losses()) == 6 and remote.losses() == local.losses()
    assert f"hf {url}: " in remote.stderr and "dtrain-data-" not in remote.stderr

    parquet = parquet_bytes(tmp_path / "parquet", 20, 4, STRIPES)
    fs.put(str(parquet), f"{bucket}/parquet", recursive=True)
    refused = launch(tmp_path / "runs" / "parquet", [*job, f"data.root=s3://{bucket}/parquet",
                                                     "data.hf.columns={input: png, target: y}"],
                     env=s3.env)
    assert refused.returncode == 2
    assert refused.stderr.strip().splitlines()[-1].endswith(
        f"data.root 's3://{bucket}/parquet': no state.json or dataset_dict.json at its top. Of "
        f"an object store, data.name hf reads a folder that datasets' save_to_disk wrote "
        f"(dataset.save_to_disk('s3://{bucket}/parquet')); for parquet or JSON-lines files, "
        f"copy them to a node-local folder and set data.root")
    images = launch(tmp_path / "runs" / "images", ["data.name=imagefolder",
                                                   f"data.root=s3://{bucket}/images"], env=s3.env)
    assert images.returncode == 2
    assert ("of an object store, dtrain reads token files (data.name: tokens) and datasets "
            "saved by save_to_disk (data.name: hf); data.name imagefolder reads a disk") in (
        images.stderr)


def test_killed_ten_times_while_uploading_never_resumes_a_partial_checkpoint(
        s3, tmp_path: Path) -> None:
    """A run that saves at every step, SIGKILLed ten times at moments spread over its saves
    (mostly inside an upload), each time relaunched: every relaunch resumes a complete
    checkpoint (all verified), and the run ends with the losses of one never killed."""
    import subprocess
    import sys

    from conftest import TRAIN, child_env, kill_tree

    fs, bucket = s3.fs(), s3.bucket()
    out = f"s3://{bucket}/exp"
    job = ["ckpt.every_steps=1", "ckpt.keep_last=2", f"run.staging_dir={tmp_path / 'stage'}"]
    straight = launch(tmp_path / "local" / "r", job)
    assert straight.returncode == 0, straight.stderr[-3000:]
    args = [*TINY, *job, f"run.out_dir={out}", "run.name=r"]
    env = child_env(s3.env)
    for kill in range(10):
        before = _latest_step(fs, bucket) if fs.exists(f"{bucket}/exp/r/checkpoints/latest") else 0
        proc = forkserver.popen([sys.executable, TRAIN, *args], cwd=REPO, env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                start_new_session=True)
        deadline = time.monotonic() + 120
        # Until this attempt saved once more, then a little later each time (0 to 90 ms).
        while not (fs.exists(f"{bucket}/exp/r/checkpoints/latest")
                   and _latest_step(fs, bucket) > before):
            assert proc.poll() is None and time.monotonic() < deadline, f"attempt {kill} ended"
            time.sleep(0.01)
        time.sleep(kill * 0.01)
        kill_tree(proc.pid, 9)
        proc.wait(timeout=30)
        verified = dtrain("verify", f"{out}/r", env=s3.env)
        assert verified.returncode == 0, verified.stdout  # every marked checkpoint intact
    last = launch(tmp_path / "x" / "r", [*job, f"run.out_dir={out}"], env=s3.env)
    assert last.returncode == 0, last.stderr[-3000:]
    assert "resumed from" in last.stderr
    assert _losses(_metrics(fs, f"{out}/r")) == straight.losses()
