"""Text of the plans (`megagrpo plan-memory`): one plan's phases and the exactness of its sync,
the layout search's best exact, unverified (and, asked for, lossy) layouts, and the throughput
ladder with its verdict against the targets."""

from __future__ import annotations

import math

from megagrpo.plan.gate import EXACT, UNVERIFIED
from megagrpo.plan.memory import GIB


def _band(b: dict | None) -> str:
    if not b:
        return ""
    return f"{b['low']:.0f}-{b['high']:.0f}"


def format_plan(p: dict) -> str:
    """Human-readable table of :func:`full_plan`."""
    lay = p["layout"]
    adapter = lay["weight_sync"] == "adapter"
    transport = lay["adapter_transport"] if adapter else lay["sync_transport"]
    lines = [
        f"layout: {p['num_gpus']} GPUs, trainer tp={lay['tp']} pp={lay['pp']} ep={lay['ep']} "
        f"etp={lay['etp']} dp={lay['dp']} sp={lay['sequence_parallel']}, "
        f"{lay['micro_batch_tokens']} tokens per micro-batch",
        f"        vLLM tp={lay['vllm_tp']} replicas={lay['replicas']} "
        f"weights={lay['rollout_quantization']} util={lay['gpu_memory_utilization']}, "
        f"sync={lay['weight_sync']}/{transport}, "
        f"offload_during_rollout={lay['offload_during_rollout']}",
    ]
    for k, v in p["breakdown_gib"].items():
        lines.append(f"  {k:<30} {v:>9.2f} GiB")
    limit = (1 - p["headroom"]) * p["gpu_memory_gib"]
    lines.append(f"  per phase (limit {limit:.1f} GiB = {1 - p['headroom']:.0%} of the GPU):")
    for k, v in p["phase_peak_gib"].items():
        mark = "ok" if v <= limit else "OVER"
        lines.append(f"    {k:<12} {v:>7.2f} GiB  {v / p['gpu_memory_gib']:>4.0%}  {mark}")
    eng = p["engine"]
    lines.append(
        f"  engine: {eng['replicas']} replica(s), KV cache {eng['kv_tokens_per_replica']:,.0f} "
        f"tokens per replica ({eng['kv_bytes_per_token'] / 1024:.0f} KiB/token/GPU)"
    )
    sep = p.get("engine_gpus")
    if sep:
        lines.append(
            f"  engine GPUs (placement=separate): {sep['gpus']} GPU(s), vLLM tp={sep['vllm_tp']}, "
            f"weights {sep['weights_gib_per_gpu']:.2f} GiB per GPU, generate "
            f"{sep['generate_gib']:.2f} GiB, KV cache {sep['kv_tokens_per_replica']:,.0f} tokens "
            f"-> {'ok' if sep['fits'] else 'DOES NOT FIT'} (per phase above: train on the "
            "trainer's GPUs, generate on the engine's)"
        )
    if "time" in p:
        lines += _format_time(p["time"], p["num_gpus"], p.get("bounds"))
    lines.append(_sync_line(p))
    if p.get("collapse"):
        c = p["collapse"]
        lines.append(
            f"  dynamic sampling ({c['policy']}, max_resample {c['max_resample']}; levels: "
            f"{c['source']}): predicted raw ACR {c['acr_predicted']:.3f}, simulated "
            f"{c['acr_raw']:.3f}; {c['rounds_per_step']:.2f} rounds and "
            f"{c['trained_groups_per_step']:.1f} of {c['batch_groups']} groups trained per step"
            + _oversample_text(c)
        )
    verdict = "FITS" if p["fits"] else "DOES NOT FIT"
    host = p.get("host")
    if host and host["pinned_gib_per_gpu"]:
        lines.append(
            f"  host (pinned): {host['pinned_gib_per_gpu']} GiB per GPU, "
            f"{host['pinned_gib_per_node']} GiB per node ({host['exact_gib_per_gpu']} GiB of "
            "tensors; pinned buffers round up to powers of two)"
            + (
                f" of {host['node_gib']:.0f} GiB (cluster.host_memory_gib) -> "
                f"{'fits' if host['fits_node'] else 'DOES NOT FIT'}"
                if "node_gib" in host
                else ""
            )
        )
    if host and host.get("adapter_sync_gib_per_gpu"):
        lines.append(
            f"  host per engine rank per adapter sync: {host['adapter_sync_gib_per_gpu']} GiB "
            "(its own experts only; registry and vLLM's cache, new and previous version, and "
            "vLLM's read copy while it loads)"
        )
    lines.append(f"per GPU: {p['per_gpu_gib']} GiB of {p['gpu_memory_gib']} GiB -> {verdict}")
    if "fits_memory_high" in p:
        high = "still fits" if p["fits_memory_high"] else "does NOT fit"
        lines.append(
            f"  with every memory pool at the high end of its range (CUDA context, NCCL, CUDA "
            f"graphs, vLLM workspace, slack: megagrpo.plan.ranges.MEMORY_RANGES): {high}"
        )
    lines += [f"  - {t}" for t in p["advice"]]
    return "\n".join(lines)


def _sync_line(p: dict) -> str:
    """Whether the plan's weight sync trains the policy it samples (:mod:`megagrpo.plan.
    exactness`): exact, or lossy with the predicted survival of the LoRA update."""
    sv = p.get("survival")
    if not sv:
        return f"  weight sync: {p['layout']['weight_sync']}: exact (the engines serve the adapter)"
    steps = ", ".join(
        f"step {k}: no update yet (lr warm-up)"
        if not mv
        else f"step {k}: {lo:.0%}" + (f"-{hi:.0%}" if abs(hi - lo) >= 0.005 else "")
        for k, lo, hi, mv in zip(sv["steps"], sv["low"], sv["high"], sv["moved"])
    )
    head = "exact" if sv["exact"] else "LOSSY (trainer.allow_lossy_sync needed)"
    return (
        f"  weight sync: merged ({sv['format']}): {head}; predicted survival of the LoRA "
        f"update {steps} (noise-dominated - coherent Adam updates); weight scales: "
        f"{sv['weight_source']}"
    )


def _oversample_text(c: dict) -> str:
    first = c.get("first_round_groups")
    if not first or abs(first - c["batch_groups"]) < 0.05:
        return ""
    return f"; first round {first:.1f} problems (dynamic.oversample), the surplus carried"


def _format_time(t: dict, gpus: int, band: dict | None = None) -> list[str]:
    ph = t["phases"]
    g = ph["generate"]
    lines = [
        f"  step-time estimate: {t['step_s']:.0f} s/step"
        + (f" (low-high {_band(band)})" if band else "")
        + f", {t['tokens_per_s_per_gpu']:.0f} tokens/s/GPU ({t['tokens_per_step']:,.0f} "
        f"trained tokens, {gpus} GPUs)"
    ]
    if math.isfinite(g["s"]):
        lines.append(
            f"    generate    {g['s']:>7.1f} s  ({g['rounds']:.2f} rounds, first "
            f"{g['first_round_s']:.1f} s, a resampling round {g['round_s']:.1f} s, collapse "
            f"{g.get('collapse_s', 0.0):.1f} s; a round: "
            f"{g['decode_steps']:.0f} decode steps x "
            f"{g['step_ms']:.1f} ms, batch shrinking from {g['concurrent_per_replica']:.0f} "
            f"sequences/replica (at full batch throughout: {g['full_batch_decode_s']:.0f} s), "
            f"MoE-LoRA speed {g['moe_lora_decode_speed']:.2f}, attention LoRA "
            f"{g['attention_lora_ms']:.1f} ms/step, prefill {g['prefill_s']:.1f} s of which "
            f"collectives {g['prefill_comm_s']:.1f} s"
            + (
                f", {g['partial_chunks_s']:.1f} s of partial chunks)"
                if g["partial_chunks_s"]
                else ")"
            )
        )
    else:
        lines.append("    generate    no KV cache: cannot generate")
    sy = ph["sync"]
    lines.append(
        f"    sync        {sy['s']:>7.1f} s  ({sy['bytes_per_gpu'] / GIB:.1f} GiB per GPU)"
    )
    tr = ph["train"]
    lines.append(
        f"    train       {tr['s']:>7.1f} s  (compute {tr['compute_s']:.1f}, LoRA "
        f"{tr['lora_s']:.1f}, MoE all-to-all {tr['moe_all_to_all_s']:.1f} over "
        f"{tr['passes']} passes, SP {tr['sp_collectives_s']:.1f}, bubble "
        f"{tr['pipeline_bubble']:.0%}; model FLOPs utilisation "
        f"{tr['model_flops_utilisation']:.0%})"
    )
    tx = ph["transitions"]
    lines.append(
        f"    transitions {tx['s']:>7.1f} s  (trainer offload {tx['trainer_offload_s']:.1f}, "
        f"engine sleep backup {tx['engine_sleep_backup_s']:.1f})"
    )
    if t.get("overlap_s"):
        lines.append(
            f"    overlap     {-t['overlap_s']:>7.1f} s  (placement separate: the next step's "
            "first round generated while this step trains)"
        )
    return lines


def format_search(res: dict, gpus: int, memory_gib: float) -> str:
    """The layout search (:func:`megagrpo.plan.search.search`): the best exact and the best
    unverified layout (and the best lossy one with ``--allow-lossy``) with their phases, then
    the fastest overall."""
    ranked = "ranked" if res.get("allow_lossy") else "not ranked (--allow-lossy ranks them)"
    lines = [
        f"layout search, {gpus} GPUs: {res['searched']} layouts tried, {res['refused']} "
        f"refused by the gate, {res.get('lossy', 0)} lossy ({ranked}), {res['fitting']} "
        f"ranked fit {memory_gib} GiB with every phase's headroom"
    ]
    picks = [("best_exact", "best exact"), ("best_unverified", "best unverified")]
    if res.get("allow_lossy"):
        picks.append(("best_lossy", "best lossy"))
    for key, title in picks:
        p = res.get(key)
        if p is None:
            lines.append(f"\n{title}: none fits")
            continue
        t = p["time"]
        lines.append(
            f"\n{title}: {t['step_s']:.0f} s/step (low-high {_band(p['bounds'])}), "
            f"{p['note']}\n  " + " ".join(p["overrides"])
        )
        lines.append(format_plan(p))
    lines.append("\nfastest fitting layouts (central s/step, low-high, status):")
    for i, p in enumerate(res["top"]):
        lines.append(
            f"  #{i + 1} {p['time']['step_s']:>6.0f} {_band(p['bounds']):>9}  {p['status']:<10} "
            + " ".join(o for o in p["overrides"] if not o.startswith("cluster."))
        )
    return "\n".join(lines)


def _line(r: dict) -> str:
    ph = r["phases"]
    status = r["note"] if r["status"] != EXACT else EXACT
    return (
        f"{r['name']:<25} {ph['generate']:>8.1f} {r['collapse_s']:>8.1f} {ph['sync']:>6.1f} "
        f"{ph['train']:>6.1f} {ph['transitions']:>6.1f} {(-r['overlap_s'] or 0.0):>8.1f} "
        f"{r['step_s']:>7.1f} {_band(r['bounds']):>9} {r['tokens_per_s_per_gpu']:>9.0f}  "
        f"{'yes' if r['fits'] else 'NO':<4}  {status}"
    )


def _verdict(title: str, rows: list[dict], target: float | None) -> str:
    ok = [r for r in rows if r["fits"] and math.isfinite(r["step_s"])]
    if not ok:
        return f"{title}: no rung fits"
    top = min(ok, key=lambda r: r["step_s"])
    ph = top["phases"]
    worst = max(ph, key=lambda k: ph[k])
    line = (
        f"{title}: {top['step_s']:.0f} s/step (low-high {_band(top['bounds'])}) at "
        f"'{top['name']}' (longest phase: {worst} {ph[worst]:.0f} s)"
    )
    if target is not None:
        verdict = "reached" if top["step_s"] <= target else "NOT reached"
        line += f"; target <= {target:.0f} s/step: {verdict}"
    return line


def format_ladder(report: dict) -> str:
    """The ladder (:func:`megagrpo.plan.ladder.ladder_report`) as a text table: the config
    as written first, every rung (cumulative) with the gate's status, then the best exact
    and the best unverified step against the targets for this GPU count."""
    head = (
        f"{'rung':<25} {'generate':>8} {'collapse':>8} {'sync':>6} {'train':>6} {'trans':>6} "
        f"{'overlap':>8} {'s/step':>7} {'low-high':>9} {'tok/s/GPU':>9}  fits  status"
    )
    gpus, config, rows = report["num_gpus"], report["config"], report["rungs"]
    lines = [
        f"throughput ladder, {gpus} GPUs (seconds per step, central estimates; low-high from "
        "the assumptions' ranges):",
        head,
        _line(config),
        "-" * len(head),
        *[_line(r) for r in rows],
    ]
    c = report.get("collapse")
    if c:
        lines.append(
            f"dynamic sampling ({c['policy']}, max_resample {c['max_resample']}; levels: "
            f"{c['source']}): {c['rounds_per_step']:.2f} generation rounds and "
            f"{c['trained_groups_per_step']:.1f} of {c['batch_groups']} groups trained per "
            f"step (raw ACR {c['acr_raw']:.3f}); 'collapse' is what the extra rounds cost"
        )
    targets = report.get("targets", {})
    exact = [*report["exact"], *([config] if config["status"] == EXACT else [])]
    ok = (EXACT, UNVERIFIED)
    unverified = [*report["unverified"], *([config] if config["status"] in ok else [])]
    lines.append(_verdict("best exact", exact, targets.get(EXACT)))
    lines.append(_verdict("best unverified", unverified, targets.get(UNVERIFIED)))
    refused = [r for r in [config, *rows] if r["status"] not in ok]
    for r in refused:
        lines.append(f"  {r['name']}: {r.get('detail', r['note'])}")
    return "\n".join(lines)
