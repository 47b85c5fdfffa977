"""HF architecture → Megatron ``TransformerConfig`` + layer spec → ``GPTModel`` (one PP stage).

The same provider builds Qwen3-MoE and dense Qwen3/Llama models. Spec: ``local`` (pure
megatron-core modules, SequentialMLP experts; CPU) or ``te`` (Transformer Engine modules,
TEGroupedMLP experts when ``moe_grouped_gemm``; GPU). Numerics are set to match transformers:
RMSNorm, SwiGLU, no biases (qkv bias for Qwen2), qk RMSNorm for Qwen3, router softmax then
top-k (renormalised when ``norm_topk_prob``), no aux loss, dropless experts.
"""

from __future__ import annotations

import importlib.util
import logging
from typing import Any, cast

import torch
import torch.nn.functional as F

from megagrpo.errors import ConfigError
from megagrpo.model.arch import Arch
from megagrpo.model.config import ModelConfig
from megagrpo.parallel.state import ParallelGroups

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_spec(model_cfg: ModelConfig) -> str:
    """``local`` or ``te``: ``auto`` picks TE only with CUDA and transformer_engine installed."""
    has_te = importlib.util.find_spec("transformer_engine") is not None
    if model_cfg.spec != "auto":
        if model_cfg.spec == "te" and not (torch.cuda.is_available() and has_te):
            missing = "CUDA" if not torch.cuda.is_available() else "transformer_engine"
            raise ConfigError(
                f"config key 'model.spec': 'te' needs CUDA + Transformer Engine ({missing} "
                "is not available here)"
            )
        return model_cfg.spec
    return "te" if torch.cuda.is_available() and has_te else "local"


def transformer_config(arch: Arch, model_cfg: ModelConfig, groups: ParallelGroups, spec: str):
    """Megatron ``TransformerConfig`` for ``arch`` under ``groups``' layout."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    dtype = DTYPES[model_cfg.dtype]
    kw: dict[str, Any] = dict(
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        num_attention_heads=arch.num_heads,
        num_query_groups=arch.num_kv_heads,
        kv_channels=arch.head_dim,
        ffn_hidden_size=arch.ffn_hidden_size or arch.hidden_size,
        normalization="RMSNorm",
        layernorm_epsilon=arch.rms_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=arch.qkv_bias,
        qk_layernorm=arch.qk_norm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        attention_softmax_in_fp32=True,
        apply_rope_fusion=False,
        masked_softmax_fusion=False,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        tensor_model_parallel_size=groups.tp_size,
        pipeline_model_parallel_size=groups.pp_size,
        expert_model_parallel_size=groups.ep_size,
        expert_tensor_parallel_size=groups.etp_size,
        sequence_parallel=groups.sequence_parallel,
        use_cpu_initialization=not torch.cuda.is_available() or groups.fake,
        perform_initialization=False,
    )
    kw.update(recompute_kwargs(arch, model_cfg, groups, spec))
    kw.update(pipeline_kwargs(groups.pp_size))
    if groups.first_stage_layers:  # megatron-core's uneven pipeline
        kw.update(num_layers_in_first_pipeline_stage=groups.first_stage_layers)
    if groups.last_stage_layers:
        kw.update(num_layers_in_last_pipeline_stage=groups.last_stage_layers)
    if arch.is_moe:
        kw.update(
            num_moe_experts=arch.num_experts,
            moe_router_topk=arch.moe_topk,
            moe_ffn_hidden_size=arch.moe_ffn_hidden_size,
            moe_router_pre_softmax=not arch.norm_topk_prob,
            moe_router_load_balancing_type="none",
            moe_aux_loss_coeff=0.0,
            moe_token_dispatcher_type="alltoall",
            moe_router_dtype="fp32",
            moe_grouped_gemm=spec == "te" and model_cfg.moe_grouped_gemm,
            moe_permute_fusion=False,
            moe_layer_freq=[1 if m else 0 for m in arch.moe_layers],
            # a RouterReplay per router: a pass-through until armed (megagrpo.model.routing)
            moe_enable_routing_replay=True,
        )
    return TransformerConfig(**kw)


def pipeline_kwargs(pp: int) -> dict[str, Any]:
    """``TransformerConfig`` keys for ``pp`` pipeline stages (pure: no megatron import).

    With pp > 1 (megagrpo.model.pipeline: Megatron's schedule drives the stages) the
    micro-batches have different lengths, so the schedule sends each activation's shape
    first (``variable_seq_lengths``); the loss arrives weighted by the trainer, so the
    schedule must not divide it by the number of micro-batches (Megatron does unless
    ``calculate_per_token_loss``). megatron-core 0.16.1 refuses ``variable_seq_lengths``
    with the allgather token dispatcher, its default even for dense models
    (``transformer_config.py`` ``__post_init__``): alltoall is set for every model."""
    if pp == 1:
        return {}
    return dict(
        variable_seq_lengths=True,
        calculate_per_token_loss=True,
        moe_token_dispatcher_type="alltoall",
    )


def recompute_kwargs(
    arch: Arch, model_cfg: ModelConfig, groups: ParallelGroups, spec: str
) -> dict[str, Any]:
    """``TransformerConfig`` keys for ``model.recompute`` (empty for none). ConfigError names
    the key when the layout cannot take it (Megatron would assert or index out of range)."""
    if model_cfg.recompute == "none":
        return {}
    if model_cfg.recompute == "selective":
        mods = list(model_cfg.recompute_modules)
        if "moe_act" in mods and not (spec == "te" and model_cfg.moe_grouped_gemm):
            raise ConfigError(
                "config key 'model.recompute_modules': moe_act needs TE grouped experts "
                "(model.spec=te, model.moe_grouped_gemm=true)"
            )
        return dict(recompute_granularity="selective", recompute_modules=mods)
    per_stage = groups.layer_span(arch.num_layers)[1]
    k = model_cfg.recompute_num_layers
    if model_cfg.recompute_method == "uniform" and per_stage % k:
        raise ConfigError(
            f"config key 'model.recompute_num_layers': {k} does not divide the {per_stage} "
            "layers of a pipeline stage (recompute_method=uniform)"
        )
    if model_cfg.recompute_method == "block" and k > per_stage:
        raise ConfigError(
            f"config key 'model.recompute_num_layers': {k} > the {per_stage} layers of a "
            "pipeline stage (recompute_method=block)"
        )
    return dict(
        recompute_granularity="full",
        recompute_method=model_cfg.recompute_method,
        recompute_num_layers=k,
        distribute_saved_activations=False,
    )


def _output_requires_grad(module, args, output):
    """Forward hook: make a frozen embedding's output require grad. Megatron's checkpoint is
    re-entrant: a recomputed block whose inputs need no grad returns outputs without a
    graph, so with frozen base weights the LoRA parameters inside would get no gradient."""
    if torch.is_grad_enabled() and isinstance(output, torch.Tensor) and not output.requires_grad:
        return output.detach().requires_grad_(True)  # same storage, now a graph input
    return output


def build_gpt_model(
    arch: Arch, model_cfg: ModelConfig, groups: ParallelGroups, spec: str | None = None
):
    """Build this rank's ``GPTModel`` stage (weights uninitialised: load them after).

    Returns ``(model, spec)``. Build under ``torch.device("meta")`` for sizing only.
    """
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    spec = spec or resolve_spec(model_cfg)
    cfg = transformer_config(arch, model_cfg, groups, spec)
    block_spec = get_gpt_decoder_block_spec(
        cfg, use_transformer_engine=spec == "te", normalization="RMSNorm"
    )
    kwargs = {}
    if groups.pg_collection is not None:
        kwargs["pg_collection"] = groups.pg_collection
    model = GPTModel(
        config=cfg,
        transformer_layer_spec=cast(Any, block_spec),  # a block spec is accepted too
        vocab_size=arch.vocab_size,
        max_sequence_length=max(model_cfg.max_seq_len, 1),
        pre_process=groups.is_first_stage,
        post_process=groups.is_last_stage,
        parallel_output=True,
        share_embeddings_and_output_weights=arch.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_base=int(arch.rope_theta),
        **kwargs,
    )
    if arch.rope_theta != int(arch.rope_theta):
        raise ConfigError(f"config key 'rope_theta': {arch.rope_theta} is not an integer")
    if model_cfg.recompute != "none" and groups.is_first_stage:
        model.embedding.register_forward_hook(_output_requires_grad)
    log.debug("built GPTModel stage %d/%d spec=%s", groups.pp_rank, groups.pp_size, spec)
    return model, spec
