"""Groups -> padded micro-batches for the Megatron forward/backward.

A sample is one completion with its prompt: ``input_ids = prompt_ids + token_ids`` (length L).
Position t of the logits predicts token t+1, so per position t: ``target[t] = input[t+1]``
and ``mask[t] = 1`` iff token t+1 is a completion token; the rollout's log-prob of completion
token i sits at position ``P - 1 + i``. Targets are shifted instead of the logits, so the
[B, T, V] logits are never sliced (a slice would be copied by the fused loss).

Micro-batches hold at most ``micro_batch_size`` samples, right-padded to their longest
sample; samples are sorted by length first (less padding), in a deterministic order.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from megagrpo.types import Group


@dataclass
class Sample:
    """One completion ready for training (python lists; tensors are built per micro-batch)."""

    input_ids: list[int]
    prompt_len: int
    advantage: float
    rollout_logprobs: list[float]
    index: int
    """Position in the flattened batch (group-major), to scatter recomputed log-probs back."""

    @property
    def length(self) -> int:
        return len(self.input_ids)


@dataclass
class MicroBatch:
    """Tensors of one micro-batch (all [B, T], B <= micro_batch_size)."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    target_ids: torch.Tensor
    mask: torch.Tensor
    advantages: torch.Tensor
    rollout_logprobs: torch.Tensor
    indices: list[int]

    @property
    def num_seqs(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_tokens(self) -> int:
        """Loss tokens (completion tokens) in this micro-batch."""
        return int(self.mask.sum().item())


def build_samples(groups: Sequence[Group], advantages: torch.Tensor) -> list[Sample]:
    """One :class:`Sample` per completion; ``advantages`` is [N, G] (rows follow ``groups``)."""
    samples = []
    for n, group in enumerate(groups):
        if not group.prompt_ids:
            raise ValueError(f"group for problem {group.problem.id} has no prompt_ids")
        for g, completion in enumerate(group.token_ids):
            lp = group.logprobs[g] if g < len(group.logprobs) else []
            samples.append(
                Sample(
                    list(group.prompt_ids) + list(completion),
                    len(group.prompt_ids),
                    float(advantages[n, g]),
                    list(lp),
                    len(samples),
                )
            )
    return samples


def _collate(samples: list[Sample], pad_id: int) -> MicroBatch:
    b, t = len(samples), max(s.length for s in samples)
    input_ids = torch.full((b, t), pad_id, dtype=torch.long)
    target = torch.zeros((b, t), dtype=torch.long)
    mask = torch.zeros((b, t), dtype=torch.float32)
    adv = torch.zeros((b, t), dtype=torch.float32)
    rollout = torch.zeros((b, t), dtype=torch.float32)
    for i, s in enumerate(samples):
        ids = torch.tensor(s.input_ids, dtype=torch.long)
        input_ids[i, : s.length] = ids
        target[i, : s.length - 1] = ids[1:]
        lo, hi = s.prompt_len - 1, s.length - 1  # positions predicting completion tokens
        mask[i, lo:hi] = 1.0
        adv[i, lo:hi] = s.advantage
        if len(s.rollout_logprobs) == hi - lo:
            rollout[i, lo:hi] = torch.tensor(s.rollout_logprobs, dtype=torch.float32)
    position_ids = torch.arange(t, dtype=torch.long).unsqueeze(0).expand(b, t).contiguous()
    return MicroBatch(
        input_ids, position_ids, target, mask, adv, rollout, [s.index for s in samples]
    )


def micro_batches(
    samples: Sequence[Sample], micro_batch_size: int, pad_id: int = 0, pad_to_multiple: int = 1
) -> Iterator[MicroBatch]:
    """Yield padded micro-batches of at most ``micro_batch_size`` samples (length-sorted).

    ``pad_to_multiple``: pad T up to a multiple (sequence parallelism needs T % TP == 0).
    """
    order = sorted(samples, key=lambda s: (s.length, s.index))
    for start in range(0, len(order), micro_batch_size):
        chunk = order[start : start + micro_batch_size]
        mb = _collate(chunk, pad_id)
        t = mb.input_ids.shape[1]
        extra = (-t) % pad_to_multiple
        if extra:
            mb = _pad(mb, extra, pad_id)
        yield mb


def _pad(mb: MicroBatch, extra: int, pad_id: int) -> MicroBatch:
    def right(x: torch.Tensor, value) -> torch.Tensor:
        return torch.nn.functional.pad(x, (0, extra), value=value)

    b, t = mb.input_ids.shape
    pos = torch.arange(t + extra, dtype=torch.long).unsqueeze(0).expand(b, -1).contiguous()
    return MicroBatch(
        right(mb.input_ids, pad_id),
        pos,
        right(mb.target_ids, 0),
        right(mb.mask, 0.0),
        right(mb.advantages, 0.0),
        right(mb.rollout_logprobs, 0.0),
        mb.indices,
    )


def has_rollout_logprobs(groups: Sequence[Group]) -> bool:
    """True when every completion of every group carries one log-prob per token."""
    return all(
        len(g.logprobs) == len(g.token_ids)
        and all(len(lp) == len(t) for lp, t in zip(g.logprobs, g.token_ids))
        for g in groups
    )


def microbatch_weight(mb: MicroBatch, loss_agg: str, total_seqs: int, total_tokens: int) -> float:
    """Scale of a micro-batch's (locally normalised) loss so the accumulated gradient equals
    the gradient of the loss over the whole batch: by tokens for ``token_mean``, by
    sequences for the per-sequence aggregations."""
    if loss_agg == "token_mean":
        return mb.num_tokens / max(total_tokens, 1)
    return mb.num_seqs / max(total_seqs, 1)
