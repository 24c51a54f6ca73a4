"""A layer whose experts saw no token yet (every load 0, as the runtime reports before a
layer's first measured step) is planned as if its experts were equal, by every step of the
solver alike: the allocation always did, and the fill's weighing divided by its zero sum."""
import warnings

from lazarus_core.balance import busiest_rank
from lazarus_core.solver import plan_job, replan
from lazarus_core.topology import NodeSpec

NODES = [NodeSpec(f"node-{i}", 8, 4) for i in range(16)]
MEASURED = [int(1000 / (e + 1)) for e in range(64)]


def test_an_idle_layer_is_planned_as_equal_loads_without_warnings():
    idle = [MEASURED, MEASURED[::-1], [0] * 64, MEASURED]
    equal = [MEASURED, MEASURED[::-1], [1] * 64, MEASURED]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a 0/0 anywhere in the solver fails here
        plan = plan_job(NODES, 64, 4, 2, loads=idle)
        survivors = NODES[:-2]
        after = replan(plan, survivors, "NodeLost", {n.name for n in survivors}, idle)
    assert plan.to_compact_json() == plan_job(NODES, 64, 4, 2, loads=equal).to_compact_json()
    assert busiest_rank(after.plan, equal) <= 1.05
    assert after.migration.recoverable
