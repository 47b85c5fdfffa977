"""The throughput ladder of a run (`megagrpo plan-memory CONFIG --ladder`): the step-time
estimate of the config's layout with one lever added per rung, each with its per-phase times.

    baseline                 issue 21's run: bf16 engine, adapter sync as a PEFT directory,
                             every round run to its longest completion, colocated
    + FP8 rollout            rollout.quantization=fp8, one vLLM TP 8 replica per node
                             (rollout.replicas=independent)
    + streamed adapter sync  trainer.adapter_transport=streamed
    + partial rollouts       rollout.partial.enabled (its finish_fraction / max_staleness)
    + one-step off-policy    the engines on their own nodes generate the next batch under the
                             previous weights while the trainer trains (separate placement)

A rung is a :class:`Rung`: the :class:`~megagrpo.plan.scenario.Scenario` fields it sets (what
the config keys would set), the phases it may change, and what the trainer has of it
(``status``). Separate placement is a planner toggle here (``Scenario.placement``); the config
keys that run it exist on CPU with one engine rank. Every figure is the estimate of
:mod:`megagrpo.plan.time` under the printed assumptions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from megagrpo.plan.memory import memory_plan, shapes_of
from megagrpo.plan.scenario import Assumptions, Hardware, Scenario
from megagrpo.plan.search import best_utilization, check_host_memory
from megagrpo.plan.time import split_placement, step_time, train_phase
from megagrpo.rollout.config import PartialConfig, serves_moe_lora

TARGET_STEP_S = 150.0
"""Issue 21's target for the 16 x H100 plan, seconds per step."""

PHASES = ("generate", "sync", "train", "transitions")


@dataclass(frozen=True)
class Rung:
    """One lever: ``changes`` (Scenario fields, cumulative over the ladder), the ``phases`` it
    may change, and ``status`` (what the trainer has of it)."""

    name: str
    changes: dict[str, Any] = field(default_factory=dict)
    phases: tuple[str, ...] = ()
    status: str = ""
    blocked: str = ""
    """Why the pinned stack cannot run it yet ("" when it can)."""


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
    per_node = sc.gpus_per_node
    fp8_tp = min(per_node, sc.num_gpus)
    nodes = sc.num_gpus // per_node
    # the engines on half the nodes (half the GPUs of a single node)
    rollout_gpus = (nodes // 2) * per_node if nodes >= 2 else sc.num_gpus // 2
    fp8_gate = serves_moe_lora(
        lora=sc.weight_sync == "adapter",
        expert_parallel=sc.enable_expert_parallel,
        quantization="fp8",
        tp=fp8_tp,
        dp=1,
    )
    ladder = [
        Rung(
            "baseline",
            dict(
                quantization="none",
                adapter_transport="peft_dir",
                partial_finish_fraction=0.0,
                placement="colocated",
                rollout_gpus=0,
            ),
            PHASES,
            "issue 21's run (the config with adapter_transport=peft_dir, no partial rounds)",
        ),
        Rung(
            "+ FP8 rollout",
            dict(quantization="fp8", vllm_tp=fp8_tp, replicas="independent"),
            ("generate", "transitions"),
            "config keys exist",
            "" if fp8_gate else "vLLM 0.33 refuses FP8 + LoRA on MoE layers (vllm.fp8_moe_lora)",
        ),
        Rung(
            "+ streamed adapter sync",
            dict(adapter_transport="streamed"),
            ("sync",),
            "built: trainer.adapter_transport=streamed (default)",
        ),
        Rung(
            "+ partial rollouts",
            dict(
                partial_finish_fraction=p.finish_fraction,
                partial_max_staleness=p.max_staleness,
                partial_chunk_tokens=p.chunk_tokens,
            ),
            ("generate",),
            f"built: rollout.partial.enabled (finish {p.finish_fraction:g}, "
            f"staleness {p.max_staleness})",
        ),
    ]
    if rollout_gpus >= 1:  # a single GPU has nothing to separate
        ladder.append(
            Rung(
                "+ one-step off-policy",
                dict(placement="separate", rollout_gpus=rollout_gpus),
                PHASES,
                f"built: rollout.placement=separate, max_staleness 1 ({rollout_gpus} engine GPUs)",
                "the trainer's separate placement has one engine rank and refuses rollout.partial",
            )
        )
    return ladder


def trainer_layout(sc: Scenario, a: Assumptions, hw: Hardware) -> dict[str, Any] | None:
    """The fastest trainer layout (TP 1/2/4/8 x PP dividing the layers x EP) whose train phase
    fits the trainer's GPUs of a separate placement; None when none does."""
    s = shapes_of(sc.hf)
    gpus = sc.num_gpus - sc.rollout_gpus
    limit = (1 - a.headroom) * sc.gpu_memory_gib
    best: tuple[float, dict[str, Any]] | None = None
    for tp in (t for t in (1, 2, 4, 8) if t <= sc.gpus_per_node and s.heads % t == 0):
        for pp in (p for p in (1, 2, 4, 8) if s.layers % p == 0 and gpus % (tp * p) == 0):
            for ep in (e for e in (1, 2, 4, 8, 16, 32) if not s.experts or s.experts % e == 0):
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


def _separate_fit(sc: Scenario, a: Assumptions) -> tuple[bool, dict[str, float]]:
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


def ladder(sc: Scenario, a: Assumptions, hw: Hardware, rung_list: list[Rung] | None = None):
    """One row per rung (cumulative): ``name``, ``status``, ``phases`` (seconds), ``step_s``,
    ``overlap_s``, ``tokens_per_s_per_gpu``, ``fits``, ``phase_peak_gib``, ``changes``."""
    rows = []
    cur = sc
    for rung in rung_list or rungs(sc):
        cur = cur.with_(**rung.changes)
        changes = dict(rung.changes)
        if cur.placement == "separate":
            layout = trainer_layout(cur, a, hw)
            if layout is not None:
                cur = cur.with_(**layout)
                changes.update(layout)
            _, engine = split_placement(cur)
            util = best_utilization(engine, a)
            if util is not None:
                cur = cur.with_(gpu_memory_utilization=util)
                changes["gpu_memory_utilization"] = util
            fits, peaks = _separate_fit(cur, a)
            fits = fits and layout is not None
            t = step_time(cur, a, hw, {})
        else:
            mem = memory_plan(cur, a)
            check_host_memory(mem, a, hw)
            fits, peaks = mem["fits"], mem["phase_peak_gib"]
            t = step_time(cur, a, hw, mem)
        rows.append(
            {
                "name": rung.name,
                "status": rung.status,
                "blocked": rung.blocked,
                "changes": changes,
                "phases": {k: t["phases"][k]["s"] for k in PHASES},
                "overlap_s": t["overlap_s"],
                "step_s": t["step_s"],
                "tokens_per_s_per_gpu": t["tokens_per_s_per_gpu"],
                "fits": bool(fits),
                "phase_peak_gib": peaks,
            }
        )
    return rows


def runnable_ladder(sc: Scenario, a: Assumptions, hw: Hardware) -> list[dict]:
    """The ladder without the rungs the pinned stack cannot run yet (``Rung.blocked``)."""
    return ladder(sc, a, hw, [r for r in rungs(sc) if not r.blocked])


def config_row(sc: Scenario, a: Assumptions, hw: Hardware) -> dict:
    """The ladder row of the config as written (what ``plan-memory`` estimates for it)."""
    return ladder(sc, a, hw, [Rung("config as written", {}, PHASES, "plan-memory's estimate")])[0]


def _line(r: dict) -> str:
    ph = r["phases"]
    status = r["status"] + (f"; BLOCKED: {r['blocked']}" if r.get("blocked") else "")
    return (
        f"{r['name']:<25} {ph['generate']:>8.1f} {ph['sync']:>6.1f} {ph['train']:>6.1f} "
        f"{ph['transitions']:>6.1f} {(-r['overlap_s'] or 0.0):>8.1f} {r['step_s']:>7.1f} "
        f"{r['tokens_per_s_per_gpu']:>9.0f}  {'yes' if r['fits'] else 'NO':<4}  {status}"
    )


def format_ladder(
    rows: list[dict],
    num_gpus: int,
    config: dict | None = None,
    runnable: list[dict] | None = None,
    target_s: float = TARGET_STEP_S,
) -> str:
    """The ladder as a text table (``config``: the config-as-written row, printed first) with
    a verdict against ``target_s``: the fastest fitting rung, what blocks the rungs it needs,
    the longest phase left, and (``runnable``: :func:`runnable_ladder`) the best without the
    blocked rungs."""
    head = (
        f"{'rung':<25} {'generate':>8} {'sync':>6} {'train':>6} {'trans':>6} {'overlap':>8} "
        f"{'s/step':>7} {'tok/s/GPU':>9}  fits  status"
    )
    lines = [f"throughput ladder, {num_gpus} GPUs (seconds per step, estimates):", head]
    if config is not None:
        lines += [_line(config), "-" * len(head)]
    lines += [_line(r) for r in rows]
    ok = [r for r in rows if r["fits"] and math.isfinite(r["step_s"])]
    if not ok:
        return "\n".join([*lines, "no rung fits"])
    best = min(ok, key=lambda r: r["step_s"])
    upto = rows[: rows.index(best) + 1]
    blocked = [f"{r['name']} ({r['blocked']})" for r in upto if r.get("blocked")]
    ph = best["phases"]
    worst = max(ph, key=lambda k: ph[k])
    verdict = "reached" if best["step_s"] <= target_s else "NOT reached"
    lines.append(
        f"target <= {target_s:.0f} s/step: {verdict}; fastest rung '{best['name']}' "
        f"{best['step_s']:.0f} s/step (longest phase: {worst} {ph[worst]:.0f} s)"
    )
    if blocked:
        lines.append("  it needs: " + "; ".join(blocked))
    slower = [r["name"] for r in rows[rows.index(best) + 1 :] if r["step_s"] > best["step_s"]]
    if slower:
        lines.append(f"  slower than it on {num_gpus} GPUs: " + ", ".join(slower))
    fit = [r for r in runnable or [] if r["fits"] and math.isfinite(r["step_s"])]
    if blocked and fit:
        top = min(fit, key=lambda r: r["step_s"])
        lines.append(
            f"without the blocked rungs: {top['step_s']:.0f} s/step at '{top['name']}' "
            f"(generate {top['phases']['generate']:.0f} s, train {top['phases']['train']:.0f} s)"
        )
    return "\n".join(lines)
