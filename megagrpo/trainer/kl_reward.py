"""``loss.kl_in_reward``: the reference KL as a reward penalty (ms-swift's ``--kl_in_reward``,
its default for ``--advantage_estimator rloo`` and ``reinforce_plus_plus``).

Each completion's reward loses ``loss.kl_coef`` x the sum over its completion tokens of
``old - ref`` log-probs (the k1 estimate of KL(pi_old || pi_ref), overlong-filtered tokens
included: ms-swift takes it from the generation's ``completion_mask``) before the advantages
are computed (``swift/rl_core/advantage.py`` ``compute_advantages``), and the loss has no KL
term. The old and reference log-probs exist once the generated batch is prepared (its first
optimiser step, :func:`megagrpo.trainer.minibatch.prepare`), so the batch's advantages are
recomputed then and written into every mini-batch's micro-batches; a checkpoint holds the
recomputed ones.

Every rank holds its data-parallel share of the log-probs (the last pipeline stage only, the
same values on every tensor-parallel rank): the per-completion sums are spread over one
world-wide vector and averaged over the ranks that hold each, so every rank ends with the
whole batch's KL.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist

from megagrpo.trainer.context import TrainContext
from megagrpo.trainer.generated import Generated


def _spans(gb: Generated, k: int, dp_rank: int, dp_size: int) -> Iterator[tuple]:
    """``(micro-batch, row, lo, hi, global index)`` of every completion of mini-batch ``k``
    on this rank: its log-probs / advantages are ``[row, lo:hi]`` of that micro-batch."""
    assert gb.updates is not None
    lo_g, hi_g = gb.bounds()[k]
    offsets, n = [], 0
    for g in gb.groups:
        offsets.append(n)
        n += g.size
    local = []  # this rank's samples, flattened as prepare_update's build_samples numbers them
    for gi in range(lo_g + dp_rank, hi_g, dp_size):
        group = gb.groups[gi]
        for j, completion in enumerate(group.token_ids):
            local.append((offsets[gi] + j, len(group.prompt_of(j)), len(completion)))
    for i, mb in enumerate(gb.updates[k].mbs):
        for pos, index in enumerate(mb.indices):
            flat, prompt, length = local[index]
            if mb.spans is not None:
                row, lo, hi = mb.spans[pos]
                yield i, row, lo, hi, flat
                continue
            starts = mb.cu_seqlens.tolist() if mb.cu_seqlens is not None else None
            row, base = (0, starts[pos]) if starts is not None else (pos, 0)
            yield i, row, base + prompt - 1, base + prompt - 1 + length, flat


def sequence_kl(ctx: TrainContext, gb: Generated) -> list[torch.Tensor]:
    """Per group ``[G_n]`` (float64): each completion's sum of old - reference log-probs over
    its completion tokens, the same on every rank. Collective (the world)."""
    total = sum(g.size for g in gb.groups)
    sums = torch.zeros(total, dtype=torch.float64)
    counts = torch.zeros(total, dtype=torch.float64)
    pgs = ctx.pgs
    assert gb.updates is not None
    for k, u in enumerate(gb.updates):
        if u.old is None or u.ref is None:
            raise RuntimeError("loss.kl_in_reward needs the old and reference log-probs")
        for i, row, lo, hi, flat in _spans(gb, k, pgs.dp_rank, pgs.dp_size):
            old, ref = u.old[i], u.ref[i]
            if old is None or ref is None:  # a pipeline stage before the last: not held here
                continue
            diff = old[row, lo:hi].double() - ref[row, lo:hi].double()
            sums[flat] += float(diff.sum())
            counts[flat] += 1.0
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        both = torch.stack([sums, counts]).to(ctx.comm.device)
        dist.all_reduce(both)
        sums, counts = both.cpu().unbind(0)
    if bool((counts == 0).any()):
        raise RuntimeError("loss.kl_in_reward: a completion's log-probs were on no rank")
    return list(torch.split(sums / counts, [g.size for g in gb.groups]))


def set_advantages(ctx: TrainContext, gb: Generated, adv: list[torch.Tensor]) -> None:
    """``adv`` (one ``[G_n]`` row per group) becomes the batch's advantages: ``gb.adv`` (what a
    checkpoint holds) and every prepared micro-batch's per-token advantages."""
    gb.adv = [a.to(torch.float32) for a in adv]
    flat = torch.cat(gb.adv) if gb.adv else torch.zeros(0)
    pgs = ctx.pgs
    assert gb.updates is not None
    for k, u in enumerate(gb.updates):
        for i, row, lo, hi, index in _spans(gb, k, pgs.dp_rank, pgs.dp_size):
            u.mbs[i].advantages[row, lo:hi] = float(flat[index])
