"""megagrpo.kernels: fused log-prob + GRPO-family loss (Triton on CUDA, chunked torch on CPU).

The Triton module (``triton_loss``) is imported lazily, only when the Triton backend runs, so
``TRITON_INTERPRET=1`` can still be set before it is imported (CPU tests). The fused output
projection + loss (:mod:`megagrpo.kernels.fused_linear`) is what training calls by default
(``loss.fused_linear``).
"""

from megagrpo.kernels.fused_linear import fused_linear_policy_loss, fused_linear_token_stats
from megagrpo.kernels.fused_loss import fused_policy_loss, resolve_backend, token_stats

__all__ = [
    "fused_linear_policy_loss",
    "fused_linear_token_stats",
    "fused_policy_loss",
    "resolve_backend",
    "token_stats",
]
