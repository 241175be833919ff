"""A real S3-compatible HTTP server for the tests: moto's server mode on 127.0.0.1.

``s3_server`` (session scope) starts ``moto.server.ThreadedMotoServer`` on a free port,
creates one bucket and stops the server at the end of the session. ``s3_url`` (function
scope) hands each test a fresh ``s3://bucket/<unique prefix>`` so tests never see each
other's keys. Credentials are fake and travel as storage options (``s3_options``) or, for
subprocesses, as environment variables (``S3Server.env``); the process environment of the
test run is never modified.
"""

from __future__ import annotations

import logging
import os
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

__all__ = ["S3Server", "BUCKET", "s3_server", "s3_options", "s3_url", "make_client"]

BUCKET = "shardstore-test"
_KEY = "testing"
_REGION = "us-east-1"


@dataclass(frozen=True)
class S3Server:
    """Where the test server listens and how to reach it."""

    endpoint: str

    @property
    def options(self) -> dict[str, Any]:
        """Storage options for ``open_store(url, **options)`` / ``s3fs.S3FileSystem(**options)``."""
        return {"endpoint_url": self.endpoint, "key": _KEY, "secret": _KEY, "client_kwargs": {"region_name": _REGION}}

    @property
    def env(self) -> dict[str, str]:
        """Environment for a subprocess (e.g. the CLI) that reaches the server through botocore's own lookup."""
        env = dict(os.environ)
        env.update(
            AWS_ACCESS_KEY_ID=_KEY,
            AWS_SECRET_ACCESS_KEY=_KEY,
            AWS_DEFAULT_REGION=_REGION,
            AWS_ENDPOINT_URL=self.endpoint,
        )
        env.pop("AWS_PROFILE", None)
        return env

    def url(self) -> str:
        return f"s3://{BUCKET}/{uuid.uuid4().hex[:12]}"


def make_client(server: S3Server) -> Any:
    """A plain synchronous boto3 client for inspecting the server from tests."""
    import boto3

    return boto3.client(
        "s3", endpoint_url=server.endpoint, aws_access_key_id=_KEY, aws_secret_access_key=_KEY, region_name=_REGION
    )


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # one line per request otherwise
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        info = S3Server(f"http://{host}:{port}")
        make_client(info).create_bucket(Bucket=BUCKET)
        yield info
    finally:
        server.stop()


@pytest.fixture
def s3_options(s3_server: S3Server) -> dict[str, Any]:
    return s3_server.options


@pytest.fixture
def s3_url(s3_server: S3Server) -> str:
    return s3_server.url()
