"""The weight stream of a sync: HF checkpoint names, byte buckets, a meter.

What every engine's ``update_weights`` / ``load_adapter`` does to the trainer's tensors before
they reach the engine: fused transformers-5 expert tensors split into per-expert checkpoint
names (:func:`to_checkpoint_format`), bucketed copies one bucket at a time
(:func:`iter_buckets`), counted (:class:`SyncMeter`).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator

import torch

from megagrpo.parallel.buckets import byte_buckets

_FUSED_EXPERTS = re.compile(r"^(.*\.mlp\.experts)\.(gate_up_proj|down_proj)$")


def to_checkpoint_format(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
) -> Iterator[tuple[str, torch.Tensor]]:
    """HF checkpoint names: split transformers-5 fused expert tensors into per-expert ones.

    ``...mlp.experts.gate_up_proj`` ``[E, 2I, H]`` -> ``...experts.{e}.gate_proj.weight``
    ``[I, H]`` (first half) and ``up_proj.weight`` (second half); ``...experts.down_proj``
    ``[E, H, I]`` -> ``...experts.{e}.down_proj.weight`` ``[H, I]``. Other names pass through.
    Yields views (no copies).
    """
    for name, tensor in named_tensors:
        m = _FUSED_EXPERTS.match(name)
        if m is None:
            yield name, tensor
            continue
        prefix, kind = m.groups()
        for e in range(tensor.shape[0]):
            if kind == "gate_up_proj":
                half = tensor.shape[1] // 2
                yield f"{prefix}.{e}.gate_proj.weight", tensor[e, :half]
                yield f"{prefix}.{e}.up_proj.weight", tensor[e, half:]
            else:
                yield f"{prefix}.{e}.down_proj.weight", tensor[e]


def iter_buckets(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    bucket_bytes: int,
    dtype: torch.dtype | None = None,
    device: str | torch.device = "cpu",
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Group a tensor stream into buckets of at most ``bucket_bytes`` (after casting to
    ``dtype`` on ``device``); a single larger tensor forms its own bucket.

    Only one bucket is materialised at a time, so a sync never holds a second full copy of
    the model. Tensors are detached, contiguous copies the engine may keep.
    """

    def copies() -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in named_tensors:
            t = tensor.detach().to(device=device, dtype=dtype or tensor.dtype).contiguous()
            if t.data_ptr() == tensor.data_ptr():
                t = t.clone()  # never hand the engine the trainer's own storage
            yield name, t

    yield from byte_buckets(copies(), bucket_bytes)


class SyncMeter:
    """Counts what flows through a bucketed sync stream (tensors, buckets, bytes)."""

    def __init__(self) -> None:
        self.bytes = 0
        self.num_tensors = 0
        self.num_buckets = 0
        self.max_bucket_bytes = 0

    def stream(
        self, buckets: Iterable[list[tuple[str, torch.Tensor]]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Flatten buckets into (name, tensor) pairs while counting them."""
        for bucket in buckets:
            nbytes = sum(t.numel() * t.element_size() for _, t in bucket)
            self.num_buckets += 1
            self.max_bucket_bytes = max(self.max_bucket_bytes, nbytes)
            self.bytes += nbytes
            self.num_tensors += len(bucket)
            yield from bucket


def resolve_dtype(name: str, checkpoint_dtype: torch.dtype | None = None) -> torch.dtype:
    """Config dtype string -> torch dtype ("auto": the checkpoint's, else float32)."""
    if name == "auto":
        return checkpoint_dtype or torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def observed(
    stream: Iterable[tuple[str, torch.Tensor]], observe: Callable[[str, torch.Tensor], object]
) -> Iterator[tuple[str, torch.Tensor]]:
    """``stream`` unchanged, ``observe(name, tensor)`` called on each pair as it passes."""
    for name, tensor in stream:
        observe(name, tensor)
        yield name, tensor
