"""Metrics/logging config (owner: megagrpo.metrics)."""

from __future__ import annotations

from dataclasses import dataclass

from megagrpo.errors import require, require_finite

WANDB_MODES = ("offline", "online", "disabled")


@dataclass
class MetricsConfig:
    """Where metrics go: metrics.jsonl always, W&B offline by default, a console progress bar."""

    wandb_mode: str = "offline"
    """offline (default: no key needed; `wandb sync` later) | online | disabled."""
    wandb_project: str = "megagrpo"
    """W&B project name."""
    wandb_entity: str | None = None
    """W&B entity (team/user); None: the account default."""
    wandb_dir: str | None = None
    """Where W&B writes its files; None: the run directory."""
    wandb_init_timeout_s: float = 30.0
    """Seconds ``wandb.init`` may take (W&B's own default is 90, tried twice). When an online
    init fails or times out (no network, server down), the run logs W&B offline instead, with
    a warning; upload it later with ``wandb sync``."""
    progress_bar: bool = True
    """Console tqdm bar with step, reward, raw ACR and tokens/s (rank 0 only)."""
    log_every: int = 1
    """Also write a one-line INFO log every N steps (the bar updates every step)."""
    swift_names: bool = True
    """Also log ms-swift/TRL dashboard names (reward, reward_std, frac_reward_zero_std,
    rewards/<f>/mean, completions/*, kl, entropy, clip_ratio/*) next to megagrpo's own
    (megagrpo.metrics.names.swift_aliases)."""
    tensorboard: bool = False
    """Also write TensorBoard event files (needs the tensorboard package; ms-swift brings it)."""
    tensorboard_dir: str | None = None
    """Where TensorBoard writes; None: RUN_DIR/tensorboard."""
    log_completions: bool = False
    """Write RUN_DIR/completions.jsonl every step: problem id, level, prompt tail, completion,
    reward and its parts (ms-swift --log_completions)."""
    completions_table_every: int = 10
    """With log_completions and W&B: a W&B table of the step's completions every N steps
    (0: never)."""
    completions_prompt_chars: int = 200
    """Characters of the prompt's end kept in each completions row."""

    def validate(self, path: str = "metrics") -> None:
        """Check values; raises ConfigError naming the key."""
        require(
            self.wandb_mode in WANDB_MODES, f"{path}.wandb_mode", f"must be one of {WANDB_MODES}"
        )
        require(self.log_every >= 1, f"{path}.log_every", "must be >= 1")
        require_finite(self.wandb_init_timeout_s, f"{path}.wandb_init_timeout_s")
        require(self.wandb_init_timeout_s > 0, f"{path}.wandb_init_timeout_s", "must be > 0")
        require(
            self.completions_table_every >= 0, f"{path}.completions_table_every", "must be >= 0"
        )
        require(
            self.completions_prompt_chars >= 0, f"{path}.completions_prompt_chars", "must be >= 0"
        )
