"""Loss config (owner: megagrpo.algo / megagrpo.kernels)."""

from __future__ import annotations

from dataclasses import dataclass

from megagrpo.errors import require, require_fp32

VARIANTS = ("grpo", "dapo", "dr_grpo", "gspo", "sapo")
LOSS_AGGS = ("auto", "token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm")
ADVANTAGE_SCALES = ("auto", "group", "batch", "none")
BACKENDS = ("auto", "triton", "torch")
GROUP_WEIGHTINGS = ("sequence", "group")
TIS_MODES = ("truncate", "mask")

# What each variant means when loss_agg / advantage_scale are "auto".
_DEFAULT_AGG = {
    "grpo": "seq_mean_token_mean",  # DeepSeekMath: mean over tokens, then over sequences
    "dapo": "token_mean",  # DAPO: one mean over every valid token of the batch
    "dr_grpo": "seq_mean_token_sum_norm",  # Dr.GRPO: sum / (num_seqs * max_tokens)
    "gspo": "seq_mean_token_mean",  # GSPO: one loss per sequence, mean over sequences
    "sapo": "seq_mean_token_mean",  # SAPO: as grpo (ms-swift's loss_type sapo)
}
_DEFAULT_SCALE = {
    "grpo": "group",
    "dapo": "group",
    "dr_grpo": "none",
    "gspo": "group",
    "sapo": "group",
}


SAPO_TAU = (1e-3, 1e3)
"""The range of ``loss.sapo_tau_pos/neg`` (ms-swift's default 1.0 / 1.05)."""
_SAPO_TAU_WHY = (
    "must be in [1e-3, 1e3] (ms-swift's defaults: 1.0, 1.05): the gate sigmoid(tau (r - 1)) "
    "4 / tau runs in float32, where below 1e-3 its constant part 2 / tau swamps the policy "
    "term in the loss (4 / tau overflows below ~1e-38), and above 1e3 it shuts within 1e-3 "
    "of ratio 1, finer than bf16 rounding moves a ratio, so almost no token trains"
)


@dataclass
class LossConfig:
    """Policy loss: GRPO/DAPO clipped surrogate and variants."""

    variant: str = "grpo"
    """grpo | dapo | dr_grpo | gspo | sapo. gspo clips a sequence-level ratio
    (length-normalised); sapo replaces the clip by a soft gate (``sapo_tau_pos/neg``)."""
    eps_low: float = 0.2
    """Lower clip: the ratio is clamped at 1 - eps_low (GSPO uses ~3e-4)."""
    eps_high: float = 0.28
    """Upper clip: the ratio is clamped at 1 + eps_high (DAPO clip-higher; GSPO ~4e-4)."""
    sapo_tau_pos: float = 1.0
    """SAPO (Soft Adaptive Policy Optimization, ms-swift's ``--loss_type sapo``
    ``--tau_pos``): each token's loss is ``-A g(r)`` with the soft gate
    ``g(r) = sigmoid(tau (r - 1)) 4 / tau`` (slope 1 at r = 1, fading as the ratio leaves 1)
    instead of the clip; this ``tau`` where ``A > 0``. eps_low / eps_high are not used."""
    sapo_tau_neg: float = 1.05
    """SAPO's ``tau`` where ``A <= 0`` (ms-swift's ``--tau_neg``; larger: the gate fades faster)."""
    kl_coef: float = 0.0
    """k3 KL to the reference policy; 0 disables it (no reference forward)."""
    kl_in_reward: bool = False
    """The KL goes into the rewards instead of the loss (ms-swift's ``--kl_in_reward``, its
    default for the rloo and reinforce_plus_plus estimators): each completion's reward loses
    ``kl_coef`` x its summed ``old - ref`` log-probs before the advantages, and the loss has
    no KL term (:mod:`megagrpo.trainer.kl_reward`). ``reward/kl_penalty_mean`` logs it."""
    entropy_coef: float = 0.0
    """Entropy bonus: loss -= entropy_coef * mean entropy. Entropy is always logged."""
    loss_agg: str = "auto"
    """auto | token_mean | seq_mean_token_mean | seq_mean_token_sum_norm (auto: by variant)."""
    max_tokens: int = 0
    """Dr.GRPO constant normaliser (the generation budget); 0: the longest sequence in the batch."""
    group_weighting: str = "sequence"
    """sequence | group: how groups of different sizes (rollout budgets) weigh in the loss.
    sequence: every completion alike (a problem with more completions weighs more, as with a
    fixed G); group: every problem alike (per-sequence weights (S / N) / G_n, passed to the
    loss as ``seq_weights``). Identical when all groups have the same size."""
    advantage_scale: str = "auto"
    """auto | group | batch | none: divisor of group-centred rewards (auto: none for dr_grpo)."""
    advantage_estimator: str = "grpo"
    """grpo | rloo | reinforce_plus_plus (ms-swift's ``--advantage_estimator``): rloo's
    leave-one-out baseline scales the centred reward by G / (G - 1); reinforce_plus_plus
    divides the centred rewards by their own std (differs from grpo with
    ``advantage_scale: batch`` only). Groups of one size (``budget.mode: uniform``)."""
    positive_weight: float = 1.0
    """Weight of the positive advantages (W-REINFORCE's lambda, Zhu et al. 2025, "The
    Surprising Effectiveness of Negative Reinforcement in LLM Reasoning"): each advantage > 0
    is multiplied by it after normalisation, the negative ones are kept. 1: plain GRPO; 0:
    negative samples only (NSR); the paper uses 0.1. Below 1 the answers that were right push
    less than the wrong ones pull, which slows the policy's sharpening onto the answers it
    already gives (entropy collapse; on multiple choice, one letter for every question).
    Applied to every advantage the loss sees, after ``advantage_scale``."""
    overlong_filter: bool = False
    """Truncated completions (finish reason ``length``: stopped at ``rollout.max_tokens``)
    carry no loss: their tokens are masked out of the policy loss and the KL term, as
    ms-swift's ``--overlong_filter`` (DAPO's overlong filtering) masks ``completion_mask``.
    They still count in the normalisers, as in ms-swift (the loss is divided by the
    unfiltered tokens or sequences), and in every reward, collapse and length metric
    (``train/overlong_filtered``: the share of the step's completions left out)."""
    tis_cap: float = 0.0
    """Truncated importance sampling for rollout/trainer mismatch: each token's loss is weighted
    by min(exp(old_logprob - rollout_logprob), tis_cap); 0 disables it."""
    tis_mode: str = "truncate"
    """truncate | mask: token-level importance weights r = exp(old_logprob - rollout_logprob)
    as min(r, tis_cap) (TIS) or as r where 1 / tis_cap <= r <= tis_cap and 0 elsewhere (MIS:
    tokens too far off-policy drop out of the loss)."""
    tis_auto: bool = True
    """With bf16/fp16 weights on either side and tis_cap 0, use tis_cap 2.0 (engine and
    trainer log-probs differ by ~0.1 per token in bf16; NeMo-RL corrects it the same way)."""
    backend: str = "auto"
    """auto (Triton on CUDA, chunked torch on CPU) | triton | torch."""
    grad_in_logits: bool = True
    """Write the logits gradient into the logits buffer during forward, so no [T, V] tensor is
    allocated at all (the gradient alone is as big as the logits). The logits' values are gone
    after a loss call with grad enabled: set False if the caller reads them afterwards. Another
    autograd node that saved the logits makes backward raise (version counter), never silently
    wrong. With grad disabled (no_grad, eval) the logits are left untouched."""
    chunk_bytes: int = 32 * 1024 * 1024
    """CPU/torch path: fp32 working set per chunk of tokens (bounds extra memory); with
    ``fused_linear``, also the logits one chunk of tokens may take (above
    ``fused_chunk_rows``)."""
    fused_chunk_rows: int = 1024
    """``fused_linear``: at least this many tokens per chunk (each chunk is three GEMMs with the
    output weight; thin ones waste the GPU: Qwen3's 151,936-token vocabulary at TP 1 would give
    110-row chunks of 32 MiB bf16 logits, 1,024 rows take 297 MiB). 1: ``chunk_bytes`` alone
    sizes them."""
    fused_linear: bool = True
    """Training computes the loss (and old / reference log-probs) from the final hidden states
    and the output weight, chunk by chunk over tokens: no ``[T, V/TP]`` logits tensor nor its
    gradient exists (:mod:`megagrpo.kernels.fused_linear`). The logits are the same product in
    chunks, so the loss and gradients equal the logits path up to matmul rounding. False: the
    model's logits go to the fused loss (``grad_in_logits`` applies)."""

    def resolved_loss_agg(self) -> str:
        """The loss aggregation actually used (``loss_agg`` or the variant's default)."""
        return _DEFAULT_AGG[self.variant] if self.loss_agg == "auto" else self.loss_agg

    def resolved_advantage_scale(self) -> str:
        """The advantage scale actually used (``advantage_scale`` or the variant's default)."""
        if self.advantage_scale == "auto":
            return _DEFAULT_SCALE[self.variant]
        return self.advantage_scale

    def validate(self, path: str = "loss") -> None:
        """Check values; raises ConfigError naming the key."""
        for key in (
            "eps_low",
            "eps_high",
            "kl_coef",
            "entropy_coef",
            "tis_cap",
            "positive_weight",
            "sapo_tau_pos",
            "sapo_tau_neg",
        ):
            require_fp32(getattr(self, key), f"{path}.{key}")
        require(self.variant in VARIANTS, f"{path}.variant", f"must be one of {VARIANTS}")
        require(0.0 <= self.eps_low < 1.0, f"{path}.eps_low", "must be in [0, 1)")
        require(self.eps_high >= 0.0, f"{path}.eps_high", "must be >= 0")
        require(self.kl_coef >= 0.0, f"{path}.kl_coef", "must be >= 0")
        require(
            not self.kl_in_reward or self.kl_coef > 0.0,
            f"{path}.kl_in_reward",
            f"true with {path}.kl_coef 0 does nothing (the penalty is kl_coef x each "
            f"completion's summed old - reference log-probs): set {path}.kl_coef > 0 "
            "(ms-swift's --beta, 0.04 by default) or drop kl_in_reward",
        )
        for key in ("sapo_tau_pos", "sapo_tau_neg"):
            tau = getattr(self, key)
            require(
                SAPO_TAU[0] <= tau <= SAPO_TAU[1], f"{path}.{key}", _SAPO_TAU_WHY + f", got {tau}"
            )
        require(0.0 <= self.positive_weight <= 1.0, f"{path}.positive_weight", "must be in [0, 1]")
        require(self.loss_agg in LOSS_AGGS, f"{path}.loss_agg", f"must be one of {LOSS_AGGS}")
        require(self.max_tokens >= 0, f"{path}.max_tokens", "must be >= 0")
        require(
            self.advantage_estimator in ("grpo", "rloo", "reinforce_plus_plus"),
            f"{path}.advantage_estimator",
            f"must be grpo, rloo or reinforce_plus_plus, got {self.advantage_estimator!r}",
        )
        require(
            self.group_weighting in GROUP_WEIGHTINGS,
            f"{path}.group_weighting",
            f"must be one of {GROUP_WEIGHTINGS}",
        )
        require(
            self.advantage_scale in ADVANTAGE_SCALES,
            f"{path}.advantage_scale",
            f"must be one of {ADVANTAGE_SCALES}",
        )
        require(
            self.tis_cap == 0.0 or self.tis_cap >= 1.0, f"{path}.tis_cap", "must be 0 (off) or >= 1"
        )
        require(self.tis_mode in TIS_MODES, f"{path}.tis_mode", f"must be one of {TIS_MODES}")
        require(self.backend in BACKENDS, f"{path}.backend", f"must be one of {BACKENDS}")
        require(self.chunk_bytes >= 1024, f"{path}.chunk_bytes", "must be >= 1024")
        require(self.fused_chunk_rows >= 1, f"{path}.fused_chunk_rows", "must be >= 1")
