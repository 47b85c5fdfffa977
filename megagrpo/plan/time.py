"""Step-time estimate of a GRPO step, per phase (`megagrpo plan-memory`): arithmetic on
FLOPs and bytes over the bandwidths of :class:`~megagrpo.plan.scenario.Hardware`, with
the efficiencies and workload of :class:`~megagrpo.plan.scenario.Assumptions`. Nothing
here is measured; every input is printed with the result.

* **generate**: prefill (2 x active params x prompt tokens at ``prefill_mfu``; with partial
  rollouts also the carried completions' prefixes: the prefix cache is keyed by the adapter
  version) + decode. Decode is memory-bound: every step each GPU reads its engine weights (the
  experts that the step's tokens touch: all of them once a replica decodes more than a few
  dozen sequences) and the KV cache of its running sequences at ``decode_hbm_eff`` x HBM
  bandwidth, plus per layer two tensor-parallel all-reduces and, for lock-stepped
  expert-parallel replicas, the MoE all-gather / reduce-scatter over every GPU (latency +
  bytes; across nodes over InfiniBand); an engine serving LoRA on the experts decodes at
  ``moe_lora_decode_speed`` of that. The batch shrinks as completions finish
  (:mod:`megagrpo.plan.decode`: log-normal lengths, expected cost of every step up to
  ``rollout.max_tokens``); partial rollouts end a round at its budget. When the KV cache
  cannot hold every sequence of a replica, the extra waves run one mean completion each at
  the cache's concurrency. ``full_batch_decode_s``: the same steps billed at full batch.
* **sync**: bytes each GPU moves for the weight update over NVLink / InfiniBand (merged:
  ``allreduce`` = zero-filled full tensors all-reduced over the model-parallel groups, twice a
  tensor's bytes per GPU, and every full tensor fed to every engine rank's loader;
  ``broadcast`` = once; ``sliced`` = only the engine shard of this GPU) + the loader's
  per-tensor overhead. Adapter sync as ``trainer.adapter_transport`` says: ``peft_dir``
  gathers in fp32, writes and reads back a directory; ``streamed`` all-reduces bf16 buckets of
  the full factors over the model-parallel groups, copies them to host, and loads the
  engine's share into its LoRA slot (over InfiniBand to the engines' GPUs when separate).
* **train**: (1 forward + 1 input-gradient pass, the frozen base has no weight gradient,
  + 1 recomputed forward under ``model.recompute=full``, + the no-grad forwards for old /
  reference log-probs) x 2 x active params per token, attention scores added, at
  ``train_mfu``; the MoE all-to-alls (dispatch + combine per pass) and SP all-gather /
  reduce-scatter bytes; the 1F1B bubble ``(pp - 1) / (micro-batches + pp - 1)``.
* **transitions**: host copies per step: the trainer's weights and LoRA state out and back
  with ``trainer.offload_during_rollout``; the engine's weights backed up and restored at
  sleep level 1.

Placement ``separate`` (a planner toggle, :mod:`megagrpo.plan.ladder`): the engines generate
the next batch on their own GPUs while the trainer trains on the rest (one-step off-policy):
``max(generate, train) + sync``, no transitions (``overlap_s`` is what the overlap hides).

``tokens_per_s_per_gpu`` = (prompt + completion tokens of the trained batch) / step time /
GPUs, the figure NeMo-RL reports.
"""

from __future__ import annotations

import math

import numpy as np

from megagrpo.model.arch import arch_from_hf, param_counts
from megagrpo.plan.decode import (
    RoundShape,
    expected_decode_s,
    lognormal_survival,
    partial_round,
    synchronous_round,
)
from megagrpo.plan.memory import (
    DTYPE_BYTES,
    GIB,
    engine_weight_bytes,
    kv_bytes_per_token,
    lora_numel,
    memory_plan,
    shapes_of,
)
from megagrpo.plan.scenario import Assumptions, Hardware, Scenario


def _bw(gpus: int, per_node: int, hw: Hardware) -> float:
    """Bytes/s per GPU of a group of ``gpus`` GPUs: NVLink inside one node, else InfiniBand."""
    return (hw.nvlink_gb_s if gpus <= per_node else hw.ib_gb_s) * 1e9


def _lat(gpus: int, per_node: int, hw: Hardware) -> float:
    return (hw.nvlink_latency_us if gpus <= per_node else hw.ib_latency_us) * 1e-6


def serves_moe_lora_adapter(sc: Scenario) -> bool:
    """Whether the engine serves the adapter on the MoE experts (MoE-LoRA decode speed)."""
    s = shapes_of(sc.hf)
    experts = any(t in sc.lora_targets for t in ("linear_fc1", "linear_fc2"))
    return bool(sc.weight_sync == "adapter" and sc.enable_lora and s.experts and experts)


def decode_step_cost(sc: Scenario, a: Assumptions, hw: Hardware):
    """``cost(n [steps], context [steps]) -> seconds [steps]`` of one decode step of a replica
    running ``n`` sequences whose completions hold ``context`` tokens (module doc)."""
    s = shapes_of(sc.hf)
    active = param_counts(arch_from_hf(sc.hf))["active"]
    replicas = max(1, sc.num_gpus // sc.vllm_tp)
    lockstep_ep = sc.replicas == "lockstep" and sc.enable_expert_parallel
    lin = 1 if sc.quantization == "fp8" else 2
    expert_gpus = sc.num_gpus if lockstep_ep else sc.vllm_tp
    experts_gpu = s.moe_layers * s.expert_layer_params * lin / expert_gpus
    w_all = engine_weight_bytes(s, sc)
    kvt = kv_bytes_per_token(s, sc)
    per = sc.gpus_per_node
    speed = a.moe_lora_decode_speed if serves_moe_lora_adapter(sc) else 1.0

    def cost(n: np.ndarray, context: np.ndarray) -> np.ndarray:
        group_tokens = n * (replicas if lockstep_ep else 1)
        touched = 1 - (1 - s.topk / s.experts) ** group_tokens if s.experts else 1.0
        weights = w_all - experts_gpu * (1 - touched)
        kv = n * (a.mean_prompt_tokens + context) * kvt
        t_mem = (weights + kv) / (hw.hbm_gb_s * 1e9 * a.decode_hbm_eff)
        t_flops = 2 * active * n / sc.vllm_tp / (hw.bf16_tflops * 1e12 * 0.5)
        comm = np.zeros_like(n)
        if sc.vllm_tp > 1:  # attention + MoE output all-reduces
            b = n * s.h * 2 * 2 * (sc.vllm_tp - 1) / sc.vllm_tp
            comm = comm + 2 * (
                _lat(sc.vllm_tp, per, hw) + b / (_bw(sc.vllm_tp, per, hw) * a.comm_eff)
            )
        if lockstep_ep and replicas > 1:  # all-gather + reduce-scatter of every replica's tokens
            b = group_tokens * s.h * 2 * (sc.num_gpus - 1) / sc.num_gpus
            m = sc.num_gpus
            comm = comm + 2 * (_lat(m, per, hw) + b / (_bw(m, per, hw) * a.comm_eff)) * s.moe_frac
        return (np.maximum(t_mem, t_flops) + s.layers * comm) / speed

    return cost


def _round_shape(sc: Scenario, a: Assumptions, n_total: float) -> RoundShape:
    surv = lognormal_survival(a.mean_completion_tokens, a.completion_sigma, sc.max_tokens)
    if sc.partial_finish_fraction > 0:
        return partial_round(
            surv,
            n_total,
            sc.partial_finish_fraction,
            sc.partial_max_staleness,
            sc.partial_chunk_tokens,
        )
    return synchronous_round(surv, n_total)


def _generate(sc: Scenario, a: Assumptions, hw: Hardware, mem: dict) -> dict:
    active = param_counts(arch_from_hf(sc.hf))["active"]
    replicas = max(1, sc.num_gpus // sc.vllm_tp)
    n_round = sc.batch_groups * sc.group_size * a.generation_rounds
    shape = _round_shape(sc, a, n_round)
    seqs = n_round / replicas  # new completions per replica and round
    final_ctx = a.mean_prompt_tokens + a.mean_completion_tokens
    conc = min(seqs * shape.in_flight, mem["engine"]["kv_tokens_per_replica"] / final_ctx)
    if conc < 1:
        return {"s": math.inf, "concurrent_per_replica": conc, "waves": math.inf}
    waves = seqs * shape.in_flight / conc
    cost = decode_step_cost(sc, a, hw)
    # waves beyond the first run at the KV cache's concurrency; the last one drains
    full_steps = max(0.0, waves - 1) * a.mean_completion_tokens
    mean_ctx = np.array([a.mean_completion_tokens / 2])
    full = full_steps * float(cost(np.array([conc]), mean_ctx)[0])
    last = seqs if waves <= 1 else conc / shape.in_flight
    decode = expected_decode_s(shape, last, cost)
    full_batch = shape.expected_steps * float(cost(np.array([conc]), mean_ctx)[0])
    prompts = n_round * a.mean_prompt_tokens + n_round * shape.carried_context
    prefill = 2 * active * prompts / (sc.num_gpus * hw.bf16_tflops * 1e12 * a.prefill_mfu)
    steps = full_steps + shape.expected_steps
    chunks = 0.0
    if sc.partial_finish_fraction > 0:
        chunks = math.ceil(steps / sc.partial_chunk_tokens) * a.partial_chunk_s
    return {
        "s": full + decode + prefill + chunks,
        "decode_s": full + decode,
        "decode_steps": steps,
        "step_ms": (full + decode) / steps * 1e3 if steps else 0.0,
        "full_batch_decode_s": full + full_batch,
        "concurrent_per_replica": conc,
        "waves": waves,
        "prefill_s": prefill,
        "partial_chunks_s": chunks,
        "round_budget_tokens": shape.round_tokens,
        "moe_lora_decode_speed": a.moe_lora_decode_speed if serves_moe_lora_adapter(sc) else 1.0,
    }


def _sync(sc: Scenario, a: Assumptions, hw: Hardware) -> dict:
    s = shapes_of(sc.hf)
    wbytes = DTYPE_BYTES.get(sc.dtype, 2)
    per = sc.gpus_per_node
    dense_b = (s.layers * (s.attn_params + s.experts * s.h) + s.vocab * s.h * 2) * wbytes
    exp_b = s.moe_layers * s.expert_layer_params * wbytes
    n_tensors = s.layers * (10 + 3 * s.experts) + 3
    mp, emp = sc.tp * sc.pp, sc.ep * sc.etp * sc.pp
    if sc.weight_sync == "adapter":
        return _adapter_sync(sc, a, hw, s, n_tensors)
    factor = {"allreduce": 2.0, "broadcast": 1.0}.get(sc.sync_transport)
    if factor is None:  # sliced: only this GPU's engine shard crosses the links
        shard = engine_weight_bytes(s, sc)
        bw = _bw(sc.num_gpus, per, hw) * a.comm_eff
        t = shard / bw + n_tensors / sc.num_gpus * sc.vllm_tp * a.loader_s_per_tensor
        return {"s": t, "bytes_per_gpu": shard}
    moved = factor * (dense_b * (mp - 1) / max(mp, 1) + exp_b * (emp - 1) / max(emp, 1))
    t_comm = factor * dense_b * (mp - 1) / max(mp, 1) / (_bw(mp, per, hw) * a.comm_eff)
    t_comm += factor * exp_b * (emp - 1) / max(emp, 1) / (_bw(emp, per, hw) * a.comm_eff)
    total = dense_b + exp_b  # every full tensor through every engine rank's loader
    t_load = n_tensors * a.loader_s_per_tensor + total / (hw.hbm_gb_s * 1e9 * 0.5)
    return {"s": t_comm + t_load, "bytes_per_gpu": moved}


def _adapter_sync(sc: Scenario, a: Assumptions, hw: Hardware, s, n_tensors: int) -> dict:
    """Seconds and bytes per GPU of an adapter sync, as ``trainer.adapter_transport`` sends it."""
    per = sc.gpus_per_node
    ld, le = lora_numel(s, sc.lora_rank, sc.lora_targets)
    dense, expert = s.layers * ld, s.moe_layers * le  # parameters of the whole adapter
    mp, emp = sc.tp * sc.pp, sc.ep * sc.etp * sc.pp
    if sc.adapter_transport != "streamed":
        # the PEFT directory: fp32 gather to rank 0 (two all-reduces per tensor), written, read
        # back and fed to every engine's loader
        full = dense + expert
        t = 2 * full * 4 / (_bw(max(mp, emp), per, hw) * a.comm_eff) + 2 * full * 2 / 2e9
        return {"s": t + 2 * n_tensors * a.loader_s_per_tensor, "bytes_per_gpu": full * 8}
    # streamed: bf16 buckets summed over the model-parallel groups (every rank receives the full
    # factors: all-reduce), copied to host, the engine's share loaded into its LoRA slot
    ring = [(2 * dense * 2 * (mp - 1) / mp, mp), (2 * expert * 2 * (emp - 1) / emp, emp)]
    moved = sum(b for b, _ in ring)
    t = sum(b / (_bw(n, per, hw) * a.comm_eff) + _lat(n, per, hw) for b, n in ring if n > 1)
    if sc.placement == "separate":  # trainer -> engine GPUs over InfiniBand
        t += (dense + expert) * 2 / (hw.ib_gb_s * 1e9 * a.comm_eff)
        moved += (dense + expert) * 2
    lockstep_ep = sc.replicas == "lockstep" and sc.enable_expert_parallel
    expert_gpus = sc.num_gpus if lockstep_ep else sc.vllm_tp
    local = dense / sc.vllm_tp + expert / expert_gpus
    local_tensors = s.layers * 8 + s.moe_layers * 6 * s.experts / expert_gpus
    host = hw.host_gb_s * 1e9
    t += (dense + expert) * 2 / host + local * 2 / host + local_tensors * a.loader_s_per_tensor
    return {"s": t, "bytes_per_gpu": moved}


def train_phase(sc: Scenario, a: Assumptions, hw: Hardware) -> dict:
    """The train phase of ``sc``: seconds (``s``) and its parts (module doc)."""
    s = shapes_of(sc.hf)
    active = param_counts(arch_from_hf(sc.hf))["active"]
    samples = sc.batch_groups * sc.group_size
    mean_len = a.mean_prompt_tokens + a.mean_completion_tokens
    tokens = samples * mean_len
    passes = 2 + int(sc.recompute == "full")  # forward, input gradient, recomputed forward
    passes_all = passes + sc.extra_forwards
    attn = 4 * s.layers * (mean_len / 2) * s.heads * s.hd  # QK^T and AV per token, forward
    flops = tokens * (2 * active + attn) * passes_all
    t_compute = flops / (sc.num_gpus * hw.bf16_tflops * 1e12 * a.train_mfu)
    per = sc.gpus_per_node
    tok_gpu_layer = tokens * sc.pp / sc.num_gpus  # tokens one GPU handles in one of its layers
    layers_gpu = s.layers / sc.pp
    a2a = 0.0
    if s.experts and sc.ep > 1:
        out = tok_gpu_layer * s.topk * s.h * 2 * (sc.ep - 1) / sc.ep
        inter = max(0.0, 1 - (min(sc.ep, per) - 1) / (sc.ep - 1))
        t_one = max(
            out * inter / (hw.ib_gb_s * 1e9 * a.comm_eff),
            out * (1 - inter) / (hw.nvlink_gb_s * 1e9 * a.comm_eff),
        ) + _lat(sc.ep, per, hw)
        a2a = t_one * 2 * (passes_all + 1) * layers_gpu * s.moe_frac  # dispatch + combine
    sp = 0.0
    if sc.tp > 1:
        b = tok_gpu_layer * s.h * 2 * (sc.tp - 1)
        sp = (b / (_bw(sc.tp, per, hw) * a.comm_eff) + _lat(sc.tp, per, hw)) * 4 * passes_all
        sp *= layers_gpu
    dp = max(1, sc.num_gpus // (sc.tp * sc.pp))
    n_micro = max(1, math.ceil(tokens / dp / sc.tokens_per_micro_batch))
    bubble = (sc.pp - 1) / (n_micro + sc.pp - 1)
    body = t_compute + a2a + sp
    return {
        "s": body / (1 - bubble),
        "compute_s": t_compute,
        "moe_all_to_all_s": a2a,
        "sp_collectives_s": sp,
        "pipeline_bubble": bubble,
        "micro_batches_per_dp_rank": n_micro,
    }


def _transitions(sc: Scenario, a: Assumptions, hw: Hardware, mem: dict) -> dict:
    b = mem["breakdown_gib"]
    host = hw.host_gb_s * 1e9
    offload = 0.0
    if sc.offload_during_rollout:
        offload = 2 * (b["base_weights"] + b["lora_params_grads_adam"]) * GIB / host
    backup = 2 * b["vllm_weights_share"] * GIB / host if sc.resolved_sleep_level == 1 else 0.0
    return {"s": offload + backup, "trainer_offload_s": offload, "engine_sleep_backup_s": backup}


def split_placement(sc: Scenario) -> tuple[Scenario, Scenario]:
    """(trainer, engine) scenarios of ``placement=separate``: the trainer on ``num_gpus -
    rollout_gpus`` GPUs (``parallel.*``), nothing offloaded, no engine asleep beside it; the
    engines on ``rollout_gpus`` GPUs with no trainer state beside them."""
    trainer = sc.with_(num_gpus=sc.num_gpus - sc.rollout_gpus, offload_cudagraph=True)
    engine = sc.with_(num_gpus=sc.rollout_gpus, offload_during_rollout=True)
    return trainer, engine


def _separate_step_time(sc: Scenario, a: Assumptions, hw: Hardware) -> dict:
    """One-step off-policy on separate GPUs: the engines generate the next batch under the
    previous weights while the trainer trains, then the adapter crosses over (the engines
    pause for it): ``max(generate, train) + sync``; no offload, no sleep."""
    trainer, engine = split_placement(sc)
    phases = {
        "generate": _generate(engine, a, hw, memory_plan(engine, a)),
        "sync": _sync(engine, a, hw),
        "train": train_phase(trainer, a, hw),
        "transitions": {"s": 0.0, "trainer_offload_s": 0.0, "engine_sleep_backup_s": 0.0},
    }
    overlap = min(phases["generate"]["s"], phases["train"]["s"])
    return _summary(sc, a, phases, overlap)


def _summary(sc: Scenario, a: Assumptions, phases: dict, overlap: float) -> dict:
    total = sum(p["s"] for p in phases.values()) - overlap
    tokens = sc.batch_groups * sc.group_size * (a.mean_prompt_tokens + a.mean_completion_tokens)
    return {
        "step_s": total,
        "phases": phases,
        "overlap_s": overlap,
        "placement": sc.placement,
        "tokens_per_step": tokens,
        "tokens_per_s_per_gpu": tokens / total / sc.num_gpus if total else 0.0,
    }


def step_time(sc: Scenario, a: Assumptions, hw: Hardware, mem: dict) -> dict:
    """Per-phase seconds of one step and ``tokens_per_s_per_gpu`` (module doc); ``mem`` is
    :func:`megagrpo.plan.memory.memory_plan` of the same scenario (colocated)."""
    if sc.placement == "separate":
        return _separate_step_time(sc, a, hw)
    phases = {
        "generate": _generate(sc, a, hw, mem),
        "sync": _sync(sc, a, hw),
        "train": train_phase(sc, a, hw),
        "transitions": _transitions(sc, a, hw, mem),
    }
    return _summary(sc, a, phases, 0.0)
