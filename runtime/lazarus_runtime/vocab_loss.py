"""The vocabulary side: output projection and cross-entropy, chunk by chunk, in fp32.

Legend: T tokens, D model dim, V vocabulary, C tokens in a chunk.

At GPT-2's vocabulary the logits are the largest tensor of a step: 32,768 tokens x 50,257
classes are 6.6 GB in fp32 (gpu-notes.md). Here they never exist whole: each chunk of C
tokens is projected, turned into fp32, reduced to its loss, and its gradients (softmax minus
one-hot, through the projection) are made at once, in the forward, so nothing of the chunk
has to be kept for the backward. The backward only scales the saved gradients by the
incoming one. The projection runs in the compute dtype; the softmax and the loss in fp32.
"""
from __future__ import annotations

import torch

# fp32 logits of one chunk, at most: 1 GiB.
CHUNK_LOGITS = 2**28


def chunk_tokens(vocab: int) -> int:
    """Tokens a chunk holds: as many as fit CHUNK_LOGITS, a multiple of 64 for the GEMMs."""
    return max(64, CHUNK_LOGITS // vocab // 64 * 64)


def _chunk_loss(logits_CV: torch.Tensor, targets_C: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp32 loss sum of the chunk, fp32 softmax of its logits, made in place of them)."""
    lse_C = torch.logsumexp(logits_CV, dim=-1)
    loss = (lse_C - logits_CV.gather(1, targets_C.unsqueeze(1)).squeeze(1)).sum()
    return loss, logits_CV.sub_(lse_C.unsqueeze(1)).exp_()


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h_TD: torch.Tensor, weight_VD: torch.Tensor, targets_T: torch.Tensor):
        chunk = chunk_tokens(weight_VD.shape[0])
        loss = torch.zeros((), dtype=torch.float32, device=h_TD.device)
        grad_h_TD = torch.empty_like(h_TD)
        grad_w_VD = torch.zeros(weight_VD.shape, dtype=torch.float32, device=weight_VD.device)
        for start in range(0, h_TD.shape[0], chunk):
            h_CD, targets_C = h_TD[start:start + chunk], targets_T[start:start + chunk]
            chunk_loss, probs_CV = _chunk_loss((h_CD @ weight_VD.T).float(), targets_C)
            loss += chunk_loss
            # d(loss)/d(logits) = softmax - one-hot of the target.
            grad_logits_CV = probs_CV.scatter_add_(
                1, targets_C.unsqueeze(1), probs_CV.new_full((len(targets_C), 1), -1.0)
            ).to(h_TD.dtype)
            torch.mm(grad_logits_CV, weight_VD, out=grad_h_TD[start:start + chunk])
            grad_w_VD += grad_logits_CV.T @ h_CD
        ctx.save_for_backward(grad_h_TD, grad_w_VD)
        ctx.weight_dtype = weight_VD.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        grad_h_TD, grad_w_VD = ctx.saved_tensors
        return (grad_h_TD * grad_loss.to(grad_h_TD.dtype),
                (grad_w_VD * grad_loss).to(ctx.weight_dtype), None)


def linear_cross_entropy_sum(h_TD: torch.Tensor, weight_VD: torch.Tensor,
                             targets_T: torch.Tensor) -> torch.Tensor:
    """fp32 sum over tokens of cross_entropy(h_TD @ weight_VD.T, targets_T)."""
    if torch.is_grad_enabled() and (h_TD.requires_grad or weight_VD.requires_grad):
        return _LinearCrossEntropy.apply(h_TD, weight_VD, targets_T)
    chunk = chunk_tokens(weight_VD.shape[0])
    return sum(_chunk_loss((h_TD[s:s + chunk] @ weight_VD.T).float(), targets_T[s:s + chunk])[0]
               for s in range(0, h_TD.shape[0], chunk))
