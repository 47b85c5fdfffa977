"""Curriculum and dynamic-sampling config (owner: megagrpo.curriculum)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from megagrpo.curriculum.oversample import parse_oversample
from megagrpo.errors import ConfigError, require, require_choice, require_finite

SamplingPolicy = Literal["original", "partial", "carry"]
"""The values of ``dynamic.policy``."""
BudgetMode = Literal["uniform", "knapsack", "sequential"]
"""The values of ``budget.mode``."""


@dataclass
class CurriculumConfig:
    """Level-filtered sampling of problems (AlphaMed L1-L6) with online difficulty."""

    levels_file: str | None = None
    """JSONL written by `megagrpo profile` (problem id, k, correct, level). None: no filter."""
    keep_levels: list[int] = field(default_factory=lambda: [2, 3, 4, 5])
    """Levels to train on (only applied when a levels file is given)."""
    level_weights: list[float] = field(default_factory=list)
    """One mixing weight per entry of keep_levels; empty: every kept problem equally often."""
    keep_unprofiled: bool = True
    """Keep problems that the levels file does not list (counted and logged)."""
    seed: int = 0
    """Seed of the per-epoch shuffles and of the independent resampling stream."""
    balance_answers: bool = False
    """Stratify each epoch's shuffle by gold answer: the problems of each answer (``a``,
    ``b``, ... or a multi-answer set) are shuffled apart and dealt in turns, so every run of
    as many draws as there are answers holds one of each (a step of 8 four-option questions:
    two golds of each letter). A policy that favours one letter then meets it as the gold of
    a quarter of every batch, not of an unlucky streak of them. False: one plain shuffle."""
    online: bool = True
    """Update each problem's pass-rate posterior from every rollout (observe)."""
    online_decay: float = 0.5
    """Weight kept by a problem's older evidence each time it is observed again
    (1: never forget)."""
    level_k: int = 5
    """k of the level scale (levels L1..L{k+1}); taken from the levels file when it has one."""
    retire_streak: int = 2
    """Retire a problem after this many consecutive all-correct/all-wrong groups (0: never).
    Judged on ``signal_reward``."""
    signal_reward: str = ""
    """The reward function (its ``label``, else its ``name``) whose values are the
    curriculum's correctness signal (>= 0.5 counts as correct): the online pass rates,
    retirement and the collapse metrics read it. Empty: the only reward function; with
    several it must be named (a format reward that every answer passes would otherwise
    retire problems whose accuracy still varies)."""
    revisit_prob: float = 0.05
    """Probability that a retired problem is served anyway when drawn (it un-retires if it
    splits)."""

    def validate(self, path: str) -> None:
        """Check values; raises ConfigError naming the key."""
        for i, w in enumerate(self.level_weights):
            require_finite(w, f"{path}.level_weights.{i}")
        require_finite(self.online_decay, f"{path}.online_decay")
        require_finite(self.revisit_prob, f"{path}.revisit_prob")
        require(
            all(isinstance(x, int) and 1 <= x for x in self.keep_levels),
            f"{path}.keep_levels",
            "levels are integers >= 1 (L1 = all correct)",
        )
        require(len(self.keep_levels) > 0, f"{path}.keep_levels", "keep at least one level")
        require(
            not self.level_weights or len(self.level_weights) == len(self.keep_levels),
            f"{path}.level_weights",
            "needs one weight per keep_levels entry (or none)",
        )
        require(
            all(w >= 0 for w in self.level_weights)
            and (not self.level_weights or sum(self.level_weights) > 0),
            f"{path}.level_weights",
            "weights are >= 0 and not all zero",
        )
        require(0.0 < self.online_decay <= 1.0, f"{path}.online_decay", "must be in (0, 1]")
        require(self.level_k >= 1, f"{path}.level_k", "must be >= 1")
        require(self.retire_streak >= 0, f"{path}.retire_streak", "must be >= 0")
        require(0.0 <= self.revisit_prob <= 1.0, f"{path}.revisit_prob", "must be in [0, 1]")


@dataclass
class DynamicSamplingConfig:
    """Bounded dynamic sampling (DAPO), see megagrpo.curriculum.dynamic."""

    enabled: bool = True
    """False: train on the first generated batch as it is (raw metrics still logged)."""
    max_resample: int = 3
    """R: at most this many extra generation rounds per step (every one of them is checked)."""
    policy: SamplingPolicy = "carry"
    """original | partial | carry: what to train on when the batch is still short.
    original = ms-swift (checks only R rounds, trains on the first batch when short)."""
    tau: float = 1e-6
    """A group is collapsed when the std of its rewards is < tau (ACR paper's threshold)."""
    carry_max_groups: int = 0
    """Bound of the carry buffer in groups (0: one batch, batch_groups)."""
    carry_max_staleness: int = 1
    """Carried groups older than this many steps are dropped (their log-probs are stale)."""
    preflight: Literal["warn", "fail", "off"] = "warn"
    """warn | fail | off: start-up check that (1 - predicted ACR) * rounds >= 1."""
    oversample: str = "auto"
    """auto | off | FACTOR (1-4): how many problems a step's first round draws
    (:mod:`megagrpo.curriculum.oversample`). off: batch_groups, then whole resampling rounds
    for the groups still missing. auto: enough that the batch fills with ~98 % probability at
    the online estimate of the raw ACR (B - carried needed, ``/(1 - ACR)`` plus two binomial
    standard deviations, at most four times that), the valid groups beyond the batch carried to
    the next step (``carry_max_staleness``, ``carry_max_groups``); off unless policy is
    carry. FACTOR: ``(B - carried) x FACTOR`` problems (policy carry only)."""

    def resolved_oversample(self) -> str | float:
        """``oversample`` as it runs: ``off`` unless dynamic sampling is on with policy carry
        (only the carry buffer keeps the surplus), else ``auto`` or the factor."""
        setting = parse_oversample(self.oversample)
        if not self.enabled or self.policy != "carry":
            return "off"
        return setting

    def validate(self, path: str) -> None:
        """Check values; raises ConfigError naming the key."""
        require_finite(self.tau, f"{path}.tau")
        require_choice(self, "policy", path)
        try:
            setting = parse_oversample(self.oversample)
        except ValueError as exc:
            raise ConfigError(f"config key '{path}.oversample': {exc}") from None
        require(
            isinstance(setting, str) or self.policy == "carry",
            f"{path}.oversample",
            f"a factor needs policy carry (the surplus groups go to the carry buffer), got "
            f"policy {self.policy}",
        )
        require(self.max_resample >= 0, f"{path}.max_resample", "must be >= 0")
        require(self.tau > 0, f"{path}.tau", "must be > 0")
        require(self.carry_max_groups >= 0, f"{path}.carry_max_groups", "must be >= 0")
        require(self.carry_max_staleness >= 0, f"{path}.carry_max_staleness", "must be >= 0")
        require_choice(self, "preflight", path)


@dataclass
class BudgetConfig:
    """Rollout budget (the ``budget:`` section): how many completions each drawn problem gets
    (megagrpo.curriculum.budget). Every generation round may spend ``batch_groups * G``
    completions, as a uniform round does; the round cap and the shortfall policy are
    dynamic sampling's (``dynamic.max_resample``, ``dynamic.policy`` partial | carry).
    """

    mode: BudgetMode = "uniform"
    """uniform (G per problem, the default) | knapsack (per-problem counts from the pass-rate
    posterior, Knapsack RL) | sequential (rounds until both outcomes, Reinforce-Ada);
    knapsack and sequential need dynamic.policy partial or carry."""
    min_samples: int = 2
    """knapsack: fewest completions a newly drawn problem gets in its first round (>= 1)."""
    max_samples: int = 32
    """Most completions one problem may get within one step (knapsack and sequential)."""
    round_samples: int = 0
    """sequential: completions per round for a problem that has not shown both outcomes yet
    (0: the group size G)."""
    trained_size: int = 0
    """Completions per trained group (0: the group size G). A problem with more is
    subsampled keeping both outcomes (balanced, as Reinforce-Ada); a split problem with fewer
    is topped up in the next round."""
    objective: Literal["completions", "groups"] = "completions"
    """knapsack value of giving a problem n completions: completions (expected completions
    with a non-zero advantage in its trained group) | groups (probability that its group is
    not collapsed: Knapsack RL's ProbNonZeroGradient)."""
    price: float = -1.0
    """knapsack: value charged per generated completion. -1 (auto): the best expected
    effective ratio any per-problem allocation reaches on the sampler's pool (Dinkelbach);
    0: Knapsack RL's setting, the whole round budget is spread over batch_groups problems."""
    sequential_gate: bool = True
    """sequential: sample another round for a problem still all-correct/all-wrong only while
    its posterior says the round is worth its price; False: Reinforce-Ada (until both outcomes
    or max_samples)."""
    advantage_baseline: Literal["group", "pool"] = "group"
    """group (mean/std of the trained group) | pool (Reinforce-Ada: mean/std of every completion
    generated for the problem in this step, before subsampling)."""

    def validate(self, path: str) -> None:
        """Check values; raises ConfigError naming the key."""
        require_choice(self, "mode", path)
        require(self.min_samples >= 1, f"{path}.min_samples", "must be >= 1")
        require(
            self.max_samples >= self.min_samples,
            f"{path}.max_samples",
            f"must be >= min_samples ({self.min_samples})",
        )
        require(self.round_samples >= 0, f"{path}.round_samples", "must be >= 0 (0: G)")
        require(
            self.trained_size == 0 or self.trained_size >= 2,
            f"{path}.trained_size",
            "must be 0 (G) or >= 2 (a group of one has no advantage)",
        )
        require_choice(self, "objective", path)
        require(
            self.price == -1.0 or self.price >= 0.0, f"{path}.price", "must be -1 (auto) or >= 0"
        )
        require_choice(self, "advantage_baseline", path)

    def resolved(self, group_size: int, path: str = "budget") -> tuple[int, int]:
        """``(trained_size, round_samples)`` with 0 replaced by G; checks them against G and
        max_samples (ConfigError naming the key)."""
        trained = self.trained_size or group_size
        rounds = self.round_samples or group_size
        if self.mode == "uniform":
            require(
                trained <= group_size,
                f"{path}.trained_size",
                f"must be <= the group size ({group_size}) with budget.mode uniform",
            )
        else:
            require(
                trained <= self.max_samples,
                f"{path}.max_samples",
                f"must be >= the trained group size ({trained})",
            )
            require(
                rounds <= self.max_samples,
                f"{path}.round_samples",
                f"must be <= max_samples ({self.max_samples})",
            )
        return trained, rounds
