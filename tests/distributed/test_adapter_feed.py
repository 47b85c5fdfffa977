"""The adapter fed by its owner ranks (placement separate, :mod:`megagrpo.placement.feed`) on 2
gloo ranks: under TP 2 + SP (dense factors split over both ranks, a TP-replicated factor) and
EP 2 (experts owned by one rank or the other), each bucket is summed onto a different owner in
turn, only that owner sends it, and the engine side rebuilds from the owners' buckets exactly
the adapter the streamed transport builds on rank 0 (``Policy.stream_adapter``), bitwise in
the engine's dtype. The engine end runs in the test process on what each owner sent."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.distributed

LAYOUTS = [{"tp": 2, "sequence_parallel": True}, {"ep": 2}]


def _worker(rank: int, hf_dir: str) -> list[dict]:
    from megagrpo.model.config import LoraConfig, ModelConfig
    from megagrpo.model.policy import build_policy
    from megagrpo.parallel import ParallelConfig, destroy_parallel, init_parallel
    from megagrpo.placement.feed import feed_adapter

    reports = []
    for n, layout in enumerate(LAYOUTS):
        groups = init_parallel(ParallelConfig(**layout))
        try:
            targets = ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]
            lora = LoraConfig(rank=4, alpha=8.0, targets=targets)
            policy = build_policy(ModelConfig(hf_path=hf_dir, lora=lora), groups)
            gen = torch.Generator().manual_seed(11)  # replicated factors agree across ranks
            with torch.no_grad():
                for p in policy.lora_parameters():
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
            sent: list[torch.Tensor] = []
            manifest = feed_adapter(
                policy, torch.bfloat16, 0.004, lambda flat, sent=sent: sent.append(flat.clone())
            )
            ref = policy.stream_adapter(torch.bfloat16, 0)
            reports.append(
                {
                    "manifest": [(b.owner, b.units, b.dtype) for b in manifest],  # plain data
                    "sent": sent,
                    "ref": ref,
                    "num_experts": policy.arch.num_experts,
                }
            )
        finally:
            destroy_parallel(keep_process_group=n < len(LAYOUTS) - 1)
    return reports


class _Queue:
    """What an engine rank receives from one owner: its buckets in order."""

    def __init__(self, buckets: list[torch.Tensor]):
        self.buckets = list(buckets)

    def recv_tensor(self, tag: int, numel: int, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
        t = self.buckets.pop(0)
        assert t.numel() == numel and t.dtype == dtype
        return t


def test_owner_fed_adapter_equals_the_streamed_one(tiny_moe_dir):
    from megagrpo.parallel.launch import launch
    from megagrpo.placement.feed import FeedBucket, receive_adapter
    from megagrpo.rollout.lora import PeftAdapter

    ranks = launch(_worker, 2, str(tiny_moe_dir))
    for layout, r0, r1 in zip(LAYOUTS, ranks[0], ranks[1], strict=True):
        # rank 0 takes part in every bucket; rank 1 only in those of the groups it shares
        # with rank 0 (a group of one holding rank 1 alone is a data-parallel copy: skipped)
        assert [b for b in r0["manifest"] if b in r1["manifest"]] == r1["manifest"], layout
        manifest = [
            FeedBucket(o, tuple((n, tuple(s)) for n, s in u), d) for o, u, d in r0["manifest"]
        ]
        owners = [b.owner for b in manifest]
        assert set(owners) == {0, 1}, (layout, owners)  # the load is spread over the owners
        assert len(r0["sent"]) == owners.count(0) and len(r1["sent"]) == owners.count(1)
        queues = {0: _Queue(r0["sent"]), 1: _Queue(r1["sent"])}
        adapter, received = receive_adapter(
            manifest, lambda o, q=queues: q[o], 4, 8.0, r0["num_experts"]
        )
        assert all(not q.buckets for q in queues.values())  # every bucket consumed
        want = PeftAdapter.from_peft_state_dict(r0["ref"], 4, 8.0)
        assert r1["ref"] is None  # the streamed transport gathers on rank 0 alone
        assert adapter.a.keys() == want.a.keys() and adapter.b.keys() == want.b.keys()
        assert any(".experts." in k for k in want.a)
        for k in want.a:
            assert torch.equal(adapter.a[k], want.a[k]), (layout, k)
            assert torch.equal(adapter.b[k], want.b[k]), (layout, k)
        assert received == sum(b.numel(4) for b in manifest) * 2  # bf16
