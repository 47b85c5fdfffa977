"""Compatibility-gate checks of the Transformer Engine training path (megatron-core 0.16.1's
TE spec, TE 2.11) that the CPU suite cannot run: megagrpo.gate.compat turns them into
unverified rules (allowed with a warning naming the GPU test that would confirm them).

``model.spec: auto`` resolves to ``te`` on a CUDA machine with Transformer Engine (the
cluster): it counts as the TE spec where ``transformer_engine`` is installed (found, not
imported), so the gate's second run at train start, on the training node, sees it.
"""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from megagrpo.gate.facts import Facts

MOE_ACT_UPSTREAM = (
    "megatron/core/transformer/moe/experts.py TEGroupedMLP.forward "
    "(activation_checkpoint.checkpoint(bias_act_func, ...), then "
    "discard_output_and_register_recompute(output of linear_fc2)); "
    "megatron/core/tensor_parallel/random.py CheckpointWithoutOutput "
    "(untyped_storage().resize_(0), refilled by a grad hook)"
)
MOE_ACT_GPU_TEST = "tests/gpu/test_te_lora_recompute.py::test_moe_act_recompute_keeps_lora_grads"
PACKED_UPSTREAM = (
    "megatron/core/extensions/transformer_engine.py TEDotProductAttention.forward "
    "(qkv_format thd: causal -> padding_causal, cu_seqlens from PackedSeqParams); "
    "transformer_engine/pytorch/attention/dot_product_attention/dot_product_attention.py "
    "DotProductAttention.forward (thd: int32 cu_seqlens [n + 1])"
)
SHARED_PREFIX_UPSTREAM = (
    "transformer_engine/pytorch/attention/dot_product_attention/utils.py "
    "get_attention_backend (thd + padding_causal_bottom_right: every backend without "
    "context parallelism); transformer_engine/common/fused_attn/fused_attn.cpp "
    "nvte_get_fused_attn_backend (cuDNN >= 9.6: thd + padding_causal_bottom_right, "
    "max_seqlen_q <= max_seqlen_kv, dropout 0; sm90 for thd)"
)
SHARED_PREFIX_GPU_TEST = "tests/gpu/test_shared_prefix_gpu.py::test_te_route_matches_rows"
PACKED_GPU_TEST = "tests/gpu/test_packing_te.py::test_te_packed_lora_grads_equal_unpacked"


def te_spec(f: Facts) -> bool:
    """The run builds the TE spec (``te``, or ``auto`` where Transformer Engine is installed)."""
    spec = f.cfg.model.spec
    return spec == "te" or (
        spec == "auto" and importlib.util.find_spec("transformer_engine") is not None
    )


def moe_act_expert_lora(f: Facts) -> str | None:
    """LoRA on the experts' linear_fc2 with ``moe_act`` recompute (TE grouped experts only)."""
    m = f.cfg.model
    if not (te_spec(f) and f.moe and m.moe_grouped_gemm and m.recompute == "selective"):
        return None
    fc2 = {"linear_fc2", "expert_linear_fc2"} & set(m.lora.targets)
    if "moe_act" not in m.recompute_modules or not fc2:
        return None
    return (
        "recomputing moe_act frees the expert activation that the expert linear_fc2 LoRA "
        "adapter keeps for its backward; megatron-core refills it from a hook on linear_fc2's "
        "output (megagrpo's wrapped output) before either backward reads it: read in "
        "megatron-core 0.16.1, not yet run on a GPU"
    )


def packed_lora(f: Facts) -> str | None:
    """Packed micro-batches (THD attention) on the TE spec."""
    if not (te_spec(f) and f.cfg.trainer.pack_tokens > 0):
        return None
    return (
        "packed rows on the TE spec run TE's THD attention (PackedSeqParams, cu_seqlens, "
        "RoPE restarted per sample); no GPU has computed LoRA gradients through it yet"
    )


def shared_prefix_thd(f: Facts) -> str | None:
    """``trainer.shared_prefix: true`` on the TE spec (THD with separate q / kv lengths)."""
    m, t = f.cfg.model, f.cfg.trainer
    if t.shared_prefix != "true" or m.spec == "local":
        return None
    return (
        "shared prefix on the TE spec: THD varlen attention with cu_seqlens_q != "
        "cu_seqlens_kv and padding_causal_bottom_right (FusedAttention needs sm90 + cuDNN >= "
        "9.6, or FlashAttention 2/3; no context parallelism, attention dropout 0, vanilla "
        "softmax, no sliding window); follows TE 2.11's source, not yet run on a GPU"
    )
