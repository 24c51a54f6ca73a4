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

Precision (``spec.runtime.precision``): the parameters live in flat buffers (flat_params.py)
and AdamW steps fp32 masters, so under bf16 the weights and the optimizer state stay fp32
and a step casts twice, whole buffers at a time. State moves in fp32, from the masters.

Host synchronisations per step: one per MoE layer in the forward with the replica
dispatcher (its split sizes), none with the local one, none in the backward, and one at the
end of the step, which reads the loss and the step's routing statistics together.
"""
from __future__ import annotations

import logging
import resource
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch
from lazarus_core.plan import ExpertKey, Plan
from lazarus_core.runtime_config import RuntimeConfig

from .collectives import Collectives
from .data import StepBatches
from .dispatcher import Dispatcher, LocalDispatcher, ReplicaDispatcher
from .experts import STACKED, GroupedExperts
from .flat_params import FlatParams
from .host_sync import to_device
from .kernels import kernel_backend
from .model import MoEGPT, computes_in_fp32
from .replica_sync import sum_over_replicas, sync_schedule

log = logging.getLogger("lazarus.engine")

COMPUTE_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


@dataclass(frozen=True)
class StepResult:
    step: int
    loss: float            # mean token loss over the global batch
    sample_ids: tuple[int, ...]  # this rank's samples
    peak_memory_bytes: int = 0  # this rank's peak so far (device memory on a GPU, RSS on CPU)


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


def peak_memory_bytes(device: torch.device) -> int:
    """This process's peak memory: allocated device memory on a GPU, resident set on a CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


class Engine:
    def __init__(self, cfg: RuntimeConfig, plan: Plan, rank: int, comm: Collectives,
                 batches: StepBatches | None = None, device: torch.device | str = "cpu"):
        _check_fits(cfg, plan, comm)
        self.cfg = cfg
        self.device = torch.device(device)
        self.precision = cfg.compute.precision_on(self.device.type)
        self.compute_dtype = COMPUTE_DTYPES[self.precision]
        self.plan, self.rank, self.comm = plan, rank, comm
        # Built on the CPU, where the seeded generators live, then moved: the same bits on
        # every device.
        model = MoEGPT(cfg.model, self._route(), cfg.seed, cfg.compute)
        self.model = model.to(self.device)
        # The loss rides in the dense gradients' all-reduce, in their spare element.
        self.dense = FlatParams(self.model.dense_parameters(), self.compute_dtype,
                                keep_fp32=computes_in_fp32, spare=1)
        self._dense_unit = self.dense.master
        self._dense_unit.grad = self.dense.master_grad[:self.dense.numel]
        self._use_experts()
        self.optimizer = self._new_optimizer()
        self.batches = batches or StepBatches.from_config(cfg.data, cfg.model.seq_len,
                                                          cfg.model.vocab)
        # Global tokens per (layer, expert) over completed steps, for rebalancing.
        self.loads_LE = np.zeros((cfg.model.layers, cfg.model.experts), dtype=np.int64)
        self._step_loads_LE = np.zeros_like(self.loads_LE)
        log.info("rank %d: plan generation %d, %s, token-dispatch ops on the %s path",
                 rank, plan.generation, self.precision, kernel_backend())

    # --- layout ----------------------------------------------------------------------

    def _route(self) -> list[Dispatcher]:
        """The current plan's routing: a dispatcher per layer, and (``self.sync``) the
        schedule that sums expert gradients over their replicas."""
        replicas_LEW = replica_matrices(self.plan)
        self.sync = sync_schedule(replicas_LEW, self.rank)
        if self.comm.world_size == 1:
            return [LocalDispatcher(self.plan.experts) for _ in replicas_LEW]
        return [ReplicaDispatcher(replicas_EW, self.comm) for replicas_EW in replicas_LEW]

    def _use_experts(self) -> None:
        """Flat buffers for the experts the model holds now, and one optimizer unit per
        expert and parameter: an expert's state is its own, whatever else a rank holds."""
        self.experts = FlatParams(self.model.expert_parameters(), self.compute_dtype)
        self._units: dict[ExpertKey, dict[str, torch.Tensor]] = {}
        for moe in self.model.moe_layers():
            prefix = f"blocks.{moe.layer}.moe.experts."
            for i, expert in enumerate(moe.experts.expert_ids):
                units = {}
                for piece, stacked in STACKED.items():
                    units[piece] = self.experts.master_view(prefix + stacked)[i]
                    units[piece].grad = self.experts.master_grad_view(prefix + stacked)[i]
                self._units[moe.layer, expert] = units

    def _new_optimizer(self) -> torch.optim.AdamW:
        o = self.cfg.optim
        params = [self._dense_unit] + [u for units in self._units.values() for u in units.values()]
        return torch.optim.AdamW(params, lr=o.lr, betas=(o.beta1, o.beta2),
                                 weight_decay=o.weight_decay, fused=self.device.type == "cuda")

    def resident_tensors(self) -> list[torch.Tensor]:
        """Every tensor the engine keeps on its device between steps: parameters, their
        buffers and gradients, the AdamW moments (for host_sync.HostSyncCounter). AdamW's
        step counts are host scalars, except for the fused kernel, which never reads them."""
        flats = [t for f in (self.dense, self.experts)
                 for t in (f.master, f.master_grad, f.spare, f.low, f.low_grad)]
        units = [u for units in self._units.values() for u in units.values()] + [self._dense_unit]
        state = [v for s in self.optimizer.state.values() for k, v in s.items() if k != "step"]
        params = list(self.model.parameters())
        return flats + units + [u.grad for u in units] + params + [p.grad for p in params] + state

    def held_experts(self) -> list[ExpertKey]:
        return list(self._units)

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
        self.dense.zero_grads()
        self.experts.zero_grads()
        loss_sum = self.model(to_device(batch.inputs_BS, self.device),
                              to_device(batch.targets_BS, self.device))
        (loss_sum / global_tokens).backward()
        self.dense.gather_grads()
        self.experts.gather_grads()
        self.dense.spare[0] = loss_sum.detach()
        self.comm.all_reduce_sum_(self.dense.master_grad)
        self._sum_expert_grads()
        # The step's one read back to the host: the loss sum and the routing statistics.
        loads_LE = torch.stack([moe.last_num_tokens_E for moe in self.model.moe_layers()])
        host = torch.cat([self.dense.spare.double(), loads_LE.flatten().double()]).cpu().numpy()
        self._step_loads_LE = host[1:].reshape(self.loads_LE.shape).astype(np.int64)
        return StepResult(step, float(host[0]) / global_tokens, tuple(batch.sample_ids.tolist()),
                          peak_memory_bytes(self.device))

    def step_loads(self) -> np.ndarray:
        """(layers, experts) global token counts of the prepared step."""
        return self._step_loads_LE

    def apply(self) -> None:
        """Commit the prepared step: the optimizer step, and its loads into the statistics."""
        self.optimizer.step()
        self.dense.publish()
        self.experts.publish()
        self.loads_LE += self._step_loads_LE

    def _sum_expert_grads(self) -> None:
        if not self.sync.active:
            return
        grads = {k: torch.cat([u.grad.reshape(-1) for u in units.values()])
                 for k, units in self._units.items()}
        sum_over_replicas(self.sync, grads, self.comm)
        for k, units in self._units.items():
            for u, g in zip(units.values(), grads[k].split([u.numel() for u in units.values()])):
                u.grad.copy_(g.view_as(u))

    def take_loads(self) -> np.ndarray:
        """(layers, experts) global token counts since the last call, then reset."""
        loads, self.loads_LE = self.loads_LE, np.zeros_like(self.loads_LE)
        return loads

    # --- state for migration ---------------------------------------------------------

    def expert_state(self, key: ExpertKey) -> dict[str, torch.Tensor]:
        """An expert's fp32 parameters and AdamW state: ``w1_DF``, ``w1_DF/exp_avg``, ..."""
        state = {}
        for piece, unit in self._units[key].items():
            state[piece] = unit.detach().clone()
            for k, v in self.optimizer.state.get(unit, {}).items():
                state[f"{piece}/{k}"] = v.clone()
        return state

    def load_expert_state(self, key: ExpertKey, state: Mapping[str, torch.Tensor]) -> None:
        self._load_expert(key, state)
        self.experts.publish()

    def _load_expert(self, key: ExpertKey, state: Mapping[str, torch.Tensor]) -> None:
        for piece, unit in self._units[key].items():
            _require(state, piece)
            with torch.no_grad():
                unit.copy_(state[piece])
            opt = _optimizer_entries(state, piece)
            if opt:
                self.optimizer.state[unit] = {k: self._optimizer_tensor(k, v, unit)
                                              for k, v in opt.items()}
            else:  # a parameter that has not been stepped yet
                self.optimizer.state.pop(unit, None)

    def dense_state(self) -> dict[str, torch.Tensor]:
        """The replicated parameters (fp32) and their AdamW state, for a worker that joins."""
        opt = self.optimizer.state.get(self._dense_unit, {})
        state = {}
        for name, _ in self.model.dense_parameters():
            state[name] = self.dense.master_view(name).clone()
            for k, v in opt.items():
                state[f"{name}/{k}"] = v.clone() if k == "step" else self.dense.view_of(v, name).clone()
        return state

    def load_dense_state(self, state: Mapping[str, torch.Tensor]) -> None:
        self._load_dense(state)
        self.dense.publish()

    def _load_dense(self, state: Mapping[str, torch.Tensor]) -> None:
        names = [name for name, _ in self.model.dense_parameters()]
        opts = {name: _optimizer_entries(state, _require(state, name)) for name in names}
        stepped = {name for name, opt in opts.items() if opt}
        if stepped and len(stepped) != len(names):
            raise ValueError(f"state: optimizer state for only {len(stepped)} of the "
                             f"{len(names)} dense parameters")
        steps = {float(opt["step"]) for opt in opts.values() if "step" in opt}
        if len(steps) > 1:
            raise ValueError(f"state: the dense parameters disagree on the step count: {steps}")
        unit = self._dense_unit
        with torch.no_grad():
            for name in names:
                self.dense.master_view(name).copy_(state[name])
        if not stepped:
            self.optimizer.state.pop(unit, None)
            return
        merged = {k: (self._optimizer_tensor(k, v, unit) if k == "step" else torch.zeros_like(unit))
                  for k, v in opts[names[0]].items()}
        for name, opt in opts.items():
            for k, v in opt.items():
                if k != "step":
                    self.dense.view_of(merged[k], name).copy_(v)
        self.optimizer.state[unit] = merged

    def load_state(self, dense: Mapping[str, torch.Tensor],
                   experts: Mapping[ExpertKey, Mapping[str, torch.Tensor]]) -> None:
        """Dense and expert state from elsewhere (survivors, a checkpoint): a whole worker's."""
        self._load_dense(dense)
        for key, state in experts.items():
            self._load_expert(key, state)
        self.dense.publish()
        self.experts.publish()

    def _optimizer_tensor(self, key: str, value: torch.Tensor, unit: torch.Tensor) -> torch.Tensor:
        """An optimizer state tensor as this engine's AdamW keeps it: the step count a
        float32 scalar (on the device for the fused kernel, on the host otherwise), moments
        beside their parameter."""
        if key == "step":
            device = unit.device if self.device.type == "cuda" else torch.device("cpu")
            return value.detach().to(device=device, dtype=torch.float32).clone()
        return value.detach().to(device=unit.device, dtype=unit.dtype).clone()

    def reconfigure(self, plan: Plan, rank: int, comm: Collectives,
                    incoming: Mapping[ExpertKey, Mapping[str, torch.Tensor]]) -> None:
        """Adopt a new plan generation: drop experts no longer held here, add the new ones
        from ``incoming`` (state fetched from surviving replicas), rebuild routing.

        Dense parameters and their optimizer state are untouched, and so is the state of
        every expert kept.
        """
        _check_fits(self.cfg, plan, comm)
        wanted = {(layer, e) for layer in range(len(plan.layers))
                  for e in plan.rank_experts(layer, rank)}
        have = set(self.held_experts())
        missing = sorted(wanted - have - set(incoming))
        if missing:
            raise ValueError(f"reconfigure: no state for new experts {missing} (layer, expert)")
        states = {key: self.expert_state(key) for key in sorted(wanted & have)}
        states.update({key: incoming[key] for key in sorted(wanted - have)})
        dense_opt = self.optimizer.state.get(self._dense_unit)
        self.plan, self.rank, self.comm = plan, rank, comm
        m = self.cfg.model
        for moe, dispatcher in zip(self.model.moe_layers(), self._route()):
            # Empty: every expert's values come from `states`.
            experts = GroupedExperts(m.dim, m.ffn_dim, moe.layer, dispatcher.local_experts,
                                     self.cfg.seed, initialise=False,
                                     recompute=moe.experts.recompute)
            moe.relayout(dispatcher, experts.to(self.device))
        self._use_experts()
        self.optimizer = self._new_optimizer()
        if dense_opt is not None:
            self.optimizer.state[self._dense_unit] = dense_opt
        for key, state in states.items():
            self._load_expert(key, state)
        self.experts.publish()


def _require(state: Mapping[str, torch.Tensor], name: str) -> str:
    if name not in state:
        raise ValueError(f"state: no tensor for parameter {name}")
    return name


def _optimizer_entries(state: Mapping[str, torch.Tensor], name: str) -> dict[str, torch.Tensor]:
    """The optimizer state of parameter ``name`` in a state dict: ``name/exp_avg`` ..."""
    return {k[len(name) + 1:]: v for k, v in state.items() if k.startswith(name + "/")}


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
