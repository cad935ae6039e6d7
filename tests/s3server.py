"""A real S3 server for the tests: moto's, as a process on 127.0.0.1 (or a test host's address),
with a fresh bucket per test. With `auth`, it checks credentials as AWS does (its IAM checks on,
a user with an access key of its own making: a wrong secret is refused); its signature check
refuses listings with a delimiter, so the tests' runs use a server without it. Tests assert the
secret never leaks."""

from __future__ import annotations

import itertools
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

# The server's first requests go unchecked: the ones that make the test user, its key and policy.
_SETUP_REQUESTS = 3
_BUCKETS = itertools.count()


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclass
class S3Server:
    host: str
    port: int
    proc: subprocess.Popen
    key: str = ""
    secret: str = ""  # looked for in every log, record and object a run writes

    @property
    def endpoint(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def env(self) -> dict[str, str]:
        """What a child process needs to reach the server, as every AWS tool reads it."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": self.key,
            "AWS_SECRET_ACCESS_KEY": self.secret,
            "AWS_DEFAULT_REGION": "us-east-1",
        }

    def fs(self):  # noqa: ANN201 - s3fs's own type
        import s3fs

        return s3fs.S3FileSystem(
            key=self.key, secret=self.secret, client_kwargs={"endpoint_url": self.endpoint},
            use_listings_cache=False, skip_instance_cache=True,
        )

    def bucket(self) -> str:
        """A new, empty bucket."""
        name = f"bucket-{os.getpid()}-{next(_BUCKETS)}"
        self.fs().mkdir(name)
        return name


def start(host: str = "127.0.0.1", netns: str | None = None, auth: bool = False) -> S3Server:
    """moto's server on `host` (inside the network namespace `netns` when given)."""
    port = _free_port(host) if netns is None else 9000
    binary = shutil.which("moto_server") or str(Path(sys.executable).with_name("moto_server"))
    cmd = [binary, "-H", host, "-p", str(port)]
    if netns:
        cmd = ["ip", "netns", "exec", netns, *cmd]
    env = dict(os.environ)
    if auth:
        env["INITIAL_NO_AUTH_ACTION_COUNT"] = str(_SETUP_REQUESTS)
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True, env=env)
    server = S3Server(host, port, proc)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        assert proc.poll() is None, "the S3 server exited at start"
        try:
            with socket.create_connection((host, port), timeout=1):
                pass
        except OSError:
            time.sleep(0.1)
            continue
        if auth:
            _make_user(server)
        else:
            server.key, server.secret = "testing-key", "s3cr3t-never-in-a-log-0d9f"
        return server
    proc.kill()
    raise AssertionError(f"the S3 server at {server.endpoint} did not answer in 30 s")


def _make_user(server: S3Server) -> None:
    """A user allowed everything, and its access key: the credentials the tests use."""
    import boto3

    iam = boto3.client("iam", endpoint_url=server.endpoint, region_name="us-east-1",
                       aws_access_key_id="setup", aws_secret_access_key="setup")
    iam.create_user(UserName="dtrain-tests")
    policy = {"Version": "2012-10-17",
              "Statement": [{"Effect": "Allow", "Action": "*", "Resource": "*"}]}
    iam.put_user_policy(UserName="dtrain-tests", PolicyName="all",
                        PolicyDocument=json.dumps(policy))
    key = iam.create_access_key(UserName="dtrain-tests")["AccessKey"]
    server.key, server.secret = key["AccessKeyId"], key["SecretAccessKey"]


def stop(server: S3Server) -> None:
    server.proc.terminate()
    try:
        server.proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        server.proc.kill()
