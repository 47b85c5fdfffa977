"""plan-memory's host memory per engine rank per adapter sync (audit 3 P1), by hand on the
shipped 2-node Qwen3-235B config: rank 32 on q/k/v/o and every expert's gate/up/down, bf16,
lock-stepped TP 1 replicas with expert parallelism over the 16 GPUs, so each rank receives
every attention factor and 1/16 of the expert factors (tests/distributed/
test_streamed_adapter.py and tests/contract/test_vllm_expert_parallel.py run that split)."""

from __future__ import annotations

import pytest

from megagrpo.cli import main
from megagrpo.commands.plan_memory import plan_run
from megagrpo.config import load_config
from megagrpo.plan.memory import GIB
from megagrpo.trainer.config import RunConfig


def _cfg(repo_root, *overrides):
    path = repo_root / "configs/qwen3_235b_a22b_2node.yaml"
    return load_config(RunConfig, [path], list(overrides))


def test_adapter_sync_host_memory_by_hand(repo_root, hf235):
    h, heads, kv, hd = 4096, 64, 4, 128  # Qwen3-235B-A22B (configs/*.hf_config.json)
    layers, experts, ffn, r = 94, 128, 1536, 32
    assert (hf235["hidden_size"], hf235["num_attention_heads"]) == (h, heads)
    assert (hf235["num_experts"], hf235["moe_intermediate_size"]) == (experts, ffn)
    q = heads * hd
    dense = r * (h + q + 2 * kv * hd) + r * (q + h)  # qkv (one A, fused B) + o
    expert = experts * r * ((h + 2 * ffn) + (ffn + h))  # gate|up (one A) + down
    per_rank = 2 * (layers * dense + layers * expert / 16)  # bf16, experts over 16 ranks
    # held until the new version is verified: registry + vLLM's pinned cache copy, of the new
    # and the previous version; and while vLLM loads the new one, the copies it read before
    # pinning them (vllm/lora/lora_model.py from_local_checkpoint -> from_lora_tensors)
    copies = 2 * 2 + 1
    got = plan_run(_cfg(repo_root), hf235)["host"]["adapter_sync_gib_per_gpu"]
    assert got == pytest.approx(copies * per_rank / GIB, abs=0.01)
    whole = copies * 2 * layers * (dense + expert) / GIB  # before P1: every rank, all
    assert got < whole / 10
    merged = plan_run(_cfg(repo_root, "trainer.weight_sync=merged"), hf235)
    assert merged["host"]["adapter_sync_gib_per_gpu"] == 0


def test_independent_replicas_bill_their_own_experts(repo_root, hf235):
    """configs/qwen3_235b_a22b.yaml with adapter sync: 8 independent replicas of TP 16 with
    expert parallelism inside each; an engine rank receives its replica's 1/16 of the experts
    (one holder per replica: peft_export.stream_lora, tests/distributed/
    test_streamed_adapter.py::test_independent_replicas_each_rank_receives_only_its_experts)."""
    h, q, kv = 4096, 64 * 128, 4 * 128
    layers, experts, ffn, r = 94, 128, 1536, 32
    dense = r * (h + q + 2 * kv) + r * (q + h)
    expert = experts * r * ((h + 2 * ffn) + (ffn + h))
    per_rank = 2 * (layers * dense + layers * expert / 16)
    path = repo_root / "configs/qwen3_235b_a22b.yaml"
    sync = ["rollout.enable_lora=true", "trainer.weight_sync=adapter"]
    cfg = load_config(RunConfig, [path], sync)
    assert (cfg.rollout.replicas, cfg.rollout.tensor_parallel_size) == ("independent", 16)
    got = plan_run(cfg, hf235)["host"]["adapter_sync_gib_per_gpu"]
    assert got == pytest.approx(5 * per_rank / GIB, abs=0.01)  # copies: see the test above
    no_ep = load_config(RunConfig, [path], [*sync, "rollout.enable_expert_parallel=false"])
    whole = 5 * 2 * layers * (dense + expert) / GIB  # without expert parallelism: every expert
    got = plan_run(no_ep, hf235)["host"]["adapter_sync_gib_per_gpu"]
    assert got == pytest.approx(whole, abs=0.01)


def test_plan_memory_prints_it(repo_root, capsys):
    rc = main(
        [
            "plan-memory",
            str(repo_root / "configs/qwen3_235b_a22b_2node.yaml"),
            "--hf-config",
            str(repo_root / "configs/qwen3_235b_a22b.hf_config.json"),
        ]
    )
    assert rc == 0
    assert "host per engine rank per adapter sync:" in capsys.readouterr().out
