"""Token ids -> what Megatron's ``GPTModel`` takes: padding for sequence parallelism, RoPE
positions, the attention mask, and packed (THD) sequences.

Padded micro-batches ``[B, T]`` run with Megatron's causal mask (plus a key mask when an
``attention_mask`` is given). A packed micro-batch (:mod:`megagrpo.trainer.batch`) is one row
``[1, T]`` holding several samples back to back, described by ``cu_seqlens`` ``[n + 1]``
(sample ``i`` = tokens ``cu_seqlens[i]:cu_seqlens[i + 1]``):

* TE spec (GPU): ``PackedSeqParams(qkv_format="thd", cu_seqlens_q/kv, max_seqlen_q/kv)``.
  TE's fused attention runs each sample on its own and Megatron restarts RoPE at every
  sample (``_apply_rotary_pos_emb_thd``): no padding token is computed.
* local spec (CPU): megatron-core's ``DotProductAttention`` refuses ``packed_seq_params``,
  so the samples get a block-diagonal causal mask instead (token ``q`` sees key ``k`` iff
  ``k <= q`` and both belong to the same sample). Megatron applies RoPE at the row positions
  ``0..T-1``; a sample starting at row position ``s`` is therefore rotated by ``s`` more than
  when it runs alone. Attention scores depend only on ``q_pos - k_pos`` (RoPE is a rotation
  by position: ``<R(a)q, R(b)k> = <R(a-b)q, k>``), and the mask keeps every score inside one
  sample, so the logits equal the unpacked ones up to floating-point rounding of the larger
  angles (tested in tests/distributed/test_packing.py).

A *segment row* (:mod:`megagrpo.model.shared_prefix`: a group's prompt once, its
completions after it) is one row with :class:`~megagrpo.model.shared_prefix.Segments`: the
THD route's ``packed_seq_params`` (or, route ``mask``, the segments' mask for the local
spec's attention), and the rotary positions each token really has
(:attr:`ModelInputs.rope_positions`).

Sequence parallelism splits the sequence over TP, so ``T`` is padded up to a multiple of TP;
the pad tokens form a trailing block of their own (packed) or sit right of the last token
(padded, causal: they never influence a real position).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from megagrpo.model.shared_prefix import Segments
    from megagrpo.parallel.state import ParallelGroups

LossFn = Callable[[torch.Tensor, int], tuple["torch.Tensor | None", Any]]
"""``loss_fn(logits [B, T, V/TP], i) -> (loss, out)``: the loss of micro-batch ``i`` (a 0-d
tensor to backpropagate, already scaled by the caller's micro-batch weight; None in a
forward-only pass) and anything to hand back (metrics, log-probs)."""


@dataclass
class ModelInputs:
    """Arguments of one ``GPTModel`` forward (``model(input_ids, position_ids,
    attention_mask, **extra)``) and how to cut the padding off its logits."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    attention_mask: torch.Tensor | None
    length: int
    """T before the sequence-parallel padding (logits ``[:, :length]`` are the real ones)."""
    extra: dict[str, Any] = field(default_factory=dict)
    """``packed_seq_params`` for a packed micro-batch on the TE spec."""
    rope_positions: torch.Tensor | None = None
    """``[T + padding]`` RoPE position of every token of a segment row (None: row positions);
    the forward runs inside :func:`megagrpo.model.shared_prefix.rope_positions`."""

    @property
    def padded(self) -> bool:
        return self.input_ids.shape[1] != self.length


def segment_ids(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """Sample index ``[total]`` of every position of a packed row (positions past
    ``cu_seqlens[-1]`` get index ``n``, the padding block)."""
    cu = cu_seqlens.to(torch.long)
    pos = torch.arange(total, device=cu.device)
    return torch.searchsorted(cu[1:], pos, right=True)


def packed_positions(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """Per-sample restarting positions ``[total]`` (0..l_i-1 for every sample, the padding
    block too)."""
    cu = cu_seqlens.to(torch.long)
    seg = segment_ids(cu, total)
    starts = torch.cat([cu[:-1], cu[-1:]])  # the padding block starts at cu[-1]
    return torch.arange(total, device=cu.device) - starts[seg]


def block_causal_mask(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """Megatron's boolean attention mask ``[1, 1, total, total]`` (True = masked) of a packed
    row: causal inside every sample, nothing across samples."""
    seg = segment_ids(cu_seqlens, total)
    causal = torch.triu(
        torch.ones(total, total, dtype=torch.bool, device=cu_seqlens.device), diagonal=1
    )
    return (causal | (seg[:, None] != seg[None, :]))[None, None]


def _check_cu_seqlens(cu: torch.Tensor, b: int, t: int) -> None:
    if b != 1:
        raise ValueError(f"a packed micro-batch is one row [1, T]; got {b} rows")
    if cu.dim() != 1 or cu.numel() < 2 or int(cu[0]) != 0 or int(cu[-1]) > t:
        raise ValueError(
            f"cu_seqlens must be [n + 1] from 0 to at most T={t}; got {cu.tolist()[:8]}"
        )
    if bool((cu[1:] < cu[:-1]).any()):
        raise ValueError("cu_seqlens must be non-decreasing")


def model_inputs(
    groups: ParallelGroups,
    spec: str,
    input_ids: torch.Tensor,
    position_ids: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    segments: Segments | None = None,
    route: str = "auto",
) -> ModelInputs:
    """The ``GPTModel`` inputs of token ids ``[B, T]`` on ``groups.device`` (module doc).

    ``position_ids``: None, 0..T-1 per row, or (packed) 0..l_i-1 per sample: RoPE positions
    are implicit, other positions are rejected. ``attention_mask`` [B, T] (1 = token, 0 =
    padding) masks padded keys on top of the causal mask (TE spec: right padding only, where
    the mask changes nothing; other padding raises ValueError). ``cu_seqlens`` [n + 1] makes
    the row a packed micro-batch (B must be 1; ``attention_mask`` must be None). ``segments``
    makes it a segment row (B = 1; ``position_ids`` None or the segments' positions);
    ``route``: thd (auto; the model's core attention installed by ``install_thd_attention``)
    | mask.
    """
    b, t = input_ids.shape
    dev = groups.device
    pad = (-t) % groups.tp_size if groups.sequence_parallel else 0
    n = t + pad
    ids = input_ids.to(dev)
    if pad:  # SP splits the sequence over TP; trailing pads do not affect causal logits
        ids = torch.nn.functional.pad(ids, (0, pad))
    if segments is not None:
        if attention_mask is not None or cu_seqlens is not None:
            raise ValueError("a segment row takes neither cu_seqlens nor an attention_mask")
        return _segment_inputs(spec, ids, segments, position_ids, t, n, route)
    if cu_seqlens is not None:
        if attention_mask is not None:
            raise ValueError("a packed micro-batch takes cu_seqlens, not an attention_mask")
        cu = cu_seqlens.to(dev)
        _check_cu_seqlens(cu, b, t)
        expected = packed_positions(cu, t).unsqueeze(0)
        if position_ids is not None and not torch.equal(position_ids.to(dev), expected):
            raise ValueError("position_ids of a packed row must restart at 0 for every sample")
        return _packed_inputs(spec, ids, cu, t, n)
    pos = torch.arange(n, device=dev).unsqueeze(0).expand(b, n)
    if position_ids is not None and not torch.equal(position_ids.to(dev), pos[:, :t]):
        raise ValueError("position_ids must be 0..T-1 per row (RoPE positions are implicit)")
    mask = None
    if attention_mask is not None and spec == "te":
        _te_padding_mask(attention_mask)  # TE ignores it: only right padding is allowed
    elif attention_mask is not None:
        keep = torch.nn.functional.pad(attention_mask.to(dev).bool(), (0, pad))
        causal = torch.triu(torch.ones(n, n, dtype=torch.bool, device=dev), diagonal=1)
        mask = causal[None, None] | ~keep[:, None, None, :]
    return ModelInputs(ids, pos, mask, t)


def _te_padding_mask(attention_mask: torch.Tensor) -> None:
    """Check a padding mask for the TE spec, where it cannot be applied: megatron-core's
    ``SelfAttention`` hands TE's ``DotProductAttention`` ``attn_mask_type=causal``, and TE
    reads ``attention_mask`` only for mask types with "padding" or "arbitrary" (TE 2.11
    ``attention/dot_product_attention/dot_product_attention.py`` ``forward`` docstring).
    Right padding needs no mask (causal: no real token sees a pad); anything else (left or
    inner padding) raises instead of being silently attended to."""
    keep = attention_mask.to(torch.int8)
    if not torch.equal(keep.cummin(dim=1).values, keep):
        raise ValueError(
            "attention_mask with left or inner padding on the Transformer Engine spec: TE's "
            "causal attention ignores the mask; right-pad the rows or pack them (cu_seqlens)"
        )


def _packed_inputs(spec: str, ids: torch.Tensor, cu: torch.Tensor, t: int, n: int) -> ModelInputs:
    """Packed row ``ids`` [1, n] (n = t + SP padding) with samples ``cu`` (module doc)."""
    last = int(cu[-1])
    if n > last:  # the tail (unused tokens + SP padding) is a block of its own
        cu = torch.cat([cu, cu.new_tensor([n])])
    pos = torch.arange(n, device=ids.device).unsqueeze(0)
    if spec != "te":
        return ModelInputs(ids, pos, block_causal_mask(cu, n), t)
    from megatron.core.packed_seq_params import PackedSeqParams

    cu32 = cu.to(torch.int32)
    longest = int((cu32[1:] - cu32[:-1]).max())
    packed = PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu32,
        cu_seqlens_kv=cu32,
        max_seqlen_q=longest,
        max_seqlen_kv=longest,
    )
    return ModelInputs(ids, pos, None, t, {"packed_seq_params": packed})


def _segment_inputs(
    spec: str,
    ids: torch.Tensor,
    segments: Segments,
    position_ids: torch.Tensor | None,
    t: int,
    n: int,
    route: str,
) -> ModelInputs:
    """Segment row ``ids`` [1, n] (n = t + SP padding): :mod:`megagrpo.model.shared_prefix`."""
    from megagrpo.model.shared_prefix import shared_params

    if ids.shape[0] != 1:
        raise ValueError(f"a segment row is one row [1, T]; got {ids.shape[0]} rows")
    if segments.total > t:
        raise ValueError(f"segments cover {segments.total} tokens of a {t}-token row")
    seg = segments.padded(n)
    pos = seg.positions(ids.device)
    if position_ids is not None and not torch.equal(position_ids.to(ids.device)[0], pos[:t]):
        raise ValueError("position_ids of a segment row must be its segments' positions")
    route = "thd" if route == "auto" else route
    if route == "thd":
        extra = {"packed_seq_params": shared_params(segments, n, ids.device)}
        return ModelInputs(ids, pos[None], None, t, extra, rope_positions=pos)
    if route != "mask":
        raise ValueError(f"segment route {route!r} is not auto | mask | thd")
    return ModelInputs(ids, pos[None], seg.mask(ids.device), t, rope_positions=pos)
