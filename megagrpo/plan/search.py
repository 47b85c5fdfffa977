"""The whole plan of a run (memory per phase + step time), the cheapest layout for a number of
GPUs (`megagrpo plan-memory --gpus N`), and their text form.

:func:`search` keeps the run's model, LoRA, batch, lengths and recompute, and tries every
trainer layout (TP in 1/2/4/8 inside a node, PP dividing the layers up to 8, EP dividing the
experts; ETP 1) with every rollout layout (vLLM TP 4/8/16, lock-stepped or independent
replicas, bf16 or FP8 weights), with and without offloading the trainer during generation,
and three weight syncs (merged all-reduce as today, merged sliced, adapter-only). The engine
gets the largest ``gpu_memory_utilization`` (a multiple of 0.05, at most 0.9) that keeps
generation inside the headroom. Among the layouts whose every phase fits, the fastest
estimated step is the cheapest (the GPU count is fixed).
"""

from __future__ import annotations

import math

from megagrpo.plan.memory import GIB, engine_weight_bytes, memory_plan, shapes_of
from megagrpo.plan.scenario import Assumptions, Hardware, Scenario
from megagrpo.plan.time import split_placement, step_time
from megagrpo.rollout.config import serves_moe_lora

SYNCS = (("merged", "allreduce"), ("merged", "sliced"), ("adapter", "sliced"))


def full_plan(sc: Scenario, a: Assumptions, hw: Hardware) -> dict:
    """:func:`~megagrpo.plan.memory.memory_plan` + ``time`` (step-time estimate) +
    the inputs (``assumptions``, ``hardware``)."""
    mem = memory_plan(sc, a)
    check_host_memory(mem, a, hw)
    if sc.placement == "separate":
        check_engine_gpus(mem, sc, a)
    mem["time"] = step_time(sc, a, hw, mem)
    mem["assumptions"] = vars(a)
    mem["hardware"] = vars(hw)
    return mem


def check_host_memory(mem: dict, a: Assumptions, hw: Hardware) -> None:
    """``mem["host"]["fits_node"]``: the pinned buffers of a node's GPUs leave ``headroom`` of
    its ``Hardware.host_memory_gib_per_node`` free; advice (and ``fits`` false) when not."""
    host = mem["host"]
    limit = (1 - a.headroom) * hw.host_memory_gib_per_node
    host["fits_node"] = host["pinned_gib_per_node"] <= limit
    if not host["fits_node"]:
        mem["fits"] = False
        mem["advice"].append(
            f"pinned host memory {host['pinned_gib_per_node']:.0f} GiB per node is over "
            f"{limit:.0f} GiB ({1 - a.headroom:.0%} of --hw host_memory_gib_per_node="
            f"{hw.host_memory_gib_per_node:.0f}): rollout.sleep_level=2 (merged sync), no "
            "trainer.offload_during_rollout, or more GPUs per model copy"
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
            f"rollout.placement=separate: the engine's {sc.rollout_gpus} GPU(s) hold "
            f"{weights:.0f} GiB of weights per GPU at vLLM tp={sc.vllm_tp} (no room for a KV "
            "cache): the separate placement runs one engine rank today; place it colocated "
            "(rollout.placement=colocated)"
        )


def best_utilization(sc: Scenario, a: Assumptions) -> float | None:
    """The largest engine budget (0.05 steps, <= 0.9) whose generate phase fits."""
    probe = memory_plan(sc.with_(gpu_memory_utilization=0.0), a)
    limit = (1 - a.headroom) * sc.gpu_memory_gib
    util = (limit - probe["phase_peak_gib"]["generate"]) / sc.gpu_memory_gib
    util = min(0.9, math.floor(util * 20) / 20)
    return util if util > 0 else None


def candidates(sc: Scenario, gpus: int):
    """Every layout :func:`search` tries for ``gpus`` GPUs (module doc)."""
    s = shapes_of(sc.hf)
    per = sc.gpus_per_node
    tps = [t for t in (1, 2, 4, 8) if t <= per and s.heads % t == 0 and s.kv % t == 0]
    pps = [p for p in (1, 2, 4, 8) if s.layers % p == 0]
    eps = [e for e in (1, 2, 4, 8, 16, 32, 64, 128) if not s.experts or s.experts % e == 0]
    for tp in tps:
        for pp in pps:
            for ep in eps if s.experts else [1]:
                if gpus % (tp * pp) or gpus % (ep * pp):
                    continue
                for vtp in (t for t in (1, 2, 4, 8, 16) if gpus % t == 0 and s.heads % t == 0):
                    for replicas in ("lockstep", "independent"):
                        for quant in ("none", "fp8"):
                            for offload in (False, True):
                                for sync, transport in SYNCS:
                                    if s.experts and not serves_moe_lora(
                                        lora=sync == "adapter",
                                        expert_parallel=True,
                                        quantization=quant,
                                        tp=vtp,
                                        dp=gpus // vtp if replicas == "lockstep" else 1,
                                    ):
                                        continue  # vLLM 0.33 refuses it (trainer.compat)
                                    yield sc.with_(
                                        num_gpus=gpus,
                                        tp=tp,
                                        pp=pp,
                                        ep=ep,
                                        etp=1,
                                        sequence_parallel=tp > 1,
                                        vllm_tp=vtp,
                                        enable_expert_parallel=bool(s.experts),
                                        replicas=replicas,
                                        quantization=quant,
                                        offload_during_rollout=offload,
                                        weight_sync=sync,
                                        sync_transport=transport,
                                        enable_lora=sync == "adapter",
                                        sleep_level=0,
                                        load_format="dummy" if offload else "auto",
                                    )


def search(sc: Scenario, a: Assumptions, hw: Hardware, gpus: int, top: int = 5) -> list[dict]:
    """The ``top`` fastest layouts for ``gpus`` GPUs whose every phase fits (module doc);
    each a :func:`full_plan` with ``overrides`` (the config keys to set)."""
    found = []
    for cand in candidates(sc, gpus):
        util = best_utilization(cand, a)
        if util is None:
            continue
        cand = cand.with_(gpu_memory_utilization=util)
        mem = memory_plan(cand, a)
        check_host_memory(mem, a, hw)
        if not mem["fits"]:
            continue
        t = step_time(cand, a, hw, mem)
        if not math.isfinite(t["step_s"]):
            continue
        mem["time"] = t
        mem.update(assumptions=vars(a), hardware=vars(hw))
        mem["overrides"] = overrides_of(cand)
        found.append(mem)
    found.sort(key=lambda p: p["time"]["step_s"])
    return found[:top]


def overrides_of(sc: Scenario) -> list[str]:
    """The ``key=value`` settings of a searched layout."""
    return [
        f"cluster.num_nodes={sc.num_gpus // sc.gpus_per_node or 1}",
        f"parallel.tp={sc.tp}",
        f"parallel.pp={sc.pp}",
        f"parallel.ep={sc.ep}",
        f"parallel.etp={sc.etp}",
        f"parallel.sequence_parallel={str(sc.sequence_parallel).lower()}",
        f"rollout.tensor_parallel_size={sc.vllm_tp}",
        f"rollout.enable_expert_parallel={str(sc.enable_expert_parallel).lower()}",
        f"rollout.gpu_memory_utilization={sc.gpu_memory_utilization}",
        f"rollout.enable_lora={str(sc.enable_lora).lower()}",
        f"trainer.weight_sync={sc.weight_sync}",
        f"rollout.replicas={sc.replicas}",
        f"rollout.quantization={sc.quantization}",
        f"rollout.load_format={sc.load_format}",
        f"trainer.offload_during_rollout={str(sc.offload_during_rollout).lower()}",
        f"trainer.sync_transport={sc.sync_transport}",
    ]


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
        lines += _format_time(p["time"], p["num_gpus"])
    verdict = "FITS" if p["fits"] else "DOES NOT FIT"
    host = p.get("host")
    if host and host["pinned_gib_per_gpu"]:
        lines.append(
            f"  host (pinned): {host['pinned_gib_per_gpu']} GiB per GPU, "
            f"{host['pinned_gib_per_node']} GiB per node ({host['exact_gib_per_gpu']} GiB of "
            "tensors; pinned buffers round up to powers of two)"
        )
    lines.append(f"per GPU: {p['per_gpu_gib']} GiB of {p['gpu_memory_gib']} GiB -> {verdict}")
    lines += [f"  - {t}" for t in p["advice"]]
    return "\n".join(lines)


def _format_time(t: dict, gpus: int) -> list[str]:
    ph = t["phases"]
    g = ph["generate"]
    lines = [
        f"  step-time estimate: {t['step_s']:.0f} s/step, "
        f"{t['tokens_per_s_per_gpu']:.0f} tokens/s/GPU ({t['tokens_per_step']:,.0f} tokens, "
        f"{gpus} GPUs)"
    ]
    if math.isfinite(g["s"]):
        lines.append(
            f"    generate    {g['s']:>7.1f} s  ({g['decode_steps']:.0f} decode steps x "
            f"{g['step_ms']:.1f} ms, batch shrinking from {g['concurrent_per_replica']:.0f} "
            f"sequences/replica (at full batch throughout: {g['full_batch_decode_s']:.0f} s), "
            f"MoE-LoRA speed {g['moe_lora_decode_speed']:.2f}, prefill {g['prefill_s']:.1f} s"
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
        f"    train       {tr['s']:>7.1f} s  (compute {tr['compute_s']:.1f}, MoE all-to-all "
        f"{tr['moe_all_to_all_s']:.1f}, SP {tr['sp_collectives_s']:.1f}, bubble "
        f"{tr['pipeline_bubble']:.0%})"
    )
    tx = ph["transitions"]
    lines.append(
        f"    transitions {tx['s']:>7.1f} s  (trainer offload {tx['trainer_offload_s']:.1f}, "
        f"engine sleep backup {tx['engine_sleep_backup_s']:.1f})"
    )
    return lines
