"""First-round oversampling (``dynamic.oversample``) on the CPU demo: generation rounds per step
and step time, off against auto, side by side in one run.

    python tools/bench_oversample.py [--steps 8] [--arms off,auto] [--json] [--quick]

Each arm is ``megagrpo train configs/demo_cpu.yaml`` in a fresh process (as a user runs it) with
``dynamic.oversample`` set, the same seed, evaluation off, for ``--steps`` steps; the means leave
out step 1 (engine warm-up). Printed per arm: generation rounds per step
(``dynamic/gen_batches``), problems generated (``dynamic/generated_groups``) and drawn in the
first round, groups trained and carried, raw ACR, reward, ``perf/step_s`` / ``gen_s`` /
``train_s``; and, for the bias check, the mean completion length of the trained groups against
that of every completion generated (``length/mean`` vs ``perf/gen_tokens / gen_seqs``): a
selection that favoured short (fast) groups would train shorter completions than it generated.

``--quick``: a random tiny dense Qwen3 (``megagrpo.testing``) in place of SmolLM2, one step of 4
problems: checks that both arms run, measures nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
KEYS = (
    "dynamic/gen_batches",
    "dynamic/generated_groups",
    "dynamic/first_round_groups",
    "dynamic/trained_groups",
    "dynamic/valid_groups_carried",
    "dynamic/carry_dropped_stale",
    "collapse/acr_raw",
    "reward/mean",
    "perf/step_s",
    "perf/gen_s",
    "perf/train_s",
    "perf/sync_s",
)


def run_arm(setting: str, steps: int, out: Path, model: str | None, seed: int) -> dict:
    """One ``megagrpo train`` of the demo with ``dynamic.oversample=setting``; the means of
    :data:`KEYS` over steps 2..N and the length check."""
    overrides = [
        f"dynamic.oversample={setting}",
        f"trainer.max_steps={steps}",
        f"trainer.output_dir={out}",
        f"trainer.name=oversample_{setting}",
        f"trainer.seed={seed}",
        "trainer.eval_every=0",
        "trainer.eval_at_start=false",
        "trainer.save_every=0",
        "trainer.export_adapter=false",
        "metrics.wandb_mode=disabled",
        "metrics.progress_bar=false",
        "metrics.log_completions=false",
    ]
    if model:  # --quick: a tiny random model, a small step
        overrides += [f"model.hf_path={model}", "rollout.max_tokens=8", "trainer.batch_groups=4"]
        overrides += ["trainer.micro_batch_size=16"]
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_ENABLE_V1_MULTIPROCESSING="0")
    env.setdefault("TRITON_INTERPRET", "1")
    cmd = [sys.executable, "-m", "megagrpo.cli", "train", "configs/demo_cpu.yaml", *overrides]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=7200)
    if proc.returncode != 0:
        return {"error": (proc.stderr or proc.stdout)[-2000:]}
    rows = [json.loads(x) for x in (out / f"oversample_{setting}" / "metrics.jsonl").open()]
    rows = [r for r in rows if int(r.get("step", 0)) >= 1]
    timed = rows[1:] or rows
    res = {k: statistics.mean(float(r.get(k) or 0.0) for r in timed) for k in KEYS}
    gen_len = sum(float(r["perf/gen_tokens"]) for r in timed) / max(
        1.0, sum(float(r["perf/gen_seqs"]) for r in timed)
    )
    lens = [float(r["length/mean"]) for r in timed if r.get("length/mean") is not None]
    res["trained_completion_len"] = statistics.mean(lens) if lens else float("nan")
    res["generated_completion_len"] = gen_len
    res["steps"] = len(rows)
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--steps", type=int, default=None, help="steps per arm (default 8; quick 2)")
    ap.add_argument("--arms", default="off,auto", help="dynamic.oversample settings to compare")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="tiny random model, one small step")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    steps = args.steps or (1 if args.quick else 8)
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    with tempfile.TemporaryDirectory(prefix="bench_oversample_") as tmp:
        model = None
        if args.quick:
            sys.path.insert(0, str(REPO))
            from megagrpo.testing import build_tiny_model

            model = str(build_tiny_model(Path(tmp) / "tiny-dense", "dense"))
        res = {a: run_arm(a, steps, Path(tmp), model, args.seed) for a in arms}
    if args.json:
        print(json.dumps(res))
        return 1 if any("error" in r for r in res.values()) else 0
    print(f"CPU demo, {steps} steps per arm (means over steps 2..N; a loaded machine varies)")
    print(f"{'dynamic.oversample':<34}" + "".join(f"{a:>12}" for a in arms))
    for k in (*KEYS, "trained_completion_len", "generated_completion_len"):
        vals = [res[a].get(k) for a in arms]
        print(
            f"{k:<34}"
            + "".join(f"{v:>12.3f}" if isinstance(v, float) else f"{'-':>12}" for v in vals)
        )
    bad = [a for a in arms if "error" in res[a]]
    for a in bad:
        print(f"arm {a} failed:\n{res[a]['error']}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
