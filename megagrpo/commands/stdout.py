"""A command's stdout kept for what it prints itself (``--json``)."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def stdout_to_stderr(active: bool = True) -> Iterator[None]:
    """While active, file descriptor 1 is stderr: whatever the engine prints (vLLM's logger
    writes to stdout, its worker processes inherit the descriptor) stays off stdout, which
    then holds only what the command prints afterwards (``--json``)."""
    if not active:
        yield
        return
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        os.dup2(2, 1)
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)
