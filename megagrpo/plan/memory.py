"""Per-GPU memory of every phase of a GRPO step (`megagrpo plan-memory`), in GiB (2^30 B).

One GPU of the most loaded pipeline stage, colocated trainer and vLLM engine, four phases
(each must leave ``Assumptions.headroom`` of the GPU free):

* **train**: the trainer's frozen base weights (non-expert / (TP x PP), experts / (EP x ETP x
  PP), embedding or output layer / TP, in ``model.dtype``) + LoRA state (fp32 parameters,
  gradients and AdamW's two moments: 16 B per parameter, sharded like the layers they adapt) +
  activations of the micro-batches in flight (1 under no pipeline, up to PP under 1F1B) as
  ``model.recompute`` configures them: per token and layer Korthikanti et al.'s 34 h bytes
  (sequence parallel divides by TP; attention scores 5 a s only on the local spec: TE's
  flash attention keeps none), the MoE MLP replaced by the routed copies (top-k per token,
  input + fc1 + activation); ``full`` keeps each layer's input (2 h bytes) plus one layer's
  working set; ``selective`` is planned as ``none`` (an upper bound) + the LoRA adapters' saved
  inputs (:func:`lora_activation_bytes`; every layer without recompute, one with it) + the
  loss head on the last stage (:func:`logits_bytes`: with ``loss.fused_linear`` one chunk of
  logits and the fp32 hidden-state gradient, else the [tokens, V/TP] logits and their
  gradient in the compute dtype; counted on the same GPU as stage 0's in-flight micro-batches,
  an upper bound under PP) + allocator slack
  + the sleeping engine (its CUDA-graph pool unless ``rollout.offload_cudagraph``; weights
  backed up to host at sleep level 1 or dropped at 2; KV cache freed).
* **generate**: the engine's whole budget (``rollout.gpu_memory_utilization`` x GPU: its
  weights, workspace, LoRA slots and KV cache) + its CUDA graphs + the trainer's resident
  weights and LoRA state, or with ``trainer.offload_during_rollout`` only the fp32 LoRA
  parameters (the offload keeps them on the GPU).
* **sync** (every step, staged wake-up: engine weights awake, KV cache not yet): merged sync
  keeps the trainer's base weights on the GPU (the merge reads them) plus the export's
  transients (two buckets and the largest full tensor; with ``trainer.sync_transport`` other
  than ``sliced`` vLLM's layerwise reload also buffers one MoE layer's experts until the
  layer is complete); adapter sync needs only the LoRA parameters (the rest offloaded with
  ``trainer.offload_during_rollout``), the engine's LoRA slots and a bf16 copy of this GPU's
  adapter share.
* **startup** (once): with ``rollout.load_format=dummy`` the first sync streams the merged
  base into the engine (like a merged sync, before any LoRA state exists; offloaded trainer
  weights stream from host memory); with ``auto`` vLLM reads its own checkpoint.

Every phase adds the CUDA context and the NCCL communicators in use (trainer and engine).
The engine's weights: non-expert ones over ``rollout.tensor_parallel_size``; experts over all
GPUs for lock-stepped replicas with expert parallelism, over one replica's GPUs for
independent replicas; FP8 rollout weights (``rollout.quantization=fp8``) halve the linears.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from megagrpo.errors import ConfigError
from megagrpo.model.arch import arch_from_hf, load_hf_config
from megagrpo.model.pretrained import BUNDLED, resolve_model_path
from megagrpo.plan.scenario import Assumptions, Scenario

GIB = 2**30
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
PHASES = ("train", "generate", "sync", "startup")


@dataclass
class Shapes:
    """The model dimensions the plan multiplies."""

    h: int
    heads: int
    kv: int
    hd: int
    layers: int
    vocab: int
    experts: int
    topk: int
    moe_ffn: int
    ffn: int
    moe_layers: int
    tied: bool

    @property
    def moe_frac(self) -> float:
        return self.moe_layers / self.layers if self.layers else 0.0

    @property
    def attn_params(self) -> int:
        """Attention parameters of one layer (qkv, output, q/k norms)."""
        return self.h * self.hd * (self.heads + 2 * self.kv) + self.heads * self.hd * self.h

    @property
    def expert_layer_params(self) -> int:
        """All experts of one MoE layer."""
        return self.experts * 3 * self.h * self.moe_ffn


def shapes_of(hf: dict) -> Shapes:
    """:class:`Shapes` of an HF config dict."""
    a = arch_from_hf(hf)
    moe_layers = sum(1 for m in (a.moe_layers or []) if m) if a.is_moe else 0
    return Shapes(
        a.hidden_size,
        a.num_heads,
        a.num_kv_heads,
        a.head_dim,
        a.num_layers,
        a.vocab_size,
        a.num_experts,
        a.moe_topk,
        a.moe_ffn_hidden_size,
        a.ffn_hidden_size,
        moe_layers,
        a.tie_word_embeddings,
    )


def lora_numel(s: Shapes, rank: int, targets: list[str]) -> tuple[float, float]:
    """(per-layer non-expert LoRA parameters, per-MoE-layer expert LoRA parameters, all
    experts)."""
    q, kv = s.heads * s.hd, s.kv * s.hd
    dense = 0.0
    if "linear_qkv" in targets:
        dense += rank * (s.h + q + 2 * kv)
    if "linear_proj" in targets:
        dense += rank * (q + s.h)
    expert = 0.0
    for fc, (i, o) in (("linear_fc1", (s.h, 2 * s.moe_ffn)), ("linear_fc2", (s.moe_ffn, s.h))):
        if fc in targets or f"expert_{fc}" in targets:
            expert += s.experts * rank * (i + o)
    return dense, expert


def lora_activation_bytes(s: Shapes, sc: Scenario, tokens: int) -> float:
    """Bytes one layer's LoRA adapters keep for backward for ``tokens`` tokens of a
    micro-batch on one GPU (averaged over dense and MoE layers).

    Per adapter: its input in the activation dtype (``model.dtype``), counted in full even
    where the base layer already holds the same storage (an upper bound), times 2 plus a
    1-byte mask per element with dropout; plus ``x A^T`` (r fp32 values per row). Column
    inputs are gathered over the sequence under SP (whole ``tokens``); row inputs are
    sharded over TP. Experts see ``tokens / sp * topk`` routed copies per GPU (all-gathered
    over ETP: ``* etp``).
    """
    abytes = DTYPE_BYTES.get(sc.dtype, 2)
    tp, etp, r = sc.tp, sc.etp, sc.lora_rank
    sp = tp if (sc.sequence_parallel or tp > 1) else 1
    per_input = abytes * (1 + ((1 + 1 / abytes) if sc.lora_dropout > 0 else 0))
    t = sc.lora_targets
    width = rows = 0.0  # input elements and x A^T rows per micro-batch token
    if "linear_qkv" in t:
        width, rows = width + s.h, rows + 1
    if "linear_proj" in t:
        width, rows = width + s.heads * s.hd / tp, rows + 1
    for fc, (dense_in, expert_in) in (
        ("linear_fc1", (s.h, s.h)),
        ("linear_fc2", (s.ffn / tp, s.moe_ffn / etp)),
    ):
        if fc in t:  # dense MLP layers
            width, rows = width + (1 - s.moe_frac) * dense_in, rows + (1 - s.moe_frac)
        if s.experts and (fc in t or f"expert_{fc}" in t):
            copies = s.topk / sp * etp
            width, rows = width + s.moe_frac * copies * expert_in, rows + s.moe_frac * copies
    return tokens * (width * per_input + rows * r * 4)


def _activation_bytes(s: Shapes, sc: Scenario, tokens: int, layers: int) -> tuple[float, float]:
    """(Megatron activations, LoRA activations) of one micro-batch on one GPU of a stage."""
    abytes = DTYPE_BYTES.get(sc.dtype, 2)
    sp = sc.tp if (sc.sequence_parallel or sc.tp > 1) else 1
    scores = 5 * s.heads * sc.max_model_len / sc.tp if sc.spec == "local" else 0.0
    dense = (15 * s.h + (1 - s.moe_frac) * 19 * s.h) / sp + scores  # Korthikanti: 11+4+19
    routed = s.moe_frac * s.topk * (4 * s.h + 8 * s.moe_ffn / sc.etp) / sp if s.experts else 0
    per_layer = tokens * (dense + routed) * abytes / 2  # the 34 h figure assumes 2-byte acts
    lora_layer = lora_activation_bytes(s, sc, tokens)
    if sc.recompute == "full":
        inputs = tokens * s.h / sp * abytes * layers
        return inputs + per_layer, lora_layer
    return per_layer * layers, lora_layer * layers


FUSED_CHUNK_BYTES = 32 * 2**20
"""Logits of one chunk of ``loss.fused_linear`` (``LossConfig.chunk_bytes``' default)."""
FUSED_CHUNK_ROWS = 1024
"""Fewest tokens per chunk of ``loss.fused_linear`` (``LossConfig.fused_chunk_rows``)."""


def logits_bytes(s: Shapes, sc: Scenario, tokens: int) -> float:
    """The loss head's memory on the last stage for ``tokens`` tokens of a micro-batch:
    ``loss.fused_linear`` keeps one chunk of logits (and its in-place gradient), the fp32
    gradient of the hidden states ``[T, H]`` and 4 fp32 statistics per token; without it, the
    ``[T, V/TP]`` logits and their gradient in the compute dtype."""
    if sc.fused_linear:  # a chunk: >= loss.fused_chunk_rows (1,024) rows of bf16 logits
        chunk = max(FUSED_CHUNK_BYTES, min(tokens, FUSED_CHUNK_ROWS) * s.vocab / sc.tp * 2)
        return chunk + tokens * s.h * 4 + tokens * 4 * 4
    return tokens * (s.vocab / sc.tp) * DTYPE_BYTES.get(sc.dtype, 2) * 2


def _nccl_comms(sc: Scenario) -> int:
    """NCCL communicators this GPU takes part in (trainer groups of size > 1, the world,
    the model-parallel copies for export; the engine's TP / EP / DP / world)."""
    dp = sc.num_gpus // (sc.tp * sc.pp)
    edp = sc.num_gpus // (sc.ep * sc.etp * sc.pp)
    trainer = sum(n > 1 for n in (sc.tp, sc.pp, dp, sc.ep, sc.etp, edp)) + 3
    replicas = max(1, sc.num_gpus // sc.vllm_tp)
    engine = 2 + int(sc.vllm_tp > 1) + int(sc.replicas == "lockstep" and replicas > 1)
    return trainer + engine


def engine_weight_bytes(s: Shapes, sc: Scenario) -> float:
    """The engine's weights on one GPU (see the module doc)."""
    lin = 1 if sc.quantization == "fp8" else 2
    frac = s.moe_frac
    nonexp = s.layers * (s.attn_params + (1 - frac) * 3 * s.h * s.ffn + frac * s.experts * s.h)
    emb = s.vocab * s.h * (1 if s.tied else 2)
    expert_gpus = sc.vllm_tp
    if sc.enable_expert_parallel and sc.replicas == "lockstep":
        expert_gpus = sc.num_gpus
    experts = s.moe_layers * s.expert_layer_params
    return (nonexp * lin + emb * 2) / sc.vllm_tp + experts * lin / expert_gpus


def engine_lora_bytes(s: Shapes, sc: Scenario) -> float:
    """vLLM's LoRA slots on one GPU (one adapter of ``rollout.max_lora_rank``, bf16)."""
    if not sc.enable_lora:
        return 0.0
    dense, expert = lora_numel(s, sc.max_lora_rank, sc.lora_targets)
    lockstep_ep = sc.replicas == "lockstep" and sc.enable_expert_parallel
    expert_gpus = sc.num_gpus if lockstep_ep else sc.vllm_tp
    return 2 * (s.layers * dense / sc.vllm_tp + s.moe_layers * expert / expert_gpus)


def _pow2(nbytes: float) -> float:
    """What torch's caching host allocator reserves for a pinned buffer of ``nbytes``
    (``CachingHostAllocator``: the next power of two)."""
    return float(2 ** math.ceil(math.log2(nbytes))) if nbytes > 0 else 0.0


def _layer_tensors(s: Shapes, tp: int, experts_on_gpu: float, wbytes: float, fused: bool):
    """``(bytes, count)`` of one layer's weight tensors on one GPU: attention, and the
    experts as one ``[E_local, ...]`` tensor each (``fused``: vLLM's w13 / w2) or one per
    expert (Megatron's TE grouped experts), else the dense MLP."""
    q, kv = s.heads * s.hd, s.kv * s.hd
    out = [(s.h * (q + 2 * kv) / tp * wbytes, 1.0), (q * s.h / tp * wbytes, 1.0)]
    if s.experts and experts_on_gpu:
        fc1, fc2 = 2 * s.moe_ffn * s.h * wbytes, s.moe_ffn * s.h * wbytes
        if fused:
            return out + [(fc1 * experts_on_gpu, 1.0), (fc2 * experts_on_gpu, 1.0)]
        return out + [(fc1, experts_on_gpu), (fc2, experts_on_gpu)]
    return out + [(2 * s.ffn * s.h / tp * wbytes, 1.0), (s.ffn * s.h / tp * wbytes, 1.0)]


def host_memory(s: Shapes, sc: Scenario, layers: int, lora_params: float) -> dict:
    """Pinned host memory of one GPU's process, in GiB: the trainer's offloaded frozen
    weights and AdamW moments (``trainer.offload_during_rollout``) and vLLM's level-1 sleep
    backup of its weights (adapter sync), exact and as reserved (each pinned buffer rounded
    up to a power of two: up to ~2x); per node x ``cluster.gpus_per_node`` (checked against
    ``Hardware.host_memory_gib_per_node`` by :func:`megagrpo.plan.search.full_plan`)."""
    tensors: list[tuple[float, float]] = []
    if sc.offload_during_rollout:
        wb = DTYPE_BYTES.get(sc.dtype, 2)
        per_layer = _layer_tensors(s, sc.tp, s.experts / (sc.ep * sc.etp), wb, fused=False)
        tensors += [(b, n * layers) for b, n in per_layer]
        tensors.append((s.vocab * s.h / sc.tp * wb, 1.0 if (s.tied or sc.pp > 1) else 2.0))
        tensors.append((lora_params * 8.0, 1.0))  # moments: small tensors, counted exactly
    if sc.resolved_sleep_level == 1:
        lin = 1 if sc.quantization == "fp8" else 2
        lockstep_ep = sc.enable_expert_parallel and sc.replicas == "lockstep"
        expert_gpus = sc.num_gpus if lockstep_ep else sc.vllm_tp
        per_layer = _layer_tensors(s, sc.vllm_tp, s.experts / expert_gpus, lin, fused=True)
        tensors += [(b, n * s.layers) for b, n in per_layer]
        tensors.append((s.vocab * s.h / sc.vllm_tp * 2, 1.0 if s.tied else 2.0))
    exact = sum(b * n for b, n in tensors) / GIB
    pinned = sum(_pow2(b) * n for b, n in tensors) / GIB
    return {
        "exact_gib_per_gpu": round(exact, 2),
        "pinned_gib_per_gpu": round(pinned, 2),
        "pinned_gib_per_node": round(pinned * sc.gpus_per_node, 1),
        "adapter_sync_gib_per_gpu": round(adapter_sync_bytes(s, sc) / GIB, 2),
    }


ADAPTER_COPIES = 5
"""Host copies of an engine rank's adapter at its peak, each sync (an in-memory sync:
megagrpo.rollout.vllm_engine ``update_adapter``; vLLM 0.33 ``max_cpu_loras=2``). The previous
version is removed (``remove_lora``, then ``forget``) only after the new one is verified, and
vLLM loads the new one during that verification (the probe's first request names it), so
four copies are held at once: the previous version's registry entry
(megagrpo.rollout.vllm_lora) and vLLM's pinned CPU-cache copy of it, the new version's
registry entry and vLLM's pinned copy of it. While vLLM loads the new version it holds one
more: ``from_local_checkpoint`` keeps every tensor it read (copies: ``get_tensor`` clones,
since vLLM scales ``lora_B`` in place) until ``from_lora_tensors`` has pinned a copy of each
(vllm/lora/lora_model.py, ``pin_memory``), so 4 + 1."""


def adapter_sync_bytes(s: Shapes, sc: Scenario) -> float:
    """Host memory of one engine rank for one adapter sync (audit 3 P1): the engine-dtype
    (bf16) attention factors of every layer plus the expert factors of the experts its engine
    holds (lock-stepped replicas with expert parallelism: 1 / num_gpus of them; a replica
    with expert parallelism: 1 / vllm_tp; else all), :data:`ADAPTER_COPIES` times. 0 without
    adapter sync."""
    if sc.weight_sync != "adapter":
        return 0.0
    dense, expert = lora_numel(s, sc.lora_rank, sc.lora_targets)
    ep = sc.num_gpus if sc.replicas == "lockstep" else sc.vllm_tp
    share = 1 / ep if sc.enable_expert_parallel else 1.0
    return ADAPTER_COPIES * 2 * (s.layers * dense + s.moe_layers * expert * share)


def kv_bytes_per_token(s: Shapes, sc: Scenario) -> float:
    """KV cache bytes per token on one GPU of a replica (KV heads replicated when TP exceeds
    them), bf16."""
    heads = max(1.0, s.kv / sc.vllm_tp)
    return s.layers * 2 * heads * s.hd * 2


def memory_plan(sc: Scenario, a: Assumptions) -> dict:
    """Per-phase memory of :class:`Scenario` ``sc`` (module doc): ``phase_peak_gib``,
    ``breakdown_gib`` (the lines), ``fits``, ``engine`` (KV capacity), ``advice``."""
    s = shapes_of(sc.hf)
    wbytes = DTYPE_BYTES.get(sc.dtype, 2)
    layers = math.ceil(s.layers / sc.pp)
    frac = s.moe_frac
    nonexp = layers * (s.attn_params + (1 - frac) * 3 * s.h * s.ffn + frac * s.experts * s.h)
    exp = layers * frac * s.expert_layer_params
    emb = s.vocab * s.h * (1 if (s.tied or sc.pp > 1) else 2)
    base = (nonexp / sc.tp + exp / (sc.ep * sc.etp) + emb / sc.tp) * wbytes
    ld, le = lora_numel(s, sc.lora_rank, sc.lora_targets)
    lora_params = layers * (ld / sc.tp + frac * le / (sc.ep * sc.etp))
    tokens = sc.tokens_per_micro_batch
    acts, lora_acts = _activation_bytes(s, sc, tokens, layers)
    dp = max(1, sc.num_gpus // (sc.tp * sc.pp))
    n_micro = sc.batch_groups * sc.group_size * sc.max_model_len // (dp * tokens)
    in_flight = min(sc.pp, max(1, n_micro))  # 1F1B: stage 0 holds up to PP micro-batches
    acts, lora_acts = acts * in_flight, lora_acts * in_flight
    logits = logits_bytes(s, sc, tokens)
    pools = a.cuda_context_gib * GIB + _nccl_comms(sc) * a.nccl_gib_per_comm * GIB
    graphs = a.cuda_graph_gib * GIB
    asleep_graphs = 0.0 if sc.offload_cudagraph else graphs
    lora_state = lora_params * 16
    frag = a.fragmentation * (acts + lora_acts + logits)
    train = base + lora_state + acts + lora_acts + logits + frag + asleep_graphs + pools

    budget = sc.gpu_memory_utilization * sc.gpu_memory_gib * GIB
    eng_w = engine_weight_bytes(s, sc)
    eng_lora = engine_lora_bytes(s, sc)
    kv = budget - eng_w - eng_lora - a.vllm_workspace_gib * GIB
    # offload keeps the fp32 LoRA parameters on the GPU (the adapter sync reads them)
    resident_gen = lora_params * 4 if sc.offload_during_rollout else base + lora_state
    if sc.placement == "separate":  # the engines' own GPUs: no trainer state beside them
        resident_gen = 0.0
    generate = budget + graphs + resident_gen + pools

    bucket = sc.sync_bucket_mb * 2**20
    largest = s.vocab * s.h * wbytes
    reload_buffer = 0.0 if sc.sync_transport == "sliced" else s.expert_layer_params * wbytes
    merged_transients = 2 * bucket + largest + reload_buffer
    if sc.weight_sync == "adapter":
        share = 2 * (s.layers * ld / sc.tp + s.moe_layers * le / (sc.ep * sc.etp))
        on_gpu = lora_params * 4 + (0.0 if sc.offload_during_rollout else base + lora_params * 8)
        sync = on_gpu + eng_w + eng_lora + 2 * share + graphs + pools
    else:  # the merge reads the base weights on the GPU; the optimizer state may go first
        on_gpu = base + lora_params * 4 + (0.0 if sc.offload_during_rollout else lora_params * 8)
        sync = on_gpu + eng_w + merged_transients * (1 + a.fragmentation) + graphs + pools
    # start-up: the engine allocates its budget at init (after the trainer offloaded, with
    # offload); dummy weights are then replaced by one merged sync of the base
    trainer_at_start = 0.0 if sc.offload_during_rollout else base
    startup = trainer_at_start + budget + graphs + pools
    if sc.load_format == "dummy":
        first = trainer_at_start + eng_w + merged_transients + graphs + pools
        startup = max(startup, first)

    peaks = {"train": train, "generate": generate, "sync": sync, "startup": startup}
    limit = (1 - a.headroom) * sc.gpu_memory_gib * GIB
    fits = all(v <= limit for v in peaks.values()) and kv > 0
    kvt = kv_bytes_per_token(s, sc)
    out = {
        "fits": bool(fits),
        "num_gpus": sc.num_gpus,
        "per_gpu_gib": round(max(peaks.values()) / GIB, 2),
        "gpu_memory_gib": sc.gpu_memory_gib,
        "headroom": a.headroom,
        "layout": _layout(sc),
        "breakdown_gib": {
            "base_weights": base / GIB,
            "lora_params_grads_adam": lora_state / GIB,
            "activations": acts / GIB,
            "lora_activations": lora_acts / GIB,
            "logits": logits / GIB,
            "allocator_slack": frag / GIB,
            "cuda_context_and_nccl": pools / GIB,
            "vllm_budget_while_generating": budget / GIB,
            "vllm_weights_share": eng_w / GIB,
            "vllm_lora_slots": eng_lora / GIB,
            "vllm_kv_cache": kv / GIB,
            "vllm_cuda_graphs": graphs / GIB,
            "sync_transients": (merged_transients if sc.weight_sync == "merged" else 0) / GIB,
        },
        "phase_peak_gib": {k: round(v / GIB, 2) for k, v in peaks.items()},
        "engine": {
            "kv_bytes_per_token": kvt,
            "kv_tokens_per_replica": max(kv, 0) / kvt,
            "replicas": max(1, sc.num_gpus // sc.vllm_tp),
        },
        "host": host_memory(s, sc, layers, lora_params),
        "lora_params_per_gpu": int(lora_params),
        "micro_batch_tokens": tokens,
    }
    out["breakdown_gib"] = {k: round(v, 3) for k, v in out["breakdown_gib"].items()}
    out["advice"] = _advice(sc, peaks, limit, kv, out)
    if sc.num_gpus % sc.vllm_tp:
        out["fits"] = False
        out["advice"].insert(
            0, f"{sc.num_gpus} GPUs are not divisible by rollout.tensor_parallel_size={sc.vllm_tp}"
        )
    if sc.num_gpus % (sc.tp * sc.pp) or sc.num_gpus % (sc.ep * sc.etp * sc.pp):
        out["fits"] = False
        out["advice"].insert(
            0,
            f"{sc.num_gpus} GPUs are not divisible by tp*pp={sc.tp * sc.pp} and "
            f"ep*etp*pp={sc.ep * sc.etp * sc.pp}",
        )
    return out


def _layout(sc: Scenario) -> dict:
    return {
        "tp": sc.tp,
        "pp": sc.pp,
        "ep": sc.ep,
        "etp": sc.etp,
        "dp": sc.num_gpus // (sc.tp * sc.pp),
        "sequence_parallel": sc.sequence_parallel,
        "vllm_tp": sc.vllm_tp,
        "replicas": sc.replicas,
        "rollout_quantization": sc.quantization,
        "weight_sync": sc.weight_sync,
        "sync_transport": sc.sync_transport,
        "adapter_transport": sc.adapter_transport,
        "loss_fused_linear": sc.fused_linear,
        "partial_finish_fraction": sc.partial_finish_fraction,
        "offload_during_rollout": sc.offload_during_rollout,
        "gpu_memory_utilization": sc.gpu_memory_utilization,
        "micro_batch_tokens": sc.tokens_per_micro_batch,
    }


def _advice(sc: Scenario, peaks: dict, limit: float, kv: float, out: dict) -> list[str]:
    tips = []
    if kv <= 0:
        tips.append(
            "no KV cache left in rollout.gpu_memory_utilization: raise it (with "
            "trainer.offload_during_rollout), raise rollout.tensor_parallel_size, use "
            "lock-stepped replicas with expert parallelism, or rollout.quantization=fp8"
        )
    over = [k for k, v in peaks.items() if v > limit]
    if "generate" in over:
        tips.append(
            "generate is over: lower rollout.gpu_memory_utilization or set "
            "trainer.offload_during_rollout=true"
        )
    if "train" in over:
        tips.append(
            "train is over: model.recompute=full, fewer tokens per micro-batch "
            "(trainer.micro_batch_size / trainer.pack_tokens), or more TP / PP / EP"
        )
    if "sync" in over:
        tips.append(
            "sync is over: trainer.weight_sync=adapter with trainer.offload_during_rollout, "
            "or trainer.sync_transport=sliced (no reload buffering)"
        )
    if "startup" in over:
        tips.append("startup is over: rollout.load_format=dummy with the trainer offloaded")
    if over:
        tips.append("or add GPUs (cluster.num_nodes) and spread the experts (parallel.ep)")
    return tips


def hf_config_for(hf_path: str, path: str | None = None) -> dict:
    """The HF config dict to plan for: ``path`` (a config.json) if given, else
    ``model.hf_path``'s (a directory or a bundled name). ConfigError when neither has one."""
    if path:
        return load_hf_config(path)
    if (Path(hf_path) / "config.json").is_file():
        return load_hf_config(hf_path)
    if hf_path in BUNDLED:
        return load_hf_config(resolve_model_path(hf_path))
    raise ConfigError(
        f"config key 'model.hf_path': {hf_path!r} has no config.json "
        "here; pass --hf-config FILE (e.g. configs/qwen3_235b_a22b.hf_config.json)"
    )
