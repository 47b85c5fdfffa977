#!/usr/bin/env python
"""Benchmark the GRPO loss: naive (log_softmax + gather), fused (megagrpo.kernels), Liger.

Each method runs forward + backward (gradient w.r.t. the logits, or w.r.t. hidden states for
Liger's fused linear loss) in its own fresh subprocess, so the memory figures do not mix.
Peak extra memory is measured
  * on CPU: the peak of bytes torch's allocator held above its level at the call, replayed
    from the profiler's allocation events (megagrpo.profiling.allocator_peak_bytes): a count
    of tensor bytes, independent of other jobs on the machine (peak RSS is not). The timed
    call runs first, unprofiled; the logits are restored before the counted call;
  * on CUDA: torch.cuda.max_memory_allocated() minus memory_allocated() before the call.
Errors are max |fused - naive| of per-token log-probs, of the loss and of sampled gradient
rows; the naive path is the reference (megagrpo.algo.losses).

Methods: naive = log_softmax + gather + megagrpo.algo.losses.policy_loss; fused =
fused_policy_loss as configured by default (gradient written into the logits buffer,
LossConfig.grad_in_logits=True); fused_outgrad = the same with a separate gradient tensor
(grad_in_logits=False: its peak is bounded below by that [T, V] gradient itself).

Inputs: hidden [T, H] and an output projection W [V, H] give logits = hidden @ W^T [T, V]
(built in chunks, in --dtype); the naive and fused paths take the logits as their input;
fused_linear (megagrpo.kernels.fused_linear) and Liger's LigerFusedLinearGRPOLoss take hidden
and W (so they also do the projection; their gradient error is measured on hidden states).

Time: the table's ``time s`` is one forward + backward; ``worker s`` the method's whole fresh
process (imports, loading the inputs, the timed call, the counted call) and ``CPU s`` that
process's CPU seconds (all threads), which other jobs on a shared machine do not inflate (its
wall time they do, several-fold); stderr gives both per phase as each method ends. The inputs
are made once, by the parent, and loaded by every worker (the logit methods rebuild the
``[T, V]`` logits from them). The end prints the whole run's wall and CPU seconds and the load.

Usage: python tools/bench_loss.py [--device cpu|cuda] [--tokens T] [--vocab V] [--json]
       python tools/bench_loss.py --quick     (64 tokens, vocab 2048, naive / fused / fused_linear)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

METHODS = ("naive", "fused", "fused_outgrad", "fused_linear", "liger")
H200_PEAK_BYTES_PER_S = 4.8e12
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--tokens", type=int, default=4096, help="T: tokens in the batch")
    p.add_argument("--vocab", type=int, default=151936, help="V: vocabulary size")
    p.add_argument("--seq-len", type=int, default=1024, help="tokens per sequence (Liger)")
    p.add_argument("--hidden", type=int, default=128, help="H of the projection that makes logits")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--methods", default=",".join(METHODS), help="comma-separated subset")
    p.add_argument("--repeat", type=int, default=3, help="timed repeats on CUDA (CPU: 1)")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: default)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--quick", action="store_true", help="64 tokens, vocab 2048: does it run?")
    p.add_argument("--worker", choices=METHODS, help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--inputs", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.quick:
        a.tokens, a.vocab, a.seq_len, a.methods = 64, 2048, 16, "naive,fused,fused_linear"
    return a


# ----------------------------------------------------------------------------- inputs


LOGIT_METHODS = ("naive", "fused", "fused_outgrad")
"""The methods that take the ``[T, V]`` logits; the others take hidden states and W."""


def _logit_chunks(hidden: torch.Tensor, weight: torch.Tensor, dtype: torch.dtype):
    """``(row0, rows of hidden @ W^T in dtype)``, 64 MiB of fp32 logits at a time."""
    w32 = weight.float().T
    step = max(1, (64 << 20) // (4 * weight.shape[0]))
    for r0 in range(0, hidden.shape[0], step):
        yield r0, (hidden[r0 : r0 + step].float() @ w32).to(dtype)


def make_inputs(a: argparse.Namespace) -> dict:
    """Deterministic inputs of every method, made once by the parent (the workers load
    them): hidden [T, H], W [V, H], targets, old log-probs (the fused log-probs of the
    logits hidden @ W^T plus noise), advantages, mask. The logits are made chunk by chunk,
    never whole (:func:`add_logits` makes them whole for the methods that take them)."""
    from megagrpo.kernels import token_stats

    T, V, H, dev = a.tokens, a.vocab, a.hidden, a.device
    dtype = DTYPES[a.dtype]
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(T, H, generator=g).to(dev, dtype)
    weight = (torch.randn(V, H, generator=g) * (3.0 / H**0.5)).to(dev, dtype)
    tgt = torch.randint(0, V, (T,), generator=g).to(dev)
    logp = torch.empty(T, device=dev)
    with torch.no_grad():
        for r0, chunk in _logit_chunks(hidden, weight, dtype):
            r1 = r0 + chunk.shape[0]
            logp[r0:r1] = token_stats(chunk, tgt[r0:r1])[0]
    old = (logp + 0.2 * torch.randn(T, generator=g).to(dev)).float()
    num_seqs = max(1, T // a.seq_len)
    adv_seq = torch.randn(num_seqs, generator=g).to(dev)
    adv = adv_seq.repeat_interleave(T // num_seqs)
    mask = (torch.rand(T, generator=g) > 0.1).float().to(dev)
    rows = torch.randperm(T, generator=g)[:32].sort().values.to(dev)
    return dict(
        hidden=hidden,
        weight=weight,
        tgt=tgt,
        old=old,
        adv=adv,
        adv_seq=adv_seq,
        mask=mask,
        logp=logp,
        rows=rows,
        num_seqs=num_seqs,
    )


def add_logits(d: dict) -> None:
    """``d["logits"]``: the whole ``[T, V]`` logits hidden @ W^T (the chunks of
    :func:`make_inputs`, so the same values its log-probs were taken of)."""
    hidden, weight = d["hidden"], d["weight"]
    logits = torch.empty(hidden.shape[0], weight.shape[0], device=hidden.device, dtype=hidden.dtype)
    for r0, chunk in _logit_chunks(hidden, weight, hidden.dtype):
        logits[r0 : r0 + chunk.shape[0]] = chunk
    d["logits"] = logits


def load_inputs(path: str, device: str) -> dict:
    """The parent's :func:`make_inputs` (tensors and plain types only), on ``device``."""
    d = torch.load(path, weights_only=True)
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in d.items()}


def loss_cfg():
    from megagrpo.algo.config import LossConfig

    return LossConfig(variant="dapo", eps_low=0.2, eps_high=0.28)


# ----------------------------------------------------------------------------- methods


def run_naive(d: dict) -> dict:
    from megagrpo.algo.losses import policy_loss

    x = d["logits"].detach().requires_grad_()
    logp = torch.log_softmax(x.float(), dim=-1).gather(-1, d["tgt"][:, None]).squeeze(-1)
    loss, _ = policy_loss(logp, d["old"], d["adv"], d["mask"], loss_cfg())
    (grad,) = torch.autograd.grad(loss, x)
    return dict(loss=loss.detach(), grad=grad, logp=logp.detach())


def run_fused(d: dict, in_logits: bool = True) -> dict:
    from megagrpo.kernels import fused_policy_loss

    cfg = loss_cfg()
    cfg.grad_in_logits = in_logits
    x = d["logits"].detach().requires_grad_()
    loss, _ = fused_policy_loss(x, d["tgt"], d["old"], d["adv"], d["mask"], cfg)
    (grad,) = torch.autograd.grad(loss, x)
    return dict(loss=loss.detach(), grad=grad)


def run_fused_linear(d: dict) -> dict:
    from megagrpo.kernels.fused_linear import fused_linear_policy_loss

    h = d["hidden"].detach().requires_grad_()
    loss, _ = fused_linear_policy_loss(
        h, d["weight"], d["tgt"], d["old"], d["adv"], d["mask"], loss_cfg()
    )
    (grad_h,) = torch.autograd.grad(loss, h)
    return dict(loss=loss.detach(), grad_hidden=grad_h)


def run_liger(d: dict) -> dict:
    from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

    n, T = d["num_seqs"], d["tgt"].numel()
    s = T // n
    compiled = d["hidden"].is_cuda  # Liger's intended mode on GPU; eager on CPU (no compiler)
    fn = LigerFusedLinearGRPOLoss(
        beta=0.0,
        compiled=compiled,
        use_ref_model=False,
        chunk_size=1,
        epsilon_low=0.2,
        epsilon_high=0.28,
        loss_type="dapo",
    )
    h = d["hidden"].detach().view(n, s, -1).requires_grad_()
    out = fn(
        h,
        d["weight"],
        d["tgt"].view(n, s),
        d["mask"].view(n, s),
        d["adv_seq"],
        old_per_token_logps=d["old"].view(n, s),
    )
    loss = out[0] if isinstance(out, tuple) else out
    (grad_h,) = torch.autograd.grad(loss, h)
    return dict(loss=loss.detach(), grad_hidden=grad_h.reshape(T, -1))


RUNNERS = {
    "naive": run_naive,
    "fused": run_fused,
    "fused_outgrad": lambda d: run_fused(d, in_logits=False),
    "fused_linear": run_fused_linear,
    "liger": run_liger,
}


# ----------------------------------------------------------------------------- measuring


class Phases:
    """Wall and CPU seconds of a worker's phases, in order (CPU: this process, all its
    threads; unlike wall time it barely moves when other jobs share the cores)."""

    def __init__(self) -> None:
        self.times: dict[str, tuple[float, float]] = {}
        self._w, self._c = time.perf_counter(), time.process_time()

    def mark(self, name: str) -> None:
        """The phase ``name`` ends now (it began at the last mark)."""
        w, c = time.perf_counter(), time.process_time()
        self.times[name] = (w - self._w, c - self._c)
        self._w, self._c = w, c


def measure(
    method: str, d: dict, a: argparse.Namespace, clock: Phases | None = None
) -> tuple[dict, int, float]:
    """(outputs, peak extra bytes, seconds) of one forward + backward of ``method``;
    ``clock`` marks the phases ``call`` (the timed call(s)) and ``count`` (the memory count)."""
    fn = RUNNERS[method]
    clock = clock or Phases()
    if a.device == "cuda":
        # "fused" overwrites the logits with their gradient (hidden-state methods take none)
        pristine = d["logits"].clone() if "logits" in d else None

        def restore():
            if pristine is not None:
                d["logits"].copy_(pristine)
            torch.cuda.synchronize()

        fn(d)  # warm-up: compile kernels, allocator pools
        times = []
        for _ in range(a.repeat):
            restore()
            t0 = time.perf_counter()
            fn(d)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        restore()
        del pristine
        clock.mark("call")
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        out = fn(d)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        out = keep(out, d)
        clock.mark("count")
        return out, peak, sorted(times)[len(times) // 2]
    from megagrpo.profiling import allocator_peak_bytes

    saved = d["logits"].clone() if "logits" in d else None  # "fused" writes grads into them
    t0 = time.perf_counter()
    out = keep(fn(d), d)
    seconds = time.perf_counter() - t0
    if saved is not None:
        d["logits"].copy_(saved)
    del saved
    clock.mark("call")
    _, peak = allocator_peak_bytes(fn, d)
    clock.mark("count")
    return out, peak, seconds


def keep(out: dict, d: dict) -> dict:
    """What the report needs of ``out`` (sampled gradient rows, log-probs, loss), copied:
    the logits buffer that may hold the gradient is reused by the next call."""
    rows = d["rows"]
    kept = {"loss": out["loss"]}
    if "grad" in out:
        kept["grad_rows"] = out["grad"][rows].float().cpu()
    if "grad_hidden" in out:
        kept["grad_hidden_rows"] = out["grad_hidden"][rows].float().cpu()
    if "logp" in out:
        kept["logp"] = out["logp"].cpu()
    return kept


def worker(a: argparse.Namespace) -> None:
    """Run one method in this (fresh) process and torch.save its figures to --out."""
    clock = Phases()
    if a.threads:
        torch.set_num_threads(a.threads)
    small = argparse.Namespace(**{**vars(a), "tokens": 8, "vocab": 64, "seq_len": 4})
    d = make_inputs(small)
    add_logits(d)
    RUNNERS[a.worker](d)  # load code paths outside the measured region
    clock.mark("warmup")
    d = load_inputs(a.inputs, a.device) if a.inputs else make_inputs(a)
    if a.worker in LOGIT_METHODS:
        add_logits(d)
    clock.mark("inputs")
    out, peak, seconds = measure(a.worker, d, a, clock)
    res = {
        "method": a.worker,
        "peak_bytes": int(peak),
        "time_s": seconds,
        # wall and CPU seconds per phase; the CPU before worker() is the imports'
        "phases": {k: list(v) for k, v in clock.times.items()},
        "startup_cpu_s": time.process_time() - sum(c for _, c in clock.times.values()),
        "loss": float(out["loss"]),
        "logp_fused": d["logp"].cpu(),
    }
    if "grad_rows" in out:
        res["grad_rows"] = out["grad_rows"]
        res["grad_hidden_rows"] = out["grad_rows"] @ d["weight"].float().cpu()
    for key in ("grad_hidden_rows", "logp"):
        if key in out:
            res[key] = out[key]
    res["input_bytes"] = a.tokens * a.vocab * DTYPES[a.dtype].itemsize  # the [T, V] logits
    save_result(res, a.out)


def save_result(obj: object, path: str | Path) -> None:
    """``torch.save`` of a worker's result into the file its parent named (via fileio)."""
    import io

    from megagrpo import fileio

    buf = io.BytesIO()
    torch.save(obj, buf)
    fileio.write_bytes(path, buf.getvalue())


def save_inputs(a: argparse.Namespace, path: Path) -> None:
    """Make the inputs once, for every worker (on stderr: how long it took)."""
    if a.threads:
        torch.set_num_threads(a.threads)
    w, c = time.perf_counter(), time.process_time()
    d = make_inputs(a)
    save_result({k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in d.items()}, path)
    del d
    if a.device == "cuda":
        torch.cuda.empty_cache()
    w, c = time.perf_counter() - w, time.process_time() - c
    print(f"[inputs] made once for every method: {w:.0f} s wall / {c:.0f} s CPU", file=sys.stderr)


def spawn(method: str, a: argparse.Namespace, tmp: Path) -> dict | None:
    out = tmp / f"{method}.pt"
    cmd = [
        sys.executable,
        __file__,
        "--worker",
        method,
        "--out",
        str(out),
        "--device",
        a.device,
        "--tokens",
        str(a.tokens),
        "--vocab",
        str(a.vocab),
        "--seq-len",
        str(a.seq_len),
        "--hidden",
        str(a.hidden),
        "--dtype",
        a.dtype,
        "--repeat",
        str(a.repeat),
        "--threads",
        str(a.threads),
        "--inputs",
        str(tmp / "inputs.pt"),
    ]
    before = _children_cpu()
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    took, cpu = time.perf_counter() - t0, _children_cpu() - before
    if proc.returncode != 0:
        print(f"[{method}] failed:\n{proc.stderr[-3000:]}", file=sys.stderr)
        return None
    r = torch.load(out, weights_only=True)  # tensors and plain types only
    r["worker_s"], r["worker_cpu_s"] = took, cpu
    # startup: the interpreter and imports (CPU: the worker's own count), result I/O (wall)
    done_w = sum(w for w, _ in r["phases"].values())
    r["phases"] = {"startup": [took - done_w, r.pop("startup_cpu_s")], **r["phases"]}
    return r


def _children_cpu() -> float:
    """User + system CPU seconds of this process's finished children."""
    import resource

    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def progress(r: dict | None, m: str, took: float) -> str:
    """One method's stderr line: its peak, its timed call, the whole worker (wall / CPU
    seconds, per phase): on a shared machine the wall time stretches, the CPU time does not."""
    if r is None:
        return f"{m}: failed, {took:.0f} s"
    parts = ", ".join(f"{k} {w:.0f}/{c:.0f}" for k, (w, c) in r["phases"].items())
    return (
        f"{m}: peak {r['peak_bytes'] / 2**20:.0f} MiB, call {r['time_s']:.1f} s; worker "
        f"{r['worker_s']:.0f} s wall / {r['worker_cpu_s']:.0f} s CPU (wall/CPU s: {parts})"
    )


# ----------------------------------------------------------------------------- report


def cpu_isa() -> str:
    """torch's CPU capability and the bf16 instructions the CPU has: the bf16 GEMMs of
    fused_linear and Liger run ~170-450 GFLOP/s with AMX, ~30 without bf16 instructions (AVX512)
    and far less on AVX2, so their times only compare between machines of one kind."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            flags = next((ln.split(":", 1)[1].split() for ln in f if ln.startswith("flags")), [])
    except OSError:
        flags = []
    bf16 = [x for x in ("avx512_bf16", "amx_bf16") if x in flags] or ["no bf16 instructions"]
    return f"{torch.backends.cpu.get_cpu_capability()}, {', '.join(bf16)}, {os.cpu_count()} CPUs"


def summarise(res: dict[str, dict], a: argparse.Namespace) -> dict:
    """The JSON figures: peaks, times, errors vs naive, ratios."""
    naive = res.get("naive")
    out = {
        "device": a.device,
        "tokens": a.tokens,
        "vocab": a.vocab,
        "dtype": a.dtype,
        "hidden": a.hidden,
        "cpu": cpu_isa() if a.device == "cpu" else None,
        "memory_method": (
            "torch allocator bytes (profiler allocation events replayed: peak minus the "
            "level at the call), fresh subprocess per method"
            if a.device == "cpu"
            else "torch.cuda.max_memory_allocated minus memory_allocated before the call"
        ),
    }
    if "fused_linear" in res:
        from megagrpo.kernels.fused_linear import chunk_rows

        cfg, size = loss_cfg(), DTYPES[a.dtype].itemsize
        out["fused_linear_chunk_rows"] = chunk_rows(
            cfg.chunk_bytes, a.vocab, size, cfg.fused_chunk_rows
        )
    for m, r in res.items():
        out[f"peak_bytes_{m}"] = r["peak_bytes"]
        out[f"time_s_{m}"] = r["time_s"]
        out[f"worker_s_{m}"] = r["worker_s"]
        out[f"worker_cpu_s_{m}"] = r["worker_cpu_s"]
        out[f"phases_{m}"] = {k: {"wall_s": w, "cpu_s": c} for k, (w, c) in r["phases"].items()}
    if naive is None:
        return out
    for m, r in res.items():
        if m == "naive":
            continue
        out[f"max_abs_err_loss_{m}"] = abs(r["loss"] - naive["loss"])
        if "grad_rows" in r:
            out[f"max_abs_err_grad_{m}"] = float((r["grad_rows"] - naive["grad_rows"]).abs().max())
        if "grad_hidden_rows" in r:
            diff = r["grad_hidden_rows"] - naive["grad_hidden_rows"]
            out[f"max_abs_err_grad_hidden_{m}"] = float(diff.abs().max())
        out[f"mem_ratio_naive_over_{m}"] = naive["peak_bytes"] / max(r["peak_bytes"], 1)
    out["max_abs_err_logp"] = float((naive["logp_fused"] - naive["logp"]).abs().max())
    if "fused" in res:
        out["max_abs_err_grad"] = out["max_abs_err_grad_fused"]
    if a.device == "cuda" and "fused" in res:  # fwd reads T*V, bwd reads + writes T*V
        moved = 3 * a.tokens * a.vocab * torch.tensor([], dtype=DTYPES[a.dtype]).element_size()
        out["fused_bandwidth_frac_of_h200_peak"] = (
            moved / res["fused"]["time_s"] / H200_PEAK_BYTES_PER_S
        )
    return out


def print_table(s: dict, res: dict) -> None:
    print(
        f"GRPO loss bench: T={s['tokens']} V={s['vocab']} dtype={s['dtype']} device={s['device']}"
    )
    print(f"memory: {s['memory_method']}")
    if s.get("cpu"):
        print(f"cpu: {s['cpu']} (the bf16 GEMMs of fused_linear / liger depend on it)")
    print(
        f"{'method':<15}{'peak extra MiB':>16}{'time s':>10}{'naive/x mem':>13}"
        f"{'err loss':>11}{'err grad':>11}{'worker s':>10}{'CPU s':>8}"
    )
    for m in res:
        ratio = s.get(f"mem_ratio_naive_over_{m}", 1.0)
        err_l = s.get(f"max_abs_err_loss_{m}", 0.0)
        err_g = s.get(f"max_abs_err_grad_{m}", s.get(f"max_abs_err_grad_hidden_{m}", 0.0))
        print(
            f"{m:<15}{s[f'peak_bytes_{m}'] / 2**20:>16.1f}{s[f'time_s_{m}']:>10.3f}"
            f"{ratio:>13.1f}{err_l:>11.2e}{err_g:>11.2e}"
            f"{s[f'worker_s_{m}']:>10.1f}{s[f'worker_cpu_s_{m}']:>8.1f}"
        )
    print(
        "time s: one forward + backward; worker s: the method's whole fresh process (imports, "
        "inputs, the timed call, the memory count under the profiler); CPU s: its CPU seconds "
        "(all threads), which other jobs on the machine do not inflate"
    )
    if "total_s" in s:
        print(
            f"total: {s['total_s']:.0f} s wall, {s['total_cpu_s']:.0f} s CPU "
            f"(load average {s['load_average_1min']:.1f} at the end)"
        )
    if "max_abs_err_logp" in s:
        print(f"max |logp fused - logp naive| = {s['max_abs_err_logp']:.2e}")
    if "fused_bandwidth_frac_of_h200_peak" in s:
        print(
            f"fused achieved bandwidth: {s['fused_bandwidth_frac_of_h200_peak']:.2%} of H200 peak"
        )
    if "fused_linear_chunk_rows" in s:
        print(
            f"fused_linear: chunks of {s['fused_linear_chunk_rows']} rows (loss.chunk_bytes, at "
            "least loss.fused_chunk_rows, as training runs it): its peak holds one chunk's logits"
        )
    if any(k.startswith("max_abs_err_grad_hidden_") for k in s):
        print("fused_linear/liger: grad error is on hidden states (naive grad_logits @ W as ref)")


def main(argv=None) -> int:
    a = parse_args(argv)
    if a.worker:
        worker(a)
        return 0
    if a.device == "cuda" and not torch.cuda.is_available():
        print("--device cuda: CUDA is not available", file=sys.stderr)
        return 2
    if a.tokens % a.seq_len and a.tokens > a.seq_len:
        print("--tokens must be a multiple of --seq-len", file=sys.stderr)
        return 2
    methods = [m for m in a.methods.split(",") if m]
    if "liger" in methods:
        try:
            import liger_kernel  # noqa: F401
        except ImportError:
            methods.remove("liger")
            print("liger-kernel is not installed: skipping the Liger peer", file=sys.stderr)
    res = {}
    start, cpu0 = time.perf_counter(), _children_cpu() + time.process_time()
    with tempfile.TemporaryDirectory() as tmp:
        save_inputs(a, Path(tmp) / "inputs.pt")
        for i, m in enumerate(methods):
            # progress on stderr (stdout stays the table or the JSON): each method is a fresh
            # process that builds the [T, V] logits and runs twice (timed, then counted)
            print(f"[{i + 1}/{len(methods)}] {m} ...", file=sys.stderr, flush=True)
            t0 = time.perf_counter()
            r = spawn(m, a, Path(tmp))
            line = progress(r, m, time.perf_counter() - t0)
            so_far = time.perf_counter() - start
            print(f"[{i + 1}/{len(methods)}] {line} ({so_far:.0f} s so far)", file=sys.stderr)
            if r is not None:
                res[m] = r
    s = summarise(res, a)
    s["total_s"] = time.perf_counter() - start
    s["total_cpu_s"] = _children_cpu() + time.process_time() - cpu0
    s["load_average_1min"] = os.getloadavg()[0]
    if a.json:
        print(json.dumps(s, indent=1))
    else:
        print_table(s, res)
    return 0 if len(res) == len(methods) else 1


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
