"""The throughput ladder of a run (`megagrpo plan-memory CONFIG --ladder`): the step-time
estimate of the config's layout with one lever added per rung, each with its per-phase times,
its low / central / high step time (:mod:`megagrpo.plan.ranges`) and what the gate says of it.

    baseline                 issue 21's run: bf16 engine in the config's vLLM layout serving
                             the adapter (synced as a PEFT directory), every round run to its
                             longest completion, colocated (a merged-sync config's layout
                             with the adapter: the ladder is the adapter's path; merged
                             layouts are in the search, ``--gpus``)
    + streamed adapter sync  trainer.adapter_transport=streamed
    + partial rollouts       rollout.partial.enabled (its finish_fraction / max_staleness)
    + vLLM TP 8 per node     one vLLM TP 8 replica per node (rollout.replicas=independent),
                             bf16
    + FP8 rollout            rollout.quantization=fp8 (unverified on GPU)
    + one-step off-policy    the engines on their own nodes generate the next step's first
                             round under the previous weights while the trainer trains
                             (rollout.placement=separate, rollout.engine_ranks, max_staleness 1)

Every rung's cumulative layout goes through the compatibility gate (:mod:`megagrpo.plan.gate`):
``exact``, ``lossy`` (its sync delivers only part of the LoRA update), ``unverified`` (gate
passes, not yet run on a GPU) or ``refused`` (the rule it breaks). The best exact step leaves
out every rung that is not exact, the best unverified one the refused and lossy rungs.
Dynamic sampling is billed on every rung (the scenario comes in with its collapse bill:
:mod:`megagrpo.plan.collapse`); ``collapse`` is what its resampling rounds cost.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from megagrpo.plan.gate import EXACT, LOSSY, REFUSED, UNVERIFIED, Gate, overrides_of, ungated
from megagrpo.plan.layouts import (
    best_utilization,
    check_host_memory,
    separate_fit,
    separate_layout,
)
from megagrpo.plan.memory import memory_plan
from megagrpo.plan.ranges import bounds
from megagrpo.plan.scenario import Assumptions, Hardware, Scenario
from megagrpo.plan.time import step_time
from megagrpo.rollout.config import PartialConfig

TARGETS: dict[int, dict[str, float]] = {
    16: {EXACT: 200.0, UNVERIFIED: 150.0},
    128: {EXACT: 95.0},
}
"""The issues' targets for the shipped configs (central estimates, seconds per step): 16 x H100
<= 200 exact (bf16), <= 150 with FP8 (unverified; issue 32); 128 x H100 <= 95 exact (issue 40:
the merged bf16 layout that met issue 32's 90 s is lossy)."""

PHASES = ("generate", "sync", "train", "transitions")


@dataclass(frozen=True)
class Rung:
    """One lever: ``changes`` (Scenario fields, cumulative over the ladder), the ``phases`` it
    may change, and ``built`` (what the trainer has of it)."""

    name: str
    changes: dict[str, Any] = field(default_factory=dict)
    phases: tuple[str, ...] = ()
    built: str = ""
    refit: bool = False
    """Give the engine the largest memory budget that fits after the change."""


def rungs(sc: Scenario, partial: PartialConfig | None = None) -> list[Rung]:
    """The ladder of ``sc`` (module doc); ``partial``: the settings of the partial rung
    (default: ``rollout.partial``'s defaults, or the config's when it has them on)."""
    p = partial or PartialConfig()
    if sc.partial_finish_fraction > 0:
        p = PartialConfig(
            enabled=True,
            finish_fraction=sc.partial_finish_fraction,
            chunk_tokens=sc.partial_chunk_tokens,
            max_staleness=sc.partial_max_staleness,
        )
    tp_node = min(sc.gpus_per_node, sc.num_gpus)
    ladder = [
        Rung(
            "baseline",
            dict(
                quantization="none",
                weight_sync="adapter",
                enable_lora=True,
                adapter_transport="peft_dir",
                partial_finish_fraction=0.0,
                placement="colocated",
                rollout_gpus=0,
                offpolicy_staleness=0,
            ),
            PHASES,
            "issue 21's run (the config's layouts, the adapter synced as a PEFT directory, "
            "no partial rounds)",
        ),
        Rung(
            "+ streamed adapter sync",
            dict(adapter_transport="streamed"),
            ("sync",),
            "trainer.adapter_transport=streamed (default)",
        ),
        Rung(
            "+ partial rollouts",
            dict(
                partial_finish_fraction=p.finish_fraction,
                partial_max_staleness=p.max_staleness,
                partial_chunk_tokens=p.chunk_tokens,
            ),
            ("generate",),
            f"rollout.partial.enabled (finish {p.finish_fraction:g}, staleness {p.max_staleness})",
        ),
        Rung(
            f"+ vLLM TP {tp_node} per node",
            dict(
                vllm_tp=tp_node,
                replicas="independent",
                enable_expert_parallel=True,
                offload_during_rollout=True,
                load_format="dummy",
            ),
            ("generate", "sync", "transitions"),
            f"rollout.tensor_parallel_size={tp_node} rollout.replicas=independent, the "
            "trainer offloaded while generating, the engine's budget refitted",
            refit=True,
        ),
        Rung(
            "+ FP8 rollout",
            dict(quantization="fp8"),
            ("generate", "transitions"),
            "rollout.quantization=fp8",
        ),
    ]
    if sc.num_gpus >= 2:  # a single GPU has nothing to separate
        ladder.append(
            Rung(
                "+ one-step off-policy",
                dict(placement="separate", offpolicy_staleness=1, load_format="auto"),
                PHASES,
                "rollout.placement=separate rollout.engine_ranks rollout.max_staleness=1",
            )
        )
    return ladder


def evaluate(sc: Scenario, a: Assumptions, hw: Hardware) -> tuple[dict, bool, dict, dict]:
    """``(step time, fits, phase peaks, low / central / high)`` of the layout ``sc``."""
    if sc.placement == "separate":
        fits, peaks = separate_fit(sc, a)
        mem: dict = {}
    else:
        mem = memory_plan(sc, a)
        check_host_memory(mem, a, hw)
        fits, peaks = mem["fits"], mem["phase_peak_gib"]
    t = step_time(sc, a, hw, mem)
    band = bounds(lambda aa, hh: step_time(sc, aa, hh, mem)["step_s"], a, hw)
    return t, bool(fits), peaks, band


def _row(name: str, built: str, cur: Scenario, changes: dict, a, hw, gate: Gate) -> dict:
    t, fits, peaks, band = evaluate(cur, a, hw)
    verdict = gate(cur)
    return {
        "name": name,
        "built": built,
        "status": verdict.status,
        "note": verdict.note(),
        "detail": verdict.detail(),
        "changes": changes,
        "overrides": overrides_of(cur),
        "phases": {k: t["phases"][k]["s"] for k in PHASES},
        "collapse_s": t["collapse_s"],
        "rounds_per_step": t["rounds_per_step"],
        "round_s": t["phases"]["generate"].get("round_s", 0.0),
        "first_round_s": t["phases"]["generate"].get("first_round_s", 0.0),
        "overlap_s": t["overlap_s"],
        "step_s": t["step_s"],
        "bounds": band,
        "tokens_per_s_per_gpu": t["tokens_per_s_per_gpu"],
        "fits": fits and math.isfinite(t["step_s"]),
        "phase_peak_gib": peaks,
    }


def ladder(
    sc: Scenario,
    a: Assumptions,
    hw: Hardware,
    rung_list: list[Rung] | None = None,
    gate: Gate = ungated,
    keep: tuple[str, ...] = (),
) -> list[dict]:
    """One row per rung (cumulative): ``name``, ``built``, ``status`` / ``note`` (the gate's),
    ``phases`` (seconds), ``collapse_s``, ``step_s``, ``bounds`` (low / central / high),
    ``overlap_s``, ``tokens_per_s_per_gpu``, ``fits``, ``phase_peak_gib``, ``changes``.
    ``keep``: statuses a rung must have to stay in the layout the next rungs build on (empty:
    every rung stays)."""
    rows = []
    cur = sc
    for rung in rung_list or rungs(sc):
        nxt, changes = cur.with_(**rung.changes), dict(rung.changes)
        util = best_utilization(nxt, a) if rung.refit else None
        if util is not None:
            nxt = nxt.with_(gpu_memory_utilization=util)
            changes["gpu_memory_utilization"] = util
        if nxt.placement == "separate":
            nxt, chosen, _, _ = separate_layout(nxt, a, hw)
            changes.update(chosen)
        row = _row(rung.name, rung.built, nxt, changes, a, hw, gate)
        if keep and row["status"] not in keep:
            continue
        rows.append(row)
        cur = nxt
    return rows


def config_row(sc: Scenario, a: Assumptions, hw: Hardware, gate: Gate = ungated) -> dict:
    """The ladder row of the config as written (what ``plan-memory`` estimates for it)."""
    return _row("config as written", "plan-memory's estimate", sc, {}, a, hw, gate)


def best(rows: list[dict]) -> dict | None:
    """The fastest fitting row (None: none fits)."""
    ok = [r for r in rows if r["fits"] and math.isfinite(r["step_s"])]
    return min(ok, key=lambda r: r["step_s"]) if ok else None


def ladder_report(sc: Scenario, a: Assumptions, hw: Hardware, gate: Gate = ungated) -> dict:
    """What ``--ladder`` prints: ``config`` (row), ``rungs`` (every rung), ``exact`` (the
    ladder without the rungs that are not exact), ``unverified`` (without the refused and lossy
    ones), the targets for this GPU count."""
    return {
        "num_gpus": sc.num_gpus,
        "targets": TARGETS.get(sc.num_gpus, {}),
        "config": config_row(sc, a, hw, gate),
        "rungs": ladder(sc, a, hw, gate=gate),
        "exact": ladder(sc, a, hw, gate=gate, keep=(EXACT,)),
        "unverified": ladder(sc, a, hw, gate=gate, keep=(EXACT, UNVERIFIED)),
        "refused_status": REFUSED,
        "lossy_status": LOSSY,
    }
