"""HF ⇄ Megatron placement plans for both specs, checked without Megatron or processes.

For every rank of a layout: owner pieces of all ranks tile each HF tensor exactly once, and
each rank's pieces tile its Megatron tensors (whose names and shapes are written out here by
hand from Megatron's local and Transformer Engine specs)."""

from __future__ import annotations

import itertools

import pytest
import torch

from megagrpo.model.arch import arch_from_hf, load_hf_config
from megagrpo.model.hf_mapping import build_plan, hf_weight_shapes
from megagrpo.parallel.state import ParallelGroups


def fake_groups(tp=1, ep=1, pp=1, tp_rank=0, ep_rank=0, pp_rank=0) -> ParallelGroups:
    return ParallelGroups(
        world_size=tp * pp * max(ep, 1),
        rank=0,
        tp=None,
        pp=None,
        dp=None,
        ep=None,
        etp=None,
        expert_dp=None,
        mp=None,
        expert_mp=None,
        tp_size=tp,
        tp_rank=tp_rank,
        pp_size=pp,
        pp_rank=pp_rank,
        dp_size=1,
        dp_rank=0,
        ep_size=ep,
        ep_rank=ep_rank,
        etp_size=1,
        etp_rank=0,
        expert_dp_size=1,
        expert_dp_rank=0,
        sequence_parallel=tp > 1,
        device=torch.device("cpu"),
    )


def megatron_shapes(a, tp, ep, pp, spec, grouped):
    """Expected Megatron tensors of one rank (names per spec, local shapes)."""
    h, hd = a.hidden_size, a.head_dim
    qkv = (a.num_heads + 2 * a.num_kv_heads) * hd // tp
    out = {}
    for layer in range(a.num_layers // pp):
        m = f"decoder.layers.{layer}."
        out[
            m
            + (
                "self_attention.linear_qkv.layer_norm_weight"
                if spec == "te"
                else "input_layernorm.weight"
            )
        ] = (h,)
        out[m + "self_attention.linear_qkv.weight"] = (qkv, h)
        out[m + "self_attention.linear_proj.weight"] = (h, a.num_heads * hd // tp)
        out[m + "self_attention.q_layernorm.weight"] = (hd,)
        out[m + "self_attention.k_layernorm.weight"] = (hd,)
        out[m + "pre_mlp_layernorm.weight"] = (h,)
        out[m + "mlp.router.weight"] = (a.num_experts, h)
        f = a.moe_ffn_hidden_size
        for j in range(a.num_experts // ep):
            if grouped:
                fc1, fc2 = f"mlp.experts.linear_fc1.weight{j}", f"mlp.experts.linear_fc2.weight{j}"
            else:
                fc1 = f"mlp.experts.local_experts.{j}.linear_fc1.weight"
                fc2 = f"mlp.experts.local_experts.{j}.linear_fc2.weight"
            out[m + fc1], out[m + fc2] = (2 * f, h), (h, f)
    return out


@pytest.mark.parametrize("spec,grouped", [("local", False), ("te", True), ("te", False)])
@pytest.mark.parametrize("tp,ep,pp", [(1, 1, 1), (2, 1, 1), (1, 2, 1), (2, 2, 2)])
def test_plans_tile_hf_and_megatron_tensors(tiny_moe_dir, spec, grouped, tp, ep, pp):
    a = arch_from_hf(load_hf_config(tiny_moe_dir))
    hf = {k: torch.zeros(s, dtype=torch.int32) for k, s in hf_weight_shapes(a).items()}
    for tr, er, pr in itertools.product(range(tp), range(ep), range(pp)):
        g = fake_groups(tp, ep, pp, tr, er, pr)
        plan = build_plan(a, g, spec, grouped)
        shapes = megatron_shapes(a, tp, ep, pp, spec, grouped)
        if pr == 0:
            shapes["embedding.word_embeddings.weight"] = (a.vocab_size // tp, a.hidden_size)
        if pr == pp - 1:
            shapes["decoder.final_layernorm.weight"] = (a.hidden_size,)
            shapes["output_layer.weight"] = (a.vocab_size // tp, a.hidden_size)
        mega = {k: torch.zeros(s, dtype=torch.int32) for k, s in shapes.items()}
        for name, pieces in plan.items():
            for p in pieces:
                mega[p.param][p.dst] += 1
                # one full copy: non-expert tensors over TP x PP (at any EP rank), expert
                # tensors over EP x PP (at any TP rank: expert-TP is 1 here)
                copy = er == 0 if ".mlp.experts." not in name else tr == 0
                if p.owner and copy:
                    hf[name][p.src] += 1
        for k, t in mega.items():
            # replicated params (norms, router) appear once per rank; everything tiled once
            assert torch.all(t == 1), k
    for k, t in hf.items():
        assert torch.all(t == 1), k
