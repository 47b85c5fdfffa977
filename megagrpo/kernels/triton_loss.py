"""Triton kernels: online (chunked-over-vocab) log-softmax stats + clipped surrogate, and the
chunked logits gradient. One program per token row; nothing [T, V]-sized is allocated except
the gradient itself (and not even that with grad-in-logits).

On CPU these run in the Triton interpreter: ``TRITON_INTERPRET=1`` must be set before this
module is imported (the ``@triton.jit`` decorator reads it). All math is fp32 whatever the
logits dtype (bf16 is upcast on load; no ``tl.dot`` is used).

Per row the forward keeps a running max m, s = sum exp(x - m) and u = sum exp(x - m) * x, and
writes stats [T, 4] = (m, s, E[x] = u / s, target logit or 0 when the target lies in another
vocab shard). With FUSE it also writes, from the same pass, terms [T, 8] =
(logp, entropy, pg, dpg/dlogp, clipped, ratio, kl, dkl/dlogp) of the clipped surrogate
pg = max(-A r, -A clamp(r, 1 - eps_low, 1 + eps_high)), r = exp(logp - old), and of the k3 KL.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

NUM_TERMS = 8
NUM_STATS = 4


@triton.jit
def _stats_fwd_kernel(
    logits_ptr,
    stride_row,
    target_ptr,
    vocab_start,
    V,
    stats_ptr,
    terms_ptr,
    old_ptr,
    adv_ptr,
    ref_ptr,
    eps_low,
    eps_high,
    BLOCK_V: tl.constexpr,
    FUSE: tl.constexpr,
    HAS_REF: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride_row
    offs = tl.arange(0, BLOCK_V)
    m = tl.max(tl.full([BLOCK_V], float("-inf"), tl.float32), axis=0)
    s = tl.sum(tl.zeros([BLOCK_V], tl.float32), axis=0)
    u = tl.sum(tl.zeros([BLOCK_V], tl.float32), axis=0)
    for start in range(0, V, BLOCK_V):
        cols = start + offs
        valid = cols < V
        x = tl.load(base + cols, mask=valid, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        scale = tl.exp(m - m_new)
        e = tl.where(valid, tl.exp(x - m_new), 0.0)
        s = s * scale + tl.sum(e, axis=0)
        u = u * scale + tl.sum(e * tl.where(valid, x, 0.0), axis=0)
        m = m_new
    tgt_local = tl.load(target_ptr + row).to(tl.int64) - vocab_start
    owned = (tgt_local >= 0) & (tgt_local < V)
    tgt = tl.load(base + tl.where(owned, tgt_local, 0)).to(tl.float32)
    tgt = tl.where(owned, tgt, 0.0)
    ex = u / s  # pyright: ignore[reportOperatorIssue]  (Triton tensors)
    sp = stats_ptr + row * 4
    tl.store(sp + 0, m)
    tl.store(sp + 1, s)
    tl.store(sp + 2, ex)
    tl.store(sp + 3, tgt)
    if FUSE:
        lse = m + tl.log(s)
        logp = tgt - lse
        old = tl.load(old_ptr + row).to(tl.float32)
        adv = tl.load(adv_ptr + row).to(tl.float32)
        ratio = tl.exp(logp - old)
        pg1 = -adv * ratio
        pg2 = -adv * tl.minimum(tl.maximum(ratio, 1.0 - eps_low), 1.0 + eps_high)
        clipped = pg2 > pg1
        tp = terms_ptr + row * 8
        tl.store(tp + 0, logp)
        tl.store(tp + 1, lse - ex)
        tl.store(tp + 2, tl.maximum(pg1, pg2))
        tl.store(tp + 3, tl.where(clipped, 0.0, pg1))
        tl.store(tp + 4, tl.where(clipped, 1.0, 0.0))
        tl.store(tp + 5, ratio)
        if HAS_REF:
            d = tl.load(ref_ptr + row).to(tl.float32) - logp
            tl.store(tp + 6, tl.exp(d) - d - 1.0)
            tl.store(tp + 7, 1.0 - tl.exp(d))
        else:
            tl.store(tp + 6, 0.0)
            tl.store(tp + 7, 0.0)


@triton.jit
def _logits_grad_kernel(
    logits_ptr,
    stride_row,
    grad_ptr,
    grad_stride,
    target_ptr,
    vocab_start,
    V,
    lse_ptr,
    ex_ptr,
    g_ptr,
    h_ptr,
    BLOCK_V: tl.constexpr,
    HAS_H: tl.constexpr,
):
    """grad_j = g * (onehot_j - p_j) - h * p_j * (x_j - E[x]);  g = dL/dlogp, h = dL/dH."""
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride_row
    gbase = grad_ptr + row * grad_stride
    offs = tl.arange(0, BLOCK_V)
    lse = tl.load(lse_ptr + row)
    g = tl.load(g_ptr + row)
    h = 0.0
    ex = 0.0
    if HAS_H:
        h = tl.load(h_ptr + row)
        ex = tl.load(ex_ptr + row)
    tgt_local = tl.load(target_ptr + row).to(tl.int64) - vocab_start
    for start in range(0, V, BLOCK_V):
        cols = start + offs
        valid = cols < V
        x = tl.load(base + cols, mask=valid, other=0.0).to(tl.float32)
        p = tl.exp(x - lse)
        if HAS_H:
            grad = -p * (g + h * (x - ex))
        else:
            grad = -p * g
        grad = tl.where(cols == tgt_local, grad + g, grad)
        tl.store(gbase + cols, grad.to(grad_ptr.dtype.element_ty), mask=valid)


def _block_v(V: int, block_v: int | None) -> int:
    if block_v is not None:
        if block_v & (block_v - 1):
            raise ValueError(f"block_v must be a power of two, got {block_v}")
        return block_v
    return min(triton.next_power_of_2(V), 4096)


def _check(logits: torch.Tensor) -> None:
    if logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError("logits must be [T, V] with a contiguous vocab dim")
    if not logits.is_cuda and not _interpreting():
        raise RuntimeError(
            "Triton kernels on CPU tensors need TRITON_INTERPRET=1 set before "
            "megagrpo.kernels.triton_loss is imported; use backend='torch'"
        )


def _interpreting() -> bool:
    return type(_stats_fwd_kernel).__name__ == "InterpretedFunction"


def triton_stats(
    logits: torch.Tensor,
    target_ids: torch.Tensor,
    vocab_start: int = 0,
    *,
    old_logprobs: torch.Tensor | None = None,
    advantages: torch.Tensor | None = None,
    ref_logprobs: torch.Tensor | None = None,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    block_v: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Online log-softmax stats of logits [T, V_local] (bf16/fp16/fp32).

    Returns stats [T, 4] fp32 = (max, sum exp(x - max), E[x], target logit or 0) and, when
    old_logprobs and advantages [T] are given (fused surrogate), terms [T, 8] fp32 (see the
    module docstring); else None.
    """
    _check(logits)
    T, V = logits.shape
    dev = logits.device
    stats = torch.empty(T, NUM_STATS, device=dev, dtype=torch.float32)
    fuse = old_logprobs is not None and advantages is not None
    terms = torch.empty(T, NUM_TERMS, device=dev, dtype=torch.float32) if fuse else stats
    old = old_logprobs.float().contiguous() if old_logprobs is not None and fuse else stats
    adv = advantages.float().contiguous() if advantages is not None and fuse else stats
    ref = ref_logprobs.float().contiguous() if ref_logprobs is not None else stats
    if T == 0:
        return stats, (terms if fuse else None)
    bv = _block_v(V, block_v)
    _stats_fwd_kernel[(T,)](
        logits,
        logits.stride(0),
        target_ids.contiguous(),
        vocab_start,
        V,
        stats,
        terms,
        old,
        adv,
        ref,
        float(eps_low),
        float(eps_high),
        BLOCK_V=bv,
        FUSE=fuse,
        HAS_REF=ref_logprobs is not None,
        num_warps=8 if bv >= 2048 else 4,  # pyright: ignore[reportCallIssue]  (launch option)
    )
    return stats, (terms if fuse else None)


def triton_logits_grad(
    logits: torch.Tensor,
    target_ids: torch.Tensor,
    lse: torch.Tensor,
    ex: torch.Tensor,
    g: torch.Tensor,
    h: torch.Tensor | None,
    out: torch.Tensor,
    vocab_start: int = 0,
    block_v: int | None = None,
) -> torch.Tensor:
    """Write d loss / d logits [T, V_local] into ``out`` (may be ``logits`` itself).

    lse, ex, g, h: [T] fp32 global log-sum-exp, E[x], dL/dlogp, dL/dentropy (h None: no
    entropy term). Every element of ``out`` is written, masked tokens get zeros.
    """
    _check(logits)
    T, V = logits.shape
    if T == 0:
        return out
    if out.stride(1) != 1:
        raise ValueError("out must have a contiguous vocab dim")
    bv = _block_v(V, block_v)
    has_h = h is not None
    _logits_grad_kernel[(T,)](
        logits,
        logits.stride(0),
        out,
        out.stride(0),
        target_ids.contiguous(),
        vocab_start,
        V,
        lse.contiguous(),
        ex.contiguous(),
        g.contiguous(),
        h.contiguous() if has_h else g,
        BLOCK_V=bv,
        HAS_H=has_h,
        num_warps=8 if bv >= 2048 else 4,  # pyright: ignore[reportCallIssue]  (launch option)
    )
    return out
