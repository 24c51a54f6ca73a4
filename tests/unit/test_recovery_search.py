"""The local search on recovery (lazarus_core.recovery_search): the swaps it skips without
counting fatal sets are swaps that could never have lowered them."""
from unittest import mock

from hypothesis import given, settings
from hypothesis import strategies as st

from lazarus_core import recovery_search as rs
from lazarus_core.recovery import fatal_counts


@st.composite
def layers(draw):
    """One or two layers of n nodes x c slots, every expert placed at least once."""
    n = draw(st.integers(2, 7))
    c = draw(st.integers(1, 4))
    num_experts = draw(st.integers(1, n * c))
    out = []
    for _ in range(draw(st.integers(1, 2))):
        pool = list(range(num_experts)) + draw(st.lists(
            st.integers(0, num_experts - 1), min_size=n * c - num_experts,
            max_size=n * c - num_experts))
        pool = draw(st.permutations(pool))
        out.append([pool[i * c:(i + 1) * c] for i in range(n)])
    return out


@settings(max_examples=300, deadline=None)
@given(layers(), st.data())
def test_a_skipped_swap_never_lowers_a_fatal_count(placements, data):
    n = len(placements[0])
    k = data.draw(st.integers(1, n - 1)) if n > 1 else 1
    search = rs._Search([[list(s) for s in p] for p in placements], k, None)
    moves = list(search._moves())
    if not moves:
        return
    li, a, x, b, y = data.draw(st.sampled_from(moves))
    old_x, old_y = search.masks[li, x], search.masks[li, y]
    new_x, new_y = search._new_mask(li, x, a, b), search._new_mask(li, y, b, a)
    if search._may_lower(old_x, new_x, old_y, new_y):
        return
    before = fatal_counts(search.masks.values(), n, k)
    masks = dict(search.masks)
    masks[li, x], masks[li, y] = new_x, new_y
    after = fatal_counts(masks.values(), n, k)
    assert all(was <= now for now, was in zip(after, before)), (before, after)


@settings(max_examples=100, deadline=None)
@given(layers(), st.data())
def test_skipping_leaves_the_search_where_it_was(placements, data):
    # Every swap counted in full, to the end of the budget or of a pass with none kept
    # (as before the skips), and with the skips: the same placements.
    n = len(placements[0])
    k = data.draw(st.integers(1, n - 1)) if n > 1 else 1
    skipping = rs.improve(placements, k)
    with mock.patch.object(rs._Search, "_may_lower", lambda *_: True), \
            mock.patch.object(rs._Search, "_stuck", lambda _: False):
        counting = rs.improve(placements, k)
    assert skipping == counting
