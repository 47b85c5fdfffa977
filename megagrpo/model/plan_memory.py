"""Per-GPU memory plan of a parallel layout (`megagrpo plan-memory`).

Closed-form estimate for one GPU of the most loaded pipeline stage, in GiB (2^30 bytes):

- frozen base weights: non-expert weights / (TP x PP), experts / (EP x ETP x PP), the
  embedding (first stage) or output layer (last stage) / TP, in ``model.dtype``;
- LoRA: fp32 parameters + gradients + AdamW's two moments (16 bytes per parameter),
  sharded like the layers they adapt;
- activations of one micro-batch (``trainer.micro_batch_size`` x ``rollout.max_model_len``
  tokens), per layer ``34 h + 5 a s`` bytes per token (Korthikanti et al., sequence
  parallel divides by TP) plus the routed tokens' expert activations, times the number of
  micro-batches in flight under 1F1B (PP); with ``model.recompute=full`` only each
  layer's input is kept (2 h bytes per token) plus one layer's working set (``selective``
  is planned as ``none``: an upper bound);
- LoRA adapter activations (:func:`lora_activation_bytes`): each adapter keeps its input
  in the activation dtype (gathered over the sequence under SP; the routed token copies for
  experts), plus a dropout copy and mask when ``model.lora.dropout`` > 0 and its r-wide fp32
  ``x A^T``; every layer without recompute, one layer's worth with full recompute;
- logits: one micro-batch's [tokens, V/TP] in the compute dtype plus its gradient (the
  fused loss never builds an fp32 [T, V] log-softmax);
- the colocated vLLM engine: during generation it may use ``rollout.gpu_memory_utilization``
  of the GPU (its weights: non-expert ones sharded over ``rollout.tensor_parallel_size``,
  experts over all GPUs with ``rollout.enable_expert_parallel``; the rest is KV cache);
  during training it sleeps (weights offloaded, KV cache freed), so the peak is the larger of
  the two phases, both on top of the trainer's resident weights and LoRA state;
- 3 GiB of CUDA context, NCCL buffers and allocator fragmentation.

``fits`` when the peak is at most 95% of ``cluster.gpu_memory_gib``; otherwise it says what
to change. ``--json`` prints ``fits``, ``num_gpus``, ``per_gpu_gib`` and the breakdown.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from megagrpo.errors import ConfigError
from megagrpo.model.arch import load_hf_config
from megagrpo.model.config import ModelConfig
from megagrpo.model.pretrained import BUNDLED, resolve_model_path
from megagrpo.parallel.config import ClusterConfig, ParallelConfig
from megagrpo.rollout.config import RolloutConfig

GIB = 2**30
OVERHEAD_GIB = 3.0
HEADROOM = 0.95
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass
class _Shapes:
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


def _shapes(hf: dict) -> _Shapes:
    from megagrpo.model.arch import arch_from_hf

    a = arch_from_hf(hf)
    moe_layers = sum(1 for m in (a.moe_layers or []) if m) if a.is_moe else 0
    return _Shapes(
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


def _lora_numel(s: _Shapes, rank: int, targets: list[str]) -> tuple[float, float]:
    """(per-layer non-expert LoRA params, per-layer expert LoRA params over all experts)."""
    q, kv = s.heads * s.hd, s.kv * s.hd
    dense = 0.0
    if "linear_qkv" in targets:
        dense += rank * (s.h + q + 2 * kv)
    if "linear_proj" in targets:
        dense += rank * (q + s.h)
    expert = 0.0
    for fc, (i, o) in (("linear_fc1", (s.h, 2 * s.moe_ffn)), ("linear_fc2", (s.moe_ffn, s.h))):
        if fc in targets:
            expert += s.experts * rank * (i + o)
    return dense, expert


def lora_activation_bytes(
    s: _Shapes, model: ModelConfig, par: ParallelConfig, tokens: int
) -> float:
    """Bytes one layer's LoRA adapters keep for backward for ``tokens`` tokens of a
    micro-batch on one GPU (averaged over dense and MoE layers).

    Per adapter: its input in the activation dtype (``model.dtype``), counted in full even
    where the base layer already holds the same storage (an upper bound), times 2 plus a
    1-byte mask per element with dropout; plus ``x A^T`` (r fp32 values per row). Column
    inputs are gathered over the sequence under SP (whole ``tokens``); row inputs are
    sharded over TP. Experts see ``tokens / sp * topk`` routed copies per GPU (all-gathered
    over ETP: ``* etp``).
    """
    abytes = DTYPE_BYTES.get(model.dtype, 2)
    tp, etp, r = par.tp, par.etp, model.lora.rank
    sp = tp if (par.sequence_parallel or tp > 1) else 1
    per_input = abytes * (1 + ((1 + 1 / abytes) if model.lora.dropout > 0 else 0))
    t = model.lora.targets
    moe_frac = s.moe_layers / s.layers if s.layers else 0.0
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
            width, rows = width + (1 - moe_frac) * dense_in, rows + (1 - moe_frac)
        if s.experts and (fc in t or f"expert_{fc}" in t):
            copies = s.topk / sp * etp
            width, rows = width + moe_frac * copies * expert_in, rows + moe_frac * copies
    return tokens * (width * per_input + rows * r * 4)


def plan(
    hf: dict,
    *,
    model: ModelConfig,
    parallel: ParallelConfig,
    rollout: RolloutConfig,
    cluster: ClusterConfig,
    micro_batch_size: int,
    batch_groups: int,
) -> dict:
    """The memory plan of one run for the model of HF config ``hf`` (a dict): the run's
    model/parallel/rollout/cluster configs and its micro-batch and batch sizes (groups)."""
    s = _shapes(hf)
    par, ro = parallel, rollout
    num_gpus = cluster.num_gpus
    wbytes = DTYPE_BYTES.get(model.dtype, 2)
    tp, pp, ep, etp = par.tp, par.pp, par.ep, par.etp
    layers = math.ceil(s.layers / pp)
    moe_frac = s.moe_layers / s.layers if s.layers else 0.0
    attn = s.h * s.hd * (s.heads + 2 * s.kv) + s.heads * s.hd * s.h + 2 * s.h
    expert_layer = s.experts * 3 * s.h * s.moe_ffn
    dense_mlp = 3 * s.h * s.ffn
    nonexp = layers * (attn + (1 - moe_frac) * dense_mlp + moe_frac * s.experts * s.h)
    exp = layers * moe_frac * expert_layer
    emb = s.vocab * s.h * (1 if (s.tied or pp > 1) else 2)
    base = (nonexp / tp + exp / (ep * etp) + emb / tp) * wbytes
    lora_dense, lora_exp = _lora_numel(s, model.lora.rank, model.lora.targets)
    lora_params = layers * (lora_dense / tp + moe_frac * lora_exp / (ep * etp))
    lora = lora_params * 16  # fp32 param + grad + 2 Adam moments
    tokens = micro_batch_size * ro.max_model_len
    sp = tp if (par.sequence_parallel or tp > 1) else 1
    lora_layer = lora_activation_bytes(s, model, par, tokens)  # one layer's adapters
    if model.recompute == "full":
        per_layer_tok = 2 * s.h / sp
        work = tokens * (34 * s.h / sp + 5 * s.heads * ro.max_model_len / tp) * 2
        acts = tokens * per_layer_tok * layers + work
        lora_acts = lora_layer
    else:
        routed = moe_frac * s.topk * 4 * s.moe_ffn * 2 / etp if s.experts else 0.0
        per_layer_tok = (34 * s.h / sp + 5 * s.heads * ro.max_model_len / tp) * 2 / 2 + routed
        acts = tokens * per_layer_tok * layers
        lora_acts = lora_layer * layers
    in_flight = min(pp, max(1, batch_groups * ro.group_size // max(micro_batch_size, 1)))
    acts *= in_flight
    lora_acts *= in_flight
    logits = tokens * (s.vocab / tp) * 2 * 2  # bf16 logits + their gradient
    train_peak = base + lora + acts + lora_acts + logits
    resident = base + lora
    gen_peak = resident + ro.gpu_memory_utilization * cluster.gpu_memory_gib * GIB
    peak = max(train_peak, gen_peak) / GIB + OVERHEAD_GIB
    fits = peak <= HEADROOM * cluster.gpu_memory_gib
    # vLLM: non-expert weights over its TP; experts over TP x DP with expert parallelism
    # (colocated: one replica per rollout.tensor_parallel_size GPUs, EP across all of them).
    vtp = max(ro.tensor_parallel_size, 1)
    vep = num_gpus if ro.enable_expert_parallel else vtp
    vllm_weights = (
        ((nonexp * pp + s.vocab * s.h * (1 if s.tied else 2)) / vtp + exp * pp / vep) * wbytes / GIB
    )
    out = {
        "fits": bool(fits),
        "num_gpus": num_gpus,
        "per_gpu_gib": round(peak, 2),
        "gpu_memory_gib": cluster.gpu_memory_gib,
        "layout": {
            "tp": tp,
            "pp": pp,
            "ep": ep,
            "etp": etp,
            "dp": num_gpus // (tp * pp),
            "sequence_parallel": bool(sp > 1),
            "vllm_tp": ro.tensor_parallel_size,
        },
        "breakdown_gib": {
            "base_weights": round(base / GIB, 2),
            "lora_params_grads_adam": round(lora / GIB, 3),
            "activations": round(acts / GIB, 2),
            "lora_activations": round(lora_acts / GIB, 2),
            "logits": round(logits / GIB, 2),
            "vllm_budget_while_generating": round(
                ro.gpu_memory_utilization * cluster.gpu_memory_gib, 2
            ),
            "vllm_weights_share": round(vllm_weights, 2),
            "overhead": OVERHEAD_GIB,
        },
        "phase_peak_gib": {
            "train": round(train_peak / GIB + OVERHEAD_GIB, 2),
            "generate": round(gen_peak / GIB + OVERHEAD_GIB, 2),
        },
        "lora_params_per_gpu": int(lora_params),
        "advice": _advice(fits, train_peak, gen_peak, vllm_weights, rollout, cluster),
    }
    if num_gpus % (tp * pp) or num_gpus % (ep * etp * pp):
        out["fits"] = False
        out["advice"].insert(
            0, f"{num_gpus} GPUs are not divisible by tp*pp={tp * pp} and ep*etp*pp={ep * etp * pp}"
        )
    return out


def _advice(
    fits: bool,
    train_peak: float,
    gen_peak: float,
    vllm_weights: float,
    rollout: RolloutConfig,
    cluster: ClusterConfig,
) -> list:
    tips = []
    budget = rollout.gpu_memory_utilization * cluster.gpu_memory_gib
    if vllm_weights > 0.8 * budget:
        tips.append(
            f"vLLM's weight share ({vllm_weights:.1f} GiB) leaves little KV cache in "
            f"rollout.gpu_memory_utilization={rollout.gpu_memory_utilization}: raise "
            "rollout.tensor_parallel_size (and enable_expert_parallel)"
        )
    if fits:
        return tips
    if gen_peak >= train_peak:
        tips.append(
            "generation phase is the peak: lower rollout.gpu_memory_utilization or "
            "shard the trainer's weights further (parallel.ep / parallel.tp / parallel.pp)"
        )
    else:
        tips.append(
            "training phase is the peak: lower trainer.micro_batch_size, set "
            "model.recompute=full, or raise parallel.tp / parallel.pp"
        )
    tips.append("or add nodes (cluster.num_nodes) and raise parallel.ep")
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


def format_plan(p: dict) -> str:
    """Human-readable table of :func:`plan`."""
    lay = p["layout"]
    lines = [
        f"layout: {p['num_gpus']} GPUs, tp={lay['tp']} pp={lay['pp']} ep={lay['ep']} "
        f"etp={lay['etp']} dp={lay['dp']} sp={lay['sequence_parallel']} "
        f"vllm_tp={lay['vllm_tp']}"
    ]
    for k, v in p["breakdown_gib"].items():
        lines.append(f"  {k:<30} {v:>9} GiB")
    lines.append(
        f"  {'peak (train | generate)':<30} {p['phase_peak_gib']['train']:>9} | "
        f"{p['phase_peak_gib']['generate']} GiB"
    )
    verdict = "FITS" if p["fits"] else "DOES NOT FIT"
    lines.append(f"per GPU: {p['per_gpu_gib']} GiB of {p['gpu_memory_gib']} GiB -> {verdict}")
    lines += [f"  - {t}" for t in p["advice"]]
    return "\n".join(lines)
