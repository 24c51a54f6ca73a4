"""A plain PyTorch MoE GPT, written the obvious way: the baseline of bench_train_step.py.

Legend: B batch, S sequence, T tokens, D model dim, F expert FFN dim, E experts, K top-k,
V vocabulary, P = T*K routed rows.

The same architecture as lazarus_runtime.model (pre-norm GPT blocks, SDPA causal attention,
an fp32 softmax router with top-k, experts D -> F -> D with GELU and biases, untied output
head), in the precision a user would reach for: fp32 parameters, bf16 autocast, an fp32
cross-entropy over the whole logits, fused AdamW on CUDA. Tokens are sorted by expert and
both expert projections are one ``torch._grouped_mm`` each where the device has it, a loop
elsewhere; counts come from ``torch.histc`` as torchtitan does it. No Lazarus code: no
dispatch kernels, no flat buffers, no chunked loss.
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn as nn
import torch.nn.functional as F

from lazarus_core.runtime_config import ModelConfig
from lazarus_runtime.experts import grouped_mm_supported


class PlainMoE(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        E, D, F_ = cfg.experts, cfg.dim, cfg.ffn_dim
        self.top_k = cfg.top_k
        self.gate = nn.Linear(D, E, bias=False)
        self.w1 = nn.Parameter(torch.randn(E, D, F_) * 0.02)
        self.b1 = nn.Parameter(torch.zeros(E, F_))
        self.w2 = nn.Parameter(torch.randn(E, F_, D) * 0.02)
        self.b2 = nn.Parameter(torch.zeros(E, D))
        self.grouped = False  # set by PlainTrainer for its device and precision

    def forward(self, x_TD):
        with torch.autocast(x_TD.device.type, enabled=False):
            probs_TE = F.softmax(self.gate(x_TD.float()), dim=-1)
        weights_TK, experts_TK = torch.topk(probs_TE, self.top_k, dim=-1)
        if self.top_k > 1:
            weights_TK = weights_TK / weights_TK.sum(-1, keepdim=True)
        order_P = torch.argsort(experts_TK.reshape(-1), stable=True)
        token_P = order_P // self.top_k
        expert_P = experts_TK.reshape(-1)[order_P]
        counts_E = torch.histc(experts_TK.float(), bins=self.w1.shape[0], min=0,
                               max=self.w1.shape[0] - 1).to(torch.int32)
        # Autocast leaves grouped GEMMs and additions alone: cast to its dtype by hand.
        dtype = (torch.get_autocast_dtype(x_TD.device.type)
                 if torch.is_autocast_enabled(x_TD.device.type) else x_TD.dtype)
        x_PD = x_TD[token_P].to(dtype)
        w1, b1, w2, b2 = (p.to(dtype) for p in (self.w1, self.b1, self.w2, self.b2))
        if self.grouped:
            offs_E = torch.cumsum(counts_E, 0, dtype=torch.int32)
            h_PF = F.gelu(torch._grouped_mm(x_PD, w1, offs=offs_E) + b1[expert_P])
            y_PD = torch._grouped_mm(h_PF, w2, offs=offs_E) + b2[expert_P]
        else:
            chunks = torch.split(x_PD, counts_E.tolist())
            y_PD = torch.cat([F.gelu(c @ w1[e] + b1[e]) @ w2[e] + b2[e]
                              for e, c in enumerate(chunks)])
        y_PD = y_PD * weights_TK.reshape(-1)[order_P].unsqueeze(1).to(dtype)
        return y_PD.new_zeros(x_TD.shape).index_add_(0, token_P, y_PD)


class PlainBlock(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.heads = cfg.heads
        self.ln1 = nn.LayerNorm(cfg.dim)
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim)
        self.proj = nn.Linear(cfg.dim, cfg.dim)
        self.ln2 = nn.LayerNorm(cfg.dim)
        self.moe = PlainMoE(cfg)

    def forward(self, x_BSD):
        B, S, D = x_BSD.shape
        q, k, v = self.qkv(self.ln1(x_BSD)).split(D, dim=-1)
        q, k, v = (t.view(B, S, self.heads, D // self.heads).transpose(1, 2) for t in (q, k, v))
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x_BSD = x_BSD + self.proj(attn.transpose(1, 2).reshape(B, S, D))
        return x_BSD + self.moe(self.ln2(x_BSD).view(B * S, D)).view(B, S, D)


class PlainMoEGPT(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.tok_emb = nn.Embedding(cfg.vocab, cfg.dim)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.dim)
        self.blocks = nn.ModuleList(PlainBlock(cfg) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab, bias=False)

    def forward(self, inputs_BS, targets_BS):
        pos = torch.arange(inputs_BS.shape[1], device=inputs_BS.device)
        x_BSD = self.tok_emb(inputs_BS) + self.pos_emb(pos)
        for block in self.blocks:
            x_BSD = block(x_BSD)
        logits_BSV = self.head(self.ln_f(x_BSD))
        return F.cross_entropy(logits_BSV.flatten(0, 1).float(), targets_BS.flatten())


class PlainTrainer:
    """One training step of the plain model: autocast forward, backward, AdamW."""

    def __init__(self, cfg: ModelConfig, device: torch.device, precision: str, lr: float,
                 compiled: bool):
        self.model = PlainMoEGPT(cfg).to(device)
        # The runtime's own probe: the same kernel, shape rules and device support apply.
        grouped = grouped_mm_supported(device, torch.bfloat16 if precision == "bf16"
                                       else torch.float32, cfg.dim, cfg.ffn_dim)
        for block in self.model.blocks:
            block.moe.grouped = grouped
        self.device = device
        self.precision = precision
        self.forward = torch.compile(self.model) if compiled else self.model
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=lr,
                                           fused=device.type == "cuda")

    def step(self, inputs_BS: torch.Tensor, targets_BS: torch.Tensor) -> None:
        inputs_BS = inputs_BS.to(self.device, non_blocking=True)
        targets_BS = targets_BS.to(self.device, non_blocking=True)
        self.optimizer.zero_grad(set_to_none=True)
        autocast = (torch.autocast(self.device.type, dtype=torch.bfloat16)
                    if self.precision == "bf16" else contextlib.nullcontext())
        with autocast:
            loss = self.forward(inputs_BS, targets_BS)
        loss.backward()
        self.optimizer.step()
