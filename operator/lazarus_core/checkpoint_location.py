"""Where a job's checkpoints live: the storage URLs we accept and the folder of one job.

``spec.checkpoint.path`` names a shared location: an object store (``s3://bucket/prefix``,
``gs://bucket/prefix``) or a shared volume (``/data/ckpt`` or ``file:///data/ckpt``). Every
worker must reach the same files, so a relative path (each pod's own working directory)
is refused, and so is a scheme no worker can open: before fsspec, ``s3://b/x`` silently
became a local folder named ``s3:``. The CRD's CEL rules say the same (crds/lazarusjob.yaml;
tests/unit/test_checkpoint_location.py checks that the two agree).

Each job writes under ``<path>/<job uid>``, so two jobs given one path never share files.

Pure string logic: the operator (no fsspec) and the runtime (fsspec) both use it.
"""
from __future__ import annotations

import re

# The URL schemes workers can open (lazarus_runtime.storage maps each to fsspec).
SCHEMES = ("s3", "gs", "file")
OBJECT_STORE_SCHEMES = ("s3", "gs")
# S3 and GCS bucket names: lower case letters, digits, '.', '-' ('_' for GCS), 3-222.
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9._-]{1,220}[a-z0-9]$")
_URL = re.compile(r"^([a-z][a-z0-9+.-]*)://(.*)$")
MAX_LENGTH = 1024

# spec.checkpoint.keep: complete checkpoints kept; older ones are deleted. Two or more let
# a restore fall back when the newest one turns out corrupt.
KEEP_DEFAULT = 3
KEEP_MIN = 1
KEEP_MAX = 100


def path_problem(path: object) -> str | None:
    """Why ``path`` cannot be a checkpoint location (a sentence naming the fix), or None."""
    if not isinstance(path, str) or not path:
        return "is required: an object-store URL such as s3://bucket/prefix, or an absolute path"
    if len(path) > MAX_LENGTH:
        return f"is {len(path)} characters long; at most {MAX_LENGTH} are allowed"
    if re.search(r"[\s?#\\]", path):
        return (f"{path!r} contains whitespace, '?', '#' or a backslash; "
                f"use a plain path such as s3://bucket/prefix")
    url = _URL.match(path)
    if url:
        scheme, rest = url.groups()
        if scheme not in SCHEMES:
            return (f"the scheme {scheme}:// is not supported; use one of "
                    f"{', '.join(s + '://' for s in SCHEMES)} or an absolute path on a "
                    f"shared volume")
        if scheme == "file":
            if not rest.startswith("/"):
                return f"{path!r}: a file:// URL needs an absolute path, as in file:///data/ckpt"
            location = rest
        else:
            bucket = rest.split("/", 1)[0]
            if not _BUCKET.match(bucket):
                return (f"{path!r}: {bucket!r} is not a bucket name (3 to 222 lower case "
                        f"letters, digits, '.', '-' or '_'); write {scheme}://BUCKET/prefix")
            location = "/" + rest
    elif path.startswith("/"):
        location = path
    else:
        return (f"{path!r} is relative, so every pod would write to its own disk; use an "
                f"absolute path on a shared volume or a URL such as s3://bucket/prefix")
    segments = location.rstrip("/").split("/")[1:]
    if any(s in (".", "..") for s in segments):
        return f"{path!r} contains a '.' or '..' segment; write the path it means directly"
    if any(s == "" for s in segments):
        return f"{path!r} contains an empty segment ('//'); remove the extra '/'"
    return None


def job_root(path: str, job_uid: str) -> str:
    """The folder (URL or path) of one job's checkpoints under ``spec.checkpoint.path``."""
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", job_uid or ""):
        raise ValueError(f"job uid {job_uid!r} cannot name a folder")
    return f"{path.rstrip('/')}/{job_uid}"
