"""Places named by URL (`s3://bucket/prefix`): how a run, checkpoint or output is recognised as
one in an object store, and what a config may say about it. Stdlib only: the config checks it."""

from __future__ import annotations

import hashlib
import os
import re
import tempfile
from collections.abc import Mapping
from typing import Any

from dtrain.core.errors import UserError

# A URL names a store: `scheme://...`. Only S3 (and S3-compatible stores) holds runs today.
_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
# A local path that was meant as a URL: `s3:/bucket`, `s3:bucket`, `S3://` with a typo.
_ALMOST_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]{1,15}):(?!//)")
SCHEMES = ("s3",)
# storage_options keys that hold a secret: those come from the environment or a profile, so
# that config.yaml, checkpoints and logs never hold one.
SECRET_KEYS = ("key", "secret", "token", "password", "aws_access_key_id",
               "aws_secret_access_key", "aws_session_token")  # fmt: skip


def is_url(path: str | None) -> bool:
    return bool(path) and _URL.match(str(path)) is not None


def check_location(path: str, key: str) -> None:
    """A config value or flag naming a place: a URL of a scheme dtrain writes to, or a local
    path that does not look like a mistyped URL. One UserError naming `key` otherwise."""
    match = _URL.match(path)
    if match:
        scheme = match.group(1).lower()
        if scheme == "file":
            return
        if scheme not in SCHEMES:
            raise UserError(
                f"config error: {key}: {path}: the '{scheme}' scheme is not supported; "
                f"runs, checkpoints and outputs go to a local path or an S3 (or "
                f"S3-compatible) store: s3://bucket/prefix"
            )
        if not path[match.end() :].split("/", 1)[0]:
            raise UserError(f"config error: {key}: {path} names no bucket: s3://bucket/prefix")
        return
    almost = _ALMOST_URL.match(path)
    if almost and almost.group(1).lower() in SCHEMES:
        raise UserError(
            f"config error: {key}: '{path}' looks like a mistyped URL (a local folder named "
            f"'{almost.group(1)}:' would be created); write {almost.group(1).lower()}://bucket/"
            f"prefix, or ./{path} for a local folder of that name"
        )


def check_options(options: Mapping[str, Any], key: str = "run.storage_options") -> None:
    """No secret in storage_options: it would be written into config.yaml and checkpoints."""
    for name, value in options.items():
        if name.lower() in SECRET_KEYS:
            raise UserError(
                f"config error: {key}.{name}: credentials are never put in the config (it is "
                f"saved with the run); set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or "
                f"AWS_PROFILE, in the environment instead"
            )
        if isinstance(value, Mapping):
            check_options(value, f"{key}.{name}")


def join(url: str, *parts: str) -> str:
    return "/".join([url.rstrip("/"), *(p.strip("/") for p in parts if p)])


def staging_dir(url: str, root: str = "") -> str:
    """The node-local folder where a run in the store at `url` writes its records before they
    are uploaded, and its checkpoints' files before each rank uploads its own. The same path on
    every node (each has its own disk there); under `root` (run.staging_dir) when given."""
    base = root or os.path.join(tempfile.gettempdir(), f"dtrain-staging-{os.getuid()}")
    digest = hashlib.sha256(url.rstrip("/").encode()).hexdigest()[:16]
    return os.path.join(base, digest, os.path.basename(url.rstrip("/")))
