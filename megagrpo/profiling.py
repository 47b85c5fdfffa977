"""Peak tensor memory of a call, counted from the allocator's own events (benchmarks).

    out, peak = allocator_peak_bytes(fn, *args)   # bytes above the level at the call

The peak resident set size of a process (``VmHWM``) depends on what the C library does with
freed pages and on the machine's other jobs (page reclaim, transparent huge pages), so two
readings of the same call can differ several-fold. Here every allocation and free of torch's
allocator during the call comes from ``torch.profiler`` (``profile_memory=True``: c10 reports
each one with its signed size); replayed in order, the running sum's maximum is the peak of
bytes held by tensors, the same on a loaded machine as on a quiet one. On CUDA
``torch.cuda.max_memory_allocated`` counts the same thing and needs no profiler.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def _allocations(results: Any, device_type: str) -> list[tuple[int, int, int]]:
    """(time ns, order, signed bytes) of every allocator event on ``device_type`` in the
    profiler's ``results``."""
    from torch._C._profiler import _EventType

    events: list[tuple[int, int, int]] = []
    stack = list(results.experimental_event_tree())
    while stack:
        node = stack.pop()
        if node.tag == _EventType.Allocation:
            fields = node.extra_fields
            if fields.device.type == device_type:
                events.append((node.start_time_ns, len(events), int(fields.alloc_size)))
        stack.extend(node.children)
    return sorted(events)


def allocator_peak_bytes(
    fn: Callable[..., Any], *args: Any, device_type: str = "cpu", **kwargs: Any
) -> tuple[Any, int]:
    """``fn(*args, **kwargs)`` and the peak bytes torch's ``device_type`` allocator held
    above its level when the call started (tensors freed during the call count while alive).

    The profiler is ``torch.autograd.profiler.profile`` (Kineto, CPU activity: the events of
    ``torch.profiler.profile(activities=[CPU], profile_memory=True)``), not the latter itself:
    its start imports ``torch._inductor`` to read one setting, ~3 CPU seconds per process
    (~10 s of wall time on a loaded 2-core machine) that a benchmark worker paid every run."""
    from torch.autograd.profiler import profile

    prof = profile(profile_memory=True, use_kineto=True)
    with prof:
        out = fn(*args, **kwargs)
    results = prof.kineto_results
    if results is None:  # set by the profiler's exit; None only if it did not run
        raise RuntimeError("the Kineto profiler returned no results")
    live = peak = 0
    for _, _, size in _allocations(results, device_type):
        live += size
        peak = max(peak, live)
    return out, peak
