"""How merged HF tensors travel between the trainer's ranks (``trainer.sync_transport``).

Each HF tensor is split over the ranks of one group (``mp`` = TP x PP for dense tensors,
``expert_mp`` = ETP x EP x PP for experts) into *pieces* that exactly one rank owns
(:mod:`megagrpo.model.hf_mapping`). Three ways to bring them where they are needed:

``allreduce`` (the original): every rank zero-fills the full tensor, writes its pieces and
    all-reduces it over the group: every rank ends with every tensor, and a ring all-reduce
    moves ``2 (n-1)/n`` of its bytes through every rank.
``broadcast``: each owner broadcasts each of its pieces to the group; every rank ends with
    every tensor, ``(n-1)/n`` of its bytes received per rank (half of the above).
``sliced``: each rank says which regions of each tensor its engine holds (a
    :data:`RegionFn`: vLLM's TP / EP shard, the whole tensor for an HF engine, nothing on a
    rank without an engine); owners send exactly the intersections, point to point, and a
    rank only yields the tensors it needs (full-shaped, zero outside its regions: vLLM's
    loaders narrow a checkpoint tensor to their own shard and read nothing else). Pieces an
    engine needs from its own rank never leave it.

Every transport yields the same values in the regions a rank receives (``allreduce`` adds
zeros, which turns a -0.0 into +0.0; the others copy). Which ranks own what and which
regions every rank needs is exchanged once (:func:`exchange_layout`, one
``all_gather_object``) and cached by the caller.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, get_args

import torch
import torch.distributed as dist

from megagrpo.model.config import SyncTransport
from megagrpo.model.hf_mapping import Piece
from megagrpo.parallel.state import ParallelGroups

TRANSPORTS: tuple[str, ...] = get_args(SyncTransport)
Region = tuple[slice, ...]
RegionFn = Callable[[str, tuple[int, ...]], "list[Region] | None"]
"""``needs(hf_name, shape)``: the regions of the tensor this rank's engine holds (tuples of
slices over the leading dimensions, the rest whole); ``None``: all of it; ``[]``: nothing."""
Bounds = tuple[tuple[int, int], ...]


def bounds(region: tuple, shape: tuple[int, ...]) -> Bounds:
    """``region`` (slices, possibly fewer than dims) as ``((start, stop), ...)`` per dim."""
    out = []
    for d, size in enumerate(shape):
        s = region[d] if d < len(region) else slice(None)
        start, stop, step = s.indices(size)
        if step != 1:
            raise ValueError(f"region {region} has a step: only contiguous slices are supported")
        out.append((start, max(start, stop)))
    return tuple(out)


def _slices(b: Bounds) -> Region:
    return tuple(slice(s, e) for s, e in b)


def _numel(b: Bounds) -> int:
    n = 1
    for s, e in b:
        n *= e - s
    return n


def intersect(a: Bounds, b: Bounds) -> Bounds | None:
    """The common box of ``a`` and ``b`` (None when empty)."""
    out = tuple((max(s1, s2), min(e1, e2)) for (s1, e1), (s2, e2) in zip(a, b))
    return out if all(s < e for s, e in out) else None


def _relative(inner: Bounds, outer: Bounds) -> Region:
    return tuple(slice(s - o, e - o) for (s, e), (o, _) in zip(inner, outer))


@dataclass
class ExportLayout:
    """Who owns and who needs what, per HF tensor, for every rank (from
    :func:`exchange_layout`; identical on every rank)."""

    owners: list[dict[str, list[Bounds]]]
    """Per global rank: HF name -> the bounds of its owned pieces, in plan order."""
    needs: list[dict[str, list[Bounds]] | None] = field(default_factory=list)
    """Per global rank (sliced only): HF name -> bounds it needs (absent: nothing)."""


def _owned(plan: dict[str, list[Piece]], shapes: dict[str, tuple[int, ...]]) -> dict:
    return {
        name: [bounds(p.src, shape) for p in plan.get(name, []) if p.owner]
        for name, shape in shapes.items()
    }


def _needed(needs: RegionFn | None, shapes: dict[str, tuple[int, ...]]) -> dict:
    out = {}
    for name, shape in shapes.items():
        regions = None if needs is None else needs(name, shape)
        if regions is None:
            out[name] = [bounds((), shape)]
        elif regions:
            out[name] = [bounds(r, shape) for r in regions]
    return out


def exchange_layout(
    plan: dict[str, list[Piece]],
    shapes: dict[str, tuple[int, ...]],
    groups: ParallelGroups,
    transport: str,
    needs: RegionFn | None = None,
) -> ExportLayout:
    """Collective (one ``all_gather_object`` over the world): every rank's owned pieces and,
    for ``sliced``, its needed regions. ValueError names a tensor whose pieces do not cover
    it exactly once in some group (a mapping error: the export would be wrong)."""
    mine: dict[str, Any] = {"owned": _owned(plan, shapes)}
    if transport == "sliced":
        mine["needs"] = _needed(needs, shapes)
    world = dist.get_world_size() if dist.is_initialized() else 1
    everyone: list[Any] = [mine]
    if world > 1:
        everyone = [None] * world
        dist.all_gather_object(everyone, mine)
    layout = ExportLayout(
        owners=[e["owned"] for e in everyone],
        needs=[e.get("needs") for e in everyone],
    )
    for name, shape in shapes.items():
        group = groups.expert_mp if ".mlp.experts." in name else groups.mp
        covered = sum(_numel(b) for r in _ranks(group) for b in layout.owners[r].get(name, []))
        if covered != torch.Size(shape).numel():
            raise ValueError(
                f"HF tensor {name!r}: the owners in a group cover {covered} of "
                f"{torch.Size(shape).numel()} elements (mapping error)"
            )
    return layout


def _ranks(group) -> list[int]:
    if not dist.is_initialized():
        return [0]
    return sorted(dist.get_process_group_ranks(group))


def _me() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


class Counter:
    """Bytes this rank sent and received through an export (``sent``, ``received``)."""

    def __init__(self) -> None:
        self.sent = 0
        self.received = 0

    def add(self, t: torch.Tensor, sent: int = 0, received: int = 0) -> None:
        n = t.numel() * t.element_size()
        self.sent += sent * n
        self.received += received * n


@dataclass
class Exchange:
    """How one export moves HF tensors between ranks: who owns and needs which pieces, the
    wire dtype and device, and the byte counter. ``local``: this rank's owned pieces of a
    tensor in plan order, already in ``dtype`` on ``device``."""

    layout: ExportLayout
    dtype: torch.dtype
    device: torch.device
    counter: Counter

    def broadcast(
        self, name: str, shape: tuple[int, ...], local: list[torch.Tensor], group
    ) -> torch.Tensor:
        """The full tensor ``name`` on every rank of ``group``: each owner broadcasts its
        pieces."""
        layout, dtype, device, counter = self.layout, self.dtype, self.device, self.counter
        full = torch.empty(shape, dtype=dtype, device=device)
        me, ranks = _me(), _ranks(group)
        for r in ranks:
            for k, b in enumerate(layout.owners[r].get(name, [])):
                if r == me:
                    buf = local[k]
                else:
                    buf = torch.empty([e - s for s, e in b], dtype=dtype, device=device)
                if len(ranks) > 1:
                    dist.broadcast(buf, src=r, group=group)
                    counter.add(buf, sent=len(ranks) - 1 if r == me else 0, received=int(r != me))
                full[_slices(b)] = buf
        return full

    def sliced(
        self, name: str, shape: tuple[int, ...], local: list[torch.Tensor], group
    ) -> torch.Tensor | None:
        """The regions of ``name`` this rank needs (a full-shaped tensor, zero elsewhere;
        None when it needs none), each received from its owner point to point; this rank's
        own pieces are sent to the ranks of ``group`` that need them."""
        layout, dtype, device, counter = self.layout, self.dtype, self.device, self.counter
        me, ranks = _me(), _ranks(group)
        mine = (layout.needs[me] or {}).get(name, [])
        full = torch.zeros(shape, dtype=dtype, device=device) if mine else None
        ops, received = [], []
        tag = itertools.count()
        for r in ranks:
            for k, owned in enumerate(layout.owners[r].get(name, [])):
                for d in ranks:
                    for want in (layout.needs[d] or {}).get(name, []):
                        box = intersect(owned, want)
                        if box is None:
                            continue
                        t = next(tag)
                        if r == me and d == me:
                            assert full is not None
                            full[_slices(box)] = local[k][_relative(box, owned)]
                        elif r == me:
                            piece = local[k][_relative(box, owned)].contiguous()
                            ops.append(dist.P2POp(dist.isend, piece, d, group, t))
                            counter.add(piece, sent=1)
                        elif d == me:
                            buf = torch.empty([e - s for s, e in box], dtype=dtype, device=device)
                            ops.append(dist.P2POp(dist.irecv, buf, r, group, t))
                            received.append((box, buf))
                            counter.add(buf, received=1)
        if ops:
            for req in dist.batch_isend_irecv(ops):
                req.wait()
        for box, buf in received:
            assert full is not None
            full[_slices(box)] = buf
        return full


def warm_up_groups(groups: ParallelGroups) -> None:
    """One tiny all-reduce over ``mp`` and ``expert_mp`` (every rank of each takes part)
    before the sliced transport's ``batch_isend_irecv``: torch leaves a group's first
    collective undefined when it is a batched P2P call that only some of the group's ranks
    join (``torch.distributed.batch_isend_irecv`` docs), and the sliced transport's first
    exchange on ``expert_mp`` involves only the ranks that hold or need a tensor's pieces."""
    for group in (groups.mp, groups.expert_mp):
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(torch.zeros(1, device=groups.device), group=group)


def transported(
    names: Iterator[tuple[str, tuple[int, ...]]],
    local_pieces: Callable[[str], list[torch.Tensor]],
    layout: ExportLayout,
    groups: ParallelGroups,
    transport: str,
    dtype: torch.dtype,
    counter: Counter,
) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` for every HF tensor this rank receives under ``transport``
    (broadcast: all of them; sliced: the ones it needs), collective over the world."""
    ex = Exchange(layout, dtype, groups.device, counter)
    fn = ex.broadcast if transport == "broadcast" else ex.sliced
    if transport == "sliced":
        warm_up_groups(groups)
    for name, shape in names:
        group = groups.expert_mp if ".mlp.experts." in name else groups.mp
        t = fn(name, shape, local_pieces(name), group)
        if t is not None:
            yield name, t
