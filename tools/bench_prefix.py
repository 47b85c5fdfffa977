"""Shared prefix against rows: train-step time, peak memory and tokens computed (issue 43).

    python tools/bench_prefix.py [--ratios 0.1,0.3,1,3,10] [--group-sizes 4,8,16]
        [--tokens 256] [--groups 2] [--reps 3] [--device cpu|cuda] [--dtype float32]
        [--plot bench_prefix.png] [--json] [--quick]

Both sides do the same work in one run: one training pass (forward, fused GRPO loss,
backward) of the same batch through the trainer's own code (``build_micro_batches`` with
``shared_prefix`` off / on, ``micro_batch_loss``) on a random dense Qwen3 (hidden 256, 4
layers, LoRA r 8 on every linear; ``--quick``: the tiny test model). Each point is a batch of
``--groups`` groups of G completions, every sample ``--tokens`` long, the prompt taking
``ratio / (1 + ratio)`` of it (ratio = prompt : completion tokens). The rows are micro-batches
of G samples (one group's worth), the shared rows segment rows of at most G x the longest
sample (the same memory bound), so both sides hold one group per micro-batch.

Measured per point: seconds of the pass (median of ``--reps`` after one warm-up): wall time,
and on CPU the process's CPU time, which the speedup uses there (on a shared machine the
wall time measures the neighbours; ``OMP_NUM_THREADS=1`` makes the CPU time the work's);
on CUDA the wall time with synchronisation. The peak bytes autograd keeps for backward in
one micro-batch (every tensor saved by the forward, counted once per storage: the
activations; an extra, untimed pass), on CUDA also ``torch.cuda.max_memory_allocated``, and
the tokens the model computed (row positions, padding included). Prints a table, the
crossover per G (the smallest ratio from which shared is faster) and writes a plot of the
speedups against the token ratio, which is what the saving would be if time followed tokens:
``G (P + C) / (P + G C)``.
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def _model(args) -> dict:
    """The benchmark's dense Qwen3 (``--hidden``, ``--layers``; heads of 64, GQA 2:1)."""
    heads = max(1, args.hidden // 64)
    return {
        "hidden_size": args.hidden,
        "intermediate_size": int(args.hidden * 2.6875),
        "num_hidden_layers": args.layers,
        "num_attention_heads": heads,
        "num_key_value_heads": max(1, heads // 2),
        "head_dim": 64,
    }


def _groups(vocab: int, n: int, g: int, prompt: int, completion: int, seed: int):
    import torch

    from megagrpo.types import Group, Problem

    gen = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        ids = torch.randint(0, vocab, (prompt,), generator=gen).tolist()
        toks = [torch.randint(0, vocab, (completion,), generator=gen).tolist() for _ in range(g)]
        out.append(
            Group(
                problem=Problem(id=f"b{i}", messages=[], answer=["a"]),
                completions=["x"] * g,
                token_ids=toks,
                logprobs=[],
                rewards=torch.randn(g, generator=gen).tolist(),
                prompt_ids=ids,
            )
        )
    return out


class _Saved:
    """Bytes of the tensors autograd saves for backward inside the block (once per storage)."""

    def __init__(self):
        self.seen: dict[tuple, int] = {}

    def __enter__(self):
        import torch

        def pack(t):
            if t.device.type != "meta":
                key = (t.untyped_storage().data_ptr(), t.device.type)
                self.seen[key] = max(self.seen.get(key, 0), t.untyped_storage().nbytes())
            return t

        self.ctx = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
        self.ctx.__enter__()
        return self

    def __exit__(self, *exc):
        self.ctx.__exit__(*exc)

    @property
    def bytes(self) -> int:
        return sum(self.seen.values())


def train_pass(policy, mbs, cfg, saved: _Saved | None = None) -> int:
    """One training pass (forward, fused loss, backward per micro-batch) as the trainer runs
    it; with ``saved``, returns the largest saved-activation bytes of one micro-batch."""
    import contextlib

    from megagrpo.trainer.batch import BatchTotals, microbatch_weight
    from megagrpo.trainer.loss_head import micro_batch_loss, model_output

    totals = BatchTotals(
        sum(mb.num_seqs for mb in mbs),
        sum(mb.num_nonempty for mb in mbs),
        sum(mb.num_tokens for mb in mbs),
    )
    agg = cfg.resolved_loss_agg()
    peak = 0
    with model_output(policy, cfg) as weight:
        for mb in mbs:
            if saved is not None:
                saved.seen.clear()
            with saved if saved is not None else contextlib.nullcontext():
                out = policy.forward_logits(
                    mb.input_ids, mb.position_ids, cu_seqlens=mb.cu_seqlens, segments=mb.segments
                )
                loss, _ = micro_batch_loss(
                    out, weight, mb, mb.rollout_logprobs, None, cfg, None, 1.0
                )
            peak = max(peak, saved.bytes if saved is not None else 0)
            (loss * microbatch_weight(mb, agg, totals)).backward()
    return peak


def measure(policy, pgs, groups, g: int, shared: bool, reps: int, cfg) -> dict:
    """Wall and CPU seconds of the pass (median of ``reps`` after a warm-up), the saved
    activations (an extra pass under the hook, untimed), the CUDA peak and the tokens."""
    import torch

    from megagrpo.algo.advantages import group_advantages
    from megagrpo.trainer.optimize import build_micro_batches

    adv = list(group_advantages(torch.tensor([x.rewards for x in groups])))
    mbs = build_micro_batches(groups, adv, g, 0, pgs.device, shared_prefix=shared)
    cuda = pgs.device.type == "cuda"
    wall, cpu, cuda_peak = [], [], 0
    for i in range(reps + 1):
        policy.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        t0, c0 = time.perf_counter(), time.process_time()
        train_pass(policy, mbs, cfg)
        if cuda:
            torch.cuda.synchronize()
            cuda_peak = torch.cuda.max_memory_allocated()
        if i:  # the first pass warms up
            wall.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
    policy.zero_grad(set_to_none=True)
    peak = train_pass(policy, mbs, cfg, _Saved())
    policy.zero_grad(set_to_none=True)
    return {
        "s": statistics.median(wall),
        "cpu_s": statistics.median(cpu),
        "saved_mb": peak / 2**20,
        "cuda_peak_mb": cuda_peak / 2**20 if cuda else None,
        "tokens": sum(int(mb.input_ids.numel()) for mb in mbs),
        "micro_batches": len(mbs),
    }


def crossover(rows: list[dict]) -> dict[int, str]:
    """Per G, the smallest ratio from which shared stays faster (or never / everywhere)."""
    out = {}
    for g in sorted({r["G"] for r in rows}):
        pts = sorted((r["ratio"], r["speedup"]) for r in rows if r["G"] == g)
        wins = [i for i, (_, s) in enumerate(pts) if all(x[1] >= 1.0 for x in pts[i:])]
        if not wins:
            out[g] = "never faster in this range"
        elif wins[0] == 0:
            out[g] = f"faster from the smallest ratio measured ({pts[0][0]:g})"
        else:
            out[g] = f"faster from P:C = {pts[wins[0]][0]:g} (slower at {pts[wins[0] - 1][0]:g})"
    return out


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from megagrpo import fileio

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for g in sorted({r["G"] for r in rows}):
        pts = sorted((r["ratio"], r["speedup"], r["token_ratio"]) for r in rows if r["G"] == g)
        xs = [p[0] for p in pts]
        line = ax.plot(xs, [p[1] for p in pts], marker="o", label=f"G={g} measured")[0]
        ax.plot(xs, [p[2] for p in pts], ls=":", color=line.get_color(), label=f"G={g} tokens")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xscale("log")
    ax.set_xlabel("prompt : completion tokens")
    ax.set_ylabel("rows time / shared time")
    ax.set_title("shared prefix: train-pass speedup")
    ax.legend(fontsize=7)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=120)
    fileio.write_bytes(path, buf.getvalue())
    plt.close(fig)


def _args(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--ratios", default="0.1,0.3,1,3,10", help="prompt:completion ratios")
    ap.add_argument("--group-sizes", default="4,8,16", help="G values")
    ap.add_argument(
        "--tokens", type=int, default=256, help="tokens per sample (prompt + completion)"
    )
    ap.add_argument("--groups", type=int, default=2, help="groups per batch")
    ap.add_argument("--reps", type=int, default=3, help="timed passes per point (median)")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument(
        "--route",
        default="thd",
        choices=["thd", "mask"],
        help="how segment rows attend (thd: the trainer's; mask: the dense segment mask)",
    )
    ap.add_argument("--hidden", type=int, default=256, help="model width (heads of 64)")
    ap.add_argument("--layers", type=int, default=4, help="model layers")
    ap.add_argument(
        "--plot", default=None, help="plot file (default bench_prefix.png; --quick: none)"
    )
    ap.add_argument("--json", action="store_true", help="print only JSON")
    ap.add_argument("--quick", action="store_true", help="tiny model, 3 ratios, G=4: does it run?")
    return ap.parse_args(argv)


def run(args) -> dict:
    import torch

    from megagrpo.algo.config import LossConfig
    from megagrpo.model.config import LoraConfig, ModelConfig
    from megagrpo.model.policy import build_policy
    from megagrpo.parallel import ParallelConfig, destroy_parallel, init_parallel
    from megagrpo.testing import build_tiny_model

    if args.quick:
        args.ratios, args.group_sizes, args.tokens, args.reps = "0.1,1,10", "4", 48, 1
    ratios = [float(x) for x in args.ratios.split(",")]
    sizes = [int(x) for x in args.group_sizes.split(",")]
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory(prefix="bench_prefix-") as tmp:
        hf = build_tiny_model(Path(tmp) / "m", "dense", **({} if args.quick else _model(args)))
        pgs = init_parallel(ParallelConfig())
        try:
            lora = LoraConfig(rank=8, alpha=16.0)
            policy = build_policy(ModelConfig(hf_path=str(hf), lora=lora, dtype=args.dtype), pgs)
            policy.prefix_route = args.route
            rows = []
            for g in sizes:
                for r in ratios:
                    p = max(1, min(args.tokens - 1, round(args.tokens * r / (1 + r))))
                    c = args.tokens - p
                    groups = _groups(policy.arch.vocab_size, args.groups, g, p, c, seed=g)
                    cfg = LossConfig(variant="grpo")
                    key = "s" if args.device == "cuda" else "cpu_s"
                    a = measure(policy, pgs, groups, g, False, args.reps, cfg)
                    b = measure(policy, pgs, groups, g, True, args.reps, cfg)
                    rows.append(
                        {
                            "G": g,
                            "ratio": r,
                            "prompt": p,
                            "completion": c,
                            "rows": a,
                            "shared": b,
                            "speedup": a[key] / b[key],
                            "token_ratio": g * (p + c) / (p + g * c),
                        }
                    )
                    if not args.json:
                        _print_row(rows[-1])
        finally:
            destroy_parallel()
    return {
        "device": args.device,
        "dtype": args.dtype,
        "route": args.route,
        "points": rows,
        "crossover": crossover(rows),
    }


def _print_row(r: dict) -> None:
    a, b = r["rows"], r["shared"]
    print(
        f"G={r['G']:<3d} P:C={r['ratio']:<5g} ({r['prompt']}:{r['completion']})  tokens "
        f"{a['tokens']:>6d} -> {b['tokens']:>6d} (x{r['token_ratio']:.2f})  wall {a['s']:.3f} -> "
        f"{b['s']:.3f} s, CPU {a['cpu_s']:.3f} -> {b['cpu_s']:.3f} s (speedup "
        f"{r['speedup']:.2f})  saved activations "
        f"{a['saved_mb']:.1f} -> {b['saved_mb']:.1f} MB",
        flush=True,
    )


def main(argv=None) -> int:
    args = _args(argv)
    res = run(args)
    if args.json:
        print(json.dumps(res))
        return 0
    print("crossover (shared faster than rows):")
    for g, text in res["crossover"].items():
        print(f"  G={g}: {text}")
    path = args.plot if args.plot is not None else ("" if args.quick else "bench_prefix.png")
    if path:
        plot(res["points"], Path(path))
        print(f"plot: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
