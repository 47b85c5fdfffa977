"""Shared prefix on a GPU against the rows on the same batch (issue 43): bf16 on CUDA, the
local spec's THD route (torch kernel) and its mask route always, and with Transformer
Engine installed the TE spec's own route: THD varlen attention with ``cu_seqlens_q`` !=
``cu_seqlens_kv`` and ``padding_causal_bottom_right`` (TE 2.11 ``DotProductAttention.forward``,
megagrpo.model.shared_prefix.te_attend), R3 replay on the tiny MoE. Skipped without CUDA.

Tolerance: 4 bf16 eps (3.1e-2) relative for the log-probs, the loss and the gradients as a
whole, as on CPU (tests/unit/test_shared_prefix_model.py); two kernels on the same bf16
inputs differ by about one eps. Measured on CPU in bf16 (torch kernel, tiny MoE, 3-4 groups of
4): the right masks 3e-3 (log-probs) / 2.4e-2 (grads_norm, R3); a top-left causal mask (what TE's
unfused backend did as self-attention) 0.36 / 0.91, a mask letting completions see each other
0.32 / 2.9. The MoE checks replay the engine routing (R3): without it a bf16 near-tie flips
a token's expert in one path and not the other (4 groups, seed 0: 0.51 nats on one token,
4.5e-2 relative, over the bound with a right mask); the dense model checks the unrouted path."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from prefix_parity import rel_diffs, run_parity

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
BF16 = 4 * torch.finfo(torch.bfloat16).eps
ROUTED = {"routing": (2, 4, 2)}


def _check_all(report: dict) -> None:
    for i, c in enumerate(report["checks"]):
        res = rel_diffs(c[False], c[True])
        for key in ("logprobs", "loss", "grads_norm"):
            assert res[key] <= BF16, f"check {i} {key}: {res[key]:.3g}"
        assert res["grad_min_scale"] > 0


def test_local_spec_routes_match_rows(tiny_moe_dir):
    checks = [
        {"routing": "r3", "groups": ROUTED},
        {"route": "mask", "routing": "r3", "groups": ROUTED},
    ]
    job = {"hf_dir": tiny_moe_dir, "layout": {}, "dtype": "bfloat16", "spec": "local"}
    (report,) = run_parity([{**job, "checks": checks}], 1)[0]
    _check_all(report)


@pytest.mark.skipif(
    importlib.util.find_spec("transformer_engine") is None, reason="needs Transformer Engine"
)
def test_te_route_matches_rows(tiny_moe_dir, tiny_dense_dir):
    """The compat gate's te.shared_prefix_thd rule stays 'unverified' until this passes. TE
    picks its backend per call (utils.py get_attention_backend); besides its own pick, the
    unfused backend is forced (its THD mask follows ``attention_type``: te_attend runs as
    cross-attention), then FlashAttention where flash-attn is installed (else unfused)."""
    r3 = {"route": "te", "routing": "r3", "groups": ROUTED}
    checks = [
        r3,
        {**r3, "env": {"NVTE_FLASH_ATTN": "0", "NVTE_FUSED_ATTN": "0"}},
        {**r3, "env": {"NVTE_FUSED_ATTN": "0"}},
    ]
    job = {"layout": {}, "dtype": "bfloat16", "spec": "te"}
    moe = {**job, "hf_dir": tiny_moe_dir, "checks": checks}
    dense = {**job, "hf_dir": tiny_dense_dir, "checks": [{"route": "te", "groups": {"n": 4}}]}
    for (report,) in run_parity([moe, dense], 1):
        _check_all(report)
