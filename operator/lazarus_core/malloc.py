"""glibc malloc settings of the processes that plan: the operator and `lazarus` commands.

Both are process-wide, so only the entry points apply them (``lazarus_operator``'s main,
``lazarus_cli``'s main, and the benchmarks, which measure the solver as those run it);
the solver itself never does. Elsewhere than glibc (musl) they are left as they are.

Arenas: glibc gives threads that allocate at the same time arenas of their own (up to
eight per core), and memory freed in an arena stays there for that arena's next use. The
operator's threads (kopf's event loop, the pod fan-out and annotation pools, the
Kubernetes client's) each decode large API responses at some point, so every arena grows
to the largest list it ever decoded, and the process's resident size is the sum of those
peaks. Two arenas are plenty for a process whose Python code runs one thread at a time.

Heap: a plan makes hundreds of numpy temporaries of 0.1-2 MiB (a 1,024-GPU layer set has
240,000 slots). glibc maps blocks over its mmap threshold afresh and unmaps them when
freed (the threshold rises to the largest block freed), and gives the heap's free top
back to the OS past its trim threshold (twice that), so the next plan's temporaries fault
the same pages in again: 7,800 page faults in a 1,024-GPU plan with per-layer loads, a
fifth of its time on a 2-core VM (115-135 ms -> 90-92 ms). Blocks up to 32 MiB come from
the heap, and up to 64 MiB of it stays mapped while free: no faults once warm.
"""
from __future__ import annotations

import ctypes
import logging

log = logging.getLogger(__name__)

# mallopt's parameters (glibc's malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8
ARENAS = 2
MMAP_THRESHOLD = 32 << 20
TRIM_THRESHOLD = 64 << 20


def _mallopt(*settings: tuple[int, int]) -> bool:
    try:
        libc = ctypes.CDLL(None)
        return all(libc.mallopt(param, value) == 1 for param, value in settings)
    except (OSError, AttributeError):
        log.debug("no mallopt in this C library: malloc left as it is")
        return False


def limit_malloc_arenas(arenas: int = ARENAS) -> bool:
    """Cap glibc's malloc arenas; call before the threads start. False where the C library
    is not glibc (musl has no arenas to cap)."""
    return _mallopt((_M_ARENA_MAX, arenas))


def keep_plan_heap() -> bool:
    """Serve a plan's temporaries from a heap that stays mapped (see the module docstring).
    False where the C library is not glibc."""
    return _mallopt((_M_MMAP_THRESHOLD, MMAP_THRESHOLD), (_M_TRIM_THRESHOLD, TRIM_THRESHOLD))
