"""LoRA on Transformer Engine-shaped modules, on CPU (issue 11, items 8 and 9).

The stand-ins below reproduce what megatron-core's TE wrappers expose, not what the local
spec exposes: ``TEGroupedLinear`` has ``weight0..weight{n-1}`` and ``explicit_expert_comm``
but no ``is_expert``; TE column/row linears used as experts (``moe_grouped_gemm=false``)
have neither (mcore 0.16.1 ``extensions/transformer_engine.py``: ``explicit_expert_comm`` is
a local variable of ``TELinear.__init__``; 0.19.2 the same). ``_TELayerNormLinearFn`` pins
TE's LayerNormLinear backward contract since commit ce0b46c4d (v2.4 → 2.20): the gradient of
the returned layernorm output is added to dgrad only when it was *not* gathered.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from megagrpo.model import lora as lora_mod
from megagrpo.model.arch import arch_from_hf, load_hf_config
from megagrpo.model.config import LoraConfig
from megagrpo.model.lora import LoraAdapter, _seeded_generator, attach_lora, kaiming_a
from megagrpo.model.policy import adapter_sites
from megagrpo.parallel.state import ParallelGroups


def _groups(tp=4, ep=2, etp=1, ep_rank=1, etp_rank=0, tp_rank=3, sp=True) -> ParallelGroups:
    """One rank's coordinates in a layout; the process groups are named sentinels."""
    return ParallelGroups(
        world_size=8,
        rank=7,
        tp="tp",
        pp="pp",
        dp="dp",
        ep="ep",
        etp="etp",
        expert_dp="expert_dp",
        mp="mp",
        expert_mp="expert_mp",
        tp_size=tp,
        tp_rank=tp_rank,
        pp_size=1,
        pp_rank=0,
        dp_size=8 // tp,
        dp_rank=0,
        ep_size=ep,
        ep_rank=ep_rank,
        etp_size=etp,
        etp_rank=etp_rank,
        expert_dp_size=8 // (ep * etp),
        expert_dp_rank=0,
        sequence_parallel=sp,
        device=torch.device("cpu"),
    )


class TEGroupedLinearStandIn(nn.Module):
    """What mcore's ``TEGroupedLinear`` exposes: weight{i}, explicit_expert_comm, no is_expert."""

    def __init__(self, n: int, out_f: int, in_f: int):
        super().__init__()
        for i in range(n):
            self.register_parameter(f"weight{i}", nn.Parameter(torch.zeros(out_f, in_f)))
        self.explicit_expert_comm = True


class TELinearStandIn(nn.Module):
    """A TE column/row linear used as an expert: TE sets tp_group=None, no is_expert."""

    def __init__(self, out_f: int, in_f: int):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(out_f, in_f))
        self.tp_group = None
        self.sequence_parallel = False


class _Layer(nn.Module):
    def __init__(self, arch, g: ParallelGroups, grouped: bool):
        super().__init__()
        h, f, n = arch.hidden_size, arch.moe_ffn_hidden_size, arch.num_experts // g.ep_size
        q = arch.num_heads * arch.head_dim
        kv = arch.num_kv_heads * arch.head_dim
        self.self_attention = nn.Module()
        self.self_attention.linear_qkv = TELinearStandIn((q + 2 * kv) // g.tp_size, h)
        self.self_attention.linear_proj = TELinearStandIn(h, q // g.tp_size)
        self.mlp = nn.Module()
        self.mlp.experts = nn.Module()
        if grouped:
            self.mlp.experts.linear_fc1 = TEGroupedLinearStandIn(n, 2 * f // g.etp_size, h)
            self.mlp.experts.linear_fc2 = TEGroupedLinearStandIn(n, h, f // g.etp_size)
        else:
            self.mlp.experts.local_experts = nn.ModuleList()
            for _ in range(n):
                e = nn.Module()
                e.linear_fc1 = TELinearStandIn(2 * f // g.etp_size, h)
                e.linear_fc2 = TELinearStandIn(h, f // g.etp_size)
                self.mlp.experts.local_experts.append(e)


def _stand_in_model(arch, g: ParallelGroups) -> nn.Module:
    """Layer 0 with TE grouped experts, layer 1 with TE SequentialMLP experts."""
    model = nn.Module()
    model.decoder = nn.Module()
    model.decoder.layers = nn.ModuleList([_Layer(arch, g, True), _Layer(arch, g, False)])
    return model


@pytest.fixture(scope="module")
def arch(repo_root):
    """The 235B architecture with its shapes shrunk (only names, counts and ratios matter)."""
    hf = load_hf_config(repo_root / "configs/qwen3_235b_a22b.hf_config.json")
    hf = dict(hf, hidden_size=64, moe_intermediate_size=24, num_experts=8, head_dim=8)
    return arch_from_hf(hf)


LORA = LoraConfig(
    rank=4, alpha=8.0, targets=["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]
)


@pytest.mark.parametrize("etp", [1, 2])
def test_te_experts_are_detected_from_the_module_path(arch, etp):
    """TP=4, EP=2, ETP=1 or 2 (the 235B layout has ETP=1 != TP=4). Fails before the fix:
    ``is_expert`` was read from the module, so TE experts got the dense TP layout."""
    g = _groups(etp=etp, etp_rank=etp - 1)
    sites = adapter_sites(_stand_in_model(arch, g), arch, LORA, g)
    experts = [s for s in sites if ".mlp.experts." in s.name]
    dense = [s for s in sites if ".self_attention." in s.name]
    n_local = arch.num_experts // g.ep_size
    assert len(experts) == 2 + 2 * n_local and len(dense) == 4
    for site in experts:
        adapter = site.build(LORA, g)
        assert site.is_expert
        assert adapter.tp_group == "etp" and adapter.tp_size == etp
        assert adapter.comm is False and adapter.sequence_parallel is False
        for p in (adapter.lora_A, adapter.lora_B):
            assert getattr(p, "lora_expert", None) is True
        # explicit_expert_comm (EP=2 > 1): with ETP > 1 the replicated factor is partial
        replicated = adapter.lora_A if site.kind == "column" else adapter.lora_B
        assert getattr(replicated, "lora_etp_partial", False) is (etp > 1)
        # init: A is the slice of the expert's *global* A that this ETP rank holds
        first = site.keys[0]
        a_local = adapter.lora_A[0] if site.num_experts else adapter.lora_A
        in_global = site.in_local * (etp if site.kind == "row" else 1)
        a_global = kaiming_a(LORA.rank, in_global, _seeded_generator(LORA.init_seed, first))
        r = g.etp_rank
        want = a_global[:, r * site.in_local : (r + 1) * site.in_local]
        assert torch.equal(a_local, want if site.kind == "row" else a_global)
    for site in dense:
        adapter = site.build(LORA, g)
        assert not site.is_expert and adapter.tp_group == "tp" and adapter.tp_size == 4
        assert adapter.comm and adapter.sequence_parallel
        assert getattr(adapter.lora_A, "lora_expert", None) is False
    # expert keys are global: EP rank 1 holds experts n_local..2*n_local-1
    grouped_fc1 = next(s for s in experts if s.name.endswith("0.mlp.experts.linear_fc1"))
    assert grouped_fc1.keys[0] == f"layers.0.experts.{n_local}.linear_fc1"
    assert grouped_fc1.num_experts == n_local


def test_te_expert_grads_sync_over_expert_dp(arch, monkeypatch):
    """Expert adapters' grads are averaged over expert-DP, dense ones over DP, ETP-partial
    factors summed over ETP first. Fails before the fix (TE experts went to the dense DP
    group, which holds *different* experts)."""
    g = _groups(etp=2, etp_rank=1)
    sites = adapter_sites(_stand_in_model(arch, g), arch, LORA, g)
    adapters = {s.name: s.build(LORA, g) for s in sites}
    params = [p for a in adapters.values() for p in (a.lora_A, a.lora_B)]
    for p in params:
        p.grad = torch.ones_like(p)
    calls: list[tuple[str, int]] = []
    sizes = {"tp": 4, "etp": 2, "dp": 2, "expert_dp": 2}
    monkeypatch.setattr(lora_mod.dist, "get_world_size", lambda group=None: sizes[group])
    monkeypatch.setattr(
        lora_mod.dist, "all_reduce", lambda t, group=None: calls.append((group, t.numel()))
    )
    lora_mod.lora_grad_sync(params, g)
    by_group: dict[str, int] = {}
    for group, n in calls:
        by_group[group] = by_group.get(group, 0) + n

    def numel(pred):
        return sum(p.numel() for p in params if pred(p))

    assert by_group["expert_dp"] == numel(lambda p: getattr(p, "lora_expert", None))
    assert by_group["dp"] == numel(lambda p: not getattr(p, "lora_expert", None))
    assert by_group["etp"] == numel(lambda p: getattr(p, "lora_etp_partial", False))
    assert by_group["tp"] == numel(lambda p: getattr(p, "sequence_parallel", False))
    assert by_group["etp"] > 0 and by_group["tp"] > 0


# ---------------------------------------------------------------- item 9: TE LayerNormLinear


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


class _TELayerNormLinearFn(torch.autograd.Function):
    """TE ``_LayerNormLinear`` at world 1, reduced to its gradient contract (v2.4 → 2.20,
    ``layernorm_linear.py``: "Residual gradient": ``if ctx.return_layernorm_output and not
    ctx.return_layernorm_output_gathered: dgrad = dgrad + grad_outputs[1]``)."""

    @staticmethod
    def forward(ctx, x, ln_w, w, ret, gathered):
        ctx.save_for_backward(x, ln_w, w)
        ctx.ret, ctx.gathered = ret, gathered
        ln = _rms(x, ln_w)
        out = ln @ w.t()
        return (out, ln.clone()) if ret else out

    @staticmethod
    def backward(ctx, *grads):
        x, ln_w, w = ctx.saved_tensors
        dgrad = grads[0] @ w
        if ctx.ret and not ctx.gathered:
            dgrad = dgrad + grads[1]
        with torch.enable_grad():
            xx = x.detach().requires_grad_()
            (dx,) = torch.autograd.grad(_rms(xx, ln_w), xx, dgrad)
        return dx, None, None, None, None


class TELayerNormColumnStandIn(nn.Module):
    """mcore's ``TELayerNormColumnParallelLinear`` at TP=1: returns ``((out, ln_out), None)``
    when ``return_layernorm_output`` is set, reads both flags at forward time."""

    def __init__(self, h: int, out_f: int, gen: torch.Generator):
        super().__init__()
        self.layer_norm_weight = nn.Parameter(1 + 0.1 * torch.randn(h, generator=gen))
        self.weight = nn.Parameter(torch.randn(out_f, h, generator=gen) / h**0.5)
        self.return_layernorm_output = False
        self.return_layernorm_output_gathered = False

    def forward(self, x):
        out = _TELayerNormLinearFn.apply(
            x,
            self.layer_norm_weight,
            self.weight,
            self.return_layernorm_output,
            self.return_layernorm_output_gathered,
        )
        return out, None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_qkv_adapter_gradient_reaches_the_residual_stream(dtype):
    """dL/dx through a TE fused-layernorm linear with LoRA (B != 0) equals plain autograd of
    ``rms(x) W^T + s B A rms(x)``. Fails before the fix (the adapter asked TE for the gathered
    output, whose gradient TE >= 2.4 drops): dx then misses the whole ``s B A`` branch."""
    gen = torch.Generator().manual_seed(0)
    h, out_f, r = 32, 48, 4
    mod = TELayerNormColumnStandIn(h, out_f, gen).to(dtype)
    adapter = LoraAdapter(
        "column", h, out_f, r, 8.0, 0.0, None, 1, 0, False, False, False, ["qkv"], seed=0
    )
    with torch.no_grad():
        adapter.lora_B.copy_(torch.randn(out_f, r, generator=gen) * 0.5)
    attach_lora(mod, adapter)
    assert mod.return_layernorm_output is True
    assert mod.return_layernorm_output_gathered is False
    x = torch.randn(5, 2, h, generator=gen).to(dtype).requires_grad_()
    gy = torch.randn(5, 2, out_f, generator=gen)
    out, bias = mod(x)
    (out.float() * gy).sum().backward()
    # reference: the same math with plain autograd, in fp32
    xr = x.detach().float().requires_grad_()
    ln = _rms(xr, mod.layer_norm_weight.detach().float())
    a, b = adapter.lora_A.detach(), adapter.lora_B.detach()
    ref = ln @ mod.weight.detach().float().t() + adapter.scaling * F.linear(F.linear(ln, a), b)
    (ref * gy).sum().backward()
    assert xr.grad is not None and x.grad is not None
    lora_part = xr.grad.norm()  # the adapter branch is a large part of dx here
    err = (x.grad.float() - xr.grad).norm() / lora_part
    # fp32: summation order only (~1e-6); bf16: inputs and dx rounded to 8 bits (~1e-2)
    assert err < (1e-5 if dtype == torch.float32 else 3e-2), err
    assert bias is None


# ------------------------------------------------- issue 39 item 3: TE path read by fresh eyes


class TELayerNormColumnWithBiasStandIn(TELayerNormColumnStandIn):
    """mcore's wrapper when ``te_return_bias`` (``skip_bias_add and bias``): it returns TE's
    own tuple, which with ``return_layernorm_output`` is ``(out, bias, ln_out)`` (TE 2.11
    ``layernorm_linear.py`` ``LayerNormLinear.forward``, the ``return_bias`` branch)."""

    def __init__(self, h: int, out_f: int, gen: torch.Generator):
        super().__init__(h, out_f, gen)
        self.bias = nn.Parameter(torch.randn(out_f, generator=gen))

    def forward(self, x):
        out, _ = super().forward(x)
        if self.return_layernorm_output:
            out, ln = out
            return out, self.bias, ln
        return out, self.bias


def test_lora_on_a_te_layernorm_linear_that_returns_its_bias():
    """Fails before the fix: the wrapper unpacked two values from TE's three."""
    gen = torch.Generator().manual_seed(3)
    h, out_f, r = 16, 24, 4
    mod = TELayerNormColumnWithBiasStandIn(h, out_f, gen)
    adapter = LoraAdapter(
        "column", h, out_f, r, 8.0, 0.0, None, 1, 0, False, False, False, ["qkv"], seed=0
    )
    with torch.no_grad():
        adapter.lora_B.copy_(torch.randn(out_f, r, generator=gen))
    attach_lora(mod, adapter)
    x = torch.randn(3, 2, h, generator=gen)
    out, bias = mod(x)
    ln = _rms(x, mod.layer_norm_weight.detach())
    a, b = adapter.lora_A.detach(), adapter.lora_B.detach()
    ref = ln @ mod.weight.detach().t() + adapter.scaling * F.linear(F.linear(ln, a), b)
    assert bias is mod.bias
    assert torch.allclose(out, ref, rtol=1e-5, atol=1e-5)  # fp32, summation order only


def test_te_spec_refuses_a_padding_mask_it_would_ignore():
    """TE's causal attention ignores ``attention_mask`` (megatron-core passes
    attn_mask_type=causal; TE 2.11 reads the mask only for padding/arbitrary types): left
    padding raises on the TE spec, right padding (harmless under a causal mask) drops the
    mask, and the local spec keeps building it. Fails before the fix (the mask was handed
    to TE and silently ignored)."""
    from types import SimpleNamespace
    from typing import Any

    from megagrpo.model.model_inputs import model_inputs

    g: Any = SimpleNamespace(tp_size=1, sequence_parallel=False, device=torch.device("cpu"))
    ids = torch.arange(8).view(2, 4)
    left = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]])
    right = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
    with pytest.raises(ValueError, match="Transformer Engine spec"):
        model_inputs(g, "te", ids, attention_mask=left)
    assert model_inputs(g, "te", ids, attention_mask=right).attention_mask is None
    mask = model_inputs(g, "local", ids, attention_mask=left).attention_mask
    assert mask is not None and bool(mask[0, 0, 3, 0]) and not bool(mask[1, 0, 3, 0])


def test_spec_te_without_transformer_engine_names_what_is_missing(monkeypatch):
    """``model.spec: te`` on a CUDA machine without transformer_engine: a ConfigError naming
    the key before any module is built. Before the fix it returned ``te`` and megatron's TE
    import failed deep inside the build."""
    import importlib.util

    from megagrpo.errors import ConfigError
    from megagrpo.model.config import ModelConfig
    from megagrpo.model.provider import resolve_spec

    real = importlib.util.find_spec
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "transformer_engine" else real(name, *a),
    )
    with pytest.raises(ConfigError, match="model.spec.*transformer_engine"):
        resolve_spec(ModelConfig(spec="te"))
    assert resolve_spec(ModelConfig(spec="auto")) == "local"


def test_megatron_checkpoints_record_the_layer_spec(tmp_path):
    """Shard names depend on the spec (TE: ``linear_qkv.layer_norm_weight``, grouped
    ``weight{j}``): the checkpoint records it and export rebuilds that spec. Before the fix
    export built ``auto`` (TE on a GPU node) and failed on shards a CPU import wrote."""
    from megagrpo.model.megatron_ckpt import model_config_of, read_meta, write_meta

    layout = {"tp": 1, "ep": 1, "etp": 1, "pp": 1}
    write_meta(tmp_path, layout, 1, "bfloat16", LORA, True, spec="te", moe_grouped_gemm=False)
    cfg = model_config_of(read_meta(tmp_path), "hf")
    assert (cfg.spec, cfg.moe_grouped_gemm, cfg.dtype) == ("te", False, "bfloat16")
    assert cfg.lora.targets == LORA.targets
    old = read_meta(tmp_path)
    del old["spec"], old["moe_grouped_gemm"]  # written before the spec was recorded
    assert model_config_of(old, "hf").spec == "auto"


def test_export_refuses_a_base_checkpoint_of_another_spec(tmp_path):
    """LoRA shards written under the TE spec on top of base shards of the local spec (or the
    reverse) name different Megatron tensors: export says so before building anything."""
    from megagrpo.errors import CheckpointError
    from megagrpo.model.megatron_ckpt import export_worker, read_meta, write_meta

    layout = {"tp": 1, "ep": 1, "etp": 1, "pp": 1}
    base, lora = tmp_path / "base", tmp_path / "lora"
    base.mkdir(), lora.mkdir()
    write_meta(base, layout, 1, "float32", LORA, False, spec="local")
    write_meta(lora, layout, 1, "float32", LORA, True, base=str(base), spec="te")
    job = {"ckpt": str(lora), "tmp": str(tmp_path / "out"), "meta": read_meta(lora)}
    with pytest.raises(CheckpointError, match="model.spec=te.*another spec"):
        export_worker(0, dict(job, mode="merged", bucket_bytes=1 << 20))
