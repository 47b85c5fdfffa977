"""Step-time estimate of a GRPO step, per phase (`megagrpo plan-memory`): arithmetic on
FLOPs and bytes over the bandwidths of :class:`~megagrpo.plan.scenario.Hardware`, with
the efficiencies and workload of :class:`~megagrpo.plan.scenario.Assumptions` (each sourced or
an assumption with a range: :mod:`megagrpo.plan.ranges`). Nothing here is measured; every
input is printed with the result.

* **generate**: ``rounds_per_step`` rounds (dynamic sampling's resampling, billed from the
  collapse simulation: :mod:`megagrpo.plan.collapse`; the first of ``first_round_groups``
  problems under ``dynamic.oversample``), each a prefill (2 x active params x prompt tokens at
  ``prefill_mfu``; with partial rollouts also the carried completions' prefixes: the prefix
  cache is keyed by the adapter version; plus its collectives: :func:`prefill_comm_s`) +
  decode. A decode step of a replica costs the MoE experts' time (the expert weights its
  tokens touch, all of them once a replica decodes more than a few dozen sequences, read at
  ``decode_hbm_eff`` x HBM bandwidth, or their FLOPs at ``decode_mfu``; uniform routing, an
  assumption that matters little for memory-bound decode) divided by
  ``moe_lora_decode_speed`` when the engine serves LoRA on the experts, plus the rest (other
  weights but the input embedding, a gather, and the KV cache of its running sequences, or
  their FLOPs), plus the attention adapters' small kernels (:func:`attention_lora_s`), plus
  per layer two tensor-parallel all-reduces and, for lock-stepped expert-parallel replicas,
  the MoE all-gather / reduce-scatter of hidden states and router logits over every GPU
  (rings per hop and per NIC: :mod:`megagrpo.plan.links`; never slowed by LoRA). The batch
  shrinks as completions finish (:mod:`megagrpo.plan.decode`: log-normal lengths, expected
  cost of every step up to ``rollout.max_tokens``); partial rollouts end a round at its
  budget. When the KV cache cannot hold every sequence of a replica, continuous batching keeps
  it full: a slot holds the prompt and the completion so far (on average ``E[L^2] / 2 E[L]``
  tokens: :func:`length_moments`), the engine runs at that concurrency until the last
  sequences are admitted, then drains. ``full_batch_decode_s``: the same steps billed at full batch.
* **sync**: bytes each GPU moves for the weight update over NVLink / InfiniBand (merged:
  ``allreduce`` = zero-filled full tensors all-reduced over the model-parallel groups, twice a
  tensor's bytes per GPU, and every full tensor fed to every engine rank's loader;
  ``broadcast`` = once; ``sliced`` = only the engine shard of this GPU, in the trainer's
  dtype whatever the engine quantises to) + the loader (``loader_gb_s`` and its per-tensor
  overhead); in a separate placement trainer rank 0 streams every merged tensor to every
  engine rank over its one link (what the trainer does: only the adapter is fed by its
  owners). Adapter sync as ``trainer.adapter_transport`` says: ``peft_dir`` gathers in fp32,
  writes and reads back a directory (``Hardware.disk_gb_s``); ``streamed`` all-reduces bf16
  buckets of the attention factors over the model-parallel groups and reduces each expert's
  to the ranks whose engine holds it, copies this rank's share to host and loads it into its
  LoRA slot (over InfiniBand to the engines' GPUs when separate). Whether the sync is exact
  is :mod:`megagrpo.plan.exactness`'s.
* **train**: the trained groups' tokens (the shortfall policy may train fewer than
  ``batch_groups``; with ``trainer.shared_prefix`` each group's prompt counted once where the
  group fits a micro-batch: :mod:`megagrpo.plan.prefix`, ``tokens_computed``) x (1 forward
  + 1 input-gradient pass, the frozen base has no weight gradient, + 1 recomputed forward
  under ``model.recompute=full``, each ``ppo_epochs`` times, + the no-grad forwards the
  trainer runs for old / reference log-probs: ``RunConfig.no_grad_forwards``, none when the
  training forward's log-probs are reused) x 2 x active params, attention scores added, at
  ``train_mfu``
  (a hardware utilisation: recompute included, see its docstring); the LoRA adapters' thin
  GEMMs, memory-bound (``lora_hbm_eff``); the MoE all-to-alls (dispatch + combine in each of
  those passes) and SP all-gather / reduce-scatter bytes; the 1F1B bubble
  ``(pp - 1) / (micro-batches + pp - 1)`` with the trainer's micro-batches
  (:func:`micro_batches_per_dp_rank`). ``model_flops_utilisation``: the FLOPs without
  recompute over the phase, the figure public benchmarks report.
* **transitions**: host copies per step: the trainer's weights and LoRA state out and back
  with ``trainer.offload_during_rollout``; the engine's weights backed up and restored at
  sleep level 1.

Placement ``separate`` (``rollout.placement: separate``, engines on ``rollout.engine_ranks``
GPUs): no transitions; one step ahead the next step's first round overlaps training
(``overlap_s``: what the overlap hides), the further rounds of dynamic sampling do not.

``tokens_per_s_per_gpu`` = (prompt + completion tokens of the trained groups) / step time /
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
from megagrpo.plan.links import alltoall_s, latency_s, link_bw, nic_bw, ring_bw, ring_s
from megagrpo.plan.memory import (
    DTYPE_BYTES,
    GIB,
    engine_weight_bytes,
    kv_bytes_per_token,
    lora_numel,
    memory_plan,
    shapes_of,
)
from megagrpo.plan.prefix import computed_train_tokens
from megagrpo.plan.scenario import Assumptions, Hardware, Scenario

ENGINE_BATCHED_TOKENS = 16384
"""Tokens one engine scheduler step takes at most (vLLM 0.33 ``max_num_batched_tokens`` for
the offline ``LLM`` class on GPUs of >= 70 GiB: ``vllm/engine/arg_utils.py``): a round's
prefill runs in passes of this many tokens per replica."""

ATTENTION_TARGETS = ("linear_qkv", "linear_proj")


def _lockstep_ep(sc: Scenario) -> bool:
    return sc.replicas == "lockstep" and sc.enable_expert_parallel


def _ep_token_bytes(s) -> float:
    """Bytes of one token in the lock-stepped EP engine's all-gather: the bf16 hidden state
    and the router logits (vLLM 0.33 gathers both: ``cuda_communicator.py``)."""
    return s.h * 2 + s.experts * 2


def serves_moe_lora_adapter(sc: Scenario) -> bool:
    """Whether the engine serves the adapter on the MoE experts (MoE-LoRA decode speed)."""
    s = shapes_of(sc.hf)
    experts = any(t in sc.lora_targets for t in ("linear_fc1", "linear_fc2"))
    return bool(sc.weight_sync == "adapter" and sc.enable_lora and s.experts and experts)


def length_moments(sc: Scenario, a: Assumptions) -> tuple[float, float]:
    """``(E[L], E[L^2] / (2 E[L]))`` of the clipped completion lengths: the mean, and the mean
    age of a running completion under continuous batching (a slot refilled as soon as its
    completion ends holds, at a random moment, a completion that is length-biased: the
    renewal-theory mean age; ``L / 2`` when every completion has the same length)."""
    surv = lognormal_survival(a.mean_completion_tokens, a.completion_sigma, sc.max_tokens)
    t = np.arange(len(surv), dtype=np.float64)
    mean = float(surv.sum())  # sum_t P(L > t) = E[L]
    second = float(((2 * t + 1) * surv).sum())  # sum_t (2t + 1) P(L > t) = E[L^2]
    return mean, second / (2 * mean) if mean else 0.0


def decode_step_cost(sc: Scenario, a: Assumptions, hw: Hardware):
    """``cost(n [steps], context [steps]) -> seconds [steps]`` of one decode step of a replica
    running ``n`` sequences whose completions hold ``context`` tokens (module doc): the MoE
    experts' time (the expert weights the step touches, or their FLOPs) at
    ``moe_lora_decode_speed`` when the engine serves LoRA on them, plus the rest (other
    weights and the KV cache, or their FLOPs), plus the collectives (never slowed by LoRA)."""
    s = shapes_of(sc.hf)
    active = param_counts(arch_from_hf(sc.hf))["active"]
    expert_active = s.moe_layers * s.topk * 3 * s.h * s.moe_ffn if s.experts else 0
    replicas = max(1, sc.num_gpus // sc.vllm_tp)
    lockstep_ep = _lockstep_ep(sc)
    lin = 1 if sc.quantization == "fp8" else 2
    expert_gpus = sc.num_gpus if lockstep_ep else sc.vllm_tp
    experts_gpu = s.moe_layers * s.expert_layer_params * lin / expert_gpus
    # the input embedding is a gather, not read whole (finding 11); a tied one is the LM head
    embed = 0.0 if s.tied else s.vocab * s.h * 2 / sc.vllm_tp
    w_rest = engine_weight_bytes(s, sc) - experts_gpu - embed
    kvt = kv_bytes_per_token(s, sc)
    per, tp, world = sc.gpus_per_node, sc.vllm_tp, sc.num_gpus
    speed = a.moe_lora_decode_speed if serves_moe_lora_adapter(sc) else 1.0
    bw = hw.hbm_gb_s * 1e9 * a.decode_hbm_eff
    flops = hw.bf16_tflops * 1e12 * a.decode_mfu
    lora_kernels = attention_lora_s(sc, a)

    def cost(n: np.ndarray, context: np.ndarray) -> np.ndarray:
        group_tokens = n * (replicas if lockstep_ep else 1)
        touched = 1 - (1 - s.topk / s.experts) ** group_tokens if s.experts else 0.0
        moe = np.maximum(experts_gpu * touched / bw, 2 * expert_active * n / tp / flops)
        kv = n * (a.mean_prompt_tokens + context) * kvt
        rest = np.maximum((w_rest + kv) / bw, 2 * (active - expert_active) * n / tp / flops)
        comm = np.zeros_like(n)
        if tp > 1:  # attention + MoE output all-reduces (ring: twice (tp - 1) / tp)
            b = n * s.h * 2 * 2 * (tp - 1) / tp
            comm = comm + 2 * (latency_s(tp, per, hw) + b / ring_bw(tp, per, hw, a))
        if lockstep_ep and replicas > 1:  # all-gather + reduce-scatter of every replica's tokens
            b = group_tokens * _ep_token_bytes(s) * (world - 1) / world
            one = latency_s(world, per, hw) + b / ring_bw(world, per, hw, a)
            comm = comm + 2 * one * s.moe_frac
        return moe / speed + rest + s.layers * comm + lora_kernels

    return cost


def attention_lora_s(sc: Scenario, a: Assumptions) -> float:
    """Seconds per decode step of the attention adapters an engine serving LoRA runs
    (scale-audit-3 finding 8): a shrink and an expand kernel per adapted attention matrix
    and layer (punica), each ``lora_kernel_us``; 0 without adapter serving."""
    if sc.weight_sync != "adapter" or not sc.enable_lora:
        return 0.0
    adapted = sum(1 for t in ATTENTION_TARGETS if t in sc.lora_targets)
    return shapes_of(sc.hf).layers * adapted * 2 * a.lora_kernel_us * 1e-6


def prefill_comm_s(sc: Scenario, a: Assumptions, hw: Hardware, tokens: float) -> float:
    """Collectives of a round's prefill of ``tokens`` tokens over all replicas (scale-audit-3
    finding 3): in lock-stepped expert-parallel replicas every prefill token goes through the
    same MoE all-gather + reduce-scatter as a decode token (vLLM 0.33 with LoRA on the
    experts forces ``allgather_reducescatter``: ``lora/layers/fused_moe.py``), in tensor
    parallel replicas through two all-reduces per layer; one latency per collective per
    prefill pass (:data:`ENGINE_BATCHED_TOKENS` tokens per replica)."""
    s = shapes_of(sc.hf)
    replicas = max(1, sc.num_gpus // sc.vllm_tp)
    per, tp, world = sc.gpus_per_node, sc.vllm_tp, sc.num_gpus
    passes = math.ceil(tokens / replicas / ENGINE_BATCHED_TOKENS) if tokens > 0 else 0
    t = 0.0
    if tp > 1:
        b = tokens / replicas * s.h * 2 * 2 * (tp - 1) / tp
        t += s.layers * 2 * (passes * latency_s(tp, per, hw) + b / ring_bw(tp, per, hw, a))
    if _lockstep_ep(sc) and replicas > 1:
        b = tokens * _ep_token_bytes(s) * (world - 1) / world
        lat = passes * latency_s(world, per, hw)
        t += s.moe_layers * 2 * (lat + b / ring_bw(world, per, hw, a))
    return t


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


def _round(
    sc: Scenario, a: Assumptions, hw: Hardware, mem: dict, groups: float | None = None
) -> dict:
    """One generation round of ``groups`` (default ``batch_groups``) x ``group_size``
    completions (module doc)."""
    active = param_counts(arch_from_hf(sc.hf))["active"]
    replicas = max(1, sc.num_gpus // sc.vllm_tp)
    n_round = (sc.batch_groups if groups is None else groups) * sc.group_size
    shape = _round_shape(sc, a, n_round)
    seqs = n_round / replicas  # new completions per replica and round
    mean_len, mean_age = length_moments(sc, a)
    # continuous batching: a slot holds its completion's prompt and the tokens so far
    conc_kv = mem["engine"]["kv_tokens_per_replica"] / (a.mean_prompt_tokens + mean_age)
    conc = min(seqs * shape.in_flight, conc_kv)
    if conc < 1:
        return {"s": math.inf, "concurrent_per_replica": conc, "waves": math.inf}
    waves = seqs * shape.in_flight / conc
    cost = decode_step_cost(sc, a, hw)
    # the KV cache holds ``conc`` sequences: until the last ``conc`` are admitted the engine
    # runs full (continuous batching refills every slot that finishes), then drains
    full_steps = max(0.0, waves - 1) * mean_len
    full_cost = float(cost(np.array([conc]), np.array([mean_age]))[0])
    full = full_steps * full_cost
    last = seqs if waves <= 1 else conc / shape.in_flight
    decode = expected_decode_s(shape, last, cost)
    prompts = n_round * a.mean_prompt_tokens + n_round * shape.carried_context
    prefill_gemm = 2 * active * prompts / (sc.num_gpus * hw.bf16_tflops * 1e12 * a.prefill_mfu)
    prefill_comm = prefill_comm_s(sc, a, hw, prompts)
    prefill = prefill_gemm + prefill_comm
    steps = full_steps + shape.expected_steps
    chunks = 0.0
    if sc.partial_finish_fraction > 0:
        chunks = math.ceil(steps / sc.partial_chunk_tokens) * a.partial_chunk_s
    return {
        "s": full + decode + prefill + chunks,
        "decode_s": full + decode,
        "decode_steps": steps,
        "step_ms": (full + decode) / steps * 1e3 if steps else 0.0,
        "full_batch_decode_s": full + shape.expected_steps * full_cost,
        "concurrent_per_replica": conc,
        "waves": waves,
        "prefill_s": prefill,
        "prefill_comm_s": prefill_comm,
        "attention_lora_ms": attention_lora_s(sc, a) * 1e3,
        "partial_chunks_s": chunks,
        "round_budget_tokens": shape.round_tokens,
        "moe_lora_decode_speed": a.moe_lora_decode_speed if serves_moe_lora_adapter(sc) else 1.0,
    }


def _generate(sc: Scenario, a: Assumptions, hw: Hardware, mem: dict) -> dict:
    """Every generation round of a step (dynamic sampling's resampling, billed from the
    collapse simulation: :mod:`megagrpo.plan.collapse`): the first round of
    ``first_round_groups`` problems (``dynamic.oversample`` draws more than ``batch_groups``)
    and ``rounds_per_step - 1`` resampling rounds of ``batch_groups``; ``round_s``: one round
    of ``batch_groups``; ``collapse_s``: everything beyond it."""
    one = _round(sc, a, hw, mem)
    first_groups = sc.first_round_groups or sc.batch_groups
    first = one if first_groups == sc.batch_groups else _round(sc, a, hw, mem, first_groups)
    rest = max(0.0, sc.rounds_per_step - 1)
    total = first["s"] + one["s"] * rest
    out = dict(one, round_s=one["s"], first_round_s=first["s"], rounds=sc.rounds_per_step)
    out.update(s=total, first_round_groups=first_groups)
    if math.isfinite(total):
        for key in ("decode_s", "prefill_s", "prefill_comm_s", "partial_chunks_s"):
            out[key] = first[key] + one[key] * rest
        out["full_batch_decode_s"] = (
            first["full_batch_decode_s"] + one["full_batch_decode_s"] * rest
        )
        out["collapse_s"] = total - one["s"]
    return out


def _sync(sc: Scenario, a: Assumptions, hw: Hardware) -> dict:
    s = shapes_of(sc.hf)
    wbytes = DTYPE_BYTES.get(sc.dtype, 2)
    per = sc.gpus_per_node
    dense_b = (s.layers * (s.attn_params + s.experts * s.h) + s.vocab * s.h * 2) * wbytes
    exp_b = s.moe_layers * s.expert_layer_params * wbytes
    n_tensors = s.layers * (10 + 3 * s.experts) + 3
    mp, emp = sc.tp * sc.pp, sc.ep * sc.etp * sc.pp
    load = 1e9 * a.loader_gb_s  # the engine's loader takes what arrives (finding 7)
    if sc.weight_sync == "adapter":
        return _adapter_sync(sc, a, hw, s, n_tensors)
    if sc.placement == "separate":  # trainer rank 0 streams every tensor to every engine rank
        total = dense_b + exp_b
        t = total * sc.num_gpus / nic_bw(hw, a)
        t += n_tensors * a.loader_s_per_tensor + total / load
        return {"s": t, "bytes_per_gpu": total}
    factor = {"allreduce": 2.0, "broadcast": 1.0}.get(sc.sync_transport)
    if factor is None:  # sliced: only this GPU's engine shard crosses the links, in the
        # trainer's dtype (vLLM quantises an FP8 engine's share on load, after the wire)
        shard = engine_weight_bytes(s, sc.with_(quantization="none")) * wbytes / 2
        t = shard / link_bw(sc.num_gpus, per, hw, a) + shard / load
        t += n_tensors / sc.num_gpus * sc.vllm_tp * a.loader_s_per_tensor
        return {"s": t, "bytes_per_gpu": shard}
    moved = factor * (dense_b * (mp - 1) / max(mp, 1) + exp_b * (emp - 1) / max(emp, 1))
    t_comm = factor * dense_b * (mp - 1) / max(mp, 1) / ring_bw(mp, per, hw, a)
    t_comm += factor * exp_b * (emp - 1) / max(emp, 1) / ring_bw(emp, per, hw, a)
    total = dense_b + exp_b  # every full tensor through every engine rank's loader
    t_load = n_tensors * a.loader_s_per_tensor + total / load
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
        disk = 2 * full * 2 / (hw.disk_gb_s * 1e9)  # written, then read back (bf16)
        t = 2 * full * 4 / ring_bw(max(mp, emp), per, hw, a) + disk
        return {"s": t + 2 * n_tensors * a.loader_s_per_tensor, "bytes_per_gpu": full * 8}
    # streamed (megagrpo.model.peft_export.stream_lora): the attention factors all-reduced in
    # bf16 buckets over the model-parallel group (every engine rank serves all of them); each
    # expert's factors reduced, in every expert-model-parallel group, to the ranks whose engine
    # holds that expert only (finding 9); the rank's own share copied to host and loaded
    lockstep_ep = _lockstep_ep(sc)
    expert_gpus = sc.num_gpus if lockstep_ep else sc.vllm_tp
    ring = [(2 * dense * 2 * (mp - 1) / mp, mp), (expert * 2 * (emp - 1) / emp, emp)]
    moved = sum(b for b, _ in ring)
    t = sum(ring_s(n, per, b, hw, a) for b, n in ring if n > 1)
    if sc.placement == "separate":  # trainer -> engine GPUs over InfiniBand
        t += (dense + expert) * 2 / nic_bw(hw, a)
        moved += (dense + expert) * 2
    local = dense / sc.vllm_tp + expert / expert_gpus
    local_tensors = s.layers * 8 + s.moe_layers * 6 * s.experts / expert_gpus
    host = hw.host_gb_s * 1e9
    t += local * 2 / host + local_tensors * a.loader_s_per_tensor
    return {"s": t, "bytes_per_gpu": moved}


def train_tokens(sc: Scenario, a: Assumptions) -> float:
    """Prompt + completion tokens of the groups trained per step."""
    mean_len, _ = length_moments(sc, a)
    return sc.trained_groups * sc.group_size * (a.mean_prompt_tokens + mean_len)


def _lora_s(sc: Scenario, a: Assumptions, hw: Hardware, s, tokens: float, passes: int) -> float:
    """The LoRA adapters' GEMMs of a train phase: per token, every adapter of the layers and
    of the token's top-k experts runs ``x A^T`` and ``(x A^T) B^T`` in each of ``passes``
    passes plus its weight gradients, 2 r (in + out) FLOPs each; at r FLOPs per byte they are
    memory-bound: billed at ``r x HBM bandwidth x lora_hbm_eff``."""
    if not sc.lora_rank:
        return 0.0
    dense, expert = lora_numel(s, sc.lora_rank, sc.lora_targets)
    per_token = s.layers * dense + (s.moe_layers * expert * s.topk / s.experts if s.experts else 0)
    flops = 2 * per_token * (passes + 1) * tokens
    rate = sc.lora_rank * hw.hbm_gb_s * 1e9 * a.lora_hbm_eff
    return flops / (sc.num_gpus * rate)


def computed_tokens(sc: Scenario, a: Assumptions) -> float:
    """Tokens the trainer computes per step: :func:`train_tokens` with each shared prompt
    once (``trainer.shared_prefix``: :mod:`megagrpo.plan.prefix`)."""
    mean, age = length_moments(sc, a)
    return computed_train_tokens(sc, a.mean_prompt_tokens, mean, 2 * mean * age)


def train_phase(sc: Scenario, a: Assumptions, hw: Hardware) -> dict:
    """The train phase of ``sc``: seconds (``s``) and its parts (module doc)."""
    s = shapes_of(sc.hf)
    active = param_counts(arch_from_hf(sc.hf))["active"]
    mean_len = a.mean_prompt_tokens + length_moments(sc, a)[0]
    tokens = computed_tokens(sc, a)
    recompute = int(sc.recompute == "full")
    # per epoch: forward, input gradient (the frozen base has no weight gradient), recomputed
    # forward; once per batch: the no-grad forwards the trainer runs (finding 2:
    # RunConfig.no_grad_forwards, the trainer's own rule)
    train_passes = (2 + recompute) * sc.ppo_epochs
    passes_all = train_passes + sc.extra_forwards
    attn = 4 * s.layers * (mean_len / 2) * s.heads * s.hd  # QK^T and AV per token, forward
    gemm = active - s.vocab * s.h  # the input embedding is a lookup, not a GEMM
    flops = tokens * (2 * gemm + attn) * passes_all
    peak = sc.num_gpus * hw.bf16_tflops * 1e12
    t_compute = flops / (peak * a.train_mfu)
    t_lora = _lora_s(sc, a, hw, s, tokens, passes_all)
    per = sc.gpus_per_node
    tok_gpu_layer = tokens * sc.pp / sc.num_gpus  # tokens one GPU handles in one of its layers
    layers_gpu = s.layers / sc.pp
    a2a = 0.0
    if s.experts and sc.ep > 1:
        out = tok_gpu_layer * s.topk * s.h * 2 * (sc.ep - 1) / sc.ep
        t_one = alltoall_s(sc.ep, per, out, hw, a)
        a2a = t_one * 2 * passes_all * layers_gpu * s.moe_frac  # dispatch + combine per pass
    sp = 0.0
    if sc.tp > 1:
        b = tok_gpu_layer * s.h * 2 * (sc.tp - 1)
        sp = ring_s(sc.tp, per, b, hw, a) * 4 * passes_all * layers_gpu
    dp = max(1, sc.num_gpus // (sc.tp * sc.pp))
    n_micro = micro_batches_per_dp_rank(sc, tokens, dp)
    bubble = (sc.pp - 1) / (n_micro + sc.pp - 1)
    body = t_compute + t_lora + a2a + sp
    total = body / (1 - bubble)
    model_flops = tokens * (2 * gemm + attn) * (passes_all - recompute * sc.ppo_epochs)
    return {
        "s": total,
        "compute_s": t_compute,
        "lora_s": t_lora,
        "moe_all_to_all_s": a2a,
        "sp_collectives_s": sp,
        "pipeline_bubble": bubble,
        "micro_batches_per_dp_rank": n_micro,
        "passes": passes_all,
        "model_flops_utilisation": model_flops / (peak * total) if total else 0.0,
        "tokens_computed": tokens,
        "tokens_trained": train_tokens(sc, a),
    }


def micro_batches_per_dp_rank(sc: Scenario, tokens: float, dp: int) -> int:
    """Micro-batches one data-parallel rank runs per optimiser step (finding 10): packed rows
    of ``trainer.pack_tokens``, else ``micro_batch_size`` sequences each (each padded to its own
    longest: ``megagrpo.trainer.batch``), not ``max_model_len``-padded token budgets."""
    if sc.pack_tokens:
        return max(1, math.ceil(tokens / dp / sc.pack_tokens))
    seqs = sc.trained_groups * sc.group_size
    return max(1, math.ceil(seqs / dp / sc.micro_batch_size))


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
    """Placement separate: the engines generate on their own GPUs, the trainer trains on the
    rest, then the adapter crosses over (the engines pause for it); no offload, no sleep.
    One step ahead (``offpolicy_staleness`` 1) the next step's first round runs while this
    step trains: ``max(first round, train) + (rounds - 1) x round + sync`` (dynamic sampling's
    further rounds wait for their decision, on the critical path); on-policy (0) the phases
    run in turn."""
    trainer, engine = split_placement(sc)
    phases = {
        "generate": _generate(engine, a, hw, memory_plan(engine, a)),
        "sync": _sync(engine, a, hw),
        "train": train_phase(trainer, a, hw),
        "transitions": {"s": 0.0, "trainer_offload_s": 0.0, "engine_sleep_backup_s": 0.0},
    }
    overlap = 0.0
    if sc.offpolicy_staleness >= 1:
        overlap = min(phases["generate"]["first_round_s"], phases["train"]["s"])
    return _summary(sc, a, phases, overlap)


def _summary(sc: Scenario, a: Assumptions, phases: dict, overlap: float) -> dict:
    total = sum(p["s"] for p in phases.values()) - overlap
    tokens = train_tokens(sc, a)
    mean_len, _ = length_moments(sc, a)
    first = sc.first_round_groups or sc.batch_groups
    groups = first + max(0.0, sc.rounds_per_step - 1) * sc.batch_groups
    generated = groups * sc.group_size * mean_len
    return {
        "step_s": total,
        "phases": phases,
        "overlap_s": overlap,
        "placement": sc.placement,
        "tokens_per_step": tokens,
        "generated_tokens_per_step": generated,
        "rounds_per_step": sc.rounds_per_step,
        "trained_groups_per_step": sc.trained_groups,
        "collapse_s": phases["generate"].get("collapse_s", 0.0),
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
