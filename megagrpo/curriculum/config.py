"""Curriculum and dynamic-sampling config (owner: megagrpo.curriculum)."""

from __future__ import annotations

from dataclasses import dataclass, field

from megagrpo.errors import require, require_finite

POLICIES = ("original", "partial", "carry")
PREFLIGHT_MODES = ("warn", "fail", "off")


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
    online: bool = True
    """Update each problem's pass-rate posterior from every rollout (observe)."""
    online_decay: float = 0.5
    """Weight kept by a problem's older evidence each time it is observed again
    (1: never forget)."""
    level_k: int = 5
    """k of the level scale (levels L1..L{k+1}); taken from the levels file when it has one."""
    retire_streak: int = 2
    """Retire a problem after this many consecutive all-correct/all-wrong groups (0: never)."""
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
    policy: str = "carry"
    """original | partial | carry: what to train on when the batch is still short.
    original = ms-swift (checks only R rounds, trains on the first batch when short)."""
    tau: float = 1e-6
    """A group is collapsed when the std of its rewards is < tau (ACR paper's threshold)."""
    carry_max_groups: int = 0
    """Bound of the carry buffer in groups (0: one batch, batch_groups)."""
    carry_max_staleness: int = 1
    """Carried groups older than this many steps are dropped (their log-probs are stale)."""
    preflight: str = "warn"
    """warn | fail | off: start-up check that (1 - predicted ACR) * rounds >= 1."""

    def validate(self, path: str) -> None:
        """Check values; raises ConfigError naming the key."""
        require_finite(self.tau, f"{path}.tau")
        require(self.policy in POLICIES, f"{path}.policy", f"must be one of {POLICIES}")
        require(self.max_resample >= 0, f"{path}.max_resample", "must be >= 0")
        require(self.tau > 0, f"{path}.tau", "must be > 0")
        require(self.carry_max_groups >= 0, f"{path}.carry_max_groups", "must be >= 0")
        require(self.carry_max_staleness >= 0, f"{path}.carry_max_staleness", "must be >= 0")
        require(
            self.preflight in PREFLIGHT_MODES,
            f"{path}.preflight",
            f"must be one of {PREFLIGHT_MODES}",
        )
