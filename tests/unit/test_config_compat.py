"""The compatibility gate (megagrpo.gate.compat): one test per rule (a violating config is
refused naming the rule, the nearest fixed config is accepted), the shipped 235B configs
pass, today's layout is refused, and the rules that restate upstream code are checked against
the installed upstream (megatron-core 0.16.1 on CPU; vLLM's ParallelConfig, slow)."""

from __future__ import annotations

import json

import pytest

from megagrpo.cli import main
from megagrpo.config.loader import load_config
from megagrpo.errors import ConfigError
from megagrpo.gate import compat
from megagrpo.trainer.config import RunConfig

MOE = {
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_experts": 8,
    "moe_intermediate_size": 64,
}
DENSE = {"num_hidden_layers": 4, "num_attention_heads": 8}


def _run(**sections) -> RunConfig:
    cfg = RunConfig()
    for dotted, value in sections.items():
        section, key = dotted.split("__")
        setattr(getattr(cfg, section), key, value)
    return cfg


def _rules(cfg: RunConfig, hf=MOE, world: int = 8) -> set[str]:
    return {v.rule.name for v in compat.check_run(cfg, hf, world)}


def _serving(**extra):
    base = dict(
        rollout__enable_lora=True,
        rollout__enable_expert_parallel=True,
        rollout__max_lora_rank=8,
    )
    base.update(extra)
    return _run(**base)


def test_moe_lora_sequence_parallel():
    bad = _serving(rollout__tensor_parallel_size=4)  # 8 GPUs: TP 4 x DP 2, EP
    assert "vllm.moe_lora_sequence_parallel" in _rules(bad)
    assert _rules(_serving(rollout__tensor_parallel_size=1)) == set()
    assert (
        _rules(_serving(rollout__tensor_parallel_size=4, rollout__replicas="independent")) == set()
    )
    assert _rules(_serving(rollout__tensor_parallel_size=4, rollout__enable_lora=False)) == set()
    assert _rules(_serving(rollout__tensor_parallel_size=8)) == set()  # DP 1
    assert _rules(_serving(rollout__tensor_parallel_size=4), hf=DENSE) == set()  # no MoE layer


def test_moe_lora_all2all_backend():
    bad = _serving(rollout__all2all_backend="deepep_low_latency")
    assert _rules(bad) == {"vllm.moe_lora_all2all_backend"}
    assert _rules(_serving(rollout__all2all_backend="allgather_reducescatter")) == set()
    assert (
        _rules(_serving(rollout__all2all_backend="deepep_low_latency", rollout__enable_lora=False))
        == set()
    )


def test_moe_lora_fully_sharded():
    assert _rules(_serving(rollout__fully_sharded_loras=True)) == {"vllm.moe_lora_fully_sharded"}
    assert _rules(_serving(rollout__fully_sharded_loras=False)) == set()
    fs_no_ep = _serving(rollout__fully_sharded_loras=True, rollout__enable_expert_parallel=False)
    assert _rules(fs_no_ep) == set()


def test_moe_shards():
    assert _rules(_serving(), world=16) == {"vllm.moe_shards"}  # EP 16 > 8 experts
    assert _rules(_serving(), world=8) == set()
    no_ep = _run(rollout__enable_expert_parallel=False)
    assert _rules(no_ep, hf=dict(MOE, moe_intermediate_size=60), world=8) == {"vllm.moe_shards"}
    assert _rules(no_ep, hf=dict(MOE, moe_intermediate_size=64), world=8) == set()


def test_attention_heads():
    cfg = _run(rollout__tensor_parallel_size=4, rollout__replicas="independent")
    assert _rules(cfg, hf=dict(DENSE, num_attention_heads=6)) == {"vllm.attention_heads"}
    assert _rules(cfg, hf=DENSE) == set()


def test_max_lora_rank():
    assert _rules(_serving(rollout__max_lora_rank=24)) == {"vllm.max_lora_rank"}
    low = _serving(rollout__max_lora_rank=8)
    low.model.lora.rank = 16
    assert _rules(low) == {"vllm.max_lora_rank"}
    assert _rules(_serving(rollout__max_lora_rank=16)) == set()


def _cautions(cfg: RunConfig, hf=MOE, world: int = 8) -> set[str]:
    return {v.rule.name for v in compat.cautions(cfg, hf, world)}


def test_fp8_moe_lora_is_allowed_unverified(caplog):
    """vLLM 0.33's source picks its Triton experts (FP8 + LoRA) when LoRA is on
    (tests/contract/test_vllm_gate.py runs that choice): allowed with a warning until a GPU
    check passes, and the planner reads the verdict 'unverified'."""
    import logging

    fp8 = _serving(rollout__quantization="fp8")
    assert _rules(fp8) == set() and _cautions(fp8) == {"vllm.fp8_moe_lora"}
    assert compat.verdict(fp8, MOE, 8) == "unverified"
    with caplog.at_level(logging.WARNING, logger="megagrpo.gate.compat"):
        compat.enforce(fp8, MOE, 8)
    assert "not yet run on a GPU" in caplog.text and "tests/gpu/" in caplog.text
    assert _cautions(_serving(rollout__quantization="fp8", rollout__enable_lora=False)) == set()
    assert _cautions(_serving(rollout__quantization="fp8"), hf=DENSE) == set()
    assert compat.verdict(_serving(), MOE, 8) == "pass"
    bad = _serving(rollout__quantization="fp8", rollout__tensor_parallel_size=4)
    assert compat.verdict(bad, MOE, 8) == "refuse"  # MoE sequence parallelism still refuses


def test_moe_lora_expert_split():
    """W2: expert LoRA on an uneven expert split (num_experts % (DP x TP) != 0) is refused;
    tests/contract/test_vllm_gate.py derives exactly these cases from vLLM 0.33's own
    determine_expert_map and LoRA loader."""
    six = dict(MOE, num_experts=6)
    assert _rules(_serving(), hf=six, world=4) == {"vllm.moe_lora_expert_split"}
    assert _rules(_serving(), hf=six, world=3) == set()
    assert _rules(_serving(), hf=six, world=6) == set()
    attention_only = _serving()
    attention_only.model.lora.targets = ["linear_qkv", "linear_proj"]
    assert _rules(attention_only, hf=six, world=4) == set()
    no_ep = _serving(rollout__enable_expert_parallel=False)
    assert "vllm.moe_lora_expert_split" not in _rules(
        no_ep, hf=dict(six, moe_intermediate_size=64), world=4
    )


def test_uneven_and_even_pipeline():
    hf3 = dict(MOE, num_hidden_layers=3)
    assert _rules(_run(parallel__pp=2), hf=hf3) == {"mcore.pipeline_layers"}
    assert (
        _rules(_run(parallel__pp=2, parallel__num_layers_in_first_pipeline_stage=2), hf=hf3)
        == set()
    )
    bad = _run(parallel__pp=4, parallel__num_layers_in_first_pipeline_stage=2)
    assert _rules(bad, hf=dict(MOE, num_hidden_layers=94)) == {"mcore.uneven_pipeline"}
    ok = _run(parallel__pp=4, parallel__num_layers_in_first_pipeline_stage=22)
    assert _rules(ok, hf=dict(MOE, num_hidden_layers=94)) == set()
    assert _rules(_run(parallel__num_layers_in_last_pipeline_stage=2)) == {"mcore.uneven_pipeline"}


def test_recompute_per_stage():
    cfg = _run(parallel__pp=2, parallel__num_layers_in_first_pipeline_stage=3)
    cfg.model.recompute = "full"
    cfg.model.recompute_num_layers = 2  # stages of 3 and 2 layers
    hf5 = dict(MOE, num_hidden_layers=5)
    assert _rules(cfg, hf=hf5) == {"mcore.recompute_per_stage"}
    cfg.model.recompute_num_layers = 1
    assert _rules(cfg, hf=hf5) == set()
    # block with k > a stage's layers recomputes every layer of it: megatron runs it (m2)
    cfg.model.recompute_method = "block"
    cfg.model.recompute_num_layers = 4
    assert _rules(cfg, hf=hf5) == set()


def test_moe_tp_sequence_parallel():
    cfg = _run(parallel__tp=2, parallel__sequence_parallel=False)
    assert _rules(cfg) == {"mcore.moe_tp_sequence_parallel"}
    assert _rules(cfg, hf=DENSE) == set()
    assert _rules(_run(parallel__tp=2, parallel__sequence_parallel=True)) == set()


def test_pp_token_dispatcher_follows_the_provider(monkeypatch):
    from megagrpo.model import provider

    assert _rules(_run(parallel__pp=2)) == set()
    monkeypatch.setattr(provider, "pipeline_kwargs", lambda pp: {"variable_seq_lengths": pp > 1})
    assert _rules(_run(parallel__pp=2)) == {"mcore.pp_token_dispatcher"}


def test_moe_act_recompute():
    cfg = _run(model__recompute="selective", model__moe_grouped_gemm=False)
    cfg.model.recompute_modules = ["moe_act"]
    assert _rules(cfg) == {"te.moe_act_recompute"}
    cfg.model.moe_grouped_gemm = True
    assert _rules(cfg) == set()


def test_te_paths_no_gpu_has_run_are_unverified():
    """Issue 39 item 3: moe_act recompute with expert linear_fc2 LoRA (megatron-core frees
    the activation the adapter saved and refills it from a hook) and packed rows (THD) on
    the TE spec are allowed with a warning naming their GPU test; the local spec, no fc2
    expert target, or padded micro-batches are not flagged."""
    act = _run(model__spec="te", model__recompute="selective")
    act.model.recompute_modules = ["moe_act"]
    assert _rules(act) == set() and _cautions(act) == {"te.moe_act_expert_lora"}
    assert compat.verdict(act, MOE, 8) == "unverified"
    (c,) = compat.cautions(act, MOE, 8)
    assert "test_te_lora_recompute.py" in c.rule.unverified and "experts.py" in c.rule.upstream
    act.model.lora.targets = ["linear_qkv", "linear_fc1"]
    assert _cautions(act) == set()
    act.model.lora.targets = ["expert_linear_fc2"]
    assert _cautions(act) == {"te.moe_act_expert_lora"}
    assert _cautions(act, hf=DENSE) == set()
    act.model.spec = "local"
    assert _cautions(act) == set()
    packed = _run(model__spec="te", trainer__pack_tokens=4096)
    assert _rules(packed) == set() and _cautions(packed) == {"te.packed_lora"}
    assert _cautions(_run(model__spec="te")) == set()
    assert _cautions(_run(model__spec="local", trainer__pack_tokens=4096)) == set()


def test_shared_prefix_on_te_is_allowed_unverified():
    """trainer.shared_prefix=true on the TE spec follows TE 2.11's source (THD +
    padding_causal_bottom_right): a warning naming the GPU check, never a refusal; auto and
    the local spec match nothing."""
    cfg = _run(trainer__shared_prefix="true")
    assert _rules(cfg) == set() and _cautions(cfg) == {"te.shared_prefix_thd"}
    assert compat.verdict(cfg, MOE, 8) == "unverified"
    assert _cautions(_run(trainer__shared_prefix="true", model__spec="local")) == set()
    assert _cautions(_run()) == set()


def test_every_rule_has_a_test():
    names = {r.name for r in compat.RULES}
    tested = {
        "vllm.moe_lora_sequence_parallel",
        "vllm.moe_lora_all2all_backend",
        "vllm.moe_lora_fully_sharded",
        "vllm.moe_shards",
        "vllm.attention_heads",
        "vllm.max_lora_rank",
        "vllm.fp8_moe_lora",
        "vllm.moe_lora_expert_split",
        "mcore.uneven_pipeline",
        "mcore.pipeline_layers",
        "mcore.recompute_per_stage",
        "mcore.moe_tp_sequence_parallel",
        "mcore.pp_token_dispatcher",
        "te.moe_act_recompute",
        "te.moe_act_expert_lora",
        "te.packed_lora",
        "te.shared_prefix_thd",
    }
    assert names == tested
    assert all(r.upstream and "/" in r.upstream for r in compat.RULES)


# ------------------------------------------------------------------ shipped 235B configs
@pytest.fixture(scope="module")
def hf235(repo_root):
    return json.loads((repo_root / "configs/qwen3_235b_a22b.hf_config.json").read_text())


@pytest.mark.parametrize("name", ["qwen3_235b_a22b.yaml", "qwen3_235b_a22b_2node.yaml"])
def test_shipped_235b_configs_pass_and_todays_layout_is_refused(repo_root, hf235, name):
    path = repo_root / "configs" / name
    cfg = load_config(RunConfig, [path])
    assert compat.check_run(cfg, hf235) == []
    lockstep = [
        "rollout.replicas=lockstep",
        "rollout.enable_lora=true",
        "trainer.weight_sync=adapter",
    ]
    for tp in (4, 8):  # the layouts shipped before: vLLM TP 4 / 8 + EP + LoRA, lock-stepped
        with pytest.raises(compat.CompatError) as err:
            load_config(RunConfig, [path], [*lockstep, f"rollout.tensor_parallel_size={tp}"])
        text = str(err.value)
        assert "vllm.moe_lora_sequence_parallel" in text
        assert "use_sequence_parallel_moe" in text and "_ep_check" in text
        assert "rollout.tensor_parallel_size=1" in text  # a layout that works
        assert isinstance(err.value, ConfigError)


def test_plan_memory_exits_2_naming_the_rule(repo_root, capsys):
    rc = main(
        [
            "plan-memory",
            str(repo_root / "configs/qwen3_235b_a22b_2node.yaml"),
            "rollout.tensor_parallel_size=4",
            "--hf-config",
            str(repo_root / "configs/qwen3_235b_a22b.hf_config.json"),
        ]
    )
    assert rc == 2
    assert "vllm.moe_lora_sequence_parallel" in capsys.readouterr().err


# --------------------------------------------------------------- against upstream code
@pytest.mark.parametrize(
    "layers,pp,first,last",
    [
        (3, 2, 2, 0),
        (3, 2, 0, 1),
        (94, 4, 22, 0),
        (94, 4, 23, 0),
        (94, 8, 10, 0),
        (94, 8, 12, 10),
        (3, 2, 2, 2),
        (5, 3, 2, 2),
        (8, 3, 3, 0),
    ],
)
def test_stage_layers_agree_with_megatron(layers, pp, first, last):
    """compat.stage_layers refuses exactly what megatron-core 0.16.1's TransformerConfig
    refuses."""
    import torch
    from megatron.core.transformer.transformer_config import TransformerConfig

    try:
        TransformerConfig(
            num_layers=layers,
            hidden_size=64,
            num_attention_heads=4,
            pipeline_model_parallel_size=pp,
            num_layers_in_first_pipeline_stage=first or None,
            num_layers_in_last_pipeline_stage=last or None,
            pipeline_dtype=torch.float32,
        )
        megatron_ok = True
    except ValueError:
        megatron_ok = False
    try:
        stages = compat.stage_layers(layers, pp, first, last)
    except ValueError:
        stages = None
    assert (stages is not None) == megatron_ok
    if stages is not None:
        assert sum(stages) == layers


@pytest.mark.slow
@pytest.mark.parametrize(
    "tp,dp,backend",
    [
        (4, 4, "allgather_reducescatter"),
        (1, 16, "allgather_reducescatter"),
        (8, 1, "allgather_reducescatter"),
        (2, 2, "deepep_low_latency"),
    ],
)
def test_sequence_parallel_moe_agrees_with_vllm(tp, dp, backend):
    """compat.moe_sequence_parallel against the installed vLLM's own property."""
    from vllm.config import ParallelConfig

    pc = ParallelConfig(
        tensor_parallel_size=tp,
        data_parallel_size=dp,
        enable_expert_parallel=True,
        all2all_backend=backend,  # pyright: ignore[reportArgumentType]
    )
    assert compat.moe_sequence_parallel(backend, True, tp, dp) == pc.use_sequence_parallel_moe
