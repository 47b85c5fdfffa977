"""Groups -> padded micro-batches for the Megatron forward/backward.

A sample is one completion with its prompt: ``input_ids = prompt_ids + token_ids`` (length L).
Position t of the logits predicts token t+1, so per position t: ``target[t] = input[t+1]``
and ``mask[t] = 1`` iff token t+1 is a completion token; the rollout's log-prob of completion
token i sits at position ``P - 1 + i``. Targets are shifted instead of the logits, so the
[B, T, V] logits are never sliced (a slice would be copied by the fused loss).

Micro-batches hold at most ``micro_batch_size`` samples, right-padded to their longest
sample; samples are sorted by length first (less padding), in a deterministic order.

Groups may differ in size (rollout budgets): advantages come one row per group, and with
``loss.group_weighting: group`` every sample carries its sequence weight
(:func:`megagrpo.algo.advantages.sequence_weights`); :func:`microbatch_weight` then scales
each micro-batch by its weighted share of the batch's aggregation mass
(:func:`megagrpo.algo.losses.aggregation_mass`), so the micro-batches still sum exactly to
the batch loss.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from megagrpo.algo.losses import aggregation_mass, make_seq_ids
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
    weight: float | None = None
    """Sequence weight in the loss aggregation (``loss.group_weighting: group``); None: 1."""

    @property
    def length(self) -> int:
        return len(self.input_ids)


@dataclass
class MicroBatch:
    """Tensors of one micro-batch (all [B, T], B <= micro_batch_size). A *padding*
    micro-batch (:func:`padding_micro_batch`) holds one all-masked row and no sample."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    target_ids: torch.Tensor
    mask: torch.Tensor
    advantages: torch.Tensor
    rollout_logprobs: torch.Tensor
    indices: list[int]
    """Positions of its samples in the flattened batch ([] for a padding micro-batch)."""
    seq_weights: torch.Tensor | None = None
    """[B] sequence weights of the loss aggregation (None: every sequence weighs 1)."""

    @property
    def num_seqs(self) -> int:
        """Samples (completions, an empty one included) in this micro-batch."""
        return len(self.indices)

    @property
    def num_nonempty(self) -> int:
        """Samples with at least one loss token."""
        return int((self.mask.sum(dim=1) > 0).sum().item())

    @property
    def num_tokens(self) -> int:
        """Loss tokens (completion tokens) in this micro-batch."""
        return int(self.mask.sum().item())

    def to(self, device: torch.device) -> MicroBatch:
        """The same micro-batch with every tensor on ``device`` (the loss and the model's
        compute device: the fused kernel takes no host tensor next to CUDA logits)."""
        return MicroBatch(
            self.input_ids.to(device),
            self.position_ids.to(device),
            self.target_ids.to(device),
            self.mask.to(device),
            self.advantages.to(device),
            self.rollout_logprobs.to(device),
            self.indices,
            None if self.seq_weights is None else self.seq_weights.to(device),
        )


@dataclass(frozen=True)
class BatchTotals:
    """Sums over the whole trained batch (every data-parallel rank), for the micro-batch
    weights: samples, samples with at least one loss token, loss tokens, and the weighted
    aggregation mass (:func:`microbatch_mass`; used by micro-batches with sequence
    weights)."""

    seqs: float
    nonempty: float
    tokens: float
    mass: float = 0.0


def padding_micro_batch(length: int, pad_id: int) -> MicroBatch:
    """A micro-batch of one all-masked row of ``length`` pad tokens: it runs the model's
    forward/backward (and its collectives) and contributes exactly zero loss and gradient."""
    ids = torch.full((1, length), pad_id, dtype=torch.long)
    zeros = torch.zeros((1, length), dtype=torch.float32)
    pos = torch.arange(length, dtype=torch.long).unsqueeze(0)
    return MicroBatch(ids, pos, torch.zeros_like(ids), zeros, zeros.clone(), zeros.clone(), [])


def build_samples(
    groups: Sequence[Group],
    advantages: torch.Tensor | Sequence[torch.Tensor],
    weights: Sequence[torch.Tensor] | None = None,
) -> list[Sample]:
    """One :class:`Sample` per completion; ``advantages``: one row per group (``[N, G]``, or
    one ``[G_n]`` tensor per group when sizes differ); ``weights``: optional per-group
    sequence weights ``[G_n]`` (:attr:`Sample.weight`)."""
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
                    float(advantages[n][g]),
                    list(lp),
                    len(samples),
                    None if weights is None else float(weights[n][g]),
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
    weights = None
    if any(s.weight is not None for s in samples):
        weights = torch.tensor([1.0 if s.weight is None else s.weight for s in samples])
    return MicroBatch(
        input_ids, position_ids, target, mask, adv, rollout, [s.index for s in samples], weights
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
        mb.seq_weights,
    )


def has_rollout_logprobs(groups: Sequence[Group]) -> bool:
    """True when every completion of every group carries one log-prob per token."""
    return all(
        len(g.logprobs) == len(g.token_ids)
        and all(len(lp) == len(t) for lp, t in zip(g.logprobs, g.token_ids))
        for g in groups
    )


def microbatch_mass(mb: MicroBatch, loss_agg: str) -> float:
    """The denominator of a micro-batch's locally normalised loss
    (:func:`megagrpo.algo.losses.aggregation_mass`): loss tokens, non-empty sequences or
    sequences, each sequence counted with its weight when the micro-batch has
    :attr:`MicroBatch.seq_weights`. 0 for a padding micro-batch."""
    if mb.seq_weights is None or not mb.indices:
        if loss_agg == "token_mean":
            return float(mb.num_tokens)
        if loss_agg == "seq_mean_token_mean":
            return float(mb.num_nonempty)
        return float(mb.num_seqs)
    ids, num = make_seq_ids(mb.mask.shape, None, mb.mask.device)
    return float(aggregation_mass(mb.mask, ids, num, loss_agg, mb.seq_weights))


def microbatch_weight(mb: MicroBatch, loss_agg: str, totals: BatchTotals) -> float:
    """Scale of a micro-batch's (locally normalised) loss so that the accumulated loss and
    gradient equal the whole batch's: each aggregation's per-micro-batch denominator over
    the whole batch's (:func:`megagrpo.algo.losses.token_weights`): loss tokens for
    ``token_mean``, non-empty sequences for ``seq_mean_token_mean`` (an empty completion
    has no token mean), sequences for ``seq_mean_token_sum_norm`` (with the fixed
    ``loss.max_tokens`` normaliser, set by ``RunConfig.resolve``). 0 for padding. A
    micro-batch with sequence weights: its weighted mass over ``totals.mass``."""
    if mb.seq_weights is not None:
        return microbatch_mass(mb, loss_agg) / max(totals.mass, 1e-12)
    if loss_agg == "token_mean":
        return mb.num_tokens / max(totals.tokens, 1.0)
    if loss_agg == "seq_mean_token_mean":
        return mb.num_nonempty / max(totals.nonempty, 1.0)
    return mb.num_seqs / max(totals.seqs, 1.0)
