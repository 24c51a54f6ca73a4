"""The processes that plan set glibc's malloc (lazarus_core/malloc.py): the operator caps its
arenas before its threads start (at 2,000 nodes its peak resident size went from 318 to
214 MiB, bench_operator_replan.py), and the operator and `lazarus` keep a plan's
temporaries on a heap that stays mapped (a 1,024-GPU plan faulted 7,800 pages in)."""
import subprocess
import sys

# Eight threads allocate at once, then glibc's malloc_info lists its arenas (one <heap>
# each). The images and this machine run glibc (Debian).
THREADS = """
import ctypes, sys, tempfile, threading
from lazarus_core.malloc import limit_malloc_arenas
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

# A plan's pattern: a few blocks of 2 MiB made, written and freed, over and over; the page
# faults of the last 40 rounds (the first ones map the heap).
ROUNDS = """
import resource, sys
from lazarus_core.malloc import keep_plan_heap
if sys.argv[1] == "kept":
    assert keep_plan_heap()
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for i in range(50):
    if i == 10:
        start = faults()
    held = [bytearray(2 << 20) for _ in range(4)]
    del held
print(faults() - start)
"""


def run(script: str, mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", script, mode], capture_output=True,
                         text=True, timeout=60, check=True)
    return int(out.stdout)


def test_threads_that_allocate_at_once_share_two_malloc_arenas():
    assert run(THREADS, "capped") <= 2
    assert run(THREADS, "uncapped") > 2  # what the cap prevents (up to eight per core)


def test_a_plans_temporaries_come_from_a_heap_that_stays_mapped():
    # 40 rounds of 8 MiB are 80,000 pages: glibc's defaults fault most of them in again
    # (the heap's free top goes back to the OS past twice the largest block freed).
    assert run(ROUNDS, "kept") < 100
    assert run(ROUNDS, "default") > 10_000
