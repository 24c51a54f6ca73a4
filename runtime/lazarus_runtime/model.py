"""GPT-style decoder whose feed-forward blocks are mixture-of-experts layers.

Legend: B batch, S sequence, T = B*S tokens, D model dim, F expert FFN dim, E experts,
K top-k, V vocabulary, X rows routed to this rank, L experts held by this rank.

A rank builds only the experts its plan gives it (``held`` maps layer -> expert ids). Every
parameter is initialised from the seed alone: dense ones from one generator in a fixed
order, each expert from its own (seed, layer, expert) generator. Any rank holding a replica
of an expert therefore starts with the same bits as every other replica, in any world size,
without a broadcast.
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from lazarus_core.runtime_config import ModelConfig

INIT_STD = 0.02


class ExpertFFN(nn.Module):
    """One expert: D -> F -> D with GELU. Its parameters are what migrates between ranks."""

    def __init__(self, dim: int, ffn_dim: int, generator: torch.Generator):
        super().__init__()
        self.w1_DF = nn.Parameter(torch.randn(dim, ffn_dim, generator=generator) * INIT_STD)
        self.b1_F = nn.Parameter(torch.zeros(ffn_dim))
        self.w2_FD = nn.Parameter(torch.randn(ffn_dim, dim, generator=generator) * INIT_STD)
        self.b2_D = nn.Parameter(torch.zeros(dim))

    def forward(self, x_XD):
        return F.gelu(x_XD @ self.w1_DF + self.b1_F) @ self.w2_FD + self.b2_D


def expert_generator(seed: int, layer: int, expert: int) -> torch.Generator:
    # Distinct, stable streams per (layer, expert), independent of which rank builds them.
    return torch.Generator().manual_seed(seed * 1_000_003 + layer * 1009 + expert + 1)


class MoELayer(nn.Module):
    """Top-k gate plus this rank's experts; routing goes through ``self.dispatcher``.

    The gate is dense (replicated on every rank). Gate weights are the softmax over all
    experts; with k = 2 the two chosen weights are renormalised to sum to one (GShard). There
    is no auxiliary balancing loss: Lazarus balances load by replication instead.
    """

    def __init__(self, cfg: ModelConfig, layer: int, held: Sequence[int], seed: int):
        super().__init__()
        self.layer = layer
        self.top_k = cfg.top_k
        self.gate = nn.Linear(cfg.dim, cfg.experts, bias=False)
        self.experts = nn.ModuleDict({
            str(e): ExpertFFN(cfg.dim, cfg.ffn_dim, expert_generator(seed, layer, e))
            for e in sorted(set(held))
        })
        self.dispatcher = None
        # Global tokens routed to each expert by the latest forward; the engine adds them to
        # its load statistics only once the step completes.
        self.last_num_tokens_E = torch.zeros(cfg.experts, dtype=torch.int64)

    def forward(self, x_TD):
        probs_TE = F.softmax(self.gate(x_TD), dim=-1)
        weights_TK, experts_TK = torch.topk(probs_TE, self.top_k, dim=-1)
        if self.top_k > 1:
            weights_TK = weights_TK / weights_TK.sum(-1, keepdim=True)
        routed_XD, num_rows_L, meta = self.dispatcher.dispatch(x_TD, weights_TK, experts_TK)
        self.last_num_tokens_E = meta.num_tokens_E
        chunks = torch.split(routed_XD, num_rows_L)
        y_XD = torch.cat([self.experts[str(e)](chunk)
                          for e, chunk in zip(self.dispatcher.local_experts, chunks)])
        return self.dispatcher.combine(y_XD, meta)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, held: Sequence[int], seed: int):
        super().__init__()
        self.heads = cfg.heads
        self.ln1 = nn.LayerNorm(cfg.dim)
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim)
        self.proj = nn.Linear(cfg.dim, cfg.dim)
        self.ln2 = nn.LayerNorm(cfg.dim)
        self.moe = MoELayer(cfg, layer, held, seed)

    def forward(self, x_BSD):
        B, S, D = x_BSD.shape
        q, k, v = self.qkv(self.ln1(x_BSD)).split(D, dim=-1)
        q, k, v = (t.view(B, S, self.heads, D // self.heads).transpose(1, 2) for t in (q, k, v))
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x_BSD = x_BSD + self.proj(attn.transpose(1, 2).reshape(B, S, D))
        return x_BSD + self.moe(self.ln2(x_BSD).view(B * S, D)).view(B, S, D)


class MoEGPT(nn.Module):
    def __init__(self, cfg: ModelConfig, held: Mapping[int, Sequence[int]], seed: int):
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab, cfg.dim)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.dim)
        self.blocks = nn.ModuleList(Block(cfg, i, held[i], seed) for i in range(cfg.layers))
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

    def moe_layers(self) -> list[MoELayer]:
        return [b.moe for b in self.blocks]

    def forward(self, inputs_BS):
        B, S = inputs_BS.shape
        pos = torch.arange(S, device=inputs_BS.device)
        x_BSD = self.tok_emb(inputs_BS) + self.pos_emb(pos)
        for block in self.blocks:
            x_BSD = block(x_BSD)
        return self.head(self.ln_f(x_BSD))
