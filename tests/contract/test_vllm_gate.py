"""(c) Every compatibility-gate rule whose upstream source is Python, against that Python.

megagrpo's gate (``megagrpo.gate.compat``, no vllm import) restates vLLM 0.33's start-up
conditions; here its verdicts are compared with what vLLM 0.33.0's own functions answer
over grids of layouts (tests/contract/upstream_gate.py):

* vllm.moe_lora_sequence_parallel / _all2all_backend / _fully_sharded:
  ``ParallelConfig.use_sequence_parallel_moe`` -> ``make_parallel_config`` ->
  ``FusedMoEParallelConfig.make`` -> ``FusedMoEWithLoRA._ep_check`` / ``_verify_ep_fs``;
* vllm.moe_shards (EP size): ``FusedMoEParallelConfig.make`` (``flatten_tp_across_dp_and_pcp``);
* vllm.moe_lora_expert_split (W2): ``determine_expert_map`` vs
  ``lora_model._is_remote_expert_key``;
* vllm.max_lora_rank: ``LoRAConfig`` (``MaxLoRARanks``), ``PEFTHelper.validate_legal``;
* vllm.attention_heads: ``ModelConfig.verify_with_parallel_config``;
* vllm.fp8_moe_lora (unverified): ``Fp8PerTensorOnlineMoEMethod`` ->
  ``select_fp8_moe_backend`` -> each kernel's ``is_supported_config``;
* the engine keywords: ``EngineArgs(**engine_kwargs(...))``, ``create_engine_config``.

Not run on CPU: the FP8 kernels themselves (the choice runs under a CUDA platform object that
reports an H100; tests/gpu/test_rollout_fp8_gpu.py compares FP8 + expert-LoRA log-probs
with bf16 on a GPU); ``ModelConfig`` for the 235B checkpoint (its weights are not here: the
engine keywords are checked on the tiny model).
"""

from __future__ import annotations

import pytest
from contract_checks import ok

from megagrpo.config.loader import load_config
from megagrpo.gate import compat
from megagrpo.rollout.config import moe_lora_status, moe_sequence_parallel
from megagrpo.trainer.config import RunConfig

LORA_RULES = {
    "vllm.moe_lora_sequence_parallel",
    "vllm.moe_lora_all2all_backend",
    "vllm.moe_lora_fully_sharded",
}


def _cfg(tp: int, ep: bool = True, backend: str = "allgather_reducescatter", fs: bool = False):
    cfg = RunConfig()
    ro = cfg.rollout
    ro.engine, ro.enable_lora, ro.max_lora_rank = "vllm", True, 8
    ro.enable_expert_parallel, ro.tensor_parallel_size = ep, tp
    ro.all2all_backend, ro.fully_sharded_loras = backend, fs  # pyright: ignore
    return cfg


def _moe(experts: int = 128) -> dict:
    return {
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "num_experts": experts,
        "moe_intermediate_size": 1536,
    }


def _rules(cfg, hf, world) -> set[str]:
    return {v.rule.name for v in compat.check_run(cfg, hf, world)}


def test_moe_lora_layouts_match_vllm(upstream):
    rows = ok(ok(upstream["gate"])["moe_lora_layouts"])
    assert len(rows) > 100
    for row in rows:
        tp, dp, ep, backend = row["tp"], row["dp"], row["ep"], row["backend"]
        what = f"TP {tp} DP {dp} EP {ep} {backend}"
        assert moe_sequence_parallel(backend, ep, tp, dp) == row["sequence_parallel"], what
        cfg = _cfg(tp, ep, backend)
        f = compat.Facts(cfg=cfg, world=tp * dp, engine_dp=dp, hf=_moe())
        assert f.vllm_use_ep == row["use_ep"], what
        assert f.engine_ep_size == (row["ep_size"] if row["use_ep"] else row["moe_tp"]), what
        assert (not _rules(cfg, _moe(), tp * dp) & LORA_RULES) == row["lora_ok"], what
        fs = _cfg(tp, ep, backend, fs=True)
        ok_fs = not _rules(fs, _moe(), tp * dp) & LORA_RULES
        assert ok_fs == row["lora_ok_fully_sharded"], f"{what} fully sharded"
        status = moe_lora_status(lora=True, expert_parallel=ep, quantization="none", tp=tp, dp=dp)
        if backend == "allgather_reducescatter":  # the planner's view of the same layouts
            assert (status != "refuse") == row["lora_ok"], what


def test_expert_lora_split_rule_matches_vllm(upstream):
    """W2: the gate refuses expert LoRA exactly where vLLM's expert placement
    (``determine_expert_map``) and its LoRA loader's blocks disagree."""
    rows = ok(ok(upstream["gate"])["expert_splits"])
    uneven = [r for r in rows if not r["lora_matches"]]
    assert uneven and any(r["n"] % r["size"] == 0 for r in rows if r["lora_matches"])
    for row in rows:
        cfg = _cfg(1)
        refused = "vllm.moe_lora_expert_split" in _rules(cfg, _moe(row["n"]), row["size"])
        assert refused == (not row["lora_matches"]), (row["n"], row["size"], row["placed"])


def test_lora_limits_match_vllm(upstream):
    limits = ok(ok(upstream["gate"])["lora_limits"])
    assert tuple(limits["ranks"]) == compat.VLLM_LORA_RANKS
    assert limits["max_cpu_loras"][(1, 2)] == 2  # megagrpo's max_loras=1, max_cpu_loras=2
    for (adapter, engine), legal in limits["validate_legal"].items():
        cfg = _cfg(1)
        cfg.rollout.max_lora_rank = engine
        cfg.model.lora.rank = adapter
        assert ("vllm.max_lora_rank" not in _rules(cfg, _moe(), 8)) == legal, (adapter, engine)


def test_attention_heads_match_vllm(upstream):
    heads = ok(ok(upstream["gate"])["attention_heads"])  # the tiny model: 4 heads
    for tp, fine in heads.items():
        cfg = _cfg(tp)
        cfg.rollout.replicas = "independent"
        hf = {"num_hidden_layers": 2, "num_attention_heads": 4}
        assert ("vllm.attention_heads" not in _rules(cfg, hf, tp)) == fine, tp


@pytest.mark.parametrize("name", ["qwen3_235b_a22b.yaml", "qwen3_235b_a22b_2node.yaml"])
def test_engine_accepts_every_keyword_of_the_shipped_configs(upstream, repo_root, name):
    row = ok(ok(upstream["gate"])["engine_args"])[name]
    assert row["accepted"] is True, row["accepted"]
    config = row["config"]
    assert isinstance(config, dict), config
    cfg = load_config(RunConfig, [repo_root / "configs" / name])
    ro = cfg.rollout
    lockstep = ro.replicas == "lockstep"
    assert config["tensor_parallel_size"] == ro.tensor_parallel_size
    assert config["data_parallel_size"] == (
        cfg.cluster.num_gpus // ro.tensor_parallel_size if lockstep else 1
    )
    assert config["enable_expert_parallel"] is ro.enable_expert_parallel
    if ro.enable_lora:
        assert (config["max_loras"], config["max_cpu_loras"]) == (1, 2)
    else:
        assert config["max_loras"] is None


def test_fp8_moe_backend_with_lora_is_triton(upstream):
    """vLLM 0.33's FP8 MoE backend choice with LoRA on: every kernel without LoRA support is
    skipped and Triton experts (FP8 per-tensor + LoRA) are chosen, whether or not the other
    kernels' libraries are installed; so the gate allows FP8 + MoE LoRA, unverified."""
    fp8 = ok(ok(upstream["gate"])["fp8_backend"])
    assert fp8["platform"] == "Hopper"
    for mode in ("probed", "libraries_present"):
        for ep in (1, 16):
            on = fp8[(mode, ep, True)]
            assert on["chosen"] == ("TRITON", "TritonExperts") and on["supports_lora"]
            for kernel, (supported, _why, lora) in on["kernels"].items():
                assert lora or not supported, f"{kernel} chosen without LoRA support"
            off = fp8[(mode, ep, False)]["kernels"]
            skipped_for_lora = [
                k for k, (s, why, lora) in on["kernels"].items() if off[k][0] and not s
            ]
            if mode == "libraries_present":  # CUTLASS takes per-tensor FP8 without LoRA
                assert skipped_for_lora
            for k in skipped_for_lora:
                assert "LoRA" in str(on["kernels"][k][1]), k
    cfg = _cfg(1)
    cfg.rollout.quantization = "fp8"
    assert compat.verdict(cfg, _moe(), 16) == "unverified"
