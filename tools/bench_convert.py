#!/usr/bin/env python
"""Benchmark HF ⇄ Megatron conversion: throughput (MB/s) and peak memory per rank.

Builds (once, under --work) a random Qwen3-MoE HF checkpoint of a few hundred MB, then for
each layout runs ``convert_ckpt import`` (stream safetensors into the rank's shards, write
them) and ``export`` (gather shards, write HF safetensors), and prints per-rank figures next
to the peer: transformers ``from_pretrained`` + ``save_pretrained`` of the whole model.

    python tools/bench_convert.py [--layouts 1,ep2,tp2] [--work /tmp/megagrpo-bench]
    python tools/bench_convert.py --quick   # the tiny test MoE, one rank, a temp dir

MB/s = HF checkpoint bytes / wall seconds of the phase (rank-local load time in brackets);
peak RSS is VmHWM of each rank process ("after imports": a process with torch + megatron
imported and nothing loaded). A 1-rank layout runs in this process.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

LAYOUTS = {"1": {}, "ep2": {"ep": 2}, "tp2": {"tp": 2}, "tp2ep2": {"tp": 2, "ep": 2}}
PEER = """
import resource, sys, time, torch
from transformers import AutoModelForCausalLM
t = time.perf_counter()
m = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32)
t_load = time.perf_counter() - t
t = time.perf_counter()
m.save_pretrained(sys.argv[2])
from megagrpo.model.megatron_ckpt import _peak_rss_mb
print(t_load, time.perf_counter() - t, _peak_rss_mb())
"""


def build_model(work: Path, quick: bool = False) -> Path:
    """A ~460 MB fp32 Qwen3-MoE (6 layers, hidden 768, 8 experts, vocab 32000); ``quick``:
    the tiny test MoE of megagrpo.testing."""
    out = work / "hf"
    if (out / "config.json").is_file():
        return out
    import torch
    from transformers import AutoModelForCausalLM

    from megagrpo.testing import tiny_config

    cfg = (
        tiny_config("moe")
        if quick
        else tiny_config(
            "moe",
            vocab_size=32000,
            hidden_size=768,
            num_attention_heads=12,
            num_key_value_heads=4,
            head_dim=64,
            num_hidden_layers=6,
            intermediate_size=2048,
            moe_intermediate_size=512,
            num_experts=8,
            num_experts_per_tok=2,
        )
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.save_pretrained(out)
    return out


def size_mb(path: Path) -> float:
    return sum(f.stat().st_size for f in path.glob("*.safetensors")) / 1e6


def baseline_rss_mb() -> float:
    code = (
        "import megagrpo.model.policy, megatron.core.models.gpt; "
        "from megagrpo.model.megatron_ckpt import _peak_rss_mb; print(_peak_rss_mb())"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
        cwd=REPO,
    )
    return float(out.stdout.strip().splitlines()[-1])


def run_layout(name: str, hf: Path, work: Path) -> dict:
    from convert_ckpt import cmd_export, cmd_import  # tools/ is on sys.path (this file's dir)

    layout = {"tp": 1, "ep": 1, "etp": 1, "pp": 1, **LAYOUTS[name]}
    ckpt, out = work / f"ckpt_{name}", work / f"out_{name}"
    shutil.rmtree(ckpt, ignore_errors=True)
    shutil.rmtree(out, ignore_errors=True)
    ns = argparse.Namespace(hf=str(hf), out=str(ckpt), dtype="float32", **layout)
    t = time.perf_counter()
    imp = cmd_import(ns)
    t_imp = time.perf_counter() - t
    ns = argparse.Namespace(
        ckpt=str(ckpt), out=str(out), merge_lora=False, adapter_only=False, shard_mb=128
    )
    t = time.perf_counter()
    exp = cmd_export(ns)
    t_exp = time.perf_counter() - t
    return {
        "layout": name,
        "world": imp["world_size"],
        "import_s": t_imp,
        "export_s": t_exp,
        "import_load_s": max(r["load_s"] for r in imp["ranks"]),
        "export_s_rank": max(r["total_s"] for r in exp["ranks"]),
        "import_rss": [round(r["peak_rss_mb"]) for r in imp["ranks"]],
        "export_rss": [round(r["peak_rss_mb"]) for r in exp["ranks"]],
        "shard_mb": [round(r["shard_bytes"] / 1e6) for r in imp["ranks"]],
    }


def main() -> int:
    sys.path.insert(0, str(REPO / "tools"))
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--layouts", default="1,ep2,tp2")
    p.add_argument("--work", default="/tmp/megagrpo-bench")
    p.add_argument("--json", action="store_true")
    p.add_argument("--build-only", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--quick", action="store_true", help="tiny model, layout 1, temp dir")
    args = p.parse_args()
    if args.quick and not args.build_only:
        with tempfile.TemporaryDirectory(prefix="bench_convert_") as tmp:
            return run(args, Path(tmp), "1")
    return run(args, Path(args.work), args.layouts)


def run(args: argparse.Namespace, work: Path, layouts: str) -> int:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    work.mkdir(parents=True, exist_ok=True)
    if (
        not args.build_only and not (work / "hf" / "config.json").is_file()
    ):  # build in a child: keep this RSS small
        quick = ["--quick"] if args.quick else []
        cmd = [sys.executable, __file__, "--build-only", "--work", str(work), *quick]
        subprocess.run(cmd, check=True)
    hf = build_model(work, args.quick)
    if args.build_only:
        return 0
    mb = size_mb(hf)
    rows = [run_layout(n, hf, work) for n in layouts.split(",")]
    peer_out = work / "peer_out"
    shutil.rmtree(peer_out, ignore_errors=True)
    res = subprocess.run(
        [sys.executable, "-c", PEER, str(hf), str(peer_out)],
        capture_output=True,
        text=True,
        env=dict(os.environ),
        cwd=REPO,
    )
    t_load, t_save, peer_rss = map(float, res.stdout.split()[-3:])
    base = baseline_rss_mb()
    report = {
        "checkpoint_mb": mb,
        "rss_after_imports_mb": base,
        "rows": rows,
        "peer": {"load_s": t_load, "save_s": t_save, "peak_rss_mb": peer_rss},
        "bench_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }
    # world-1 rows run inside this process: their peak includes this process's history
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"HF checkpoint: {mb:.0f} MB fp32; rank RSS after imports: {base:.0f} MB")
    print(
        f"{'layout':>8} {'ranks':>5} {'import MB/s':>14} {'export MB/s':>14} "
        f"{'shard MB/rank':>14} {'peak RSS import/export MB per rank':>36}"
    )
    for r in rows:
        imp = f"{mb / r['import_s']:.0f} ({mb / r['import_load_s']:.0f})"
        exp = f"{mb / r['export_s']:.0f} ({mb / r['export_s_rank']:.0f})"
        print(
            f"{r['layout']:>8} {r['world']:>5} {imp:>14} {exp:>14} "
            f"{'/'.join(map(str, r['shard_mb'])):>14} "
            f"{'/'.join(map(str, r['import_rss']))} | {'/'.join(map(str, r['export_rss']))}"
        )
    print(
        f"{'peer':>8} {1:>5} {mb / t_load:>14.0f} {mb / t_save:>14.0f} {mb:>14.0f} "
        f"{peer_rss:.0f}  (transformers from_pretrained / save_pretrained)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
