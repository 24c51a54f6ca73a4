"""GPT-style decoder whose feed-forward blocks are mixture-of-experts layers.

Legend: B batch, S sequence, T = B*S tokens, D model dim, F expert FFN dim, E experts,
K top-k, V vocabulary, X rows routed to this rank, L experts held by this rank.

A rank builds only the experts its plan gives it: each MoE layer is built with its dispatcher,
whose ``local_experts`` say which. Every parameter is initialised from the seed alone: dense
ones from one generator in a fixed order, each expert from its own (seed, layer, expert)
generator. Any rank holding a replica of an expert therefore starts with the same bits as
every other replica, in any world size, without a broadcast.

The dense part of a block (attention, both norms and the router) is one function of its
input and parameters, ``dense_sublayer``: one graph that ``torch.compile`` compiles once for
all blocks, and one region that activation checkpointing recomputes. The router computes in
fp32 whatever the compute dtype: its softmax decides where every token goes.
"""
from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F
from lazarus_core.runtime_config import ComputeConfig, ModelConfig
from torch.utils.checkpoint import checkpoint

from .dispatcher import Dispatcher
from .experts import INIT_STD, GroupedExperts
from .vocab_loss import linear_cross_entropy_sum


def dense_sublayer(x_BSD, ln1_w, ln1_b, qkv_w, qkv_b, proj_w, proj_b, ln2_w, ln2_b, gate_w,
                   heads: int, top_k: int, eps: float):
    """Attention with its residual, then the MoE input's norm and the router.

    Returns (x_BSD after attention, h_TD the MoE input, weights_TK, experts_TK). Gate weights
    are the softmax over all experts; with k = 2 the two chosen are renormalised to sum to
    one (GShard). There is no auxiliary balancing loss: Lazarus balances by replication.
    """
    B, S, D = x_BSD.shape
    q, k, v = F.linear(F.layer_norm(x_BSD, (D,), ln1_w, ln1_b, eps), qkv_w, qkv_b).split(D, -1)
    q, k, v = (t.view(B, S, heads, D // heads).transpose(1, 2) for t in (q, k, v))
    attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    x_BSD = x_BSD + F.linear(attn.transpose(1, 2).reshape(B, S, D), proj_w, proj_b)
    h_TD = F.layer_norm(x_BSD, (D,), ln2_w, ln2_b, eps).view(B * S, D)
    probs_TE = F.softmax(F.linear(h_TD.float(), gate_w), dim=-1)
    weights_TK, experts_TK = torch.topk(probs_TE, top_k, dim=-1)
    if top_k > 1:
        weights_TK = weights_TK / weights_TK.sum(-1, keepdim=True)
    return x_BSD, h_TD, weights_TK, experts_TK


def computes_in_fp32(name: str) -> bool:
    """Whether a parameter computes in fp32 whatever the precision: the router's gate."""
    return name.endswith(".moe.gate.weight")


@functools.cache
def _compiled_dense_sublayer():
    return torch.compile(dense_sublayer, dynamic=False)


class MoELayer(nn.Module):
    """The router's gate, this rank's experts, and the dispatcher that routes between them."""

    def __init__(self, cfg: ModelConfig, layer: int, dispatcher: Dispatcher, seed: int,
                 recompute_experts: bool = False):
        super().__init__()
        self.layer = layer
        self.gate = nn.Linear(cfg.dim, cfg.experts, bias=False)
        self.dispatcher = dispatcher
        self.experts = GroupedExperts(cfg.dim, cfg.ffn_dim, layer, dispatcher.local_experts, seed,
                                      recompute=recompute_experts)
        # Global tokens routed to each expert by the latest forward, on the device; the engine
        # reads them once per step, and adds them to its statistics once the step completes.
        self.last_num_tokens_E = torch.zeros(cfg.experts, dtype=torch.int64)

    def relayout(self, dispatcher: Dispatcher, experts: GroupedExperts) -> None:
        """Take a new plan's routing and expert set together (a reconfiguration)."""
        assert experts.expert_ids == tuple(dispatcher.local_experts)
        self.dispatcher, self.experts = dispatcher, experts

    def forward(self, h_TD, weights_TK, experts_TK):
        routed_XD, rows, meta = self.dispatcher.dispatch(h_TD, weights_TK, experts_TK)
        self.last_num_tokens_E = meta.num_tokens_E
        return self.dispatcher.combine(self.experts(routed_XD, rows), meta)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, dispatcher: Dispatcher, seed: int,
                 compute: ComputeConfig):
        super().__init__()
        self.heads = cfg.heads
        self.top_k = cfg.top_k
        self.ln1 = nn.LayerNorm(cfg.dim)
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim)
        self.proj = nn.Linear(cfg.dim, cfg.dim)
        self.ln2 = nn.LayerNorm(cfg.dim)
        self.moe = MoELayer(cfg, layer, dispatcher, seed,
                            recompute_experts=compute.activation_checkpointing == "full")
        self.recompute_dense = compute.activation_checkpointing in ("attention", "full")
        self.compiled = compute.compile == "dense"

    def forward(self, x_BSD):
        B, S, D = x_BSD.shape
        dense = _compiled_dense_sublayer() if self.compiled else dense_sublayer
        args = (x_BSD, self.ln1.weight, self.ln1.bias, self.qkv.weight, self.qkv.bias,
                self.proj.weight, self.proj.bias, self.ln2.weight, self.ln2.bias,
                self.moe.gate.weight, self.heads, self.top_k, self.ln1.eps)
        if self.recompute_dense and torch.is_grad_enabled():
            x_BSD, h_TD, weights_TK, experts_TK = checkpoint(dense, *args, use_reentrant=False)
        else:
            x_BSD, h_TD, weights_TK, experts_TK = dense(*args)
        return x_BSD + self.moe(h_TD, weights_TK, experts_TK).view(B, S, D)


class MoEGPT(nn.Module):
    """The decoder, laid out by one dispatcher per MoE layer (which experts live here)."""

    def __init__(self, cfg: ModelConfig, dispatchers: Sequence[Dispatcher], seed: int,
                 compute: ComputeConfig = ComputeConfig()):
        super().__init__()
        if len(dispatchers) != cfg.layers:
            raise ValueError(f"layers: {len(dispatchers)} dispatchers for {cfg.layers} layers")
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab, cfg.dim)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.dim)
        self.blocks = nn.ModuleList(Block(cfg, i, d, seed, compute)
                                    for i, d in enumerate(dispatchers))
        self.ln_f = nn.LayerNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab, bias=False)
        self._init_dense(torch.Generator().manual_seed(seed))

    def _init_dense(self, generator: torch.Generator):
        # GPT-2 initialisation; residual projections scaled by depth.
        with torch.no_grad():
            for name, p in self.dense_parameters():
                if name.endswith("bias"):
                    p.zero_()
                elif ".ln" in name or name.startswith("ln_"):
                    p.fill_(1.0)
                else:
                    residual = name.endswith("proj.weight")
                    std = INIT_STD / math.sqrt(2 * self.cfg.layers) if residual else INIT_STD
                    p.copy_(torch.randn(p.shape, generator=generator) * std)

    def dense_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """Parameters replicated on every rank (everything but the experts), in fixed order."""
        return [(n, p) for n, p in self.named_parameters() if ".moe.experts." not in n]

    def expert_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """This rank's stacked expert parameters, layer by layer."""
        return [(n, p) for n, p in self.named_parameters() if ".moe.experts." in n]

    def moe_layers(self) -> list[MoELayer]:
        return [b.moe for b in self.blocks]

    def hidden(self, inputs_BS):
        """The final norm's output, [B*S, D]."""
        B, S = inputs_BS.shape
        pos = torch.arange(S, device=inputs_BS.device)
        x_BSD = self.tok_emb(inputs_BS) + self.pos_emb(pos)
        for block in self.blocks:
            x_BSD = block(x_BSD)
        return self.ln_f(x_BSD).view(B * S, -1)

    def forward(self, inputs_BS, targets_BS):
        """The sum of the batch's token losses, in fp32."""
        return linear_cross_entropy_sum(self.hidden(inputs_BS), self.head.weight,
                                        targets_BS.reshape(-1))


class _NoLocalExperts:
    """The layout of a layer that holds no experts here; it never routes."""

    local_experts: tuple[int, ...] = ()


def dense_parameter_shapes(cfg: ModelConfig) -> tuple[tuple[str, torch.Size], ...]:
    """Names and shapes of the dense parameters: a joiner knows them before it has state.

    Built on the CPU, not on the meta device: a process's first meta-device init imports
    torch's reference ops (about a second), and a joiner's peers wait for it meanwhile.
    """
    model = MoEGPT(cfg, [_NoLocalExperts()] * cfg.layers, seed=0)
    return tuple((n, p.shape) for n, p in model.dense_parameters())
