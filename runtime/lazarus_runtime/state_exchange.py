"""Moving expert and dense state between workers after a reconfiguration.

The solver's transfer list says which surviving holder sends which (layer, expert) to which
node, with the senders already spread over the holders. Every transfer is one flat fp32
message (parameters, then AdamW's moments and step count), posted as one batch of
point-to-point sends and receives over the generation's group, so the transfers of a
reconfiguration overlap. Joining workers also get the dense parameters and their optimizer
state from one survivor.

Messages are packed and received where the backend sends from: on NCCL, the worker's GPU, so
state goes GPU to GPU with no copy through the host; on gloo, host memory (its point-to-point
sends read host pointers), also for ranks that share a GPU over gloo. NCCL matches the messages between two ranks by their
order, not their tags, and both ends post them in the order of the transfer list (the dense
state last), so the tags only matter to gloo; one batch also keeps two ranks that send to
each other from waiting on each other's first send.

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
from .devices import NCCL
from .engine import Engine
from .model import ExpertFFN, MoEGPT

Layout = list[tuple[str, torch.Size]]

_OPTIMIZER_KEYS = ("exp_avg", "exp_avg_sq", "step")
# Tags keep messages between the same two ranks apart; dense state gets its own range.
_DENSE_TAG = 1 << 30


@functools.lru_cache(maxsize=4)
def _shapes(cfg: ModelConfig) -> tuple[tuple, tuple]:
    """(expert, dense) parameter names and shapes: a joiner knows them before it has state."""
    expert = ExpertFFN(cfg.dim, cfg.ffn_dim, torch.Generator())
    dense = MoEGPT(cfg, {layer: () for layer in range(cfg.layers)}, seed=0)
    return (tuple((n, p.shape) for n, p in expert.named_parameters()),
            tuple((n, p.shape) for n, p in dense.dense_parameters()))


def layout(named_shapes: Sequence[tuple[str, torch.Size]], stepped: bool) -> Layout:
    out = []
    for name, shape in named_shapes:
        out.append((name, shape))
        if stepped:
            out += [(f"{name}/exp_avg", shape), (f"{name}/exp_avg_sq", shape),
                    (f"{name}/step", torch.Size([]))]
    return sorted(out)


def pack(state: Mapping[str, torch.Tensor], lay: Layout,
         device: torch.device | str = "cpu") -> torch.Tensor:
    """One flat fp32 message on ``device``. Tensors already there are copied once, into the
    message; a CPU one (AdamW's step count) crosses over on its own."""
    missing = [name for name, _ in lay if name not in state]
    if missing:
        raise ValueError(f"state: missing {missing[:3]} for the agreed layout")
    return torch.cat([state[name].detach().reshape(-1).to(device=device, dtype=torch.float32)
                      for name, _ in lay])


def unpack(flat: torch.Tensor, lay: Layout) -> dict[str, torch.Tensor]:
    sizes = [shape.numel() for _, shape in lay]
    if flat.numel() != sum(sizes):
        raise ValueError(f"state: a message of {flat.numel()} values for a layout of "
                         f"{sum(sizes)}")
    return {name: part.reshape(shape).clone()
            for (name, shape), part in zip(lay, flat.split(sizes))}


def message_device(comm: Collectives, device: torch.device | str) -> torch.device:
    """Where this group's point-to-point messages must live: NCCL sends device memory,
    gloo host memory."""
    if comm.group is not None and dist.get_backend(comm.group) == NCCL:
        return torch.device(device)
    return torch.device("cpu")


def exchange(comm: Collectives, cfg: ModelConfig, engine: Engine | None, me: str,
             ranks: Mapping[str, int], transfers: Sequence[Transfer], joiners: Sequence[str],
             dense_source: str | None, stepped: bool,
             device: torch.device | str = "cpu") -> tuple[dict[ExpertKey, dict], dict | None]:
    """Post every send and receive this worker takes part in; wait for all of them.

    ``engine`` is None on a worker that holds no state yet (it only receives). Returns
    (incoming expert states, incoming dense state or None), on ``device`` over NCCL, in host
    memory over gloo: loading them puts them where the engine keeps its state.
    """
    expert_shapes, dense_shapes = _shapes(cfg)
    expert_lay = layout(expert_shapes, stepped)
    dense_lay = layout(dense_shapes, stepped)
    device = message_device(comm, device)
    ops, incoming = [], []

    def post(op, tensor: torch.Tensor, peer: str, tag: int) -> None:
        ops.append(dist.P2POp(op, tensor, ranks[peer], comm.group, tag))

    for tag, t in enumerate(transfers):
        key = (t.layer, t.expert)
        if t.source == me:
            post(dist.isend, pack(engine.expert_state(key), expert_lay, device), t.destination,
                 tag)
        if t.destination == me:
            buf = torch.empty(sum(s.numel() for _, s in expert_lay), device=device)
            post(dist.irecv, buf, t.source, tag)
            incoming.append((key, buf))
    dense_buf = None
    if dense_source is not None:
        if me == dense_source:
            flat = pack(engine.dense_state(), dense_lay, device)
            for j in joiners:
                post(dist.isend, flat, j, _DENSE_TAG)
        elif me in joiners:
            dense_buf = torch.empty(sum(s.numel() for _, s in dense_lay), device=device)
            post(dist.irecv, dense_buf, dense_source, _DENSE_TAG)
    for work in dist.batch_isend_irecv(ops) if ops else ():
        comm.wait(work)
    experts = {key: unpack(buf, expert_lay) for key, buf in incoming}
    return experts, (unpack(dense_buf, dense_lay) if dense_buf is not None else None)
