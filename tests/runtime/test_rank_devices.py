"""Where a node's rank processes run, and which collective backend their generation uses:
NCCL only when every rank has a GPU of its own (it refuses two ranks on one GPU), gloo when
ranks share GPUs or have none; members that disagree are stopped before they build a group."""
from __future__ import annotations

import threading

import pytest
import torch.distributed as dist
from lazarus_core import process_env as penv

from gloo_harness import free_port
from lazarus_runtime.devices import (collective_backend, parse_visible_gpus, place_ranks,
                                     share_machine)
from lazarus_runtime.process_group import BackendMismatch, join_generation


@pytest.mark.parametrize("ranks, gpus, expected, backend", [
    (2, ["0", "1"], ["0", "1"], "nccl"),               # a GPU per rank: a pod on a cluster
    (4, ["0", "1"], ["0", "1", "0", "1"], "gloo"),     # more ranks than GPUs: shared
    (2, ["0"], ["0", "0"], "gloo"),                    # one GPU for the whole node
    (3, [], [None, None, None], "gloo"),               # no GPU: every rank on the CPU
    (1, ["GPU-5f0e"], ["GPU-5f0e"], "nccl"),           # GPUs named by UUID
])
def test_ranks_take_gpus_in_turn_and_share_only_over_gloo(ranks, gpus, expected, backend):
    placed = place_ranks(ranks, gpus)
    assert [r.local_rank for r in placed] == list(range(ranks))
    assert [r.gpu for r in placed] == expected
    assert collective_backend(placed) == backend


def test_ranks_of_several_nodes_sharing_the_machines_gpus_use_gloo():
    # Two simulated nodes of two ranks each on a two-GPU machine: each node alone would
    # have a GPU per rank, but rank 0 of both nodes is on GPU 0.
    node_a, node_b = place_ranks(2, ["0", "1"]), place_ranks(2, ["0", "1"])
    assert collective_backend(node_a) == "nccl"
    assert collective_backend(node_a + node_b) == "gloo"


@pytest.mark.parametrize("nodes, per_node, gpus, backend", [
    (2, 2, ["0"], "gloo"), (2, 2, ["0", "1"], "gloo"), (2, 2, ["0", "1", "2"], "gloo"),
    (2, 2, list("0123"), "nccl"), (2, 3, ["0", "1"], "gloo"), (3, 1, [], "gloo"),
])
def test_simulated_nodes_take_the_machines_gpus_in_turn(nodes, per_node, gpus, backend):
    shares, chosen = share_machine(nodes, per_node, gpus)
    assert chosen == backend
    # Each agent, placing its ranks over its share, lands them where a round-robin over
    # the whole machine would.
    placed = [r.gpu for share in shares for r in place_ranks(per_node, share)]
    expected = [gpus[k % len(gpus)] if gpus else None for k in range(nodes * per_node)]
    assert placed == expected


def test_a_node_without_ranks_is_refused():
    with pytest.raises(ValueError, match="gpusPerNode"):
        place_ranks(0, ["0"])


@pytest.mark.parametrize("value, gpus", [
    ("0,1", ["0", "1"]), ("", []), ("3, 1", ["3", "1"]), ("2,-1,3", ["2"]),
    ("GPU-5f0e,GPU-77aa", ["GPU-5f0e", "GPU-77aa"]),
])
def test_visible_gpus_are_read_as_cuda_reads_them(value, gpus):
    assert parse_visible_gpus(value) == gpus


def test_a_rank_reads_the_device_and_backend_its_agent_gives_it():
    base = {penv.COORDINATOR: "h:1", penv.NODE_NAME: "n", penv.RUNTIME: "{}",
            penv.JOB: "job", penv.JOB_KEY: penv.new_job_key()}
    on_gpu = penv.read_worker_env(base | penv.rank_env(1, "GPU-5f0e", "nccl"))
    assert (on_gpu.local_rank, on_gpu.device, on_gpu.backend) == (1, "cuda", "nccl")
    cpu_env = penv.rank_env(0, None, "gloo")
    assert cpu_env[penv.CUDA_VISIBLE_DEVICES] == ""  # a CPU rank sees no GPU at all
    on_cpu = penv.read_worker_env(base | cpu_env)
    assert (on_cpu.local_rank, on_cpu.device, on_cpu.backend) == (0, "cpu", "gloo")
    alone = penv.read_worker_env(base)  # a worker started without an agent
    assert (alone.local_rank, alone.device, alone.backend) == (0, "cpu", "gloo")


def test_an_unknown_backend_names_the_variable():
    with pytest.raises(penv.EnvError, match=penv.BACKEND):
        penv.read_worker_env({penv.COORDINATOR: "h:1", penv.NODE_NAME: "n",
                              penv.RUNTIME: "{}", penv.JOB: "job",
                              penv.JOB_KEY: penv.new_job_key(), penv.BACKEND: "mpi"})
    with pytest.raises(ValueError, match="backend"):
        join_generation(None, 1, 0, 2, backend="mpi")


def test_members_with_different_backends_stop_before_building_a_group():
    store = dist.TCPStore("127.0.0.1", free_port(), is_master=True, wait_for_workers=False)
    errors = {}

    def member(rank: int, backend: str) -> None:
        try:
            join_generation(store, 7, rank, 2, timeout_s=10, backend=backend)
        except BackendMismatch as e:
            errors[rank] = str(e)

    threads = [threading.Thread(target=member, args=(r, b))
               for r, b in enumerate(("gloo", "nccl"))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=15)
    assert sorted(errors) == [0, 1]
    assert "1 of 2 ranks use another collective backend" in errors[0]
    assert "gpusPerNode" in errors[0]
