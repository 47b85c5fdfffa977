"""Chunked-over-tokens torch path: same outputs and memory behaviour as the Triton kernels.

Each chunk of rows is upcast to fp32 once and worked on in place, so the extra memory is
about two fp32 [rows, V] buffers, with rows chosen from a byte budget. This is the CPU
backend; it also runs on CUDA (backend='torch') for debugging.
"""

from __future__ import annotations

import torch


def rows_per_chunk(V: int, chunk_bytes: int) -> int:
    """Rows per chunk so that two fp32 [rows, V] buffers fit in chunk_bytes (at least 1)."""
    return max(1, chunk_bytes // (8 * max(V, 1)))


def _owned(target_ids: torch.Tensor, vocab_start: int, V: int) -> tuple[torch.Tensor, torch.Tensor]:
    local = target_ids.long() - vocab_start
    owned = (local >= 0) & (local < V)
    return local.clamp(0, max(V - 1, 0)), owned


def chunked_stats(
    logits: torch.Tensor,
    target_ids: torch.Tensor,
    vocab_start: int = 0,
    chunk_bytes: int = 32 << 20,
) -> torch.Tensor:
    """stats [T, 4] fp32 = (max, sum exp(x - max), E[x], target logit or 0) of logits [T, V]."""
    T, V = logits.shape
    stats = torch.empty(T, 4, device=logits.device, dtype=torch.float32)
    local, owned = _owned(target_ids, vocab_start, V)
    step = rows_per_chunk(V, chunk_bytes)
    for r0 in range(0, T, step):
        r1 = min(T, r0 + step)
        z = logits[r0:r1].to(torch.float32, copy=True)
        m = z.amax(dim=1)
        z.sub_(m.unsqueeze(1))
        e = torch.exp(z)
        s = e.sum(dim=1)
        ez = torch.bmm(e.unsqueeze(1), z.unsqueeze(2)).view(-1)  # sum e * (x - m), no temp
        del e, z
        tgt = logits[r0:r1].gather(1, local[r0:r1].unsqueeze(1)).squeeze(1).float()
        stats[r0:r1, 0] = m
        stats[r0:r1, 1] = s
        stats[r0:r1, 2] = m + ez / s
        stats[r0:r1, 3] = torch.where(owned[r0:r1], tgt, torch.zeros_like(tgt))
    return stats


def chunked_logits_grad(
    logits: torch.Tensor,
    target_ids: torch.Tensor,
    lse: torch.Tensor,
    ex: torch.Tensor,
    g: torch.Tensor,
    h: torch.Tensor | None,
    out: torch.Tensor,
    vocab_start: int = 0,
    chunk_bytes: int = 32 << 20,
) -> torch.Tensor:
    """Write grad_j = g (onehot_j - p_j) - h p_j (x_j - E[x]) into out [T, V] (may be logits)."""
    T, V = logits.shape
    local, owned = _owned(target_ids, vocab_start, V)
    step = rows_per_chunk(V, chunk_bytes)
    for r0 in range(0, T, step):
        r1 = min(T, r0 + step)
        z = logits[r0:r1].to(torch.float32, copy=True)
        z.sub_(lse[r0:r1].unsqueeze(1))  # log p
        p = torch.exp(z)
        gc = g[r0:r1].unsqueeze(1)
        if h is not None:  # -p * (g + h * (log p + lse - E[x]))
            z.add_((lse[r0:r1] - ex[r0:r1]).unsqueeze(1)).mul_(h[r0:r1].unsqueeze(1)).add_(gc)
            z.mul_(p).neg_()
        else:
            torch.mul(p, gc, out=z).neg_()
        del p
        add = torch.where(owned[r0:r1], g[r0:r1], torch.zeros_like(g[r0:r1]))
        z.scatter_add_(1, local[r0:r1].unsqueeze(1), add.unsqueeze(1))
        out[r0:r1].copy_(z)
    return out
