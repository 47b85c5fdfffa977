"""The streamed adapter sync's trainer side on 2 gloo ranks: the adapter built from bucketed
collectives (``trainer.adapter_transport: streamed``) equals the PEFT-directory path's (fp32
gather, files written and read back) bitwise once cast to the engine's dtype, under TP2 + SP
(dense row/column shards, a TP-replicated factor) and EP2 (experts owned by one rank), for
one engine on rank 0 (a reduce) and for an engine on every rank (an all-reduce).

The engine side (vLLM taking the adapter in memory, verified, serving what the PEFT
directory serves) is ``test_in_memory_adapter_equals_the_peft_directory`` in
tests/unit/test_rollout_lora.py.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.distributed

LAYOUTS = [{"tp": 2, "sequence_parallel": True}, {"ep": 2}]


def _worker(rank: int, hf_dir: str) -> list[dict]:
    from megagrpo.model.config import LoraConfig, ModelConfig
    from megagrpo.model.policy import build_policy
    from megagrpo.parallel import ParallelConfig, destroy_parallel, init_parallel
    from megagrpo.trainer.context import Comm
    from megagrpo.trainer.sync import weight_update

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
            comm = Comm(groups)

            def update(transport, dtype=None, dst=0, policy=policy, comm=comm, lora=lora):
                return weight_update(
                    policy,
                    "adapter",
                    comm,
                    adapter_transport=transport,
                    adapter_dtype=dtype,
                    adapter_dst=dst,
                    policy_lora=lora,
                )

            peft = update("peft_dir").adapter
            bf16 = update("streamed", torch.bfloat16, 0)
            everywhere = update("streamed", torch.float32, None)
            reports.append(
                {
                    "peft": None if peft is None else (peft.a, peft.b, peft.rank, peft.alpha),
                    "bf16": None if bf16.adapter is None else (bf16.adapter.a, bf16.adapter.b),
                    "fp32_all": (everywhere.adapter.a, everywhere.adapter.b),
                    "in_memory": (bf16.in_memory, everywhere.in_memory),
                }
            )
        finally:
            destroy_parallel(keep_process_group=n < len(LAYOUTS) - 1)
    return reports


def test_streamed_adapter_equals_the_peft_directory(tiny_moe_dir):
    """Fails before the streamed transport: ``weight_update`` had no ``adapter_transport``
    (every adapter sync went through the PEFT directory)."""
    from megagrpo.parallel.launch import launch

    ranks = launch(_worker, 2, str(tiny_moe_dir))
    for layout, r0, r1 in zip(LAYOUTS, ranks[0], ranks[1], strict=True):
        a, b, rank, alpha = r0["peft"]
        assert r1["peft"] is None and r1["bf16"] is None  # built on the engine's rank only
        assert (rank, alpha) == (4, 8.0) and r0["in_memory"] == (True, True)
        assert any(".experts." in k for k in a)  # expert factors are in the adapter
        for got_a, got_b, dtype in (
            (*r0["bf16"], torch.bfloat16),
            (*r0["fp32_all"], torch.float32),
            (*r1["fp32_all"], torch.float32),
        ):
            assert got_a.keys() == a.keys() and got_b.keys() == b.keys(), layout
            for k in a:
                assert got_a[k].dtype == dtype
                assert torch.equal(got_a[k], a[k].to(dtype)), (layout, k)
                assert torch.equal(got_b[k], b[k].to(dtype)), (layout, k)
        assert all(t.abs().max() > 0 for t in a.values())  # every factor was written


EXPERT_LAYOUTS = [{"ep": 2}, {}, {"tp": 2, "sequence_parallel": True}]
BLOCKS = [(0, 2), (2, 4)]
"""vLLM expert parallelism over the 2 ranks: rank r's engine holds experts BLOCKS[r]."""


def _expert_worker(rank: int, hf_dir: str) -> list[dict]:
    from megagrpo.model.config import LoraConfig, ModelConfig
    from megagrpo.model.policy import build_policy
    from megagrpo.parallel import ParallelConfig, destroy_parallel, init_parallel
    from megagrpo.trainer.context import Comm
    from megagrpo.trainer.sync import weight_update

    out = []
    for n, layout in enumerate(EXPERT_LAYOUTS):
        groups = init_parallel(ParallelConfig(**layout))
        try:
            targets = ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]
            lora = LoraConfig(rank=4, alpha=8.0, targets=targets)
            policy = build_policy(ModelConfig(hf_path=hf_dir, lora=lora), groups)
            gen = torch.Generator().manual_seed(11)
            with torch.no_grad():
                for p in policy.lora_parameters():
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
            kw = dict(adapter_transport="streamed", adapter_dtype=torch.float32, policy_lora=lora)
            comm = Comm(groups)
            whole = weight_update(policy, "adapter", comm, adapter_dst=None, **kw).adapter
            mine = weight_update(
                policy, "adapter", comm, adapter_dst=None, adapter_experts=BLOCKS, **kw
            ).adapter
            out.append({"whole": (whole.a, whole.b), "mine": (mine.a, mine.b)})
        finally:
            destroy_parallel(keep_process_group=n < len(EXPERT_LAYOUTS) - 1)
    return out


def test_each_engine_rank_receives_only_its_experts(tiny_moe_dir):
    """Audit 3 P1: with vLLM expert parallelism each rank's streamed adapter holds every
    attention factor and only the experts of its engine's block (a reduce to that rank),
    bitwise equal to the whole adapter's; whatever the trainer's layout (EP 2: the experts'
    owners differ from the engines'; none; TP 2 + SP)."""
    from megagrpo.parallel.launch import launch
    from megagrpo.rollout.lora import expert_of

    ranks = launch(_expert_worker, 2, str(tiny_moe_dir))
    for layout, r0, r1 in zip(EXPERT_LAYOUTS, ranks[0], ranks[1], strict=True):
        for rank, got in enumerate((r0, r1)):
            (wa, wb), (ma, mb) = got["whole"], got["mine"]
            lo, hi = BLOCKS[rank]
            want = {k for k in wa if expert_of(k) is None or lo <= expert_of(k) < hi}
            assert set(ma) == want and set(mb) == want, (layout, rank)
            assert any(expert_of(k) is not None for k in want)
            for k in want:
                assert torch.equal(ma[k], wa[k]) and torch.equal(mb[k], wb[k]), (layout, k)
