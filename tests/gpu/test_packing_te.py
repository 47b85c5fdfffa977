"""Packed rows on the Transformer Engine spec (THD ``PackedSeqParams``, cu_seqlens) give the
logits of the same samples run one per row (issue 15 item 6). Skipped without CUDA and TE.

On GPU the samples of a packed row never meet: TE's fused attention takes cu_seqlens and
Megatron restarts RoPE per sample, so each sample's logits equal its unpacked logits up to
kernel rounding (bf16: compared at 2e-2 of the logits' scale, the bf16 noise between two
kernels on the same inputs; a sample attending to its neighbour moves them by O(1)).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(
        importlib.util.find_spec("transformer_engine") is None, reason="needs Transformer Engine"
    ),
]


def test_te_packed_logits_equal_unpacked(tiny_moe_dir):
    from megagrpo.model.config import ModelConfig
    from megagrpo.model.policy import build_policy
    from megagrpo.parallel import ParallelConfig, destroy_parallel, init_parallel

    groups = init_parallel(ParallelConfig())
    try:
        policy = build_policy(
            ModelConfig(hf_path=str(tiny_moe_dir), spec="te", dtype="bfloat16"), groups
        )
        g = torch.Generator().manual_seed(0)
        lens = [7, 12, 5]
        seqs = [torch.randint(0, 500, (n,), generator=g) for n in lens]
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
        row = torch.cat(seqs).unsqueeze(0).cuda()
        with policy.scoring():
            packed = policy.forward_logits(row, cu_seqlens=cu.cuda()).float()
            for i, s in enumerate(seqs):
                alone = policy.forward_logits(s.unsqueeze(0).cuda()).float()[0]
                got = packed[0, int(cu[i]) : int(cu[i + 1])]
                scale = alone.abs().max().item()
                assert (got - alone).abs().max().item() <= 2e-2 * scale, i
    finally:
        destroy_parallel()


def test_te_packed_lora_grads_equal_unpacked(tiny_moe_dir):
    """LoRA gradients through THD attention (issue 39 item 3): the same per-token loss on a
    packed row and on the samples one per row gives the same gradients, B != 0 so A's
    gradients exist too. bf16, the 235B dtype (TE's fused/flash THD kernels): 5e-2 relative
    per tensor, the bf16 noise of two kernels on the same math; a sample attending to its
    neighbour or RoPE not restarting moves them by O(1)."""
    from megagrpo.model.config import ModelConfig
    from megagrpo.model.policy import build_policy
    from megagrpo.parallel import ParallelConfig, destroy_parallel, init_parallel

    groups = init_parallel(ParallelConfig())
    try:
        policy = build_policy(
            ModelConfig(hf_path=str(tiny_moe_dir), spec="te", dtype="bfloat16"), groups
        )
        gen = torch.Generator().manual_seed(1)
        named = sorted((n, p) for n, p in policy.model.named_parameters() if ".adapter.lora_" in n)
        with torch.no_grad():
            for _, p in named:
                p.copy_((torch.randn(p.shape, generator=gen) * 0.1).to(p.device))
        lens = [9, 14, 6]
        seqs = [torch.randint(0, 500, (n,), generator=gen) for n in lens]
        v = policy.arch.vocab_size
        ws = [torch.randn(n, v, generator=gen).cuda() for n in lens]
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)

        def grads() -> dict[str, torch.Tensor]:
            out = {
                n: torch.zeros(p.shape) if p.grad is None else p.grad.float().cpu()
                for n, p in named
            }
            for _, p in named:
                p.grad = None
            return out

        packed = policy.forward_logits(torch.cat(seqs).unsqueeze(0).cuda(), cu_seqlens=cu.cuda())
        loss = torch.stack(
            [(packed[0, int(cu[i]) : int(cu[i + 1])].float() * w).sum() for i, w in enumerate(ws)]
        ).sum()
        loss.backward()
        got = grads()
        for s, w in zip(seqs, ws):
            (policy.forward_logits(s.unsqueeze(0).cuda())[0].float() * w).sum().backward()
        ref = grads()
        for name in ref:
            err = (got[name] - ref[name]).norm() / ref[name].norm().clamp_min(1e-12)
            assert err.item() < 5e-2, (name, err.item())
    finally:
        destroy_parallel()
