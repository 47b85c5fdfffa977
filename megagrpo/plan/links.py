"""Collectives as the step-time estimate bills them (`megagrpo plan-memory`): NCCL rings and
all-to-alls over NVLink and InfiniBand, per hop and per NIC (scale-audit-3 findings 4, 5a).

* **ring** all-gather / reduce-scatter / all-reduce over ``n`` ranks: ``n - 1`` hops of
  latency (:data:`Hardware.nvlink_latency_us` is 8 ranks of a node, 7 hops;
  :data:`Hardware.ib_latency_us` 16 ranks over two nodes, 15 hops; a ring of ``n`` takes
  ``(n - 1) / 7`` or ``(n - 1) / 15`` of it) plus the bytes each rank moves over its bus
  bandwidth: NVLink inside a node; across nodes NCCL's rings leave every node on all of its
  NICs (one 400 Gb/s HCA per GPU), so ``min(nvlink, ib x gpus_per_node)`` (NVIDIA/nccl-tests
  #160: the bus bandwidth "reflect[s] exactly what's going through the NICs"; multi-node H100
  all-reduce 400-450 GB/s at large sizes), at ``comm_eff`` of the line;
* **all-to-all** over ``n`` ranks: each GPU's traffic to other nodes leaves through its own
  NIC (``ib_gb_s``), to its node's GPUs over NVLink, in parallel; one latency.

A measured ``--hw-file`` (``tools/measure_cluster.py``) replaces the modelled rates
(``Hardware.ring_busbw_gb_s``, ``nvlink_busbw_gb_s``, ``ib_alltoall_gb_s``) and latencies.
"""

from __future__ import annotations

from megagrpo.plan.scenario import Assumptions, Hardware

RING_ANCHORS = (7, 15)
"""Hops of the rings the two latency figures are given for: 8 GPUs of a node, 16 of two."""


def latency_s(n: int, per_node: int, hw: Hardware) -> float:
    """Latency of one small ring collective over ``n`` ranks (module doc); 0 for one rank."""
    if n <= 1:
        return 0.0
    if n <= per_node:
        return hw.nvlink_latency_us * 1e-6 * (n - 1) / RING_ANCHORS[0]
    return hw.ib_latency_us * 1e-6 * (n - 1) / RING_ANCHORS[1]


def ring_bw(n: int, per_node: int, hw: Hardware, a: Assumptions) -> float:
    """Bus bandwidth (bytes/s per rank) of a ring collective over ``n`` ranks (module doc)."""
    if n <= per_node:
        measured = hw.nvlink_busbw_gb_s
        return (measured or hw.nvlink_gb_s * a.comm_eff) * 1e9
    if hw.ring_busbw_gb_s:
        return hw.ring_busbw_gb_s * 1e9
    return min(hw.nvlink_gb_s, hw.ib_gb_s * per_node) * a.comm_eff * 1e9


def ring_s(n: int, per_node: int, nbytes: float, hw: Hardware, a: Assumptions) -> float:
    """Seconds of one ring collective over ``n`` ranks in which each rank moves ``nbytes``
    (all-gather / reduce-scatter: ``(n - 1) / n`` of the gathered size; all-reduce: twice)."""
    if n <= 1:
        return 0.0
    return latency_s(n, per_node, hw) + nbytes / ring_bw(n, per_node, hw, a)


def alltoall_s(n: int, per_node: int, nbytes: float, hw: Hardware, a: Assumptions) -> float:
    """Seconds of one all-to-all over ``n`` ranks in which each rank sends ``nbytes`` to the
    others, evenly: the share to other nodes over its NIC, the rest over NVLink, in parallel."""
    if n <= 1:
        return 0.0
    inter = max(0.0, 1 - (min(n, per_node) - 1) / (n - 1))
    ib = (hw.ib_alltoall_gb_s or hw.ib_gb_s * a.comm_eff) * 1e9
    nv = (hw.nvlink_busbw_gb_s or hw.nvlink_gb_s * a.comm_eff) * 1e9
    lat = (hw.nvlink_latency_us if n <= per_node else hw.ib_latency_us) * 1e-6
    return max(nbytes * inter / ib, nbytes * (1 - inter) / nv) + lat


def nic_bw(hw: Hardware, a: Assumptions) -> float:
    """Bytes/s of one GPU's traffic to another node (its own NIC)."""
    return (hw.ib_alltoall_gb_s or hw.ib_gb_s * a.comm_eff) * 1e9


def link_bw(n: int, per_node: int, hw: Hardware, a: Assumptions) -> float:
    """Bytes/s per GPU of point-to-point traffic between ``n`` GPUs (one link each: NVLink
    inside a node, the GPU's NIC across nodes), at ``comm_eff``."""
    if n <= per_node:
        return (hw.nvlink_busbw_gb_s or hw.nvlink_gb_s * a.comm_eff) * 1e9
    return nic_bw(hw, a)
