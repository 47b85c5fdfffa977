"""Stream HF safetensors into this rank's shards, and gather shards back into HF tensors.

Import reads, file by file, only the slices this rank's plan asks for (safetensors slices are
memory-mapped reads), so no rank materialises the full model. Export yields full HF tensors
in bounded buckets (each tensor gathered over the group that holds one copy, by the
transport :mod:`megagrpo.model.sync_transport` describes).
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from megagrpo.errors import CheckpointError
from megagrpo.model.arch import Arch
from megagrpo.model.hf_mapping import Piece, hf_weight_shapes
from megagrpo.model.sync_transport import TRANSPORTS, Counter, ExportLayout, transported
from megagrpo.parallel.buckets import byte_buckets
from megagrpo.parallel.state import ParallelGroups

log = logging.getLogger(__name__)
# HF keys that are not weights of the model (or duplicates of one): skipped on import.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def _unreadable(path: str | Path, exc: BaseException) -> CheckpointError:
    return CheckpointError(
        f"{path}: unreadable safetensors file ({exc}); it is truncated or not safetensors "
        "(copy it again)"
    )


@contextmanager
def open_safetensors(path: str | Path) -> Iterator[Any]:
    """``safetensors.safe_open`` whose errors (corrupt header, truncated file, unreadable
    data) raise CheckpointError naming the file instead of a bare ``SafetensorError``."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            yield f
    except (SafetensorError, OSError) as exc:
        raise _unreadable(path, exc) from exc


def load_safetensors(path: str | Path) -> dict[str, torch.Tensor]:
    """``safetensors.torch.load_file`` naming the file on a corrupt or truncated file."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(str(path))
    except (SafetensorError, OSError) as exc:
        raise _unreadable(path, exc) from exc


def safetensors_files(hf_dir: str | Path) -> list[Path]:
    """The checkpoint's shard files (from the index when present). CheckpointError if none."""
    d = Path(hf_dir)
    index = d / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (KeyError, TypeError, AttributeError, ValueError) as exc:  # JSON/UTF-8 errors
            raise CheckpointError(f"{index}: not a safetensors index: {exc}") from exc
        files = [d / n for n in names]
    else:
        files = sorted(d.glob("*.safetensors"))
    missing = [str(f) for f in files if not f.is_file()]
    if missing or not files:
        raise CheckpointError(f"{d}: safetensors shard(s) missing: {missing or '*.safetensors'}")
    return files


def load_hf_weights(
    params: dict[str, torch.Tensor], plan: dict[str, list[Piece]], arch: Arch, hf_dir: str | Path
) -> dict[str, int]:
    """Copy this rank's slices of every HF tensor into ``params`` (Megatron name → tensor).

    Checks every HF key against the model (unknown keys, wrong shapes, missing tensors,
    uncovered Megatron elements all raise CheckpointError naming the tensor).
    Returns ``{"bytes_read": ..., "tensors": ...}``.
    """
    shapes = hf_weight_shapes(arch)
    seen: set[str] = set()
    covered = {name: 0 for pieces in plan.values() for name in {p.param for p in pieces}}
    bytes_read = 0
    for path in safetensors_files(hf_dir):
        with open_safetensors(path) as f:
            for key in f.keys():
                if key.endswith(_IGNORED_SUFFIXES) or (
                    key == "lm_head.weight" and arch.tie_word_embeddings
                ):
                    continue
                if key not in shapes:
                    raise CheckpointError(
                        f"{path.name}: tensor '{key}' is not a weight of this "
                        f"{arch.model_type} model"
                    )
                sl = f.get_slice(key)
                shape = tuple(sl.get_shape())
                if shape != shapes[key]:
                    raise CheckpointError(
                        f"{path.name}: tensor '{key}' has shape {shape}, "
                        f"config implies {shapes[key]}"
                    )
                seen.add(key)
                for piece in plan.get(key, []):
                    dst = params[piece.param]
                    src = sl[piece.src]
                    region = dst[piece.dst]
                    if tuple(region.shape) != tuple(src.shape):
                        raise CheckpointError(
                            f"'{key}' slice {tuple(src.shape)} does not fit "
                            f"'{piece.param}' region {tuple(region.shape)}"
                        )
                    with torch.no_grad():
                        region.copy_(src)
                    covered[piece.param] += src.numel()
                    bytes_read += src.numel() * src.element_size()
    unmapped = [n for n in params if n not in covered and ".adapter." not in n]
    if unmapped:
        raise CheckpointError(
            f"Megatron tensor '{unmapped[0]}' has no HF source (unsupported "
            "layer spec, e.g. legacy GroupedMLP?)"
        )
    missing = [k for k in shapes if k not in seen]
    if missing:
        raise CheckpointError(f"{hf_dir}: {len(missing)} tensor(s) missing, e.g. '{missing[0]}'")
    for name, n in covered.items():
        # the tied last-stage copy is covered too; every element must be written exactly once
        if n != params[name].numel():
            raise CheckpointError(
                f"Megatron tensor '{name}': {n} of {params[name].numel()} "
                "elements loaded (mapping error)"
            )
    return {"bytes_read": bytes_read, "tensors": len(seen)}


def export_hf_tensors(
    get_param: Callable[[str], torch.Tensor],
    plan: dict[str, list[Piece]],
    arch: Arch,
    groups: ParallelGroups,
    dtype: torch.dtype,
    bucket_bytes: int = 256 << 20,
    transport: str = "allreduce",
    layout: ExportLayout | None = None,
    counter: Counter | None = None,
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Yield full HF tensors ``[(hf_name, tensor)]`` in buckets of at most ``bucket_bytes``
    (a bigger single tensor gets a bucket of its own), on ``groups.device`` (GPU tensors
    under CUDA, ready for a colocated engine).

    ``get_param(megatron_name)`` returns the local tensor to export (merged LoRA or base).
    ``transport`` (:mod:`megagrpo.model.sync_transport`): ``allreduce`` and ``broadcast``
    yield every tensor, identical on every rank; ``sliced`` yields only the tensors this
    rank's engine needs, with the regions it needs filled. ``layout``: the owners / needs of
    :func:`~megagrpo.model.sync_transport.exchange_layout` (required unless allreduce).
    ``counter``: bytes sent / received by this rank are added to it.
    Collective: every rank must iterate the generator to the end.
    """
    shapes = hf_weight_shapes(arch)
    counter = counter or Counter()

    def local_pieces(name: str) -> list[torch.Tensor]:
        with torch.no_grad():
            return [
                get_param(p.param)[p.dst].to(groups.device, dtype).contiguous()
                for p in plan.get(name, [])
                if p.owner
            ]

    if transport == "allreduce":
        stream = _allreduced(shapes, plan, get_param, groups, dtype, counter)
    elif transport in TRANSPORTS:
        if layout is None:
            raise ValueError(f"transport {transport!r} needs the export layout")
        stream = transported(
            iter(shapes.items()), local_pieces, layout, groups, transport, dtype, counter
        )
    else:
        raise ValueError(f"unknown sync transport {transport!r} (one of {TRANSPORTS})")
    yield from byte_buckets(stream, bucket_bytes)


def _allreduced(shapes, plan, get_param, groups, dtype, counter) -> Iterator[tuple[str, Any]]:
    """Zero-fill + all-reduce over the tensor's group: every tensor on every rank."""
    for name, shape in shapes.items():
        pieces = [p for p in plan.get(name, []) if p.owner]
        expert = ".mlp.experts." in name
        group = groups.expert_mp if expert else groups.mp
        n = dist.get_world_size(group)
        with torch.no_grad():
            local = [get_param(p.param)[p.dst] for p in pieces]
            # pieces that cover the whole tensor (alone in the group): no zero fill needed
            covers = n == 1 and sum(t.numel() for t in local) == math.prod(shape)
            full = (torch.empty if covers else torch.zeros)(  # NCCL needs CUDA
                shape, dtype=dtype, device=groups.device
            )
            for p, t in zip(pieces, local):
                full[p.src] = t.to(groups.device, dtype)
        if n > 1:
            dist.all_reduce(full, group=group)
            # a ring all-reduce sends and receives 2 (n - 1) / n of the tensor per rank
            full_bytes = full.numel() * full.element_size()
            counter.sent += 2 * (n - 1) * full_bytes // n
            counter.received += 2 * (n - 1) * full_bytes // n
        yield name, full
