"""The operator caps glibc's malloc arenas before its threads start (operator/memory.py):
at 2,000 nodes its peak resident size went from 318 to 214 MiB (bench_operator_replan.py)."""
import subprocess
import sys

import pytest

pytest.importorskip("kopf")  # the operator extra

# Eight threads allocate at once, then glibc's malloc_info lists its arenas (one <heap>
# each). The images and this machine run glibc (Debian).
THREADS = """
import ctypes, sys, tempfile, threading
from lazarus_operator.memory import limit_malloc_arenas
if sys.argv[1] == "capped":
    assert limit_malloc_arenas()
start = threading.Barrier(8)
def work():
    start.wait()
    for _ in range(2000):
        held = [bytearray(20_000) for _ in range(8)]
        del held
threads = [threading.Thread(target=work) for _ in range(8)]
for t in threads: t.start()
for t in threads: t.join()
libc = ctypes.CDLL(None)
libc.fopen.restype = ctypes.c_void_p
with tempfile.NamedTemporaryFile("r") as out:
    f = libc.fopen(out.name.encode(), b"w")
    libc.malloc_info(0, ctypes.c_void_p(f))
    libc.fclose(ctypes.c_void_p(f))
    print(out.read().count("<heap nr="))
"""


def arenas(mode: str) -> int:
    run = subprocess.run([sys.executable, "-c", THREADS, mode], capture_output=True,
                         text=True, timeout=60, check=True)
    return int(run.stdout)


def test_threads_that_allocate_at_once_share_two_malloc_arenas():
    assert arenas("capped") <= 2
    assert arenas("uncapped") > 2  # what the cap prevents (up to eight per core)
