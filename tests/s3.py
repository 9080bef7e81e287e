"""A real S3 endpoint over HTTP for tests: moto's standalone server on loopback, credentials from the env."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from contextlib import contextmanager

import fsspec
from s3fs import S3FileSystem

from tests.procs import free_port

SECRET = "unbroken-test-secret-key-do-not-leak"
ENV = {
    "AWS_ACCESS_KEY_ID": "unbroken-test-key-id",
    "AWS_SECRET_ACCESS_KEY": SECRET,
    "AWS_DEFAULT_REGION": "us-east-1",
}


@contextmanager
def moto_server():
    """Start ``moto.server`` on 127.0.0.1, point the standard AWS variables at it, yield its URL."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    saved = {k: os.environ.get(k) for k in (*ENV, "AWS_ENDPOINT_URL")}
    os.environ.update(ENV, AWS_ENDPOINT_URL=url)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError("moto server did not start") from None
                time.sleep(0.2)
        S3FileSystem.clear_instance_cache()  # cached clients would still talk to an earlier endpoint
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        S3FileSystem.clear_instance_cache()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def make_bucket(name: str) -> str:
    fs = fsspec.filesystem("s3", skip_instance_cache=True)
    fs.mkdir(name)
    return f"s3://{name}"
