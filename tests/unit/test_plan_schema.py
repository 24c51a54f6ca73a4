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


def test_each_rank_is_a_process_named_by_its_node_and_gpu():
    plan = _plan()
    node = plan.nodes[1]
    assert node.devices == (0, 1)
    assert plan.members()[f"{node.name}/1"] == node.ranks[1]
    assert list(plan.members().values()) == list(range(plan.world_size))
    # Plans written before nodes named their GPUs read as GPUs 0..n-1.
    d = plan.to_dict()
    for n in d["nodes"]:
        del n["devices"]
    assert Plan.from_dict(d) == plan


def test_a_node_that_lost_a_gpu_names_the_gpus_left():
    d = _plan().to_dict()
    d["nodes"][0]["devices"] = [1, 1]
    d["nodes"][2]["name"] = "a/b"
    with pytest.raises(PlanError) as err:
        Plan.from_dict(d)
    fields = " ".join(err.value.violations)
    assert "nodes[0].devices" in fields and "nodes[2].name" in fields


def test_the_per_rank_view_holds_each_ranks_slots_under_its_process_name():
    plan = _plan()
    view = plan.by_rank()
    assert view.world_size == plan.world_size == len(view.nodes)
    assert [n.name for n in view.nodes] == list(plan.members())
    for layer in range(len(plan.layers)):
        for rank in range(plan.world_size):
            assert view.rank_experts(layer, rank) == plan.rank_experts(layer, rank)


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


def test_slots_that_disagree_only_with_the_counts_are_named():
    # Every node's slot count and every expert id in order: only the counts say otherwise.
    # The layers are checked all at once first, and that check must still see it.
    d = _plan().to_dict()
    slots = d["layers"][1]["placement"][0]
    was = slots[0]
    slots[0] = (was + 1) % 6
    with pytest.raises(PlanError) as err:
        Plan.from_dict(d)
    other, said = (was + 1) % 6, d["layers"][1]["replicas"]
    assert sorted(err.value.violations) == sorted([
        f"layers[1].replicas[{was}]: says {said[was]}, placement holds {said[was] - 1}",
        f"layers[1].replicas[{other}]: says {said[other]}, placement holds {said[other] + 1}"])


def test_expert_ids_out_of_range_are_named():
    d = _plan().to_dict()
    d["layers"][1]["placement"][3][0] = 99
    with pytest.raises(PlanError, match=r"layers\[1\].placement\[3\]: expert ids must be in 0..5"):
        Plan.from_dict(d)
