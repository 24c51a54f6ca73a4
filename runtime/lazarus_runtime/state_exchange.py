"""Moving expert and dense state between workers after a reconfiguration.

The solver's transfer list says which surviving holder sends which (layer, expert) to which
node, with the senders already spread over the holders. Every transfer is one flat fp32
message (parameters, then AdamW's moments and step count), posted as non-blocking sends and
receives all at once, so the transfers of a reconfiguration overlap. Joining workers also
get the dense parameters and their optimizer state from one survivor.

Both ends know every message's layout without asking: all experts share one shape, and the
optimizer state exists exactly when at least one step has been committed.
"""
from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist
from lazarus_core.plan import ExpertKey, Transfer
from lazarus_core.runtime_config import ModelConfig

from .collectives import Collectives
from .engine import Engine
from .experts import expert_shapes
from .model import dense_parameter_shapes

Layout = list[tuple[str, torch.Size]]

_OPTIMIZER_KEYS = ("exp_avg", "exp_avg_sq", "step")
# Tags keep messages between the same two ranks apart; dense state gets its own range.
_DENSE_TAG = 1 << 30


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
    """Post every send and receive this worker takes part in; wait for all of them.

    ``engine`` is None on a worker that holds no state yet (it only receives). Returns
    (incoming expert states, incoming dense state or None).
    """
    expert_shapes, dense_shapes = _shapes(cfg)
    expert_lay = layout(expert_shapes, stepped)
    dense_lay = layout(dense_shapes, stepped)
    works, incoming = [], []
    for tag, t in enumerate(transfers):
        key = (t.layer, t.expert)
        if t.source == me:
            works.append(dist.isend(pack(engine.expert_state(key), expert_lay),
                                    dst=ranks[t.destination], tag=tag))
        if t.destination == me:
            buf = torch.empty(sum(s.numel() for _, s in expert_lay))
            works.append(dist.irecv(buf, src=ranks[t.source], tag=tag))
            incoming.append((key, buf))
    dense_buf = None
    if dense_source is not None:
        if me == dense_source:
            flat = pack(engine.dense_state(), dense_lay)
            works += [dist.isend(flat, dst=ranks[j], tag=_DENSE_TAG) for j in joiners]
        elif me in joiners:
            dense_buf = torch.empty(sum(s.numel() for _, s in dense_lay))
            works.append(dist.irecv(dense_buf, src=ranks[dense_source], tag=_DENSE_TAG))
    for work in works:
        comm.wait(work)
    experts = {key: unpack(buf, expert_lay) for key, buf in incoming}
    return experts, (unpack(dense_buf, dense_lay) if dense_buf is not None else None)
