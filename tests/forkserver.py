"""Single-process launches, torchrun's agent and its ranks forked from a warm interpreter.

Importing torch and its compiler stack costs each fresh Python about 5-7 CPU seconds here, most
of a tiny run's cost. This module keeps, per pytest worker, one server process that has imported
them (and dtrain) once and computed nothing, and forks it for each launch: the child sets its
argv, environment, working directory and standard files as a fresh `python SCRIPT` or `python -m
MODULE` would have them, runs the program as `__main__`, and exits the way Python exits
(non-daemon threads joined, atexit handlers run, the exit code of SystemExit, a traceback and 1
for an exception). Each launch is still a process of its own: its pid can be signalled and
killed with all it started, and its exit code is what waitpid reports. A forked torchrun agent
forks its ranks from itself (`_fork_ranks`), so that they stay its children.

What a fork does not reproduce, and where a launch gets a fresh interpreter instead
(`subprocess.Popen`):
- settings read when torch, numpy or Python start: a launch whose environment differs from the
  server's in `PYTHON*`, `LD_*`, `OMP_*`, `TORCH*`, `CUDA*`, malloc or BLAS variables;
- a command that is not `sys.executable SCRIPT|-m MODULE ...`;
- every launch when DTRAIN_TEST_FRESH=1 is set (to check that a result does not depend on this).
One difference remains: the children of one server share its string-hash seed (a fresh Python
draws its own), so a result that depended on set order would be steadier here, never flakier.
"""

from __future__ import annotations

import atexit
import io
import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

# Variables that Python, torch, numpy, the C runtime or a preloaded library (huggingface_hub's
# cache and offline settings) read when they start: a launch that sets them otherwise than the
# server started with needs a fresh interpreter.
READ_AT_START = ("PYTHON", "LD_", "OMP_", "MKL_", "KMP_", "OPENBLAS", "GOTO", "TORCH", "CUDA",
                 "NVIDIA", "GLIBC_TUNABLES", "MALLOC_", "LC_", "LANG", "HF_", "TRANSFORMERS_")
# Of those, what is read later, when used: the suite's own PYTHON (the interpreter its scripts
# run), torch.hub's folder.
READ_WHEN_USED = ("PYTHON", "TORCH_HOME")
# What a tiny run imports that is worth importing once (the rest is quick, or particular).
PRELOAD = ("torch", "torch._dynamo", "torch.distributed.run", "torch.distributed.checkpoint",
           "torch.distributed.checkpoint.state_dict", "torch.distributed.fsdp", "torch.utils.data",
           "numpy", "dtrain.cli", "dtrain.run")
# Preloaded where installed: what a Hugging Face model's launch imports (2.5 CPU s).
PRELOAD_IF_THERE = ("transformers.modeling_utils",)
_MAX_MESSAGE = 1 << 20


# -- the test's side ---------------------------------------------------------------------------

class _Server:
    def __init__(self, env: dict, cwd: str) -> None:
        self.env = dict(env)
        self.folder = tempfile.mkdtemp(prefix="dtrain-forks-")
        self.address = os.path.join(self.folder, "socket")
        self.proc = subprocess.Popen([sys.executable, __file__, self.address], cwd=cwd, env=self.env,
                                     stdin=subprocess.DEVNULL)
        atexit.register(self.stop)

    def connect(self, timeout: float = 180) -> socket.socket:
        deadline = time.monotonic() + timeout
        while True:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            try:
                sock.connect(self.address)
                return sock
            except (FileNotFoundError, ConnectionRefusedError):
                sock.close()
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the fork server did not start (exit {self.proc.poll()})")
                time.sleep(0.05)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        for name in ("socket",):
            try:
                os.unlink(os.path.join(self.folder, name))
            except OSError:
                pass
        try:
            os.rmdir(self.folder)
        except OSError:
            pass


_server: Optional[_Server] = None
_base: Optional[tuple[dict, str]] = None
_cpu_used = 0.0


_started_with: dict[str, str] = {}


def configure(env: dict, cwd) -> None:
    """The environment and folder the server starts in: the tests' usual ones for a launch."""
    global _base, _started_with
    _base = (dict(env), str(cwd))
    _started_with = dict(os.environ)


def cpu_seconds() -> float:
    """CPU seconds of the forked launches that ended so far (they are not this process's children,
    so RUSAGE_CHILDREN does not count them)."""
    return _cpu_used


def _start_server() -> bool:
    global _server
    if _base is None:
        return False
    if _server is None or _server.proc.poll() is not None:
        _server = _Server(*_base)
    return True


def _program(cmd: list[str]) -> Optional[dict]:
    if len(cmd) < 2 or cmd[0] != sys.executable:
        return None
    if cmd[1] == "-m" and len(cmd) >= 3:
        return {"module": cmd[2], "args": cmd[3:]}
    if cmd[1].endswith(".py") and not cmd[1].startswith("-"):
        return {"script": os.path.abspath(cmd[1]), "args": cmd[2:]}
    return None


def _incompatible(env: dict) -> Optional[str]:
    """The first variable read at start that this launch sets otherwise than the server, if
    any. Not those this process's own libraries set since it started (torch's inductor sets
    TORCHINDUCTOR_CACHE_DIR to its default when imported): a fresh child inherits them too, with
    the values the server's libraries use anyway."""
    assert _server is not None
    keys = {k for k in (*env, *_server.env) if k.startswith(READ_AT_START)}
    for key in sorted(keys - set(READ_WHEN_USED)):
        ours = env.get(key)
        if ours == _server.env.get(key):
            continue
        if ours == os.environ.get(key) and ours != _started_with.get(key):
            continue  # set by a library in this process, not by the test
        return key
    return None


def _note(cmd: list[str], why: str) -> None:
    """With DTRAIN_TEST_FORKS=FILE, each launch that gets a fresh interpreter is a line of FILE
    with the reason (to find launches that could fork and do not)."""
    path = os.environ.get("DTRAIN_TEST_FORKS")
    if path:
        with open(path, "a", encoding="utf-8") as out:
            test = os.environ.get("PYTEST_CURRENT_TEST", "").split(" ")[0]
            out.write(json.dumps({"test": test, "why": why, "cmd": cmd[:3]}) + "\n")


def _fd(target, name: str) -> tuple[int, bool]:
    """The descriptor the child gets for one standard file, and whether it is ours to close."""
    mode = os.O_RDONLY if name == "stdin" else os.O_WRONLY
    if target == subprocess.DEVNULL or (target is None and name == "stdin"):
        return os.open(os.devnull, mode), True
    if target is None:
        return (1 if name == "stdout" else 2), False
    return (target if isinstance(target, int) else target.fileno()), False


class _Signalled:
    """What subprocess.Popen's signalling methods do, for a launch with a pid and a poll()."""

    pid: int

    def poll(self) -> Optional[int]:
        raise NotImplementedError

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Forked(_Signalled):
    """A launch forked from the server: the parts of subprocess.Popen that tests use."""

    def __init__(self, args: list[str], request: dict, stdin=None, stdout=None, stderr=None,
                 text: bool = False) -> None:
        assert _server is not None
        self.args = args
        self.returncode: Optional[int] = None
        self.stdout = self.stderr = None
        self._text = text
        ours: list[int] = []
        pipes: dict[str, int] = {}
        fds: list[int] = []
        for name, target in (("stdin", stdin), ("stdout", stdout), ("stderr", stderr)):
            if target == subprocess.PIPE:
                if name == "stdin":
                    raise ValueError("a forked launch reads no input from the test")
                pipes[name], write_end = os.pipe()
                fds.append(write_end)
                ours.append(write_end)
            elif target == subprocess.STDOUT and name == "stderr":
                fds.append(fds[1])
            else:
                fd, close = _fd(target, name)
                fds.append(fd)
                if close:
                    ours.append(fd)
        self._sock = _server.connect()
        try:
            socket.send_fds(self._sock, [json.dumps(request).encode()], fds)
            reply = json.loads(self._sock.recv(_MAX_MESSAGE))
        finally:
            for fd in ours:
                os.close(fd)
        self.pid: int = reply["pid"]
        for name, fd in pipes.items():
            setattr(self, name, open(fd, "r" if text else "rb"))

    def _finish(self, message: bytes) -> int:
        global _cpu_used
        reply = json.loads(message) if message else {"exit": -signal.SIGKILL, "cpu": 0.0}
        _cpu_used += reply["cpu"]
        self.returncode = reply["exit"]
        self._sock.close()
        return self.returncode

    def poll(self) -> Optional[int]:
        if self.returncode is None and select.select([self._sock], [], [], 0)[0]:
            self._finish(self._sock.recv(_MAX_MESSAGE))
        return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        if self.returncode is None:
            if not select.select([self._sock], [], [], timeout)[0]:
                raise subprocess.TimeoutExpired(self.args, timeout)
            self._finish(self._sock.recv(_MAX_MESSAGE))
        assert self.returncode is not None
        return self.returncode

    def communicate(self, timeout: Optional[float] = None):
        streams = [s for s in (self.stdout, self.stderr) if s is not None]
        chunks: dict[int, list[bytes]] = {s.fileno(): [] for s in streams}
        deadline = None if timeout is None else time.monotonic() + timeout
        open_fds = list(chunks)
        while open_fds:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready = select.select(open_fds, [], [], left)[0]
            if not ready:
                raise subprocess.TimeoutExpired(self.args, timeout)
            for fd in ready:
                data = os.read(fd, 1 << 16)
                if data:
                    chunks[fd].append(data)
                else:
                    open_fds.remove(fd)
        self.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        out = [_decode(b"".join(chunks[s.fileno()]), self._text) if s is not None else None
               for s in (self.stdout, self.stderr)]
        for s in streams:
            s.close()
        return out[0], out[1]

    def __enter__(self) -> "Forked":
        return self

    def __exit__(self, *exc) -> None:
        for s in (self.stdout, self.stderr):
            if s is not None:
                s.close()
        self.wait()


def _decode(data: bytes, text: bool):
    return io.TextIOWrapper(io.BytesIO(data)).read() if text else data


def popen(cmd: list[str], *, cwd, env: dict, stdin=None, stdout=None, stderr=None,
          text: bool = False, start_new_session: bool = False):
    """subprocess.Popen(cmd, ...), forked from the server where it can be (module docstring)."""
    program = _program(cmd)
    if os.environ.get("DTRAIN_TEST_FRESH") == "1":
        why: Optional[str] = "DTRAIN_TEST_FRESH=1"
    elif program is None:
        why = "not a script or a module"
    elif not _start_server():
        why = "no server configured"
    else:
        why = _incompatible(env)
        if why is None:
            request = {**program, "cwd": str(cwd), "env": env, "session": start_new_session}
            return Forked(cmd, request, stdin, stdout, stderr, text)
    _note(cmd, why or "")
    return subprocess.Popen(cmd, cwd=cwd, env=env, stdin=stdin, stdout=stdout, stderr=stderr,
                            text=text, start_new_session=start_new_session)


def run(cmd: list[str], *, cwd, env: dict, timeout: Optional[float] = None,
        text: bool = True) -> subprocess.CompletedProcess:
    """subprocess.run(cmd, capture_output=True, ...), forked where it can be. Output goes through
    files, as a run's output may be larger than a pipe holds."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        proc = popen(cmd, cwd=cwd, env=env, stdout=out, stderr=err, text=text)
        try:
            code = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess(cmd, code, _decode(out.read(), text),
                                           _decode(err.read(), text))


# -- the server ----------------------------------------------------------------------------------

# The signals whose handling a fresh Python starts with otherwise than the default: SIGINT raises
# KeyboardInterrupt, SIGPIPE and SIGXFSZ are ignored. Every other one is reset in a child.
_PYTHON_STARTS_WITH = {signal.SIGINT: signal.default_int_handler, signal.SIGPIPE: signal.SIG_IGN,
                       signal.SIGXFSZ: signal.SIG_IGN}


def _reset_signals() -> None:
    for sig in signal.valid_signals():
        if sig in (signal.SIGKILL, signal.SIGSTOP):
            continue
        try:
            signal.signal(sig, _PYTHON_STARTS_WITH.get(sig, signal.SIG_DFL))
        except (OSError, ValueError):
            pass


def _child(request: dict, fds: list[int]) -> None:
    """In the forked child: become the launch, run it, exit as Python would. Never returns."""
    import runpy
    import threading

    code = 1
    try:
        _reset_signals()
        if request["session"]:
            os.setsid()
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        for fd in set(fds):
            if fd > 2:
                os.close(fd)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        tempfile.tempdir = None  # the launch's TMPDIR, not the server's, as a fresh Python reads it
        if "module" in request:
            sys.argv = ["-m", *request["args"]]
            sys.path[0] = os.getcwd()
        else:
            sys.argv = [request["script"], *request["args"]]
            sys.path[0] = os.path.dirname(os.path.realpath(request["script"]))
        if request.get("module") == "torch.distributed.run":
            _fork_ranks()
        try:
            if "module" in request:
                runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
            else:
                runpy.run_path(request["script"], run_name="__main__")
            code = 0
        except SystemExit as stop:
            if stop.code is None:
                code = 0
            elif isinstance(stop.code, int):
                code = stop.code
            else:
                print(stop.code, file=sys.stderr)
                code = 1
        except KeyboardInterrupt:
            sys.excepthook(*sys.exc_info())
            code = -signal.SIGINT
        except BaseException:
            sys.excepthook(*sys.exc_info())
            code = 1
        threading._shutdown()  # type: ignore[attr-defined]  # what Python's exit does first
        atexit._run_exitfuncs()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
    except BaseException:  # in setting the child up: say so on its stderr
        import traceback
        traceback.print_exc()
        code = 1
    finally:
        if code < 0:  # as Python does on an uncaught KeyboardInterrupt: die of the signal
            signal.signal(-code, signal.SIG_DFL)
            os.kill(os.getpid(), -code)
        os._exit(code & 0xFF)


# -- torchrun's ranks, in a forked agent -----------------------------------------------------------

# What torchrun sets for each rank and the rank reads when it runs, not when torch is imported.
_SET_BY_TORCHRUN = ("TORCHELASTIC_", "TORCH_NCCL_", "TORCH_DISTRIBUTED_")


def _fork_ranks() -> None:
    """In a forked torchrun agent: the ranks it starts are forked from it (not from the server:
    so they stay the agent's children, in sessions of their own, as torchrun starts them), where
    the rank's command is `python [-u] SCRIPT ...` and its environment differs from the server's
    only in what torchrun sets for a rank. The rest get torchrun's own subprocess.Popen."""
    from torch.distributed.elastic.multiprocessing.subprocess_handler import (
        subprocess_handler as handler,
    )

    started = handler.SubprocessHandler._popen
    agent_env = dict(os.environ)  # the agent's launch: what its server accepted

    def popen(self, args: tuple, env: dict) -> object:
        words = [str(a) for a in args]
        if words[1:2] == ["-u"]:
            words = [words[0], *words[2:]]
        program = _program(words)
        if program is None or "script" not in program or not _rank_fits(env, agent_env):
            return started(self, args, env)
        request = {**program, "cwd": os.getcwd(), "env": dict(env), "session": True}
        out = self._stdout.fileno() if self._stdout else 1
        err = self._stderr.fileno() if self._stderr else 2
        return _ForkedRank(list(args), request, [0, out, err])

    handler.SubprocessHandler._popen = popen


def _rank_fits(env: dict, agent_env: dict) -> bool:
    """Whether a rank's environment is the agent's but for what torchrun sets per rank (the
    agent's own was checked against the server's when it was forked)."""
    keys = {k for k in (*env, *agent_env) if k.startswith(READ_AT_START)}
    for key in keys - set(READ_WHEN_USED):
        if env.get(key) != agent_env.get(key) and not key.startswith(_SET_BY_TORCHRUN):
            return False
    return True


class _ForkedRank(_Signalled):
    """A rank forked from the agent: its child, waited for as subprocess.Popen waits."""

    def __init__(self, args: list[str], request: dict, fds: list[int]) -> None:
        self.args = args
        self.returncode: Optional[int] = None
        pid = os.fork()
        if pid == 0:
            _child(request, fds)
        self.pid = pid

    def poll(self) -> Optional[int]:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(0.01)
        assert self.returncode is not None
        return self.returncode


def serve(address: str) -> None:
    import gc
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)
    for name in PRELOAD_IF_THERE:
        try:
            importlib.import_module(name)
        except ImportError:
            pass
    gc.collect()
    gc.freeze()  # the children's collections then leave the server's objects (and pages) alone
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_write, False)
    signal.set_wakeup_fd(wake_write)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    parent = os.getppid()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(address + ".new")
    listener.listen(64)
    os.rename(address + ".new", address)  # connectable only once ready
    waiting: dict[int, socket.socket] = {}
    while os.getppid() == parent:
        try:
            ready = select.select([listener, wake_read], [], [], 1.0)[0]
        except InterruptedError:
            ready = []
        if listener in ready:
            conn, _ = listener.accept()
            message, fds, _, _ = socket.recv_fds(conn, _MAX_MESSAGE, 3)
            pid = os.fork()
            if pid == 0:
                signal.set_wakeup_fd(-1)
                listener.close()
                conn.close()
                for other in waiting.values():
                    other.close()
                os.close(wake_read)
                os.close(wake_write)
                _child(json.loads(message), fds)
            for fd in fds:
                os.close(fd)
            conn.sendall(json.dumps({"pid": pid}).encode())
            waiting[pid] = conn
        if wake_read in ready:
            try:
                os.read(wake_read, 4096)
            except BlockingIOError:
                pass
        while waiting:
            try:
                pid, status, usage = os.wait4(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            conn = waiting.pop(pid, None)
            if conn is not None:
                try:
                    conn.sendall(json.dumps({"exit": os.waitstatus_to_exitcode(status),
                                             "cpu": usage.ru_utime + usage.ru_stime}).encode())
                except OSError:
                    pass
                conn.close()


if __name__ == "__main__":  # sys.path[0], this file's folder, is each child's to set
    serve(sys.argv[1])
