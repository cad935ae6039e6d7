"""A store that stops answering (docs/trust.md): every request to it has a deadline. An endpoint
that accepts connections and never answers is one line within the deadline, and a stop signal
ends the wait; a store lost while a resume reads a checkpoint ends the run with one line and
moves nothing aside (the checkpoint is not damaged: nothing is known of it); a store that stalls
during a save costs that save, with a warning while it waits, and training goes on. Against a
real S3 server (moto's) behind a TCP proxy the test cuts or holds."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import forkserver
import pytest
from conftest import REPO, TINY, TRAIN, child_env, launch
from tcp_proxy import Proxy

# Small deadlines: a failed connection tried twice, a request given up after a few seconds.
QUICK = ("run.storage_options={config_kwargs: {connect_timeout: 1, read_timeout: 1, "
         "retries: {max_attempts: 2}}}")


class Silent:
    """An endpoint that accepts every connection and reads it, and never answers."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.connected = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            client, _ = self.listener.accept()
            self.connected.set()
            threading.Thread(target=self._read, args=(client,), daemon=True).start()

    def _read(self, client: socket.socket) -> None:
        while client.recv(65536):
            pass


@pytest.fixture(scope="module")
def silent() -> Silent:
    return Silent()


@pytest.mark.parametrize("case", ["deadline", "SIGTERM"])
def test_an_endpoint_that_never_answers_is_one_line(silent: Silent, tmp_path: Path,
                                                    case: str) -> None:
    """The start-up check of the store waits no longer than run.store_timeout_s (exit 2, one
    line naming the endpoint and the request), whatever botocore's timeouts and retries (30 s a
    read, 6 attempts); with the default deadline (45 s), a SIGTERM ends the wait within seconds
    (exit 143, one line, no traceback). Nothing is written. (Before: over 14 minutes of
    silence, and SIGTERM ignored.)"""
    env = {"AWS_ENDPOINT_URL": silent.endpoint, "AWS_ACCESS_KEY_ID": "k",
           "AWS_SECRET_ACCESS_KEY": "s", "AWS_DEFAULT_REGION": "us-east-1"}
    stage = tmp_path / "stage"
    args = [*TINY, "run.out_dir=s3://bucket/exp", "run.name=r", f"run.staging_dir={stage}"]
    if case == "deadline":
        args.append("run.store_timeout_s=3")
    silent.connected.clear()
    began = time.monotonic()
    proc = forkserver.popen([sys.executable, "-m", "dtrain", "train", *args], cwd=REPO,
                            env=child_env(env), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        if case == "SIGTERM":
            assert silent.connected.wait(60), "the run never reached the endpoint"
            time.sleep(1)
            began = time.monotonic()
            proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    took = time.monotonic() - began
    said = [line for line in stderr.splitlines() if line.startswith("dtrain: ")]
    if case == "deadline":
        assert proc.returncode == 2, stderr[-3000:]
        assert said == [f"dtrain: storage error: cannot reach the object store at "
                        f"{silent.endpoint} for s3://bucket/exp (a listing of bucket 'bucket': no "
                        f"answer within 3 s); check AWS_ENDPOINT_URL (or run.storage_options."
                        f"client_kwargs.endpoint_url) and the network"], stderr[-3000:]
        assert took < 45
    else:
        assert proc.returncode == 128 + signal.SIGTERM, stderr[-3000:]
        assert len(said) == 1 and said[0].startswith(
            "dtrain: stopped by SIGTERM while waiting "), stderr[-3000:]
        assert said[0].endswith(f"for the object store at {silent.endpoint} (a listing of bucket "
                                f"'bucket')")
        assert took < 15
    assert "Traceback" not in stderr
    assert not stage.exists()


def _store_run(s3, tmp_path: Path) -> tuple[Proxy, dict, list[str], str]:
    """A proxy in front of the store, the environment that reaches the store through it, the
    overrides of a run in it, and the run's URL."""
    proxy = Proxy(s3.host, s3.port)
    bucket = s3.bucket()
    env = {**s3.env, "AWS_ENDPOINT_URL": proxy.endpoint}
    overrides = [f"run.out_dir=s3://{bucket}/exp", f"run.staging_dir={tmp_path / 'stage'}", QUICK,
                 "run.store_timeout_s=3", "ckpt.every_steps=2"]
    return proxy, env, overrides, f"s3://{bucket}/exp/r"


def _objects(fs, run: str) -> dict[str, bytes]:
    """Every object of the run but its lease and logs, with its content."""
    base = run.removeprefix("s3://")
    return {name[len(base) + 1:]: fs.cat(name) for name in fs.find(base)
            if not name.endswith(".lock") and "/log" not in name}


def test_a_store_lost_while_a_resume_reads_a_checkpoint_keeps_the_history(s3,
                                                                         tmp_path: Path) -> None:
    """The store lost (connections refused) just as a resume downloads the newest checkpoint:
    exit 1 with one line naming the store and the checkpoint's file; the checkpoints, the
    metrics and the TensorBoard events stay where they were, nothing is set aside and the run
    does not start afresh. (Before: every checkpoint was "unusable", the history was moved to
    superseded/ and the run began again at step 0.)"""
    proxy, env, overrides, run = _store_run(s3, tmp_path)
    try:
        first = launch(tmp_path / "x" / "r",
                       [*overrides, "train.max_steps=4", "log.tensorboard=true"], env=env)
        assert first.returncode == 0, first.stderr[-3000:]
        fs = s3.fs()
        before = _objects(fs, run)
        assert {"metrics.jsonl", "checkpoints/step_000004-epoch_00/COMPLETE"} <= set(before)
        assert any(name.startswith("tb/") for name in before)
        proxy.when(b"/checkpoint.pt HTTP", proxy.cut)  # as the resume downloads the file
        resumed = launch(tmp_path / "x" / "r", [*overrides, "train.max_steps=6"], env=env)
    finally:
        proxy.close()
    assert resumed.returncode == 1, resumed.stderr[-3000:]
    said = [line for line in resumed.stderr.splitlines() if line.startswith("dtrain: ")]
    assert len(said) == 1, resumed.stderr[-3000:]
    assert said[0].startswith(
        f"dtrain: storage error: the object store at {proxy.endpoint} did not answer the download "
        f"of {run}/checkpoints/step_000004-epoch_00/checkpoint.pt ("), said
    for never in ("Traceback", "unusable", "fresh start", "moved", "resumed from"):
        assert never not in resumed.stderr, resumed.stderr[-3000:]
    assert _objects(fs, run) == before
    assert not fs.exists(f"{run.removeprefix('s3://')}/superseded")


def test_a_store_that_stalls_during_a_save_costs_that_save(s3, tmp_path: Path) -> None:
    """The store holds every connection (accepts, never answers: a store stopped with SIGSTOP)
    from the first request of the save at step 4: within a quarter of run.store_timeout_s a
    warning names the store and the upload it waits for; past the deadline the save is given
    up with the failed-save warning and training goes on; once the store answers again the run
    finishes with its last checkpoint complete. (Before: the run blocked inside the save, with
    no line, as long as the store was stopped.)"""
    from dtrain.core.urls import staging_dir

    proxy, env, overrides, run = _store_run(s3, tmp_path)
    stage = tmp_path / "stage"
    log = Path(staging_dir(run, str(stage))) / "log.txt"
    proxy.when(b"/checkpoints/step_000004", proxy.hold)
    args = [*TINY, "run.name=r", "train.max_steps=10", *overrides]
    proc = forkserver.popen([sys.executable, TRAIN, *args], cwd=REPO,
                            env=child_env(env), text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while "the next save tries again" not in (log.read_text() if log.exists() else ""):
            assert proc.poll() is None and time.monotonic() < deadline, "no given-up save"
            time.sleep(0.1)
        proxy.restore()
        output, _ = proc.communicate(timeout=120)
    finally:
        proxy.close()
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, output[-3000:]
    upload = f"the upload of {run}/checkpoints/step_000004-epoch_00/checkpoint.pt"
    waiting = [line for line in output.splitlines() if "waiting for the object store" in line]
    assert waiting and waiting[0].endswith(
        f"waiting for the object store at {proxy.endpoint}: {upload} has had no answer for 1 s "
        f"(given up after 3 s, run.store_timeout_s)"), output[-3000:]
    failed = [line for line in output.splitlines() if "the next save tries again" in line]
    assert len(failed) == 1 and failed[0].endswith(
        f"checkpoint error: cannot write step_000004-epoch_00 in {run}/checkpoints: storage "
        f"error: the object store at {proxy.endpoint} did not answer {upload} (no answer within "
        f"3 s); the previous checkpoint is kept; training goes on, and the next save tries "
        f"again"), output[-3000:]
    assert "Traceback" not in output
    fs = s3.fs()
    latest = fs.cat(f"{run.removeprefix('s3://')}/checkpoints/latest").decode().strip()
    marker = json.loads(fs.cat(f"{run.removeprefix('s3://')}/checkpoints/{latest}/COMPLETE"))
    assert marker["step"] == 10
