"""What the base-weights fingerprint costs on a Qwen3-235B-A22B-shaped model directory.

Every checkpoint records :func:`megagrpo.model.fingerprint.base_fingerprint` of
``model.hf_path`` and ``--resume`` recomputes it, so it must stay cheap at 235B. This builds a
directory shaped like the real one (the tensor names and bf16 shapes of
``configs/qwen3_235b_a22b.hf_config.json``, packed into ~4 GB safetensors shards with real
headers and a ``model.safetensors.index.json``) as sparse files (no disk space used), then
prints side by side:

- the fingerprint: seconds and bytes read (headers, a probe of every tensor, both ends of a
  few members of every tensor family), and version 1 (16 tensors) it replaced;
- the naive alternative, SHA-256 of every byte: measured on 256 MB, extrapolated to the
  whole model (sparse files read from the page cache: a real disk is slower still).

``--quick``: the first 6 shards only (CI smoke run).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import struct
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from megagrpo import fileio  # noqa: E402
from megagrpo.model.arch import arch_from_hf, load_hf_config  # noqa: E402
from megagrpo.model.fingerprint import base_fingerprint  # noqa: E402
from megagrpo.model.hf_mapping import hf_weight_shapes  # noqa: E402

SHARD_BYTES = 4 << 30


def build(out: Path, max_shards: int | None) -> tuple[int, int, int]:
    """The sparse 235B-shaped directory; ``(shards, tensors, bytes)``."""
    hf = load_hf_config(ROOT / "configs" / "qwen3_235b_a22b.hf_config.json")
    fileio.write_text(out / "config.json", json.dumps(hf))
    shards: list[dict] = [{}]
    size = 0
    for name, shape in hf_weight_shapes(arch_from_hf(hf)).items():
        n = 2
        for d in shape:
            n *= d
        if size + n > SHARD_BYTES and shards[-1]:
            if max_shards and len(shards) >= max_shards:
                break
            shards.append({})
            size = 0
        shards[-1][name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [size, size + n]}
        size += n
    weight_map, total, tensors = {}, 0, 0
    for i, header in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        raw = json.dumps(header).encode()
        data = max(spec["data_offsets"][1] for spec in header.values())
        with open(out / fname, "wb") as fh:
            fh.write(struct.pack("<Q", len(raw)) + raw)
            fh.truncate(8 + len(raw) + data)  # sparse: no blocks allocated
        weight_map.update(dict.fromkeys(header, fname))
        total += 8 + len(raw) + data
        tensors += len(header)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    fileio.write_text(out / "model.safetensors.index.json", json.dumps(index))
    return len(shards), tensors, total


class _Counting:
    """Counts the bytes ``open(..., 'rb')`` reads while active."""

    def __init__(self) -> None:
        self.bytes = 0

    def __enter__(self) -> _Counting:
        import builtins

        self._open = builtins.open
        counter = self

        class Reader:
            def __init__(self, fh):
                self._fh = fh

            def __getattr__(self, name):
                return getattr(self._fh, name)

            def __enter__(self):
                return self

            def __exit__(self, *exc):
                self._fh.close()

            def read(self, *args):
                data = self._fh.read(*args)
                counter.bytes += len(data)
                return data

        def counting_open(file, mode="r", *args, **kwargs):
            fh = self._open(file, mode, *args, **kwargs)
            return Reader(fh) if "b" in mode and "r" in mode else fh

        builtins.open = counting_open
        return self

    def __exit__(self, *exc) -> None:
        import builtins

        builtins.open = self._open


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="the first 6 shards only")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="megagrpo-fp-") as tmp:
        out = Path(tmp)
        shards, tensors, total = build(out, 6 if args.quick else None)
        index_mb = (out / "model.safetensors.index.json").stat().st_size / 1e6
        with _Counting() as counted_v1:
            t0 = time.perf_counter()
            fp_v1 = base_fingerprint(out, version=1)
            t_v1 = time.perf_counter() - t0
        with _Counting() as counted:
            t0 = time.perf_counter()
            fp = base_fingerprint(out)
            t_fp = time.perf_counter() - t0
        first = sorted(out.glob("*.safetensors"))[0]
        h, chunk, probe = hashlib.sha256(), 8 << 20, 256 << 20
        t0 = time.perf_counter()
        with open(first, "rb") as fh:
            for _ in range(probe // chunk):
                h.update(fh.read(chunk))
        t_naive = (time.perf_counter() - t0) * total / probe
    print(f"Qwen3-235B-A22B-shaped directory: {shards} shards, {tensors} tensors, ")
    print(f"  {total / 1e9:.1f} GB of bf16 weights, index {index_mb:.2f} MB (sparse files)")
    print(
        f"fingerprint   {t_fp:8.3f} s   {counted.bytes / 1e6:8.1f} MB read  ({fp['sampled']} "
        f"tensors probed, {fp['families']} families at both ends, every header)"
    )
    print(
        f"fingerprint v1{t_v1:8.3f} s   {counted_v1.bytes / 1e6:8.1f} MB read  "
        f"({fp_v1['sampled']} tensors from the start of the sorted list: the version before)"
    )
    print(
        f"SHA-256 all   {t_naive:8.1f} s   {total / 1e6:8.0f} MB read  (measured on 256 MB, "
        "extrapolated)"
    )


if __name__ == "__main__":
    main()
