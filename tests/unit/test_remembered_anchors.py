"""The anchor search remembers the shapes it has weighed (``anchor_search.best_anchors``): a
remembered shape must be exactly what a cold search gives, and a shape that differs in any
input (counts, slots, loads, search or not) must not be taken for another."""
from lazarus_core.anchor_search import _best_anchors, best_anchors, forget_anchors

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
