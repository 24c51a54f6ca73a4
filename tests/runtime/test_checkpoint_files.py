"""Checkpoint files: every expert saved exactly once, and a damaged file is refused."""
from __future__ import annotations

import pytest
import torch

from lazarus_core.solver import plan_job
from lazarus_core.topology import NodeSpec
from lazarus_runtime import checkpoint


@pytest.mark.parametrize("policy", ["mro", "spread", "compact"])
@pytest.mark.parametrize("nodes,slots,min_replicas", [(4, 4, 2), (5, 3, 3), (3, 6, 1)])
def test_each_expert_is_owned_once_by_its_lowest_ranked_holder(policy, nodes, slots,
                                                                min_replicas):
    specs = [NodeSpec(f"n{i}", gpus=1, slots_per_gpu=slots, zone=f"z{i % 2}")
             for i in range(nodes)]
    plan = plan_job(specs, experts=4, layers=2, min_replicas=min_replicas, policy=policy)
    owned = {rank: checkpoint.owned_experts(plan, rank) for rank in range(plan.world_size)}
    keys = [key for keys in owned.values() for key in keys]
    assert sorted(keys) == [(layer, e) for layer in range(2) for e in range(4)]
    for rank, keys in owned.items():
        for layer, e in keys:
            holders = [r for r in range(plan.world_size) if e in plan.rank_experts(layer, r)]
            assert rank == min(holders)


def test_a_corrupt_shard_is_refused_and_an_unfinished_checkpoint_ignored(tmp_path):
    state = {"w": torch.arange(4.0)}
    info = checkpoint.write_shard(tmp_path, 5, 0, {(0, 0): state}, dense=state)
    checkpoint.write_manifest(tmp_path, 5, [info])
    checkpoint.write_shard(tmp_path, 10, 0, {(0, 0): state}, dense=state)
    # Step 10 has a shard but no manifest: it never finished, step 5 is the latest.
    ck = checkpoint.latest(tmp_path)
    assert ck.step == 5
    dense, experts = ck.load({(0, 0)})
    assert torch.equal(experts[(0, 0)]["w"], state["w"]) and torch.equal(dense["w"], state["w"])

    shard = checkpoint.step_dir(tmp_path, 5) / info["file"]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte
    shard.write_bytes(bytes(data))
    with pytest.raises(checkpoint.CheckpointError, match="checksum mismatch"):
        ck.load({(0, 0)})
