"""The anchor search remembers the shapes it has weighed (``anchor_search.best_anchors``), and
a search the layers it has aligned (``anchors.align``): a remembered shape must be exactly
what a cold search gives, and a shape that differs in any input (counts, slots, loads,
search or not, the template's cores) must not be taken for another."""
import numpy as np

from lazarus_core.anchor_search import _best_anchors, best_anchors, forget_anchors
from lazarus_core.anchors import align
from lazarus_core.mro import per_replica

REPLICAS = [12, 11, 11] + [2] * 13  # 16 experts on 10 nodes x 6 slots
HOT_FIRST = [1.0 / (e + 1) for e in range(16)]
SHAPES = [
    (REPLICAS, [6] * 10, HOT_FIRST, True),
    (REPLICAS, [6] * 10, HOT_FIRST[::-1], True),  # other loads: other anchors
    (REPLICAS, [6] * 10, HOT_FIRST, False),  # the construction alone: other anchors
    ([12, 12, 12] + [2] * 6, [4] * 12, [1.0] * 9, True),
]


def test_a_remembered_shape_is_what_a_cold_search_gives():
    cold = []
    for shape in SHAPES:
        forget_anchors()
        cold.append(best_anchors(*shape))
    assert len(set(cold[:3])) == 3  # the shapes differ only in what the key must hold
    forget_anchors()
    assert [best_anchors(*shape) for shape in SHAPES + SHAPES] == cold + cold
    assert _best_anchors.cache_info().hits == len(SHAPES)
    # Lists, tuples and numpy-made floats of the same shape are one shape.
    assert best_anchors(tuple(REPLICAS), tuple([6] * 10), tuple(HOT_FIRST)) == cold[0]
    assert _best_anchors.cache_info().hits == len(SHAPES) + 1


def test_aligned_layers_remembered_are_what_aligning_afresh_gives():
    # ``anchors.align``'s memo (a search aligns variant after variant on one cluster): a
    # layer that differs in counts, in weights alone, or in the template's cores must not
    # be taken for another.
    slots = [6] * 10
    layers = [REPLICAS, [10, 10, 8, 4, 4, 4] + [2] * 10, [14, 9, 7, 4, 4] + [2] * 11,
              [9, 9, 9, 7, 4] + [2] * 11]
    loads = np.array([[1 / (e + 1) ** s for e in range(16)] for s in (1.0, 1.2, 0.8, 0.5)])
    hot = per_replica(layers, loads).tolist()
    cold = per_replica(layers, loads[:, ::-1]).tolist()
    template, other = (best_anchors(layers[i], slots, hot[i]) for i in (0, 1))
    calls = [(template, hot), (template, cold), (other, hot)]
    fresh = [align(layers, t, slots, w, w[0], 10) for t, w in calls]
    assert fresh[0][1:] != fresh[1][1:] and fresh[0][1:] != fresh[2][1:]
    memo: dict = {}
    assert [align(layers, t, slots, w, w[0], 10, memo) for t, w in calls + calls] == fresh * 2
    assert len(memo) == 9  # layers 1-3 of each call: layer 0 takes the template's anchors
