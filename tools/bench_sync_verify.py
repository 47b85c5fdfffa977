"""Weight-sync verification on CPU: the bf16 noise the thresholds are set from, and what the
periodic full check costs.

    python tools/bench_sync_verify.py [--engine hf|vllm|both] [--model smollm2-135m|tiny-dense]
    python tools/bench_sync_verify.py --quick    # a random tiny dense model, 1 repeat

1. Noise: a bf16 engine against an fp32 trainer (transformers) on the 16-token probe, for
   rank-8 updates of every matrix of relative size s: the engine/trainer offset (max, mean)
   and the change statistic rms(observed - predicted) / rms(predicted) the change test uses.
2. Cost: one merged sync of the whole model, probe only vs probe + full check (per-tensor
   checksums on both sides), per engine, median of --repeat runs.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

import torch


def _update(base: dict[str, torch.Tensor], rel: float, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for k, v in base.items():
        if v.dim() == 2:
            d = torch.randn(v.shape[0], 8, generator=g) @ torch.randn(8, v.shape[1], generator=g)
            out[k] = v + d * (rel * v.std() / d.std())
        else:
            out[k] = v.clone()
    if "lm_head.weight" in out:
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    return out


def _rms(x: torch.Tensor) -> float:
    return float(x.pow(2).mean().sqrt())


def noise_table(model_dir) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megagrpo.rollout.base import default_probe_ids
    from megagrpo.rollout.hf_engine import sequence_logprobs

    ids = default_probe_ids(AutoTokenizer.from_pretrained(model_dir), 16)
    trainer = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    engine = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
    base = {k: v.clone() for k, v in trainer.state_dict().items()}

    def lp(m):
        return torch.tensor(sequence_logprobs(m, ids), dtype=torch.float64)

    t0, e0 = lp(trainer), lp(engine)
    print("bf16 engine vs fp32 trainer, 16-token probe (HF bf16 as the engine)")
    print(
        f"  base weights: offset max {(e0 - t0).abs().max():.3f} mean {(e0 - t0).abs().mean():.3f}"
    )
    print(
        f"  {'update s':>9} {'rms pred':>9} {'rms(obs-pred)':>14} {'change err':>11}"
        f" {'offset max':>11}"
    )
    for s in (1e-4, 1e-3, 1e-2, 3e-2, 8e-2):
        new = _update(base, s, seed=1)
        trainer.load_state_dict(new)
        engine.load_state_dict({k: v.bfloat16() for k, v in new.items()})
        t1, e1 = lp(trainer), lp(engine)
        pred, noise = _rms(t1 - t0), _rms((e1 - e0) - (t1 - t0))
        print(
            f"  {s:>9.0e} {pred:>9.3f} {noise:>14.3f} {noise / pred:>11.2f} "
            f"{float((e1 - t1).abs().max()):>11.3f}"
        )
    trainer.load_state_dict(base)


def cost_table(model_dir, engines: list[str], repeat: int) -> None:
    import tempfile

    from transformers import AutoModelForCausalLM

    from megagrpo.rollout import RolloutConfig, build_engine

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).state_dict()
    nparams = sum(v.numel() for k, v in base.items() if k != "lm_head.weight")
    print(f"\nmerged sync of {nparams / 1e6:.0f}M parameters, bf16 engine, median of {repeat}")
    print(
        f"  {'engine':>6} {'probe only s':>13} {'+ full check s':>15} {'checksums s':>12}"
        f" {'units':>6}"
    )
    for name in engines:
        with tempfile.TemporaryDirectory() as cache:
            cfg = RolloutConfig(
                engine=name, dtype="bfloat16", max_tokens=4, max_model_len=128, cache_dir=cache
            )
            eng = build_engine(cfg, str(model_dir))
            try:
                rows = {False: [], True: []}
                for i in range(repeat):
                    for full in (False, True):
                        new = _update(base, 0.05, seed=10 + 2 * i + int(full))
                        rep = eng.update_weights(iter(new.items()), full_check=full)
                        rows[full].append((rep.seconds, rep.full_check_s, rep.full_check_tensors))
                off = statistics.median(r[0] for r in rows[False])
                on = statistics.median(r[0] for r in rows[True])
                chk = statistics.median(r[1] for r in rows[True])
                print(f"  {name:>6} {off:>13.2f} {on:>15.2f} {chk:>12.3f} {rows[True][0][2]:>6}")
            finally:
                eng.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--engine", default="both", choices=["hf", "vllm", "both"])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--skip-noise", action="store_true")
    ap.add_argument("--quick", action="store_true", help="a random tiny dense model, 1 repeat")
    args = ap.parse_args()
    if args.quick:
        args.model, args.repeat = "tiny-dense", 1
    with tempfile.TemporaryDirectory(prefix="bench_sync_verify_") as tmp:
        model_dir = _model_dir(args.model, Path(tmp))
        if not args.skip_noise:
            noise_table(model_dir)
        engines = ["hf", "vllm"] if args.engine == "both" else [args.engine]
        cost_table(model_dir, engines, args.repeat)


def _model_dir(spec: str, tmp: Path) -> Path:
    """``tiny-dense``: a random tiny test model built in ``tmp``; else a bundled name or dir."""
    if spec == "tiny-dense":
        from megagrpo.testing import build_tiny_model

        return build_tiny_model(tmp / spec, "dense")
    from megagrpo.model.pretrained import resolve_model_path

    return resolve_model_path(spec)


if __name__ == "__main__":
    main()
