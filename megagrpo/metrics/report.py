"""PNG plots of a run's metrics.jsonl (`megagrpo report RUN_DIR`).

:func:`make_report` draws (into RUN_DIR/report/ unless ``out``):

- ``collapse.png``: raw ACR (first generation of each step, pre-filter) against the
  post-filter ``frac_reward_zero_std`` of the trained batch, with the line ACR = 1 - 1/R
  above which dynamic sampling with R checked rounds cannot fill a batch, and the predicted
  ACR when levels were given. The article's Figure 1 showed only the post-filter curve
  (0 = "dynamic sampling succeeded"); the raw curve is what it could not show.
- ``reward.png``: mean total reward and each reward function's mean (+ eval/accuracy).
- ``length.png``: mean completion length and the clip ratio.
- ``levels.png``: the curriculum's level histogram L1..L6 over steps (drift of difficulty).
- ``time.png``: per-step time breakdown (generation, training, weight sync) and tokens/s.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from megagrpo.errors import DataError
from megagrpo.metrics.logger import read_metrics

log = logging.getLogger(__name__)


def _series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    pts = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
    return [p[0] for p in pts], [float(p[1]) for p in pts]


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path


def plot_collapse(rows: list[dict], out: Path, rounds: int | None) -> Path:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for key, label, style in (
        ("collapse/acr_raw", "raw ACR (pre-filter, first generation)", "-o"),
        ("collapse/frac_reward_zero_std", "frac_reward_zero_std (post-filter, trained)", "-s"),
        ("collapse/acr_predicted", "predicted ACR (levels)", ":"),
    ):
        x, y = _series(rows, key)
        if x:
            ax.plot(x, y, style, ms=3, label=label)
    if rounds:
        ax.axhline(
            1 - 1 / rounds,
            color="red",
            ls="--",
            label=f"1 - 1/R = {1 - 1 / rounds:.2f} (R = {rounds} checked rounds)",
        )
    ax.set_ylim(-0.03, 1.03)
    ax.set_xlabel("step")
    ax.set_ylabel("fraction of groups collapsed")
    ax.set_title("Advantage collapse: raw vs what dynamic sampling lets through")
    ax.legend(fontsize=8)
    return _save(fig, out / "collapse.png")


def plot_reward(rows: list[dict], out: Path) -> Path:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    keys = (
        ["reward/mean", "reward/mean_raw"]
        + sorted(
            {
                k
                for r in rows
                for k in r
                if k.startswith("reward/") and k.endswith("/mean") and k != "reward/mean"
            }
        )
        + ["eval/accuracy"]
    )
    for key in keys:
        x, y = _series(rows, key)
        if x:
            ax.plot(x, y, "-o" if key == "eval/accuracy" else "-", ms=3, label=key)
    ax.set_xlabel("step")
    ax.set_ylabel("reward")
    ax.legend(fontsize=8)
    ax.set_title("Reward")
    return _save(fig, out / "reward.png")


def plot_length(rows: list[dict], out: Path) -> Path:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    x, y = _series(rows, "length/mean")
    ax.plot(x, y, label="length/mean (tokens)")
    ax.set_xlabel("step")
    ax.set_ylabel("tokens")
    ax2 = ax.twinx()
    x, y = _series(rows, "length/clip_ratio")
    ax2.plot(x, y, color="tab:red", ls="--", label="length/clip_ratio")
    ax2.set_ylabel("clip ratio")
    ax2.set_ylim(-0.03, 1.03)
    fig.legend(fontsize=8, loc="upper right")
    ax.set_title("Completion length")
    return _save(fig, out / "length.png")


def plot_levels(rows: list[dict], out: Path) -> Path:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    levels = sorted(
        {k for r in rows for k in r if k.startswith("curriculum/level_hist/L")},
        key=lambda k: int(k.rsplit("L", 1)[1]),
    )
    steps = [r["step"] for r in rows]
    stacks = [[float(r.get(k) or 0.0) for r in rows] for k in levels]
    if steps and stacks:
        ax.stackplot(steps, stacks, labels=[k.rsplit("/", 1)[1] for k in levels])
    ax.set_xlabel("step")
    ax.set_ylabel("problems")
    ax.set_title("Online difficulty levels (L1 = always solved ... L6 = never)")
    ax.legend(fontsize=8, loc="upper left")
    return _save(fig, out / "levels.png")


def plot_time(rows: list[dict], out: Path) -> Path:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    steps = [r["step"] for r in rows]
    bottom = [0.0] * len(rows)
    for key, label in (
        ("perf/gen_s", "generation"),
        ("perf/train_s", "training"),
        ("perf/sync_s", "weight sync"),
    ):
        vals = [float(r.get(key) or 0.0) for r in rows]
        ax.bar(steps, vals, bottom=bottom, label=label)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_xlabel("step")
    ax.set_ylabel("seconds")
    ax2 = ax.twinx()
    x, y = _series(rows, "perf/tokens_per_s")
    ax2.plot(x, y, color="black", label="tokens/s")
    ax2.set_ylabel("generated tokens / s")
    fig.legend(fontsize=8, loc="upper right")
    ax.set_title("Step time breakdown")
    return _save(fig, out / "time.png")


def make_report(
    run_dir: str | os.PathLike,
    out: str | os.PathLike | None = None,
    checked_rounds: int | None = None,
) -> list[Path]:
    """Draw every plot; returns the PNG paths. ``checked_rounds``: generation rounds dynamic
    sampling checks (draws the ACR = 1 - 1/rounds line; None: no line). DataError when
    metrics.jsonl is missing or empty."""
    import matplotlib

    matplotlib.use("Agg")
    run_dir = Path(run_dir)
    metrics = run_dir / "metrics.jsonl"
    if not metrics.is_file():
        raise DataError(f"{metrics}: not found (is {run_dir} a run directory?)")
    rows = read_metrics(metrics)
    if not rows:
        raise DataError(f"{metrics}: no rows")
    out = Path(out) if out else run_dir / "report"
    out.mkdir(parents=True, exist_ok=True)
    rounds = checked_rounds
    paths = [
        plot_collapse(rows, out, rounds),
        plot_reward(rows, out),
        plot_length(rows, out),
        plot_levels(rows, out),
        plot_time(rows, out),
    ]
    summary = {
        "steps": len(rows),
        "plots": [p.name for p in paths],
        "last": {
            k: rows[-1].get(k)
            for k in ("reward/mean", "collapse/acr_raw", "collapse/frac_reward_zero_std")
        },
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1), encoding="utf-8")
    return paths
