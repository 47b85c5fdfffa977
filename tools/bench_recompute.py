#!/usr/bin/env python
"""Benchmark activation recompute: peak memory of one train step with ``model.recompute``
none vs full, and the LoRA gradients of both (they must be equal).

One train step = ``policy.forward_logits`` + a weighted-sum loss + backward, on a random
Qwen3 model (dense or MoE, sizes below) with LoRA on qkv/proj/fc1/fc2 and non-zero B, at
world size 1 (gloo on CPU, NCCL on CUDA). Each mode runs in its own fresh subprocess after
one warm-up step, so the figures do not mix. Peak extra memory of the measured step:
  * CPU: peak RSS (VmHWM, reset through /proc/self/clear_refs after malloc_trim(0) handed
    freed heap pages back) minus the RSS just before the step;
  * CUDA: torch.cuda.max_memory_allocated() minus memory_allocated() before the step.
"Saved for backward" is the bytes of the distinct storages autograd kept at the end of the
forward (torch.autograd.graph.saved_tensors_hooks), on either device.

Usage: python tools/bench_recompute.py [--device cpu|cuda] [--kind dense|moe] [--json]
       python tools/bench_recompute.py --quick      (2 layers, h=64, 64 tokens)
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

MODES = ("none", "full")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--kind", choices=["dense", "moe"], default="dense")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--ffn", type=int, default=768, help="dense MLP / per-expert FFN size")
    p.add_argument("--seq", type=int, default=1024, help="tokens per sequence")
    p.add_argument("--batch", type=int, default=2, help="sequences in the micro-batch")
    p.add_argument(
        "--dtype",
        choices=["float32", "bfloat16"],
        default=None,
        help="base weights (default: float32 on CPU, bfloat16 on CUDA)",
    )
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: default)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--quick", action="store_true", help="2 layers, h=64, 64 tokens: does it run?")
    p.add_argument("--worker", choices=MODES, help=argparse.SUPPRESS)
    p.add_argument("--model-dir", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.quick:
        a.layers, a.hidden, a.ffn, a.seq, a.batch = 2, 64, 128, 64, 1
    return a


def _rss_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def _malloc_trim() -> None:
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:  # not glibc: RSS may then under-count reused memory
        pass


def build_model(a: argparse.Namespace, out: Path) -> Path:
    """A random HF checkpoint of the requested size (megagrpo.testing's tiny tokenizer)."""
    from megagrpo.testing import build_tiny_model

    sizes = dict(
        hidden_size=a.hidden,
        num_hidden_layers=a.layers,
        num_attention_heads=max(a.hidden // 64, 1),
        num_key_value_heads=max(a.hidden // 128, 1),
        head_dim=64,
        max_position_embeddings=max(a.seq, 1024),
    )
    if a.kind == "moe":
        sizes.update(moe_intermediate_size=a.ffn, num_experts=8, num_experts_per_tok=2)
    else:
        sizes.update(intermediate_size=a.ffn)
    return build_tiny_model(out, a.kind, **sizes)


def _policy(a: argparse.Namespace, mode: str):
    from megagrpo.model.config import LoraConfig, ModelConfig
    from megagrpo.model.policy import build_policy
    from megagrpo.parallel import ParallelConfig, init_parallel

    groups = init_parallel(ParallelConfig())
    dtype = a.dtype or ("bfloat16" if a.device == "cuda" else "float32")
    cfg = ModelConfig(
        hf_path=a.model_dir,
        dtype=dtype,
        spec="local",
        recompute=mode,
        max_seq_len=a.seq,
        lora=LoraConfig(rank=16, targets=["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]),
    )
    policy = build_policy(cfg, groups)
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():  # non-zero B: every adapter is on the gradient path
        for name in sorted(policy.adapters):
            b = policy.adapters[name].lora_B
            b.copy_(torch.randn(b.shape, generator=gen).to(b.device) * 0.02)
    return policy, groups


def _step(policy, ids: torch.Tensor, w: torch.Tensor, storages: dict | None = None) -> float:
    for p in policy.lora_parameters():
        p.grad = None

    def pack(t):
        if storages is not None:
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = (policy.forward_logits(ids).float() * w).sum() / w.numel()
    loss.backward()
    return float(loss)


def worker(a: argparse.Namespace) -> None:
    """Measure one train step of ``a.worker`` in this fresh process; torch.save to --out."""
    if a.threads:
        torch.set_num_threads(a.threads)
    policy, groups = _policy(a, a.worker)
    dev = groups.device
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, policy.arch.vocab_size, (a.batch, a.seq), generator=gen)
    w = torch.randn(a.batch, a.seq, policy.arch.vocab_size, generator=gen).to(dev)
    _step(policy, ids, w)  # warm-up: lazy buffers, allocator pools
    storages: dict[int, int] = {}
    if a.device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        _malloc_trim()
        Path("/proc/self/clear_refs").write_text("5")  # peak-RSS reset (a /proc control file)
        base = _rss_bytes("VmRSS")
    t0 = time.perf_counter()
    loss = _step(policy, ids, w, storages)
    if a.device == "cuda":
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
    else:
        peak = _rss_bytes("VmHWM") - base
    seconds = time.perf_counter() - t0
    grads = {
        n: p.grad.detach().float().cpu()
        for n, p in policy.model.named_parameters()
        if p.grad is not None
    }
    save_result(
        {
            "loss": loss,
            "peak": peak,
            "saved": sum(storages.values()),
            "seconds": seconds,
            "grads": grads,
        },
        a.out,
    )


def save_result(obj: object, path: str | Path) -> None:
    """``torch.save`` of a worker's result into the file its parent named (via fileio)."""
    import io

    from megagrpo import fileio

    buf = io.BytesIO()
    torch.save(obj, buf)
    fileio.write_bytes(path, buf.getvalue())


def run(a: argparse.Namespace) -> dict:
    """Both modes in fresh subprocesses; the side-by-side figures and the gradient check."""
    res = {}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_model(a, Path(tmp) / "model")
        for mode in MODES:
            out = Path(tmp) / f"{mode}.pt"
            cmd = [
                sys.executable,
                __file__,
                "--worker",
                mode,
                "--model-dir",
                str(model_dir),
                "--out",
                str(out),
            ] + _passthrough(a)
            proc = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ))
            if proc.returncode != 0:
                raise RuntimeError(f"worker {mode} failed:\n{proc.stderr[-4000:]}")
            res[mode] = torch.load(out)
    g0, g1 = res["none"]["grads"], res["full"]["grads"]
    if set(g0) != set(g1) or not g0:
        raise RuntimeError("the two modes trained different parameters")
    rel = max(float((g1[n] - g0[n]).abs().max() / g0[n].abs().max().clamp_min(1e-30)) for n in g0)
    fp32 = (a.dtype or ("bfloat16" if a.device == "cuda" else "float32")) == "float32"
    tol = 1e-5 if fp32 else 2e-2
    return {
        "device": a.device,
        "kind": a.kind,
        "shape": {"layers": a.layers, "hidden": a.hidden, "ffn": a.ffn, "tokens": a.batch * a.seq},
        "peak_mib": {m: round(res[m]["peak"] / 2**20, 1) for m in MODES},
        "saved_for_backward_mib": {m: round(res[m]["saved"] / 2**20, 1) for m in MODES},
        "step_s": {m: round(res[m]["seconds"], 3) for m in MODES},
        "loss": {m: res[m]["loss"] for m in MODES},
        "lora_grad_max_rel_diff": rel,
        "grads_equal": rel <= tol,
        "tolerance": tol,
    }


def _passthrough(a: argparse.Namespace) -> list[str]:
    out = [
        "--device",
        a.device,
        "--kind",
        a.kind,
        "--layers",
        str(a.layers),
        "--hidden",
        str(a.hidden),
        "--ffn",
        str(a.ffn),
        "--seq",
        str(a.seq),
        "--batch",
        str(a.batch),
        "--threads",
        str(a.threads),
    ]
    return out + (["--dtype", a.dtype] if a.dtype else [])


def main(argv=None) -> int:
    a = parse_args(argv)
    if a.worker:
        worker(a)
        return 0
    r = run(a)
    if a.json:
        print(json.dumps(r))
    else:
        print(f"recompute benchmark ({r['device']}, {r['kind']}, {r['shape']})")
        print(f"{'':28}{'none':>12}{'full':>12}")
        for key, label in (
            ("peak_mib", "peak extra memory (MiB)"),
            ("saved_for_backward_mib", "saved for backward (MiB)"),
            ("step_s", "step time (s)"),
            ("loss", "loss"),
        ):
            v = r[key]
            print(f"{label:28}{v['none']:>12.4g}{v['full']:>12.4g}")
        print(
            f"LoRA grads max relative difference {r['lora_grad_max_rel_diff']:.2e} "
            f"(equal: {r['grads_equal']}, tolerance {r['tolerance']:g})"
        )
    return 0 if r["grads_equal"] else 1


if __name__ == "__main__":
    sys.exit(main())
