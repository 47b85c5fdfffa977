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
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
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
    a = p.parse_args(argv)
    if a.quick:
        a.tokens, a.vocab, a.seq_len, a.methods = 64, 2048, 16, "naive,fused,fused_linear"
    return a


# ----------------------------------------------------------------------------- inputs


def make_inputs(a: argparse.Namespace) -> dict:
    """Deterministic inputs built chunk by chunk (no transient above the steady state)."""
    from megagrpo.kernels import token_stats

    T, V, H, dev = a.tokens, a.vocab, a.hidden, a.device
    dtype = DTYPES[a.dtype]
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(T, H, generator=g).to(dev, dtype)
    weight = (torch.randn(V, H, generator=g) * (3.0 / H**0.5)).to(dev, dtype)
    logits = torch.empty(T, V, device=dev, dtype=dtype)
    step = max(1, (64 << 20) // (4 * V))
    for r0 in range(0, T, step):
        logits[r0 : r0 + step] = (hidden[r0 : r0 + step].float() @ weight.float().T).to(dtype)
    tgt = torch.randint(0, V, (T,), generator=g).to(dev)
    with torch.no_grad():
        logp, *_ = token_stats(logits, tgt)
    old = (logp + 0.2 * torch.randn(T, generator=g).to(dev)).float()
    num_seqs = max(1, T // a.seq_len)
    adv_seq = torch.randn(num_seqs, generator=g).to(dev)
    adv = adv_seq.repeat_interleave(T // num_seqs)
    mask = (torch.rand(T, generator=g) > 0.1).float().to(dev)
    rows = torch.randperm(T, generator=g)[:32].sort().values.to(dev)
    return dict(
        hidden=hidden,
        weight=weight,
        logits=logits,
        tgt=tgt,
        old=old,
        adv=adv,
        adv_seq=adv_seq,
        mask=mask,
        logp=logp,
        rows=rows,
        num_seqs=num_seqs,
    )


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


def measure(method: str, d: dict, a: argparse.Namespace) -> tuple[dict, int, float]:
    """(outputs, peak extra bytes, seconds) of one forward + backward of ``method``."""
    fn = RUNNERS[method]
    if a.device == "cuda":
        pristine = d["logits"].clone()  # "fused" overwrites the logits with their gradient

        def restore():
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
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        out = fn(d)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        return keep(out, d), peak, sorted(times)[len(times) // 2]
    from megagrpo.profiling import allocator_peak_bytes

    saved = d["logits"].clone()  # "fused" overwrites the logits with their gradient
    t0 = time.perf_counter()
    out = keep(fn(d), d)
    seconds = time.perf_counter() - t0
    d["logits"].copy_(saved)
    del saved
    _, peak = allocator_peak_bytes(fn, d)
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
    if a.threads:
        torch.set_num_threads(a.threads)
    small = argparse.Namespace(**{**vars(a), "tokens": 8, "vocab": 64, "seq_len": 4})
    RUNNERS[a.worker](make_inputs(small))  # load code paths outside the measured region
    d = make_inputs(a)
    logits_in = d["logits"]
    out, peak, seconds = measure(a.worker, d, a)
    res = {
        "method": a.worker,
        "peak_bytes": int(peak),
        "time_s": seconds,
        "loss": float(out["loss"]),
        "logp_fused": d["logp"].cpu(),
    }
    if "grad_rows" in out:
        res["grad_rows"] = out["grad_rows"]
        res["grad_hidden_rows"] = out["grad_rows"] @ d["weight"].float().cpu()
    for key in ("grad_hidden_rows", "logp"):
        if key in out:
            res[key] = out[key]
    res["input_bytes"] = logits_in.numel() * logits_in.element_size()
    save_result(res, a.out)


def save_result(obj: object, path: str | Path) -> None:
    """``torch.save`` of a worker's result into the file its parent named (via fileio)."""
    import io

    from megagrpo import fileio

    buf = io.BytesIO()
    torch.save(obj, buf)
    fileio.write_bytes(path, buf.getvalue())


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
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        print(f"[{method}] failed:\n{proc.stderr[-3000:]}", file=sys.stderr)
        return None
    return torch.load(out, weights_only=True)  # tensors and plain types only


# ----------------------------------------------------------------------------- report


def summarise(res: dict[str, dict], a: argparse.Namespace) -> dict:
    """The JSON figures: peaks, times, errors vs naive, ratios."""
    naive = res.get("naive")
    out = {
        "device": a.device,
        "tokens": a.tokens,
        "vocab": a.vocab,
        "dtype": a.dtype,
        "hidden": a.hidden,
        "memory_method": (
            "torch allocator bytes (profiler allocation events replayed: peak minus the "
            "level at the call), fresh subprocess per method"
            if a.device == "cpu"
            else "torch.cuda.max_memory_allocated minus memory_allocated before the call"
        ),
    }
    for m, r in res.items():
        out[f"peak_bytes_{m}"] = r["peak_bytes"]
        out[f"time_s_{m}"] = r["time_s"]
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
    print(
        f"{'method':<15}{'peak extra MiB':>16}{'time s':>10}{'naive/x mem':>13}"
        f"{'err loss':>11}{'err grad':>11}"
    )
    for m in res:
        ratio = s.get(f"mem_ratio_naive_over_{m}", 1.0)
        err_l = s.get(f"max_abs_err_loss_{m}", 0.0)
        err_g = s.get(f"max_abs_err_grad_{m}", s.get(f"max_abs_err_grad_hidden_{m}", 0.0))
        print(
            f"{m:<15}{s[f'peak_bytes_{m}'] / 2**20:>16.1f}{s[f'time_s_{m}']:>10.3f}"
            f"{ratio:>13.1f}{err_l:>11.2e}{err_g:>11.2e}"
        )
    if "max_abs_err_logp" in s:
        print(f"max |logp fused - logp naive| = {s['max_abs_err_logp']:.2e}")
    if "fused_bandwidth_frac_of_h200_peak" in s:
        print(
            f"fused achieved bandwidth: {s['fused_bandwidth_frac_of_h200_peak']:.2%} of H200 peak"
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
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        for i, m in enumerate(methods):
            # progress on stderr (stdout stays the table or the JSON): each method is a fresh
            # process that builds the [T, V] logits and runs twice (timed, then counted)
            print(f"[{i + 1}/{len(methods)}] {m} ...", file=sys.stderr, flush=True)
            t0 = time.perf_counter()
            r = spawn(m, a, Path(tmp))
            took = time.perf_counter() - t0
            done = "failed" if r is None else f"peak {r['peak_bytes'] / 2**20:.0f} MiB"
            print(
                f"[{i + 1}/{len(methods)}] {m}: {done}, {took:.0f} s "
                f"({time.perf_counter() - start:.0f} s so far)",
                file=sys.stderr,
                flush=True,
            )
            if r is not None:
                res[m] = r
    s = summarise(res, a)
    if a.json:
        print(json.dumps(s, indent=1))
    else:
        print_table(s, res)
    return 0 if len(res) == len(methods) else 1


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
