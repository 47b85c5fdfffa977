"""Size a full model for one rank of a layout without memory: meta device + fake process group.

``megagrpo verify-model --meta --hf-config configs/qwen3_235b_a22b.hf_config.json --tp 4
--ep 8 --pp 2`` builds that rank's Megatron stage (with LoRA adapters) on the meta device in a
single process, on torch's ``fake`` backend, and reports its parameter count and bytes next to
the model's closed-form total/active counts.
"""

from __future__ import annotations

import torch

from megagrpo.model.arch import arch_from_hf, load_hf_config, param_counts
from megagrpo.model.config import LoraConfig, ModelConfig
from megagrpo.parallel import ParallelConfig, validate_layout


def meta_report(
    hf_config: str,
    layout: dict,
    world_size: int,
    rank: int = 0,
    dtype: str = "bfloat16",
    lora: LoraConfig | None = None,
) -> dict:
    """Counts for ``rank`` of ``layout`` on ``world_size`` ranks (see module docstring).

    Runs in the calling process and leaves a fake torch.distributed group behind: call it in
    a process of its own (the CLI does).
    """
    from megagrpo.model.policy import MegatronPolicy
    from megagrpo.model.provider import DTYPES, build_gpt_model
    from megagrpo.parallel import init_fake_parallel

    arch = arch_from_hf(load_hf_config(hf_config))
    pcfg = ParallelConfig(**layout)
    validate_layout(pcfg, arch.raw, world_size)
    groups = init_fake_parallel(pcfg, world_size, rank)
    mcfg = ModelConfig(dtype=dtype, spec="local", lora=lora or LoraConfig())
    with torch.device("meta"):
        model, spec = build_gpt_model(arch, mcfg, groups, spec="local")
        policy = MegatronPolicy(model, arch, mcfg, groups, spec)
        policy.attach_adapters()
    base = [(n, p) for n, p in model.named_parameters() if ".adapter." not in n]
    expert = sum(p.numel() for n, p in base if ".experts." in n)
    n_base = sum(p.numel() for _, p in base)
    n_lora = sum(p.numel() for p in policy.lora_parameters())
    planned = sum(_numel(pc, dict(base)) for pieces in policy.plan.values() for pc in pieces)
    counts = param_counts(arch)
    itemsize = torch.empty((), dtype=DTYPES[dtype]).element_size()
    return {
        "model_type": arch.model_type,
        "total_params": counts["total"],
        "active_params": counts["active"],
        "world_size": world_size,
        "rank": rank,
        "layout": layout,
        "dp": groups.dp_size,
        "expert_dp": groups.expert_dp_size,
        "layers_on_rank": groups.layer_span(arch.num_layers)[1],
        "experts_on_rank": arch.num_experts // groups.ep_size if arch.is_moe else 0,
        "rank_params": n_base,
        "rank_expert_params": expert,
        "rank_bytes": n_base * itemsize,
        "rank_gib": round(n_base * itemsize / 2**30, 3),
        "dtype": dtype,
        "rank_lora_params": n_lora,
        "hf_mapping_covers_rank": planned == n_base,
    }


def _numel(piece, params) -> int:
    return params[piece.param][piece.dst].numel() if piece.owner else 0
