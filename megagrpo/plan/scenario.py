"""What the planner (`megagrpo plan-memory`) reads: one run's layout and workload, the
hardware, and the assumptions behind every estimate, each a documented field.

:func:`scenario_from_config` builds a :class:`Scenario` from a validated ``RunConfig``: every
key it plans (offload, sync transport, packing, replicas, load format, FP8 rollout, weight sync)
is read from the config schema, where its type, default and allowed values are declared once.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megagrpo.errors import ConfigError
from megagrpo.gate.sync_exactness import engine_weight_dtype
from megagrpo.model.arch import arch_from_hf
from megagrpo.model.survival import checkpoint_weight_stds, known_shapes
from megagrpo.rollout.config import resolved_weight_sync, serves_adapters


@dataclass
class Hardware:
    """Per-GPU hardware figures the step-time estimate divides by (H100 SXM 80 GB defaults;
    override with ``--hw key=value``, or with a measured ``--hw-file`` from
    ``tools/measure_cluster.py``). The ranged ones (latencies, host copies, disk) are in
    :data:`megagrpo.plan.ranges.RANGES`; a value set here is a point."""

    hbm_gb_s: float = 3350.0
    """HBM bandwidth, GB/s (H100 SXM data sheet: 3.35 TB/s; a ``--hw-file`` gives the copy rate
    measured on the cluster's GPU)."""
    bf16_tflops: float = 989.0
    """Dense bf16 tensor-core peak, TFLOP/s (H100 SXM data sheet, no sparsity)."""
    nvlink_gb_s: float = 450.0
    """NVLink bandwidth per GPU and direction, GB/s (H100 SXM data sheet: NVLink 4, 900 GB/s
    both ways)."""
    ib_gb_s: float = 50.0
    """Inter-node bandwidth per GPU and direction, GB/s (DGX H100: one 400 Gb/s NDR HCA per GPU,
    so a node has ``gpus_per_node`` of them: ring collectives across nodes use all of them,
    an all-to-all each GPU's own: :mod:`megagrpo.plan.links`)."""
    host_gb_s: float = 25.0
    """Pinned host <-> GPU copy bandwidth per GPU when all 8 GPUs of a node copy at once,
    GB/s (PCIe 5 x16 is ~55 GB/s alone; host memory bandwidth is shared). Assumption (range
    15-40)."""
    nvlink_latency_us: float = 20.0
    """One small ring collective over the 8 GPUs of a node (NCCL: 7 hops), microseconds;
    a ring over ``n`` GPUs of a node takes ``(n - 1) / 7`` of it. Assumption (range 10-30)."""
    ib_latency_us: float = 50.0
    """One small ring collective over 16 GPUs of two nodes (NCCL: 15 hops), microseconds; a
    ring over ``n`` GPUs across nodes takes ``(n - 1) / 15`` of it (scale-audit-3 finding 5a:
    a 96-rank ring is 95 hops); an all-to-all across nodes takes it once. Assumption (range
    20-80)."""
    host_memory_gib_per_node: float = 2048.0
    """Host memory of one node, GiB (DGX H100: 2 TB DDR5): the pinned buffers of every GPU
    of the node must fit in it, with the OS and the data loaders beside them (a run
    config's ``cluster.host_memory_gib`` when planned from one)."""
    disk_gb_s: float = 2.0
    """Write + read-back bandwidth of the directory a ``peft_dir`` adapter sync goes through,
    GB/s. Assumption (range 1-7: one node-local NVMe SSD writes 2-7 GB/s, a shared file system
    less per node)."""
    ring_busbw_gb_s: float = 0.0
    """Bus bandwidth of ring all-gather / reduce-scatter / all-reduce across nodes, GB/s per
    GPU, as measured (``tools/measure_cluster.py``); 0: ``min(nvlink_gb_s, ib_gb_s x
    gpus_per_node) x comm_eff`` (NCCL's rings cross the nodes on every NIC: NVIDIA/nccl-tests
    #160; multi-node H100 all-reduce reaches 400-450 GB/s bus bandwidth)."""
    nvlink_busbw_gb_s: float = 0.0
    """Bus bandwidth of collectives inside a node, GB/s per GPU, as measured; 0:
    ``nvlink_gb_s x comm_eff``."""
    ib_alltoall_gb_s: float = 0.0
    """All-to-all bandwidth across nodes per GPU, GB/s, as measured; 0: ``ib_gb_s x
    comm_eff`` (each GPU's traffic leaves through its own NIC)."""


@dataclass
class Assumptions:
    """Efficiencies, workload figures and memory pools the plan cannot read from a config.

    Each time figure names its source, or says "assumption" with a range; the ranged ones
    (:data:`megagrpo.plan.ranges.RANGES`) give every estimate its low / high bound."""

    mean_completion_tokens: float = 1100.0
    """Mean completion length. Assumption (range 800-1,400): the seed's job answers MCQs with
    thinking, soft_overlong from 2,048 tokens; tools/bench_packing.py's model has mean ~1,080;
    no 235B completions exist to fit it."""
    completion_sigma: float = 0.6
    """Shape of the completion lengths: log-normal with mean ``mean_completion_tokens``,
    clipped to [16, rollout.max_tokens]; 0: every completion of the mean length. Assumption
    (range 0.4-0.8; tools/bench_packing.py's model: 0.6, median ~900). Sets how fast a round's
    batch shrinks (:mod:`megagrpo.plan.decode`)."""
    mean_prompt_tokens: float = 330.0
    """Mean prompt length (IgakuQA + the built-in prompt, tokenised: tools/bench_packing.py
    --igakuqa). `plan-memory` measures it on ``data.train`` when the files and the tokenizer
    are here (:mod:`megagrpo.plan.prefix`); otherwise an assumption (range 200-500: other
    exams' shorter questions or longer case vignettes)."""
    train_mfu: float = 0.20
    """Fraction of the bf16 dense peak that the trainer's executed GEMM FLOPs reach (forward,
    input gradient, full-recompute forward, no-grad forwards; communication separate).
    Assumption (range 0.20-0.25) bounded by the best public H100 figure for this model:
    Megatron-Bridge's Qwen3-235B-A22B pretraining, 1,575 tokens/s/GPU = 233 model TFLOP/s =
    0.236 of 989 (docs performance-summary; FP8 GEMMs, ``moe_router_force_load_balancing``),
    whose recipe recomputes only moe_act and layernorm
    (scripts/moe_model_zoo/examples/qwen3/launch_qwen235b.sh): there model FLOPs are the
    executed FLOPs, so the figure is a hardware utilisation and applies to this trainer's
    recompute too. That is FP8 with forced balance: bf16 GEMMs with real routing and ~700
    tokens per expert per micro-batch are lower, 0.15-0.22 (scale-audit-3 finding 6). Range
    0.15-0.25; no bf16 H100 figure is published for this model."""
    lora_hbm_eff: float = 0.5
    """Fraction of HBM bandwidth the LoRA adapters' thin GEMMs reach in training. A rank-r
    adapter does r FLOPs per byte it reads or writes (``x A^T``: 2 T in r FLOPs over 2 T in
    bytes), far below the H100's ~300 FLOP/B balance, so it is billed at ``r x HBM bandwidth
    x lora_hbm_eff``. Assumption (range 0.35-0.7)."""
    moe_lora_decode_speed: float = 0.60
    """Speed of the MoE experts' decode time when the engine serves LoRA on them, as a
    fraction of the same experts without LoRA (attention, KV reads and communication are not
    slowed). Source: the Triton MoE-LoRA path that Hopper takes measures 0.54-0.65 of no-LoRA
    speed (sglang #28466: 57.1 / 56.5 / 53.7 % at batch 16 / 32 / 64; #27329: ~62-65 %); the
    0.74 once used here is SGLang's TRT-LLM FP8 backend, Blackwell only (sglang #34803).
    Range 0.54-0.65 (reviews/scale-audit-2.md section 1)."""
    lora_kernel_us: float = 7.5
    """One small LoRA kernel of a decode step (punica shrink or expand of the attention
    adapters: 2 per adapted attention matrix and layer, 376 per step for qkv + o on 94 layers),
    microseconds. Assumption (range 5-10, scale-audit-3 finding 8): tiny GEMMs at a few
    dozen tokens are launch- and latency-bound."""
    partial_chunk_s: float = 0.2
    """Overhead of one engine call of a partial round (``rollout.partial.chunk_tokens`` per
    call: requests re-admitted from the prefix cache, results gathered over the ranks),
    seconds. Assumption (range 0.05-0.5), not measured."""
    prefill_mfu: float = 0.4
    """Fraction of bf16 peak of the engine's prefill GEMMs (collectives separate). Assumption
    (range 0.3-0.5), not measured: large-batch prefill GEMMs are compute-bound like training's
    but run at the engine's scheduler batch (16,384 tokens on H100)."""
    decode_hbm_eff: float = 0.5
    """Fraction of HBM bandwidth a decode step reaches reading weights and KV cache.
    Assumption (range 0.4-0.6): at 0.6 the planner's FP8 TP 8 step without LoRA was ~1.3x
    above the best public H100 figure for this model (gpustack performance lab, vLLM, bf16
    TP 8: 9,638 output tokens/s per 8 GPUs; reviews/scale-audit-2.md section 1)."""
    decode_mfu: float = 0.5
    """Fraction of bf16 peak a decode step's GEMMs reach when its batch makes it
    compute-bound. Assumption (range 0.3-0.6)."""
    comm_eff: float = 0.7
    """Fraction of link bandwidth collectives reach. Assumption (range 0.6-0.8: NCCL's
    all-reduce bus bandwidth over NVLink 4 / NDR InfiniBand reaches 70-85 % of the line rate
    at large messages)."""
    loader_s_per_tensor: float = 2e-4
    """vLLM weight-loader overhead per received tensor (Python, slicing), seconds. Assumption
    (range 0.0001-0.0005)."""
    loader_gb_s: float = 5.0
    """Rate at which one engine rank's weight loader takes the merged tensors it receives
    (vLLM's reload: per-tensor Python, casts, expert slicing), GB/s per GPU. Assumption (range
    1-20): verl measured a whole Qwen3-235B-A22B weight sync at 58.6 s (NCCL) and 23.7 s
    (checkpoint-engine) into 64 H20 (docs/advance/fully_async.md), 0.13-0.31 GB/s per engine
    GPU end to end (scale-audit-3 finding 7); an HBM copy alone would be ~1.7 TB/s."""
    cuda_context_gib: float = 1.0
    """CUDA context, cuBLAS/cuDNN workspaces, kernels of one process. Assumption (range
    0.5-1.5): 500-600 MiB of context on H100 with CUDA 12, plus cuBLAS workspaces."""
    nccl_gib_per_comm: float = 0.25
    """Buffers of one NCCL communicator with NVLS off (NCCL_NVLS_ENABLE=0; NVLS allocates
    ~1 GiB more per communicator: verl and NeMo-RL turn it off for this model). Assumption
    (range 0.1-0.5: NCCL_BUFFSIZE 4 MiB x channels x peers)."""
    cuda_graph_gib: float = 2.0
    """vLLM's CUDA-graph pool (decode graphs up to 512 sequences); on the GPU while the engine
    is awake, and asleep too unless ``rollout.offload_cudagraph``. Assumption (range 1-4)."""
    vllm_workspace_gib: float = 2.0
    """vLLM's activation workspace (profiled at its max batched tokens) and sampler buffers.
    Assumption (range 1-4)."""
    fragmentation: float = 0.05
    """Allocator slack on the trainer's transient memory (activations, logits, buckets).
    Assumption (range 0.02-0.15)."""
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
    adapter_transport: str = "streamed"
    """``trainer.adapter_transport`` (adapter sync): streamed bf16 buckets or a PEFT directory."""
    fused_linear: bool = True
    """``loss.fused_linear``: no ``[T, V/TP]`` logits on the last stage, chunks only."""
    partial_finish_fraction: float = 0.0
    """``rollout.partial.finish_fraction`` when partial rollouts are on, 0 when off."""
    partial_max_staleness: int = 0
    """``rollout.partial.max_staleness`` (partial rollouts)."""
    partial_chunk_tokens: int = 64
    """``rollout.partial.chunk_tokens`` (partial rollouts)."""
    placement: str = "colocated"
    """colocated (trainer and engine share every GPU, phases in turn) | separate (the engines
    own ``rollout_gpus`` GPUs, the trainer the rest: ``rollout.placement: separate`` with
    ``rollout.engine_ranks``; with ``offpolicy_staleness`` 1 the next step's first round is
    generated under the previous weights while the trainer trains: one-step off-policy)."""
    rollout_gpus: int = 0
    """GPUs of the engines under ``placement=separate``; ``parallel.*`` then lays out the
    trainer's ``num_gpus - rollout_gpus``."""
    offpolicy_staleness: int = 1
    """``rollout.max_staleness`` of placement separate: 1 generates the next step's first
    round while this step trains, 0 waits for the new weights (no overlap)."""
    rounds_per_step: float = 1.0
    """Generation rounds of ``batch_groups`` problems per step: dynamic sampling's resampling,
    billed from the collapse simulation (:mod:`megagrpo.plan.collapse`)."""
    trained_groups_per_step: float | None = None
    """Groups trained per step (the shortfall policy may train fewer than ``batch_groups``);
    None: ``batch_groups``."""
    shared_prefix: bool = False
    """``trainer.shared_prefix`` as the trainer resolves it on this spec: each group's prompt
    computed once in training (:mod:`megagrpo.plan.prefix`)."""
    prompts_per_group: float = 1.0
    """Distinct prompts (renderings, ``data.variants``) per group: what sharing computes."""
    first_round_groups: float | None = None
    """Problems of a step's first generation round (``dynamic.oversample`` draws more than
    ``batch_groups`` and carries the surplus), in the mean of the collapse simulation; None:
    ``batch_groups``. Resampling rounds draw ``batch_groups``."""
    ppo_epochs: int = 1
    """``trainer.ppo_epochs``: training passes over each generated batch (its no-grad forwards
    run once)."""
    lr: float = 1e-5
    """``trainer.lr`` (the merged sync's survival: :mod:`megagrpo.model.survival`)."""
    warmup_steps: int = 0
    """``trainer.num_warmup_steps``."""
    lr_schedule: str = "constant"
    """``trainer.lr_schedule``."""
    max_steps: int = 0
    """``trainer.max_steps`` (the decay of a linear / cosine schedule)."""
    min_lr_ratio: float = 0.0
    """``trainer.min_lr / trainer.lr``."""
    engine_dtype: str = "bfloat16"
    """The engines' weight dtype (``rollout.dtype``; auto: the checkpoint's)."""
    weight_std: tuple[tuple[str, float], ...] | None = None
    """Std of each LoRA target's weights read from the checkpoint (None: the survival model's
    assumption, printed with its range)."""

    @property
    def trained_groups(self) -> float:
        """Groups trained per step (``trained_groups_per_step``, else ``batch_groups``)."""
        if self.trained_groups_per_step is None:
            return float(self.batch_groups)
        return self.trained_groups_per_step

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
        extra_forwards=cfg.no_grad_forwards(),  # the trainer's own rule (finding 2)
        adapter_transport=tr.adapter_transport,
        fused_linear=bool(cfg.loss.fused_linear),
        partial_finish_fraction=ro.partial.finish_fraction if ro.partial.enabled else 0.0,
        partial_max_staleness=ro.partial.max_staleness,
        partial_chunk_tokens=ro.partial.chunk_tokens,
        placement="separate" if ro.placement == "separate" else "colocated",
        rollout_gpus=ro.engine_ranks if ro.placement == "separate" else 0,  # the last ranks
        offpolicy_staleness=ro.resolved_max_staleness() if ro.placement == "separate" else 0,
        shared_prefix=cfg.shared_prefix_decision("local" if m.spec == "local" else "te")[0],
        ppo_epochs=tr.ppo_epochs,
        lr=tr.lr,
        warmup_steps=tr.num_warmup_steps,
        lr_schedule=tr.lr_schedule,
        max_steps=tr.max_steps,
        min_lr_ratio=tr.min_lr / tr.lr if tr.lr > 0 else 0.0,
        engine_dtype=engine_weight_dtype(cfg, hf),
        weight_std=_checkpoint_stds(m.hf_path, hf, m.lora.targets),
    )


def _checkpoint_stds(hf_path: str, hf: dict, targets: list[str]):
    """The weight scales of the LoRA targets when ``model.hf_path`` is a readable checkpoint
    here (:func:`megagrpo.model.survival.checkpoint_weight_stds`), else None."""
    shapes = known_shapes(hf, targets)
    if shapes is None or not hf_path or not Path(hf_path).is_dir():
        return None
    stds = checkpoint_weight_stds(hf_path, shapes)
    return tuple(sorted(stds.items())) if stds else None


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
