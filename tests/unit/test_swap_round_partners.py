"""A swap round pairs each layer's busiest ranks with lighter ones (balance._exchange): with
many layers at work, only each row's two ends are ordered (balance._ends), and they must be
exactly where a stable sort of the whole row puts them, ties included."""
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from lazarus_core import balance


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_both_ends_are_where_a_stable_sort_puts_them(data):
    rows = data.draw(st.integers(1, 3 * balance.PARTIAL_ROWS))
    width = data.draw(st.integers(2, 400))
    half = width // 2
    pairs = min(half, balance.MAX_PAIRS)
    t = data.draw(st.integers(0, balance.MAX_ROUNDS - 1))
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    # Loads with many ties (few distinct values) as well as distinct ones.
    distinct = data.draw(st.sampled_from([2, 5, 1000]))
    x = rng.integers(0, distinct, (rows, width)) / 4.0
    places = (np.arange(pairs) + t) % half
    order = np.argsort(x, axis=1, kind="stable")
    heavy, light = balance._ends(x, pairs, places)
    assert (heavy == order[:, ::-1][:, :pairs]).all()
    assert (light == order[:, places]).all()
