#!/usr/bin/env python
"""Weight-sync bytes and time per mode: measured on a CPU model, estimated for Qwen3-235B.

Measured (2 gloo ranks, expert parallelism 2, a random Qwen3-MoE built here with
``--hidden``/``--layers``/``--experts``; real ``MegatronPolicy``, real export):
  * merged per-tensor (today): ``policy.export_hf_weights()``: every HF tensor zero-filled and
    all-reduced over its model-parallel group, every full tensor on every rank;
  * merged owner broadcast: the same tensors, each broadcast from the rank that owns it whole
    (experts under EP) or taken locally (replicated dense weights): half the bytes;
  * adapter-only, PEFT directory (``trainer.adapter_transport: peft_dir``): ``gather_lora``
    (full fp32 factors, two all-reduces per HF tensor) + PEFT files written by rank 0; and
    streamed (``adapter_transport: streamed``, the default): ``policy.stream_adapter`` (the
    owners' shards in bf16 buckets, one reduce to rank 0 per bucket, the PEFT state built in
    memory there).
  Rank 0 then loads the merged stream into a real HF engine (``HFEngine.update_weights``).
Estimated: the 235B modes for the 2-node and 16-node configs from megagrpo.plan.time
(bytes per GPU and seconds over the stated bandwidths).

Usage: python tools/bench_sync.py [--hidden 256 --layers 4 --experts 8] [--repeat 3]
       python tools/bench_sync.py --quick     (h=64, 2 layers, 4 experts, 1 repeat)
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--json", action="store_true")
    p.add_argument("--quick", action="store_true", help="h=64, 2 layers, 4 experts, 1 repeat")
    a = p.parse_args(argv)
    if a.quick:
        a.hidden, a.layers, a.experts, a.repeat = 64, 2, 4, 1
    return a


def _owner_broadcast(policy) -> tuple[int, int]:
    """Stream the merged HF tensors by owner broadcast; (bytes received by this rank,
    tensors). A tensor this rank holds whole is sent from here; replicated ones need none."""
    from megagrpo.model.hf_mapping import hf_weight_shapes

    g = policy.groups
    shapes = hf_weight_shapes(policy.arch)
    mine = {}
    for name, shape in shapes.items():
        pieces = [p for p in policy.plan.get(name, []) if p.owner]
        covered = sum(policy.params()[p.param][p.dst].numel() for p in pieces)
        mine[name] = covered == torch.Size(shape).numel()
    owners: list = [None] * g.world_size
    dist.all_gather_object(owners, mine)
    received = 0
    for name, shape in shapes.items():
        holders = [r for r in range(g.world_size) if owners[r][name]]
        if len(holders) == g.world_size:  # replicated: every rank exports it locally
            continue
        src = holders[0]
        full = torch.empty(shape, dtype=torch.float32, device=g.device)
        if g.rank == src:
            for p in policy.plan.get(name, []):
                if p.owner:
                    full[p.src] = policy.merged_param(p.param)[p.dst]
        dist.broadcast(full, src=src)
        if g.rank != src:
            received += full.numel() * full.element_size()
    return received, len(shapes)


def _worker(rank: int, job: dict) -> dict:
    from megagrpo.model.config import LoraConfig, ModelConfig
    from megagrpo.model.peft_export import gather_lora
    from megagrpo.model.policy import build_policy
    from megagrpo.parallel import ParallelConfig, destroy_parallel, init_parallel

    g = init_parallel(ParallelConfig(ep=2))
    try:
        lora = LoraConfig(
            rank=8, alpha=16.0, targets=["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]
        )
        policy = build_policy(ModelConfig(hf_path=job["hf_dir"], lora=lora), g)
        with torch.no_grad():
            for p in policy.lora_parameters():
                p.normal_(0, 0.01)
        out: dict = {"merged": [], "broadcast": [], "adapter_peft": [], "adapter_stream": []}
        for _ in range(job["repeat"]):
            dist.barrier()
            t0 = time.perf_counter()
            nbytes = ntensors = 0
            stream = []
            for bucket in policy.export_hf_weights(merge_lora=True):
                for name, t in bucket:
                    nbytes += t.numel() * t.element_size()
                    ntensors += 1
                    stream.append((name, t))
            out["merged"].append(time.perf_counter() - t0)
            out["merged_bytes"] = 2 * nbytes * (g.world_size - 1) / g.world_size
            out["tensors"] = ntensors
            dist.barrier()
            t0 = time.perf_counter()
            out["broadcast_bytes"], _ = _owner_broadcast(policy)
            out["broadcast"].append(time.perf_counter() - t0)
            dist.barrier()
            t0 = time.perf_counter()
            with tempfile.TemporaryDirectory() as tmp:
                gather_lora(policy)
                policy.export_peft_adapter(Path(tmp) / "a")
            out["adapter_peft"].append(time.perf_counter() - t0)
            full = sum(a.numel() + b.numel() for a, b in gather_lora(policy).values())
            out["adapter_peft_bytes"] = 2 * full * 4 * (g.world_size - 1) / g.world_size
            dist.barrier()
            t0 = time.perf_counter()  # the trainer's streamed path (adapter_transport=streamed)
            state = policy.stream_adapter(torch.bfloat16, 0)
            out["adapter_stream"].append(time.perf_counter() - t0)
            full_bf16 = sum(a.numel() + b.numel() for a, b in gather_lora(policy).values()) * 2
            # a reduce of the bucketed bf16 factors: each rank sends / receives ~1x the buffer
            out["adapter_stream_bytes"] = full_bf16 * (g.world_size - 1) / g.world_size
            if state is not None:
                out["adapter_stream_state_bytes"] = sum(
                    t.numel() * t.element_size() for t in state.values()
                )
        if rank == 0:
            out["engine_update_s"] = _engine_update(job["hf_dir"], stream)
        return out
    finally:
        destroy_parallel()


def _engine_update(hf_dir: str, stream: list) -> float:
    """Seconds for a real HF engine to load rank 0's last merged stream (probe included)."""
    from megagrpo.rollout.config import RolloutConfig
    from megagrpo.rollout.hf_engine import HFEngine

    engine = HFEngine(RolloutConfig(engine="hf", max_model_len=64), hf_dir)
    t0 = time.perf_counter()
    engine.update_weights(stream, full_check=False)
    return time.perf_counter() - t0


def measured(args) -> dict:
    from megagrpo.parallel.launch import launch
    from megagrpo.testing import build_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        d = build_tiny_model(
            Path(tmp) / "m",
            "moe",
            hidden_size=args.hidden,
            num_hidden_layers=args.layers,
            num_experts=args.experts,
            moe_intermediate_size=args.hidden // 2,
            intermediate_size=args.hidden * 2,
        )
        res = launch(_worker, 2, {"hf_dir": str(d), "repeat": args.repeat})
    return res[0]


def estimated(repo: Path) -> list[dict]:
    """235B: bytes per GPU and seconds per mode for the 2-node and 16-node configs."""
    from megagrpo.config import load_config
    from megagrpo.model.arch import load_hf_config
    from megagrpo.plan.memory import memory_plan
    from megagrpo.plan.scenario import Assumptions, Hardware, scenario_from_config
    from megagrpo.plan.time import _sync
    from megagrpo.trainer.config import RunConfig

    hf = load_hf_config(repo / "configs/qwen3_235b_a22b.hf_config.json")
    rows = []
    for cfgname in ("qwen3_235b_a22b_2node.yaml", "qwen3_235b_a22b.yaml"):
        cfg = load_config(RunConfig, [repo / "configs" / cfgname])
        sc = scenario_from_config(cfg, hf)
        for sync, transport in (
            ("merged", "allreduce"),
            ("merged", "broadcast"),
            ("merged", "sliced"),
            ("adapter", "allreduce"),
            ("adapter", "sliced"),
        ):
            s = sc.with_(weight_sync=sync, sync_transport=transport, enable_lora=sync == "adapter")
            a, hw = Assumptions(), Hardware()
            memory_plan(s, a)
            r = _sync(s, a, hw)
            rows.append(
                {
                    "config": cfgname,
                    "mode": f"{sync}/{transport}",
                    "gpus": s.num_gpus,
                    "gib_per_gpu": r["bytes_per_gpu"] / 2**30,
                    "s": r["s"],
                }
            )
    return rows


def main(argv=None) -> int:
    args = parse_args(argv)
    m = measured(args)
    est = estimated(Path(__file__).resolve().parents[1])
    if args.json:
        print(json.dumps({"measured": m, "estimated": est}, default=str))
        return 0
    med = {
        k: statistics.median(m[k])
        for k in ("merged", "broadcast", "adapter_peft", "adapter_stream")
    }
    print(f"CPU, 2 gloo ranks (EP2), {m['tensors']} HF tensors, median of {args.repeat}:")
    print(f"  {'mode':<34} {'MB moved/rank':>14} {'seconds':>9}")
    for name, key, b in (
        ("merged per-tensor (all-reduce)", "merged", "merged_bytes"),
        ("merged owner broadcast", "broadcast", "broadcast_bytes"),
        ("adapter, PEFT dir", "adapter_peft", "adapter_peft_bytes"),
        ("adapter, streamed bf16 buckets", "adapter_stream", "adapter_stream_bytes"),
    ):
        print(f"  {name:<34} {m[b] / 1e6:>14.2f} {med[key]:>9.3f}")
    print(f"  engine load of the merged stream (HF engine, rank 0): {m['engine_update_s']:.3f} s")
    print("\nQwen3-235B-A22B estimate (megagrpo.plan.time, stated bandwidths):")
    print(f"  {'config':<28} {'mode':<20} {'GiB/GPU':>9} {'seconds':>8}")
    for r in est:
        print(f"  {r['config']:<28} {r['mode']:<20} {r['gib_per_gpu']:>9.2f} {r['s']:>8.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
