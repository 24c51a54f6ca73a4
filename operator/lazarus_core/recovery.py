"""Recovery probability: the chance the whole model survives k random node failures.

The model is lost when some expert of some layer loses every replica, i.e. when the failed
set F contains that expert's node set. Only the minimal node sets matter (a superset fails
only after its subset has), and under MRO there are few of them.

Exact answers come from inclusion-exclusion over the minimal sets whose union fits in k
nodes, or from enumerating every failed set while C(N, k) is small. When neither is cheap
the answer is a Monte Carlo estimate with a 95% confidence half-width.
"""
from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import combinations

import numpy as np

from .plan import replica_counts

Placement = list[list[int]]

_INCLUSION_EXCLUSION_BUDGET = 2_000_000  # set unions formed before giving up on exactness
_ENUMERATION_LIMIT = 200_000  # failed sets enumerated before sampling instead
_SAMPLES = 20_000


@dataclass(frozen=True)
class Recovery:
    probability: float
    exact: bool
    half_width: float = 0.0  # 95% confidence half-width when not exact


def presence(layers: Iterable[Placement]) -> np.ndarray:
    """[(layer, expert), node]: does the node hold a replica of it."""
    return np.concatenate([replica_counts(placement).T > 0 for placement in layers])


def cube_presence(cube: np.ndarray) -> np.ndarray:
    """``presence`` from a [layer, node, expert] count cube (``Plan.count_cube``): a plan
    already has it, and converting 4,096 GPUs' slots back from tuples took a fifth of
    `lazarus plan`."""
    return (cube > 0).transpose(0, 2, 1).reshape(-1, cube.shape[1])


def minimal_masks(present: np.ndarray, max_size: int | None = None) -> list[int]:
    """``minimal_sets`` of the node sets of a ``presence`` matrix, at once."""
    if max_size is not None:
        present = present[present.sum(axis=1) <= max_size]
    return masks_of(minimal_rows(present))


def minimal_rows(present: np.ndarray) -> np.ndarray:
    """The distinct non-empty rows of a boolean [set, node] matrix that contain no other,
    smallest first."""
    present = present[present.any(axis=1)]
    if not len(present):
        return present
    # Distinct rows: sorted on their 64-bit words, far cheaper than by column, and than
    # ``np.unique`` of each row as one opaque value (a re-plan at 1,024 GPUs: 9,600 rows of
    # 128 nodes, 1 ms against 2). The sort is stable: the first of each run is the row's
    # first occurrence.
    words = _words(present)
    order = np.lexsort(words.T)
    runs = np.ones(len(order), dtype=bool)
    runs[1:] = (words[order[1:]] != words[order[:-1]]).any(axis=1)
    rows = present[np.sort(order[runs])]
    sizes = rows.sum(axis=1)
    kept = np.zeros((0, present.shape[1]), dtype=bool)
    # Sizes as Python ints: a first plain ``np.unique`` in a process imports numpy.ma (16
    # ms of `lazarus plan`).
    for size in sorted(set(sizes.tolist())):
        same = rows[sizes == size]
        if len(kept):
            inside = same.astype(np.int32) @ kept.T.astype(np.int32) == kept.sum(axis=1)
            same = same[~inside.any(axis=1)]
        kept = np.concatenate((kept, same))
    return kept


def _words(present: np.ndarray) -> np.ndarray:
    """[row, word]: each row of a boolean [row, node] matrix as 64-bit words, bit i of
    word j being node 64 j + i."""
    packed = np.packbits(present, axis=1, bitorder="little")
    words = np.zeros((len(packed), -(-packed.shape[1] // 8) * 8), dtype=np.uint8)
    words[:, :packed.shape[1]] = packed
    return words.view("<u8")


def masks_of(present: np.ndarray) -> list[int]:
    """One bitmask per row of a boolean [row, node] matrix (bit i: node i)."""
    # As 64-bit words, joined in Python only where a mask is wider: a re-plan at 1,024
    # GPUs makes 15,000 masks, and bytes converted one row at a time took 4 ms.
    columns = [c.tolist() for c in _words(present).T]
    if not columns:
        return [0] * len(present)
    masks = columns[-1]
    for column in reversed(columns[:-1]):
        masks = [high << 64 | low for high, low in zip(masks, column)]
    return masks


def minimal_sets(masks: Iterable[int], max_size: int | None = None) -> list[int]:
    """The distinct node sets that contain no other one, smallest first."""
    unique = sorted(set(masks), key=lambda m: (m.bit_count(), m))
    kept: list[int] = []
    for m in unique:
        if max_size is not None and m.bit_count() > max_size:
            break
        if not any(k & m == k for k in kept):
            kept.append(m)
    return kept


def recovery_probability(layers: Sequence[Placement], k: int, seed: int = 0) -> Recovery:
    """P(every expert of every layer keeps a replica) when k of the nodes fail at random."""
    n = len(layers[0])
    if not 0 <= k <= n:
        raise ValueError(f"failures: k must be in 0..{n}, got {k}")
    return _recovery_from_sets(minimal_masks(presence(layers), max_size=k), n, k, seed)


def recovery_curve(present: np.ndarray, max_failures: int,
                   exact_only: bool = False, budget: int | None = None) -> list[Recovery]:
    """Recovery for k = 1..max_failures, sharing the work across k, of the node sets of a
    ``presence`` matrix.

    With ``exact_only`` the curve stops before the first k that has no exact answer within
    ``budget`` set unions; otherwise such k fall back to enumeration or sampling.
    """
    n = present.shape[1]
    max_failures = min(max_failures, n)
    sets = minimal_masks(present, max_size=max_failures)
    curve = []
    for k in range(1, max_failures + 1):
        r = _recovery_from_sets([s for s in sets if s.bit_count() <= k], n, k, 0,
                                exact_only, budget)
        if r is None:
            break
        curve.append(r)
    return curve


def fatal_counts(masks: Iterable[int], n: int, max_failures: int,
                 budget: int = _INCLUSION_EXCLUSION_BUDGET) -> list[int]:
    """How many k-node failure sets are fatal, for k = 1..max_failures, counted exactly.

    ``masks`` are node sets (bitmasks), one per (layer, expert). On up to ``BITMAP_NODES``
    nodes every failure set is a bit of one integer, so the count is exact and cheap;
    beyond, inclusion-exclusion stops before the first k it cannot finish within ``budget``
    set unions, and the list is shorter.
    """
    return list(_fatal_counts(frozenset(masks), n, min(max_failures, n), budget))


# The solver scores the same structures many times over (every option of a plan is scored
# against the same few cores; a search revisits its start); each count is a pure function
# of the node sets.
@functools.lru_cache(maxsize=4096)
def _fatal_counts(masks: frozenset[int], n: int, max_failures: int,
                  budget: int) -> tuple[int, ...]:
    if n <= BITMAP_NODES:
        table = _SupersetTable.of(n)
        fatal = 0
        for m in masks:
            fatal |= table.supersets(m)
        return tuple((fatal & table.of_size[k]).bit_count() for k in range(1, max_failures + 1))
    sets = minimal_sets(masks, max_size=max_failures)
    # The unions within max_failures nodes hold those within any fewer (a subfamily's
    # union only grows as sets join it), and cost at least as much to form: when they fit
    # the budget, one pass counts every k. Else each k within the budget is counted alone.
    every = _union_histogram(sets, max_failures, budget)
    counts = []
    for k in range(1, max_failures + 1 if every is not None else max_failures):
        histogram = every if every is not None else _union_histogram(
            [s for s in sets if s.bit_count() <= k], k, budget)
        if histogram is None:
            break
        counts.append(sum(sign * math.comb(n - u, k - u)
                          for u, sign in histogram.items() if u <= k))
    return tuple(counts)


# Up to this many nodes a set of failure sets is one integer of 2^n bits (4096 for 12).
BITMAP_NODES = 12


class _SupersetTable:
    """For n nodes: each node set's supersets as a bitmap over all 2^n failure sets."""

    _cache: dict[int, "_SupersetTable"] = {}

    def __init__(self, n: int):
        self.n = n
        self.of_size = [0] * (n + 1)
        for f in range(1 << n):
            self.of_size[f.bit_count()] |= 1 << f
        self._supersets: dict[int, int] = {}

    @classmethod
    def of(cls, n: int) -> "_SupersetTable":
        if n not in cls._cache:
            cls._cache[n] = cls(n)
        return cls._cache[n]

    def supersets(self, mask: int) -> int:
        bits = self._supersets.get(mask)
        if bits is None:
            # Supersets of mask = mask | every subset of its complement.
            rest = ((1 << self.n) - 1) & ~mask
            bits, sub = 0, rest
            while True:
                bits |= 1 << (mask | sub)
                if not sub:
                    break
                sub = (sub - 1) & rest
            self._supersets[mask] = bits
        return bits


def recovery_table(present: np.ndarray, max_failures: int) -> dict[str, float]:
    """Model-level recovery probability for k = 1..max_failures, keyed by str(k), of the
    node sets of a ``presence`` matrix."""
    return {str(k): r.probability
            for k, r in enumerate(recovery_curve(present, max_failures), start=1)}


def _recovery_from_sets(sets: list[int], n: int, k: int, seed: int, exact_only: bool = False,
                        budget: int | None = None) -> Recovery | None:
    if not sets:
        return Recovery(1.0, True)
    total = math.comb(n, k)
    histogram = _union_histogram(sets, k, _INCLUSION_EXCLUSION_BUDGET if budget is None else budget)
    if histogram is not None:
        failing = sum(sign * math.comb(n - u, k - u) for u, sign in histogram.items())
        return Recovery(1.0 - failing / total, True)
    if total <= _ENUMERATION_LIMIT:
        return Recovery(1.0 - _count_by_enumeration(sets, n, k) / total, True)
    return None if exact_only else _monte_carlo(sets, n, k, seed)


def _union_histogram(sets: list[int], k: int, budget: int) -> dict[int, int] | None:
    """Inclusion-exclusion terms by union size: {u: Σ (-1)^(|T|+1) over subfamilies T
    whose union has u ≤ k nodes}. Then |{F : |F| = k, F ⊇ some set}| = Σ_u h[u]·C(n-u, k-u).
    None when more than ``budget`` unions would have to be formed."""
    histogram: dict[int, int] = {}
    work = 0
    stack = [(i, sets[i], 1) for i in range(len(sets))]
    while stack:
        i, union, size = stack.pop()
        work += len(sets) - i
        if work > budget:
            return None
        u = union.bit_count()
        histogram[u] = histogram.get(u, 0) + (1 if size % 2 else -1)
        for j in range(i + 1, len(sets)):
            merged = union | sets[j]
            if merged.bit_count() <= k:
                stack.append((j, merged, size + 1))
    return histogram


def _count_by_enumeration(sets: list[int], n: int, k: int) -> int:
    failing = 0
    for combo in combinations(range(n), k):
        f = 0
        for i in combo:
            f |= 1 << i
        if any(s & f == s for s in sets):
            failing += 1
    return failing


def _monte_carlo(sets: list[int], n: int, k: int, seed: int) -> Recovery:
    rng = np.random.default_rng(seed)
    member = np.array([[(s >> i) & 1 for i in range(n)] for s in sets], dtype=np.float32)
    # Random k-subsets: the k smallest of n uniform keys per sample.
    keys = rng.random((_SAMPLES, n))
    failed = np.zeros((_SAMPLES, n), dtype=np.float32)
    np.put_along_axis(failed, np.argpartition(keys, k - 1, axis=1)[:, :k], 1.0, axis=1)
    alive_replicas = (1.0 - failed) @ member.T  # samples x sets
    survived = (alive_replicas > 0).all(axis=1)
    p = float(survived.mean())
    return Recovery(p, False, 1.96 * math.sqrt(max(p * (1 - p), 1e-12) / _SAMPLES))


def zone_survival(present: np.ndarray, zone_of: Sequence[str]) -> dict[str, bool]:
    """For each zone: does every expert keep a replica when the whole zone is lost?
    (``present``: a ``presence`` matrix.)"""
    sets = minimal_masks(present)
    result = {}
    for zone in sorted(set(zone_of)):
        zone_mask = sum(1 << i for i, z in enumerate(zone_of) if z == zone)
        result[zone] = not any(s & zone_mask == s for s in sets)
    return result
