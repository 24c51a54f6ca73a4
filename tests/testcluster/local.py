"""The local kwok cluster of hack/cluster.sh, driven from Python."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CLUSTER_SCRIPT = REPO / "hack" / "cluster.sh"
# A cold build of the control plane takes 10-25 minutes on 2 cores; a warm start seconds.
UP_TIMEOUT_S = 45 * 60
DOWN_TIMEOUT_S = 120


def _run(command: str, *, name: str | None, timeout: float,
         heartbeat_factor: int = 1) -> subprocess.CompletedProcess:
    env = dict(os.environ, LAZARUS_HEARTBEAT_FACTOR=str(heartbeat_factor))
    if name:
        env["LAZARUS_CLUSTER_NAME"] = name
    try:
        return subprocess.run(
            [str(CLUSTER_SCRIPT), command], env=env, capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired as e:
        raise RuntimeError(f"hack/cluster.sh {command} did not finish in {timeout:g} s:\n{e.stderr}") from None


def up(name: str | None = None, heartbeat_factor: int = 1) -> tuple[Path, str]:
    """Start (or reuse) the local cluster. Returns its kubeconfig and the script's log.
    ``heartbeat_factor``: hack/cluster.sh's LAZARUS_HEARTBEAT_FACTOR (a cluster made with
    another is made again)."""
    result = _run("up", name=name, timeout=UP_TIMEOUT_S, heartbeat_factor=heartbeat_factor)
    if result.returncode != 0:
        raise RuntimeError(f"hack/cluster.sh up failed (exit {result.returncode}):\n{result.stderr}")
    return Path(result.stdout.strip().splitlines()[-1]), result.stderr


def down(name: str | None = None) -> None:
    result = _run("down", name=name, timeout=DOWN_TIMEOUT_S)
    if result.returncode != 0:
        raise RuntimeError(f"hack/cluster.sh down failed (exit {result.returncode}):\n{result.stderr}")


def stop(name: str | None = None) -> None:
    result = _run("stop", name=name, timeout=DOWN_TIMEOUT_S)
    if result.returncode != 0:
        raise RuntimeError(f"hack/cluster.sh stop failed (exit {result.returncode}):\n{result.stderr}")


def is_running(name: str | None = None) -> bool:
    return _run("status", name=name, timeout=30).returncode == 0


def logs_dir(name: str | None = None) -> Path:
    return Path(_run("logs", name=name, timeout=30).stdout.strip())


def tools_path() -> str:
    """The cached tools' directories (kubectl, helm, kwokctl, etcd), PATH-style."""
    return _run("path", name=None, timeout=30).stdout.strip()


def cached_binaries() -> dict[str, int]:
    """Every cached control-plane binary and its modification time (ns), to tell a reuse from a
    rebuild."""
    tools = Path(os.environ.get("LAZARUS_CACHE", Path.home() / ".cache" / "lazarus")) / "tools"
    return {str(p): p.stat().st_mtime_ns for p in tools.glob("*/*") if p.is_file()}
