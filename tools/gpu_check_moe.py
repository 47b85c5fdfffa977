"""LoRA gradients of one GRPO step on a tiny Qwen3-MoE: the device's bf16 path against a CPU
fp32 reference (``scripts/gpu_check.sh`` part ``train_moe``).

    python tools/gpu_check_moe.py grads --model DIR --device cuda --dtype bfloat16 --out a.pt
    python tools/gpu_check_moe.py grads --model DIR --device cpu --dtype float32 --out b.pt
    python tools/gpu_check_moe.py compare a.pt b.pt [--json]
    python tools/gpu_check_moe.py grads --spec te ... # Transformer Engine spec (CUDA + TE)
    python tools/gpu_check_moe.py --quick      # CPU smoke: a tiny MoE, bf16 vs fp32, on CPU

``grads`` builds megagrpo's Megatron policy (world 1; ``--spec`` local, the default, or te:
TE's fused layernorm linears and ``TEGroupedMLP`` experts; LoRA rank 8 on linear_qkv,
linear_proj and every expert's linear_fc1 / linear_fc2) from ``--model`` on ``--device`` in
``--dtype``, the LoRA as at step 1 (A seeded, B zero: only B has a gradient) and once more
with B seeded too (A's gradient then exists), and runs the trainer's own loss path on a
fixed batch of 6 completions: ``model_output`` + ``micro_batch_loss`` with the fused-linear
head (``loss.fused_linear``), GRPO, advantages +-1, old log-probs from the policy itself
(``policy_logprobs``). It saves ``gather_lora(use_grad=True)`` (HF names, fp32) and those
log-probs of the completion tokens. The CPU run is the reference the CPU test suite validates
against transformers; the device run adds the CUDA kernels (Triton fused head, cuBLAS bf16,
NCCL groups; with ``--spec te`` TE's kernels, never run anywhere before).

``compare`` prints per factor kind the relative error ``|g - g_ref| / |g_ref|`` (over all
tensors of the kind) and the cosine, and the mean and largest log-prob difference over the
completion tokens; exits 1 when an error exceeds :data:`REL_TOL` (bf16's 8-bit mantissa over
a 2-layer model: per-element noise ~1e-2, summed errors well under 0.1) or the mean
log-prob difference :data:`LOGPROB_TOL`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

REL_TOL = 0.1
"""Largest relative gradient error of a bf16 device run against the fp32 CPU reference."""
MIN_COS = 0.99
LOGPROB_TOL = 0.05
"""Largest mean |log p - log p_ref| (nats) over the completion tokens, bf16 against fp32. The
CPU quick run of this tool measures 0.013 (its max, 0.18, is one token whose top-2 experts
flip between bf16 and fp32 routing: the max is reported, not judged); an attention, RoPE or
LoRA error moves the mean by O(0.1-1)."""
TARGETS = ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]


def _batch(vocab: int):
    from megagrpo.trainer.batch import Sample

    g = torch.Generator().manual_seed(7)
    out = []
    for i in range(6):
        p, c = 5 + i % 3, 6 + (2 * i) % 5
        ids = torch.randint(0, vocab, (p + c,), generator=g).tolist()
        out.append(Sample(ids, p, 1.0 if i % 2 else -1.0, [], i))
    return out


def _step_grads(policy, mbs, cfg, logprobs: list) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    from megagrpo.model.peft_export import gather_lora
    from megagrpo.trainer.loss_head import micro_batch_loss, model_output
    from megagrpo.trainer.optimize import policy_logprobs

    old = policy_logprobs(policy, mbs, cfg, None)
    logprobs.append(torch.cat([lp[mb.mask.bool()].float().cpu() for lp, mb in zip(old, mbs)]))
    for p in policy.lora_parameters():
        p.grad = None
    with model_output(policy, cfg) as weight:

        def loss_fn(output, i):
            loss, m = micro_batch_loss(output, weight, mbs[i], old[i], None, cfg, None, 1.0)
            return loss, {k: float(v) for k, v in m.items()}

        policy.forward_backward(mbs, loss_fn)
    policy.finish_grad_sync()
    return gather_lora(policy, use_grad=True)


def grads(model: str, device: str, dtype: str, out: str, spec: str = "local") -> None:
    from megagrpo.algo.config import LossConfig
    from megagrpo.model.config import LoraConfig, ModelConfig
    from megagrpo.model.policy import build_policy
    from megagrpo.parallel import ParallelConfig, destroy_parallel, init_parallel
    from megagrpo.trainer.batch import micro_batches

    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("gpu_check_moe: --device cuda without CUDA")
    groups = init_parallel(ParallelConfig())
    try:
        assert groups.device.type == device, (groups.device, device)
        lora = LoraConfig(rank=8, alpha=16.0, targets=list(TARGETS))
        policy = build_policy(ModelConfig(hf_path=model, lora=lora, dtype=dtype, spec=spec), groups)
        assert policy.spec == spec, (policy.spec, spec)
        gen = torch.Generator().manual_seed(1)
        with torch.no_grad():  # A seeded alike on both devices; B zero as at step 1
            for name in sorted(policy.adapters):
                a = policy.adapters[name].lora_A
                a.copy_((torch.randn(a.shape, generator=gen) * 0.1).to(a.dtype))
        cfg = LossConfig(variant="grpo", fused_linear=True)
        mbs = [mb.to(groups.device) for mb in micro_batches(_batch(policy.arch.vocab_size), 3, 0)]
        logprobs: list[torch.Tensor] = []
        result = {"step1": _step_grads(policy, mbs, cfg, logprobs), "device": str(groups.device)}
        with torch.no_grad():
            for name in sorted(policy.adapters):
                b = policy.adapters[name].lora_B
                b.copy_((torch.randn(b.shape, generator=gen) * 0.05).to(b.dtype))
        result["trained"] = _step_grads(policy, mbs, cfg, logprobs)
        result.update(dtype=dtype, spec=spec, logprobs=logprobs)
        save_result(result, out)
    finally:
        destroy_parallel()


def _kind(name: str) -> str:
    if ".experts." in name:
        return "experts"
    return "attention" if ".self_attn." in name else "dense_mlp"


def compare(device_file: str, reference_file: str) -> dict:
    got, ref = torch.load(device_file), torch.load(reference_file)
    out: dict = {"device": got["device"], "dtype": got["dtype"], "reference": ref["device"]}
    out.update(spec=got.get("spec", "local"), reference_spec=ref.get("spec", "local"))
    worst = 0.0
    for when in ("step1", "trained"):
        acc: dict[str, list[float]] = {}
        for name, (ga, gb) in got[when].items():
            ra, rb = ref[when][name]
            for factor, g, r in (("A", ga, ra), ("B", gb, rb)):
                key = f"{_kind(name)}.{factor}"
                s = acc.setdefault(key, [0.0, 0.0, 0.0, 0.0])
                g, r = g.double().flatten(), r.double().flatten()
                s[0] += float((g - r).pow(2).sum())
                s[1] += float(r.pow(2).sum())
                s[2] += float((g * r).sum())
                s[3] += float(g.pow(2).sum())
        rows = {}
        for key, (err, norm, dot, gnorm) in sorted(acc.items()):
            if norm == 0.0:  # no gradient on either side (A at step 1)
                rows[key] = {"ref_norm": 0.0, "norm": gnorm**0.5}
                continue
            rel = (err / norm) ** 0.5
            cos = dot / max((norm * gnorm) ** 0.5, 1e-300)
            rows[key] = {"rel_err": round(rel, 5), "cos": round(cos, 6)}
            worst = max(worst, rel, (1 - cos) * REL_TOL / (1 - MIN_COS))
        out[when] = rows
    out["worst_rel_err"] = round(worst, 5)
    lp_ok = True
    if "logprobs" in got and "logprobs" in ref:  # base (step 1), then with B != 0
        diffs = [(g - r).abs() for g, r in zip(got["logprobs"], ref["logprobs"])]
        out["logprob_mean_abs_diff"] = [round(float(d.mean()), 5) for d in diffs]
        out["logprob_max_abs_diff"] = [round(float(d.max()), 5) for d in diffs]
        lp_ok = max(out["logprob_mean_abs_diff"]) <= LOGPROB_TOL
    # at step 1 B is zero: A has no gradient, on the device as in the reference
    no_grad = [r for r in out["step1"].values() if "norm" in r]
    out["ok"] = worst <= REL_TOL and lp_ok and all(r["norm"] == 0.0 for r in no_grad)
    return out


def _quick() -> int:
    """Both sides on CPU: the tool's whole path (build, gradients, compare) in seconds."""
    import tempfile

    from megagrpo.testing import build_tiny_model

    with tempfile.TemporaryDirectory(prefix="gpu_check_moe-") as tmp:
        model = str(Path(tmp) / "tiny_moe")
        build_tiny_model(model, "moe")
        a, b = str(Path(tmp) / "bf16.pt"), str(Path(tmp) / "fp32.pt")
        grads(model, "cpu", "bfloat16", a)
        grads(model, "cpu", "float32", b)
        res = compare(a, b)
    print(f"gpu_check_moe --quick: CPU bf16 against CPU fp32, ok {res['ok']}")
    print(json.dumps(res))
    return 0 if res["ok"] else 1


def save_result(obj: object, path: str | Path) -> None:
    """``torch.save`` of a worker's result into the file its parent named (via fileio)."""
    import io

    from megagrpo import fileio

    buf = io.BytesIO()
    torch.save(obj, buf)
    fileio.write_bytes(path, buf.getvalue())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="CPU smoke run: build a tiny Qwen3-MoE in a temporary directory, gradients in "
        "bf16 and fp32 on CPU, compare (what CI runs so the tool cannot rot)",
    )
    sub = parser.add_subparsers(dest="cmd")
    g = sub.add_parser("grads", help="LoRA gradients of one step on --device in --dtype")
    g.add_argument("--model", required=True)
    g.add_argument("--device", choices=("cuda", "cpu"), required=True)
    g.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    g.add_argument("--out", required=True)
    g.add_argument(
        "--spec",
        default="local",
        choices=("local", "te"),
        help="Megatron layer spec: local, or te (Transformer Engine: needs CUDA + TE)",
    )
    c = sub.add_parser("compare", help="device gradients against the reference")
    c.add_argument("device_file")
    c.add_argument("reference_file")
    c.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    if args.quick:
        return _quick()
    if args.cmd is None:
        parser.error("a command is required: grads or compare (or --quick)")
    if args.cmd == "grads":
        grads(args.model, args.device, args.dtype, args.out, args.spec)
        print(f"gpu_check_moe: gradients -> {args.out}")
        return 0
    res = compare(args.device_file, args.reference_file)
    print(json.dumps(res) if args.json else json.dumps(res, indent=1))
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    sys.exit(main())
