"""A cheap fingerprint of a model directory's base weights, so that a checkpoint's LoRA is
never resumed, exported or evaluated on other base weights found under the same path.

A checkpoint recorded only the path; rebuilding the weights under it (another download,
another conversion, a fine-tuned copy, a LoRA merged back into the base) resumed silently,
the adapter now trained on a model it was not made for. :func:`base_fingerprint` reads,
without loading any tensor:

- ``config.json`` and ``model.safetensors.index.json`` (hashed whole);
- every ``*.safetensors`` file's size and its JSON header (tensor names, dtypes, shapes and
  offsets: a few kilobytes per shard);
- :data:`PROBE_BYTES` of *every* tensor's data, at a position fixed by the tensor's name: a
  change of any whole tensor (a merged LoRA rewrites every value of the matrices it adapts)
  shows;
- every tensor *family* (the name with its layer and expert numbers taken out: each
  attention projection, norm, router, expert projection, the embeddings, the head):
  :data:`FAMILY_PICKS` members spread over the layers, :data:`SAMPLE_BYTES` from the start
  and the end of each one's data.

Cost at Qwen3-235B-A22B (``tools/bench_fingerprint.py`` builds a directory of its shape:
110 shards of 4 GB, 36,945 tensors, a 3.2 MB index): 110 header reads, 36,945 probes of 64
bytes (one random read each, read-ahead off) and 3 ends of each of the ~20 families: about
13 MB read, under a second from the page cache (a few seconds from a cold local NVMe disk);
SHA-256 of every byte instead: 12-20 minutes. What it cannot see: an edit of a few weights
in place away from every probe. Version 1 (16 tensors from the start of the sorted list:
blind to an in-place change of, e.g., one layer's attention) is still computed to compare
with the fingerprints of older checkpoints (:func:`changed`).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import struct
import zlib
from pathlib import Path
from typing import Any

VERSION = 2
"""What :func:`base_fingerprint` computes (1: the sample of 16 tensors; 2: every tensor)."""
SAMPLED_TENSORS = 16
"""Version 1: tensors whose data bytes are sampled."""
SAMPLE_BYTES = 32 << 10
"""Bytes read from the start and from the end of each sampled tensor's data."""
PROBE_BYTES = 64
"""Version 2: bytes of every tensor's data read at a position fixed by its name."""
FAMILY_PICKS = 3
"""Version 2: members of each tensor family (first, middle, last) sampled at both ends."""
MAX_HEADER = 100 << 20
"""A safetensors header larger than this is not read (the file is hashed by size only)."""
_NUMBER = re.compile(r"\.\d+(?=\.)")


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


Tensor = tuple[Path, int, str, int, int]
"""``(file, data start, name, lo, hi)`` of one tensor."""


def _tensors(files: list[tuple[Path, int, dict[str, Any]]]) -> list[Tensor]:
    """Every tensor with readable offsets, sorted by file, then name."""
    out = []
    for path, start, header in files:
        for name, spec in sorted(header.items()):
            offsets = spec.get("data_offsets") if isinstance(spec, dict) else None
            if name == "__metadata__" or not (isinstance(offsets, list) and len(offsets) == 2):
                continue
            try:
                lo, hi = (int(v) for v in offsets)
            except (TypeError, ValueError):
                continue
            out.append((path, start, name, lo, hi))
    return out


def _ends(fh: Any, start: int, name: str, lo: int, hi: int, h: Any) -> None:
    """Hash :data:`SAMPLE_BYTES` from both ends of one tensor's data."""
    for at in sorted({lo, max(lo, hi - SAMPLE_BYTES)}):
        fh.seek(start + at)
        h.update(name.encode() + fh.read(max(0, min(SAMPLE_BYTES, hi - at))))


def _sample_v1(files: list[tuple[Path, int, dict[str, Any]]], h: Any) -> int:
    """Version 1: both ends of :data:`SAMPLED_TENSORS` tensors taken every ``len // 16``
    from the start of the sorted list; returns how many were read."""
    tensors = _tensors(files)
    if not tensors:
        return 0
    step = max(1, len(tensors) // SAMPLED_TENSORS)
    picked = tensors[::step][:SAMPLED_TENSORS]
    for path, start, name, lo, hi in picked:
        with open(path, "rb") as fh:
            _ends(fh, start, name, lo, hi, h)
    return len(picked)


def family(name: str) -> str:
    """A tensor's family: its name with the layer and expert numbers replaced by ``*``."""
    return _NUMBER.sub(".*", name)


def _sample(files: list[tuple[Path, int, dict[str, Any]]], h: Any) -> tuple[int, int]:
    """Version 2: :data:`PROBE_BYTES` of every tensor, both ends of :data:`FAMILY_PICKS`
    members of every family; returns ``(tensors probed, families)``."""
    tensors = _tensors(files)
    families: dict[str, list[Tensor]] = {}
    for t in tensors:
        families.setdefault(family(t[2]), []).append(t)
    picked = set()
    for members in families.values():
        last = len(members) - 1
        spread = {round(i * last / max(1, FAMILY_PICKS - 1)) for i in range(FAMILY_PICKS)}
        picked.update(members[i][2] for i in spread)
    by_file: dict[Path, list[Tensor]] = {}
    for t in tensors:
        by_file.setdefault(t[0], []).append(t)
    for path, items in by_file.items():
        with open(path, "rb", buffering=0) as fh:  # no read buffer: each probe reads 64 B
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fh.fileno(), 0, 0, os.POSIX_FADV_RANDOM)  # no read-ahead
            for _, start, name, lo, hi in sorted(items, key=lambda t: t[3]):
                span = max(0, hi - lo - PROBE_BYTES)
                at = lo + (zlib.crc32(name.encode()) % (span + 1))
                fh.seek(start + at)
                h.update(name.encode() + fh.read(max(0, min(PROBE_BYTES, hi - at))))
                if name in picked:
                    _ends(fh, start, name, lo, hi, h)
    return len(tensors), len(families)


def base_fingerprint(model_dir: str | os.PathLike, version: int = VERSION) -> dict[str, Any]:
    """``{"version", "bytes", "files", "sampled", "families", "sha256"}`` of ``model_dir``'s
    base weights (see module docstring); the same directory gives the same fingerprint, any
    rebuild another. ``version`` 1: the older fingerprint (no ``version`` key)."""
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
    if version == 1:
        return {
            "bytes": total,
            "files": len(files),
            "sampled": _sample_v1(files, h),
            "sha256": h.hexdigest(),
        }
    h.update(f"fingerprint v{version}".encode())
    sampled, families = _sample(files, h)
    return {
        "version": version,
        "bytes": total,
        "files": len(files),
        "sampled": sampled,
        "families": families,
        "sha256": h.hexdigest(),
    }


def changed(saved: Any, model_dir: str | os.PathLike | None, now: Any = None) -> str | None:
    """None when ``model_dir`` holds the base weights of fingerprint ``saved`` (a checkpoint's
    ``base``); else ``then: ...; now: ...`` for the message. ``now``: ``model_dir``'s
    fingerprint when already computed (recomputed when ``saved`` is of another version and
    ``model_dir`` is given)."""
    version = saved.get("version", 1) if isinstance(saved, dict) else None
    if version not in (1, VERSION):
        return f"its fingerprint is of an unknown version {version!r}"
    same_version = isinstance(now, dict) and now.get("version", 1) == version
    if not same_version and model_dir is not None:
        now = base_fingerprint(model_dir, version)
    if not isinstance(now, dict):
        now = {}
    if saved.get("sha256") == now.get("sha256"):
        return None
    return f"then: {describe(saved)}; now: {describe(now)}"


def describe(fp: Any) -> str:
    """One line for a fingerprint (or ``unknown``)."""
    if not isinstance(fp, dict):
        return "unknown"
    return (
        f"{fp.get('bytes', '?')} bytes in {fp.get('files', '?')} safetensors files, "
        f"sha256 {str(fp.get('sha256', '?'))[:12]}"
    )
