"""The planner calibrated on the user's cluster: ``tools/measure_cluster.py`` times the terms the
step time hangs on and writes a JSON; :func:`hardware_from_file` turns it into the
:class:`~megagrpo.plan.scenario.Hardware` that ``megagrpo plan-memory --hw-file`` plans with,
and :func:`comparison` into the measured-vs-planned lines ``megagrpo report --hw-file`` prints.

The file (version :data:`VERSION`)::

    {"version": 1, "tool": "tools/measure_cluster.py", "backend": "nccl", "device": "...",
     "world": 16, "gpus_per_node": 8, "config": "...",
     "measurements": [{"name": ..., "op": "all_gather", "group": "engine", "ranks": 16,
                       "nodes": 2, "bytes": ..., "seconds": ..., "busbw_gb_s": ...}, ...],
     "hardware": {"ib_latency_us": ..., "ring_busbw_gb_s": ..., ...}}

``hardware`` holds only :class:`Hardware` fields (:func:`derive_hardware` computes them from
``measurements``); a measured field is a point for the bands (:mod:`megagrpo.plan.ranges`).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from megagrpo.errors import ConfigError
from megagrpo.plan.links import RING_ANCHORS
from megagrpo.plan.scenario import Assumptions, Hardware

VERSION = 1

RING_OPS = ("all_gather", "reduce_scatter", "all_reduce")


def moved_bytes(op: str, nbytes: float, ranks: int) -> float:
    """Bytes one rank moves over its link in ``op`` of a ``nbytes`` message (all-gather:
    the gathered output; reduce-scatter: the input; all-reduce: the tensor; all-to-all: what
    it sends) over ``ranks`` ranks: nccl-tests' bus-bandwidth factors."""
    if ranks <= 1:
        return 0.0
    frac = (ranks - 1) / ranks
    return nbytes * frac * (2.0 if op == "all_reduce" else 1.0)


def fit_ring(points: list[tuple[float, float]]) -> tuple[float, float]:
    """``(latency s, bus bandwidth bytes/s)`` of ``t = L + b / B`` through the smallest and
    the largest of ``(bytes moved, seconds)`` points; one point (or a non-physical fit):
    the bandwidth of the largest, the latency what the smallest has left over (>= 0)."""
    pts = sorted(points)
    (b1, t1), (b2, t2) = pts[0], pts[-1]
    bw = b2 / t2 if t2 > 0 else 0.0
    if len(pts) > 1 and t2 > t1 and b2 > b1:
        bw = (b2 - b1) / (t2 - t1)
    lat = max(0.0, t1 - b1 / bw) if bw > 0 else t1
    return lat, bw


def derive_hardware(measurements: list[dict[str, Any]], gpus_per_node: int) -> dict[str, float]:
    """The :class:`Hardware` fields the measurements determine (module doc): per kind of
    group, ring latency (scaled to the 7- / 15-hop anchors) and bus bandwidth, the all-to-all
    rate across nodes, HBM copy bandwidth, host copies per GPU with the node copying."""
    out: dict[str, float] = {}
    rings: dict[tuple[bool, int], list[tuple[float, float]]] = {}
    for m in measurements:
        op, n = m["op"], int(m.get("ranks", 1))
        if op in RING_OPS and n > 1:
            across = int(m.get("nodes", 1)) > 1
            rings.setdefault((across, n), []).append((moved_bytes(op, m["bytes"], n), m["seconds"]))
    for (across, n), pts in sorted(rings.items()):
        lat, bw = fit_ring(pts)
        anchor = RING_ANCHORS[1] if across else RING_ANCHORS[0]
        prefix = "ib" if across else "nvlink"
        out[f"{prefix}_latency_us"] = lat * 1e6 * anchor / (n - 1)
        if bw > 0:
            out["ring_busbw_gb_s" if across else "nvlink_busbw_gb_s"] = bw / 1e9
    a2a = [m for m in measurements if m["op"] == "all_to_all" and int(m.get("nodes", 1)) > 1]
    if a2a:
        big = max(a2a, key=lambda m: m["bytes"])
        n = int(big["ranks"])
        inter = max(0.0, 1 - (min(n, gpus_per_node) - 1) / (n - 1)) if n > 1 else 0.0
        if big["seconds"] > 0 and inter > 0:
            out["ib_alltoall_gb_s"] = big["bytes"] * (n - 1) / n * inter / big["seconds"] / 1e9
    for op, key in (("hbm_copy", "hbm_gb_s"),):
        rows = [m for m in measurements if m["op"] == op and m["seconds"] > 0]
        if rows:
            big = max(rows, key=lambda m: m["bytes"])
            out[key] = 2 * big["bytes"] / big["seconds"] / 1e9  # read + write
    host = [m for m in measurements if m["op"] in ("h2d", "d2h") and m["seconds"] > 0]
    if host:
        out["host_gb_s"] = min(m["bytes"] / m["seconds"] / 1e9 for m in host)
    return out


def read_measurements(path: str | Path) -> dict[str, Any]:
    """The JSON of ``tools/measure_cluster.py`` at ``path``; ConfigError naming the file and
    what is wrong (missing, not JSON, another version, an unknown hardware key)."""
    p = Path(path)
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError(f"--hw-file {p}: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise ConfigError(f"--hw-file {p}: not JSON ({str(exc)[:120]})") from None
    if not isinstance(data, dict) or data.get("version") != VERSION:
        raise ConfigError(
            f"--hw-file {p}: not a measure_cluster.py file of version {VERSION} "
            "(rerun tools/measure_cluster.py)"
        )
    hw = data.get("hardware")
    names = {f.name for f in dataclasses.fields(Hardware)}
    if not isinstance(hw, dict):
        raise ConfigError(f"--hw-file {p}: no 'hardware' object")
    for key, value in hw.items():
        if key not in names:
            raise ConfigError(f"--hw-file {p}: hardware key {key!r} is not one of {sorted(names)}")
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
            raise ConfigError(f"--hw-file {p}: hardware.{key} = {value!r} is not a positive number")
    return data


def hardware_from_file(path: str | Path, base: Hardware | None = None) -> Hardware:
    """``base`` (default :class:`Hardware`) with the measured fields of the file at ``path``."""
    data = read_measurements(path)
    return dataclasses.replace(
        base or Hardware(), **{k: float(v) for k, v in data["hardware"].items()}
    )


def measured_line(path: str | Path) -> str:
    """One line naming the measured figures a plan uses (``plan-memory --hw-file``)."""
    data = read_measurements(path)
    fields = ", ".join(f"{k}={v:.3g}" for k, v in data["hardware"].items())
    return (
        f"hardware measured by {data.get('tool', '?')} on {data.get('device', '?')} "
        f"({data.get('backend', '?')}, {data.get('world', '?')} ranks, "
        f"{data.get('measured_at', '?')}; {path}): {fields or 'nothing'}"
    )


def comparison(data: dict[str, Any], a: Assumptions | None = None) -> list[str]:
    """Lines of measured vs planned figures (``megagrpo report --hw-file``): what the planner
    assumes without the file (data sheet x efficiency, the ranged latencies) beside what was
    measured, and the training GEMM beside ``train_mfu`` x peak."""
    a = a or Assumptions()
    hw, got = Hardware(), data.get("hardware", {})
    per = int(data.get("gpus_per_node", 8))
    planned = {
        "hbm_gb_s": (hw.hbm_gb_s, "GB/s HBM (data sheet; decode reaches decode_hbm_eff of it)"),
        "host_gb_s": (hw.host_gb_s, "GB/s host copies per GPU, the node copying (15-40)"),
        "nvlink_latency_us": (hw.nvlink_latency_us, "us, 8-rank ring in a node (10-30)"),
        "ib_latency_us": (hw.ib_latency_us, "us, 16-rank ring over 2 nodes (20-80)"),
        "nvlink_busbw_gb_s": (hw.nvlink_gb_s * a.comm_eff, "GB/s ring bus bandwidth in a node"),
        "ring_busbw_gb_s": (
            min(hw.nvlink_gb_s, hw.ib_gb_s * per) * a.comm_eff,
            "GB/s ring bus bandwidth across nodes",
        ),
        "ib_alltoall_gb_s": (hw.ib_gb_s * a.comm_eff, "GB/s all-to-all per GPU across nodes"),
    }
    head = (
        f"cluster measured by {data.get('tool', '?')} ({data.get('backend', '?')}, "
        f"{data.get('device', '?')}, {data.get('world', '?')} ranks):"
    )
    lines = [head, f"  {'term':<22} {'planned':>10} {'measured':>10}  unit"]
    for key, (want, unit) in planned.items():
        meas = got.get(key)
        shown = f"{meas:>10.1f}" if isinstance(meas, (int, float)) else f"{'-':>10}"
        lines.append(f"  {key:<22} {want:>10.1f} {shown}  {unit}")
    for m in data.get("measurements", []):
        if m.get("op") == "gemm" and m.get("seconds", 0) > 0:
            tf = m["flops"] / m["seconds"] / 1e12
            lines.append(
                f"  {'gemm ' + m.get('name', ''):<22} {a.train_mfu * hw.bf16_tflops:>10.1f} "
                f"{tf:>10.1f}  TFLOP/s (planned: train_mfu x peak for the whole pass; "
                "measured: one GEMM at the model's shape, an upper bound)"
            )
    return lines
