"""A cheap fingerprint of a model directory's base weights, so that a checkpoint's LoRA is
never resumed on other base weights found under the same ``model.hf_path``.

A checkpoint recorded only the path; rebuilding the weights under it (another download,
another conversion, a fine-tuned copy) resumed silently, the adapter now trained on a model it
was not made for. :func:`base_fingerprint` reads, without loading any tensor:

- ``config.json`` and ``model.safetensors.index.json`` (hashed whole);
- every ``*.safetensors`` file's size and its JSON header (tensor names, dtypes, shapes and
  offsets: a few kilobytes per shard);
- a deterministic sample of :data:`SAMPLED_TENSORS` tensors spread over the files (by sorted
  name), :data:`SAMPLE_BYTES` from the start and the end of each tensor's data.

Cost at Qwen3-235B-A22B (``tools/bench_fingerprint.py`` builds a directory of its shape:
110 shards of 4 GB, 36,945 tensors, a 3.2 MB index): 110 opens and header reads plus 16
tensors' ends, about 9 MB read in all, 0.3 s (a loaded 2-core machine, page cache); SHA-256
of every byte instead: 12-20 minutes. What it cannot see: a change confined to bytes of
tensors outside the sample with identical sizes and headers (an edit of a few weights in
place); any rebuild, re-download of another revision, conversion or fine-tune changes the
sampled bytes.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path
from typing import Any

SAMPLED_TENSORS = 16
"""Tensors whose data bytes are sampled."""
SAMPLE_BYTES = 32 << 10
"""Bytes read from the start and from the end of each sampled tensor's data."""
MAX_HEADER = 100 << 20
"""A safetensors header larger than this is not read (the file is hashed by size only)."""


def _header(path: Path) -> tuple[int, dict[str, Any], bytes]:
    """``(data offset, header dict, raw header bytes)`` of a safetensors file; ``(0, {}, b"")``
    when it has none readable."""
    with open(path, "rb") as fh:
        head = fh.read(8)
        if len(head) < 8:
            return 0, {}, b""
        (n,) = struct.unpack("<Q", head)
        if n > MAX_HEADER:
            return 0, {}, b""
        raw = fh.read(n)
    try:
        header = json.loads(raw)
    except (ValueError, RecursionError):
        return 0, {}, raw
    return 8 + n, header if isinstance(header, dict) else {}, raw


def _sample(files: list[tuple[Path, int, dict[str, Any]]], h: Any) -> int:
    """Hash :data:`SAMPLE_BYTES` from both ends of :data:`SAMPLED_TENSORS` tensors spread
    evenly over all tensors (sorted by file, then name); returns how many were read."""
    tensors = [
        (path, start, name, spec)
        for path, start, header in files
        for name, spec in sorted(header.items())
        if name != "__metadata__" and isinstance(spec, dict)
    ]
    if not tensors:
        return 0
    step = max(1, len(tensors) // SAMPLED_TENSORS)
    picked = tensors[::step][:SAMPLED_TENSORS]
    for path, start, name, spec in picked:
        offsets = spec.get("data_offsets")
        if not (isinstance(offsets, list) and len(offsets) == 2):
            continue
        lo, hi = (int(v) for v in offsets)
        with open(path, "rb") as fh:
            for at in sorted({lo, max(lo, hi - SAMPLE_BYTES)}):
                fh.seek(start + at)
                h.update(name.encode() + fh.read(min(SAMPLE_BYTES, hi - at)))
    return len(picked)


def base_fingerprint(model_dir: str | os.PathLike) -> dict[str, Any]:
    """``{"bytes", "files", "sampled", "sha256"}`` of ``model_dir``'s base weights (see module
    docstring); the same directory gives the same fingerprint, any rebuild another."""
    root = Path(model_dir)
    h = hashlib.sha256()
    for name in ("config.json", "model.safetensors.index.json"):
        f = root / name
        if f.is_file():
            with open(f, "rb") as fh:
                h.update(name.encode() + fh.read())
        else:
            h.update(name.encode() + b"-")
    files = []
    total = 0
    for path in sorted(root.glob("*.safetensors")):
        size = path.stat().st_size
        start, header, raw = _header(path)
        h.update(f"{path.name}:{size}:".encode() + hashlib.sha256(raw).digest())
        files.append((path, start, header))
        total += size
    for path in sorted(p for ext in ("*.bin", "*.pt", "*.gguf") for p in root.glob(ext)):
        size = path.stat().st_size  # other weight formats: by name and size
        h.update(f"{path.name}:{size}".encode())
        total += size
    sampled = _sample(files, h)
    return {"bytes": total, "files": len(files), "sampled": sampled, "sha256": h.hexdigest()}


def describe(fp: Any) -> str:
    """One line for a fingerprint (or ``unknown``)."""
    if not isinstance(fp, dict):
        return "unknown"
    return (
        f"{fp.get('bytes', '?')} bytes in {fp.get('files', '?')} safetensors files, "
        f"sha256 {str(fp.get('sha256', '?'))[:12]}"
    )
