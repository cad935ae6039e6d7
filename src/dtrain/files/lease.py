"""One owner per run directory in an object store: a lease object.

A local run directory is kept by a POSIX lock that the kernel drops when its holder dies. A
store has no locks, so rank 0 creates `<run>/.lock` with a conditional write (only if there is
none) and renews it every `ttl / 4` seconds with a conditional rewrite of the version it wrote.
A second launch finds a live lease and exits 2 naming the holder. A lease that was not renewed
for `ttl` seconds (its holder was killed, or its node lost), whose holder process is gone on
this same host, or that the same SLURM job holds (the job was requeued) is taken over with a
conditional rewrite of the version that was read, so two launches never both win it.
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import threading
import time
from typing import Any

from dtrain.core.errors import UserError
from dtrain.core.logs import log
from dtrain.files import names
from dtrain.files.objstore import ObjectStore, PreconditionFailed

DEFAULT_TTL_S = 60.0


class Lease:
    def __init__(self, store: ObjectStore, ttl_s: float = DEFAULT_TTL_S) -> None:
        self.store, self.ttl_s = store, ttl_s
        self.rel = names.LOCK
        self.etag: str | None = None
        self.lost = False
        self._holder: dict[str, Any] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def acquire(self, job_id: str | None) -> None:
        started = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
        self._holder = {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "job": job_id,
            "started": started,
            "ttl_s": self.ttl_s,
        }
        for _ in range(3):  # a lease that ends while it is read is read again
            data, etag = self.store.read_with_etag(self.rel)
            if data is not None:
                current = _parse(data)
                if not self._may_take(current, job_id):
                    raise UserError(
                        f"run error: the run directory {self.store.url} is in use by another run "
                        f"({_describe(current)}); wait for it to end (a lease not renewed for "
                        f"{current.get('ttl_s', self.ttl_s):g} s is taken over), or give this run "
                        f"another run.name"
                    )
                log.warning(f"taking over the lease of {self.store.url} from {_describe(current)}")
            try:
                self.etag = self.store.replace(self.rel, self._body(), etag)
                break
            except PreconditionFailed:
                continue
        else:
            raise UserError(
                f"run error: the run directory {self.store.url} is being claimed by another "
                f"launch at the same time; give this run another run.name"
            )
        self._thread = threading.Thread(target=self._renew, name="dtrain-lease", daemon=True)
        self._thread.start()

    def release(self, remove: bool = True) -> None:
        """Stop renewing the lease and, with `remove`, remove it (when it is still this run's)."""
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join()
        self._thread = None
        if remove and not self.lost:
            try:
                data, etag = self.store.read_with_etag(self.rel)
                if etag == self.etag:  # never delete a lease another run holds now
                    self.store.rm(self.rel)
            except Exception as e:  # noqa: BLE001 - the lease ends by itself after ttl_s
                log.warning(f"could not release the lease of {self.store.url}: {e}")

    def _body(self) -> bytes:
        return json.dumps({**self._holder, "renewed": time.time()}).encode()

    def _renew(self) -> None:
        while not self._stop.wait(self.ttl_s / 4):
            try:
                self.etag = self.store.replace(self.rel, self._body(), self.etag)
            except PreconditionFailed:
                self.lost = True
                log.error(
                    f"the lease of {self.store.url} was taken by another run: this run no longer "
                    f"owns the directory; stop it (its next checkpoints would mix with the other "
                    f"run's)"
                )
                return
            except Exception as e:  # noqa: BLE001 - retried at the next renewal
                log.warning(f"could not renew the lease of {self.store.url}: {e}")

    def _may_take(self, current: dict[str, Any], job_id: str | None) -> bool:
        renewed = float(current.get("renewed", 0))
        ttl = float(current.get("ttl_s", self.ttl_s))
        if time.time() - renewed > ttl:
            return True
        if job_id and current.get("job") == job_id:  # this job, requeued: its old run is gone
            return True
        if current.get("host") == socket.gethostname():
            return not _alive(int(current.get("pid", 0) or 0))
        return False


def _parse(data: bytes) -> dict[str, Any]:
    try:
        value = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def _alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _describe(holder: dict[str, Any]) -> str:
    parts = [f"host {holder.get('host', '?')}", f"pid {holder.get('pid', '?')}"]
    if holder.get("job"):
        parts.append(f"SLURM job {holder['job']}")
    if holder.get("started"):
        parts.append(f"since {holder['started']}")
    if holder.get("renewed"):
        parts.append(f"renewed {max(0.0, time.time() - float(holder['renewed'])):.0f} s ago")
    return ", ".join(parts)
