"""Time the terms the planner's step time hangs on, on this cluster, at a run config's sizes.

    torchrun --nnodes 2 --nproc-per-node 8 ... tools/measure_cluster.py CONFIG --out F.json
    python tools/measure_cluster.py CONFIG --out F.json            # one GPU: its own terms
    python tools/measure_cluster.py --quick [--nproc 2]            # gloo on CPU, tiny sizes

then ``megagrpo plan-memory CONFIG --hw-file F.json`` plans with the measured figures and
``megagrpo report RUN_DIR --hw-file F.json`` prints them beside the planner's assumptions
(:mod:`megagrpo.plan.hwfile`). ``slurm/measure_cluster.sh`` is the two-node command.

What it times (median of ``--repeats``, the slowest rank's time, after a warm-up):

* the engine's collectives at the decode and the prefill message of the config: lock-stepped
  expert-parallel replicas all-gather + reduce-scatter hidden states and router logits of
  every replica's tokens over all GPUs (decode: ``batch_groups x group_size`` running
  sequences; prefill: one scheduler pass of 16,384 tokens per replica); tensor-parallel
  replicas all-reduce ``tokens x hidden`` over their group;
* the trainer's MoE all-to-all over its expert-parallel group (one micro-batch's routed
  copies) and an all-gather inside a node (the NVLink rate);
* HBM (a device copy), host <-> device copies of pinned memory with every local rank copying
  at once (GPU only), and training GEMMs at the model's shapes (an expert's fc1 at the routed
  rows of a micro-batch, the attention qkv projection).

Groups larger than the launched world shrink to it (a 16-GPU measurement of a 128-GPU config
measures 16-rank rings: the planner scales latency by hops, ``megagrpo.plan.links``).
``--quick``: 2 gloo processes on CPU at tiny sizes (checks the pipeline; measures nothing
about a cluster); the file then says ``backend: gloo``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

PREFILL_PASS_TOKENS = 16384  # megagrpo.plan.time.ENGINE_BATCHED_TOKENS (vLLM 0.33, H100)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("config", nargs="?", default=str(REPO / "configs/qwen3_235b_a22b_2node.yaml"))
    p.add_argument("--hf-config", default=str(REPO / "configs/qwen3_235b_a22b.hf_config.json"))
    p.add_argument(
        "--out",
        default=None,
        help="the JSON plan-memory --hw-file reads (default cluster.json; with --quick a "
        "temporary directory's, so a smoke run never replaces a measured file)",
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace an existing --out file (refused otherwise: it holds a measurement)",
    )
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--scale", type=float, default=1.0, help="message sizes x this")
    p.add_argument("--nproc", type=int, default=0, help="spawn N local gloo ranks (CPU)")
    p.add_argument("--quick", action="store_true", help="2 gloo ranks on CPU, tiny sizes")
    args = p.parse_args(argv)
    if args.quick:
        args.nproc, args.repeats, args.scale = args.nproc or 2, 2, 1e-4
        if args.out is None:
            import tempfile

            args.out = str(Path(tempfile.mkdtemp(prefix="measure_cluster_")) / "cluster.json")
    args.out = args.out or "cluster.json"
    if Path(args.out).exists() and not args.overwrite:
        p.error(
            f"--out {args.out} exists (an earlier measurement): name another file, or pass "
            "--overwrite to replace it"
        )
    return args


def sizes(cfg, hf: dict, world: int, scale: float) -> dict:
    """Message sizes (bytes) and GEMM shapes of the config, for a world of ``world`` ranks."""
    from megagrpo.plan.memory import shapes_of

    s = shapes_of(hf)
    ro, tr = cfg.rollout, cfg.trainer
    lockstep = ro.replicas == "lockstep" and ro.enable_expert_parallel
    token = s.h * 2 + s.experts * 2  # hidden state + router logits (bf16)
    seqs = tr.batch_groups * ro.group_size
    engine = world if lockstep else min(ro.tensor_parallel_size, world)
    replicas = max(1, cfg.cluster.num_gpus // max(1, ro.tensor_parallel_size))
    prompt = 330.0 * seqs  # megagrpo.plan.scenario.Assumptions.mean_prompt_tokens
    pass_tokens = min(prompt, PREFILL_PASS_TOKENS * replicas)
    if lockstep:
        decode = ("all_gather", seqs * token)
        prefill = ("all_gather", pass_tokens * token)
    else:
        decode = ("all_reduce", seqs / replicas * s.h * 2)
        prefill = ("all_reduce", min(prompt / replicas, PREFILL_PASS_TOKENS) * s.h * 2)
    mb_tokens = tr.pack_tokens or tr.micro_batch_size * ro.max_model_len
    ep = min(cfg.parallel.ep, world)
    a2a = mb_tokens / max(1, cfg.parallel.tp) * s.topk * s.h * 2
    rows = max(1, int(cfg.parallel.ep * mb_tokens * s.topk / max(1, s.experts)))
    q = (s.heads + 2 * s.kv) * s.hd // max(1, cfg.parallel.tp)

    def b(x: float) -> int:
        return max(256, int(x * scale) // 256 * 256)

    def dim(x: float) -> int:  # GEMM dimensions shrink with the cube root of the scale
        return max(8, int(x * scale ** (1 / 3)))

    return {
        "engine_ranks": engine,
        "ep_ranks": ep,
        "decode": (decode[0], b(decode[1])),
        "prefill": (prefill[0], b(prefill[1])),
        "a2a": b(a2a),
        "hbm": b(1 << 30),
        "host": b(1 << 30),
        "gemm": {
            "expert_fc1": (dim(rows), dim(s.h), dim(2 * (s.moe_ffn or s.ffn))),
            "attention_qkv": (dim(mb_tokens), dim(s.h), dim(q)),
        },
    }


class Timer:
    """Median over repeats of the slowest rank's seconds (collective: every rank calls)."""

    def __init__(self, torch, dist, device, repeats: int) -> None:
        self.torch, self.dist, self.device, self.repeats = torch, dist, device, repeats

    def sync(self) -> None:
        if self.device.type == "cuda":
            self.torch.cuda.synchronize()

    def __call__(self, fn, group=None, member: bool = True) -> float:
        torch, dist = self.torch, self.dist
        if not member:  # a rank outside the group takes no part
            return 0.0
        fn()  # warm-up (NCCL connects lazily)
        times = []
        for _ in range(self.repeats):
            self.sync()
            if dist.is_initialized():
                dist.barrier(group=group)
            t0 = time.perf_counter()
            fn()
            self.sync()
            dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64, device=self.device)
            if dist.is_initialized():
                dist.all_reduce(dt, op=dist.ReduceOp.MAX, group=group)
            times.append(float(dt.item()))
        return statistics.median(times)


def collectives(timer, sz: dict, world: int, per_node: int) -> list[dict]:
    """The ring collectives and the all-to-all at the config's sizes (module doc)."""
    from megagrpo.plan.hwfile import moved_bytes

    torch, dist, dev = timer.torch, timer.dist, timer.device
    # torch 2.13 renames the tensor forms; older torch (GPU images) has only the old names
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    out = []
    engine = sz["engine_ranks"]
    groups = {world: None}
    for n in sorted({engine, min(per_node, world), sz["ep_ranks"]}):
        if 1 < n < world:  # every rank creates every group (torch.distributed's rule)
            groups[n] = dist.new_group(list(range(n)))
    rank = dist.get_rank()

    # bf16 as the engines send it; gloo (CPU) has no bf16 reductions: fp32 of the same bytes
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    esize = torch.empty(0, dtype=dtype).element_size()

    def run(name: str, op: str, n: int, nbytes: int) -> None:
        if n <= 1 or n not in groups:
            return
        g, member = groups[n], rank < n
        numel = max(n, nbytes // esize // n * n)  # the gathered / reduced tensor
        part = numel // n
        x = torch.ones(part if op == "all_gather" else numel, dtype=dtype, device=dev)
        y = torch.empty(numel if op == "all_gather" else part, dtype=dtype, device=dev)
        z = torch.empty_like(x)

        def fn() -> None:
            if op == "all_gather":
                gather(y, x, group=g)
            elif op == "reduce_scatter":
                scatter(y, x, group=g)
            elif op == "all_reduce":
                dist.all_reduce(x, group=g)
            else:
                dist.all_to_all_single(z, x, group=g)

        secs = timer(fn, g, member)
        nb = numel * esize
        nodes = max(1, -(-n // per_node))
        bus = moved_bytes(op, nb, n) / secs / 1e9 if secs > 0 else 0.0
        out.append(
            dict(name=name, op=op, ranks=n, nodes=nodes, bytes=nb, seconds=secs, busbw_gb_s=bus)
        )

    for phase in ("decode", "prefill"):
        op, nb = sz[phase]
        run(f"engine_{phase}_{op}", op, engine, nb)
        if op == "all_gather":  # the reduce-scatter of the same tokens
            run(f"engine_{phase}_reduce_scatter", "reduce_scatter", engine, nb)
    run("trainer_ep_all_to_all", "all_to_all", sz["ep_ranks"], sz["a2a"])
    node = min(per_node, world)
    if node != engine:
        _, nb = sz["prefill"]
        run("node_all_gather", "all_gather", node, nb)
        run("node_all_gather_small", "all_gather", node, sz["decode"][1])
    return out


def single_gpu(timer, sz: dict) -> list[dict]:
    """HBM copy, pinned host copies (GPU only) and the training GEMMs (module doc)."""
    torch, dev = timer.torch, timer.device
    out = []
    n = sz["hbm"] // 2
    a = torch.empty(n, dtype=torch.bfloat16, device=dev)
    b = torch.empty_like(a)
    secs = timer(lambda: b.copy_(a))
    out.append(dict(name="hbm_copy", op="hbm_copy", bytes=n * 2, seconds=secs))
    if dev.type == "cuda":
        h = torch.empty(sz["host"] // 2, dtype=torch.bfloat16, pin_memory=True)
        d = torch.empty(sz["host"] // 2, dtype=torch.bfloat16, device=dev)
        for op, fn in (
            ("h2d", lambda: d.copy_(h, non_blocking=True)),
            ("d2h", lambda: h.copy_(d, non_blocking=True)),
        ):
            out.append(dict(name=op, op=op, bytes=h.numel() * 2, seconds=timer(fn)))
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    for name, (m, k, nn) in sz["gemm"].items():
        x = torch.randn(m, k, dtype=dtype, device=dev)
        w = torch.randn(k, nn, dtype=dtype, device=dev)
        secs = timer(lambda x=x, w=w: x @ w)
        out.append(
            dict(name=name, op="gemm", shape=[m, k, nn], flops=2.0 * m * k * nn, seconds=secs)
        )
    return out


def measure(args: argparse.Namespace, rank: int, world: int) -> dict | None:
    import torch
    import torch.distributed as dist

    from megagrpo.config import load_config
    from megagrpo.model.arch import load_hf_config
    from megagrpo.plan.hwfile import VERSION, derive_hardware
    from megagrpo.trainer.config import RunConfig

    cuda = torch.cuda.is_available() and not args.quick
    dev = (
        torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    )
    if cuda:
        torch.cuda.set_device(dev)
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world)
    cfg = load_config(RunConfig, [args.config], ["trainer.allow_lossy_sync=true"])
    hf = load_hf_config(args.hf_config)
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", cfg.cluster.gpus_per_node if cuda else world))
    sz = sizes(cfg, hf, world, args.scale)
    timer = Timer(torch, dist, dev, args.repeats)
    rows = collectives(timer, sz, world, per_node) if world > 1 else []
    rows += single_gpu(timer, sz)
    if dist.is_initialized():
        dist.barrier()
    if rank != 0:
        return None
    name = torch.cuda.get_device_name(dev) if cuda else f"cpu ({socket.gethostname()})"
    return {
        "version": VERSION,
        "tool": "tools/measure_cluster.py",
        "backend": "nccl" if cuda and world > 1 else ("gloo" if world > 1 else "none"),
        "device": name,
        "world": world,
        "gpus_per_node": per_node,
        "config": str(args.config),
        "measured_at": time.strftime("%Y-%m-%d %H:%M:%S"),
        "measurements": rows,
        "hardware": derive_hardware(rows, per_node),
    }


def _worker(rank: int, args: argparse.Namespace, world: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_RANK=str(rank))
    os.environ["LOCAL_WORLD_SIZE"] = str(world)
    result = measure(args, rank, world)
    if result is not None:
        write(args.out, result)


def write(out: str, result: dict) -> None:
    from megagrpo import fileio

    fileio.write_text(out, json.dumps(result, indent=1) + "\n")
    hw = ", ".join(f"{k}={v:.3g}" for k, v in result["hardware"].items())
    print(f"measure_cluster: {result['world']} rank(s), {result['backend']}, {result['device']}")
    for m in result["measurements"]:
        extra = f", busbw {m['busbw_gb_s']:.2f} GB/s" if "busbw_gb_s" in m else ""
        mb, us = m.get("bytes", 0) / 1e6, m["seconds"] * 1e6
        print(f"  {m['name']:<34} {mb:>10.2f} MB {us:>12.1f} us{extra}")
    print(f"hardware for plan-memory --hw-file {out}: {hw}")


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if args.nproc > 1:
        from torch.multiprocessing.spawn import spawn

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        spawn(_worker, args=(args, args.nproc, port), nprocs=args.nproc, join=True)
        return 0
    world = int(os.environ.get("WORLD_SIZE", 1))
    rank = int(os.environ.get("RANK", 0))
    result = measure(args, rank, world)
    if result is not None:
        write(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
