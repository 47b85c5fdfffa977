"""O(T) epilogue of the fused loss: closed-form per-token terms and their gradients.

Given per-token log-probs and entropies (from the online stats), this computes the batch
loss, the metrics, and the two per-token coefficients the logits gradient needs:
g_t = dL/dlogp_t and h_t = dL/dH_t. It mirrors megagrpo.algo.losses (which is autograd
based); the tests check one against the other.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megagrpo.algo.config import LossConfig
from megagrpo.algo.losses import loss_metrics, tis_factor, token_weights

Tensor = torch.Tensor


@dataclass
class TokenTerms:
    """Per-token terms [T] fp32: surrogate pg and dpg/dlogp, clipped (0/1), ratio, k3 KL, dKL."""

    pg: Tensor
    dpg: Tensor
    clipped: Tensor
    ratio: Tensor
    kl: Tensor | None = None
    dkl: Tensor | None = None


def token_terms(
    logp: Tensor, old: Tensor, adv: Tensor, cfg: LossConfig, ref: Tensor | None
) -> TokenTerms:
    """Clipped surrogate (SAPO's soft gate for ``variant: sapo``) and k3 KL per token with
    their logp derivatives (as the kernel does)."""
    ratio = torch.exp(logp - old)
    if cfg.variant == "sapo":  # pg = -A g(r), dpg/dlogp = -A g'(r) r, g' = 4 s (1 - s)
        tau = torch.where(adv > 0, cfg.sapo_tau_pos, cfg.sapo_tau_neg).to(ratio.dtype)
        s = torch.sigmoid(tau * (ratio - 1.0))
        terms = TokenTerms(
            -adv * s * (4.0 / tau),
            -adv * 4.0 * s * (1.0 - s) * ratio,
            torch.zeros_like(ratio),
            ratio,
        )
    else:
        pg1 = -adv * ratio
        pg2 = -adv * ratio.clamp(1.0 - cfg.eps_low, 1.0 + cfg.eps_high)
        clipped = pg2 > pg1
        terms = TokenTerms(
            torch.maximum(pg1, pg2), torch.where(clipped, 0.0, pg1), clipped.float(), ratio
        )
    if ref is not None:
        d = ref - logp
        terms.kl, terms.dkl = torch.exp(d) - d - 1.0, 1.0 - torch.exp(d)
    return terms


def from_kernel(terms: Tensor, has_ref: bool) -> TokenTerms:
    """TokenTerms from the kernel's packed [T, 8] output."""
    t = terms.unbind(1)
    return TokenTerms(t[2], t[3], t[4], t[5], t[6] if has_ref else None, t[7] if has_ref else None)


def gspo_terms(
    logp: Tensor,
    old: Tensor,
    adv: Tensor,
    m: Tensor,
    ids: Tensor,
    num_seqs: int,
    cfg: LossConfig,
    ref: Tensor | None,
) -> tuple[TokenTerms, Tensor]:
    """GSPO sequence terms broadcast to tokens; dpg is d pg_i / d logp_t for t in i.

    Returns (terms, ids) where terms.pg is pg_i on every token of sequence i.
    """
    n = torch.zeros(num_seqs, device=m.device).index_add_(0, ids, m).clamp_min(1.0)
    log_s = torch.zeros(num_seqs, device=m.device).index_add_(0, ids, (logp - old) * m) / n
    adv_seq = torch.zeros(num_seqs, device=m.device).index_add_(0, ids, adv * m) / n
    seq = token_terms(log_s, torch.zeros_like(log_s), adv_seq, cfg, None)
    dpg = seq.dpg[ids] * m / n[ids]
    terms = TokenTerms(seq.pg[ids], dpg, seq.clipped[ids], seq.ratio[ids])
    if ref is not None:
        d = ref - logp
        terms.kl, terms.dkl = torch.exp(d) - d - 1.0, 1.0 - torch.exp(d)
    return terms, ids


def assemble(
    logp: Tensor,
    ent: Tensor,
    old: Tensor,
    adv: Tensor,
    m: Tensor,
    cfg: LossConfig,
    ids: Tensor | None,
    num_seqs: int,
    terms: TokenTerms,
    rollout: Tensor | None,
    seq_weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor], Tensor, Tensor | None]:
    """Loss (0-d), metrics, g [T] = dL/dlogp and h [T] = dL/dH (None when entropy_coef == 0).
    ``seq_weights`` [num_seqs]: per-sequence aggregation weights (see ``token_weights``)."""
    c = token_weights(m, ids, num_seqs, cfg.resolved_loss_agg(), cfg.max_tokens, seq_weights)
    w = tis_factor(old, rollout, cfg)
    cw = c if w is None else c * w
    pg_loss = (cw * terms.pg).sum()
    if cfg.variant == "gspo":  # pg_i is shared by all tokens of i: dL/dlogp_t = C_i dpg_i/dlogp_t
        if ids is None:
            raise ValueError("GSPO needs sequences: pass [B, S] inputs or seq_ids [T]")
        big_c = torch.zeros(num_seqs, device=m.device).index_add_(0, ids, cw)
        g = big_c[ids] * terms.dpg
    else:
        g = cw * terms.dpg
    loss = pg_loss
    if cfg.kl_coef > 0:
        if terms.kl is None or terms.dkl is None:
            raise ValueError("loss.kl_coef > 0 needs ref_logprobs")
        loss = loss + cfg.kl_coef * (c * terms.kl).sum()
        g = g + cfg.kl_coef * c * terms.dkl
    h = None
    if cfg.entropy_coef != 0:
        loss = loss - cfg.entropy_coef * (c * ent).sum()
        h = -cfg.entropy_coef * c
    metrics = loss_metrics(
        m, pg_loss, terms.ratio, terms.clipped > 0, adv, cfg, ent, terms.kl, w, ids, num_seqs
    )
    metrics["loss/total"] = loss.detach()
    return loss, metrics, g, h


def mismatch_sums(logp: Tensor, probe: Tensor, m: Tensor) -> dict[str, Tensor]:
    """Unweighted sums of ``|logp - probe|`` over the mask (``loss/logprob_mismatch_sum``,
    ``_tokens_sum``, ``_max``): the train/inference mismatch measured on the training forward
    when it is also the behaviour forward (no separate old-log-prob forward ran)."""
    diff = (logp.detach() - probe).abs() * m
    return {
        "loss/logprob_mismatch_sum": diff.sum(),
        "loss/logprob_mismatch_tokens_sum": m.sum(),
        "loss/logprob_mismatch_max": diff.max() if diff.numel() else diff.sum(),
    }
