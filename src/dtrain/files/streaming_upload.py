"""One object of a store uploaded while it is written (S3's multipart upload): a checkpoint's
file goes up as its writer makes it, instead of after. No torch."""

from __future__ import annotations

from typing import Any

from dtrain.core.logs import log
from dtrain.files.objstore import ObjectStore

PART = 8 * 2**20  # the size of an upload's parts


class StreamingUpload:
    """One object uploaded while it is written: its bytes go up in parts (S3's multipart upload)
    as they come, at most two parts in flight beside the writer, and the object exists once
    `finish` completes the upload; `abort` (or a failed part) leaves no object. A file smaller
    than a part is one plain upload at `finish`. Parts of 8 MiB (small parts overlap the upload
    with the writing best: bench/objstore_io.py), growing every 1,000 parts (S3 takes at most
    10,000): about 440 GB at most."""

    IN_FLIGHT = 2

    def __init__(self, objects: ObjectStore, rel: str) -> None:
        self.objects, self.url = objects, objects.url_of(rel)
        self.fs, self.bucket, self.key = objects.fs, objects.bucket, objects.key(rel)
        self.upload_id: str | None = None
        self.parts: list[dict[str, Any]] = []
        self.pending: list[tuple[int, int, Any]] = []  # (part number, size, future) in order
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
            body = bytes(self.buffer)
            self._request("put_object", len(body), Body=body)
            return
        if self.buffer:
            self._send(bytes(self.buffer))
            self.buffer.clear()
        while self.pending:
            self._collect()
        self._request(
            "complete_multipart_upload",
            UploadId=self.upload_id,
            MultipartUpload={"Parts": self.parts},
        )

    def abort(self) -> None:
        for _, _, future in self.pending:
            future.cancel()
        self.pending.clear()
        if self.upload_id is not None:
            try:
                self._request("abort_multipart_upload", UploadId=self.upload_id)
            except Exception as e:  # noqa: BLE001 - the store discards it after a while
                log.debug(f"object store: could not abort the upload of {self.key}: {e!r}")

    def _part_bytes(self) -> int:
        return PART * (1 + (len(self.parts) + len(self.pending)) // 1000)

    def _send(self, body: bytes) -> None:
        if self.upload_id is None:
            started = self._request("create_multipart_upload")
            self.upload_id = str(started["UploadId"])
        number = len(self.parts) + len(self.pending) + 1
        request = self.fs._call_s3(
            "upload_part",
            Bucket=self.bucket,
            Key=self.key,
            PartNumber=number,
            UploadId=self.upload_id,
            Body=body,
        )
        self.pending.append((number, len(body), self.objects.submit(request)))
        while len(self.pending) > self.IN_FLIGHT:
            self._collect()

    def _collect(self) -> None:
        number, size, future = self.pending.pop(0)
        answer = self.objects.wait(f"the upload of {self.url} (part {number})", future, size)
        self.parts.append({"PartNumber": number, "ETag": answer["ETag"]})

    def _request(self, method: str, moved: int = 0, **kwargs: Any) -> Any:
        request = self.fs._call_s3(method, Bucket=self.bucket, Key=self.key, **kwargs)
        return self.objects.request(f"the upload of {self.url}", request, moved)
