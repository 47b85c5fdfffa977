"""Padding-free training micro-batches: several samples packed into one row.

GRPO completions run from a few tokens to ``rollout.max_tokens``; right-padding a
micro-batch to its longest sample computes (and stores activations for) padding tokens.
:func:`pack_samples` instead concatenates samples into rows of at most ``max_tokens``
tokens (first-fit over the length-sorted samples, longest first: deterministic, and every
row but the last few nearly full), one row per micro-batch, with ``cu_seqlens`` marking the
samples. The model keeps them apart (:mod:`megagrpo.model.model_inputs`: THD
``PackedSeqParams`` with TE, a block-diagonal mask on the local spec) and the fused loss
takes the flat row with ``seq_ids`` (README "Fused GRPO loss": packed ``[T]`` inputs).

A :class:`PackedMicroBatch` has the fields and counters of the trainer's padded
``MicroBatch`` (``input_ids``/``position_ids``/``target_ids``/``mask``/``advantages``/
``rollout_logprobs`` ``[1, T]``, ``indices``, ``num_seqs``/``num_nonempty``/``num_tokens``,
``to(device)``) plus ``cu_seqlens`` ``[n + 1]`` and ``seq_ids`` ``[1, T]``, so the trainer's
loss weights (``microbatch_weight``) apply unchanged. Per-sample targets and masks follow the
trainer's convention: position ``t`` predicts token ``t + 1`` of the *same* sample; the last
position of every sample has mask 0 (it would predict the next sample's first token).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from megagrpo.model.model_inputs import packed_positions


class SampleLike(Protocol):
    """What packing reads of a training sample (the trainer's ``Sample``)."""

    input_ids: list[int]
    prompt_len: int
    advantage: float
    rollout_logprobs: list[float]
    index: int


@dataclass
class PackedMicroBatch:
    """One packed row (all ``[1, T]``) and its sample boundaries (module doc)."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    target_ids: torch.Tensor
    mask: torch.Tensor
    advantages: torch.Tensor
    rollout_logprobs: torch.Tensor
    indices: list[int]
    cu_seqlens: torch.Tensor
    """[n + 1] int32: sample ``i`` is tokens ``cu_seqlens[i]:cu_seqlens[i+1]``."""
    seq_ids: torch.Tensor
    """[1, T] sample index of every token (padding belongs to the last sample, mask 0)."""

    @property
    def num_seqs(self) -> int:
        """Samples in this row."""
        return len(self.indices)

    @property
    def num_nonempty(self) -> int:
        """Samples with at least one loss token."""
        n = self.cu_seqlens.numel() - 1
        per = torch.zeros(n, dtype=self.mask.dtype, device=self.mask.device)
        per.index_add_(0, self.seq_ids.reshape(-1).to(self.mask.device), self.mask.reshape(-1))
        return int((per > 0).sum().item())

    @property
    def num_tokens(self) -> int:
        """Loss tokens (completion tokens) in this row."""
        return int(self.mask.sum().item())

    def to(self, device: torch.device) -> PackedMicroBatch:
        """The same row with every tensor on ``device``."""
        return PackedMicroBatch(
            self.input_ids.to(device),
            self.position_ids.to(device),
            self.target_ids.to(device),
            self.mask.to(device),
            self.advantages.to(device),
            self.rollout_logprobs.to(device),
            self.indices,
            self.cu_seqlens.to(device),
            self.seq_ids.to(device),
        )


def plan_rows(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Indices of ``lengths`` per row: first-fit decreasing into rows of <= ``max_tokens``
    (ties by index: deterministic). A sample longer than ``max_tokens`` raises."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    rows: list[list[int]] = []
    free: list[int] = []
    for i in order:
        n = lengths[i]
        if n > max_tokens:
            raise ValueError(
                f"sample of {n} tokens does not fit a packed row of {max_tokens} "
                "(raise the row size to at least rollout.max_model_len)"
            )
        for r, room in enumerate(free):
            if n <= room:
                rows[r].append(i)
                free[r] -= n
                break
        else:
            rows.append([i])
            free.append(max_tokens - n)
    return rows


def _row(samples: Sequence[SampleLike], pad_id: int, pad_to_multiple: int) -> PackedMicroBatch:
    total = sum(len(s.input_ids) for s in samples)
    t = total + (-total) % pad_to_multiple
    ids = torch.full((t,), pad_id, dtype=torch.long)
    target = torch.zeros(t, dtype=torch.long)
    mask = torch.zeros(t, dtype=torch.float32)
    adv = torch.zeros(t, dtype=torch.float32)
    rollout = torch.zeros(t, dtype=torch.float32)
    seq = torch.full((t,), len(samples) - 1, dtype=torch.long)
    cu = [0]
    for k, s in enumerate(samples):
        o, n = cu[-1], len(s.input_ids)
        x = torch.tensor(s.input_ids, dtype=torch.long)
        ids[o : o + n] = x
        target[o : o + n - 1] = x[1:]
        lo, hi = o + s.prompt_len - 1, o + n - 1  # positions predicting completion tokens
        mask[lo:hi] = 1.0
        adv[lo:hi] = s.advantage
        if len(s.rollout_logprobs) == hi - lo:
            rollout[lo:hi] = torch.tensor(s.rollout_logprobs, dtype=torch.float32)
        seq[o : o + n] = k
        cu.append(o + n)
    cu_t = torch.tensor(cu, dtype=torch.int32)
    pos = packed_positions(cu_t, t)
    return PackedMicroBatch(
        ids[None],
        pos[None],
        target[None],
        mask[None],
        adv[None],
        rollout[None],
        [s.index for s in samples],
        cu_t,
        seq[None],
    )


def pack_samples(
    samples: Sequence[SampleLike], max_tokens: int, pad_id: int = 0, pad_to_multiple: int = 1
) -> list[PackedMicroBatch]:
    """Packed micro-batches of ``samples``, each row at most ``max_tokens`` tokens before the
    padding to ``pad_to_multiple`` (sequence parallelism needs T % TP == 0); longest rows
    first (the order of :func:`plan_rows`)."""
    rows = plan_rows([len(s.input_ids) for s in samples], max_tokens)
    return [_row([samples[i] for i in row], pad_id, pad_to_multiple) for row in rows]


def padding_stats(lengths: Sequence[int], micro_batch_size: int, max_tokens: int) -> dict:
    """Token slots computed per batch: padded micro-batches (length-sorted, ``micro_batch_size``
    samples each, padded to the longest) against packed rows of ``max_tokens``. Returns
    ``real``, ``padded_slots``, ``padded_waste`` (fraction of padded slots that are padding),
    ``packed_rows``, ``packed_slots`` (rows x the longest row: what a fixed-shape pipeline
    would allocate) and ``packed_fill`` (real / sum of row lengths: 1.0 without SP padding)."""
    real = sum(lengths)
    order = sorted(lengths)
    slots = 0
    for start in range(0, len(order), micro_batch_size):
        chunk = order[start : start + micro_batch_size]
        slots += len(chunk) * max(chunk)
    rows = plan_rows(lengths, max_tokens)
    row_lens = [sum(lengths[i] for i in r) for r in rows]
    return {
        "samples": len(lengths),
        "real": real,
        "padded_slots": slots,
        "padded_waste": 1.0 - real / max(slots, 1),
        "packed_rows": len(rows),
        "packed_slots": len(rows) * max(row_lens, default=0),
        "packed_fill": real / max(sum(row_lens), 1),
    }
