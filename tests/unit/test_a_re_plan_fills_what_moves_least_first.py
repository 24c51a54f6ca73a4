"""A re-plan gives the fill that moves least its full chance before rebuilding: its first
fill and its rescues trade every layer again with a lone layer's budget where they missed
their bound (the most fragile layer filled alone) for want of trading, not of structure
(``solver._restructured``); the repair that moves least is filled, as a rescue where the
window leaves it out; and where the options do not balance, the repair that recovers as
well as the first search's choice is filled before that choice is made afresh
(``mro.restructure``'s rescues). Of the fills made, the one taken is the one whose busiest
rank, priced up by the share of the slots it moves, weighs least (``balance.cheapest``)."""
from __future__ import annotations

from unittest import mock

import numpy as np
import pytest

from lazarus_core import balance as balancing
from lazarus_core import count_trading, mro, solver
from lazarus_core.balance import busiest_rank
from lazarus_core.solver import plan_job, replan
from lazarus_sim.workload import differing_loads

from layer_shapes import nodes


def re_plan(cluster, experts, loads, then=lambda: None, move_price=balancing.MOVE_PRICE):
    """The busiest rank and the replicas moved after losing node-03; ``then`` runs after
    the plan is made. (The fill taken, without the search for fewer copies that follows
    it: fewer_copies.py, tested on its own.) The plan is the one its fill leaves, before
    its layers over the target trade on (``balance.traded_on``, tested on its own): these
    cases were written on those plans, and traded on, some re-plan otherwise (26 nodes:
    1.134 -> 1.121, and its starved re-plan takes a fill moving 283 at 1.137 over the
    rescue moving 55 at 1.171, as the price says)."""
    with mock.patch.object(mro, "traded_on", lambda placed, *args: placed):
        plan = plan_job(cluster, experts, len(loads), 2, "mro", loads, max_failures=0)
    then()
    survivors = [n for n in cluster if n.name != "node-03"]
    result = replan(plan, survivors, "NodeLost", {n.name for n in survivors}, loads,
                    max_failures=0, move_price=move_price, copy_search=False)
    assert result.migration.recoverable
    return busiest_rank(result.plan, loads), result.migration.experts_migrated


def starved(monkeypatch):
    """Fills' trading budget cut to 20,000 rank loads (8 million by default), once the plan
    is made: its layers share it, and a fill's trading falls short of its bound."""
    return lambda: monkeypatch.setattr(count_trading, "FILL_EVALUATIONS", 20_000)


def test_the_first_fill_trades_again_where_it_missed_its_bound(monkeypatch):
    # 21 nodes x 2 GPUs x 4 slots, E = 32, 3 layers, zipf 0.2-0.8. The fill's trading is
    # shared by its layers; a budget this small starves them here as 8 million does at 256
    # GPUs (there: 1.080 and 16,114 moved, lost to 1.046 and 40,152). Traded only once, the
    # re-plan ends at 1.520 with 268 replicas moved.
    balance, moved = re_plan(nodes(21, 2, 4), 32, differing_loads(32, 3, 0.5, 681396858),
                             starved(monkeypatch))
    assert balance < 1.10
    assert moved < 100


@pytest.mark.parametrize("traded", [True, False])
def test_a_rescue_trades_again_where_it_missed_its_bound(monkeypatch, traded):
    # 26 nodes x 2 GPUs x 4 slots, E = 64, 4 layers, zipf 0.2-0.8, the budget as small as
    # above. The rescue that moves least (55 replicas) fills to 1.211 traded once and
    # 1.171 traded again, where the window's best fill is 1.136 moving 346, 43% of the
    # slots: priced, 1.179 against 1.185. Traded again only as the first fill, the re-plan
    # moves 346.
    if not traded:  # no fill trades again
        monkeypatch.setattr(solver, "BALANCED_ENOUGH", 10.0)
    balance, moved = re_plan(nodes(26, 2, 4), 64, differing_loads(64, 4, 0.5, 54449067),
                             starved(monkeypatch))
    assert moved < 100
    if traded:
        assert balance < 1.19
    else:  # 1.211
        assert balance > 1.2


@pytest.mark.parametrize("move_price", [0.0, 0.05, 0.1, 1.0])
def test_the_move_price_is_the_callers(monkeypatch, move_price):
    # The rescue's case above: the window's best fill 1.136 moving 346 replicas (43% of the
    # slots), the rescue 1.171 moving 55 (7%). Priced at p, they weigh 1.136 (1 + 0.43 p)
    # and 1.171 (1 + 0.07 p): the one moving more is cheaper below p = 0.086.
    balance, moved = re_plan(nodes(26, 2, 4), 64, differing_loads(64, 4, 0.5, 54449067),
                             starved(monkeypatch), move_price=move_price)
    if move_price < 0.086:
        assert balance < 1.14 and moved > 300
    else:
        assert balance > 1.16 and moved < 100


@pytest.mark.parametrize("move_price", [-0.1, float("nan"), float("inf"), "0.1"])
def test_a_move_price_that_is_not_a_number_at_least_zero_is_refused(move_price):
    cluster = nodes(4, 1, 4)
    plan = plan_job(cluster, 4, 1, 2, "mro", max_failures=0)
    with pytest.raises(ValueError, match="move_price"):
        replan(plan, cluster[:3], "NodeLost", {n.name for n in cluster}, move_price=move_price)


def test_the_first_fill_traded_again_is_weighed_on_what_it_moves(monkeypatch):
    # 15 nodes x 4 GPUs x 4 slots, E = 64, 4 layers, zipf 0.7-1.3, the budget as small as
    # above: traded again, the first fill is as balanced (1.342) as the fill taken, and
    # moves about 20 more. Which fills those are depends on the CPU's float sums: 296
    # against 277 where this test was written, 335 against 314 on an AMD EPYC without
    # AVX-512.
    case = nodes(15, 4, 4), 64, differing_loads(64, 4, 1.0, 101074032)
    with monkeypatch.context() as m:
        balance, moved = re_plan(*case, starved(m))
    with monkeypatch.context() as m:  # the more balanced of the two, whatever it moves
        m.setattr(solver, "cheapest", lambda made, _: min(made, key=lambda m: m[0]))
        balance_alone, moved_alone = re_plan(*case, starved(m))
    assert balance < 1.35
    assert balance == pytest.approx(balance_alone, abs=1e-3)
    assert moved <= moved_alone - 10


@pytest.mark.parametrize("repaired", [True, False])
def test_the_repair_is_rescued_before_the_choice_made_afresh(monkeypatch, repaired):
    # 15 nodes x 4 GPUs x 2 slots, E = 16, 3 layers, zipf 0.7-1.3: no option fills within
    # 1.05 after losing a node; the first search's choice made afresh fills to 1.116 and
    # moves 109 replicas, the plan's own structure repaired 1.060 and 41.
    if not repaired:
        restructure = solver.restructure

        def fresh_rescue_only(*args, **kwargs):
            options, rescues = restructure(*args, **kwargs)
            return options, rescues[-1:]
        monkeypatch.setattr(solver, "restructure", fresh_rescue_only)
    balance, moved = re_plan(nodes(15, 4, 2), 16, differing_loads(16, 3, 1.0, 774747711))
    if repaired:
        assert balance < 1.07 and moved < 50
    else:  # what the re-plan was before the repair was a rescue
        assert balance > 1.1 and moved > 100


@pytest.mark.parametrize("rescued", [True, False])
def test_the_repair_that_moves_least_is_filled_beyond_the_window(monkeypatch, rescued):
    # 10 nodes x 4 GPUs x 3 slots, E = 16, 4 layers, zipf 1.2-1.8: the window's options
    # promise more on their most fragile layers than they fill; the repair nearest the plan
    # before ranks beyond the window and fills best.
    if not rescued:  # as though every option were in the window
        monkeypatch.setattr(mro, "FILLS_TRIED", 10**6)
    balance, moved = re_plan(nodes(10, 4, 3), 16, differing_loads(16, 4, 1.5, 111563015))
    if rescued:
        assert balance < 1.11 and moved < 10
    else:  # 1.158 with 18 moved
        assert balance > 1.15 and moved > 15


@pytest.mark.parametrize("weighed", [True, False])
def test_a_re_plan_takes_the_fill_that_moves_least_of_balances_alike(monkeypatch, weighed):
    # 20 nodes x 2 GPUs x 3 slots, E = 16, 4 layers, zipf 1.2-1.8: after losing a node no
    # fill balances within 1.05; two fill to the same 1.055, one moving 26 replicas fewer.
    if not weighed:  # the fills taken in their order, as though moves were not known
        first_balanced = solver.first_balanced
        monkeypatch.setattr(solver, "first_balanced",
                            lambda *a, moved=None, **k: first_balanced(*a, **k))
    balance, moved = re_plan(nodes(20, 2, 3), 16, differing_loads(16, 4, 1.5, 21606496))
    assert balance < 1.06
    if weighed:
        assert moved < 60
    else:  # 80 moved
        assert moved > 75


# 10 slots x 2 layers, one rank a slot, the hot expert's load 50 times the other's: one
# replica of it (50 / 5.1: 9.8 times the mean), or five (1.96).
LOADS_APART = [[1.0, 50.0], [1.0, 50.0]]
ONE_HOT = np.array([[0] * 9 + [1]] * 2)
FIVE_HOT = np.array([[0, 1] * 5] * 2)


def fills(calls: list, made: dict):
    """Makers of fills named by what they are made from; ``made`` maps each name to its
    [layer, slot] fill."""
    def make(name):
        return lambda: (calls.append(name), (name, made[name]))[1]
    return [make(name) for name in made]


@pytest.mark.parametrize("moves, rescued, taken", [
    (None, ONE_HOT, "a"),  # a plan's fills: the first of balances alike
    ({"a": 30, "b": 10, "c": 20, "d": 15}, ONE_HOT, "b"),  # as balanced: moving least
    ({"a": 30, "b": 10, "c": 20, "d": 50}, FIVE_HOT, "d")])  # far more balanced
def test_fills_alike_in_balance_are_weighed_on_what_they_move(moves, rescued, taken):
    calls = []
    window = fills(calls, {"a": ONE_HOT, "b": ONE_HOT, "c": ONE_HOT})
    made_from, _ = balancing.first_balanced(
        window, LOADS_APART, [1] * 10, [1] * 10, balancing.BALANCED_ENOUGH,
        rescues=fills(calls, {"d": rescued}),
        moved=None if moves is None else lambda name, _: moves[name])
    assert calls == ["a", "b", "c", "d"]
    assert made_from == taken


@pytest.mark.parametrize("bound, moves, made", [
    (9.9, {"a": 20, "d": 0}, True),  # 9.9 x 1.01 < 9.8 x 1.1: it could be cheaper
    (11.0, {"a": 20, "d": 0}, False),  # 11.11 > 10.78: it cannot
    (9.9, None, False)])  # a plan's fill: its bound within 1% of the best made
def test_a_costly_fill_is_made_where_its_bound_could_be_cheaper_priced(monkeypatch, bound,
                                                                       moves, made):
    # Costly fills (more slot-layers than FILL_WORK shares out) are made only where their
    # bound could beat what is made: a re-plan's weighed unmoved against the cheapest made
    # priced (the benchmark's shape on 60 nodes after losing 4: the repair, bound 1.064,
    # was left out against a first fill of 1.068 moving 51,116 replicas, 49% of the slots;
    # made, it fills to 1.074 moving 17,351).
    monkeypatch.setattr(balancing, "FILL_WORK", 1)
    calls = []
    made_from, _ = balancing.first_balanced(
        fills(calls, {"a": ONE_HOT}), LOADS_APART, [1] * 10, [1] * 10,
        balancing.BALANCED_ENOUGH, rescues=fills(calls, {"d": ONE_HOT}), bounds=[9.8, bound],
        moved=None if moves is None else lambda name, _: moves[name])
    assert calls == (["a", "d"] if made else ["a"])
    assert made_from == ("d" if made else "a")


def test_a_fill_is_priced_up_by_the_share_of_the_slots_it_moves():
    # MOVE_PRICE 0.1 (moving every slot weighs as ranks 10% busier): 1.20 x 1.05 = 1.26,
    # 1.25 x 1.005 = 1.25625, 1.19 x 1.06 = 1.2614.
    made = [(1.20, 0.50, "a"), (1.25, 0.05, "b"), (1.19, 0.60, "c")]
    assert balancing.cheapest(made)[2] == "b"
    assert balancing.cheapest([made[0], made[2]])[2] == "a"
    # Ranks within BALANCE_TARGET are balanced alike: the fill that moves less.
    assert balancing.cheapest([(1.01, 0.3, "x"), (1.04, 0.1, "y")])[2] == "y"
    assert balancing.cheapest([(1.06, 0.0, "z"), (1.04, 0.1, "y")])[2] == "z"
