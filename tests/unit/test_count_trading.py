"""Replica counts traded inside a layer's fill (lazarus_core.count_trading): what may change,
what never does, and that it lowers the busiest rank where swaps alone cannot."""
from unittest import mock

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lazarus_core import count_trading as ct
from lazarus_core.count_trading import (FILL_EVALUATIONS, MAX_EVALUATIONS, layer_budget,
                                         trade_counts)


def rank_loads(experts, rank_of_slot, loads, num_ranks):
    counts = np.bincount(experts, minlength=len(loads))
    per_replica = np.asarray(loads, dtype=float) / np.maximum(counts, 1)
    return np.bincount(rank_of_slot, weights=per_replica[experts], minlength=num_ranks)


def trade(experts, ranks, loads, home=None, min_replicas=1, rank_node=None,
          budget=MAX_EVALUATIONS):
    experts, ranks = np.asarray(experts), np.asarray(ranks)
    num_ranks = int(ranks.max()) + 1
    home = np.full(len(experts), -1) if home is None else np.asarray(home)
    rank_node = np.arange(num_ranks) if rank_node is None else np.asarray(rank_node)
    slots = np.bincount(ranks, minlength=num_ranks)
    return trade_counts(experts, ranks, rank_node, home, np.asarray(loads, dtype=float),
                        slots, min_replicas, 1.0, budget)


def test_a_replica_of_a_light_expert_becomes_one_of_the_hot_expert():
    # Three ranks of one slot: A (load 3) on one, B (load 1) on two. No swap helps (every
    # rank holds one replica); a second replica of A halves the busiest rank.
    out = trade([0, 1, 1], [0, 1, 2], [3.0, 1.0])
    assert sorted(np.bincount(out, minlength=2)) == [1, 2]
    assert rank_loads(out, np.arange(3), [3.0, 1.0], 3).max() == 1.5


def test_a_trade_does_no_more_work_than_its_budget():
    # The move above costs one row of rank loads per candidate: with no budget, none is
    # tried; the layers of one fill share a bound, each at most a lone layer's.
    assert trade([0, 1, 1], [0, 1, 2], [3.0, 1.0], budget=0).tolist() == [0, 1, 1]
    assert layer_budget(1) == MAX_EVALUATIONS
    assert layer_budget(58) * 58 <= FILL_EVALUATIONS < MAX_EVALUATIONS * 58


def test_nothing_goes_below_min_replicas():
    out = trade([0, 1, 1], [0, 1, 2], [3.0, 1.0], min_replicas=2)
    assert out.tolist() == [0, 1, 1]


def test_pinned_replicas_keep_their_expert_and_node():
    # Both of B's replicas are pinned (anchors): B cannot give one up.
    out = trade([0, 1, 1], [0, 1, 2], [3.0, 1.0], home=[-1, 1, 2])
    assert out.tolist() == [0, 1, 1]


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_every_trade_keeps_the_invariants(data):
    num_ranks = data.draw(st.integers(2, 6))
    per_rank = data.draw(st.integers(1, 3))
    num_experts = data.draw(st.integers(per_rank, per_rank + 4))
    ranks = np.repeat(np.arange(num_ranks), per_rank)
    # A rank holds distinct experts, as the fill leaves them.
    experts = np.concatenate([data.draw(st.permutations(range(num_experts)))[:per_rank]
                              for _ in range(num_ranks)])
    loads = data.draw(st.lists(st.floats(0.01, 10), min_size=num_experts,
                               max_size=num_experts))
    nodes = data.draw(st.integers(1, num_ranks))
    rank_node = np.arange(num_ranks) % nodes
    pinned = data.draw(st.lists(st.booleans(), min_size=len(experts), max_size=len(experts)))
    home = np.where(pinned, rank_node[ranks], -1)
    counts = np.bincount(experts, minlength=num_experts)
    floor = int(counts[counts > 0].min())
    out = trade(experts, ranks, loads, home, floor, rank_node)
    after = np.bincount(out, minlength=num_experts)
    assert len(out) == len(experts)
    assert (after[counts >= floor] >= floor).all()
    # A pinned replica's expert stays on its node: as many of it there as were pinned.
    for node in range(nodes):
        on = rank_node[ranks] == node
        need = np.bincount(experts[on & np.asarray(pinned)], minlength=num_experts)
        have = np.bincount(out[on], minlength=num_experts)
        assert (have >= need).all()
    # No rank holds an expert twice, and the busiest rank is never busier than before.
    for k in range(num_ranks):
        assert len(set(out[ranks == k])) == per_rank
    before = rank_loads(experts, ranks, loads, num_ranks).max()
    assert rank_loads(out, ranks, loads, num_ranks).max() <= before + 1e-9


@settings(max_examples=100, deadline=None)
@given(st.data())
def test_retargets_score_every_move_as_its_full_row_of_rank_loads(data):
    # The busiest rank after each retarget comes from one row per (a, b) pair of experts,
    # and the sum of squares only for the moves that can rank: both must be what the full
    # row of rank loads after that move gives.
    num_ranks = data.draw(st.integers(2, 6))
    per_rank = data.draw(st.integers(1, 3))
    num_experts = data.draw(st.integers(per_rank + 1, per_rank + 4))
    experts = np.array([data.draw(st.permutations(range(num_experts)))[:per_rank]
                        for _ in range(num_ranks)]).ravel()
    loads = np.array(data.draw(st.lists(st.floats(0.1, 10), min_size=num_experts,
                                        max_size=num_experts)))
    ranks = np.repeat(np.arange(num_ranks), per_rank)
    limit = data.draw(st.sampled_from([1, ct.KICKS]))
    layer = ct._Layer(ranks, np.arange(num_ranks), loads, np.full(num_ranks, 1.0 / per_rank),
                      1, 0.0)
    pinned = np.full(len(experts), -1)
    r = np.bincount(experts, minlength=num_experts)
    n = np.bincount(ranks * num_experts + experts,
                    minlength=num_ranks * num_experts).reshape(num_ranks, num_experts)
    w = loads / np.maximum(r, 1)
    load = (n @ w) * layer.per_slot
    busy = np.argsort(-load, kind="stable")[:ct.TOP_RANKS]
    # With rows weighed from the ranks each move changes (WHOLE_ROWS = 0), and with every
    # full row at once (as a small layer's are): the same moves and busiest ranks, and the
    # same sums wherever the first has one.
    with mock.patch.object(ct, "WHOLE_ROWS", 0):
        top, squares, p, q = ct._retargets(layer, experts, pinned, n, r, w, load, busy,
                                           ct._marked(busy, len(load)), limit)
    layer.budget = ct.MAX_EVALUATIONS
    whole = ct._retargets(layer, experts, pinned, n, r, w, load, busy,
                          ct._marked(busy, len(load)), limit)
    assert (whole[2] == p).all() and (whole[3] == q).all() and (whole[0] == top).all()
    summed = np.isfinite(squares)
    assert (whole[1][summed] == squares[summed]).all()
    full = np.empty(len(p))
    for i in range(len(p)):
        after = experts.copy()
        after[p[i]] = q[i]
        row = rank_loads(after, ranks, loads, num_ranks) / per_rank
        full[i] = row @ row
        assert top[i] == pytest.approx(row.max(), rel=1e-12)
        if np.isfinite(squares[i]):
            assert squares[i] == pytest.approx(full[i], rel=1e-12)
    # Every move among the ``limit`` best by (busiest, sum of squares) has its sum, and no
    # move left unsummed would have ranked before the last of them.
    best = np.lexsort((squares, top))[:limit]
    assert np.isfinite(squares[best]).all()
    last = best[-1] if len(best) else None
    for i in np.flatnonzero(~np.isfinite(squares)):
        assert top[i] > top[last] or full[i] >= squares[last] * (1 - 1e-12)


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_pair_rows_weigh_each_pair_as_its_own_row_of_rank_loads(data):
    # _PairRows weighs the ranks of each expert a that hold no b once for every pair of
    # that a (a hot a holds hundreds of ranks): each pair's busiest changed rank, where
    # it first comes (a's ranks, then b's others, in rank order), the runner-up without
    # that one, the busiest rank left unchanged and the change in the sum of squares
    # must still be what the pair's own row of rank loads gives. Skewed layers, so that
    # hot experts share ranks with others.
    num_ranks = data.draw(st.integers(2, 24))
    per_rank = data.draw(st.integers(1, 4))
    num_experts = data.draw(st.integers(2, 12))
    weights = 1.0 / np.arange(1, num_experts + 1) ** data.draw(st.floats(0.0, 2.0))
    seed = data.draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    experts = rng.choice(num_experts, size=num_ranks * per_rank, p=weights / weights.sum())
    loads = rng.uniform(0.1, 10, size=num_experts)
    ranks = np.repeat(np.arange(num_ranks), per_rank)
    layer = ct._Layer(ranks, np.arange(num_ranks), loads, np.full(num_ranks, 1.0 / per_rank),
                      1, 0.0)
    r = np.bincount(experts, minlength=num_experts)
    n = np.zeros((num_ranks, num_experts), dtype=np.uint16)
    np.add.at(n, (ranks, experts), 1)
    w = np.divide(loads, r, out=np.zeros_like(loads), where=r > 0)
    load = (n @ w) * layer.per_slot
    sources = np.flatnonzero(r > 1)
    if not len(sources):
        return
    keys = np.array([a * num_experts + b for a in sources for b in np.flatnonzero(r > 0)
                     if a != b], dtype=np.int64)
    if not len(keys):
        return
    a, b = keys // num_experts, keys % num_experts  # sorted by a, as _retargets makes them
    rows = ct._PairRows(layer, experts, n, r, w, load, a, b)
    for i in range(len(a)):
        da = loads[a[i]] / (r[a[i]] - 1) - w[a[i]]
        db = loads[b[i]] / (r[b[i]] + 1) - w[b[i]]
        row = load + (n[:, a[i]] * da + n[:, b[i]] * db) * layer.per_slot
        on_a, on_b = n[:, a[i]] > 0, n[:, b[i]] > 0
        changed = np.concatenate((np.flatnonzero(on_a), np.flatnonzero(on_b & ~on_a)))
        top = changed[np.argmax(row[changed])]  # the first of equals, in that order
        assert rows.largest[i] == row[changed].max()
        assert rows.top_rank[i] == top
        rest = changed[changed != top]
        assert rows.second[i] == (row[rest].max() if len(rest) else -np.inf)
        still = ~on_a & ~on_b
        assert rows.unchanged[i] == (load[still].max() if still.any() else -np.inf)
        assert rows.squares[i] == pytest.approx(
            (row[changed] ** 2 - load[changed] ** 2).sum(), rel=1e-9, abs=1e-9)


def test_a_trade_is_remembered_only_within_its_block(monkeypatch):
    computed = []
    real = ct._traded
    monkeypatch.setattr(ct, "_traded", lambda *a: computed.append(1) or real(*a))
    args = ([0, 1, 1], [0, 1, 2], [3.0, 1.0])
    assert trade(*args).tolist() == trade(*args).tolist()
    assert len(computed) == 2  # no memory outside a block
    with ct.remembered():
        first = trade(*args)
        first[:] = 9  # the caller's copy: what is remembered stays as it was
        with ct.remembered():  # an inner block shares the outer one's memory
            again = trade(*args)
        assert trade(*args, min_replicas=2).tolist() == [0, 1, 1]  # other inputs: traded
        assert trade([0, 1, 1], [0, 1, 2], [1.0, 3.0]).tolist() == [0, 1, 1]
    assert len(computed) == 5
    assert sorted(np.bincount(again, minlength=2)) == [1, 2]
    trade(*args)
    assert len(computed) == 6  # the memory went with its block


def test_a_re_plan_remembers_its_trades_and_plans_as_without(monkeypatch):
    # A small cluster whose layers differ in shape: its re-plan's searches fill the same
    # layer around the same anchors again and again. Remembering must save those trades
    # and change nothing in the plan.
    from lazarus_core import solver
    from lazarus_core.topology import NodeSpec
    from lazarus_sim.workload import differing_loads

    loads = differing_loads(16, 2, 1.0, seed=3)
    nodes = [NodeSpec(f"node-{i}", 1, 6, zone=f"zone-{i % 4}") for i in range(10)]
    plan = solver.plan_job(nodes, 16, 2, 2, "mro", loads, max_failures=0)
    survivors = nodes[:3] + nodes[5:]

    def re_plan():
        calls = []
        real = ct._traded
        monkeypatch.setattr(ct, "_traded", lambda *a: calls.append(1) or real(*a))
        out = solver.replan(plan, survivors, "NodeLost", {n.name for n in survivors}, loads,
                            max_failures=0)
        monkeypatch.setattr(ct, "_traded", real)
        return out, len(calls)

    remembering, traded = re_plan()

    class Forgetful:  # a block that remembers nothing
        def get(self):
            return None

        def set(self, value):
            return None

        def reset(self, token):
            return None

    monkeypatch.setattr(ct, "_REMEMBERED", Forgetful())
    forgetting, traded_without = re_plan()
    assert 0 < traded < traded_without
    assert [layer.placement for layer in remembering.plan.layers] == \
        [layer.placement for layer in forgetting.plan.layers]
    assert remembering.migration.experts_migrated == forgetting.migration.experts_migrated
