import json

import pytest

from lazarus_core.plan import SCHEMA_VERSION, Plan, PlanError
from lazarus_core.solver import plan_job
from lazarus_core.topology import NodeSpec


def _plan():
    nodes = [NodeSpec(f"n{i}", gpus=2, slots_per_gpu=2, zone=f"z{i % 2}") for i in range(4)]
    return plan_job(nodes, experts=6, layers=2, min_replicas=2)


def test_plan_round_trips_through_json():
    plan = _plan()
    again = Plan.from_json(plan.to_json())
    assert again == plan
    assert json.loads(plan.to_json())["version"] == SCHEMA_VERSION


def test_ranks_map_to_the_slots_of_their_node():
    plan = _plan()
    assert plan.world_size == 8
    node0 = plan.nodes[0]
    slots = plan.layers[1].placement[0]
    assert plan.rank_experts(1, node0.ranks[0]) == slots[:2]
    assert plan.rank_experts(1, node0.ranks[1]) == slots[2:]
    with pytest.raises(KeyError):
        plan.rank_experts(0, 99)


def test_every_violation_is_reported_with_its_field():
    d = _plan().to_dict()
    d["layers"][0]["replicas"][0] += 1
    d["layers"][1]["placement"][2].append(0)
    d["nodes"][1]["ranks"] = [0, 1]
    d["recovery"]["2"] = 1.5
    with pytest.raises(PlanError) as err:
        Plan.from_dict(d)
    fields = " ".join(err.value.violations)
    for field in ("layers[0].replicas[0]", "layers[1].placement[2]", "nodes[].ranks",
                  "recovery[2]"):
        assert field in fields


def test_wrong_types_and_versions_are_rejected_before_use():
    with pytest.raises(PlanError, match="version"):
        Plan.from_dict(dict(_plan().to_dict(), version="v0"))
    with pytest.raises(PlanError, match="generation: must be an integer"):
        Plan.from_dict(dict(_plan().to_dict(), generation="2"))
    with pytest.raises(PlanError, match="not valid JSON"):
        Plan.from_json("{")


def test_compact_encoding_round_trips_and_the_reader_takes_both():
    plan = _plan()
    compact = plan.to_compact_json()
    envelope = json.loads(compact)
    assert envelope["version"] == SCHEMA_VERSION and envelope["encoding"] == "zlib+base64"
    assert Plan.from_json(compact) == plan == Plan.from_json(plan.to_json())


def test_a_large_plan_compresses_to_a_fraction_of_its_json():
    nodes = [NodeSpec(f"node-{i:03d}", 8, 4, zone=f"z{i % 4}") for i in range(64)]
    plan = plan_job(nodes, experts=64, layers=8, min_replicas=2, max_failures=0,
                    loads=[[1 / (e + 1) for e in range(64)]] * 8)
    assert len(plan.to_compact_json()) * 4 < len(plan.to_json())
    assert Plan.from_json(plan.to_compact_json()) == plan


@pytest.mark.parametrize("change,field", [
    ({"encoding": "gzip"}, "encoding"),
    ({"data": "not base64!"}, "data"),
    ({"data": "aGVsbG8="}, "data"),  # base64 of b"hello": not zlib
    ({"version": "lazarus.dev/plan/v0"}, "version"),
])
def test_a_damaged_compact_plan_names_the_field(change, field):
    envelope = dict(json.loads(_plan().to_compact_json()), **change)
    with pytest.raises(PlanError) as err:
        Plan.from_json(json.dumps(envelope))
    assert err.value.violations[0].startswith(field)


def test_expert_ids_out_of_range_are_named():
    d = _plan().to_dict()
    d["layers"][1]["placement"][3][0] = 99
    with pytest.raises(PlanError, match=r"layers\[1\].placement\[3\]: expert ids must be in 0..5"):
        Plan.from_dict(d)
