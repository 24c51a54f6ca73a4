"""Local search on recovery: replica swaps that leave the model fewer fatal failure sets.

MRO's construction is exact when every expert fits on one node, and a heuristic when
experts outnumber a node's slots. This search starts from a placement and swaps two
replicas of one layer (on two nodes) whenever that makes the failure sets the model cannot
survive fewer, counted exactly and compared from one failed node upwards: first fewer
fatal single nodes, then fewer fatal pairs, and so on. That is the order in which expected
survival ranks placements when node failures are independent and rare. A swap is kept only
if recovery also stays at or above ``floor`` at every failure count, so the result is never
below its start nor below the baselines the caller names.

``improve`` (for up to ``recovery.BITMAP_NODES`` nodes, where counting is cheap) tries every
swap that changes some expert's node set, pass after pass, until none helps;
``tests/unit/test_exhaustive_placement.py`` checks that this reaches the exhaustive optimum
on every small instance. ``improve_anchors`` (for more nodes) moves single anchors between
the cores already in use instead (``anchors.py``): only the experts anchored on cores small
enough to be fatal at the counts scored can matter there.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from .anchors import LayerAnchors, nodes_of
from .recovery import fatal_counts

Placement = list[list[int]]

# Swaps or anchor moves one search may try (a pass over every swap of the paper's testbed is
# about 1,800).
MAX_EVALUATIONS = 20_000
# Set unions one count may form beyond BITMAP_NODES nodes (see recovery.fatal_counts).
SCORING_BUDGET = 30_000


def improve(layers: Sequence[Placement], max_failures: int,
            floor: Sequence[int] | None = None) -> list[Placement]:
    """``layers`` with replicas swapped until no swap lowers the fatal counts (a copy).
    Every swap is tried: meant for up to ``recovery.BITMAP_NODES`` nodes.

    ``floor`` caps the fatal counts for k = 1..max_failures that any accepted swap may
    reach (the baselines' counts, say); the start must respect it.
    """
    search = _Search([[list(s) for s in p] for p in layers], max_failures, floor)
    search.run(MAX_EVALUATIONS)
    return search.layers


def improve_anchors(anchors: LayerAnchors, slots: Sequence[int], max_failures: int,
                    floor: Sequence[int] | None = None) -> LayerAnchors:
    """One layer's anchors after moving anchors between cores (for many nodes, where
    swapping every pair of replicas would cost too much)."""
    return _AnchorSearch(anchors, slots, max_failures, floor).run(MAX_EVALUATIONS)


def _masks(layers: Sequence[Placement]) -> dict[tuple[int, int], int]:
    masks: dict[tuple[int, int], int] = {}
    for li, placement in enumerate(layers):
        for node, experts in enumerate(placement):
            for e in experts:
                masks[li, e] = masks.get((li, e), 0) | (1 << node)
    return masks


class _Search:
    def __init__(self, layers: list[Placement], max_failures: int, floor):
        self.layers = layers
        self.n = len(layers[0])
        self.k = min(max_failures, self.n - 1)
        self.floor = tuple(floor[:self.k]) if floor is not None else None
        self.masks = _masks(layers)
        self.uses = Counter(self.masks.values())
        # copies[li][node][e]: replicas of e on that node
        self.copies = [[Counter(experts) for experts in placement] for placement in layers]
        self.key = self._key()
        self.critical = _critical(self.uses)
        self.evaluations = 0

    def _key(self) -> tuple[int, ...]:
        return tuple(fatal_counts(self.uses.keys(), self.n, self.k, SCORING_BUDGET))

    def _acceptable(self, key: tuple[int, ...]) -> bool:
        common = min(len(key), len(self.key))
        if common == 0 or key[:common] >= self.key[:common]:
            return False
        return self.floor is None or all(a <= b for a, b in zip(key, self.floor))

    def run(self, budget: int) -> None:
        improved = True
        while improved and self.evaluations < budget:
            if self._stuck():
                return
            improved = False
            for li, a, x, b, y in self._moves():
                if self.evaluations >= budget:
                    return
                if self._try(li, a, x, b, y):
                    improved = True

    def _moves(self):
        """(layer, node a, expert x, node b, expert y): swap one x on a with one y on b."""
        nodes = range(self.n)
        for li in range(len(self.layers)):
            movable = [sorted(self.copies[li][a]) for a in nodes]
            for a in nodes:
                for x in movable[a]:
                    for b in nodes:
                        if b == a:
                            continue
                        for y in sorted(self.copies[li][b]):
                            if y != x and self.copies[li][a][x] and self.copies[li][b][y]:
                                yield li, a, x, b, y

    def _new_mask(self, li, e, leaves, joins) -> int:
        m = self.masks[li, e]
        if self.copies[li][leaves][e] == 1:
            m &= ~(1 << leaves)
        return m | (1 << joins)

    def _try(self, li, a, x, b, y) -> bool:
        old_x, old_y = self.masks[li, x], self.masks[li, y]
        new_x, new_y = self._new_mask(li, x, a, b), self._new_mask(li, y, b, a)
        if new_x == old_x and new_y == old_y:
            return False
        self.evaluations += 1
        if not self._may_lower(old_x, new_x, old_y, new_y):
            return False
        self._swap_masks(((li, x), old_x, new_x), ((li, y), old_y, new_y))
        key = self._key()
        if not self._acceptable(key):
            self._swap_masks(((li, x), new_x, old_x), ((li, y), new_y, old_y))
            return False
        self.key = key
        self.critical = _critical(self.uses)
        placement, copies = self.layers[li], self.copies[li]
        placement[a][placement[a].index(x)] = y
        placement[b][placement[b].index(y)] = x
        copies[a][x] -= 1
        copies[a][y] += 1
        copies[b][y] -= 1
        copies[b][x] += 1
        for node, e in ((a, x), (b, y)):
            if not copies[node][e]:
                del copies[node][e]
        return True

    def _stuck(self) -> bool:
        """Whether no swap can lower a count, now or after (none would be kept, so nothing
        changes): no ``critical`` mask (``_may_lower``). At 12 nodes x 32 slots, E = 64,
        each of the two minimal masks holds several experts, and the search ended after
        20,000 swaps counted, keeping none."""
        return not self.critical

    def _may_lower(self, old_x: int, new_x: int, old_y: int, new_y: int) -> bool:
        """Whether a swap that changes these masks can leave fewer fatal sets, told without
        counting them: only where a ``critical`` mask (one that no other mask lies inside,
        and one expert's alone) changes. A fatal set holds some mask. One that goes and is
        not minimal holds another that stays, or that holds one that stays (two go at
        most); where both swapped experts had the same mask, their new ones lie inside it.
        So every fatal set stays fatal. Skipped swaps still count against the budget, so
        the search ends where counting every one would."""
        return (old_x != new_x and old_x in self.critical) or (
            old_y != new_y and old_y in self.critical)

    def _swap_masks(self, *changes) -> None:
        for key, old, new in changes:
            self.masks[key] = new
            self.uses[old] -= 1
            if not self.uses[old]:
                del self.uses[old]
            self.uses[new] += 1


def _critical(uses: Counter) -> set[int]:
    """The masks one expert's alone with no other mask inside them: the only ones whose
    change can lower a fatal count (``_Search._may_lower``). Kept between kept swaps
    (a swap tried and refused leaves ``uses`` as it was)."""
    return {m for m, count in uses.items()
            if count == 1 and not any(o != m and o & m == o for o in uses)}


class _AnchorSearch:
    """Beyond BITMAP_NODES nodes: re-anchor an expert on another core that has room on every
    node when the cores' fatal counts drop, or stay equal while the experts gather on fewer,
    fuller cores (which can free a whole core a few moves later)."""

    def __init__(self, anchors: LayerAnchors, slots: Sequence[int], max_failures: int, floor):
        self.replicas = anchors.replicas
        self.cores = list(anchors.cores)
        self.n = len(slots)
        self.k = min(max_failures, self.n - 1)
        self.floor = tuple(floor[:self.k]) if floor is not None else None
        self.room = list(slots)
        for c in self.cores:
            for i in nodes_of(c):
                self.room[i] -= 1
        self.users = Counter(c for c in self.cores if c)
        self.key = self._key()

    def _key(self):
        counts = tuple(fatal_counts(self.users.keys(), self.n, self.k, SCORING_BUDGET))
        return counts, -sum(u * u for u in self.users.values())

    def _better(self, key) -> bool:
        counts, spread = key
        common = min(len(counts), len(self.key[0]))
        if counts[:common] != self.key[0][:common]:
            return counts[:common] < self.key[0][:common] and (
                self.floor is None or all(a <= b for a, b in zip(counts, self.floor)))
        return common > 0 and spread < self.key[1]

    def _move(self, e: int, new: int) -> None:
        old = self.cores[e]
        for i in nodes_of(old):
            self.room[i] += 1
        for i in nodes_of(new):
            self.room[i] -= 1
        self.users[old] -= 1
        if not self.users[old]:
            del self.users[old]
        self.users[new] += 1
        self.cores[e] = new

    def run(self, budget: int) -> LayerAnchors:
        evaluations, improved = 0, True
        fragile = [e for e in range(len(self.cores))
                   if self.cores[e] and self.cores[e].bit_count() <= self.k]
        while improved and evaluations < budget:
            improved = False
            for e in fragile:
                for core in sorted(self.users, key=lambda m: (m.bit_count(), m)):
                    old = self.cores[e]
                    if (core == old or core.bit_count() > min(self.replicas[e], self.n)
                            or any(self.room[i] < 1 for i in nodes_of(core & ~old))):
                        continue
                    evaluations += 1
                    self._move(e, core)
                    key = self._key()
                    if self._better(key):
                        self.key, improved = key, True
                    else:
                        self._move(e, old)
                if evaluations >= budget:
                    break
        return LayerAnchors(self.replicas, tuple(self.cores))

