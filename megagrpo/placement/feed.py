"""The adapter from the trainer ranks that own it straight to every engine rank (placement
separate, ``trainer.weight_sync: adapter``).

The adapter's full HF factors are cut into buckets (:func:`megagrpo.model.peft_export` order:
dense then expert units, at most ``rollout.sync_bucket_mb`` each). Each bucket is summed over
the model-parallel group that owns it (the group of trainer rank 0's data-parallel copy;
expert factors: its expert-model-parallel group) onto one member, a different member per
bucket in turn, and that member sends it to every engine rank: no single trainer rank gathers
the adapter, and a bucket stays on the compute device from the owners' shards to the engine
(NCCL reduce, NCCL send; strict mode checks it on CPU).

The engine rank learns from the push header where each bucket comes from (the
:class:`FeedBucket` manifest, built identically on every trainer rank), receives them in order
and rebuilds the PEFT state dict that :meth:`megagrpo.model.Policy.stream_adapter` would have
built (same names, vLLM's per-expert layout: :func:`megagrpo.model.peft_export.peft_tensors`),
in host memory, keeping only the experts it holds under vLLM expert parallelism: every bucket
still reaches every engine rank (each drops the other ranks' experts as the bucket arrives).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megagrpo.model.hf_mapping import hf_weight_shapes
from megagrpo.model.peft_export import (
    _buckets,
    _fill_bucket,
    check_exportable,
    lora_target,
    peft_tensors,
)
from megagrpo.placement.bridge import FEED, Channel
from megagrpo.rollout.lora import PeftAdapter, expert_of


@dataclass(frozen=True)
class FeedBucket:
    """One bucket of the adapter: the trainer rank that sends it, its units (HF weight name,
    shape ``[out, in]``) and the dtype of its flat buffer (``A [r, in]`` then ``B [out, r]``
    per unit)."""

    owner: int
    units: tuple[tuple[str, tuple[int, int]], ...]
    dtype: str

    def numel(self, rank: int) -> int:
        return sum(rank * (out + inp) for _, (out, inp) in self.units)


def feed_adapter(
    policy, dtype: torch.dtype, bucket_mb: float, send: Callable[[torch.Tensor], None]
) -> list[FeedBucket]:
    """Collective over the trainer ranks: every bucket summed onto its owner, which hands it
    to ``send`` (to every engine rank). Returns the manifest (identical on the ranks of rank
    0's model-parallel copy, empty on the others)."""
    g, lc = policy.groups, policy.cfg.lora
    check_exportable(lc, policy.arch.is_moe, "per_expert")
    units = [
        (name, shape, *hit)
        for name, shape in hf_weight_shapes(policy.arch).items()
        if (hit := lora_target(name, lc.targets)) is not None
    ]
    itemsize = torch.empty((), dtype=dtype).element_size()
    max_elems = max(1, int(bucket_mb * 2**20) // itemsize)
    manifest: list[FeedBucket] = []
    for expert in (False, True):
        group = g.expert_mp if expert else g.mp
        size = dist.get_world_size(group)
        members = dist.get_process_group_ranks(group) if size > 1 else [g.rank]
        if 0 not in members:
            continue  # a data-parallel copy of what rank 0's group sends
        mine = [u for u in units if u[3] == expert]
        for k, bucket in enumerate(_buckets(mine, lc.rank, max_elems)):
            owner = members[k % len(members)]
            flat, _ = _fill_bucket(policy, bucket, dtype)
            if size > 1:
                dist.reduce(flat, dst=owner, group=group)
            shapes = tuple((u[0], (int(u[1][0]), int(u[1][1]))) for u in bucket)
            manifest.append(FeedBucket(owner, shapes, str(dtype).removeprefix("torch.")))
            if g.rank == owner:
                send(flat)
    return manifest


def receive_adapter(
    manifest: list[FeedBucket],
    channel_of: Callable[[int], Channel],
    rank: int,
    alpha: float,
    num_experts: int,
    experts: tuple[int, int] | None = None,
) -> tuple[PeftAdapter, int]:
    """The engine rank's side: every bucket of ``manifest`` from its owner
    (``channel_of(owner)``, on the channel's device), as the adapter
    :meth:`~megagrpo.model.Policy.stream_adapter` builds (rank ``rank``, ``alpha``), and the
    bytes received. ``experts``: the ``[lo, hi)`` experts this engine rank holds (vLLM expert
    parallelism: :func:`megagrpo.rollout.lora.expert_range`; None: all). As each bucket
    arrives its factors are copied to host memory, those of other experts dropped, and the
    device buffer released: the engine's GPU never holds more than one bucket of the adapter,
    and its host only this rank's share (audit 3 P1)."""
    lora: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    received = 0
    for b in manifest:
        flat = channel_of(b.owner).recv_tensor(FEED, b.numel(rank), getattr(torch, b.dtype))
        received += flat.numel() * flat.element_size()
        lora.update(_to_host(flat, b.units, rank, experts))
        del flat  # the next bucket reuses its memory
    state = peft_tensors(lora, num_experts, "per_expert")[0]  # vLLM's 2D MoE LoRA names
    return PeftAdapter.from_peft_state_dict(state, rank, alpha), received


def _to_host(
    flat: torch.Tensor,
    units: tuple[tuple[str, tuple[int, int]], ...],
    rank: int,
    experts: tuple[int, int] | None,
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Host copies of the factors ``A [r, in]``, ``B [out, r]`` of ``units`` in the received
    bucket ``flat`` (no view of it survives), those of experts outside ``experts`` left out."""
    out: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    at = 0
    for name, (rows, cols) in units:
        a, b = at, at + rank * cols
        at = b + rows * rank
        e = expert_of(name)
        if experts is None or e is None or experts[0] <= e < experts[1]:
            out[name] = (
                flat[a:b].view(rank, cols).to("cpu", copy=True),
                flat[b:at].view(rows, rank).to("cpu", copy=True),
            )
    return out
