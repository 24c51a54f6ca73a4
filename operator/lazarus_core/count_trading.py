"""Replica counts traded inside one layer's fill, where swaps alone leave a rank too busy.

The fill (``balance.py``) places a layer's replicas with the counts the allocation gave:
every replica of expert e carries t_e / r_e, and only where replicas sit is searched. On a
few nodes with few slots that is often not enough: the issue-18 example (4 nodes x 3 slots,
4 experts, zipf 0.5) places counts (5, 3, 2, 2) at best 1.11 times the mean with its best
recovery, while counts (3, 3, 4, 2) recover as well and reach 1.045. So here a free replica
may also become a replica of another expert: r_a - 1 for the expert it was, r_b + 1 for the
one it becomes, and every replica of both re-weighed.

What never changes: anchored replicas (and, on a re-plan, the replicas a node keeps) stay
the expert they are, on their node, so every expert's node set still contains its core and
recovery does not drop at any failure count (``anchors.py``). No expert goes below
``min_replicas``, and no rank gets a second replica of an expert it holds (it would carry
that expert's share twice and add nothing).

The search: best improvement over retargeting one free replica and swapping two replicas
between ranks, moves that involve the busiest ranks only (nothing else lowers the busiest),
ranked by the busiest rank's load, then by the sum of squared rank loads (which lets ties
at the top come apart), until no move lowers them or the busiest rank is within ``enough``
of the mean. Where it stops short, it starts again from each of the ``KICKS`` least bad
moves and keeps what ends best (a single move often has to make the busiest rank worse
before a second one brings it below where it was).
"""
from __future__ import annotations

import hashlib
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from functools import cached_property

import numpy as np

# Work one trade may do, in rank loads (a retarget costs a row of them, a swap one: the
# units it was measured in, though a retarget is now scored from the ranks it changes),
# over all its climbs, and all the layers of one fill together (each an equal share,
# at most the first): a re-plan after losing half of 1,024 GPUs traded 58 layers, each to
# its own bound, in 16 s (7 s shared at 8 million). Small clusters use a few percent of
# either (the balance sweep's largest trade: 0.6 million). A fresh fill trades its layer
# furthest over first with a lone layer's budget, and the layers that take its placement
# do not trade (``balance._borrow_best``). And rows computed at once (memory).
MAX_EVALUATIONS = 2_000_000
FILL_EVALUATIONS = 8_000_000
CHUNK = 1 << 18
# Moves x ranks up to which a retarget computes every full row at once: weighing rows from
# the ranks they change (``_PairRows``) costs some fifty numpy calls to set up, and a small
# cluster's trade makes thousands of calls (10 ranks: its re-plans in half the time). A
# 256-GPU re-plan's 260 trades take as long either way with this bound, 8% longer with
# every row at once up to ``CHUNK``.
WHOLE_ROWS = 1 << 14
# Ranks whose slots are tried in each round, busiest first.
TOP_RANKS = 4
# Restarts from the least bad moves where a climb stops above ``enough``.
KICKS = 8
_EPS = 1e-12
# The trades of the plan or re-plan at work, by their inputs (``remembered``).
_REMEMBERED: ContextVar[dict | None] = ContextVar("trades_remembered", default=None)


@dataclass
class _Layer:
    """One layer's trade: what stays fixed, and the work it has left (``budget``)."""

    rank_of_slot: np.ndarray
    rank_node: np.ndarray
    loads: np.ndarray
    per_slot: np.ndarray  # 1 / slots of each rank
    min_replicas: int
    target: float  # the busiest rank's load per slot that is enough
    budget: int = MAX_EVALUATIONS

    @cached_property
    def positions(self) -> list[np.ndarray]:
        """The slots at each position within their rank (the first of each rank, then the
        second, ...): no two slots of one position share a rank."""
        order = np.argsort(self.rank_of_slot, kind="stable")
        ranks = self.rank_of_slot[order]
        position = np.empty(len(order), dtype=np.int64)
        position[order] = np.arange(len(order)) - np.searchsorted(ranks, ranks)
        return [np.flatnonzero(position == j) for j in range(int(position.max(initial=-1)) + 1)]


def layer_budget(layers: int) -> int:
    """The work one layer's trade may do where ``layers`` layers of a fill trade."""
    return min(MAX_EVALUATIONS, FILL_EVALUATIONS // max(layers, 1))


@contextmanager
def remembered():
    """Within, a trade with the same inputs as an earlier one gives that one's answer
    again (a trade is a function of its inputs alone), until the outermost such block
    ends. A plan's or re-plan's searches fill the same layer around the same anchors
    again and again: a 10-node re-plan repeats a third of its trades, a 256-GPU one a
    quarter."""
    if _REMEMBERED.get() is not None:
        yield
        return
    token = _REMEMBERED.set({})
    try:
        yield
    finally:
        _REMEMBERED.reset(token)


def trade_counts(experts: np.ndarray, rank_of_slot: np.ndarray, rank_node: np.ndarray,
                 home: np.ndarray, loads: np.ndarray, rank_slots: np.ndarray,
                 min_replicas: int, enough: float, budget: int = MAX_EVALUATIONS
                 ) -> np.ndarray:
    """The layer's experts per slot after trading (a copy; the slots keep their ranks), in
    at most ``budget`` rank loads computed.

    ``experts[s]`` is the expert in slot s, on rank ``rank_of_slot[s]`` of node
    ``rank_node[rank]``; ``home[s]`` is the node the replica in slot s must stay on (-1:
    free to move and to become another expert); ``loads[e]`` is t_e; ``rank_slots[k]`` the
    slots of rank k (loads are compared per slot, as the fill does).
    """
    arrays = (np.asarray(experts, dtype=np.int64), np.asarray(rank_of_slot, dtype=np.int64),
              np.asarray(rank_node, dtype=np.int64), np.asarray(home, dtype=np.int64),
              np.asarray(loads, dtype=np.float64), np.asarray(rank_slots, dtype=np.int64))
    memory = _REMEMBERED.get()
    if memory is None:
        return _traded(*arrays, min_replicas, enough, budget)
    digest = hashlib.blake2b(repr((min_replicas, enough, budget, [a.shape for a in arrays]))
                             .encode(), digest_size=16)
    for a in arrays:
        digest.update(np.ascontiguousarray(a).data)
    key = digest.digest()
    if key not in memory:
        memory[key] = _traded(*arrays, min_replicas, enough, budget)
    return memory[key].copy()


def _traded(experts, rank_of_slot, rank_node, home, t, rank_slots, min_replicas, enough,
            budget) -> np.ndarray:
    """``trade_counts``, computed."""
    layer = _Layer(rank_of_slot, rank_node, t, 1.0 / rank_slots.astype(np.float64),
                   min_replicas, enough * t.sum() / rank_slots.sum(), budget)
    x = experts.copy()
    pinned = home.copy()
    best = _climb(layer, x, pinned)
    if best[0][0] > layer.target:
        # Restarts from the least bad moves of where the climb stopped.
        stuck_x, stuck_pinned = best[1], best[2]
        for move in _ranked_moves(layer, stuck_x, stuck_pinned, limit=KICKS):
            x, pinned = stuck_x.copy(), stuck_pinned.copy()
            _apply(move, x, pinned)
            result = _climb(layer, x, pinned)
            if result[0] < best[0]:
                best = result
            if best[0][0] <= layer.target or layer.budget <= 0:
                break
    return best[1]


def _climb(layer: _Layer, x: np.ndarray, pinned: np.ndarray):
    """Best improvement from (x, pinned), in place: ((busiest, sum of squares), x, pinned)."""
    score = _score(_loads(layer, x))
    while score[0] > layer.target and layer.budget > 0:
        moves = _ranked_moves(layer, x, pinned, limit=1)
        if not moves or not _better(moves[0][0], score):
            break
        score = moves[0][0]
        _apply(moves[0], x, pinned)
    return score, x, pinned


def _better(a, b) -> bool:
    return a[0] < b[0] - _EPS or (a[0] <= b[0] + _EPS and a[1] < b[1] - _EPS)


def _score(load: np.ndarray) -> tuple[float, float]:
    return float(load.max()), float(load @ load)


def _loads(layer: _Layer, x: np.ndarray) -> np.ndarray:
    r = np.bincount(x, minlength=len(layer.loads))
    w = np.divide(layer.loads, r, out=np.zeros_like(layer.loads), where=r > 0)
    return np.bincount(layer.rank_of_slot, weights=w[x],
                       minlength=len(layer.rank_node)) * layer.per_slot


def _ranked_moves(layer: _Layer, x: np.ndarray, pinned: np.ndarray, limit: int):
    """The ``limit`` best moves from (x, pinned), best first: (score, kind, p, q), kind 0
    retargets slot p to expert q, kind 1 swaps slots p and q."""
    num_ranks, num_experts = len(layer.rank_node), len(layer.loads)
    r = np.bincount(x, minlength=num_experts)
    # [rank, expert] counts, as 16-bit integers: a 1,024-rank layer's are 262,144, and 64-bit
    # ones (``np.bincount``'s) are fresh memory eight times the size on every call.
    n = np.zeros((num_ranks, num_experts), dtype=np.uint16)
    for slots in layer.positions:  # no rank twice in one: plain adds (np.add.at: 4x slower)
        n[layer.rank_of_slot[slots], x[slots]] += 1
    w = np.divide(layer.loads, r, out=np.zeros_like(layer.loads), where=r > 0)
    load = (n @ w) * layer.per_slot
    busy = np.argsort(-load, kind="stable")[:TOP_RANKS]
    is_busy = _marked(busy, num_ranks)
    found = []
    for kind, (top, squares, p, q) in enumerate((
            _retargets(layer, x, pinned, n, r, w, load, busy, is_busy, limit),
            _swaps(layer, x, pinned, n, w, load, busy, is_busy))):
        if not len(p):
            continue
        order = np.lexsort((squares, top))[:limit]
        found += [((float(top[i]), float(squares[i])), kind, int(p[i]), int(q[i]))
                  for i in order]
    found.sort(key=lambda m: m[0])
    return found[:limit]


def _apply(move, x: np.ndarray, pinned: np.ndarray) -> None:
    _, kind, p, q = move
    if kind == 0:
        x[p] = q
    else:
        x[p], x[q] = x[q], x[p]
        pinned[p], pinned[q] = pinned[q], pinned[p]


def _retargets(layer, x, pinned, n, r, w, load, busy, is_busy, limit):
    """Free replicas that become another expert: on a busy rank (it sheds its weight), or
    anywhere when the new expert is on a busy rank (its replicas there get lighter). As
    (busiest rank after, sum of squares after, slot, expert) arrays, the sum of squares
    only for the moves that can be among the ``limit`` best (+inf for the others).

    Every rank that holds either expert changes, so a move is charged a row of rank loads
    to the budget. Moves that turn the same expert a into the same b change every rank but
    their own alike, so the busiest rank is computed once per (a, b) row: the largest of
    the row without the move's own rank, and that rank's load after.
    """
    none = np.zeros(0), np.zeros(0), np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    free = np.flatnonzero((pinned < 0) & (r[x] > layer.min_replicas))
    if not len(free):
        return none
    # One source per distinct (rank, expert): its slots are interchangeable.
    _, first = np.unique(layer.rank_of_slot[free] * len(w) + x[free], return_index=True)
    slots = free[first]
    wanted = np.flatnonzero(n[busy].sum(axis=0) > 0)
    # A slot on a busy rank may become any expert, any other one an expert a busy rank
    # holds: slot by slot, targets in id order.
    on_busy = is_busy[layer.rank_of_slot[slots]]
    sizes = np.where(on_busy, len(w), len(wanted))
    p = np.repeat(slots, sizes)
    nth = np.arange(len(p)) - np.repeat(np.cumsum(sizes) - sizes, sizes)
    q = np.where(np.repeat(on_busy, sizes), nth,
                 wanted[np.minimum(nth, len(wanted) - 1)] if len(wanted) else nth)
    k, a = layer.rank_of_slot[p], x[p]
    ok = (a != q) & (n[k, q] == 0)
    p, q, k, a = p[ok], q[ok], k[ok], a[ok]
    num_ranks = len(load)
    affordable = max(layer.budget // num_ranks, 0)
    p, q, k, a = p[:affordable], q[:affordable], k[:affordable], a[:affordable]
    if not len(p):
        return none
    layer.budget -= len(p) * num_ranks
    wa = layer.loads[a] / (r[a] - 1)
    wb = layer.loads[q] / (r[q] + 1)
    own = (wb - wa) * layer.per_slot[k]  # the move's own rank gains b and sheds a
    if len(p) * num_ranks <= WHOLE_ROWS:
        # The same additions as ``_PairRows``' and the near rows' below, so the same
        # busiest ranks and sums (and a sum for every move).
        after = _rows_after(layer, n, r, w, load, a, q)
        after[np.arange(len(p)), k] += own
        return after.max(axis=1), (after * after).sum(axis=1), p, q
    pairs, row = np.unique(a * len(w) + q, return_inverse=True)
    rows = _PairRows(layer, x, n, r, w, load, pairs // len(w), pairs % len(w))
    after_own = rows.at(row, k)
    top = np.maximum(rows.without(row, k), after_own + own)
    # Only moves that can be among the ``limit`` best need their sum of squares (the tie
    # break after the busiest rank), each from its full row. Which those are is told by
    # the sums from the changed ranks alone, close to the full row's (another order of
    # additions): every move that could rank within ``slack`` of them is summed in full.
    squares = np.full(len(p), np.inf)
    cut = np.partition(top, limit - 1)[limit - 1] if len(p) > limit else np.inf
    near = np.flatnonzero(top <= cut)
    base = float(load @ load)
    close = (base + rows.squares[row[near]] - after_own[near] ** 2
             + (after_own[near] + own[near]) ** 2)
    if len(near) > limit:
        last = np.lexsort((close, top[near]))[limit - 1]
        slack = 1e-9 * max(base, float(close.max()))
        near = near[(top[near] < top[near][last])
                    | (close <= close[last] + 2 * slack)]
    chunk = max(1, CHUNK // num_ranks)
    for start in range(0, len(near), chunk):
        some = near[start:start + chunk]
        after = _rows_after(layer, n, r, w, load, a[some], q[some])
        after[np.arange(len(after)), k[some]] += own[some]
        squares[some] = (after * after).sum(axis=1)
    return top, squares, p, q


class _PairRows:
    """The rows of rank loads per slot after a replica of ``a[i]`` becomes one of
    ``b[i]`` (``_rows_after``), from the ranks they change: those holding a or b (a
    layer's expert is on a few of its thousand ranks); every other rank keeps its load, so
    only the busiest of those is needed. The same additions as the full row's, so the
    same values.

    Pairs come sorted by a, and a hot a is on hundreds of ranks, shared by every pair of
    that a (zipf 0.8-1.4 at 1,024 GPUs: 500 pairs of 2-8 experts a, 300,000 (pair, rank)
    entries a call). Its ranks that hold no b change alike in every such pair, so they
    are weighed once per a, busiest first; a pair then reads the first two of them that
    hold no b, and weighs only b's ranks itself."""

    def __init__(self, layer, x, n, r, w, load, a, b):
        num_ranks, num_experts = n.shape
        # (expert, rank) where the rank holds the expert, expert by expert, ranks in order.
        held = np.sort(x * num_ranks + layer.rank_of_slot)
        held = held[_run_starts(held)]  # np.unique hashes first: 10x slower here
        by_expert, rank = held // num_ranks, held % num_ranks
        start = np.searchsorted(by_expert, np.arange(num_experts + 1))
        size = np.diff(start)

        def ranks_of(e):
            pair, at = _windows(size[e], start[e])
            return pair, rank[at]

        self.layer, self.n, self.load = layer, n, load
        self.da = layer.loads[a] / (r[a] - 1) - w[a]
        self.db = layer.loads[b] / (r[b] + 1) - w[b]
        self.a, self.b = a, b
        count, per_slot = len(a), layer.per_slot
        # b's ranks, pair by pair (some hold a too): as ``at`` weighs them.
        pb, rb = ranks_of(b)
        vb = self.at(pb, rb)
        both = n[rb, a[pb]] > 0
        # a's ranks once per distinct a, with no b there (n * db adds a zero: the same
        # value), busiest first, the lower rank first among equals.
        first_pair = _run_starts(a)  # pairs come sorted by a
        distinct, which = a[first_pair], np.cumsum(_marked(first_pair, count)) - 1
        qa, ra = ranks_of(distinct)
        va = (n[ra, distinct[qa]] * self.da[first_pair][qa]) * per_slot[ra] + load[ra]
        order = np.lexsort((ra, -va, qa))
        ra_sorted, va_sorted = ra[order], va[order]
        a_start = np.cumsum(size[distinct]) - size[distinct]
        # Each pair's two busiest ranks of a that hold no b: among the first
        # (ranks of b that hold a) + 2 of a's.
        overlap = np.bincount(pb[both], minlength=count)
        pair, at = _windows(np.minimum(overlap + 2, size[a]), a_start[which])
        free = n[ra_sorted[at], b[pair]] == 0
        pair, at = pair[free], at[free]
        first = _run_starts(pair)
        then = first[(first + 1 < len(pair))]
        then = then[pair[then + 1] == pair[then]] + 1
        a1, a2 = np.full(count, -np.inf), np.full(count, -np.inf)
        a1_rank = np.full(count, num_ranks)
        a1[pair[first]], a1_rank[pair[first]] = va_sorted[at[first]], ra_sorted[at[first]]
        a2[pair[then]] = va_sorted[at[then]]
        # The largest, and the rank where it comes first in a row's order (a's ranks, then
        # b's others, each in rank order), and the largest without that one.
        b1 = _segment(np.maximum, vb, pb, count, -np.inf)
        self.largest = np.maximum(a1, b1)
        top = vb == self.largest[pb]
        on_a = np.minimum(np.where(a1 == self.largest, a1_rank, num_ranks),
                          _segment(np.minimum, np.where(top & both, rb, num_ranks), pb,
                                   count, num_ranks))
        a_first = (a1 == self.largest) & (on_a == a1_rank)
        self.top_rank = np.where(on_a < num_ranks, on_a,
                                 _segment(np.minimum, np.where(top & ~both, rb, num_ranks),
                                          pb, count, num_ranks))
        rest = np.where((rb == self.top_rank[pb]) & ~a_first[pb], -np.inf, vb)
        self.second = np.where(a_first, np.maximum(a2, b1),
                               np.maximum(a1, _segment(np.maximum, rest, pb, count,
                                                       -np.inf)))
        # The busiest rank that neither changes: the first of the busiest that holds
        # neither expert; of those that hold no a, the first (ranks of b) + 1 are enough.
        busiest = np.argsort(-load, kind="stable")
        u, t = np.nonzero(n[:, distinct][busiest].T == 0)  # by a, then busiest first
        u_start = np.searchsorted(u, np.arange(len(distinct) + 1))
        pair, at = _windows(np.minimum(size[b] + 1, np.diff(u_start)[which]),
                            u_start[which])
        ranks = busiest[t[at]]
        free = n[ranks, b[pair]] == 0
        first_free = _segment(np.minimum, np.where(free, at, len(t)), pair, count, len(t))
        found = first_free < len(t)
        self.unchanged = np.full(count, -np.inf)
        self.unchanged[found] = load[busiest[t[first_free[found]]]]
        # What each pair changes in the sum of squares of the row, from the ranks it changes:
        # a's with no b (their sum once per a, less the ranks b shares), and b's. (Added in
        # another order than the full row's: these only choose which moves get their full
        # row, with a slack: ``_retargets``.)
        a_squares = np.bincount(qa, weights=va * va - load[ra] ** 2, minlength=len(distinct))
        shared = pb[both]
        va_shared = ((n[rb[both], a[shared]] * self.da[shared]) * per_slot[rb[both]]
                     + load[rb[both]])
        self.squares = (a_squares[which]
                        - np.bincount(shared, weights=va_shared ** 2 - load[rb[both]] ** 2,
                                      minlength=count)
                        + np.bincount(pb, weights=vb * vb - load[rb] ** 2, minlength=count))

    def at(self, i, rank):
        """Pair i's row at ``rank``."""
        a, b, per_slot = self.a[i], self.b[i], self.layer.per_slot[rank]
        return ((self.n[rank, a] * self.da[i] + self.n[rank, b] * self.db[i]) * per_slot
                + self.load[rank])

    def without(self, i, rank):
        """The largest of pair i's row but at ``rank`` (one of those that change)."""
        changed = np.where(rank == self.top_rank[i], self.second[i], self.largest[i])
        return np.maximum(changed, self.unchanged[i])


def _segment(reduce, values: np.ndarray, group: np.ndarray, count: int, empty: float
             ) -> np.ndarray:
    """``reduce`` (np.maximum or np.minimum) of ``values`` per ``group`` (sorted), for each
    of ``count`` groups; ``empty`` where a group has none."""
    out = np.full(count, empty, dtype=np.result_type(values, empty))
    if len(values):
        starts = _run_starts(group)
        out[group[starts]] = reduce.reduceat(values, starts)
    return out


def _run_starts(group: np.ndarray) -> np.ndarray:
    """Where each run of equal values of ``group`` starts."""
    return np.flatnonzero(np.concatenate(([True], group[1:] != group[:-1])))[:len(group)]


def _windows(lengths: np.ndarray, starts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Window i = indexes starts[i] .. starts[i] + lengths[i] - 1, all windows in turn:
    (window, index) arrays."""
    window = np.repeat(np.arange(len(lengths)), lengths)
    return window, (np.arange(len(window)) - np.repeat(np.cumsum(lengths) - lengths, lengths)
                    + np.asarray(starts)[window])


def _rows_after(layer, n, r, w, load, a, b):
    """[move, rank]: every rank's load per slot once a replica of a becomes one of b, but
    for the rank of the replica that changes (it gains b and sheds a: ``own``);
    ``n[rank, e]``: replicas of e on each rank."""
    wa = layer.loads[a] / (r[a] - 1)
    wb = layer.loads[b] / (r[b] + 1)
    # Rows of n.T: a [move, rank] array in row order, so each row is summed alike.
    out = n.T[a] * (wa - w[a])[:, None]
    out += n.T[b] * (wb - w[b])[:, None]
    out *= layer.per_slot
    out += load
    return out


def _swaps(layer, x, pinned, n, w, load, busy, is_busy):
    """Two replicas of different experts on different ranks trade places; a pinned one
    only within its node, and neither lands on a rank that holds its expert already. Only
    two ranks change, so each move is scored from the three busiest ranks and the sum of
    squares as they are."""
    node = layer.rank_node
    src = np.flatnonzero(is_busy[layer.rank_of_slot])
    # Partners: free replicas, and pinned ones at home on a busy rank's node (the others
    # could not land on a busy rank), in slot order as before. (A free replica's -1 looks
    # up the last node, but it is a partner either way.)
    at_busy_node = _marked(node[busy], max(int(node.max()), int(pinned.max())) + 1)
    partners = np.flatnonzero((pinned < 0) | at_busy_node[pinned])
    p = np.repeat(src, len(partners))
    q = np.tile(partners, len(src))
    k1, k2 = layer.rank_of_slot[p], layer.rank_of_slot[q]
    e1, e2 = x[p], x[q]
    ok = (k1 != k2) & (e1 != e2) & (n[k2, e1] == 0) & (n[k1, e2] == 0)
    ok &= ((pinned[p] < 0) | (pinned[p] == node[k2])) & ((pinned[q] < 0) | (pinned[q] == node[k1]))
    p, q, k1, k2, e1, e2 = p[ok], q[ok], k1[ok], k2[ok], e1[ok], e2[ok]
    layer.budget -= len(p)
    d = w[e1] - w[e2]
    new1 = load[k1] - d * layer.per_slot[k1]
    new2 = load[k2] + d * layer.per_slot[k2]
    # The busiest of the other ranks: the first of the three busiest that is neither.
    three = np.argsort(-load, kind="stable")[:3]
    rest = np.full(len(p), -np.inf)
    for t in three[::-1]:
        rest = np.where((k1 != t) & (k2 != t), load[t], rest)
    top = np.maximum(rest, np.maximum(new1, new2))
    squares = float(load @ load) - load[k1] ** 2 - load[k2] ** 2 + new1 ** 2 + new2 ** 2
    return top, squares, p, q


def _marked(indices: np.ndarray, size: int) -> np.ndarray:
    """A boolean lookup of ``indices`` among ``range(size)`` (what ``np.isin`` tells, without
    its sort: a tenth of a small layer's trade)."""
    out = np.zeros(size, dtype=bool)
    out[indices] = True
    return out
