"""LoRA for Megatron's parallel linears (local and Transformer Engine, incl. grouped experts).

``y = base(x) + (alpha / r) * B @ A @ dropout(x)`` with B zero-initialised. The adapter reuses
the wrapped layer's TP group, ``is_expert`` and sequence-parallel flags:

* column-parallel (linear_qkv, linear_fc1): A [r, in] replicated, B [out/tp, r] sharded.
  Under SP the adapter gathers the sequence itself (its backward only *splits*, since the
  ``h`` all-reduce below already makes dX complete), ``h = x A^T`` is all-reduced in
  backward, so A's gradient is complete and equal on every TP rank.
* row-parallel (linear_proj, linear_fc2): A [r, in/tp] sharded, B [out, r] replicated;
  ``h`` is all-reduced (or reduce-scattered over the sequence under SP) in forward. Under SP,
  B's gradient is a partial sum over sequence chunks: B is marked ``sequence_parallel`` and
  :func:`lora_grad_sync` sums it over TP, as Megatron does for SP layer norms.
* experts (``explicit_expert_comm``: the dispatcher owns the communication): plain matmuls;
  with expert-TP > 1 the replicated factor's gradient is partial and is summed over ETP.

Adapter parameters carry ``lora_expert`` so gradients are reduced over expert-DP for experts
and over DP for the rest (:func:`lora_grad_sync`).

Memory: the adapter keeps its input for backward in the *activation* dtype (bf16 on GPU; the
same storage the base layer already holds unless SP gathers or dropout copies it) and computes
``x A^T`` in fp32 (:class:`_InputProjection`); only the r-wide ``h`` is kept in fp32.
"""

from __future__ import annotations

import hashlib
import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


def _seeded_generator(seed: int, key: str) -> torch.Generator:
    digest = hashlib.sha256(f"{seed}:{key}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))


def kaiming_a(rank: int, in_features: int, gen: torch.Generator) -> torch.Tensor:
    """PEFT's A init (kaiming-uniform, a=sqrt(5)) for the *global* [r, in] matrix."""
    bound = 1.0 / math.sqrt(in_features)  # = gain*sqrt(3/fan_in) with a=sqrt(5)
    return (torch.rand(rank, in_features, generator=gen) * 2 - 1) * bound


def set_flags(obj: torch.Tensor | nn.Module, **flags: bool) -> None:
    """Set plain attributes (Megatron-style parameter flags, TE module switches) on ``obj``."""
    for key, value in flags.items():
        setattr(obj, key, value)


class _InputProjection(torch.autograd.Function):
    """``h = x A^T`` in A's dtype (fp32) that saves ``x`` in its own dtype for backward.

    Plain ``F.linear(x.to(fp32), A)`` would keep an fp32 copy of every adapter input until
    backward (~34 GB per 5,120-token micro-batch at 235B); here the copy is transient, made
    again in backward for ``dA``. Same arithmetic as the plain form.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, a)
        return F.linear(x.to(a.dtype), a)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        (dh,) = grads
        x, a = ctx.saved_tensors
        dx = da = None
        if ctx.needs_input_grad[0]:
            dx = torch.matmul(dh, a).to(x.dtype)
        if ctx.needs_input_grad[1]:
            flat = x.reshape(-1, x.shape[-1]).to(a.dtype)
            da = dh.reshape(-1, dh.shape[-1]).t() @ flat
        return dx, da


class LoraAdapter(nn.Module):
    """One adapter on one Megatron linear (or, with ``num_experts``, a grouped-expert linear).

    ``kind``: "column" or "row". ``in_local``/``out_local``: the base layer's local shard
    sizes. ``global_keys`` (layout-independent names, one per expert when grouped) seed A,
    so every layout starts from the same adapter.
    """

    def __init__(
        self,
        kind: str,
        in_local: int,
        out_local: int,
        rank: int,
        alpha: float,
        dropout: float,
        tp_group,
        tp_size: int,
        tp_rank: int,
        sequence_parallel: bool,
        explicit_expert_comm: bool,
        is_expert: bool,
        global_keys: list[str],
        seed: int,
        num_experts: int = 0,
    ):
        super().__init__()
        self.kind, self.rank, self.scaling = kind, rank, alpha / rank
        self.tp_group, self.tp_size = tp_group, tp_size
        self.comm = tp_size > 1 and not explicit_expert_comm
        self.sequence_parallel = sequence_parallel and self.comm
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        in_global = in_local * (tp_size if kind == "row" else 1)
        n = max(num_experts, 1)
        assert len(global_keys) == n, (global_keys, n)
        a = torch.stack(
            [kaiming_a(rank, in_global, _seeded_generator(seed, k)) for k in global_keys]
        )
        if kind == "row":
            a = a[:, :, tp_rank * in_local : (tp_rank + 1) * in_local]
        b = torch.zeros(n, out_local, rank)
        if not num_experts:
            a, b = a[0], b[0]
        self.num_experts = num_experts
        self.lora_A = nn.Parameter(a.contiguous())
        self.lora_B = nn.Parameter(b)
        for p in (self.lora_A, self.lora_B):
            set_flags(p, lora_expert=is_expert)
        replicated = self.lora_A if kind == "column" else self.lora_B
        if kind == "row" and self.sequence_parallel:
            set_flags(self.lora_B, sequence_parallel=True)  # partial over sequence chunks
        if explicit_expert_comm and tp_size > 1:
            set_flags(replicated, lora_etp_partial=True)  # partial over expert-TP: sum over ETP

    def _lowrank(self, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        from megatron.core.tensor_parallel import mappings as mp

        g = self.tp_group
        if self.kind == "column":
            if self.sequence_parallel:
                x = mp.gather_from_sequence_parallel_region(
                    x, tensor_parallel_output_grad=False, group=g
                )
            h = _InputProjection.apply(x, a)
            if self.comm:
                h = mp.copy_to_tensor_model_parallel_region(h, group=g)
        else:
            h = _InputProjection.apply(x, a)
            if self.sequence_parallel:
                h = mp.reduce_scatter_to_sequence_parallel_region(h, group=g)
            elif self.comm:
                h = mp.reduce_from_tensor_model_parallel_region(h, group=g)
        return F.linear(h, b) * self.scaling

    def forward(self, x: torch.Tensor, m_splits: list[int] | None = None) -> torch.Tensor:
        """``x`` [..., in_local] (sequence-sharded under SP) → delta [..., out_local] in
        fp32. ``m_splits``: tokens per local expert (grouped experts only)."""
        x = self.dropout(x)
        if not self.num_experts:
            return self._lowrank(x, self.lora_A, self.lora_B)
        if m_splits is None:
            raise ValueError("grouped-expert adapter called without m_splits")
        chunks = torch.split(x, [int(n) for n in m_splits], dim=0)
        outs = [self._lowrank(c, self.lora_A[e], self.lora_B[e]) for e, c in enumerate(chunks)]
        return torch.cat(outs, dim=0)

    def delta_weight(self) -> torch.Tensor:
        """Local ``scaling * B @ A`` ([out_local, in_local], or [E, out, in] grouped), fp32."""
        return torch.matmul(self.lora_B.float(), self.lora_A.float()) * self.scaling


def attach_lora(module: nn.Module, adapter: LoraAdapter) -> None:
    """Register ``adapter`` as ``module.adapter`` and add its output to ``module``'s.

    Handles Megatron's ``(out, bias)`` return, TE's fused-layernorm column linear and TE
    grouped linears (``forward(x, m_splits)``).

    TE's ``LayerNormLinear`` is asked to return its layernorm output *not gathered*
    (``return_layernorm_output_gathered=False``); the adapter does the sequence-parallel
    gather itself. Since TE commit ce0b46c4d (v2.4 and every later release) the backward adds
    the gradient of the returned layernorm output to dgrad only when it was not gathered
    (``layernorm_linear.py``: ``if ctx.return_layernorm_output and not
    ctx.return_layernorm_output_gathered: dgrad = dgrad + grad_outputs[1]``): with the
    gathered output, dL/dx through ``B A`` never reached the residual stream.

    mcore's wrapper returns ``(out, None)``, or TE's own tuple when it returns the bias
    (``te_return_bias``): then ``(out, bias, ln_out)`` (TE 2.11 ``layernorm_linear.py``
    ``LayerNormLinear.forward``, its ``return_bias`` branch).
    """
    module.adapter = adapter
    orig = module.forward
    if hasattr(module, "return_layernorm_output"):  # TELayerNormColumnParallelLinear
        set_flags(module, return_layernorm_output=True, return_layernorm_output_gathered=False)

    def forward(x, *args, **kwargs):
        res = orig(x, *args, **kwargs)
        inp = x
        if len(res) == 3:  # TE LayerNormLinear that returns its bias: (out, bias, ln output)
            out, bias, inp = res
        else:
            out, bias = res
            if isinstance(out, tuple):  # TE: (output, layernorm output)
                out, inp = out
        m_splits = args[0] if adapter.num_experts and args else kwargs.get("m_splits")
        delta = adapter(inp, m_splits) if adapter.num_experts else adapter(inp)
        return out + delta.to(out.dtype), bias

    module.forward = forward


def lora_grad_sync(params: list[nn.Parameter], groups) -> None:
    """Reduce LoRA gradients like Megatron's DDP + finalize_model_grads.

    1. ``sequence_parallel`` params: sum over TP. 2. ``lora_etp_partial``: sum over ETP.
    3. non-expert: sum over DP; expert: sum over expert-DP; both divided by the DP size, so
    the gradient is that of the mean over DP ranks of their losses.
    """
    for p in params:  # an expert that got no tokens still takes part in the collectives
        if p.grad is None:
            p.grad = torch.zeros_like(p)

    def reduce(ps, group, scale=None):
        if not ps or dist.get_world_size(group) == 1:
            if scale is not None:
                for p in ps:
                    p.grad.mul_(scale)
            return
        flat = torch.cat([p.grad.reshape(-1) for p in ps])
        dist.all_reduce(flat, group=group)
        if scale is not None:
            flat.mul_(scale)
        off = 0
        for p in ps:
            n = p.grad.numel()
            p.grad.copy_(flat[off : off + n].view_as(p.grad))
            off += n

    reduce([p for p in params if getattr(p, "sequence_parallel", False)], groups.tp)
    reduce([p for p in params if getattr(p, "lora_etp_partial", False)], groups.etp)
    scale = 1.0 / groups.dp_size
    reduce([p for p in params if not getattr(p, "lora_expert", False)], groups.dp, scale)
    reduce([p for p in params if getattr(p, "lora_expert", False)], groups.expert_dp, scale)
