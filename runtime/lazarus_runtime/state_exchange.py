"""Moving expert and dense state between workers after a reconfiguration.

The solver's transfer list says which surviving holder sends which (layer, expert) to which
node, with the senders already spread over the holders. Every transfer is one flat fp32
message (parameters, then AdamW's moments and step count); all of a reconfiguration's
messages, and the dense parameters with their optimizer state for joining workers, travel
in one uneven all-to-all of the generation's group, so they overlap, and the wait is the
collectives' own: bounded, and interrupted by a newer generation. (Point-to-point sends
would need waits of their own: a gloo send cannot be polled, and a timed wait on it closes
the connection when the peer posts its receive a moment late.)

Both ends know every message's layout without asking: all experts share one shape, and the
optimizer state exists exactly when at least one step has been committed.
"""
from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence

import torch
from lazarus_core.plan import ExpertKey, Transfer
from lazarus_core.runtime_config import ModelConfig

from .collectives import Collectives
from .engine import Engine
from .experts import expert_shapes
from .model import dense_parameter_shapes

Layout = list[tuple[str, torch.Size]]

_OPTIMIZER_KEYS = ("exp_avg", "exp_avg_sq", "step")


@functools.lru_cache(maxsize=4)
def _shapes(cfg: ModelConfig) -> tuple[tuple, tuple]:
    """(expert, dense) parameter names and shapes: a joiner knows them before it has state."""
    return (tuple((n, torch.Size(s)) for n, s in expert_shapes(cfg.dim, cfg.ffn_dim).items()),
            dense_parameter_shapes(cfg))


def layout(named_shapes: Sequence[tuple[str, torch.Size]], stepped: bool) -> Layout:
    out = []
    for name, shape in named_shapes:
        out.append((name, shape))
        if stepped:
            out += [(f"{name}/exp_avg", shape), (f"{name}/exp_avg_sq", shape),
                    (f"{name}/step", torch.Size([]))]
    return sorted(out)


def pack(state: Mapping[str, torch.Tensor], lay: Layout) -> torch.Tensor:
    missing = [name for name, _ in lay if name not in state]
    if missing:
        raise ValueError(f"state: missing {missing[:3]} for the agreed layout")
    return torch.cat([state[name].detach().reshape(-1).to(torch.float32).cpu()
                      for name, _ in lay])


def unpack(flat: torch.Tensor, lay: Layout) -> dict[str, torch.Tensor]:
    sizes = [shape.numel() for _, shape in lay]
    if flat.numel() != sum(sizes):
        raise ValueError(f"state: a message of {flat.numel()} values for a layout of "
                         f"{sum(sizes)}")
    return {name: part.reshape(shape).clone()
            for (name, shape), part in zip(lay, flat.split(sizes))}


def exchange(comm: Collectives, cfg: ModelConfig, engine: Engine | None, me: str,
             ranks: Mapping[str, int], transfers: Sequence[Transfer], joiners: Sequence[str],
             dense_source: str | None, stepped: bool) -> tuple[dict[ExpertKey, dict], dict | None]:
    """Send and receive every message this worker takes part in, in one all-to-all that
    every member of the generation's group calls.

    ``engine`` is None on a worker that holds no state yet (it only receives). Returns
    (incoming expert states, incoming dense state or None). Between two ranks, messages go
    in one agreed order: the transfers in the directive's order, then the dense state.
    """
    expert_shapes, dense_shapes = _shapes(cfg)
    expert_lay = layout(expert_shapes, stepped)
    dense_lay = layout(dense_shapes, stepped)
    expert_n = sum(s.numel() for _, s in expert_lay)
    dense_n = sum(s.numel() for _, s in dense_lay)
    world = comm.world_size
    outgoing: list[list[torch.Tensor]] = [[] for _ in range(world)]
    # Per source rank, what arrives from it, in order: (expert key or None for dense, size).
    arriving: list[list[tuple[ExpertKey | None, int]]] = [[] for _ in range(world)]
    for t in transfers:
        key = (t.layer, t.expert)
        if t.source == me:
            outgoing[ranks[t.destination]].append(pack(engine.expert_state(key), expert_lay))
        if t.destination == me:
            arriving[ranks[t.source]].append((key, expert_n))
    if dense_source is not None:
        if me == dense_source:
            flat = pack(engine.dense_state(), dense_lay)
            for j in joiners:
                outgoing[ranks[j]].append(flat)
        elif me in joiners:
            arriving[ranks[dense_source]].append((None, dense_n))
    send_splits = [sum(m.numel() for m in msgs) for msgs in outgoing]
    recv_splits = [sum(n for _, n in msgs) for msgs in arriving]
    empty = torch.empty(0)
    received = comm.all_to_all(torch.cat([empty] + [m for msgs in outgoing for m in msgs]),
                               recv_splits, send_splits)
    experts, dense = {}, None
    parts = iter(received.split([n for msgs in arriving for _, n in msgs]))
    for msgs in arriving:
        for key, _ in msgs:
            if key is None:
                dense = unpack(next(parts), dense_lay)
            else:
                experts[key] = unpack(next(parts), expert_lay)
    return experts, dense
