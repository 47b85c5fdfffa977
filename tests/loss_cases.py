"""The loss configuration the kernel parity tests compare the fused kernels under (a test
helper: ``from loss_cases import parity_loss_config``; tests/ is on the import path)."""

from __future__ import annotations

from typing import Any

from megagrpo.algo.config import LossConfig


def parity_loss_config(
    variant: str, *, gspo_eps: tuple[float, float] = (0.01, 0.02), **overrides: Any
) -> LossConfig:
    """Every loss term switched on: clip range (0.1, 0.3), KL 0.05, entropy 0.01, then
    ``overrides``. GSPO clips a sequence-level ratio, so it gets the narrow ``gspo_eps`` range
    (a wide one would clip nothing and leave the clipping path untested)."""
    fields: dict[str, Any] = {
        "variant": variant,
        "eps_low": 0.1,
        "eps_high": 0.3,
        "kl_coef": 0.05,
        "entropy_coef": 0.01,
        **overrides,
    }
    if variant == "gspo":
        fields["eps_low"], fields["eps_high"] = gspo_eps
    return LossConfig(**fields)
