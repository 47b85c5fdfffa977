"""Shared-prefix micro-batches (``trainer.shared_prefix``): each group's prompt computed once.

The G completions of a group continue one prompt. Instead of G rows ``prompt + c_j`` a
*segment row* holds ``[prompt | c_1 | ... | c_G]`` (:mod:`megagrpo.model.shared_prefix`:
each completion attends to the prompt and causally to itself, its RoPE positions continue
from the prompt's end), and several groups share a row, first-fit by tokens.

Targets. Completion ``j``'s first token is predicted from the prompt's *last* position
(shared by the G completions), token ``i > 0`` from its own token ``i - 1``. The loss tensors
(``target_ids``, ``mask``, ``advantages``, ``rollout_logprobs``, ``seq_ids``: ``[1, N]``,
N = the row's completion tokens) list every completion token once, in sample order, with
``loss_index[n]`` the row position whose output predicts token ``n``: the loss head gathers
those rows of the hidden states (or logits) before the fused loss
(:mod:`megagrpo.trainer.loss_head`), so the prompt's last position feeds G predictions and
its gradient is their sum by autograd. ``spans`` locates each sample's tokens in them.

Which completions share. Within a group, completions share when they continue the same
prompt ids (``data.variants`` members may answer different renderings: each rendering shares
on its own) and, when the engine returned MoE routing, the same prompt routing (R3 then
replays the prompt's routing once; a group whose copies routed differently cannot be replayed
exactly and trains as rows). A group whose shared unit exceeds the micro-batch's token
budget (``trainer.pack_tokens``, else ``micro_batch_size`` x the longest sample: the padded
path's largest micro-batch) trains as rows, packed into segment rows as root segments (an
ordinary packed sample). ``shared_groups`` counts both so the trainer reports
``train/shared_prefix_fraction``: the share of groups (of two or more completions) trained
with their prompt shared.

MoE routing from the engine is laid out per row position: the prompt's rows once (from the
member that fed the most of it), each completion's own rows after; a completion's last token
was never fed (``routing_valid`` False), as in the padded layout.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from megagrpo.model.routing import pad_routing
from megagrpo.model.shared_prefix import Segments
from megagrpo.trainer.batch import MicroBatch, Sample, _filtered, _seq_weights, plan_rows


@dataclass
class Unit:
    """What one row keeps together: a shared group (one prompt, several completions) or one
    sample on its own."""

    samples: list[Sample]
    shared: bool

    @property
    def prompt_len(self) -> int:
        return self.samples[0].prompt_len

    @property
    def tokens(self) -> int:
        """Row tokens it takes."""
        if not self.shared:
            return self.samples[0].length
        return self.prompt_len + sum(s.length - s.prompt_len for s in self.samples)


def _same_prompt_routing(members: list[Sample]) -> bool:
    """True when every member's engine routing agrees on the prompt positions it fed (or
    none carries routing)."""
    routes = [(s.routing, min(s.prompt_len, s.length - 1)) for s in members]
    if all(r is None for r, _ in routes):
        return True
    if any(r is None for r, _ in routes):
        return False
    src, _ = max(routes, key=lambda x: x[1])
    assert src is not None
    return all(torch.equal(r[:n], src[:n]) for r, n in routes if r is not None)


def plan_units(samples: Sequence[Sample], budget: int) -> tuple[list[Unit], int, int]:
    """The units of ``samples`` (module doc) in a deterministic order, with the number of
    groups trained shared and of groups that could share (two or more completions)."""
    by_group: dict[int, list[Sample]] = {}
    for s in samples:
        by_group.setdefault(s.group if s.group >= 0 else -1 - s.index, []).append(s)
    units: list[Unit] = []
    shared = shareable = 0
    for members in by_group.values():
        families: dict[tuple[int, ...], list[Sample]] = {}
        for s in members:
            families.setdefault(tuple(s.input_ids[: s.prompt_len]), []).append(s)
        whole = True  # every family of two or more completions trains shared
        for fam in families.values():
            unit = Unit(fam, shared=len(fam) > 1)
            if unit.shared and unit.tokens <= budget and _same_prompt_routing(fam):
                units.append(unit)
                continue
            whole = whole and len(fam) == 1
            units.extend(Unit([s], shared=False) for s in fam)
        if any(len(f) > 1 for f in families.values()):
            shareable += 1
            shared += int(whole)
    return units, shared, shareable


@dataclass
class _RowBuilder:
    """Accumulates one segment row."""

    ids: list[int]
    cu: list[int]
    parent: list[int]
    source: list[tuple[Sample, int]]
    """Per row token: (sample, its position in that sample's own ``input_ids``)."""
    loss_pos: list[int]
    targets: list[int]
    seq: list[int]
    samples: list[Sample]
    spans: list[tuple[int, int, int]]

    @classmethod
    def empty(cls) -> _RowBuilder:
        return cls([], [0], [], [], [], [], [], [], [])

    def segment(self, tokens: list[int], sources: list[tuple[Sample, int]], parent: int) -> int:
        self.ids.extend(tokens)
        self.source.extend(sources)
        self.cu.append(self.cu[-1] + len(tokens))
        self.parent.append(parent)
        return len(self.parent) - 1

    def completion(self, s: Sample, predicted_from: list[int]) -> None:
        """Sample ``s``'s completion tokens as loss tokens, token ``i`` predicted from row
        position ``predicted_from[i]``. An empty completion keeps one masked slot (outside
        its span), so every sample has a sequence id, as in the rows (the loss counts
        sequences by their ids: Dr.GRPO's normaliser, sequence weights)."""
        k, lo = len(self.samples), len(self.targets)
        self.samples.append(s)
        self.targets.extend(s.input_ids[s.prompt_len :])
        self.loss_pos.extend(predicted_from)
        self.seq.extend([k] * len(predicted_from))
        self.spans.append((0, lo, len(self.targets)))
        if not predicted_from:
            self.targets.append(0)
            self.loss_pos.append(self.cu[-1] - 1)
            self.seq.append(k)

    def add(self, unit: Unit) -> None:
        o, p = self.cu[-1], unit.prompt_len
        if not unit.shared:
            s = unit.samples[0]
            self.segment(list(s.input_ids), [(s, i) for i in range(s.length)], -1)
            self.completion(s, list(range(o + p - 1, o + s.length - 1)))
            return
        src = max(unit.samples, key=lambda s: (s.length, -s.index))  # fed the most prompt
        root = self.segment(list(src.input_ids[:p]), [(src, i) for i in range(p)], -1)
        for s in unit.samples:
            n = s.length - p
            start = self.cu[-1]
            if n:
                self.segment(list(s.input_ids[p:]), [(s, p + i) for i in range(n)], root)
            self.completion(s, ([o + p - 1] + list(range(start, start + n - 1)))[:n])


def _loss_tensors(b: _RowBuilder) -> dict[str, torch.Tensor]:
    n = len(b.targets)  # every sample has at least one slot (its masked one when empty)
    target = torch.zeros(n, dtype=torch.long)
    mask = torch.zeros(n, dtype=torch.float32)
    adv = torch.zeros(n, dtype=torch.float32)
    rollout = torch.zeros(n, dtype=torch.float32)
    seq = torch.zeros(n, dtype=torch.long)
    index = torch.zeros(n, dtype=torch.long)
    if b.targets:
        target[:] = torch.tensor(b.targets)
        seq[:] = torch.tensor(b.seq)
        index[:] = torch.tensor(b.loss_pos)
    for s, (_, lo, hi) in zip(b.samples, b.spans):
        mask[lo:hi] = 0.0 if s.excluded else 1.0
        adv[lo:hi] = s.advantage
        if len(s.rollout_logprobs) == hi - lo:
            rollout[lo:hi] = torch.tensor(s.rollout_logprobs, dtype=torch.float32)
    return {
        "target": target,
        "mask": mask,
        "adv": adv,
        "rollout": rollout,
        "seq": seq,
        "index": index,
    }


def _row_routing(b: _RowBuilder, t: int) -> tuple[torch.Tensor | None, torch.Tensor]:
    """``([1, t, layers, k]`` engine routing or None, ``[1, t]`` fed positions)."""
    valid = torch.zeros((1, t), dtype=torch.bool)
    for r, (s, i) in enumerate(b.source):
        valid[0, r] = i < s.length - 1
    routes = [s.routing for s in b.samples]
    if not routes or any(r is None for r in routes):
        return None, valid
    first = routes[0]
    assert first is not None
    out = pad_routing(first.new_zeros((1, 0, *first.shape[1:])), t).clone()
    for r, (s, i) in enumerate(b.source):
        assert s.routing is not None
        if s.routing.shape[0] != s.length - 1 or s.routing.shape[1:] != first.shape[1:]:
            raise ValueError(
                f"sample {s.index}: routing {tuple(s.routing.shape)} does not fit its "
                f"{s.length} tokens ([L - 1, layers, k])"
            )
        if i < s.length - 1:
            out[0, r] = s.routing[i]
    return out, valid


def segment_row(units: Sequence[Unit], pad_id: int, pad_to_multiple: int = 1) -> MicroBatch:
    """One micro-batch: ``units`` in a segment row, padded to ``pad_to_multiple`` tokens."""
    b = _RowBuilder.empty()
    for u in units:
        b.add(u)
    total = b.cu[-1]
    t = total + (-total) % pad_to_multiple
    ids = torch.full((1, t), pad_id, dtype=torch.long)
    ids[0, :total] = torch.tensor(b.ids, dtype=torch.long)
    segments = Segments(tuple(b.cu), tuple(b.parent))
    loss = _loss_tensors(b)
    routing, valid = _row_routing(b, t)
    return MicroBatch(
        ids,
        segments.padded(t).positions()[None],
        loss["target"][None],
        loss["mask"][None],
        loss["adv"][None],
        loss["rollout"][None],
        [s.index for s in b.samples],
        seq_ids=loss["seq"][None],
        routing=routing,
        routing_valid=valid,
        seq_weights=_seq_weights(b.samples),
        filtered_tokens=_filtered(b.samples)[0],
        filtered_nonempty=_filtered(b.samples)[1],
        spans=b.spans,
        segments=segments,
        loss_index=loss["index"],
    )


def row_budget(samples: Sequence[Sample], micro_batch_size: int, pack_tokens: int) -> int:
    """Tokens of one segment row: ``pack_tokens`` when packing, else what the padded path's
    largest micro-batch holds (``micro_batch_size`` x the longest sample)."""
    if pack_tokens:
        return pack_tokens
    return micro_batch_size * max((s.length for s in samples), default=1)


def shared_micro_batches(
    samples: Sequence[Sample], budget: int, pad_id: int = 0, pad_to_multiple: int = 1
) -> list[MicroBatch]:
    """Segment-row micro-batches of ``samples`` (this rank's share of the batch, from
    :func:`~megagrpo.trainer.batch.build_samples`), each at most ``budget`` tokens before
    padding; the first row carries the groups' shared counts (``shared_groups``)."""
    units, shared, shareable = plan_units(samples, budget)
    rows = plan_rows([u.tokens for u in units], budget)
    mbs = [segment_row([units[i] for i in row], pad_id, pad_to_multiple) for row in rows]
    if mbs:
        mbs[0].shared_groups = (shared, shareable)
    return mbs


def unshared_tokens(samples: Sequence[Sample]) -> int:
    """Tokens the rows would compute (every sample in full): the saving's reference."""
    return sum(s.length for s in samples)
