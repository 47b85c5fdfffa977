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
    from megagrpo.parallel.comm import Comm
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
    from megagrpo.parallel.comm import Comm
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


REPLICA_LAYOUTS = [{}, {"ep": 2}, {"ep": 4}, {"tp": 2, "sequence_parallel": True, "ep": 2}]
REPLICA_BLOCKS: list[tuple[int, int] | None] = [(0, 2), (2, 4), (0, 2), (2, 4)]
"""Two independent vLLM replicas of 2 ranks (ranks 0-1 and 2-3), each with expert
parallelism: every expert block has two holders, one per replica."""


def _replica_worker(rank: int, hf_dir: str) -> list[dict]:
    from megagrpo.model.config import LoraConfig, ModelConfig
    from megagrpo.model.peft_export import gather_lora, stream_lora
    from megagrpo.model.policy import build_policy
    from megagrpo.parallel import ParallelConfig, destroy_parallel, init_parallel

    out = []
    for n, layout in enumerate(REPLICA_LAYOUTS):
        groups = init_parallel(ParallelConfig(**layout))
        try:
            targets = ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]
            lora = LoraConfig(rank=4, alpha=8.0, targets=targets)
            policy = build_policy(ModelConfig(hf_path=hf_dir, lora=lora), groups)
            gen = torch.Generator().manual_seed(11)
            with torch.no_grad():
                for p in policy.lora_parameters():
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
            got = {
                dtype: stream_lora(policy, dtype, None, 4096, experts=REPLICA_BLOCKS)
                for dtype in (torch.float32, torch.bfloat16)
            }
            host = {  # the host buffers behind the factors (views keep their whole buffer)
                dtype: sum(
                    {
                        t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                        for ab in factors.values()
                        for t in ab
                    }.values()
                )
                for dtype, factors in got.items()
            }
            out.append({"ref": gather_lora(policy), "got": got, "host": host})
        finally:
            destroy_parallel(keep_process_group=n < len(REPLICA_LAYOUTS) - 1)
    return out


def test_independent_replicas_each_rank_receives_only_its_experts(tiny_moe_dir):
    """Audit 3 P1 for independent replicas: an expert held by one engine rank per replica goes
    to each of its holders (one holder per trainer group: a reduce; two: an all-reduce they
    keep), never to a rank of another block: each rank's factors are the reference's
    (:func:`gather_lora`, fp32 all-reduces) attention factors and its own experts', bitwise
    (bf16: the reference cast), and the host buffers behind them are that subset's. Before:
    every expert had two holders, so every rank all-reduced and kept the whole adapter."""
    from megagrpo.parallel.launch import launch
    from megagrpo.rollout.lora import expert_of

    ranks = launch(_replica_worker, 4, str(tiny_moe_dir))
    for i, layout in enumerate(REPLICA_LAYOUTS):
        for rank in range(4):
            ref, got = ranks[rank][i]["ref"], ranks[rank][i]["got"]
            block = REPLICA_BLOCKS[rank]
            assert block is not None
            want = {k for k in ref if (e := expert_of(k)) is None or block[0] <= e < block[1]}
            assert {expert_of(k) for k in ref} >= {0, 1, 2, 3}  # the reference has all
            for dtype, factors in got.items():
                assert set(factors) == want, (layout, rank, dtype)
                for k in want:
                    for t, r in zip(factors[k], ref[k], strict=True):
                        assert t.dtype == dtype and t.device.type == "cpu"
                        assert torch.equal(t, r.to(dtype)), (layout, rank, k)
                host = ranks[rank][i]["host"][dtype]
                local = sum(r.numel() * dtype.itemsize for k in want for r in ref[k])
                whole = sum(r.numel() * dtype.itemsize for ab in ref.values() for r in ab)
                assert host == local < whole, (layout, rank, dtype)
