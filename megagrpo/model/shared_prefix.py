"""Shared-prefix rows: a GRPO group's prompt computed once, its completions after it.

A *segment row* is one micro-batch row ``[1, T]`` cut into segments (:class:`Segments`).
A segment may *continue* an earlier segment of the row (its ``parent``): the group
``[prompt | c_1 | ... | c_G]`` is a prompt segment and G completion segments whose parent is
the prompt. Token ``q`` of segment ``s`` attends to key ``k`` iff ``k`` is in ``parent(s)``
or ``k`` is in ``s`` and ``k <= q``: each completion sees the whole prompt and itself,
causally, never another completion. Its RoPE positions continue from the prompt's end
(completion token ``i`` sits at position ``P + i``, as in its own row ``prompt + c_j``).
A segment without a parent is an ordinary packed sample, so today's block-diagonal packing
is the special case with no parents. The prompt runs through attention, MLP and experts
once; the gradient reaching it is the sum over its completions by autograd.

Two routes through megatron-core 0.16.1's ``GPTModel`` (both exact; tested against the
unshared rows in tests/unit/test_shared_prefix_model.py and
tests/distributed/test_shared_prefix_layouts.py). Both give every token its own RoPE
position through :func:`rope_positions`: the rotary table ``GPTModel._preprocess`` builds
(``RotaryEmbedding.forward``: rows 0..T-1) is gathered at each token's position by a forward
hook; the table is built once per forward and handed to every layer as an argument, so
activation recompute and pipeline schedules see the same one.

* THD (``MegatronPolicy.prefix_route = "thd"``, the default on both specs): the model gets
  :func:`shared_params` as its ``packed_seq_params`` (``qkv_format="sbhd"``: megatron treats
  the row as an ordinary ``[T, 1]`` sequence, rotary included), and
  :func:`install_thd_attention` routes every layer's core attention through
  :func:`segment_attention`: queries are the row's tokens in THD (one sequence per segment,
  ``cu_seqlens_q``), keys/values are gathered per segment as ``[parent; own]``
  (``cu_seqlens_kv``), and the kernel applies a causal mask aligned to the bottom right, so a
  completion's query ``i`` sees the ``P`` prompt keys and its own keys ``0..i``; a segment
  without a parent (``len_q == len_kv``) is plain causal. On the TE spec the kernel is
  Transformer Engine 2.11's ``DotProductAttention.forward`` with ``qkv_format="thd"`` and
  ``attn_mask_type="padding_causal_bottom_right"`` (:func:`te_attend`); on the local spec
  torch's ``scaled_dot_product_attention`` over two padded batches (:func:`torch_attend`).
  This is PrefixGrouper's "prefix self-attention + suffix concat-attention" (verl
  ``verl/trainer/ppo/prefix_grouper_utils.py``, johncaged/PrefixGrouper ``forward.py``) in
  one varlen call; the gathered keys/values are copies of ``K``/``V`` only (no extra layer
  compute), and their gradient flows back to the prompt's ``K``/``V`` by autograd.
* mask (``prefix_route = "mask"``, local spec): :meth:`Segments.mask` is the ``[1, 1, T, T]``
  boolean mask megatron's ``DotProductAttention`` applies (True = masked; it fills -10000,
  which underflows to an exact 0 after the softmax's max subtraction): the direct
  generalisation of the packed rows' block-diagonal mask. It computes every query of the row
  against every key (T^2 per row: with long completions more attention than the rows),
  so it is a check of the THD route by megatron's own attention, not the default.
  :func:`reference_attend` is the THD route with a dense torch kernel, the tests' stand-in
  for TE's.
"""

from __future__ import annotations

import contextlib
import math
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

Tensor = torch.Tensor


@dataclass(frozen=True)
class Segments:
    """The segments of a row: ``cu`` ``[n + 1]`` (segment ``s`` = row positions
    ``cu[s]:cu[s+1]``, the real tokens; what follows ``cu[-1]`` is padding) and ``parent``
    (per segment, the index of the earlier segment it continues, -1 for none; a parent
    continues nothing itself)."""

    cu: tuple[int, ...]
    parent: tuple[int, ...]

    def __post_init__(self) -> None:
        cu, parent = self.cu, self.parent
        if len(cu) < 2 or cu[0] != 0 or any(b < a for a, b in zip(cu, cu[1:])):
            raise ValueError(f"segment bounds must rise from 0: {list(cu)[:8]}")
        if len(parent) != len(cu) - 1:
            raise ValueError(f"{len(cu) - 1} segments but {len(parent)} parents")
        for s, p in enumerate(parent):
            if p >= s or (p >= 0 and parent[p] != -1):
                raise ValueError(f"segment {s}: parent {p} must be an earlier root segment")

    @property
    def shared(self) -> bool:
        """Some segment continues another."""
        return any(p >= 0 for p in self.parent)

    @property
    def total(self) -> int:
        return self.cu[-1]

    def length(self, s: int) -> int:
        return self.cu[s + 1] - self.cu[s]

    def padded(self, total: int) -> Segments:
        """The same with the tail ``cu[-1]:total`` (unused tokens, sequence-parallel padding)
        a root segment of its own."""
        if total < self.total:
            raise ValueError(f"row of {total} tokens holds segments up to {self.total}")
        if total == self.total:
            return self
        return Segments((*self.cu, total), (*self.parent, -1))

    def segment_ids(self, device=None) -> Tensor:
        """Segment index ``[cu[-1]]`` of every token."""
        lens = torch.tensor([self.length(s) for s in range(len(self.parent))], device=device)
        return torch.repeat_interleave(torch.arange(len(self.parent), device=device), lens)

    def positions(self, device=None) -> Tensor:
        """RoPE position ``[cu[-1]]`` of every token: ``i`` for token ``i`` of a root segment,
        ``len(parent) + i`` in a segment that continues one."""
        out = []
        for s, p in enumerate(self.parent):
            start = 0 if p < 0 else self.length(p)
            out.append(torch.arange(start, start + self.length(s), device=device))
        return torch.cat(out) if out else torch.zeros(0, dtype=torch.long, device=device)

    def mask(self, device=None) -> Tensor:
        """Megatron's boolean attention mask ``[1, 1, T, T]`` (True = masked): query ``q``
        sees key ``k`` iff they share a segment and ``k <= q``, or ``k`` is in the parent of
        ``q``'s segment. With no parents: today's block-diagonal packed mask."""
        seg = self.segment_ids(device)
        par = torch.tensor(self.parent, device=device)[seg]
        t = seg.numel()
        idx = torch.arange(t, device=device)
        own = (seg[:, None] == seg[None, :]) & (idx[None, :] <= idx[:, None])
        see = own | (par[:, None] == seg[None, :])
        return ~see[None, None]

    def thd(self, device=None) -> ThdIndex:
        """The THD form of the row (module doc): queries in row order, one sequence per
        segment; keys/values gathered per segment as ``[parent; own]``."""
        kv, cu_kv = [], [0]
        for s, p in enumerate(self.parent):
            if p >= 0:
                kv.append(torch.arange(self.cu[p], self.cu[p + 1]))
            kv.append(torch.arange(self.cu[s], self.cu[s + 1]))
            cu_kv.append(cu_kv[-1] + self.length(s) + (self.length(p) if p >= 0 else 0))
        lens_q = [self.length(s) for s in range(len(self.parent))]
        lens_kv = [b - a for a, b in zip(cu_kv, cu_kv[1:])]
        return ThdIndex(
            kv_index=torch.cat(kv).to(device) if kv else torch.zeros(0, dtype=torch.long),
            cu_q=torch.tensor(self.cu, dtype=torch.int32, device=device),
            cu_kv=torch.tensor(cu_kv, dtype=torch.int32, device=device),
            max_q=max(lens_q, default=0),
            max_kv=max(lens_kv, default=0),
        )


@dataclass
class ThdIndex:
    """What the THD route needs per row: ``kv_index`` ``[T_kv]`` (row position of every
    gathered key/value), ``cu_q`` / ``cu_kv`` ``[n + 1]`` int32 and the longest sequences."""

    kv_index: Tensor
    cu_q: Tensor
    cu_kv: Tensor
    max_q: int
    max_kv: int
    _buckets: list[Bucket] | None = field(default=None, repr=False, compare=False)

    def buckets(self, device) -> list[Bucket]:
        """The sequences padded into two batches for :func:`torch_attend`: those that
        continue nothing (``len_q == len_kv``: prompts, plain samples, padding) and those
        that continue a parent; built once per row (every layer reuses them)."""
        if self._buckets is None:
            self._buckets = _buckets(self.cu_q.tolist(), self.cu_kv.tolist(), device)
        return self._buckets


@dataclass(frozen=True)
class Bucket:
    """Sequences of a THD row padded to ``[n, L_q]`` queries and ``[n, L_kv]`` keys:
    ``q_index`` / ``kv_index`` (the pad index is the THD length: a zero row appended),
    ``allowed`` ``[n, 1, L_q, L_kv]`` (bottom-right causal within each sequence; a padding
    query sees key 0 only, its output discarded) and ``valid`` ``[n, L_q]``."""

    q_index: Tensor
    kv_index: Tensor
    allowed: Tensor
    valid: Tensor


def _buckets(cu_q: list[int], cu_kv: list[int], device) -> list[Bucket]:
    seqs: dict[bool, list[tuple[int, int, int, int]]] = {True: [], False: []}
    for i in range(len(cu_q) - 1):
        lq, lkv = cu_q[i + 1] - cu_q[i], cu_kv[i + 1] - cu_kv[i]
        if lq:
            seqs[lq == lkv].append((cu_q[i], lq, cu_kv[i], lkv))
    out = []
    for group in seqs.values():
        if not group:
            continue
        lq_max = max(g[1] for g in group)
        lkv_max = max(g[3] for g in group)
        jq = torch.arange(lq_max, device=device)
        jk = torch.arange(lkv_max, device=device)
        q0, lq, k0, lkv = (torch.tensor(c, device=device)[:, None] for c in zip(*group))
        valid = jq[None, :] < lq
        qi = torch.where(valid, q0 + jq, cu_q[-1])
        ki = torch.where(jk[None, :] < lkv, k0 + jk, cu_kv[-1])
        see = (jk[None, None, :] <= (jq[None, :, None] + (lkv - lq)[:, :, None])) & (
            jk[None, None, :] < lkv[:, :, None]
        )
        see = torch.where(valid[:, :, None], see, jk[None, None, :] == 0)
        out.append(Bucket(qi, ki, see[:, None], valid))
    return out


def shared_params(segments: Segments, total: int, device=None) -> Any:
    """megatron-core's ``PackedSeqParams`` for a segment row of ``total`` (padded) tokens on
    the THD route: ``qkv_format="sbhd"`` (megatron handles the row as one ``[T, 1]``
    sequence: RoPE from the ``T``-row table, ``max_seqlen_*`` = T for
    ``RotaryEmbedding.get_rotary_seq_len``), carrying the :class:`ThdIndex` for
    :func:`segment_attention`."""
    from megatron.core.packed_seq_params import PackedSeqParams

    params = PackedSeqParams(qkv_format="sbhd", max_seqlen_q=total, max_seqlen_kv=total)
    params.segment_thd = segments.padded(total).thd(device)  # type: ignore[attr-defined]
    return params


def reference_attend(module: nn.Module, q: Tensor, k: Tensor, v: Tensor, idx: ThdIndex) -> Tensor:
    """Varlen attention ``[T_q, h, d]`` with a bottom-right causal mask per sequence, in
    torch (fp32 softmax): what TE's ``padding_causal_bottom_right`` computes; the THD route's
    stand-in on CPU. ``k``/``v`` ``[T_kv, h_kv, d]`` (grouped-query heads repeated)."""
    scale = getattr(module, "softmax_scale", None) or 1.0 / math.sqrt(q.shape[-1])
    rep = q.shape[1] // k.shape[1]
    if rep > 1:
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    dev = q.device
    cu_q, cu_kv = idx.cu_q.long().to(dev), idx.cu_kv.long().to(dev)
    seq_q = torch.searchsorted(cu_q[1:], torch.arange(q.shape[0], device=dev), right=True)
    seq_k = torch.searchsorted(cu_kv[1:], torch.arange(k.shape[0], device=dev), right=True)
    pos_q = torch.arange(q.shape[0], device=dev) - cu_q[seq_q]
    pos_k = torch.arange(k.shape[0], device=dev) - cu_kv[seq_k]
    shift = (cu_kv[1:] - cu_kv[:-1]) - (cu_q[1:] - cu_q[:-1])  # bottom-right alignment
    see = (seq_q[:, None] == seq_k[None, :]) & (pos_k[None, :] <= (pos_q + shift[seq_q])[:, None])
    dt = torch.promote_types(q.dtype, torch.float32)  # softmax in fp32 at least
    scores = torch.einsum("qhd,khd->hqk", q.to(dt), k.to(dt)) * scale
    probs = torch.softmax(scores.masked_fill(~see[None], float("-inf")), dim=-1)
    return torch.einsum("hqk,khd->qhd", probs.to(v.dtype), v)


def torch_attend(module: nn.Module, q: Tensor, k: Tensor, v: Tensor, idx: ThdIndex) -> Tensor:
    """The THD route's kernel on the local spec: varlen attention with a bottom-right causal
    mask per sequence (TE's ``padding_causal_bottom_right``), as two padded batches of
    torch's ``scaled_dot_product_attention`` (:meth:`ThdIndex.buckets`): a completion's
    queries against ``[prompt; own]`` keys only, so the work is the rows' minus the repeated
    prompts, where the dense mask route computes the whole row against the whole row."""
    scale = getattr(module, "softmax_scale", None) or 1.0 / math.sqrt(q.shape[-1])
    rep = q.shape[1] // k.shape[1]

    def pad(x: Tensor) -> Tensor:
        return torch.cat([x, x.new_zeros(1, *x.shape[1:])])

    qp, kp, vp = pad(q), pad(k), pad(v)
    pos, vals = [], []
    for b in idx.buckets(q.device):
        keys, values = kp[b.kv_index], vp[b.kv_index]  # [n, L_kv, h_kv, d]
        if rep > 1:
            keys, values = keys.repeat_interleave(rep, 2), values.repeat_interleave(rep, 2)
        y = torch.nn.functional.scaled_dot_product_attention(
            qp[b.q_index].transpose(1, 2),
            keys.transpose(1, 2),
            values.transpose(1, 2),
            attn_mask=b.allowed,
            scale=scale,
        ).transpose(1, 2)  # [n, L_q, h, d]
        vals.append(y[b.valid])
        pos.append(b.q_index[b.valid])
    order = torch.argsort(torch.cat(pos))
    return torch.cat(vals).index_select(0, order)


TE_SEQLEN_ROUND = 64
"""``max_seqlen_q/kv`` handed to TE rounded up to this (what TE 2.11 ``DotProductAttention.forward``
does itself when it derives them from ``cu_seqlens``): cuDNN 9.6's fused THD kernel takes
``padding_causal_bottom_right`` only with multiples of 64 (``fused_attn.cpp``
``nvte_get_fused_attn_backend``); a larger bound changes no result."""

TE_BACKENDS = ("flash_attention", "fused_attention", "unfused_attention")
"""TE 2.11 ``DotProductAttention``'s backend modules, each with its own ``attention_type``."""


@contextlib.contextmanager
def _cross_attention(module: nn.Module) -> Iterator[None]:
    """``module`` and its TE backends as ``attention_type="cross"`` inside the block. TE
    2.11's ``UnfusedDotProductAttention`` builds a *self*-attention THD mask from
    ``cu_seqlens_q`` alone (``utils.py`` ``get_padding_mask``: ``attention_type == "self"``
    keeps the query mask only; ``get_full_mask`` then takes the key lengths equal to the
    query lengths): with ``cu_seqlens_kv != cu_seqlens_q`` it raises on the shapes, or, when
    the longest query and key sequences are equally long, silently masks top-left over the
    first ``len_q`` keys. As cross-attention it takes both lengths (``[q_mask, kv_mask]``)
    and aligns the causal mask bottom-right per sequence; TE itself switches to ``cross``
    for the same case, queries shorter than keys (KV cache: ``DotProductAttention.forward``).
    FlashAttention and FusedAttention read ``attention_type`` for sbhd / bshd only."""
    mods = [module, *(getattr(module, n, None) for n in TE_BACKENDS)]
    mods = [m for m in mods if m is not None and hasattr(m, "attention_type")]
    saved = [m.attention_type for m in mods]
    for m in mods:
        m.attention_type = "cross"
    try:
        yield
    finally:
        for m, a in zip(mods, saved):
            m.attention_type = a


def _te_seqlen(n: int) -> int:
    return -(-n // TE_SEQLEN_ROUND) * TE_SEQLEN_ROUND


def te_attend(module: nn.Module, q: Tensor, k: Tensor, v: Tensor, idx: ThdIndex) -> Tensor:
    """Transformer Engine 2.11's ``DotProductAttention.forward`` on the THD inputs (the
    parent class of megatron-core's ``TEDotProductAttention``, called directly: megatron's
    ``AttnMaskType`` has no ``padding_causal_bottom_right``), as cross-attention
    (:func:`_cross_attention`) with ``max_seqlen`` rounded to :data:`TE_SEQLEN_ROUND`."""
    import transformer_engine.pytorch as te  # pyright: ignore[reportMissingImports]  (GPU only)

    with _cross_attention(module):
        return te.DotProductAttention.forward(
            module,
            q,
            k,
            v,
            None,
            qkv_format="thd",
            cu_seqlens_q=idx.cu_q,
            cu_seqlens_kv=idx.cu_kv,
            max_seqlen_q=_te_seqlen(idx.max_q),
            max_seqlen_kv=_te_seqlen(idx.max_kv),
            attn_mask_type="padding_causal_bottom_right",
        )


Attend = Callable[[nn.Module, Tensor, Tensor, Tensor, ThdIndex], Tensor]


def segment_attention(
    module: nn.Module, attend: Attend, query: Tensor, key: Tensor, value: Tensor, idx: ThdIndex
) -> Tensor:
    """Core attention of a segment row on the THD route: ``query`` ``[T, 1, h, d]``,
    ``key``/``value`` ``[T, 1, h_kv, d]`` (RoPE applied) -> ``[T, 1, h * d]`` (what
    megatron's core attention returns for an sbhd row)."""
    t = query.shape[0]
    q = query.reshape(t, *query.shape[2:])
    k = key.reshape(t, *key.shape[2:]).index_select(0, idx.kv_index.to(key.device))
    v = value.reshape(t, *value.shape[2:]).index_select(0, idx.kv_index.to(value.device))
    out = attend(module, q, k, v, idx)
    return out.reshape(t, 1, -1)


def _segment_forward(self, query, key, value, attention_mask, *args, **kwargs):
    """The core attention's ``forward`` on the instance (:func:`install_thd_attention`)."""
    idx = getattr(kwargs.get("packed_seq_params"), "segment_thd", None)
    if idx is None:  # not a segment row: the module's own forward
        return type(self).forward(self, query, key, value, attention_mask, *args, **kwargs)
    return segment_attention(self, self._megagrpo_attend, query, key, value, idx)


def install_thd_attention(model: nn.Module, attend: Attend = te_attend) -> int:
    """Route every ``self_attention.core_attention`` of ``model`` through
    :func:`segment_attention` with kernel ``attend`` whenever its ``packed_seq_params``
    carries a segment index (:func:`shared_params`); any other call goes to the module's own
    (class) forward unchanged. The module keeps its name and state (``forward`` is set on the
    instance). Returns the number of modules routed; installing again swaps the kernel."""
    count = 0
    for name, mod in model.named_modules():
        if not name.endswith("self_attention.core_attention"):
            continue
        mod._megagrpo_attend = attend  # type: ignore[attr-defined]
        mod.forward = types.MethodType(_segment_forward, mod)  # type: ignore[method-assign]
        count += 1
    return count


@contextlib.contextmanager
def rope_positions(model: nn.Module, positions: Tensor | None) -> Iterator[None]:
    """Inside the block, the rotary table ``model`` builds for a forward (``[T, 1, 1, d]``,
    rows 0..T-1) holds row ``positions[t]`` at row ``t`` (``positions`` ``[T]``, each
    ``<= t``); None: unchanged."""
    rope = getattr(model, "rotary_pos_emb", None)
    if positions is None or rope is None:
        yield
        return

    def gather(_module, _args, out):
        if not isinstance(out, Tensor) or out.shape[0] != positions.numel():
            raise RuntimeError(
                f"rotary table of {tuple(getattr(out, 'shape', ()))} rows for a segment row "
                f"of {positions.numel()} tokens"
            )
        return out.index_select(0, positions.to(out.device))

    handle = rope.register_forward_hook(gather)
    try:
        yield
    finally:
        handle.remove()


__all__ = [
    "Segments",
    "ThdIndex",
    "install_thd_attention",
    "reference_attend",
    "rope_positions",
    "segment_attention",
    "shared_params",
    "te_attend",
    "torch_attend",
]
