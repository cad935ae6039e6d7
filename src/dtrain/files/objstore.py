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

import contextlib
import os
from collections.abc import Iterator, Mapping
from typing import Any

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

__all__ = ["ObjectStore", "PreconditionFailed", "StreamingUpload", "is_url", "join", "staging_dir"]

# Short timeouts and bounded retries: an unreachable endpoint is one line within a minute, a
# 503 "SlowDown" is retried with backoff (botocore's standard retry mode).
_DEFAULT_CONFIG = {"connect_timeout": 5, "read_timeout": 60,
                   "retries": {"max_attempts": 6, "mode": "standard"}}  # fmt: skip
PART = 8 * 2**20  # the size of an upload's parts


class PreconditionFailed(Exception):
    """A conditional write lost: the object exists (create) or changed (replace)."""


class ObjectStore:
    """One prefix of a bucket: every name below is relative to it."""

    def __init__(self, url: str, options: Mapping[str, Any] | None = None) -> None:
        # A URL's userinfo is no S3 credential, and messages show these URLs.
        check_no_userinfo(url, "object store", STORE_CREDENTIALS, "storage error")
        endpoint = os.environ.get("AWS_ENDPOINT_URL", "")
        check_no_userinfo(endpoint, "AWS_ENDPOINT_URL", STORE_CREDENTIALS, "storage error")
        require("s3fs", "s3", f"an object-store location ({url})")
        import s3fs

        self.url = url.rstrip("/")
        self.bucket = self.url.split("://", 1)[1].split("/", 1)[0]
        opts = dict(options or {})
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
            self.fs.call_s3("list_objects_v2", Bucket=self.bucket, MaxKeys=1)
        except Exception as e:  # noqa: BLE001 - each cause becomes its one line
            raise self.error(e, "reach") from None

    def cat(self, rel: str) -> bytes | None:
        """The object's bytes, or None when there is none."""
        try:
            return bytes(self.fs.cat_file(self.path(rel)))
        except FileNotFoundError:
            return None

    def read_with_etag(self, rel: str) -> tuple[bytes | None, str | None]:
        """The object and its version (ETag) for a conditional rewrite; (None, None) if absent."""
        try:
            response = self.fs.call_s3("get_object", Bucket=self.bucket, Key=self.key(rel))
        except FileNotFoundError:
            return None, None
        body = response["Body"]
        data = _read_body(self.fs, body)
        return data, response["ETag"]

    def exists(self, rel: str = "") -> bool:
        return bool(self.fs.exists(self.path(rel)))

    def files(self, rel: str = "") -> dict[str, int]:
        """Every object below `rel`, by its name relative to `rel`, with its size."""
        return {name: size for name, (size, _) in self.versions(rel).items()}

    def versions(self, rel: str = "") -> dict[str, tuple[int, str]]:
        """`files`, each with its version too: its ETag, which changes whenever the object is
        written again (a content digest only for single-part uploads: a version, not a check)."""
        base = self.path(rel)
        try:
            found = self.fs.find(base, detail=True, withdirs=False)
        except FileNotFoundError:
            return {}
        return {
            name[len(base) + 1 :]: (int(info.get("size", 0)), str(info.get("ETag", "")))
            for name, info in found.items()
            if name.startswith(base + "/")
        }

    def version(self, rel: str) -> str:
        """The object's ETag now (FileNotFoundError when there is none)."""
        return str(self.fs.info(self.path(rel), refresh=True).get("ETag", ""))

    def folders(self, rel: str = "") -> list[str]:
        """The names of the folders (common prefixes) directly below `rel`."""
        try:
            entries = self.fs.ls(self.path(rel), detail=True, refresh=True)
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
        self.fs.get_file(self.path(rel), local, max_concurrency=1)

    # -- writing -------------------------------------------------------------------------------
    def put(self, local: str, rel: str, create: bool = False) -> None:
        """Upload the file `local`; with `create`, only if there is no such object
        (If-None-Match: *), else PreconditionFailed."""
        if not create:
            self.fs.put_file(local, self.path(rel))
            return
        try:
            self.fs.put_file(local, self.path(rel), mode="create")
        except (FileExistsError, OSError) as e:
            if isinstance(e, FileExistsError) or "condition" in str(e).lower():
                raise PreconditionFailed(rel) from None
            raise

    def pipe(self, rel: str, data: bytes) -> None:
        self.fs.pipe_file(self.path(rel), data)

    def create(self, rel: str, data: bytes) -> None:
        """Write the object only if there is none (If-None-Match: *); PreconditionFailed if
        another writer got there first."""
        try:
            self.fs.pipe_file(self.path(rel), data, mode="create")
        except FileExistsError:
            raise PreconditionFailed(rel) from None

    def replace(self, rel: str, data: bytes, etag: str | None) -> str:
        """Rewrite the object only if it is still the version `etag` (None: only if there is
        none); returns the new version. PreconditionFailed when it changed meanwhile."""
        kwargs = {"IfMatch": etag} if etag else {"IfNoneMatch": "*"}
        try:
            response = self.fs.call_s3(
                "put_object", Bucket=self.bucket, Key=self.key(rel), Body=data, **kwargs
            )
        except (FileExistsError, OSError) as e:
            if "condition" in str(e).lower() or isinstance(e, FileExistsError):
                raise PreconditionFailed(rel) from None
            raise
        return str(response["ETag"])

    def rm(self, rel: str, recursive: bool = False) -> None:
        try:
            self.fs.rm(self.path(rel), recursive=recursive)
        except FileNotFoundError:
            pass

    def move_tree(self, rel: str, target: str) -> None:
        """Move every object below `rel` to below `target` (server-side copies, then deletes:
        an object store has no rename)."""
        for name in self.files(rel):
            self.fs.copy(self.path(f"{rel}/{name}"), self.path(f"{target}/{name}"))
        self.rm(rel, recursive=True)

    def invalidate(self) -> None:
        self.fs.invalidate_cache()

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
        if "connect" in lowered or "timeout" in lowered or "Endpoint" in name:
            return UserError(
                f"storage error: cannot {doing} {where} for {self.url} ({text}); check "
                f"AWS_ENDPOINT_URL (or run.storage_options.client_kwargs.endpoint_url) and the "
                f"network"
            )
        return UserError(f"storage error: cannot {doing} {self.url} at {self.endpoint}: {text}")


class StreamingUpload:
    """One object uploaded while it is written: its bytes go up in parts (S3's multipart upload)
    as they come, at most two parts in flight beside the writer, and the object exists once
    `finish` completes the upload; `abort` (or a failed part) leaves no object. A file smaller
    than a part is one plain upload at `finish`. Parts of 8 MiB (small parts overlap the upload
    with the writing best: bench/objstore_io.py), growing every 1,000 parts (S3 takes at most
    10,000): about 440 GB at most."""

    IN_FLIGHT = 2

    def __init__(self, objects: ObjectStore, rel: str) -> None:
        self.fs, self.bucket, self.key = objects.fs, objects.bucket, objects.key(rel)
        self.upload_id: str | None = None
        self.parts: list[dict[str, Any]] = []
        self.pending: list[tuple[int, Any]] = []  # (part number, future) in order
        self.buffer = bytearray()

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        self.buffer += view  # a copy: the writer may reuse its memory once write returns
        while len(self.buffer) >= self._part_bytes():
            size = self._part_bytes()
            self._send(bytes(self.buffer[:size]))
            del self.buffer[:size]
        return view.nbytes

    def finish(self) -> None:
        if self.upload_id is None:
            self.fs.call_s3("put_object", Bucket=self.bucket, Key=self.key, Body=bytes(self.buffer))
            return
        if self.buffer:
            self._send(bytes(self.buffer))
            self.buffer.clear()
        while self.pending:
            self._collect()
        self.fs.call_s3(
            "complete_multipart_upload",
            Bucket=self.bucket,
            Key=self.key,
            UploadId=self.upload_id,
            MultipartUpload={"Parts": self.parts},
        )

    def abort(self) -> None:
        for _, future in self.pending:
            future.cancel()
        self.pending.clear()
        if self.upload_id is not None:
            try:
                self.fs.call_s3(
                    "abort_multipart_upload", Bucket=self.bucket, Key=self.key,
                    UploadId=self.upload_id,
                )  # fmt: skip
            except Exception as e:  # noqa: BLE001 - the store discards it after a while
                log.debug(f"object store: could not abort the upload of {self.key}: {e!r}")

    def _part_bytes(self) -> int:
        return PART * (1 + (len(self.parts) + len(self.pending)) // 1000)

    def _send(self, body: bytes) -> None:
        import asyncio

        if self.upload_id is None:
            started = self.fs.call_s3("create_multipart_upload", Bucket=self.bucket, Key=self.key)
            self.upload_id = str(started["UploadId"])
        number = len(self.parts) + len(self.pending) + 1
        request = self.fs._call_s3(
            "upload_part", Bucket=self.bucket, Key=self.key, PartNumber=number,
            UploadId=self.upload_id, Body=body,
        )  # fmt: skip
        self.pending.append((number, asyncio.run_coroutine_threadsafe(request, self.fs.loop)))
        while len(self.pending) > self.IN_FLIGHT:
            self._collect()

    def _collect(self) -> None:
        number, future = self.pending.pop(0)
        self.parts.append({"PartNumber": number, "ETag": future.result()["ETag"]})


def _read_body(fs: Any, body: Any) -> bytes:
    """Read an aiobotocore streaming body on s3fs's event loop."""
    from fsspec.asyn import sync

    async def read() -> bytes:
        async with body as stream:
            return bytes(await stream.read())

    return bytes(sync(fs.loop, read))


def _quiet(loop: Any, context: dict[str, Any]) -> None:
    log.debug(f"object store: {context.get('message')}: {context.get('exception')!r}")
