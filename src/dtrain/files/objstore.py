"""Run directories, checkpoints and outputs in an object store (`s3://bucket/prefix`), through
fsspec and s3fs. No torch.

An object store has no rename, no directories and no locks, so what a local disk gives for free
is built from what every S3-compatible store has: a checkpoint is complete when its marker
object exists (written last), one run owns a prefix through a lease object created with a
conditional write (`If-None-Match: *`) and renewed with `If-Match`, and runs.csv is rewritten
with `If-Match` on the version that was read. Endpoint, region and credentials come from where
every AWS tool reads them (AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, AWS_PROFILE, ...);
`run.storage_options` adds what those cannot say, never a secret.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import signal
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from dtrain.core import signals
from dtrain.core.errors import UserError, first_line
from dtrain.core.imports import require
from dtrain.core.logs import log
from dtrain.core.urls import (
    STORE_CREDENTIALS,
    check_no_userinfo,
    is_url,
    join,
    staging_dir,
)

__all__ = [
    "ObjectStore",
    "PreconditionFailed",
    "StoreUnanswered",
    "is_url",
    "join",
    "staging_dir",
]

# Short timeouts and bounded retries: an unreachable endpoint is one line within a minute, a
# 503 "SlowDown" is retried with backoff (botocore's standard retry mode).
_RETRIES = {"max_attempts": 6, "mode": "standard"}
_DEFAULT_CONFIG = {"connect_timeout": 5, "read_timeout": 30, "retries": _RETRIES}
# The longest one request waits for its answer, its retries included (run.store_timeout_s); a
# transfer also gets a second per MiB it moved.
TIMEOUT_S = 45.0


class PreconditionFailed(Exception):
    """A conditional write lost: the object exists (create) or changed (replace)."""


class StoreUnanswered(UserError):
    """The store did not answer a request (connection refused or reset, no answer within the
    request's deadline, 5xx after the retries), or a stop signal ended the wait: nothing is
    known about what it holds, least of all that it is damaged. One line, exit 1 (a stop: 128 +
    the signal's number)."""

    exit_code = 1

    def __init__(self, line: str, cause: str = "", stopped_by: int | None = None) -> None:
        super().__init__(line)
        self.cause = cause  # what went wrong, without the endpoint (for lines that name it)
        self.stopped_by = stopped_by
        if stopped_by is not None:
            self.exit_code = 128 + stopped_by

    def __reduce__(self) -> tuple[Any, ...]:  # sent to the other ranks whole (dist.on_main)
        return (type(self), (str(self), self.cause, self.stopped_by))


class ObjectStore:
    """One prefix of a bucket: every name below is relative to it."""

    def __init__(
        self, url: str, options: Mapping[str, Any] | None = None, timeout_s: float = TIMEOUT_S
    ) -> None:
        # A URL's userinfo is no S3 credential, and messages show these URLs.
        check_no_userinfo(url, "object store", STORE_CREDENTIALS, "storage error")
        endpoint = os.environ.get("AWS_ENDPOINT_URL", "")
        check_no_userinfo(endpoint, "AWS_ENDPOINT_URL", STORE_CREDENTIALS, "storage error")
        require("s3fs", "s3", f"an object-store location ({url})")
        import s3fs

        self.url = url.rstrip("/")
        self.bucket = self.url.split("://", 1)[1].split("/", 1)[0]
        self.options = dict(options or {})  # as given (run.storage_options)
        opts = dict(self.options)
        config = {**_DEFAULT_CONFIG, **opts.pop("config_kwargs", {})}
        # Listings are never cached: other ranks and other nodes write into the same prefix.
        opts.setdefault("use_listings_cache", False)
        self.fs = s3fs.S3FileSystem(config_kwargs=config, **opts)
        # A connection dropped under a request leaves aiohttp's writer task failed; the request
        # itself reports it (and is retried). Not a traceback on the console.
        self.fs.loop.call_soon_threadsafe(self.fs.loop.set_exception_handler, _quiet)
        client = opts.get("client_kwargs", {}) or {}
        self.endpoint = client.get("endpoint_url") or os.environ.get("AWS_ENDPOINT_URL") or "AWS S3"
        self.root = self.url.split("://", 1)[1]
        self.timeout_s = timeout_s

    # -- names ---------------------------------------------------------------------------------
    def path(self, rel: str = "") -> str:
        return "/".join([self.root, rel.strip("/")]) if rel.strip("/") else self.root

    def child(self, rel: str) -> ObjectStore:
        """The store of a prefix below this one (same filesystem, same credentials)."""
        other = object.__new__(ObjectStore)
        other.__dict__.update(self.__dict__)
        other.url, other.root = join(self.url, rel), self.path(rel)
        return other

    def url_of(self, rel: str = "") -> str:
        return join(self.url, rel)

    def key(self, rel: str) -> str:
        return self.path(rel).split("/", 1)[1] if "/" in self.path(rel) else ""

    # -- reading -------------------------------------------------------------------------------
    def check(self) -> None:
        """Reach the endpoint, the bucket, and the credentials, before anything is written."""
        try:  # one listing of at most one object: needs the endpoint, bucket and credentials
            self.request(
                f"a listing of bucket '{self.bucket}'",
                self.fs._call_s3("list_objects_v2", Bucket=self.bucket, MaxKeys=1),
            )
        except Exception as e:  # noqa: BLE001 - each cause becomes its one line
            raise self.error(e, "reach") from None

    def cat(self, rel: str) -> bytes | None:
        """The object's bytes, or None when there is none."""
        try:
            return bytes(
                self.request(f"a read of {self.url_of(rel)}", self.fs._cat_file(self.path(rel)))
            )
        except FileNotFoundError:
            return None

    def read_with_etag(self, rel: str) -> tuple[bytes | None, str | None]:
        """The object and its version (ETag) for a conditional rewrite; (None, None) if absent."""
        what = f"a read of {self.url_of(rel)}"
        try:
            response = self.request(
                what, self.fs._call_s3("get_object", Bucket=self.bucket, Key=self.key(rel))
            )
        except FileNotFoundError:
            return None, None
        data = self.request(what, _read_body(response["Body"]))
        return data, response["ETag"]

    def exists(self, rel: str = "") -> bool:
        return bool(self.request(f"a look at {self.url_of(rel)}", self.fs._exists(self.path(rel))))

    def files(self, rel: str = "") -> dict[str, int]:
        """Every object below `rel`, by its name relative to `rel`, with its size."""
        return {name: size for name, (size, _) in self.versions(rel).items()}

    def versions(self, rel: str = "") -> dict[str, tuple[int, str]]:
        """`files`, each with its version too: its ETag, which changes whenever the object is
        written again (a content digest only for single-part uploads: a version, not a check)."""
        base = self.path(rel)
        try:
            found = self.request(
                f"a listing of {self.url_of(rel)}",
                self.fs._find(base, detail=True, withdirs=False),
            )
        except FileNotFoundError:
            return {}
        return {
            name[len(base) + 1 :]: (int(info.get("size", 0)), str(info.get("ETag", "")))
            for name, info in found.items()
            if name.startswith(base + "/")
        }

    def version(self, rel: str) -> str:
        """The object's ETag now (FileNotFoundError when there is none)."""
        info = self.request(
            f"a look at {self.url_of(rel)}", self.fs._info(self.path(rel), refresh=True)
        )
        return str(info.get("ETag", ""))

    def folders(self, rel: str = "") -> list[str]:
        """The names of the folders (common prefixes) directly below `rel`."""
        try:
            entries = self.request(
                f"a listing of {self.url_of(rel)}",
                self.fs._ls(self.path(rel), detail=True, refresh=True),
            )
        except FileNotFoundError:
            return []
        return sorted(
            os.path.basename(e["name"].rstrip("/")) for e in entries if e["type"] == "directory"
        )

    def get(self, rel: str, local: str) -> None:
        """Download the object to the file `local` in one request, written as it arrives:
        memory stays flat. (s3fs's default, ten ranged parts of 50 MiB at once, holds up to
        500 MiB in memory; with 8 MiB parts two at a time it was a third as fast here.)"""
        os.makedirs(os.path.dirname(local) or ".", exist_ok=True)
        self.request(
            f"the download of {self.url_of(rel)}",
            self.fs._get_file(self.path(rel), local, max_concurrency=1),
            moved=lambda: os.path.getsize(local) if os.path.exists(local) else 0,
        )

    # -- writing -------------------------------------------------------------------------------
    def put(self, local: str, rel: str, create: bool = False) -> None:
        """Upload the file `local`; with `create`, only if there is no such object
        (If-None-Match: *), else PreconditionFailed."""
        what, size = f"the upload of {self.url_of(rel)}", os.path.getsize(local)
        if not create:
            self.request(what, self.fs._put_file(local, self.path(rel)), moved=size)
            return
        try:
            self.request(what, self.fs._put_file(local, self.path(rel), mode="create"), moved=size)
        except (FileExistsError, OSError) as e:
            if isinstance(e, FileExistsError) or "condition" in str(e).lower():
                raise PreconditionFailed(rel) from None
            raise

    def pipe(self, rel: str, data: bytes) -> None:
        self.request(
            f"the upload of {self.url_of(rel)}",
            self.fs._pipe_file(self.path(rel), data),
            moved=len(data),
        )

    def create(self, rel: str, data: bytes) -> None:
        """Write the object only if there is none (If-None-Match: *); PreconditionFailed if
        another writer got there first."""
        try:
            self.request(
                f"the upload of {self.url_of(rel)}",
                self.fs._pipe_file(self.path(rel), data, mode="create"),
                moved=len(data),
            )
        except FileExistsError:
            raise PreconditionFailed(rel) from None

    def replace(self, rel: str, data: bytes, etag: str | None) -> str:
        """Rewrite the object only if it is still the version `etag` (None: only if there is
        none); returns the new version. PreconditionFailed when it changed meanwhile."""
        kwargs = {"IfMatch": etag} if etag else {"IfNoneMatch": "*"}
        try:
            response = self.request(
                f"the upload of {self.url_of(rel)}",
                self.fs._call_s3(
                    "put_object", Bucket=self.bucket, Key=self.key(rel), Body=data, **kwargs
                ),
                moved=len(data),
            )
        except (FileExistsError, OSError) as e:
            if "condition" in str(e).lower() or isinstance(e, FileExistsError):
                raise PreconditionFailed(rel) from None
            raise
        return str(response["ETag"])

    def rm(self, rel: str, recursive: bool = False) -> None:
        try:
            self.request(
                f"the removal of {self.url_of(rel)}",
                self.fs._rm(self.path(rel), recursive=recursive),
            )
        except FileNotFoundError:
            pass

    def move_tree(self, rel: str, target: str) -> None:
        """Move every object below `rel` to below `target` (server-side copies, then deletes:
        an object store has no rename)."""
        for name, size in self.files(rel).items():
            self.copy(f"{rel}/{name}", f"{target}/{name}", size)
        self.rm(rel, recursive=True)

    def copy(self, rel: str, target: str, size: int = 0) -> None:
        """The object `rel` copied to `target` by the store (a server-side copy of `size`
        bytes)."""
        self.request(
            f"a copy of {self.url_of(rel)}",
            self.fs._cp_file(self.path(rel), self.path(target)),
            moved=size,
        )

    def invalidate(self) -> None:
        self.fs.invalidate_cache()

    # -- waiting -------------------------------------------------------------------------------
    def request(self, what: str, coroutine: Any, moved: int | Callable[[], int] = 0) -> Any:
        """Send one of s3fs's requests (`coroutine`) and wait for its answer (`submit`,
        `wait`)."""
        return self.wait(what, self.submit(coroutine), moved)

    def submit(self, coroutine: Any) -> concurrent.futures.Future:
        """Start a request on s3fs's event loop; `wait` for its answer."""
        return asyncio.run_coroutine_threadsafe(coroutine, self.fs.loop)

    def wait(
        self, what: str, future: concurrent.futures.Future, moved: int | Callable[[], int] = 0
    ) -> Any:
        """The answer of a request (`what`, for messages), or StoreUnanswered when the store
        does not give one: connection refused or reset, a 5xx after botocore's retries, or no
        answer within `timeout_s`, retries included (a transfer also gets a second per MiB it
        `moved`: its size, or a function that says how much arrived so far). A wait a quarter
        that long says so once (the store may be stalled); a stop signal ends it
        (signals.ends_wait: a store that answers gets a few seconds to finish)."""
        began = time.monotonic()
        warned = False
        while not concurrent.futures.wait([future], timeout=0.2).done:
            waited = time.monotonic() - began
            limit = self.timeout_s + (moved() if callable(moved) else moved) / 2**20
            stop = signals.ends_wait(began)
            if stop is not None:
                future.cancel()
                raise StoreUnanswered(
                    f"stopped by {signal.Signals(stop).name} while waiting {waited:.0f} s for "
                    f"the object store at {self.endpoint} ({what})",
                    f"{what}: stopped",
                    stop,
                )
            if waited > limit:
                future.cancel()
                raise self._unanswered(what, f"no answer within {limit:.0f} s")
            if not warned and waited > limit / 4:
                warned = True
                log.warning(
                    f"waiting for the object store at {self.endpoint}: {what} has had no answer "
                    f"for {waited:.0f} s (given up after {limit:.0f} s, run.store_timeout_s)"
                )
        try:
            return future.result()
        except Exception as e:  # noqa: BLE001 - a store that did not answer, told apart
            if not _unanswered(e):
                raise
            raise self._unanswered(what, f"{type(e).__name__}: {first_line(e)}") from None

    def _unanswered(self, what: str, cause: str) -> StoreUnanswered:
        line = f"storage error: the object store at {self.endpoint} did not answer {what} ({cause})"
        return StoreUnanswered(line, f"{what}: {cause}")

    # -- errors --------------------------------------------------------------------------------
    @contextlib.contextmanager
    def failing_as(self, doing: str) -> Iterator[None]:
        """The store's failures in the block as `error`'s one line; a UserError as it is."""
        try:
            yield
        except UserError:
            raise
        except Exception as e:  # noqa: BLE001 - each cause becomes its one line
            raise self.error(e, doing) from None

    def error(self, e: BaseException, doing: str) -> UserError:
        """What went wrong talking to the store, as one line naming the endpoint and bucket."""
        text = first_line(e)
        name = type(e).__name__
        lowered = text.lower()
        where = f"the object store at {self.endpoint}"
        unanswered = isinstance(e, StoreUnanswered)
        if isinstance(e, StoreUnanswered) and (doing != "reach" or e.stopped_by is not None):
            return e  # a store lost while in use (exit 1), or a stop signal
        if "bucket does not exist" in lowered or "nosuchbucket" in lowered:
            return UserError(
                f"storage error: bucket '{self.bucket}' does not exist at {self.endpoint}; "
                f"create it, or name another bucket in {self.url}"
            )
        if isinstance(e, PermissionError) or any(
            w in text
            for w in ("InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied", "Forbidden")
        ):
            return UserError(
                f"storage error: {where} refused the credentials for bucket '{self.bucket}' "
                f"({text}); check AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE)"
            )
        if unanswered or "connect" in lowered or "timeout" in lowered or "Endpoint" in name:
            return UserError(
                f"storage error: cannot {doing} {where} for {self.url} "
                f"({e.cause if isinstance(e, StoreUnanswered) else text}); check "
                f"AWS_ENDPOINT_URL (or run.storage_options.client_kwargs.endpoint_url) and the "
                f"network"
            )
        return UserError(f"storage error: cannot {doing} {self.url} at {self.endpoint}: {text}")


async def _read_body(body: Any) -> bytes:
    """An aiobotocore streaming body, read (on s3fs's event loop)."""
    async with body as stream:
        return bytes(await stream.read())


def _unanswered(error: BaseException) -> bool:
    """Whether `error` (or what caused it) says that the store did not answer: no connection,
    a connection dropped, a timeout, or a 5xx (the store's own failure) after the retries."""
    from aiohttp import ClientConnectionError, ClientPayloadError
    from botocore.exceptions import ClientError, HTTPClientError
    from botocore.exceptions import ConnectionError as NoConnection
    from fsspec.exceptions import FSTimeoutError

    lost = (NoConnection, HTTPClientError, FSTimeoutError, ClientConnectionError)
    dropped = (ClientPayloadError, ConnectionError, TimeoutError)  # Python's: refused, reset
    seen: BaseException | None = error
    while seen is not None:
        if isinstance(seen, FileNotFoundError | FileExistsError | PermissionError):
            return False  # an answer
        if isinstance(seen, lost + dropped):
            return True
        if isinstance(seen, ClientError):
            status = seen.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0
            return int(status) >= 500
        seen = seen.__cause__ or seen.__context__
    return False


def _quiet(loop: Any, context: dict[str, Any]) -> None:
    log.debug(f"object store: {context.get('message')}: {context.get('exception')!r}")
