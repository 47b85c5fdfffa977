"""Reference policy losses in pure torch: GRPO / DAPO / Dr.GRPO / GSPO / SAPO, k3 KL, entropy,
TIS.

These are the readable, autograd-differentiated definitions the fused kernels
(megagrpo.kernels) are tested against. They materialise a [T, V] fp32 log-softmax, so use
them for tests and small shapes; training calls ``megagrpo.kernels.fused_policy_loss``.

Tokens are flat ([T]) or [B, S] (then each row is one sequence). Sequence-level pieces
(GRPO's per-sequence mean, Dr.GRPO, GSPO) need ``seq_ids [T]`` (0..num_seqs-1) for flat,
packed inputs. Per-token loss l_t = w_t * pg_t + kl_coef * kl_t - entropy_coef * H_t and the
batch loss is sum_t c_t * l_t with the aggregation weights c_t of :func:`token_weights`.

Deliberately left out: dual-clip PPO, value baselines, sequence-level TIS.
"""

from __future__ import annotations

import torch

from megagrpo.algo.config import LossConfig

Tensor = torch.Tensor


def _up(t: Tensor) -> Tensor:
    """fp32 for lower precisions; fp64 stays fp64 (gradcheck)."""
    return t if t.dtype == torch.float64 else t.float()


def token_logprobs(logits: Tensor, target_ids: Tensor) -> Tensor:
    """log softmax(logits)[target] in fp32. logits [..., V], target_ids [...] -> [...]."""
    logp = torch.log_softmax(_up(logits), dim=-1)
    return logp.gather(-1, target_ids.long().clamp(0, logits.shape[-1] - 1).unsqueeze(-1)).squeeze(
        -1
    )


def token_entropy(logits: Tensor) -> Tensor:
    """Entropy of softmax(logits) in fp32. logits [..., V] -> [...]."""
    logp = torch.log_softmax(_up(logits), dim=-1)
    return -(logp.exp() * logp).sum(-1)


def k3_kl(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """k3 estimator of KL(pi || pi_ref) per token: exp(r) - r - 1 with r = ref - logp. [T]."""
    r = _up(ref_logp) - logp
    return torch.exp(r) - r - 1.0


def clipped_surrogate(
    logp: Tensor, old: Tensor, adv: Tensor, eps_low: float, eps_high: float
) -> tuple[Tensor, Tensor, Tensor]:
    """PPO/GRPO clipped surrogate per token with asymmetric clip (DAPO clip-higher).

    pg_t = max(-A r, -A clamp(r, 1 - eps_low, 1 + eps_high)), r = exp(logp - old).
    Returns (pg [T], clipped [T] bool: the clamped branch won, ratio [T]).
    """
    ratio = torch.exp(logp - _up(old))
    adv = _up(adv)
    pg1 = -adv * ratio
    pg2 = -adv * torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high)
    return torch.maximum(pg1, pg2), (pg2 > pg1).detach(), ratio


def sapo_surrogate(
    logp: Tensor, old: Tensor, adv: Tensor, tau_pos: float, tau_neg: float
) -> tuple[Tensor, Tensor, Tensor]:
    """SAPO's soft-gated surrogate per token (ms-swift's ``loss_type sapo``).

    pg_t = -A g(r), g(r) = sigmoid(tau (r - 1)) * 4 / tau, tau = tau_pos where A > 0, else
    tau_neg; r = exp(logp - old). dg/dr = 4 sigma (1 - sigma): 1 at r = 1 (the policy
    gradient, on-policy), fading as r leaves 1. Nothing is clipped.
    Returns (pg [T], clipped [T] all False, ratio [T]).
    """
    ratio = torch.exp(logp - _up(old))
    adv = _up(adv)
    tau = torch.where(adv > 0, tau_pos, tau_neg).to(ratio.dtype)
    gate = torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)
    return -adv * gate, torch.zeros_like(ratio, dtype=torch.bool), ratio


def gspo_surrogate(
    logp: Tensor,
    old: Tensor,
    adv: Tensor,
    mask: Tensor,
    seq_ids: Tensor,
    num_seqs: int,
    eps_low: float,
    eps_high: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """GSPO: clipped surrogate on the length-normalised sequence ratio, broadcast to tokens.

    s_i = exp(mean_{t in i, mask} (logp_t - old_t)); A_i = masked mean of adv over seq i.
    Returns (pg [T]: the sequence's loss on each of its tokens, clipped [T], s_i on tokens [T]).
    """
    m = mask.to(logp.dtype)

    def seq_sum(x: Tensor) -> Tensor:
        return torch.zeros(num_seqs, device=logp.device, dtype=logp.dtype).index_add_(0, seq_ids, x)

    n = seq_sum(m).clamp_min(1.0)
    log_s = seq_sum((logp - _up(old)) * m) / n
    adv_seq = seq_sum(_up(adv) * m) / n
    pg, clipped, s = clipped_surrogate(log_s, torch.zeros_like(log_s), adv_seq, eps_low, eps_high)
    return pg[seq_ids], clipped[seq_ids], s[seq_ids]


def tis_weights(old: Tensor, rollout: Tensor, cap: float, mode: str = "truncate") -> Tensor:
    """Token-level importance weights of r = pi_trainer_old / pi_rollout. [T]. ``truncate``
    (TIS): min(r, cap); ``mask`` (MIS): r inside [1 / cap, cap], 0 outside."""
    r = torch.exp(_up(old) - _up(rollout))
    if mode == "mask":
        return torch.where((r <= cap) & (r >= 1.0 / cap), r, torch.zeros_like(r)).detach()
    return torch.clamp(r, max=cap).detach()


def tis_factor(old: Tensor, rollout: Tensor | None, cfg: LossConfig) -> Tensor | None:
    """:func:`tis_weights` ``[T]`` under ``cfg`` (``loss.tis_cap``, ``loss.tis_mode``); None
    when ``tis_cap`` is 0 (no correction). ValueError without rollout log-probs."""
    if cfg.tis_cap <= 0:
        return None
    if rollout is None:
        raise ValueError("loss.tis_cap > 0 needs rollout_logprobs")
    return tis_weights(old, rollout, cfg.tis_cap, cfg.tis_mode)


def make_seq_ids(shape: torch.Size, seq_ids: Tensor | None, device) -> tuple[Tensor | None, int]:
    """Flat sequence ids [T] and their count: rows of a [B, S] batch, or the given packed ids."""
    if seq_ids is not None:
        ids = seq_ids.reshape(-1).long()
        return ids, (int(ids.max()) + 1 if ids.numel() else 0)
    if len(shape) == 2:
        b, s = shape
        return torch.arange(b, device=device).repeat_interleave(s), b
    return None, 0


def token_weights(
    mask: Tensor,
    seq_ids: Tensor | None,
    num_seqs: int,
    agg: str,
    max_tokens: int = 0,
    seq_weights: Tensor | None = None,
) -> Tensor:
    """Aggregation weights c_t [T] with loss = sum_t c_t * l_t.

    token_mean: m_t / sum(m). seq_mean_token_mean: m_t / (n_seq(t) * #non-empty seqs).
    seq_mean_token_sum_norm (Dr.GRPO): m_t / (num_seqs * L), L = max_tokens or longest n_i.
    ``seq_weights`` [num_seqs] (e.g. :func:`megagrpo.algo.advantages.sequence_weights`)
    weighs sequence s by w_s: m_t w_s / sum_t m_t w_s, m_t w_s / (n_s * sum_{s non-empty} w_s)
    and m_t w_s / (L * sum_s w_s); all ones gives the unweighted forms exactly.
    """
    m = _up(mask.reshape(-1))
    if seq_weights is not None:
        if seq_ids is None:
            raise ValueError("seq_weights need sequences: pass [B, S] inputs or seq_ids [T]")
        w = _up(seq_weights.reshape(-1)).to(m.dtype)
        if w.numel() != num_seqs:
            raise ValueError(f"seq_weights has {w.numel()} entries for {num_seqs} sequences")
    else:
        w = None
    mw = m if w is None else m * w[seq_ids]
    if agg == "token_mean":
        return mw / mw.sum().clamp_min(1e-12 if w is not None else 1.0)
    if seq_ids is None:
        raise ValueError(
            f"loss aggregation {agg!r} needs sequences: pass [B, S] inputs or seq_ids [T]"
        )
    n = torch.zeros(num_seqs, device=m.device, dtype=m.dtype).index_add_(0, seq_ids, m)
    if agg == "seq_mean_token_mean":
        if w is None:
            num_valid = (n > 0).sum().clamp_min(1).float()
            return m / (n.clamp_min(1.0)[seq_ids] * num_valid.to(m.dtype))
        mass = (w * (n > 0)).sum().clamp_min(1e-12)
        return mw / (n.clamp_min(1.0)[seq_ids] * mass)
    if agg == "seq_mean_token_sum_norm":
        length = float(max_tokens) if max_tokens > 0 else n.max().clamp_min(1.0)
        if w is None:
            return m / (num_seqs * length)
        return mw / (w.sum().clamp_min(1e-12) * length)
    raise ValueError(f"unknown loss aggregation {agg!r}")


def aggregation_mass(
    mask: Tensor, seq_ids: Tensor | None, num_seqs: int, agg: str, seq_weights: Tensor | None = None
) -> Tensor:
    """The normaliser :func:`token_weights` divides by (up to Dr.GRPO's length), 0-d.

    token_mean: sum_t m_t w_s; seq_mean_token_mean: sum of w_s over non-empty sequences;
    seq_mean_token_sum_norm: sum_s w_s (w = 1 without weights). A batch split into
    micro-batches has the loss sum_k (mass_k / mass) * loss_k exactly when every micro-batch
    loss uses the same Dr.GRPO length (set ``max_tokens``): this is the scale a trainer gives
    each micro-batch's loss.
    """
    m = _up(mask.reshape(-1))
    if seq_ids is None:
        if agg != "token_mean" or seq_weights is not None:
            raise ValueError(f"aggregation {agg!r} with weights needs sequences (seq_ids)")
        return m.sum()
    w = torch.ones(num_seqs, dtype=m.dtype, device=m.device)
    if seq_weights is not None:
        w = _up(seq_weights.reshape(-1)).to(m.dtype)
    if agg == "token_mean":
        return (m * w[seq_ids]).sum()
    n = torch.zeros(num_seqs, device=m.device, dtype=m.dtype).index_add_(0, seq_ids, m)
    if agg == "seq_mean_token_mean":
        return (w * (n > 0)).sum()
    if agg == "seq_mean_token_sum_norm":
        return w.sum()
    raise ValueError(f"unknown loss aggregation {agg!r}")


def _masked_mean(x: Tensor, m: Tensor) -> Tensor:
    return (x.to(m.dtype) * m).sum() / m.sum().clamp_min(1.0)


def loss_metrics(
    m: Tensor,
    pg_loss: Tensor,
    ratio: Tensor,
    clipped: Tensor,
    adv: Tensor,
    cfg: LossConfig,
    entropy: Tensor | None = None,
    kl: Tensor | None = None,
    tis_w: Tensor | None = None,
    seq_ids: Tensor | None = None,
    num_seqs: int = 0,
) -> dict[str, Tensor]:
    """Detached 0-d metric tensors (DESIGN.md names), token means over the mask m [T].

    Keys ending ``_min`` / ``_max`` hold this call's value for a min / max over calls (a
    trainer combines micro-batches so; +inf / -inf when no token is valid), keys ending
    ``_sum`` a sum over calls: ``loss/entropy_seq_sum`` (the sum over non-empty sequences of
    each one's mean token entropy) and ``loss/nonempty_seqs_sum`` (their count), with
    ``seq_ids`` [T]."""
    valid = m > 0
    big = torch.finfo(ratio.dtype).max
    ratio = ratio.detach()
    low = _masked_mean(clipped & (ratio < 1.0 - cfg.eps_low) & (adv < 0), m)
    high = _masked_mean(clipped & (ratio > 1.0 + cfg.eps_high) & (adv > 0), m)
    inf = torch.tensor(float("inf"), device=m.device)
    out = {
        "loss/policy": pg_loss.detach(),
        "loss/clip_frac": _masked_mean(clipped, m),
        "loss/clip_frac_low": low,
        "loss/clip_frac_high": high,
        "loss/clip_frac_low_min": low if valid.any() else inf,
        "loss/clip_frac_high_max": high if valid.any() else -inf,
        "loss/ratio_mean": _masked_mean(ratio, m),
        "loss/ratio_min": torch.where(valid, ratio, big).min()
        if valid.any()
        else ratio.new_ones(()),
        "loss/ratio_max": torch.where(valid, ratio, -big).max()
        if valid.any()
        else ratio.new_ones(()),
    }
    if entropy is not None:
        out["loss/entropy"] = _masked_mean(entropy.detach(), m)
        if seq_ids is not None and num_seqs > 0:
            z = torch.zeros(num_seqs, device=m.device, dtype=m.dtype)
            n = z.index_add(0, seq_ids, m)
            per_seq = z.index_add(0, seq_ids, entropy.detach().to(m.dtype) * m)
            nonempty = n > 0
            out["loss/entropy_seq_sum"] = (per_seq[nonempty] / n[nonempty]).sum()
            out["loss/nonempty_seqs_sum"] = nonempty.sum().to(m.dtype)
    if kl is not None:
        out["loss/kl"] = _masked_mean(kl.detach(), m)
    if tis_w is not None:
        out["loss/tis_weight_mean"] = _masked_mean(tis_w, m)
        cut = tis_w == 0 if cfg.tis_mode == "mask" else tis_w >= cfg.tis_cap
        out["loss/tis_clip_frac"] = _masked_mean(cut, m)
    return out


def policy_loss(
    logp: Tensor,
    old_logprobs: Tensor | None,
    advantages: Tensor,
    mask: Tensor,
    cfg: LossConfig,
    *,
    entropy: Tensor | None = None,
    ref_logprobs: Tensor | None = None,
    rollout_logprobs: Tensor | None = None,
    seq_ids: Tensor | None = None,
    seq_weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """The GRPO-family loss from per-token log-probs.

    Args (all [T] or all [B, S]): logp (differentiable, fp32), old_logprobs (None: on-policy,
        old = logp.detach()), advantages, mask (1 = response token), entropy (optional, needed
        when cfg.entropy_coef > 0), ref_logprobs (needed when cfg.kl_coef > 0),
        rollout_logprobs (needed when cfg.tis_cap > 0). seq_ids [T] for packed flat input.
        seq_weights [num_seqs]: per-sequence weights of the aggregation (:func:`token_weights`).

    Returns (scalar loss, metrics): see :func:`loss_metrics`; ``loss/total`` is the loss.
    """
    shape = logp.shape
    ids, num_seqs = make_seq_ids(shape, seq_ids, logp.device)

    def flat(x: Tensor | None) -> Tensor | None:
        return None if x is None else x.reshape(-1)

    logp = logp.reshape(-1)
    old, ent, ref, rollout = (
        flat(x) for x in (old_logprobs, entropy, ref_logprobs, rollout_logprobs)
    )
    old = logp.detach() if old is None else old.to(logp.dtype)
    adv, m = advantages.reshape(-1).to(logp.dtype), mask.reshape(-1).to(logp.dtype)
    if cfg.variant == "gspo":
        if ids is None:
            raise ValueError("GSPO needs sequences: pass [B, S] inputs or seq_ids [T]")
        pg, clipped, ratio = gspo_surrogate(
            logp, old, adv, m, ids, num_seqs, cfg.eps_low, cfg.eps_high
        )
    elif cfg.variant == "sapo":
        pg, clipped, ratio = sapo_surrogate(logp, old, adv, cfg.sapo_tau_pos, cfg.sapo_tau_neg)
    else:
        pg, clipped, ratio = clipped_surrogate(logp, old, adv, cfg.eps_low, cfg.eps_high)
    c = token_weights(m, ids, num_seqs, cfg.resolved_loss_agg(), cfg.max_tokens, seq_weights)
    tis_w = tis_factor(old, rollout, cfg)
    if tis_w is not None:
        pg = pg * tis_w
    pg_loss = (c * pg).sum()
    loss = pg_loss
    kl = None
    if ref is not None:
        kl = k3_kl(logp, ref)
        if cfg.kl_coef > 0:
            loss = loss + cfg.kl_coef * (c * kl).sum()
    elif cfg.kl_coef > 0:
        raise ValueError("loss.kl_coef > 0 needs ref_logprobs")
    if ent is not None and cfg.entropy_coef != 0:
        loss = loss - cfg.entropy_coef * (c * ent).sum()
    elif ent is None and cfg.entropy_coef != 0:
        raise ValueError("loss.entropy_coef != 0 needs entropy")
    metrics = loss_metrics(m, pg_loss, ratio, clipped, adv, cfg, ent, kl, tis_w, ids, num_seqs)
    metrics["loss/total"] = loss.detach()
    return loss, metrics


def reference_policy_loss(
    logits: Tensor,
    target_ids: Tensor,
    old_logprobs: Tensor | None,
    advantages: Tensor,
    mask: Tensor,
    cfg: LossConfig,
    *,
    ref_logprobs: Tensor | None = None,
    rollout_logprobs: Tensor | None = None,
    seq_ids: Tensor | None = None,
    seq_weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Naive reference: full fp32 log_softmax + gather, then :func:`policy_loss`.

    logits [T, V] or [B, S, V]; the other tensors [T] or [B, S]. Memory: several [T, V] fp32.
    """
    logp = token_logprobs(logits, target_ids)
    ent = token_entropy(logits)
    return policy_loss(
        logp,
        old_logprobs,
        advantages,
        mask,
        cfg,
        entropy=ent,
        ref_logprobs=ref_logprobs,
        rollout_logprobs=rollout_logprobs,
        seq_ids=seq_ids,
        seq_weights=seq_weights,
    )
