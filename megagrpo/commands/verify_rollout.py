"""`megagrpo verify-rollout`: train/inference log-prob mismatch and a verified weight sync.

1. The engine generates a group of ``--n`` answers per prompt.
2. The trainer's model (transformers, in the checkpoint's dtype) re-scores the sampled
   tokens; the max and mean |engine - trainer| log-prob is the train/inference mismatch.
3. The weights are perturbed on the trainer side, streamed through the engine's sync path,
   and the engine's probe must equal the trainer's prediction (else the sync failed); a
   fresh group's log-probs are re-scored against the new weights.
"""

from __future__ import annotations

import argparse
import json
import logging
import tempfile
from pathlib import Path

from megagrpo.errors import ConfigError
from megagrpo.types import Problem

DESCRIPTION = __doc__
log = logging.getLogger(__name__)

PROMPTS = [
    [
        {"role": "system", "content": "あなたは日本の医師国家試験の問題に答える医学の専門家です。"},
        {
            "role": "user",
            "content": "高アンモニア血症をきたす疾患はどれか。\na 糖尿病\nb 肝硬変\n"
            "c 甲状腺機能低下症\nd 貧血\ne 肺炎",
        },
    ],
    [{"role": "user", "content": "Let me think step by step about each option before answering."}],
]
TINY = ("tiny-moe", "tiny-dense")
ENGINES = ("vllm", "hf")
"""``rollout.engine``'s values (tests/unit/test_first_hour4.py checks them against the
config; not read from it here: the rollout config imports torch, and --help stays fast)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--hf",
        required=True,
        help="HF checkpoint directory, smollm2-135m (bundled), or tiny-moe / "
        "tiny-dense (a random tiny test model built on the fly)",
    )
    parser.add_argument("--engine", choices=ENGINES, default="vllm")
    parser.add_argument("--n", type=int, default=8, help="answers per prompt (G)")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--noise",
        type=float,
        default=0.01,
        help="weight perturbation, relative to each matrix's std",
    )
    parser.add_argument(
        "--tol",
        type=float,
        default=None,
        help="max allowed log-prob mismatch (default 1e-3 fp32, 5e-2 else)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def _model_dir(spec: str, tmp: Path) -> Path:
    if spec in TINY:
        from megagrpo.testing import build_tiny_model

        return build_tiny_model(tmp / spec, spec.removeprefix("tiny-"))
    path = Path(spec)
    if (path / "config.json").is_file():
        return path
    try:  # bundled names (smollm2-135m), converted once by megagrpo.model
        from megagrpo.model.pretrained import resolve_model_path

        return resolve_model_path(spec)
    except (ImportError, ConfigError) as exc:
        raise ConfigError(
            f"--hf {spec}: no config.json there (an HF checkpoint directory, "
            f"a bundled name like smollm2-135m, or one of {TINY}): {exc}"
        ) from exc


def _mismatch(groups, trainer) -> tuple[float, float, int]:
    """Max / mean |engine - trainer| over all sampled tokens, and the token count."""
    import torch

    from megagrpo.rollout.hf_engine import sequence_logprobs

    diffs = []
    for g in groups:
        for toks, lps in zip(g.token_ids, g.logprobs):
            ref = sequence_logprobs(trainer, g.prompt_ids + toks)[len(g.prompt_ids) - 1 :]
            diffs += [abs(a - b) for a, b in zip(lps, ref)]
    t = torch.tensor(diffs or [0.0], dtype=torch.float64)
    return float(t.max()), float(t.mean()), len(diffs)


def _perturb(model, noise: float, seed: int) -> None:
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.add_(noise * p.float().std() * torch.randn(p.shape, generator=g).to(p.dtype))


def verify(model_dir: Path, args: argparse.Namespace) -> dict:
    """Run the checks; returns the report dict (raises EngineError on engine failures)."""
    import torch
    from transformers import AutoModelForCausalLM

    from megagrpo.rollout import build_engine
    from megagrpo.rollout.base import WeightSyncError
    from megagrpo.rollout.config import RolloutConfig
    from megagrpo.rollout.hf_engine import sequence_logprobs

    trainer = AutoModelForCausalLM.from_pretrained(model_dir, dtype="auto").eval()
    fp32 = next(trainer.parameters()).dtype == torch.float32
    tol = args.tol if args.tol is not None else (1e-3 if fp32 else 5e-2)
    cfg = RolloutConfig(
        engine=args.engine,
        max_tokens=args.max_tokens,
        max_model_len=args.max_model_len,
        seed=args.seed,
        verify_tol=args.tol,  # None: the engine dtype's bound (megagrpo.rollout.verify)
    )
    cfg.validate("rollout")
    problems = [Problem(f"verify-{i}", m, []) for i, m in enumerate(PROMPTS)]
    engine = build_engine(cfg, str(model_dir), seed=args.seed)
    try:
        groups = engine.generate(problems, n=args.n)
        max_diff, mean_diff, num_tokens = _mismatch(groups, trainer)
        before = sequence_logprobs(trainer, engine.probe_token_ids)
        _perturb(trainer, args.noise, args.seed + 1)
        expected = sequence_logprobs(trainer, engine.probe_token_ids)
        effective, error = True, ""
        try:
            report = engine.update_weights(
                iter(trainer.state_dict().items()), expected_probe=expected, expected_before=before
            )
            sync = dict(
                seconds=report.seconds,
                bytes=report.bytes,
                probe=report.max_probe_diff,
                change_error=report.change_error,
            )
        except WeightSyncError as exc:
            effective, error = False, str(exc)
            sync = dict(seconds=None, bytes=None, probe=None, change_error=None)
        after = _mismatch(engine.generate(problems, n=args.n), trainer) if effective else None
    finally:
        engine.close()
    return {
        "engine": args.engine,
        "model": str(args.hf),
        "dtype": str(next(trainer.parameters()).dtype).removeprefix("torch."),
        "num_samples": sum(g.size for g in groups),
        "num_tokens": num_tokens,
        "distinct_samples": sum(len({tuple(t) for t in g.token_ids}) for g in groups),
        "logprob_max_abs_diff": max_diff,
        "logprob_mean_abs_diff": mean_diff,
        "tolerance": tol,
        "weight_update_effective": effective,
        "sync_seconds": sync["seconds"],
        "sync_bytes": sync["bytes"],
        "sync_probe_max_abs_diff": sync["probe"],
        "sync_change_error": sync["change_error"],
        "post_sync_logprob_max_abs_diff": after[0] if after else None,
        "error": error,
    }


def run(args: argparse.Namespace) -> int:
    """Print the report; exit 1 when the mismatch exceeds --tol or the sync failed."""
    with tempfile.TemporaryDirectory(prefix="megagrpo-verify-") as tmp:
        model_dir = _model_dir(args.hf, Path(tmp))
        out = verify(model_dir, args)  # EngineError: printed by the CLI with config keys
    ok = (
        out["weight_update_effective"]
        and out["logprob_max_abs_diff"] <= out["tolerance"]
        and (out["post_sync_logprob_max_abs_diff"] or 0.0) <= out["tolerance"]
    )
    out["ok"] = bool(ok)
    if args.json:
        print(json.dumps(out))
    else:
        for key, value in out.items():
            print(f"{key:32s} {value}")
    return 0 if ok else 1
