"""Rollout benchmark: vLLM vs HF ``generate`` tokens/s, and weight-sync cost (full vs adapter).

Both engines get the same model, prompts, G and max tokens; each runs one warm-up call, then
``--repeats`` timed ``generate`` calls. Weight sync: a perturbed full state dict streamed
through ``update_weights`` (bucketed, verified against the trainer's probe log-probs) and a
random LoRA adapter through ``sync_lora`` (adapter-only on vLLM with LoRA support, i.e. dense
models on CPU; merged otherwise). Sleep/wake times are printed too (no-ops on CPU).

    python tools/bench_rollout.py --hf tiny-moe
    python tools/bench_rollout.py --hf smollm2-135m --max-tokens 64 --json
    python tools/bench_rollout.py --quick     # tiny-dense, 2 prompts x 2 answers of 8 tokens
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

log = logging.getLogger("bench_rollout")
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def model_dir(spec: str, tmp: Path) -> Path:
    if spec in ("tiny-moe", "tiny-dense"):
        from megagrpo.testing import build_tiny_model

        return build_tiny_model(tmp / spec, spec.removeprefix("tiny-"))
    from megagrpo.model.pretrained import resolve_model_path

    return resolve_model_path(spec)


def problems(num: int):
    from megagrpo.commands.verify_rollout import PROMPTS
    from megagrpo.types import Problem

    return [Problem(f"b{i}", PROMPTS[i % len(PROMPTS)] + [], []) for i in range(num)]


def random_adapter(model, rank: int, seed: int):
    """A LoRA adapter on every nn.Linear named in TARGETS (B non-zero so it changes outputs)."""
    from megagrpo.rollout import PeftAdapter

    g = torch.Generator().manual_seed(seed)
    adapter = PeftAdapter(rank=rank, alpha=2.0 * rank)
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear) and name.rsplit(".", 1)[-1] in TARGETS:
            out_f, in_f = mod.weight.shape
            adapter.a[name] = torch.randn(rank, in_f, generator=g) / in_f**0.5
            adapter.b[name] = 0.05 * torch.randn(out_f, rank, generator=g) / rank**0.5
    return adapter


def merged_reference(model, adapter):
    """The trainer's view of base + adapter: a copy of ``model`` with the deltas added."""
    import copy

    ref = copy.deepcopy(model)
    with torch.no_grad():
        mods = dict(ref.named_modules())
        for name in adapter.a:
            w = mods[name].weight
            w.add_(adapter.delta(name).to(w.dtype))
    return ref


def bench_engine(kind: str, path: Path, args, trainer) -> dict:
    from megagrpo.rollout import RolloutConfig, SamplingSpec, build_engine, sync_lora
    from megagrpo.rollout.hf_engine import sequence_logprobs

    dense = "moe" not in trainer.config.model_type
    lora = kind == "vllm" and (dense or torch.cuda.is_available())
    cfg = RolloutConfig(
        engine=kind,
        max_tokens=args.max_tokens,
        max_model_len=args.max_model_len,
        enable_lora=lora,
        max_lora_rank=max(8, args.lora_rank),
        verify_tol=args.tol,
        sync_bucket_mb=args.bucket_mb,
    )
    t0 = time.perf_counter()
    engine = build_engine(cfg, str(path), seed=0)
    row = {"engine": kind, "start_s": time.perf_counter() - t0}
    probs = problems(args.prompts)
    engine.generate(probs[:1], n=1, sampling=SamplingSpec(max_tokens=4))  # warm-up
    toks, secs = 0, 0.0
    for r in range(args.repeats):
        t0 = time.perf_counter()
        groups = engine.generate(probs, n=args.n, sampling=SamplingSpec(seed=100 + r))
        secs += time.perf_counter() - t0
        toks += sum(sum(g.lengths) for g in groups)
    row.update(gen_tokens=toks, gen_s=secs, tokens_per_s=toks / secs)
    # full sync: perturbed weights, verified against the trainer's probe
    new = {
        k: v + 0.01 * v.float().std() * torch.randn_like(v) if v.dim() >= 2 else v
        for k, v in trainer.state_dict().items()
    }
    ref = type(trainer)(trainer.config).eval()
    ref.load_state_dict(new)
    expected = sequence_logprobs(ref, engine.probe_token_ids)
    rep = engine.update_weights(iter(new.items()), expected_probe=expected)
    row.update(
        full_sync_s=rep.seconds,
        full_sync_bytes=rep.bytes,
        full_sync_buckets=rep.num_buckets,
        full_sync_probe_diff=rep.max_probe_diff,
    )
    # LoRA sync (adapter-only where supported, else merged); base = trainer's weights
    engine.update_weights(
        iter(trainer.state_dict().items()),
        expected_probe=sequence_logprobs(trainer, engine.probe_token_ids),
    )
    adapter = random_adapter(trainer, args.lora_rank, seed=1)
    expected = sequence_logprobs(merged_reference(trainer, adapter), engine.probe_token_ids)
    rep = sync_lora(engine, adapter, iter(trainer.state_dict().items()), expected)
    row.update(
        lora_sync_mode=rep.mode,
        lora_sync_s=rep.seconds,
        lora_sync_bytes=rep.bytes,
        lora_sync_probe_diff=rep.max_probe_diff,
    )
    t0 = time.perf_counter()
    engine.sleep()
    row["sleep_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    engine.wake_up()
    row["wake_s"] = time.perf_counter() - t0
    engine.close()
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--hf", default="tiny-moe", help="HF dir, smollm2-135m, tiny-moe, tiny-dense")
    p.add_argument("--engines", default="vllm,hf")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--lora-rank", type=int, default=8)
    p.add_argument("--bucket-mb", type=float, default=64.0)
    p.add_argument("--tol", type=float, default=1e-3)
    p.add_argument("--json", action="store_true")
    p.add_argument("--quick", action="store_true", help="tiny-dense, 2 x 2 answers of 8 tokens")
    args = p.parse_args(argv)
    if args.quick:
        args.hf, args.prompts, args.n, args.max_tokens, args.repeats = "tiny-dense", 2, 2, 8, 1
    logging.basicConfig(level=logging.WARNING)
    os.environ.setdefault("VLLM_CACHE_ROOT", str(Path(tempfile.gettempdir()) / "megagrpo-vllm"))
    from transformers import AutoModelForCausalLM

    with tempfile.TemporaryDirectory() as tmp:
        path = model_dir(args.hf, Path(tmp))
        trainer = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        rows = [bench_engine(kind, path, args, trainer) for kind in args.engines.split(",")]
    if args.json:
        print(json.dumps({"model": args.hf, "rows": rows}))
        return 0
    params = sum(p.numel() for p in trainer.parameters())
    print(
        f"model {args.hf} ({params / 1e6:.1f} M params, fp32), {args.prompts} prompts x "
        f"G={args.n}, max {args.max_tokens} tokens, {args.repeats} timed calls, "
        f"torch threads {torch.get_num_threads()}"
    )
    keys = [k for k in rows[0] if k != "engine"]
    print(f"{'':24s}" + "".join(f"{r['engine']:>16s}" for r in rows))
    for k in keys:
        cells = [r.get(k) for r in rows]
        fmt = [f"{c:16.4g}" if isinstance(c, float) else f"{c!s:>16s}" for c in cells]
        print(f"{k:24s}" + "".join(fmt))
    return 0


if __name__ == "__main__":
    sys.exit(main())
