"""Checkpoint storage: one job's folder on an object store or a shared disk, through fsspec.

``s3://`` and ``gs://`` go through obstore's fsspec filesystem, local paths and ``file://``
through fsspec's own. Credentials come from the environment, as each store's SDK reads it
(the workers get it from the Secret named by ``spec.checkpoint.secretName``): for S3 and
S3-compatible stores AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_ENDPOINT_URL, AWS_REGION
(AWS_ALLOW_HTTP=true for a plain-http endpoint); for GCS GOOGLE_SERVICE_ACCOUNT_KEY (the
key's JSON) or GOOGLE_APPLICATION_CREDENTIALS, or the node's workload identity.

What the checkpoints need from a store, and how each kind provides it:
- a write is never seen half done: an object store's PUT is atomic; on a disk the bytes go
  to a temporary file named after this writer (a random id: the pid is 1 in every
  container), are fsynced, and renamed over the final name;
- every call is bounded: the object store client retries a little and times out, and the
  checkpoint layer above decides what to do about a failure.
"""
from __future__ import annotations

import os
import uuid
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

from fsspec import AbstractFileSystem
from fsspec.implementations.local import LocalFileSystem
from lazarus_core.checkpoint_location import OBJECT_STORE_SCHEMES, job_root, path_problem

# The object store client's own retries (connection errors, 5xx) stay short: the checkpoint
# layer retries whole writes with its own backoff, and a training step waits for them.
_RETRY = {"max_retries": 2, "retry_timeout": timedelta(seconds=10),
          "backoff": {"init_backoff": timedelta(seconds=0.1), "max_backoff": timedelta(seconds=1),
                      "base": 2}}


class StorageError(RuntimeError):
    """A checkpoint location that cannot be opened at all (a bad URL)."""


@dataclass(frozen=True)
class Storage:
    """The folder of one job's checkpoints; paths below it are relative, '/'-separated."""

    fs: AbstractFileSystem
    root: str  # a URL on an object store, a local path otherwise
    # Names this writer's temporary files, so concurrent writers never collide.
    writer: str = field(default_factory=lambda: uuid.uuid4().hex[:12])

    @property
    def local(self) -> bool:
        return isinstance(self.fs, LocalFileSystem)

    def path(self, relative: str) -> str:
        return f"{self.root}/{relative}" if relative else self.root

    def put(self, relative: str, data: bytes) -> None:
        """Write ``data`` whole, or not at all."""
        target = self.path(relative)
        if not self.local:
            self.fs.pipe_file(target, data)
            return
        final = Path(target)
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = final.with_name(f".{final.name}.tmp-{self.writer}")
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, final)
        finally:
            tmp.unlink(missing_ok=True)
        # The rename itself must survive a crash of the node.
        fd = os.open(final.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def get(self, relative: str) -> bytes:
        return self.fs.cat_file(self.path(relative))

    def listing(self, relative: str = "") -> dict[str, int | None]:
        """Names directly under ``relative``: files with their size, folders with None.
        Empty when the folder does not exist (an object store has no empty folders)."""
        try:
            entries = self.fs.ls(self.path(relative), detail=True)
        except FileNotFoundError:
            return {}
        return {e["name"].rstrip("/").rsplit("/", 1)[-1]:
                (e.get("size") if e.get("type") == "file" else None) for e in entries}

    def remove(self, relative: str) -> None:
        """Delete a folder and everything in it (nothing if it is gone already)."""
        try:
            self.fs.rm(self.path(relative), recursive=True)
        except FileNotFoundError:
            pass


def open_storage(location: str, job_uid: str | None) -> Storage:
    """The storage of one job's checkpoints: ``<location>/<job uid>``, or ``location``
    itself when it is one run's own already (``job_uid`` None)."""
    if (problem := path_problem(location)) is not None:
        raise StorageError(f"checkpoint path {problem}")
    root = job_root(location, job_uid) if job_uid is not None else location.rstrip("/")
    scheme = root.split("://", 1)[0] if "://" in root else "file"
    if scheme in OBJECT_STORE_SCHEMES:
        from obstore.fsspec import FsspecStore

        # Not fsspec's instance cache: credentials come from the environment at creation.
        # No client_options: given any, the client ignores the environment's (such as
        # AWS_ALLOW_HTTP); its defaults bound each request (a 5 MB part of a large upload).
        fs = FsspecStore(scheme, retry_config=_RETRY, skip_instance_cache=True)
        return Storage(fs, root)
    return Storage(LocalFileSystem(), root.removeprefix("file://"))
