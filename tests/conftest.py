"""Shared helpers: real launches of launch/train.py, as a single process or under torchrun (gloo)."""

from __future__ import annotations

import json
import os
import re
import resource
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import pytest

import forkserver

REPO = Path(__file__).resolve().parents[1]
TRAIN = str(REPO / "launch" / "train.py")
TESTS = str(REPO / "tests")
# In-process imports of dtrain test this checkout too, not wherever dtrain was pip-installed from.
sys.path.insert(0, str(REPO / "src"))

# A small, fast job: tiny CNN, small synthetic set, log every step, no loader processes (tests
# of data.num_workers set it themselves).
TINY = [
    "model.name=simple_cnn", "model.args={width: 8}",
    "data.synthetic.train_size=512", "data.synthetic.val_size=100", "data.batch_size=16",
    "data.num_workers=0", "train.epochs=1", "train.log_every=1", "log.tensorboard=false",
    "optim.lr=0.05", "sched.name=none",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_env(extra: Optional[dict] = None) -> dict:
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    # Each launch would compile dtrain's modules again where bytecode is not written.
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    # Tests' own user models and datasets are importable by module path.
    env["PYTHONPATH"] = os.pathsep.join([TESTS, str(REPO / "src"), env.get("PYTHONPATH", "")])
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "SLURM_JOB_ID",
                 "SLURM_PROCID", "SLURM_NTASKS", "SLURM_STEP_ID"):
        env.pop(name, None)
    env.update(extra or {})
    return env


forkserver.configure(child_env(), REPO)  # launches fork from a warm interpreter (forkserver.py)


def without_module(folder: Path, module: str) -> dict:
    """Environment entries under which a child process cannot import `module` (nor its
    submodules), as when the extra that installs it was not installed: a `sitecustomize` in
    `folder` that refuses it."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sitecustomize.py").write_text(
        "import sys\n"
        "class Hidden:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        f"        if name == {module!r} or name.startswith({module + '.'!r}):\n"
        "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
        "sys.meta_path.insert(0, Hidden())\n")
    return {"PYTHONPATH": os.pathsep.join([str(folder), TESTS, str(REPO / "src")])}


@dataclass
class Result:
    returncode: int
    stdout: str
    stderr: str
    run_dir: Path

    @property
    def output(self) -> str:
        return self.stdout + self.stderr

    def records(self) -> list[dict]:
        path = self.run_dir / "metrics.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    def losses(self) -> dict[int, float]:
        return {r["step"]: r["loss"] for r in self.records() if "loss" in r}

    def evals(self) -> list[dict]:
        return [r for r in self.records() if "val_acc" in r]


# A log line's timestamp, as a pattern.
STAMP = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d "


def unwrapped(text: str) -> str:
    """Log text with each line that was cut to fit the console (an indented line after the
    timestamp) joined back to the one it continues."""
    return re.sub(r"\n" + STAMP + r"(?:\[rank \d+\] )?  (?=\S)", " ", text)


def run_facts(cfg):  # noqa: ANN001, ANN201 - dtrain is imported when used
    """What a run's sinks are told about it, made from a loaded config as `dtrain train` does."""
    from dtrain.config import flatten, to_dict
    from dtrain.observe import RunFacts

    monitor = (cfg.ckpt.monitor, cfg.ckpt.monitor_mode)
    return RunFacts(cfg.run_name, cfg.run.out_dir, monitor, flatten(to_dict(cfg)))


def torchrun_cmd(nproc: int, nnodes: int = 1, extra: Optional[list] = None) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
            f"--nnodes={nnodes}", "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{free_port()}", *(extra or [])]


def note_launch(nproc: int, args: list[str]) -> None:
    """With DTRAIN_TEST_LAUNCHES=FILE, each launch a test makes is a line of FILE (the test, its
    ranks, its arguments but the run's place): to find the runs that tests make twice."""
    path = os.environ.get("DTRAIN_TEST_LAUNCHES")
    if path:
        what = [a for a in args if not a.startswith(("run.out_dir=", "run.name=", "--run", "/"))]
        with open(path, "a", encoding="utf-8") as out:
            out.write(json.dumps({"test": os.environ.get("PYTEST_CURRENT_TEST", "").split(" ")[0],
                                  "nproc": nproc, "args": what}) + "\n")


def launch(run_dir: Path, overrides: list[str], nproc: int = 0, config: Optional[str] = None,
           timeout: float = 300, env: Optional[dict] = None, torchrun_args: Optional[list] = None,
           tiny: bool = True) -> Result:
    """Run launch/train.py: nproc=0 as a plain process, else under torchrun with nproc ranks."""
    args = ([f"--config={config}"] if config else []) + (TINY if tiny else []) + [
        f"run.out_dir={run_dir.parent}", f"run.name={run_dir.name}", *overrides]
    prefix = torchrun_cmd(nproc, extra=torchrun_args) if nproc else [sys.executable]
    note_launch(nproc, args)
    proc = forkserver.run([*prefix, TRAIN, *args], cwd=REPO, env=child_env(env), timeout=timeout)
    return Result(proc.returncode, proc.stdout, proc.stderr, run_dir)


def dtrain(*args: str, timeout: float = 120, env: Optional[dict] = None) -> subprocess.CompletedProcess:
    note_launch(0, ["dtrain", *args])
    return forkserver.run([sys.executable, "-m", "dtrain", *args], cwd=REPO, env=child_env(env),
                          timeout=timeout)


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (torchrun starts its workers in sessions of their own, so a
    process-group kill does not reach them)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def kill_tree(pid: int, sig: int) -> None:
    """Send `sig` to `pid` and every process below it, at once (as when a node dies)."""
    for target in [pid, *descendants(pid)]:
        try:
            os.kill(target, sig)
        except ProcessLookupError:
            pass


def wait_for_step(path: Path, step: int, proc: subprocess.Popen, timeout: float) -> None:
    """Until metrics.jsonl at `path` holds a record of `step` or later, while `proc` runs."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, "the run ended before it could be killed"
        if path.exists():
            steps = [json.loads(line).get("step", 0) for line in path.read_text().splitlines()
                     if line.endswith("}")]
            if steps and max(steps) >= step:
                return
        time.sleep(0.05)
    raise AssertionError(f"no step {step} in {path} after {timeout} s")


# -- runs killed and resumed, and what they leave -------------------------------------------------

def latest(run_dir: Path) -> Path:
    """The checkpoint folder that the run directory's `latest` names."""
    return run_dir / "checkpoints" / (run_dir / "checkpoints" / "latest").read_text().strip()


def final_weights(run_dir: Path) -> dict:
    from dtrain.commands.export.command import load_model
    model, _ = load_model(str(latest(run_dir)))
    return model.state_dict()


def start(run_dir: Path, overrides: list[str], nproc: int, env: dict | None = None):
    """launch/train.py on the tiny job in the background, output discarded, in a session of its own."""
    args = [*TINY, f"run.out_dir={run_dir.parent}", f"run.name={run_dir.name}", *overrides]
    prefix = torchrun_cmd(nproc) if nproc else [sys.executable]
    note_launch(nproc, args)
    return forkserver.popen([*prefix, TRAIN, *args], cwd=REPO, env=child_env(env),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)


def kill_when(proc: subprocess.Popen, ready, timeout: float = 180) -> None:
    """SIGKILL torchrun and all its workers at once when `ready()` holds."""
    deadline = time.monotonic() + timeout
    while not ready():
        assert proc.poll() is None, "the run ended before it could be killed"
        assert time.monotonic() < deadline, "timed out waiting to kill the run"
        time.sleep(0.05)
    assert proc.poll() is None, "the run ended before it could be killed"
    kill_tree(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)


def saved_step(run_dir: Path) -> int:
    path = run_dir / "checkpoints" / "latest"
    return json.loads((latest(run_dir) / "COMPLETE").read_text())["step"] if path.exists() else 0


def kill_then_resume(run_dir: Path, overrides: list[str], at_step: int) -> tuple[int, Result]:
    """A 2-rank run SIGKILLed (torchrun and every worker) once a checkpoint of `at_step` or
    later is saved, then the same command again: the step it was killed at, and the relaunch."""
    proc = start(run_dir, overrides, nproc=2)
    kill_when(proc, lambda: saved_step(run_dir) >= at_step)
    killed_at = saved_step(run_dir)
    return killed_at, launch(run_dir, overrides, nproc=2)


def assert_workers_resume_bit_exactly(runs: Path, overrides: list[str]) -> None:
    """A 2-rank run killed after step 10 with 2 loader workers per rank, then resumed, has the
    losses of the same run made straight through without workers: bitwise."""
    straight = launch(runs / "straight", [*overrides, "data.num_workers=0"], nproc=2)
    assert straight.returncode == 0, straight.stderr[-3000:]
    killed_at, resumed = kill_then_resume(runs / "killed", [*overrides, "data.num_workers=2"],
                                          at_step=10)
    assert killed_at < 50
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stderr
    assert resumed.losses() == straight.losses()


@pytest.fixture(scope="session")
def s3():
    """A real S3 server (moto's) on 127.0.0.1 for this worker's tests; `s3.bucket()` makes each
    test its own bucket."""
    import s3server
    server = s3server.start()
    yield server
    s3server.stop(server)


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    return tmp_path / "runs" / "run"


@pytest.fixture
def tmpfs(tmp_path: Path):
    """`mount(options, name)`: a tmpfs at tmp_path/name (`size=256k`, `ro,size=64k`: a full or a
    read-only disk), unmounted after the test; the test is skipped where none can be mounted."""
    mounted: list[Path] = []

    def mount(options: str, name: str = "disk") -> Path:
        where = tmp_path / name
        where.mkdir(parents=True, exist_ok=True)
        proc = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.strip()}")
        mounted.append(where)
        return where

    yield mount
    for where in reversed(mounted):
        subprocess.run(["umount", str(where)], capture_output=True)


def fill_disk(folder: Path) -> None:
    """Take the rest of the disk `folder` is on, with folder/filler."""
    filler = os.open(folder / "filler", os.O_WRONLY | os.O_CREAT)
    try:
        while os.write(filler, b"\0" * 4096):
            pass
    except OSError:
        pass
    finally:
        os.close(filler)



# The files whose tests use a SLURM cluster or the test hosts: under `make test` (pytest -n N)
# the files of one service run on one worker, one test at a time, as the service expects (two
# at once would wait for each other's nodes). The one-node cluster is not on the test hosts;
# the two-node one is.
SERVICES = {"tests/test_slurm.py": "one-node SLURM", "tests/test_sweep.py": "one-node SLURM",
            "tests/test_slurm_replicas.py": "one-node SLURM",
            "tests/test_multinode.py": "test hosts", "tests/test_elastic.py": "test hosts"}


# The files that take longest, roughly longest first (a service's files are the longest chains),
# from the wall times a run of the suite prints last: workers start them first, so that none
# begins a long file while the others are done. The rest follow in collection order. A stale
# order costs minutes, never a result.
LONGEST_FIRST = ("tests/test_export_quantize.py", "tests/test_multinode.py", "tests/test_elastic.py",
                 "tests/test_slurm.py", "tests/test_sweep.py", "tests/test_export_formats.py",
                 "tests/test_pipeline.py", "tests/test_tensor_parallel.py", "tests/test_qat.py",
                 "tests/test_objstore.py", "tests/test_replicas.py", "tests/test_features.py",
                 "tests/test_tasks_lm_eval.py", "tests/test_lora.py",
                 "tests/test_hf.py", "tests/test_eval.py", "tests/test_plan_fit.py",
                 "tests/test_hf_models.py", "tests/test_ema.py", "tests/test_fsdp_scale.py",
                 "tests/test_readme_commands.py", "tests/test_fsdp.py", "tests/test_faults.py",
                 "tests/test_pipeline_models.py", "tests/test_generate.py", "tests/test_trackers.py",
                 "tests/test_tokens.py", "tests/test_trust_code.py", "tests/test_integrity.py",
                 "tests/test_quantize.py", "tests/test_tasks.py", "tests/test_checkpoint.py",
                 "tests/test_replicas_hosts.py", "tests/test_shown_and_shared.py",
                 "tests/test_images.py")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    rank = {path: i for i, path in enumerate(LONGEST_FIRST)}
    order = {}  # each file's place: its rank, else after them in the order collected
    for item in items:
        path = item.nodeid.split("::", 1)[0]
        order.setdefault(path, rank.get(path, len(rank) + len(order)))
    items.sort(key=lambda item: order[item.nodeid.split("::", 1)[0]])  # stable: a file's order


@pytest.hookimpl(optionalhook=True)  # (a hook of xdist's: unknown where it is not loaded)
def pytest_xdist_make_scheduler(config: pytest.Config, log):  # noqa: ANN201 - xdist's own types
    """Under `pytest -n N`: each file's tests share a worker (and so their module fixtures, which
    train once for many tests); the files of one of the SERVICES share one. Files are handed
    out in the order collected (LONGEST_FIRST), not xdist's (most tests first)."""
    from xdist.scheduler import LoadScopeScheduling

    class ByFile(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return SERVICES.get(path, path)

    config.option.loadscopereorder = False
    return ByFile(config, log)


# CPU seconds of each test, its launches included (what a test's processes and theirs used, once
# they ended), shown after the slowest tests: on two cores the suite's length is its CPU time.
def _cpu_seconds() -> float:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(
        resource.RUSAGE_CHILDREN)
    return (own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime
            + forkserver.cpu_seconds())


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    item.stash[_CPU_START] = _cpu_seconds()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):  # noqa: ANN201
    outcome = yield
    report = outcome.get_result()
    if call.when == "teardown" and _CPU_START in item.stash:
        report.user_properties.append(("cpu_s", _cpu_seconds() - item.stash[_CPU_START]))


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    spent = [(dict(r.user_properties).get("cpu_s"), r.nodeid)
             for reports in terminalreporter.stats.values() for r in reports
             if getattr(r, "when", None) == "teardown" and dict(getattr(r, "user_properties", ()))]
    spent = sorted(((s, n) for s, n in spent if s is not None), reverse=True)
    if not spent:
        return
    terminalreporter.section(f"most CPU: 25 of {len(spent)} tests, {sum(s for s, _ in spent) / 60:.1f} "
                             f"CPU minutes in all")
    for seconds, nodeid in spent[:25]:
        terminalreporter.write_line(f"{seconds:7.1f}s cpu  {nodeid}")
    # Each file's wall time (its tests' setup, call and teardown): what LONGEST_FIRST orders by.
    by_file: dict[str, float] = {}
    for reports in terminalreporter.stats.values():
        for r in reports:
            if getattr(r, "when", None) in ("setup", "call", "teardown"):
                path = r.nodeid.split("::", 1)[0]
                by_file[path] = by_file.get(path, 0.0) + r.duration
    terminalreporter.section("longest files (wall seconds)")
    for path, seconds in sorted(by_file.items(), key=lambda item: -item[1])[:40]:
        terminalreporter.write_line(f"{seconds:7.1f}s  {path}")


_CPU_START = pytest.StashKey[float]()
