"""A real S3-compatible server on localhost for tests: moto in server mode, in its own process."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from typing import Iterator

ACCESS_KEY, SECRET_KEY = "pd-test", "pd-test-secret"
START_TIMEOUT_S = 60.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def s3_server() -> Iterator[str]:
    """Start the server, yield its endpoint once it answers, stop it (by its pid) after.

    Sets the AWS credential variables that the NIXL OBJ backend and boto3 read.
    """
    import boto3
    from botocore.exceptions import EndpointConnectionError

    port = free_port()
    endpoint = f"http://127.0.0.1:{port}"
    saved = {name: os.environ.get(name) for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")}
    os.environ.update(AWS_ACCESS_KEY_ID=ACCESS_KEY, AWS_SECRET_ACCESS_KEY=SECRET_KEY)
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            try:
                client.list_buckets()
                break
            except EndpointConnectionError:
                if server.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the S3 test server did not start on {endpoint}")
                time.sleep(0.1)  # polling a starting server's port, not standing in for an event
        yield endpoint
    finally:
        server.terminate()
        server.wait(timeout=30)
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def bucket_keys(endpoint: str, bucket: str) -> list[str]:
    import boto3

    client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=bucket)
    return [item["Key"] for page in pages for item in page.get("Contents", [])]


def create_bucket(endpoint: str, bucket: str) -> None:
    import boto3

    boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(Bucket=bucket)
