"""Groups -> padded micro-batches for the Megatron forward/backward.

A sample is one completion with its prompt: ``input_ids = prompt_ids + token_ids`` (length L).
Position t of the logits predicts token t+1, so per position t: ``target[t] = input[t+1]``
and ``mask[t] = 1`` iff token t+1 is a completion token; the rollout's log-prob of completion
token i sits at position ``P - 1 + i``. Targets are shifted instead of the logits, so the
[B, T, V] logits are never sliced (a slice would be copied by the fused loss).

Micro-batches hold at most ``micro_batch_size`` samples, right-padded to their longest
sample; samples are sorted by length first (less padding), in a deterministic order.

MoE routing from the engine (``Group.routing``, ``[L - 1, num_layers, top_k]`` per sample:
position t routes input token t) is padded the same way into ``MicroBatch.routing``
``[B, T, num_layers, top_k]``; padded positions route to experts ``0..k-1`` and are not
``routing_valid``.

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
from megagrpo.model.model_inputs import packed_positions
from megagrpo.model.routing import pad_routing
from megagrpo.model.shared_prefix import Segments
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
    routing: torch.Tensor | None = None
    """The engine's experts ``[L - 1, num_layers, top_k]`` int16 (None: none returned)."""
    weight: float | None = None
    """Sequence weight in the loss aggregation (``loss.group_weighting: group``); None: 1."""
    excluded: bool = False
    """Truncated and ``loss.overlong_filter``: no loss token, still counted in the batch's
    normalisers (ms-swift masks it out of ``completion_mask`` in the loss only)."""
    group: int = -1
    """Index of its group in the batch (:func:`build_samples`; -1: unknown)."""

    @property
    def length(self) -> int:
        return len(self.input_ids)


@dataclass
class MicroBatch:
    """Tensors of one micro-batch (all [B, T], B <= micro_batch_size). A *packed* micro-batch
    (:func:`pack_samples`) is one row ``[1, T]`` of several samples with ``cu_seqlens``
    ``[n + 1]`` and ``seq_ids`` ``[1, T]``; a *padding* micro-batch
    (:func:`padding_micro_batch`) holds one all-masked row and no sample."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    target_ids: torch.Tensor
    mask: torch.Tensor
    advantages: torch.Tensor
    rollout_logprobs: torch.Tensor
    indices: list[int]
    """Positions of its samples in the flattened batch ([] for a padding micro-batch)."""
    cu_seqlens: torch.Tensor | None = None
    """Packed: [n + 1] int32, sample ``i`` is tokens ``cu_seqlens[i]:cu_seqlens[i+1]``."""
    seq_ids: torch.Tensor | None = None
    """Packed: [1, T] sample index of every token (padding: the last sample's, mask 0)."""
    routing: torch.Tensor | None = None
    """The engine's experts ``[B, T, num_layers, top_k]`` (None when a sample has none)."""
    routing_valid: torch.Tensor | None = None
    """``[B, T]`` bool: positions the engine fed through the model (0 .. L-2 per sample)."""
    seq_weights: torch.Tensor | None = None
    """[B] sequence weights of the loss aggregation (None: every sequence weighs 1)."""
    filtered_tokens: int = 0
    """Completion tokens of its samples the overlong filter took out of ``mask``."""
    filtered_nonempty: int = 0
    """Its non-empty samples the overlong filter took out of ``mask`` entirely."""
    spans: list[tuple[int, int, int]] | None = None
    """Per sample (the order of ``indices``): ``(row, lo, hi)``, its completion tokens'
    log-probs are ``[row, lo:hi]`` of the loss tensors (``target_ids``, ``mask`` ...)."""
    segments: Segments | None = None
    """A segment row (:mod:`megagrpo.trainer.prefix_batch`): ``input_ids`` / ``position_ids``
    ``[1, T]`` are the row, the loss tensors ``[1, N]`` list its completion tokens, each
    predicted from row position ``loss_index[n]``."""
    loss_index: torch.Tensor | None = None
    """Segment row: ``[N]`` row position whose output predicts loss token ``n``."""
    shared_groups: tuple[int, int] = (0, 0)
    """Segment row: (groups trained with their prompt shared, groups that could share)."""

    @property
    def num_seqs(self) -> int:
        """Samples (completions, an empty one included) in this micro-batch."""
        return len(self.indices)

    @property
    def num_nonempty(self) -> int:
        """Samples with at least one loss token."""
        if self.seq_ids is None:
            return int((self.mask.sum(dim=1) > 0).sum().item())
        per = torch.zeros(self.num_seqs, dtype=self.mask.dtype)
        per.index_add_(0, self.seq_ids.reshape(-1).cpu(), self.mask.reshape(-1).cpu())
        return int((per > 0).sum().item())

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
            cu_seqlens=None if self.cu_seqlens is None else self.cu_seqlens.to(device),
            seq_ids=None if self.seq_ids is None else self.seq_ids.to(device),
            routing=None if self.routing is None else self.routing.to(device),
            routing_valid=None if self.routing_valid is None else self.routing_valid.to(device),
            seq_weights=None if self.seq_weights is None else self.seq_weights.to(device),
            filtered_tokens=self.filtered_tokens,
            filtered_nonempty=self.filtered_nonempty,
            spans=self.spans,
            segments=self.segments,
            loss_index=None if self.loss_index is None else self.loss_index.to(device),
            shared_groups=self.shared_groups,
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
    fed = torch.zeros((1, length), dtype=torch.bool)  # nothing to replay or measure
    return MicroBatch(
        ids,
        pos,
        torch.zeros_like(ids),
        zeros,
        zeros.clone(),
        zeros.clone(),
        [],
        routing_valid=fed,
        spans=[],
    )


def build_samples(
    groups: Sequence[Group],
    advantages: torch.Tensor | Sequence[torch.Tensor],
    weights: Sequence[torch.Tensor] | None = None,
    overlong_filter: bool = False,
) -> list[Sample]:
    """One :class:`Sample` per completion; ``advantages``: one row per group (``[N, G]``, or
    one ``[G_n]`` tensor per group when sizes differ); ``weights``: optional per-group
    sequence weights ``[G_n]`` (:attr:`Sample.weight`); ``overlong_filter``: completions
    that stopped at the length limit (finish reason ``length``) are :attr:`Sample.excluded`."""
    samples = []
    for n, group in enumerate(groups):
        if not group.prompt_ids:
            raise ValueError(f"group for problem {group.problem.id} has no prompt_ids")
        for g, completion in enumerate(group.token_ids):
            lp = group.logprobs[g] if g < len(group.logprobs) else []
            prompt = group.prompt_of(g)  # data.variants: members answer other renderings
            samples.append(
                Sample(
                    list(prompt) + list(completion),
                    len(prompt),
                    float(advantages[n][g]),
                    list(lp),
                    len(samples),
                    group.routing[g] if group.routing else None,
                    None if weights is None else float(weights[n][g]),
                    overlong_filter
                    and g < len(group.finish_reasons)
                    and group.finish_reasons[g] == "length",
                    n,
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
        mask[i, lo:hi] = 0.0 if s.excluded else 1.0
        adv[i, lo:hi] = s.advantage
        if len(s.rollout_logprobs) == hi - lo:
            rollout[i, lo:hi] = torch.tensor(s.rollout_logprobs, dtype=torch.float32)
    position_ids = torch.arange(t, dtype=torch.long).unsqueeze(0).expand(b, t).contiguous()
    routing, valid = _collate_routing(samples, t)
    return MicroBatch(
        input_ids,
        position_ids,
        target,
        mask,
        adv,
        rollout,
        [s.index for s in samples],
        routing=routing,
        routing_valid=valid,
        seq_weights=_seq_weights(samples),
        filtered_tokens=_filtered(samples)[0],
        filtered_nonempty=_filtered(samples)[1],
        spans=[(i, s.prompt_len - 1, s.length - 1) for i, s in enumerate(samples)],
    )


def _filtered(samples: Sequence[Sample]) -> tuple[int, int]:
    """``(filtered_tokens, filtered_nonempty)`` of the overlong-filtered ``samples``."""
    out = [s.length - s.prompt_len for s in samples if s.excluded]
    return sum(out), sum(1 for n in out if n > 0)


def _seq_weights(samples: Sequence[Sample]) -> torch.Tensor | None:
    """``[n]`` sequence weights of ``samples`` (None when none carries one)."""
    if all(s.weight is None for s in samples):
        return None
    return torch.tensor([1.0 if s.weight is None else s.weight for s in samples])


def _collate_routing(samples: list[Sample], t: int) -> tuple[torch.Tensor | None, torch.Tensor]:
    """``([B, T, layers, k]`` engine routing or None, ``[B, T]`` fed positions)."""
    valid = torch.zeros((len(samples), t), dtype=torch.bool)
    for i, s in enumerate(samples):
        valid[i, : s.length - 1] = True
    routes = [s.routing for s in samples]
    if any(r is None for r in routes):
        return None, valid
    first = routes[0]
    assert first is not None
    out = pad_routing(first.new_zeros((len(samples), 0, *first.shape[1:])), t).clone()
    for i, (s, r) in enumerate(zip(samples, routes)):
        assert r is not None
        if r.shape[0] != s.length - 1 or r.shape[1:] != first.shape[1:]:
            raise ValueError(
                f"sample {s.index}: routing {tuple(r.shape)} does not fit its "
                f"{s.length} tokens ([L - 1, layers, k])"
            )
        out[i, : s.length - 1] = r
    return out, valid


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
        routing=None if mb.routing is None else pad_routing(mb.routing, extra),
        routing_valid=None if mb.routing_valid is None else right(mb.routing_valid, False),
        seq_weights=mb.seq_weights,
        filtered_tokens=mb.filtered_tokens,
        filtered_nonempty=mb.filtered_nonempty,
        spans=mb.spans,
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
    ids, num = make_seq_ids(mb.mask.shape, mb.seq_ids, mb.mask.device)
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


# ----------------------------------------------------------------------------- packing
# Padding-free micro-batches: GRPO completions run from a few tokens to rollout.max_tokens, and
# right-padding a micro-batch to its longest sample computes padding. Packing concatenates
# samples into rows of at most ``trainer.pack_tokens`` tokens (first-fit over the samples,
# longest first: deterministic, every row but the last few nearly full), one row per
# micro-batch; the model keeps the samples apart (megagrpo.model.model_inputs: THD
# PackedSeqParams with TE, a block-diagonal mask on the local spec) and the fused loss takes
# the row with ``seq_ids``. Targets and masks follow the padded convention per sample: the
# last position of a sample has mask 0 (it would predict the next sample's first token).


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


def _packed_row(samples: Sequence[Sample], pad_id: int, pad_to_multiple: int) -> MicroBatch:
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
        mask[lo:hi] = 0.0 if s.excluded else 1.0
        adv[lo:hi] = s.advantage
        if len(s.rollout_logprobs) == hi - lo:
            rollout[lo:hi] = torch.tensor(s.rollout_logprobs, dtype=torch.float32)
        seq[o : o + n] = k
        cu.append(o + n)
    cu_t = torch.tensor(cu, dtype=torch.int32)
    pos = packed_positions(cu_t, t)
    return MicroBatch(
        ids[None],
        pos[None],
        target[None],
        mask[None],
        adv[None],
        rollout[None],
        [s.index for s in samples],
        cu_seqlens=cu_t,
        seq_ids=seq[None],
        seq_weights=_seq_weights(samples),
        filtered_tokens=_filtered(samples)[0],
        filtered_nonempty=_filtered(samples)[1],
        spans=[(0, c + s.prompt_len - 1, c + s.length - 1) for c, s in zip(cu, samples)],
    )


def pack_samples(
    samples: Sequence[Sample], max_tokens: int, pad_id: int = 0, pad_to_multiple: int = 1
) -> list[MicroBatch]:
    """Packed micro-batches of ``samples``, each row at most ``max_tokens`` tokens before the
    padding to ``pad_to_multiple`` (sequence parallelism needs T % TP == 0); longest rows
    first (the order of :func:`plan_rows`)."""
    rows = plan_rows([len(s.input_ids) for s in samples], max_tokens)
    return [_packed_row([samples[i] for i in row], pad_id, pad_to_multiple) for row in rows]


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
