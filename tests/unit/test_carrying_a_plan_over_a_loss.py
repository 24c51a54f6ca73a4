"""A loss re-planned by carrying the old plan over (lazarus_core/carry.py): the survivors
keep their slots, a core that lost a node gets a fresh one for every layer, and a carried
plan that misses the balance target is kept only where it is no worse than one made
afresh."""
from __future__ import annotations

import copy

import numpy as np
import pytest

from lazarus_core import solver
from lazarus_core.anchor_search import largest_core
from lazarus_core.anchors import smallest_cores
from lazarus_core.balance import BALANCE_TARGET, busiest_rank, fill_counts, layer_balance
from lazarus_core.carry import _Carried, _survivors
from lazarus_core.recovery import cube_presence
from lazarus_core.topology import NodeSpec

EXPERTS, LAYERS, F = 32, 8, 2


def zipf(experts: int, layers: int) -> list[list[float]]:
    """Skewed loads whose hottest expert rotates from layer to layer."""
    return [[1 / (((e + l) % experts) + 1) for e in range(experts)] for l in range(layers)]


def cluster(n: int) -> list[NodeSpec]:
    return [NodeSpec(f"node-{i:02d}", 4, 4, zone=f"zone-{i % 3}") for i in range(n)]


NODES = cluster(40)
LOADS = zipf(EXPERTS, LAYERS)


@pytest.fixture(scope="module")
def plan():
    return solver.plan_job(NODES, EXPERTS, LAYERS, F, "mro", LOADS, max_failures=0)


def losses(nodes, draws: int, seed: int, most: int = 3):
    """Random losses of 1..most nodes: (survivors, their names)."""
    rng = np.random.default_rng(seed)
    for _ in range(draws):
        gone = {nodes[i].name for i in rng.choice(len(nodes), int(rng.integers(1, most + 1)),
                                                  replace=False)}
        survivors = [n for n in nodes if n.name not in gone]
        yield survivors, {n.name for n in survivors}


def slots_of(plan, name: str) -> np.ndarray:
    """[layer, slot] of one node."""
    i = plan.node_index(name)
    start, end = plan.slot_offsets[i], plan.slot_offsets[i + 1]
    return plan.slot_matrix[:, start:end]


def cores(plan) -> list[frozenset[str]]:
    """The plan's cores (the minimal node sets over every (layer, expert)) of fewer than
    ``largest`` nodes, as sets of node names: they alone are fatal at the failure counts
    scored."""
    rows, _ = smallest_cores(cube_presence(plan.count_cube), largest_core(len(plan.nodes)))
    names = [n.name for n in plan.nodes]
    return [frozenset(names[i] for i in np.flatnonzero(r))
            for r in rows if r.sum() < largest_core(len(plan.nodes))]


def test_a_loss_is_carried_over_with_the_survivors_slots_kept_and_ranks_balanced(plan):
    carried = 0
    for survivors, names in losses(NODES, draws=8, seed=1):
        step = solver.replan(plan, survivors, "NodeLost", names, LOADS, max_failures=0)
        new = step.plan
        if solver.carried_over(plan, survivors, LOADS, names) is None:
            continue
        carried += 1
        assert busiest_rank(new, LOADS) <= BALANCE_TARGET
        assert min(min(layer.replicas) for layer in new.layers) >= F
        changed = 0
        for node in survivors:
            before, after = plan.nodes[plan.node_index(node.name)], new.nodes[new.node_index(node.name)]
            # Each rank stays on its GPU: nothing moves between a node's GPUs.
            assert after.devices == before.devices
            changed += int((slots_of(plan, node.name) != slots_of(new, node.name)).sum())
        # Only what the loss needs changes: fewer slots than the lost nodes held.
        lost = sum(n.slots for n in NODES) - sum(n.slots for n in survivors)
        assert changed < lost * LAYERS, (changed, lost * LAYERS)
        assert step.migration.recoverable
    assert carried >= 6  # the case this path exists for: most losses of a few nodes


def test_a_carried_plan_adds_no_fatal_set_to_the_old_plans_cores(plan):
    """Cores of the carried plan below ``largest`` nodes are the old ones, or old ones with
    their lost nodes replaced by one fresh node each: as many, as large, and as disjoint."""
    old = cores(plan)
    assert old and all(not a & b for a in old for b in old if a != b)
    for survivors, names in losses(NODES, draws=8, seed=2):
        if solver.carried_over(plan, survivors, LOADS, names) is None:
            continue
        new = cores(solver.replan(plan, survivors, "NodeLost", names, LOADS,
                                  max_failures=0).plan)
        assert all(not a & b for a in new for b in new if a != b)
        assert_cores_kept(plan, solver.replan(plan, survivors, "NodeLost", names, LOADS,
                                              max_failures=0).plan, {n.name for n in NODES} - names)


def test_a_broken_core_gets_the_same_fresh_node_in_every_layer(plan):
    core = min(cores(plan), key=lambda c: (len(c), sorted(c)))
    names = [n.name for n in plan.nodes]
    on_core = [(li, e) for li in range(LAYERS) for e in range(EXPERTS)
               if frozenset(names[i] for i in np.flatnonzero(plan.count_cube[li, :, e])) == core]
    assert on_core  # cold experts held by exactly the core's nodes
    victim = sorted(core)[0]
    survivors = [n for n in NODES if n.name != victim]
    ordered = solver._order(survivors, EXPERTS, LAYERS)
    state = _Carried(plan, ordered, _survivors(plan, ordered, {n.name for n in survivors}),
                     LOADS)
    assert state.recored.any()  # the loss broke a core that cold experts keep
    new = solver.replan(plan, survivors, "NodeLost", {n.name for n in survivors}, LOADS,
                        max_failures=0).plan
    fresh = set()
    for li, e in on_core:
        now = {new.nodes[i].name for i in np.flatnonzero(new.count_cube[li, :, e])}
        assert core - {victim} <= now
        fresh |= now - core
    assert len(fresh) == 1, fresh  # one node takes the lost one's place, in every layer
    assert not fresh & set().union(*(c for c in cores(plan) if c != core))


@pytest.mark.parametrize("change", ["grows", "gpu lost", "cannot send"])
def test_what_is_not_a_plain_loss_is_not_carried(plan, change):
    survivors = NODES[1:]
    names = {n.name for n in survivors}
    if change == "grows":
        survivors = survivors + [NodeSpec("node-new", 4, 4, zone="zone-0")]
    elif change == "gpu lost":
        survivors = [survivors[0].without_gpus({3})] + survivors[1:]
    else:
        names = names - {survivors[0].name}
    assert solver.carried_over(plan, survivors, LOADS, names) is None
    # The full re-plan still answers.
    assert solver.replan(plan, survivors, "NodeLost", names, LOADS, max_failures=0).plan


def test_a_carried_plan_that_misses_the_target_is_kept_only_where_it_is_no_worse(monkeypatch):
    """36 nodes, 48 experts: three lost nodes leave too few spare replicas for ranks within
    the target; the re-plan then makes a plan afresh too and keeps the better."""
    nodes, loads = cluster(36), zipf(48, 4)
    old = solver.plan_job(nodes, 48, 4, F, "mro", loads, max_failures=0)
    # Trading on with the kept replicas free (tested on its own below) brings the carry
    # that misses here within the target (1.0559 -> 1.0484); without it, it misses it,
    # the case this rule is for.
    monkeypatch.setattr(_Carried, "_loose",
                        lambda self, layers: np.zeros(self.slots.shape, bool))
    compared = 0
    for survivors, names in losses(nodes, draws=6, seed=4, most=3):
        carried = solver.carried_over(old, survivors, loads, names)
        # Without the search for fewer copies after a fill made afresh (fewer_copies.py,
        # tested on its own; 12 re-plans here took 14 s with it): the rule that chooses
        # between the carried and the rebuilt plan is the same with it.
        chosen = solver.replan(old, survivors, "NodeLost", names, loads, max_failures=0,
                               copy_search=False)
        with monkeypatch.context() as m:
            m.setattr(solver, "carry", lambda *args: None)
            rebuilt = solver.replan(old, survivors, "NodeLost", names, loads, max_failures=0,
                                    copy_search=False)
        if carried is None or carried.balance <= BALANCE_TARGET:
            continue
        compared += 1
        kept = chosen.plan.layers != rebuilt.plan.layers
        no_worse = (solver._fatal_sets(chosen.plan) <= solver._fatal_sets(rebuilt.plan)
                    and busiest_rank(chosen.plan, loads) <= busiest_rank(rebuilt.plan, loads)
                    and chosen.migration.experts_migrated <= rebuilt.migration.experts_migrated)
        assert no_worse
        if kept:
            assert busiest_rank(chosen.plan, loads) == pytest.approx(carried.balance)
    assert compared >= 1


def test_losses_in_a_row_stay_balanced_and_recoverable():
    """Each re-plan carries the last one over where that balances: ranks within the
    target, every expert keeps f replicas, no fatal pair, and a carried plan's cores stay
    disjoint (a plan made afresh may share nodes between cores: MRO's structures do)."""
    current = solver.plan_job(NODES, EXPERTS, LAYERS, F, "mro", LOADS, max_failures=3)
    first = solver._fatal_sets(current)  # no single node or pair loses an expert
    assert first == [0, 0]
    alive = list(NODES)
    rng = np.random.default_rng(9)
    carried_steps = 0
    for _ in range(5):
        gone = {alive[i].name for i in rng.choice(len(alive), 2, replace=False)}
        alive = [n for n in alive if n.name not in gone]
        names = {n.name for n in alive}
        carried = solver.carried_over(current, alive, LOADS, names)
        step = solver.replan(current, alive, "NodeLost", names, LOADS, max_failures=3)
        current = step.plan
        assert step.migration.recoverable
        assert busiest_rank(current, LOADS) <= BALANCE_TARGET
        assert min(min(layer.replicas) for layer in current.layers) >= F
        assert solver._fatal_sets(current) == first
        if carried is not None and np.array_equal(current.slot_matrix, carried.placements):
            carried_steps += 1
            found = cores(current)
            assert all(not a & b for a in found for b in found if a != b)
    assert carried_steps >= 2
    assert current.generation == 6


def assert_cores_kept(old_plan, new_plan, gone: set[str]) -> None:
    """``new_plan``'s cores below ``largest`` nodes are ``old_plan``'s, or old ones whose
    lost nodes were each replaced by one node of no other core."""
    old, new = cores(old_plan), cores(new_plan)
    unused = list(old)
    for core in new:
        match = [c for c in unused if core == c
                 or (c & gone and c - gone <= core and len(core) == len(c))]
        assert match, (sorted(core), [sorted(c) for c in old])
        unused.remove(match[0])


@pytest.mark.parametrize("seed", range(24))
def test_random_clusters_and_losses_are_re_planned_and_carried_safely(seed):
    rng = np.random.default_rng(seed)
    per_gpu = int(rng.integers(2, 5))  # ranks of one size: the balance target is reachable
    nodes = [NodeSpec(f"node-{i:02d}", int(rng.choice([2, 4, 4, 8])), per_gpu,
                      zone=f"zone-{i % 3}") for i in range(int(rng.integers(14, 40)))]
    experts, layers, f = int(rng.integers(8, 40)), int(rng.integers(1, 6)), int(rng.integers(1, 4))
    if sum(n.slots for n in nodes) * 0.7 < experts * f:
        f = 1
    skew, shift = rng.uniform(0, 1.5), rng.integers(experts, size=layers)
    loads = [[1 / (((e + s) % experts) + 1) ** skew for e in range(experts)] for s in shift]
    old = solver.plan_job(nodes, experts, layers, f, "mro", loads, max_failures=0)
    for survivors, names in losses(nodes, draws=4, seed=seed, most=3):
        if sum(n.slots for n in survivors) < experts * f:
            continue
        step = solver.replan(old, survivors, "NodeLost", names, loads, max_failures=0)
        assert min(min(layer.replicas) for layer in step.plan.layers) >= f
        carried = solver.carried_over(old, survivors, loads, names)
        if carried is not None and carried.balance <= BALANCE_TARGET:
            assert busiest_rank(step.plan, loads) == pytest.approx(carried.balance)
            assert_cores_kept(old, step.plan, {n.name for n in nodes} - names)


@pytest.mark.parametrize("seed", range(6))
def test_a_fresh_node_is_taken_only_where_its_slots_can_take_the_cores_replicas(plan, seed):
    # ``_Carried._yields``: how many replicas ``_place_on`` can put on a node in each layer
    # is the node's open movable slots, each expert's no more than it may leave. A count
    # of open slots alone let recore take a node that then could not hold them all, and
    # the loss was made afresh (1,024 GPUs, zipf 0.8-1.4 per layer: 4.5-5.7 s). Here it
    # must be exact both ways, on random losses, for every layer, node and core.
    survivors, names = next(iter(losses(NODES, 1, seed)))
    ordered = solver._order(survivors, EXPERTS, LAYERS)
    state = _Carried(plan, ordered, _survivors(plan, ordered, names), LOADS)
    rng = np.random.default_rng(seed)
    for node in rng.choice(len(ordered), 4, replace=False).tolist():
        core = int(rng.choice(np.unique(state.core[state.core >= 0])))
        yields = state._yields(node, core)
        anchoring = state._anchoring(node, core)
        for li in range(LAYERS):
            for wanted, placed in ((yields[li], True), (yields[li] + 1, False)):
                trial = copy.deepcopy(state)
                # As recore marks them on taking the node.
                trial.movable[:, state._columns(node)] &= ~anchoring
                experts = np.arange(int(wanted)) % EXPERTS
                assert trial._place_on(li, node, experts) is placed, (li, node, wanted)


def test_a_carried_layer_a_re_plan_would_not_keep_trades_only_what_refill_placed(monkeypatch):
    """``_Carried.trade``: the replicas ``refill`` placed may become other experts and
    move; every other replica stays on its node (the cores, the spread and what survivors
    keep depend on them), and a layer traded balances no worse than before. 36 nodes,
    zipf 1.5: losses of one or two leave the carried layers at 1.065-1.108, over what a
    re-plan keeps (1.052), and their trade brings them to 1.051-1.076."""
    nodes = cluster(36)
    loads = [[1 / (((e + l) % 48) + 1) ** 1.5 for e in range(48)] for l in range(4)]
    old = solver.plan_job(nodes, 48, 4, F, "mro", loads, max_failures=0)
    seen = []
    trade = _Carried.trade

    def watched(self, placed, layers, *args):
        seen.append((placed.copy(), self.refilled.copy(), layers.copy()))
        trade(self, placed, layers, *args)

    monkeypatch.setattr(_Carried, "trade", watched)
    # Trading on with kept replicas free too has its own test (below).
    monkeypatch.setattr(_Carried, "_loose",
                        lambda self, layers: np.zeros(self.slots.shape, bool))
    traded_draws = lowered = 0
    for survivors, names in losses(nodes, draws=6, seed=4, most=2):
        g = per_rank = [4] * len(survivors)
        seen.clear()
        carried = solver.carried_over(old, survivors, loads, names)
        if carried is None or not seen:
            continue
        (untraded, refilled, layers), = seen
        traded_draws += 1
        traded = carried.placements
        # Every other replica is still on its node (it may change GPUs there).
        node = np.repeat(np.arange(len(survivors)), 16)
        kept = held_per_node(np.where(refilled, -1, untraded), node, 48)
        assert (held_per_node(traded, node, 48)[kept > 0] >= kept[kept > 0]).all()
        others = np.setdiff1d(np.arange(4), layers)
        assert np.array_equal(traded[others], untraded[others])
        before = layer_balance(untraded[layers], np.asarray(loads)[layers], g, per_rank)
        after = layer_balance(traded[layers], np.asarray(loads)[layers], g, per_rank)
        assert (after <= before + 1e-12).all()
        assert fill_counts(traded, 48).min() >= F
        lowered += int((after < before - 1e-9).any())
    assert lowered == traded_draws >= 4


def held_per_node(placements: np.ndarray, node: np.ndarray, experts: int) -> np.ndarray:
    """[layer, node, expert]: the replicas each node holds (slots of -1 left out)."""
    layers = len(placements)
    cells = (np.arange(layers)[:, None] * (node.max() + 1) + node) * experts + placements
    return np.bincount(cells[placements >= 0], minlength=layers * (node.max() + 1) * experts
                       ).reshape(layers, -1, experts)


def test_a_layer_near_the_bound_trades_again_with_the_kept_replicas_that_may_leave(
        monkeypatch):
    """``_Carried.trade``: a layer that trading the new replicas leaves over the bound, but
    within 1% of it, trades on with the kept replicas that anchor nothing free too
    (``_loose``, each expert's no more than it may leave). 38 nodes x 4 GPUs x 4 slots,
    E = 64, zipf 1.07: losing node 3, 0 or 5, the first trade leaves a layer at
    1.051-1.060 against the 1.0501 kept; trading on brings each within it, the cores kept
    and every other replica on its node."""
    nodes = [NodeSpec(f"node-{i:02d}", 4, 4, zone=f"zone-{i % 3}") for i in range(38)]
    loads = [[1 / (((e + 7 * l) % 64) + 1) ** 1.07 for e in range(64)] for l in range(4)]
    old = solver.plan_job(nodes, 64, 4, F, "mro", loads, max_failures=0)
    bound = solver._kept_between(old, loads)[1]
    seen = []
    trade, loose = _Carried.trade, _Carried._loose

    def watched_trade(self, placed, *args):
        seen.append((self, placed.copy()))
        trade(self, placed, *args)

    def watched_loose(self, layers):
        seen.append((loose(self, layers), layers.copy()))
        return seen[-1][0]

    monkeypatch.setattr(_Carried, "trade", watched_trade)
    monkeypatch.setattr(_Carried, "_loose", watched_loose)
    rescued = 0
    for lost in (3, 0, 5):
        survivors = [n for i, n in enumerate(nodes) if i != lost]
        names = {n.name for n in survivors}
        seen.clear()
        carried = solver.carried_over(old, survivors, loads, names)
        if len(seen) < 2:  # the first trade sufficed (float sums differ by CPU)
            continue
        (state, untraded), (free, again) = seen
        # Only the layers that trade on free kept replicas.
        assert not np.delete(free, again, axis=0).any()
        # Every replica neither placed by refill nor loose is still on its node.
        node = np.repeat(np.arange(len(survivors)), 16)
        kept = held_per_node(np.where(state.refilled | free, -1, untraded), node, 64)
        assert (held_per_node(carried.placements, node, 64)[kept > 0] >= kept[kept > 0]).all()
        assert fill_counts(carried.placements, 64).min() >= F
        # No expert frees more kept replicas than it may leave (one without a core keeps
        # ``largest`` nodes), and only replicas that anchor nothing are freed.
        layer, slot = np.nonzero(free)
        freed = np.bincount(layer * 64 + state.slots[layer, slot], minlength=4 * 64)
        assert (freed.reshape(4, 64) <= np.maximum(state.leave, 0)).all()
        assert not (free & ~state.movable).any()
        spread = (held_per_node(carried.placements, node, 64) > 0).sum(axis=1)
        coreless = (state.core < 0) & (state.spread >= state.largest)
        assert (spread[coreless] >= state.largest).all()
        step = solver.replan(old, survivors, "NodeLost", names, loads, max_failures=0)
        assert busiest_rank(step.plan, loads) == pytest.approx(carried.balance)
        assert_cores_kept(old, step.plan, {nodes[lost].name})
        # Without trading on, the carry misses the bound.
        with monkeypatch.context() as m:
            m.setattr(_Carried, "_loose", lambda self, layers: np.zeros(self.slots.shape, bool))
            seen.clear()
            missed = solver.carried_over(old, survivors, loads, names).balance > bound
        rescued += missed and carried.balance <= bound
    assert rescued >= 2  # 3 of 3 where written


def test_a_layer_far_over_the_bound_does_not_trade_again(monkeypatch):
    # Further than 1% over what the re-plan keeps, the re-plan searches afresh anyway: the
    # second trade would only cost time (seconds on small clusters).
    nodes = [NodeSpec(f"node-{i:02d}", 4, 4, zone=f"zone-{i % 3}") for i in range(38)]
    loads = [[1 / (((e + 7 * l) % 64) + 1) ** 1.07 for e in range(64)] for l in range(4)]
    old = solver.plan_job(nodes, 64, 4, F, "mro", loads, max_failures=0)
    survivors = nodes[:3] + nodes[4:]
    ordered = solver._order(survivors, 64, 4)
    calls = []
    loose = _Carried._loose
    monkeypatch.setattr(_Carried, "_loose",
                        lambda self, layers: (calls.append(1), loose(self, layers))[1])
    state = _Carried(old, ordered, _survivors(old, ordered, {n.name for n in survivors}),
                     loads)
    assert state.recore() and state.widen()
    placed = state.refill()
    g, per = [4] * len(ordered), [4] * len(ordered)
    # Every layer is more than 1% over a bound of 1.0 (the near case: the test above).
    state.trade(placed, np.arange(4), g, per, 1.0)
    assert (layer_balance(placed, state.loads, g, per) > 1.01).all() and not calls


def test_a_fresh_node_gives_up_slots_in_turn_as_far_as_each_expert_may_leave(plan):
    """``_Carried._place_on``: in its order (slots of experts with spare replicas first,
    then busiest ranks first), a node gives up the slots whose expert may still leave one
    more replica, the earlier slots of that expert counting against it, until every new
    replica has one; the last new replica takes the first slot. A replica given up by an
    expert with replicas to spare is gone; one beyond them is placed again elsewhere."""
    survivors = NODES[1:]
    ordered = solver._order(survivors, EXPERTS, LAYERS)
    rng = np.random.default_rng(7)
    checked = 0
    for _ in range(40):
        state = _Carried(plan, ordered, _survivors(plan, ordered, {n.name for n in survivors}),
                         LOADS)
        li, node = int(rng.integers(LAYERS)), int(rng.integers(len(ordered)))
        columns = state._columns(node)
        # Some experts may leave none, some one, some more; some have none to spare.
        state.leave[li] = rng.integers(0, 3, EXPERTS)
        state.spare[li] = np.minimum(rng.integers(0, 2, EXPERTS), state.leave[li])
        open_ = np.flatnonzero(state.movable[li, columns] & ~state.used[li, columns])
        if not len(open_):
            continue
        experts = rng.choice(EXPERTS, int(rng.integers(1, len(open_) + 2)), replace=False)
        before = copy.deepcopy(state)
        done = state._place_on(li, node, experts)
        # What the node's slots should become, one slot at a time.
        order = columns.start + open_
        order = order[np.lexsort((-before.rank_load[li, before.rank_of[order]],
                                  before.spare[li, before.slots[li, order]] == 0))]
        leave, spare = before.leave[li].copy(), before.spare[li].copy()
        removed, displaced, left = np.zeros(EXPERTS, int), np.zeros(EXPERTS, int), list(experts)
        placed, used = before.placed[li].copy(), before.used[li].copy()
        for slot in order:
            was = before.slots[li, slot]
            if left and leave[was] > 0:
                leave[was] -= 1
                removed[was] += 1
                if spare[was] > 0:
                    spare[was] -= 1
                else:
                    displaced[was] += 1
                placed[slot], used[slot] = left.pop(), True
        assert done == (not left)
        assert (state.placed[li] == placed).all() and (state.used[li] == used).all()
        assert (state.leave[li] == leave).all() and (state.spare[li] == spare).all()
        assert (state.removed[li] - before.removed[li] == removed).all()
        assert (state.displaced[li] - before.displaced[li] == displaced).all()
        assert (state.added[li] - before.added[li]
                == np.bincount(experts[::-1][:len(experts) - len(left)],
                               minlength=EXPERTS)).all()
        checked += 1
    assert checked >= 30


def test_every_replica_given_up_counts_against_what_its_expert_may_leave(plan):
    """``leave`` is how many more of an expert's replicas may go (``_loose`` frees no more):
    each one ``recore`` and ``widen`` give up for new replicas lowers it by one, so an
    expert without a core still keeps ``largest`` nodes once the layer trades on."""
    widened = 0
    for survivors, names in losses(NODES, draws=30, seed=9, most=4):
        ordered = solver._order(survivors, EXPERTS, LAYERS)
        held = _survivors(plan, ordered, names)
        if held is None:
            continue
        state = _Carried(plan, ordered, held, LOADS)
        leave = state.leave.copy()
        if not state.recore():
            continue
        after_recore = state.removed.sum()
        if not state.widen():
            continue
        widened += state.removed.sum() > after_recore
        assert (state.leave + state.removed == leave).all()
    assert widened >= 3
