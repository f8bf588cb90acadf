from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

pytest_plugins = ["powertrain.testing"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class RedisServer:
    """A real redis-server (or valkey-server) on a free localhost port, nothing persisted."""

    def __init__(self, directory: Path) -> None:
        binary = shutil.which("redis-server") or shutil.which("valkey-server")
        if binary is None:
            # A server is the only honest peer for a networked store; none here, so say so.
            pytest.skip("no redis-server or valkey-server on PATH (Debian: apt install redis-server)")
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        args = [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        self.process = subprocess.Popen([*args, "--dir", str(directory)], stdout=subprocess.DEVNULL)
        client = redis.Redis.from_url(self.url)
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"{binary} did not start on port {self.port}") from None
                time.sleep(0.05)
        client.close()

    def stop(self) -> None:
        self.process.kill()
        self.process.wait(timeout=10)


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path)
    try:
        yield server
    finally:
        server.stop()
