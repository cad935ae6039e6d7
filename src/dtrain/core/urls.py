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
# A URL's userinfo (`user:password@` before the host): a credential, never printed.
_USERINFO = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*://)([^\s/@]*)@")
# Option names (s3fs's, botocore's, S3 request parameters'; any case, with or without `_`) that
# hold a credential: those come from the environment or a credentials file, so that
# config.yaml, checkpoints and logs never hold one. `key` and `username` are s3fs's names of
# the access key, `password` of the secret.
_CREDENTIAL_NAMES = ("key", "username")
_CREDENTIAL_WORDS = ("secret", "password", "passwd", "token", "accesskey", "credential")
# SSE-C: the object's encryption key travels with each request (SSECustomerKey, ...).
_ENCRYPTION_KEY_WORD = "customerkey"
STORE_CREDENTIALS = (
    "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (and AWS_SESSION_TOKEN), or AWS_PROFILE "
    "with a credentials file, in the environment instead"
)
ENCRYPTION_KEYS = (
    "let the bucket encrypt its objects instead (SSE-S3, or SSE-KMS: s3_additional_kwargs: "
    "{ServerSideEncryption: aws:kms, SSEKMSKeyId: ...})"
)
MLFLOW_CREDENTIALS = (
    "set MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD (or MLFLOW_TRACKING_TOKEN) in "
    "the environment instead"
)


def is_url(path: str | None) -> bool:
    return bool(path) and _URL.match(str(path)) is not None


def check_location(path: str, key: str) -> None:
    """A config value or flag naming a place: a URL of a scheme dtrain writes to, or a local
    path that does not look like a mistyped URL. One UserError naming `key` otherwise."""
    check_no_userinfo(path, key, STORE_CREDENTIALS)
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


def redacted(text: str) -> str:
    """`text` with the userinfo of every URL in it hidden (`http://user:***@host`,
    `http://***@host`): what every message that shows a URL prints."""

    def hide(found: re.Match[str]) -> str:
        user, colon, _ = found.group(2).partition(":")
        return f"{found.group(1)}{user + ':' if colon else ''}***@"

    return _USERINFO.sub(hide, text)


def check_no_userinfo(value: str, key: str, instead: str, error: str = "config error") -> None:
    """A value (of the config key or variable `key`) that holds a URL with `user:password@`:
    one line showing it redacted and saying where credentials go (`instead`)."""
    if redacted(value) != value:
        raise UserError(
            f"{error}: {key}: {redacted(value)}: credentials are never put in a URL (the config "
            f"is saved with the run, and messages show URLs); {instead}"
        )


def credential_kind(name: str) -> str | None:
    """What an option of this name holds, when it is a secret ('credentials', 'encryption
    keys'); None for any other option."""
    word = re.sub(r"[^a-z0-9]", "", name.lower())
    if _ENCRYPTION_KEY_WORD in word:
        return "encryption keys"
    if word in _CREDENTIAL_NAMES or any(part in word for part in _CREDENTIAL_WORDS):
        return "credentials"
    return None


def check_options(options: Mapping[str, Any], key: str = "run.storage_options") -> None:
    """No credential in storage_options, at any depth (client_kwargs, config_kwargs,
    s3_additional_kwargs, ...), neither by name nor as a URL's userinfo: it would be written
    into config.yaml, checkpoints and TensorBoard's hyperparameters."""
    for name, value in options.items():
        dotted = f"{key}.{name}"
        kind = credential_kind(str(name))
        if kind:
            instead = ENCRYPTION_KEYS if kind == "encryption keys" else STORE_CREDENTIALS
            raise UserError(
                f"config error: {dotted}: {kind} are never put in the config (it is saved with "
                f"the run); {instead}"
            )
        if isinstance(value, str):
            check_no_userinfo(value, dotted, STORE_CREDENTIALS)
        if isinstance(value, Mapping):
            check_options(value, dotted)


def join(url: str, *parts: str) -> str:
    return "/".join([url.rstrip("/"), *(p.strip("/") for p in parts if p)])


def staging_dir(url: str, root: str = "") -> str:
    """The node-local folder where a run in the store at `url` writes its records before they
    are uploaded, and its checkpoints' files before each rank uploads its own. The same path on
    every node (each has its own disk there); under `root` (run.staging_dir) when given."""
    base = root or os.path.join(tempfile.gettempdir(), f"dtrain-staging-{os.getuid()}")
    digest = hashlib.sha256(url.rstrip("/").encode()).hexdigest()[:16]
    return os.path.join(base, digest, os.path.basename(url.rstrip("/")))
