"""Step-time estimate of a GRPO step, per phase (`megagrpo plan-memory`): arithmetic on
FLOPs and bytes over the bandwidths of :class:`~megagrpo.plan.scenario.Hardware`, with
the efficiencies and workload of :class:`~megagrpo.plan.scenario.Assumptions`. Nothing
here is measured; every input is printed with the result.

* **generate**: prefill (2 x active params x prompt tokens at ``prefill_mfu``) + decode.
  Decode is memory-bound: every step each GPU reads its engine weights (the experts that the
  step's tokens touch: all of them once a replica decodes more than a few dozen sequences) and
  the KV cache of its running sequences at ``decode_hbm_eff`` x HBM bandwidth, plus per layer
  two tensor-parallel all-reduces and, for lock-stepped expert-parallel replicas, the MoE
  all-gather / reduce-scatter over every GPU (latency + bytes; across nodes over InfiniBand).
  Steps: ``rollout.max_tokens`` (the longest completion ends the phase) when the KV cache holds
  every sequence of a replica at once, plus one mean completion per extra wave otherwise.
* **sync**: bytes each GPU moves for the weight update over NVLink / InfiniBand (merged:
  ``allreduce`` = zero-filled full tensors all-reduced over the model-parallel groups, twice a
  tensor's bytes per GPU, and every full tensor fed to every engine rank's loader;
  ``broadcast`` = once; ``sliced`` = only the engine shard of this GPU; adapter: the PEFT
  directory today (``allreduce``: gathered in fp32, written and read back), this GPU's bf16
  adapter share when streamed) + the loader's per-tensor overhead.
* **train**: (1 forward + 1 input-gradient pass, the frozen base has no weight gradient,
  + 1 recomputed forward under ``model.recompute=full``, + the no-grad forwards for old /
  reference log-probs) x 2 x active params per token, attention scores added, at
  ``train_mfu``; the MoE all-to-alls (dispatch + combine per pass) and SP all-gather /
  reduce-scatter bytes; the 1F1B bubble ``(pp - 1) / (micro-batches + pp - 1)``.
* **transitions**: host copies per step: the trainer's weights and LoRA state out and back
  with ``trainer.offload_during_rollout``; the engine's weights backed up and restored at
  sleep level 1.

``tokens_per_s_per_gpu`` = (prompt + completion tokens of the trained batch) / step time /
GPUs, the figure NeMo-RL reports.
"""

from __future__ import annotations

import math

from megagrpo.model.arch import arch_from_hf, param_counts
from megagrpo.plan.memory import (
    DTYPE_BYTES,
    GIB,
    engine_weight_bytes,
    kv_bytes_per_token,
    lora_numel,
    shapes_of,
)
from megagrpo.plan.scenario import Assumptions, Hardware, Scenario


def _bw(gpus: int, per_node: int, hw: Hardware) -> float:
    """Bytes/s per GPU of a group of ``gpus`` GPUs: NVLink inside one node, else InfiniBand."""
    return (hw.nvlink_gb_s if gpus <= per_node else hw.ib_gb_s) * 1e9


def _lat(gpus: int, per_node: int, hw: Hardware) -> float:
    return (hw.nvlink_latency_us if gpus <= per_node else hw.ib_latency_us) * 1e-6


def _generate(sc: Scenario, a: Assumptions, hw: Hardware, mem: dict) -> dict:
    s = shapes_of(sc.hf)
    active = param_counts(arch_from_hf(sc.hf))["active"]
    replicas = max(1, sc.num_gpus // sc.vllm_tp)
    seqs = sc.batch_groups * sc.group_size * a.generation_rounds / replicas
    final_ctx = a.mean_prompt_tokens + a.mean_completion_tokens
    conc = min(seqs, mem["engine"]["kv_tokens_per_replica"] / final_ctx)
    if conc < 1:
        return {"s": math.inf, "concurrent_per_replica": conc, "waves": math.inf}
    waves = seqs / conc
    steps = sc.max_tokens + max(0.0, waves - 1) * a.mean_completion_tokens
    lockstep_ep = sc.replicas == "lockstep" and sc.enable_expert_parallel
    group_tokens = conc * (replicas if lockstep_ep else 1)
    touched = 1 - (1 - s.topk / s.experts) ** group_tokens if s.experts else 1.0
    lin = 1 if sc.quantization == "fp8" else 2
    expert_gpus = sc.num_gpus if lockstep_ep else sc.vllm_tp
    experts_gpu = s.moe_layers * s.expert_layer_params * lin / expert_gpus
    weights = engine_weight_bytes(s, sc) - experts_gpu * (1 - touched)
    kv = conc * (a.mean_prompt_tokens + a.mean_completion_tokens / 2) * kv_bytes_per_token(s, sc)
    t_mem = (weights + kv) / (hw.hbm_gb_s * 1e9 * a.decode_hbm_eff)
    t_flops = 2 * active * conc / sc.vllm_tp / (hw.bf16_tflops * 1e12 * 0.5)
    per = sc.gpus_per_node
    comm = 0.0
    if sc.vllm_tp > 1:  # attention + MoE output all-reduces
        b = conc * s.h * 2 * 2 * (sc.vllm_tp - 1) / sc.vllm_tp
        comm += 2 * (_lat(sc.vllm_tp, per, hw) + b / (_bw(sc.vllm_tp, per, hw) * a.comm_eff))
    if lockstep_ep and replicas > 1:  # all-gather + reduce-scatter of every replica's tokens
        b = group_tokens * s.h * 2 * (sc.num_gpus - 1) / sc.num_gpus
        n = sc.num_gpus
        comm += 2 * (_lat(n, per, hw) + b / (_bw(n, per, hw) * a.comm_eff)) * s.moe_frac
    t_step = max(t_mem, t_flops) + s.layers * comm
    prompts = sc.batch_groups * sc.group_size * a.generation_rounds * a.mean_prompt_tokens
    prefill = 2 * active * prompts / (sc.num_gpus * hw.bf16_tflops * 1e12 * a.prefill_mfu)
    return {
        "s": steps * t_step + prefill,
        "decode_steps": steps,
        "step_ms": t_step * 1e3,
        "concurrent_per_replica": conc,
        "waves": waves,
        "prefill_s": prefill,
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
        ld, le = lora_numel(s, sc.lora_rank, sc.lora_targets)
        full = s.layers * ld + s.moe_layers * le  # parameters of the whole adapter
        # what the trainer does (trainer.sync.weight_update), whatever sync_transport says: the
        # PEFT directory (fp32 gather to rank 0, write, the engines read it back). Streamed bf16
        # shards (2 x params / GPUs bytes per GPU) are measured by tools/bench_sync.py, not built.
        t = 2 * full * 4 / (_bw(max(mp, emp), per, hw) * a.comm_eff) + 2 * full * 2 / 2e9
        return {"s": t + 2 * n_tensors * a.loader_s_per_tensor, "bytes_per_gpu": full * 8}
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


def _train(sc: Scenario, a: Assumptions, hw: Hardware) -> dict:
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


def step_time(sc: Scenario, a: Assumptions, hw: Hardware, mem: dict) -> dict:
    """Per-phase seconds of one step and ``tokens_per_s_per_gpu`` (module doc); ``mem`` is
    :func:`megagrpo.plan.memory.memory_plan` of the same scenario."""
    phases = {
        "generate": _generate(sc, a, hw, mem),
        "sync": _sync(sc, a, hw),
        "train": _train(sc, a, hw),
        "transitions": _transitions(sc, a, hw, mem),
    }
    total = sum(p["s"] for p in phases.values())
    tokens = sc.batch_groups * sc.group_size * (a.mean_prompt_tokens + a.mean_completion_tokens)
    return {
        "step_s": total,
        "phases": phases,
        "tokens_per_step": tokens,
        "tokens_per_s_per_gpu": tokens / total / sc.num_gpus if total else 0.0,
    }
