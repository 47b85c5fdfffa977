"""megagrpo.profiling.allocator_peak_bytes: the peak of tensor bytes a call held, from the
allocator's own events, without the cost of torch.profiler.profile's start-up."""

from __future__ import annotations

import subprocess
import sys

import torch

from megagrpo.profiling import allocator_peak_bytes


def _known_peak() -> torch.Tensor:
    """Holds 4 MB + 8 MB at once (the peak), frees the 4 MB, then holds 8 MB + 2 MB."""
    a = torch.empty(1_000_000, dtype=torch.float32)  # 4,000,000 B
    b = torch.empty(1_000_000, dtype=torch.float64)  # 8,000,000 B
    del a
    c = torch.empty(500_000, dtype=torch.float32)  # 2,000,000 B
    del b
    return c


def test_peak_is_the_bytes_held_at_once():
    out, peak = allocator_peak_bytes(_known_peak)
    assert out.numel() == 500_000
    assert peak == 12_000_000  # byte for byte: 4 MB + 8 MB alive together


def test_peak_counts_bytes_above_the_level_at_the_call():
    held = torch.ones(2_000_000)  # 8 MB alive before the call are not the call's
    _, peak = allocator_peak_bytes(torch.zeros, 250_000, dtype=torch.float64)
    assert peak == 2_000_000
    del held


def test_no_inductor_import():
    """torch.profiler.profile's start imports torch._inductor (~3 CPU s, once per process:
    every bench_loss worker paid it); the allocator count must not. A fresh interpreter,
    because this one may have imported it for other tests."""
    code = (
        "import sys, torch\n"
        "from megagrpo.profiling import allocator_peak_bytes\n"
        "_, peak = allocator_peak_bytes(torch.ones, 1000)\n"
        "assert peak == 4000, peak\n"
        "print('torch._inductor' in sys.modules)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == "False"
