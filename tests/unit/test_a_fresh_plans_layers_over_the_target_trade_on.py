"""A fresh plan's layers still over the balance target after the fill trade counts on
(lazarus_core.balance.traded_on): they balance no worse, and the anchors, each layer's
fewest replicas and the plan's fatal failure sets stay as they were."""
from __future__ import annotations

import numpy as np
import pytest

from lazarus_core import balance, count_trading, mro
from lazarus_core.anchor_search import largest_core
from lazarus_core.anchors import anchor_greedily, anchored_replicas
from lazarus_core.balance import BALANCE_TARGET, fill_counts, layer_balance, traded_on
from lazarus_core.mro import per_replica, place_anchored
from lazarus_core.recovery import fatal_counts, minimal_masks
from lazarus_core.solver import allocate_layers

NODES, GPUS, PER_GPU, EXPERTS, LAYERS = 12, 4, 2, 32, 3


def zipf(skew: float) -> list[list[float]]:
    return [[1 / (((e + 7 * l) % EXPERTS) + 1) ** skew for e in range(EXPERTS)]
            for l in range(LAYERS)]


def untraded_fill(loads):
    """A fill that trades no counts (as one whose shared budget ran out would leave its
    layers), and its anchors."""
    slots = [GPUS * PER_GPU] * NODES
    counts = allocate_layers(loads, LAYERS, EXPERTS, sum(slots), 2)
    weights = per_replica(np.asarray(counts), np.asarray(loads)).tolist()
    anchors = [anchor_greedily(r, w, [], slots, largest_core(NODES))
               for r, w in zip(counts, weights)]
    return place_anchored(anchors, slots, loads, [GPUS] * NODES, None, trade=False), anchors


def node_sets(placed: np.ndarray) -> np.ndarray:
    """[layer * expert, node]: which nodes hold each expert."""
    node = np.repeat(np.arange(NODES), GPUS * PER_GPU)
    held = np.zeros((LAYERS, EXPERTS, NODES), dtype=bool)
    held[np.arange(LAYERS)[:, None], placed, node] = True
    return held.reshape(-1, NODES)


@pytest.mark.parametrize("skew", [1.2, 1.6])
def test_layers_over_the_target_trade_on_and_keep_their_anchors(skew):
    loads = zipf(skew)
    placed, anchors = untraded_fill(loads)
    g, per = [GPUS] * NODES, [PER_GPU] * NODES
    before = layer_balance(placed, np.asarray(loads), g, per)
    over = before > BALANCE_TARGET
    assert over.any()  # the case this step exists for
    out = traded_on(placed, anchored_replicas(anchors), loads, g, per, largest_core(NODES))
    after = layer_balance(out, np.asarray(loads), g, per)
    assert (after <= before + 1e-12).all()
    assert (after[over] < before[over] - 1e-6).any()
    assert np.array_equal(out[~over], placed[~over])
    # Every anchored replica is still on its node, as its expert.
    node = np.repeat(np.arange(NODES), GPUS * PER_GPU)
    held = {(li, int(node[p]), int(out[li, p])) for li in range(LAYERS)
            for p in range(out.shape[1])}
    assert {tuple(map(int, row)) for row in anchored_replicas(anchors)} <= held
    # No layer's fewest replicas fall, and the fatal node sets are those of the fill.
    assert (fill_counts(out, EXPERTS).min(axis=1)
            >= fill_counts(placed, EXPERTS).min(axis=1)).all()
    k = largest_core(NODES)
    assert (fatal_counts(minimal_masks(node_sets(out), k), NODES, k)
            == fatal_counts(minimal_masks(node_sets(placed), k), NODES, k))


def test_a_plan_within_the_target_is_left_as_filled():
    loads = zipf(0.0)
    placed, anchors = untraded_fill(loads)
    g, per = [GPUS] * NODES, [PER_GPU] * NODES
    assert (layer_balance(placed, np.asarray(loads), g, per) <= BALANCE_TARGET).all()
    assert traded_on(placed, anchored_replicas(anchors), loads, g, per,
                     largest_core(NODES)) is placed


def test_a_fresh_plan_trades_on_what_its_fill_left_over(monkeypatch):
    # mro.filled hands traded_on the fill taken and that fill's anchors.
    seen = []

    def watched(placed, anchored, *args):
        seen.append((placed.copy(), np.asarray(anchored)))
        return traded_on(placed, anchored, *args)

    monkeypatch.setattr(mro, "traded_on", watched)
    # The fill trades nothing, so that it leaves layers over the target.
    monkeypatch.setattr(balance, "MAX_EVALUATIONS", 0)
    monkeypatch.setattr(count_trading, "FILL_EVALUATIONS", 0)
    loads = zipf(1.2)
    slots = [GPUS * PER_GPU] * NODES
    counts = allocate_layers(loads, LAYERS, EXPERTS, sum(slots), 2)
    out = mro.filled(counts, slots, loads, [GPUS] * NODES)
    (placed, anchored), = seen
    node = np.repeat(np.arange(NODES), GPUS * PER_GPU)
    assert len(anchored) and all(placed[li, node == n].tolist().count(e) >= 1
                                 for li, n, e in anchored.tolist())
    g, per = [GPUS] * NODES, [PER_GPU] * NODES
    before = layer_balance(placed, np.asarray(loads), g, per)
    assert (before > BALANCE_TARGET).any()
    assert (layer_balance(out, np.asarray(loads), g, per) < before - 1e-6).any()
