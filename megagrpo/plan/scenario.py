"""What the planner (`megagrpo plan-memory`) reads: one run's layout and workload, the
hardware, and the assumptions behind every estimate, each a documented field.

:func:`scenario_from_config` builds a :class:`Scenario` from a validated ``RunConfig``: every
key it plans (offload, sync transport, packing, replicas, load format, FP8 rollout, weight sync)
is read from the config schema, where its type, default and allowed values are declared once.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from megagrpo.errors import ConfigError
from megagrpo.model.arch import arch_from_hf
from megagrpo.rollout.config import resolved_weight_sync, serves_adapters


@dataclass
class Hardware:
    """Per-GPU hardware figures the step-time estimate divides by (H100 SXM 80 GB defaults;
    override with ``--hw key=value``)."""

    hbm_gb_s: float = 3350.0
    """HBM bandwidth, GB/s (H100 SXM: 3.35 TB/s)."""
    bf16_tflops: float = 989.0
    """Dense bf16 tensor-core peak, TFLOP/s (H100 SXM, no sparsity)."""
    nvlink_gb_s: float = 450.0
    """NVLink bandwidth per GPU and direction, GB/s (NVLink 4: 900 GB/s both ways)."""
    ib_gb_s: float = 50.0
    """Inter-node bandwidth per GPU and direction, GB/s (one 400 Gb/s NDR HCA per GPU)."""
    host_gb_s: float = 25.0
    """Pinned host <-> GPU copy bandwidth per GPU when all 8 GPUs of a node copy at once,
    GB/s (PCIe 5 x16 is ~55 GB/s alone; host memory bandwidth is shared)."""
    nvlink_latency_us: float = 20.0
    """One small collective inside a node (NCCL, 8 GPUs), microseconds."""
    ib_latency_us: float = 50.0
    """One small collective across nodes, microseconds."""


@dataclass
class Assumptions:
    """Efficiencies, workload figures and memory pools the plan cannot read from a config."""

    mean_completion_tokens: float = 1100.0
    """Mean completion length (the seed's job: thinking answers to MCQs, soft_overlong from
    2,048 tokens; tools/bench_packing.py's model has mean ~1,080)."""
    mean_prompt_tokens: float = 330.0
    """Mean prompt length (IgakuQA + the built-in prompt; tools/bench_packing.py)."""
    generation_rounds: float = 1.0
    """Generated batches per trained batch (dynamic sampling refills: 1 / (1 - ACR))."""
    train_mfu: float = 0.35
    """Fraction of bf16 peak the trainer's GEMMs reach (MoE, LoRA; communication separate)."""
    prefill_mfu: float = 0.4
    """Fraction of bf16 peak of the engine's prefill."""
    decode_hbm_eff: float = 0.6
    """Fraction of HBM bandwidth a decode step reaches reading weights and KV cache."""
    comm_eff: float = 0.7
    """Fraction of link bandwidth collectives reach."""
    loader_s_per_tensor: float = 2e-4
    """vLLM weight-loader overhead per received tensor (Python, slicing), seconds."""
    cuda_context_gib: float = 1.0
    """CUDA context, cuBLAS/cuDNN workspaces, kernels of one process."""
    nccl_gib_per_comm: float = 0.25
    """Buffers of one NCCL communicator with NVLS off (NCCL_NVLS_ENABLE=0; NVLS allocates
    ~1 GiB more per communicator: verl and NeMo-RL turn it off for this model)."""
    cuda_graph_gib: float = 2.0
    """vLLM's CUDA-graph pool (decode graphs up to 512 sequences); on the GPU while the engine
    is awake, and asleep too unless ``rollout.offload_cudagraph``."""
    vllm_workspace_gib: float = 2.0
    """vLLM's activation workspace (profiled at its max batched tokens) and sampler buffers."""
    fragmentation: float = 0.05
    """Allocator slack on the trainer's transient memory (activations, logits, buckets)."""
    headroom: float = 0.10
    """Fraction of GPU memory every phase must leave free."""


@dataclass
class Scenario:
    """One run as the planner sees it (GPU side: the TE spec, no materialised attention
    scores unless ``model.spec=local``)."""

    hf: dict
    num_gpus: int
    gpus_per_node: int
    gpu_memory_gib: float
    tp: int
    pp: int
    ep: int
    etp: int
    sequence_parallel: bool
    dtype: str
    spec: str
    recompute: str
    lora_rank: int
    lora_alpha: float
    lora_targets: list[str]
    lora_dropout: float
    micro_batch_size: int
    pack_tokens: int
    batch_groups: int
    group_size: int
    max_tokens: int
    max_model_len: int
    vllm_tp: int
    enable_expert_parallel: bool
    replicas: str
    quantization: str
    gpu_memory_utilization: float
    enable_lora: bool
    max_lora_rank: int
    sleep_level: int
    offload_cudagraph: bool
    sync_bucket_mb: float
    weight_sync: str
    sync_transport: str
    offload_during_rollout: bool
    load_format: str
    extra_forwards: int
    """No-grad forwards per trained batch (recomputed old log-probs, the KL reference)."""

    @property
    def tokens_per_micro_batch(self) -> int:
        """Tokens of one training micro-batch: a packed row, or micro_batch_size padded rows."""
        return self.pack_tokens or self.micro_batch_size * self.max_model_len

    @property
    def resolved_sleep_level(self) -> int:
        """``rollout.sleep_level`` as the engine resolves 0: 1 for adapter sync (the base
        weights must survive the sleep), 2 when merged weights are re-sent every sync."""
        if self.sleep_level:
            return self.sleep_level
        return 1 if self.weight_sync == "adapter" else 2

    def with_(self, **changes: Any) -> Scenario:
        """A copy with ``changes`` (layout search)."""
        return dataclasses.replace(self, **changes)


def planned_weight_sync(cfg: Any, hf: dict) -> str:
    """``trainer.weight_sync`` of ``cfg`` as the trainer resolves it on GPUs, for the model of
    HF config ``hf`` (auto: the adapter where the engine serves LoRA adapters)."""
    ro = cfg.rollout
    serves = serves_adapters(ro.engine, ro.enable_lora, True, arch_from_hf(hf).is_moe)
    return resolved_weight_sync(cfg.trainer.weight_sync, serves)


def scenario_from_config(cfg: Any, hf: dict) -> Scenario:
    """The :class:`Scenario` of a validated ``RunConfig`` ``cfg`` for the model of HF config
    ``hf``."""
    m, par, ro, tr = cfg.model, cfg.parallel, cfg.rollout, cfg.trainer
    source = tr.resolved_old_logprobs(True)
    extra = int(source == "recompute") + int(cfg.loss.kl_coef > 0)
    same = [  # Scenario fields that are config keys of the same name
        (cfg.cluster, ("num_gpus", "gpus_per_node", "gpu_memory_gib")),
        (par, ("tp", "pp", "ep", "etp")),
        (m, ("dtype", "recompute")),
        (tr, ("micro_batch_size", "pack_tokens", "batch_groups", "sync_transport")),
        (
            ro,
            (
                "group_size",
                "max_tokens",
                "max_model_len",
                "enable_expert_parallel",
                "replicas",
                "quantization",
                "gpu_memory_utilization",
                "enable_lora",
                "max_lora_rank",
                "sleep_level",
                "offload_cudagraph",
                "sync_bucket_mb",
                "load_format",
            ),
        ),
    ]
    return Scenario(
        hf=hf,
        **{key: getattr(section, key) for section, keys in same for key in keys},
        sequence_parallel=bool(par.sequence_parallel and par.tp > 1),
        spec="local" if m.spec == "local" else "te",
        lora_rank=m.lora.rank,
        lora_alpha=m.lora.alpha,
        lora_targets=list(m.lora.targets),
        lora_dropout=m.lora.dropout,
        vllm_tp=max(ro.tensor_parallel_size, 1),
        weight_sync=planned_weight_sync(cfg, hf),
        offload_during_rollout=tr.offload_during_rollout,
        extra_forwards=extra,
    )


def parse_assignments(items: list[str], obj: Any, what: str) -> Any:
    """``key=value`` strings applied to the dataclass ``obj`` (floats); ConfigError names an
    unknown key or a bad value."""
    names = {f.name for f in dataclasses.fields(obj)}
    changes = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or key not in names:
            raise ConfigError(f"{what} '{item}': expected key=value with key in {sorted(names)}")
        try:
            changes[key] = float(value)
        except ValueError as exc:
            raise ConfigError(f"{what} '{item}': {value!r} is not a number") from exc
    return dataclasses.replace(obj, **changes)
