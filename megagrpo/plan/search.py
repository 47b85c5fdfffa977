"""The whole plan of a run (memory per phase + step time) and the fastest layouts for a number
of GPUs (`megagrpo plan-memory --gpus N`).

:func:`search` keeps the run's model, LoRA, batch, lengths, recompute and dynamic-sampling bill,
and tries:

* trainer layouts: TP in 1/2/4/8 inside a node, PP dividing the layers up to 8, EP dividing the
  experts, ETP 1;
* vLLM layouts (:data:`VLLM_LAYOUTS`): TP 1 lock-stepped (one vLLM, data-parallel replicas,
  experts over every GPU), TP 4 and TP 8 independent replicas per node, TP 16 replicas over
  two nodes; bf16 or FP8 weights;
* weight sync: the adapter streamed into the engines' LoRA slots, or merged weights sliced;
* partial rollouts off / on (the config's settings, or ``rollout.partial``'s defaults);
* placement colocated (trainer offloaded while generating, or not) or separate (engines on
  whole nodes: :func:`megagrpo.plan.ladder.engine_splits`, the trainer's fastest layout on
  the rest) one step ahead or on-policy (``rollout.max_staleness`` 1 / 0).

Every candidate goes through the gate (:mod:`megagrpo.plan.gate`): refused layouts are skipped,
FP8 ones are kept as unverified, lossy ones (a merged sync that rounds the LoRA update away:
:mod:`megagrpo.plan.exactness`) are counted but ranked only with ``allow_lossy``
(``--allow-lossy``). The engine gets the largest ``gpu_memory_utilization`` (a multiple of
0.05, at most :data:`~megagrpo.plan.layouts.ENGINE_UTIL_CAP`) that keeps generation inside the
headroom. Among the layouts whose every phase fits, the fastest central estimate wins;
:func:`search` returns the best exact layout (the default pick), the best unverified one, the
best lossy one (with ``allow_lossy``) and the fastest ones overall, each with its low / central
/ high step time.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator

from megagrpo.plan.exactness import sync_survival
from megagrpo.plan.gate import EXACT, LOSSY, UNVERIFIED, Gate, overrides_of, ungated
from megagrpo.plan.layouts import (
    best_utilization,
    check_host_memory,
    engine_splits,
    separate_memory,
    trainer_layout,
    trainer_layouts,
)
from megagrpo.plan.memory import memory_plan, shapes_of
from megagrpo.plan.ranges import bounds, memory_corner
from megagrpo.plan.scenario import Assumptions, Hardware, Scenario
from megagrpo.plan.time import split_placement, step_time
from megagrpo.rollout.config import PartialConfig

VLLM_LAYOUTS = (("lockstep", 1), ("independent", 4), ("independent", 8), ("independent", 16))
"""``(rollout.replicas, rollout.tensor_parallel_size)`` the search tries."""

SYNCS = (("adapter", "sliced"), ("merged", "sliced"))
"""``(trainer.weight_sync, trainer.sync_transport)``: the adapter (streamed), merged sliced."""


def full_plan(sc: Scenario, a: Assumptions, hw: Hardware) -> dict:
    """:func:`~megagrpo.plan.memory.memory_plan` + ``time`` (step-time estimate) + ``bounds``
    (low / central / high) + the inputs (``assumptions``, ``hardware``)."""
    mem = separate_memory(sc, a) if sc.placement == "separate" else memory_plan(sc, a)
    check_host_memory(mem, a, hw)
    mem["time"] = step_time(sc, a, hw, mem)
    mem["bounds"] = bounds(lambda aa, hh: step_time(sc, aa, hh, mem)["step_s"], a, hw)
    mem["assumptions"] = vars(a)
    mem["hardware"] = vars(hw)
    pred = sync_survival(sc)
    mem["survival"] = pred.as_dict() if pred is not None else None
    if sc.placement != "separate":  # the memory pools at the high ends of their ranges
        mem["fits_memory_high"] = memory_plan(sc, memory_corner(a))["fits"]
    return mem


def rollout_options(sc: Scenario, gpus: int) -> Iterator[dict]:
    """Every vLLM layout x weights x sync x partial rollouts the search tries for engines on
    ``gpus`` GPUs (module doc); partial rollouts with the config's settings when it has them
    on, else ``rollout.partial``'s defaults."""
    s = shapes_of(sc.hf)
    p = PartialConfig()
    if sc.partial_finish_fraction > 0:
        p = PartialConfig(
            True, sc.partial_finish_fraction, 0, sc.partial_chunk_tokens, sc.partial_max_staleness
        )
    for replicas, vtp in VLLM_LAYOUTS:
        if vtp > gpus or gpus % vtp or s.heads % vtp:
            continue
        for quant in ("none", "fp8"):
            for sync, transport in SYNCS:
                for part in (0.0, p.finish_fraction):
                    yield dict(
                        vllm_tp=vtp,
                        replicas=replicas,
                        enable_expert_parallel=bool(s.experts),
                        quantization=quant,
                        weight_sync=sync,
                        sync_transport=transport,
                        enable_lora=sync == "adapter",
                        adapter_transport="streamed",
                        sleep_level=0,
                        partial_finish_fraction=part,
                        partial_max_staleness=p.max_staleness,
                        partial_chunk_tokens=p.chunk_tokens,
                    )


def candidates(sc: Scenario, gpus: int, a: Assumptions, hw: Hardware) -> Iterator[Scenario]:
    """Every layout :func:`search` tries for ``gpus`` GPUs (module doc), colocated first."""
    base = sc.with_(num_gpus=gpus, placement="colocated", rollout_gpus=0, offpolicy_staleness=0)
    for layout in trainer_layouts(base, gpus):
        for opt in rollout_options(base, gpus):
            for offload in (True, False):
                yield base.with_(
                    **layout,
                    **opt,
                    offload_during_rollout=offload,
                    load_format="dummy" if offload else "auto",
                )
    for engine_gpus in engine_splits(base):
        split = base.with_(placement="separate", rollout_gpus=engine_gpus, load_format="auto")
        layout = trainer_layout(split, a, hw)
        if layout is None:
            continue
        for opt in rollout_options(base, engine_gpus):
            for staleness in (1, 0):
                yield split.with_(**layout, **opt, offpolicy_staleness=staleness)


def _fitting(cand: Scenario, a: Assumptions, hw: Hardware) -> dict | None:
    """The plan of ``cand`` with its engine budget, or None when it does not fit."""
    probe = split_placement(cand)[1] if cand.placement == "separate" else cand
    util = best_utilization(probe, a)
    if util is None:
        return None
    cand = cand.with_(gpu_memory_utilization=util)
    mem = separate_memory(cand, a) if cand.placement == "separate" else memory_plan(cand, a)
    check_host_memory(mem, a, hw)
    if not mem["fits"]:
        return None
    t = step_time(cand, a, hw, mem)
    if not math.isfinite(t["step_s"]):
        return None
    mem.update(time=t, scenario=cand)
    return mem


def search(
    sc: Scenario,
    a: Assumptions,
    hw: Hardware,
    gpus: int,
    top: int = 5,
    gate: Gate = ungated,
    loads: Callable[[Scenario], str] | None = None,
    allow_lossy: bool = False,
) -> dict:
    """The fastest layouts for ``gpus`` GPUs whose every phase fits (module doc):
    ``{"best_exact", "best_unverified", "best_lossy", "top"}``, each a :func:`full_plan`-like
    dict with ``overrides`` (the config keys to set), ``status`` and ``note`` (the gate's),
    ``bounds``; ``searched`` / ``refused`` / ``lossy``: how many layouts were tried / refused
    by the gate / lossy (ranked only with ``allow_lossy``; ``best_lossy`` None without it)."""
    found: list[dict] = []
    refused = searched = lossy = 0
    ranked = (EXACT, UNVERIFIED, LOSSY) if allow_lossy else (EXACT, UNVERIFIED)
    for cand in candidates(sc, gpus, a, hw):
        searched += 1
        verdict = gate(cand)
        lossy += verdict.status == LOSSY
        if verdict.status not in ranked:
            refused += verdict.status not in (LOSSY,)
            continue
        plan = _fitting(cand, a, hw)
        if plan is not None:
            plan.update(status=verdict.status, note=verdict.note())
            found.append(plan)
    found.sort(key=lambda p: p["time"]["step_s"])

    def first(status: str) -> dict | None:
        """The fastest layout of ``status`` whose config loads as ``megagrpo train`` loads it
        (the trainer's own rules: ``loads`` returns the loader's error, '' when it loads)."""
        for p in found:
            if p["status"] != status:
                continue
            p["loader"] = loads(p["scenario"]) if loads is not None else ""
            if not p["loader"]:
                return p
        return None

    out = {
        "best_exact": first(EXACT),
        "best_unverified": first(UNVERIFIED),
        "best_lossy": first(LOSSY) if allow_lossy else None,
        "top": found[:top],
        "searched": searched,
        "refused": refused,
        "lossy": lossy,
        "allow_lossy": allow_lossy,
        "fitting": len(found),
    }
    for p in [out["best_exact"], out["best_unverified"], out["best_lossy"], *out["top"]]:
        if p is not None and "bounds" not in p:
            _finish(p, a, hw)
    return out


def _finish(plan: dict, a: Assumptions, hw: Hardware) -> None:
    """Add what a printed layout shows: its low / central / high step time, its overrides
    and the inputs."""
    cand = plan["scenario"]
    plan["bounds"] = bounds(lambda aa, hh: step_time(cand, aa, hh, plan)["step_s"], a, hw)
    plan["overrides"] = overrides_of(cand)
    pred = sync_survival(cand)
    plan["survival"] = pred.as_dict() if pred is not None else None
    plan.update(assumptions=vars(a), hardware=vars(hw))
