"""Byte-bounded buckets of a named-tensor stream: the one rule both sides of a weight sync
use (the trainer's export and the engine's load)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch


def byte_buckets(
    named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Group ``(name, tensor)`` pairs, in order, into buckets of at most ``bucket_bytes``;
    a single larger tensor forms its own bucket. Lazy: one bucket is held at a time."""
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in named_tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket
