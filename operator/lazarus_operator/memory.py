"""Keep the operator's resident memory close to what it holds.

glibc's malloc gives threads that allocate at the same time arenas of their own (up to
eight per core), and memory freed in an arena stays there for that arena's next use. The
operator's threads (kopf's event loop, the pod fan-out and annotation pools, the Kubernetes
client's) each decode large API responses at some point, so every arena grows to the
largest list it ever decoded, and the process's resident size is the sum of those peaks.
Two arenas are plenty for a process whose Python code runs one thread at a time.
"""
from __future__ import annotations

import ctypes
import logging

log = logging.getLogger(__name__)

# mallopt's parameter for the most arenas (glibc's malloc.h).
_M_ARENA_MAX = -8
ARENAS = 2


def limit_malloc_arenas(arenas: int = ARENAS) -> bool:
    """Cap glibc's malloc arenas; call before the threads start. False where the C library
    is not glibc (musl has no arenas to cap)."""
    try:
        libc = ctypes.CDLL(None)
        return libc.mallopt(_M_ARENA_MAX, arenas) == 1
    except (OSError, AttributeError):
        log.debug("no mallopt in this C library: malloc arenas left as they are")
        return False
