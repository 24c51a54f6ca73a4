"""The training engine of one worker: a model laid out by a plan, and one step at a time.

A step is all-or-nothing. Every collective (dispatch, gradient sums) runs before the
optimizer touches a parameter, so a step interrupted by a failure leaves the engine exactly
as it was after the previous step, and the survivors can redo it under a new plan.

The arithmetic equals single-copy training of the global batch: each rank's loss is its
token-loss sum divided by the *global* token count, dense gradients are summed over ranks
(that is the average, weighted by each rank's share of the batch) and every expert's
gradient is summed over its replicas. Runtime II drives reconfiguration through
``reconfigure`` and moves state with ``expert_state`` / ``load_expert_state`` (experts) and
``dense_state`` / ``load_dense_state`` (for joining workers).
"""
from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from lazarus_core.plan import ExpertKey, Plan
from lazarus_core.runtime_config import RuntimeConfig

from .collectives import Collectives
from .data import StepBatches
from .dispatcher import LocalDispatcher, ReplicaDispatcher
from .kernels import kernel_backend
from .model import ExpertFFN, MoEGPT, expert_generator
from .replica_sync import sum_over_replicas, sync_schedule

log = logging.getLogger("lazarus.engine")


@dataclass(frozen=True)
class StepResult:
    step: int
    loss: float            # mean token loss over the global batch
    sample_ids: tuple[int, ...]  # this rank's samples


def replica_matrices(plan: Plan) -> list[np.ndarray]:
    """Per layer, ``replicas_EW[e, j]``: slots of expert e on rank j."""
    out = []
    for layer in range(len(plan.layers)):
        replicas_EW = np.zeros((plan.experts, plan.world_size), dtype=np.int64)
        for rank in range(plan.world_size):
            for e in plan.rank_experts(layer, rank):
                replicas_EW[e, rank] += 1
        out.append(replicas_EW)
    return out


class Engine:
    def __init__(self, cfg: RuntimeConfig, plan: Plan, rank: int, comm: Collectives,
                 batches: StepBatches | None = None, device: torch.device | str = "cpu"):
        _check_fits(cfg, plan, comm)
        self.cfg = cfg
        self.device = torch.device(device)
        held = {layer: plan.rank_experts(layer, rank) for layer in range(len(plan.layers))}
        self.model = MoEGPT(cfg.model, held, cfg.seed).to(self.device)
        self.batches = batches or StepBatches.from_config(cfg.data, cfg.model.seq_len,
                                                          cfg.model.vocab)
        # Global tokens per (layer, expert) over completed steps, for rebalancing.
        self.loads_LE = np.zeros((cfg.model.layers, cfg.model.experts), dtype=np.int64)
        self.optimizer = self._new_optimizer()
        self._use_plan(plan, rank, comm)
        log.info("rank %d: plan generation %d, token-dispatch ops on the %s path",
                 rank, plan.generation, kernel_backend())

    # --- layout ----------------------------------------------------------------------

    def _use_plan(self, plan: Plan, rank: int, comm: Collectives) -> None:
        self.plan, self.rank, self.comm = plan, rank, comm
        replicas_LEW = replica_matrices(plan)
        for moe, replicas_EW in zip(self.model.moe_layers(), replicas_LEW):
            moe.dispatcher = (LocalDispatcher(plan.experts) if comm.world_size == 1
                              else ReplicaDispatcher(replicas_EW, comm))
        self.sync = sync_schedule(replicas_LEW, rank)

    def _new_optimizer(self) -> torch.optim.AdamW:
        o = self.cfg.optim
        return torch.optim.AdamW(self.model.parameters(), lr=o.lr, betas=(o.beta1, o.beta2),
                                 weight_decay=o.weight_decay)

    def held_experts(self) -> list[ExpertKey]:
        return [(moe.layer, int(e)) for moe in self.model.moe_layers() for e in moe.experts]

    def _expert(self, key: ExpertKey) -> ExpertFFN:
        layer, expert = key
        return self.model.moe_layers()[layer].experts[str(expert)]

    # --- one step ------------------------------------------------------------------------

    def step(self, step: int) -> StepResult:
        """Train on step ``step``'s global batch (this rank's share of it)."""
        result = self.prepare(step)
        self.apply()
        return result

    def prepare(self, step: int) -> StepResult:
        """Everything of a step that talks to other ranks: afterwards every gradient is
        final, and nothing has changed yet. ``apply`` then makes the step; dropping it
        (the step was interrupted and will be redone) leaves the engine as it was."""
        batch = self.batches.batch(step, self.rank, self.comm.world_size)
        global_tokens = self.batches.global_batch * self.cfg.model.seq_len
        self.optimizer.zero_grad(set_to_none=True)
        logits_BSV = self.model(batch.inputs_BS.to(self.device))
        loss_sum = F.cross_entropy(logits_BSV.flatten(0, 1),
                                   batch.targets_BS.to(self.device).flatten(), reduction="sum")
        (loss_sum / global_tokens).backward()
        # An expert that saw no tokens still takes its (zero-gradient) AdamW step, on every
        # replica and in every world size alike.
        for p in self.model.parameters():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        loss = self._sum_dense_grads(loss_sum.detach())
        self._sum_expert_grads()
        return StepResult(step, loss / global_tokens, tuple(batch.sample_ids.tolist()))

    def step_loads(self) -> np.ndarray:
        """(layers, experts) global token counts of the prepared step."""
        return np.stack([moe.last_num_tokens_E.numpy() for moe in self.model.moe_layers()])

    def apply(self) -> None:
        """Commit the prepared step: the optimizer step, and its loads into the statistics."""
        self.optimizer.step()
        self.loads_LE += self.step_loads()

    def _sum_dense_grads(self, loss_sum: torch.Tensor) -> float:
        """One all-reduce for every dense gradient, with the loss sum riding along."""
        params = [p for _, p in self.model.dense_parameters()]
        flat = torch.cat([_flat_grad(params), loss_sum.reshape(1)])
        self.comm.all_reduce_sum_(flat)
        _set_grads(params, flat[:-1])
        return float(flat[-1])

    def _sum_expert_grads(self) -> None:
        params = {k: list(self._expert(k).parameters()) for k in self.held_experts()}
        grads = {k: _flat_grad(ps) for k, ps in params.items()}
        sum_over_replicas(self.sync, grads, self.comm)
        for k, ps in params.items():
            _set_grads(ps, grads[k])

    def take_loads(self) -> np.ndarray:
        """(layers, experts) global token counts since the last call, then reset."""
        loads, self.loads_LE = self.loads_LE, np.zeros_like(self.loads_LE)
        return loads

    # --- state for migration ---------------------------------------------------------

    def expert_state(self, key: ExpertKey) -> dict[str, torch.Tensor]:
        """An expert's parameters and AdamW state: ``w1_DF``, ``w1_DF/exp_avg``, ..."""
        return self._state_of(self._expert(key).named_parameters())

    def load_expert_state(self, key: ExpertKey, state: Mapping[str, torch.Tensor]) -> None:
        self._load_state(self._expert(key).named_parameters(), state)

    def dense_state(self) -> dict[str, torch.Tensor]:
        """The replicated parameters and their AdamW state, for a worker that joins."""
        return self._state_of(self.model.dense_parameters())

    def load_dense_state(self, state: Mapping[str, torch.Tensor]) -> None:
        self._load_state(self.model.dense_parameters(), state)

    def load_state(self, dense: Mapping[str, torch.Tensor],
                   experts: Mapping[ExpertKey, Mapping[str, torch.Tensor]]) -> None:
        """Dense and expert state from elsewhere (survivors, a checkpoint): a whole worker's."""
        self.load_dense_state(dense)
        for key, state in experts.items():
            self.load_expert_state(key, state)

    def _state_of(self, named_params) -> dict[str, torch.Tensor]:
        state = {}
        for name, p in named_params:
            state[name] = p.detach().clone()
            for k, v in self.optimizer.state.get(p, {}).items():
                state[f"{name}/{k}"] = v.clone()
        return state

    def _load_state(self, named_params, state: Mapping[str, torch.Tensor]) -> None:
        for name, p in named_params:
            if name not in state:
                raise ValueError(f"state: no tensor for parameter {name}")
            with torch.no_grad():
                p.copy_(state[name])
            opt = {k[len(name) + 1:]: v.clone() for k, v in state.items()
                   if k.startswith(name + "/")}
            if opt:
                self.optimizer.state[p] = opt
            else:  # a parameter that has not been stepped yet
                self.optimizer.state.pop(p, None)

    def reconfigure(self, plan: Plan, rank: int, comm: Collectives,
                    incoming: Mapping[ExpertKey, Mapping[str, torch.Tensor]]) -> None:
        """Adopt a new plan generation: drop experts no longer held here, add the new ones
        from ``incoming`` (state fetched from surviving replicas), rebuild routing.

        Dense parameters and the optimizer state of kept parameters are untouched.
        """
        _check_fits(self.cfg, plan, comm)
        wanted = {(layer, e) for layer in range(len(plan.layers))
                  for e in plan.rank_experts(layer, rank)}
        have = set(self.held_experts())
        missing = sorted(wanted - have - set(incoming))
        if missing:
            raise ValueError(f"reconfigure: no state for new experts {missing} (layer, expert)")
        kept_state = dict(self.optimizer.state)
        for layer, e in sorted(have - wanted):
            del self.model.moe_layers()[layer].experts[str(e)]
        for key in sorted(wanted - have):  # initial values are overwritten from `incoming`
            layer, e = key
            self.model.moe_layers()[layer].experts[str(e)] = ExpertFFN(
                self.cfg.model.dim, self.cfg.model.ffn_dim, expert_generator(self.cfg.seed, *key)
            ).to(self.device)
        self.optimizer = self._new_optimizer()
        for p in self.model.parameters():
            if p in kept_state:
                self.optimizer.state[p] = kept_state[p]
        for key in sorted(wanted - have):
            self.load_expert_state(key, incoming[key])
        self._use_plan(plan, rank, comm)


def _flat_grad(params: list[torch.nn.Parameter]) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for p in params])


def _set_grads(params: list[torch.nn.Parameter], flat: torch.Tensor) -> None:
    for p, g in zip(params, flat.split([p.numel() for p in params])):
        p.grad.copy_(g.view_as(p))


def _check_fits(cfg: RuntimeConfig, plan: Plan, comm: Collectives) -> None:
    if plan.experts != cfg.model.experts:
        raise ValueError(f"experts: the plan has {plan.experts} experts, the model "
                         f"{cfg.model.experts}")
    if len(plan.layers) != cfg.model.layers:
        raise ValueError(f"layers: the plan has {len(plan.layers)} MoE layers, the model "
                         f"{cfg.model.layers}")
    if plan.world_size != comm.world_size:
        raise ValueError(f"plan generation {plan.generation} has {plan.world_size} ranks but "
                         f"the process group has {comm.world_size}")
