"""Layouts the planner chooses between (`megagrpo plan-memory`): the engine's memory budget,
the trainer layouts a number of GPUs allows, and the split of a separate placement (engines
on whole nodes, the trainer's fastest fitting layout on the rest), with the memory checks they
must pass (host memory per node, the engines' own GPUs)."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

from megagrpo.plan.memory import GIB, engine_weight_bytes, memory_plan, shapes_of
from megagrpo.plan.scenario import Assumptions, Hardware, Scenario
from megagrpo.plan.time import split_placement, step_time, train_phase


def check_host_memory(mem: dict, a: Assumptions, hw: Hardware) -> None:
    """``mem["host"]["fits_node"]``: the pinned buffers of a node's GPUs leave ``headroom`` of
    its ``Hardware.host_memory_gib_per_node`` free; advice (and ``fits`` false) when not."""
    host = mem["host"]
    limit = (1 - a.headroom) * hw.host_memory_gib_per_node
    host["fits_node"] = host["pinned_gib_per_node"] <= limit
    host["node_gib"] = hw.host_memory_gib_per_node
    if not host["fits_node"]:
        mem["fits"] = False
        mem["advice"].append(
            f"pinned host memory {host['pinned_gib_per_node']:.0f} GiB per node is over "
            f"{limit:.0f} GiB ({1 - a.headroom:.0%} of cluster.host_memory_gib="
            f"{hw.host_memory_gib_per_node:.0f}; --hw host_memory_gib_per_node overrides): "
            "rollout.sleep_level=2 (merged sync), no trainer.offload_during_rollout, or more "
            "GPUs per model copy"
        )


def check_engine_gpus(mem: dict, sc: Scenario, a: Assumptions) -> None:
    """``placement=separate``: the engines' ``rollout_gpus`` GPUs hold the whole engine with
    no trainer beside it (``mem["engine_gpus"]``); ``fits`` false and advice when its
    weights leave no KV cache or its generate phase is over the limit; ``mem["engine"]``
    becomes the engine GPUs' replicas and KV cache."""
    _, engine = split_placement(sc)
    eng = memory_plan(engine, a)
    limit = (1 - a.headroom) * sc.gpu_memory_gib
    weights = engine_weight_bytes(shapes_of(sc.hf), engine) / GIB
    kv = eng["engine"]["kv_tokens_per_replica"]
    peak = eng["phase_peak_gib"]["generate"]
    fits = kv > 0 and peak <= limit
    mem["engine_gpus"] = {
        "gpus": sc.rollout_gpus,
        "vllm_tp": sc.vllm_tp,
        "weights_gib_per_gpu": round(weights, 2),
        "kv_tokens_per_replica": kv,
        "generate_gib": peak,
        "fits": fits,
    }
    mem["engine"] = eng["engine"]  # replicas and KV cache of the engine's own GPUs
    if not fits:
        mem["fits"] = False
        mem["advice"].append(
            f"rollout.placement=separate: the engines' {sc.rollout_gpus} GPU(s) hold "
            f"{weights:.0f} GiB of weights per GPU at vLLM tp={sc.vllm_tp} (no room for a KV "
            "cache): give the engines more GPUs (rollout.engine_ranks, a whole node at "
            "rollout.tensor_parallel_size=8) or place them colocated "
            "(rollout.placement=auto)"
        )


ENGINE_UTIL_CAP = 0.9
"""Largest ``rollout.gpu_memory_utilization`` the search gives an engine: the last 0.05 step
under vLLM 0.33's own default (``CacheConfig.gpu_memory_utilization`` 0.92,
``vllm/config/cache.py``), the share vLLM is tuned and tested at."""


def best_utilization(sc: Scenario, a: Assumptions) -> float | None:
    """The largest engine budget (0.05 steps, <= :data:`ENGINE_UTIL_CAP`) whose generate phase
    fits."""
    probe = memory_plan(sc.with_(gpu_memory_utilization=0.0), a)
    limit = (1 - a.headroom) * sc.gpu_memory_gib
    util = (limit - probe["phase_peak_gib"]["generate"]) / sc.gpu_memory_gib
    util = min(ENGINE_UTIL_CAP, math.floor(util * 20) / 20)
    return util if util > 0 else None


def trainer_layouts(sc: Scenario, gpus: int) -> Iterator[dict]:
    """Every trainer layout the search tries on ``gpus`` GPUs (module doc)."""
    s = shapes_of(sc.hf)
    tps = [t for t in (1, 2, 4, 8) if t <= sc.gpus_per_node and s.heads % t == 0 and s.kv % t == 0]
    pps = [p for p in (1, 2, 4, 8) if s.layers % p == 0]
    eps = [e for e in (1, 2, 4, 8, 16, 32, 64, 128) if not s.experts or s.experts % e == 0]
    for tp in tps:
        for pp in pps:
            for ep in eps if s.experts else [1]:
                if gpus % (tp * pp) == 0 and gpus % (ep * pp) == 0:
                    yield dict(tp=tp, pp=pp, ep=ep, etp=1, sequence_parallel=tp > 1)


def trainer_layout(sc: Scenario, a: Assumptions, hw: Hardware) -> dict[str, Any] | None:
    """The fastest trainer layout (TP 1/2/4/8 x PP dividing the layers x EP) whose train phase
    fits the trainer's GPUs of a separate placement; None when none does."""
    s = shapes_of(sc.hf)
    gpus = sc.num_gpus - sc.rollout_gpus
    limit = (1 - a.headroom) * sc.gpu_memory_gib
    best: tuple[float, dict[str, Any]] | None = None
    for tp in (t for t in (1, 2, 4, 8) if t <= sc.gpus_per_node and s.heads % t == 0):
        for pp in (p for p in (1, 2, 4, 8) if s.layers % p == 0 and gpus % (tp * p) == 0):
            for ep in (e for e in (1, 2, 4, 8, 16, 32, 64) if not s.experts or s.experts % e == 0):
                if gpus % (ep * pp):
                    continue
                layout = dict(tp=tp, pp=pp, ep=ep, etp=1, sequence_parallel=tp > 1)
                trainer, _ = split_placement(sc.with_(**layout))
                if memory_plan(trainer, a)["phase_peak_gib"]["train"] > limit:
                    continue
                t = train_phase(trainer, a, hw)["s"]
                if best is None or t < best[0]:
                    best = (t, layout)
    return best[1] if best else None


def engine_splits(sc: Scenario) -> list[int]:
    """GPUs the engines may take in a separate placement: whole nodes (1, a quarter, half,
    three quarters, all but one), or half of a single node."""
    per, nodes = sc.gpus_per_node, sc.num_gpus // sc.gpus_per_node
    if nodes < 2:
        return [sc.num_gpus // 2] if sc.num_gpus >= 2 else []
    picks = {1, nodes // 4, nodes // 2, (3 * nodes) // 4, nodes - 1}
    return sorted(k * per for k in picks if 1 <= k < nodes)


def separate_fit(sc: Scenario, a: Assumptions) -> tuple[bool, dict[str, float]]:
    """Whether the trainer's GPUs fit its train phase and the engines' GPUs their generate
    phase with a KV cache (each with ``headroom`` free), and those peaks."""
    trainer, engine = split_placement(sc)
    eng = memory_plan(engine, a)
    peaks = {
        "train": memory_plan(trainer, a)["phase_peak_gib"]["train"],
        "generate": eng["phase_peak_gib"]["generate"],
    }
    limit = (1 - a.headroom) * sc.gpu_memory_gib
    kv = eng["breakdown_gib"]["vllm_kv_cache"] > 0
    return kv and all(v <= limit for v in peaks.values()), peaks


def separate_layout(
    sc: Scenario, a: Assumptions, hw: Hardware
) -> tuple[Scenario, dict[str, Any], bool, dict[str, float]]:
    """The fastest fitting split of a separate placement (:func:`engine_splits`, the trainer's
    fastest layout on the rest, the engines' largest memory budget): ``(scenario, the fields
    chosen, fits, peaks)``; the first split's when none fits."""
    tried = []
    for gpus in engine_splits(sc) or [sc.rollout_gpus]:
        cur = sc.with_(rollout_gpus=gpus)
        chosen: dict[str, Any] = {"rollout_gpus": gpus}
        layout = trainer_layout(cur, a, hw)
        if layout is not None:
            cur = cur.with_(**layout)
            chosen.update(layout)
        util = best_utilization(split_placement(cur)[1], a)
        if util is not None:
            cur = cur.with_(gpu_memory_utilization=util)
            chosen["gpu_memory_utilization"] = util
        fits, peaks = separate_fit(cur, a)
        fits = fits and layout is not None
        t = step_time(cur, a, hw, {})["step_s"] if fits else math.inf
        tried.append((t, cur, chosen, fits, peaks))
    best = min(tried, key=lambda x: x[0]) if any(x[3] for x in tried) else tried[0]
    return best[1], best[2], best[3], best[4]


def separate_memory(sc: Scenario, a: Assumptions) -> dict:
    """The memory plan of a separate placement: the engines' GPUs' plan (their replicas and
    KV cache: ``engine``, ``engine_gpus``) with the phases of each side (``train`` on the
    trainer's GPUs, ``generate`` / ``sync`` / ``startup`` on the engines') and ``fits`` from
    both (each with ``headroom`` free, a KV cache on the engines)."""
    trainer, engine = split_placement(sc)
    mem = memory_plan(engine, a)
    train = memory_plan(trainer, a)
    peaks = dict(mem["phase_peak_gib"], train=train["phase_peak_gib"]["train"])
    mem["phase_peak_gib"] = peaks
    mem["per_gpu_gib"] = max(peaks.values())
    mem["layout"] = train["layout"] | {"engine_gpus": sc.rollout_gpus}
    check_engine_gpus(mem, sc, a)
    fits, _ = separate_fit(sc, a)
    limit = (1 - a.headroom) * sc.gpu_memory_gib
    mem["fits"] = bool(fits and mem["engine_gpus"]["fits"] and peaks["sync"] <= limit)
    mem["num_gpus"] = sc.num_gpus
    return mem
