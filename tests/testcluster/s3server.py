"""A real S3-compatible server on 127.0.0.1 for the checkpoint tests: moto's server mode,
installed and cached by hack/build-s3-server.sh (which says why moto, and why in an
environment of its own). One server process per test session; a bucket per test.

The clients under test reach it the way workers reach a real store: through the standard
environment (AWS_ENDPOINT_URL and credentials), over a socket.
"""
from __future__ import annotations

import socket
import subprocess
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

from testcluster.local import REPO
from testcluster.waits import wait_until

BUILD_SCRIPT = REPO / "hack" / "build-s3-server.sh"
START_TIMEOUT_S = 30
# moto accepts any credentials; the workers still need some to sign their requests.
ACCESS_KEY, SECRET_KEY, REGION = "lazarus-test", "lazarus-test-secret", "us-east-1"


@dataclass
class S3Server:
    endpoint: str
    proc: subprocess.Popen
    log: Path

    def env(self) -> dict[str, str]:
        """What a worker needs to use this server (what a Secret would hold)."""
        return {"AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
                "AWS_REGION": REGION, "AWS_ENDPOINT_URL": self.endpoint,
                "AWS_ALLOW_HTTP": "true"}

    def create_bucket(self, name: str | None = None) -> str:
        name = name or f"t-{uuid.uuid4().hex[:12]}"
        self._request("PUT", f"/{name}")
        return name

    def _request(self, method: str, path: str) -> None:
        request = urllib.request.Request(self.endpoint + path, method=method)
        with urllib.request.urlopen(request, timeout=10):
            pass

    def _answers(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"moto_server exited with {self.proc.returncode}: "
                                 f"{self.log.read_text()[-2000:]}")
        try:
            self._request("GET", "/")
            return True
        except (urllib.error.URLError, OSError):
            return False


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    built = subprocess.run([str(BUILD_SCRIPT)], capture_output=True, text=True, timeout=600)
    if built.returncode != 0:
        raise RuntimeError(f"hack/build-s3-server.sh failed:\n{built.stderr}")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = tmp_path_factory.mktemp("s3") / "moto.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([built.stdout.strip().splitlines()[-1], "-H", "127.0.0.1",
                                 "-p", str(port)], stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL)
    server = S3Server(f"http://127.0.0.1:{port}", proc, log)
    try:
        wait_until(server._answers, timeout=START_TIMEOUT_S, what="moto_server to answer")
        yield server
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture
def s3_bucket(s3_server, monkeypatch) -> str:
    """A fresh bucket, with this process's environment pointing at the server."""
    for key, value in s3_server.env().items():
        monkeypatch.setenv(key, value)
    return s3_server.create_bucket()
