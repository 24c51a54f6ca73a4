"""What is being trained and what the fault-handling operations cost, in seconds and bytes.

The GPT presets carry the paper's model facts (experts, layers, bytes per expert with
optimizer state; paper-notes.md). Step times and the cost constants are our assumptions,
stated in docs/reproduction; every one can be overridden from a config file.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import numpy as np

from lazarus_core.migration import Migration


@dataclass(frozen=True)
class ModelSpec:
    name: str
    experts: int
    layers: int
    expert_mb: float  # one expert of one layer: weights + optimizer state (paper: 63 / 112 MB)
    dense_gb: float  # all non-expert parameters with their optimizer state
    step_s: float  # one training step when every rank computes the same number of tokens
    # Share of step_s spent in expert FFNs and their all-to-alls: the part that waits for the
    # busiest rank. The rest (attention, dense layers) is the same on every rank.
    expert_fraction: float = 0.5
    batch_per_gpu: int = 4  # samples per GPU per step (paper: 4 sequences of 1024 tokens)

    @property
    def state_gb(self) -> float:
        return self.dense_gb + self.layers * self.experts * self.expert_mb / 1000


# Dense state = (total params - expert params) x 16 bytes (fp16 weights, fp32 master + Adam).
# Step times: the paper's GPT-M runs at 45 samples/s on 10 GPUs x 4 samples (0.89 s a step);
# GPT-S and GPT-L are scaled from it by active parameters per token.
PRESETS = {
    "gpt-s": ModelSpec("GPT-S", experts=8, layers=12, expert_mb=63, dense_gb=2.3, step_s=0.6),
    "gpt-m": ModelSpec("GPT-M", experts=12, layers=12, expert_mb=112, dense_gb=4.6, step_s=0.89),
    "gpt-l": ModelSpec("GPT-L", experts=16, layers=12, expert_mb=112, dense_gb=5.7, step_s=1.1),
}


@dataclass(frozen=True)
class Costs:
    checkpoint_gb_per_s: float = 1.0  # writing a full checkpoint (all ranks together)
    restore_gb_per_s: float = 2.0  # reading it back
    restart_s: float = 60.0  # relaunch every process, init communicators and data loaders
    # Lazarus's fixed cost of a reconfiguration, in two parts. Paper Table 2: 20-40 s in total,
    # of which transfers were 2-8 s and the rest, 18 s on average, was 10-20 s waiting for NCCL
    # timeouts and 5-15 s building new communicator groups. Only a loss has a timeout to wait
    # out: growing, rebalancing and moving off a node under a spot notice are planned.
    detect_s: float = 12.0  # from a node's loss until the survivors know of it
    rebuild_s: float = 6.0  # new communicator groups for a new plan
    link_gb_per_s: float = 0.5  # expert migration per node; fits Table 2's GPT-L transfers

    def checkpoint_s(self, model: ModelSpec) -> float:
        return model.state_gb / self.checkpoint_gb_per_s

    def load_s(self, model: ModelSpec) -> float:
        return model.state_gb / self.restore_gb_per_s

    def fixed_reconfiguration_s(self, lost: bool) -> float:
        return self.rebuild_s + (self.detect_s if lost else 0.0)

    def restart_total_s(self, model: ModelSpec) -> float:
        """A full job restart: new processes, then the checkpoint read back."""
        return self.restart_s + self.load_s(model)

    def migration_s(self, model: ModelSpec, migration: Migration) -> float:
        """Transfers run in parallel; the node that sends or receives the most sets the time."""
        sent = Counter(t.source for t in migration.transfers)
        received = Counter(t.destination for t in migration.transfers)
        busiest = max([*sent.values(), *received.values()], default=0)
        return busiest * model.expert_mb / 1000 / self.link_gb_per_s


def differing_loads(experts: int, layers: int, skew: float, seed: int) -> list[list[float]]:
    """Token loads ``[layer][expert]`` whose layers differ in shape, not only in which
    expert is hot, as measured MoE routing does: per layer a zipf exponent within 0.3 of
    ``skew``, lognormal(0, 0.2) noise per expert and a random order (rounded, so that the
    loads do not depend on float printing). The solver's tests and benchmark use them."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(layers):
        exponent = max(skew + rng.uniform(-0.3, 0.3), 0.0)
        t = rng.lognormal(0, 0.2, experts) / np.arange(1, experts + 1) ** exponent
        out.append([round(float(x), 9) for x in rng.permutation(t)])
    return out
