"""PNG plots of a run's metrics.jsonl (`megagrpo report RUN_DIR`).

:func:`make_report` draws (into RUN_DIR/report/ unless ``out``):

- ``collapse.png``: raw ACR (first generation of each step, pre-filter) against the
  post-filter ``frac_reward_zero_std`` of the trained batch, with the line ACR = 1 - 1/R
  above which dynamic sampling with R checked rounds cannot fill a batch, and the predicted
  ACR when levels were given. A lower panel shows what dynamic sampling achieved: the groups
  actually trained (``dynamic/trained_groups``: a short batch under ``carry``/``partial`` is
  visible here, where the post-filter curve reads 0 by construction) and the steps where it
  filled the batch (``dynamic/success``). The article's Figure 1 showed only the post-filter
  curve; the raw curve is what it could not show.
- ``reward.png``: mean total reward and each reward function's mean (+ eval/accuracy with
  its 95% interval, step 0 included when the run evaluated before training, against the
  best constant answer and chance on the same questions), the means of the raw reward over the
  first and the last fifth of the steps (:func:`learning_summary`), and the reward
  errors/timeouts per step (a broken reward plugin shows here).
- ``calibration.png`` (runs with a levels file): the planner's predicted raw ACR per profile
  level (``collapse/acr_predicted_by_level/L*``, the sampler's posterior at each step's
  group sizes) against the measured one (``collapse/acr_by_level/L*``, per step and as a
  running mean weighted by ``collapse/groups_by_level/L*``).
- ``length.png``: mean completion length (with min/max when logged) and the clip ratio.
- ``kl_entropy.png``: ``loss/kl`` and ``loss/entropy`` per step.
- ``levels.png``: the curriculum's level histogram over steps (levels that occur).
- ``time.png``: per-step time breakdown (generation, training, weight sync) and tokens/s.

Every x axis has integer step ticks; legends sit outside the plotting area.
"""

from __future__ import annotations

import io
import json
import logging
import math
import os
from pathlib import Path
from typing import Any

from megagrpo import fileio
from megagrpo.errors import DataError
from megagrpo.metrics.answers import answer_bias_warning, learning_verdict, wilson_interval
from megagrpo.metrics.logger import read_metrics

log = logging.getLogger(__name__)


def _series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    pts = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
    return [p[0] for p in pts], [float(p[1]) for p in pts]


def _steps_axis(ax: Any) -> None:
    """Integer step ticks (short runs showed 1.2, 1.4, ...)."""
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("step")


def _legend(fig: Any, axes: list[Any]) -> None:
    """One legend for ``axes``, to the right of the plotting area (never over the data)."""
    handles, labels = [], []
    for ax in axes:
        h, lab = ax.get_legend_handles_labels()
        handles += h
        labels += lab
    if handles:
        fig.legend(handles, labels, fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 0.95))


def _finish(fig: Any, bottom_ax: Any, axes: list[Any]) -> Any:
    """``fig`` with step ticks on ``bottom_ax``, a tight layout and one legend for ``axes``."""
    _steps_axis(bottom_ax)
    fig.tight_layout()
    _legend(fig, axes)
    return fig


def _save(fig: Any, path: Path) -> Path:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    fileio.write_bytes(path, buf.getvalue())
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path


def last_generation_row(rows: list[dict]) -> dict:
    """The last row of a step that generated (``reward/mean`` measured): with several
    optimizer steps per generated batch (``trainer.mini_batches`` / ``ppo_epochs`` > 1) the
    other rows hold ``None`` for what a generation measures; {} without rows."""
    return next(
        (r for r in reversed(rows) if r.get("reward/mean") is not None), rows[-1] if rows else {}
    )


def figure_collapse(rows: list[dict], rounds: int | None) -> Any:
    """collapse.png: ACR raw vs post-filter (top), trained groups and success (bottom).
    ``rounds``: the rounds dynamic sampling checks (the ACR = 1 - 1/R line), 0 when dynamic
    sampling is off (said on the plot: every generated group is trained), None unknown."""
    import matplotlib.pyplot as plt

    fig, (ax, ax_dyn) = plt.subplots(
        2, 1, figsize=(7, 5.5), sharex=True, gridspec_kw={"height_ratios": [3, 2]}
    )
    for key, label, style in (
        ("collapse/acr_raw", "raw ACR (pre-filter, first generation)", "-o"),
        ("collapse/frac_reward_zero_std", "frac_reward_zero_std (post-filter, trained)", "-s"),
        ("collapse/acr_predicted", "predicted ACR (levels)", ":"),
    ):
        x, y = _series(rows, key)
        if x:
            ax.plot(x, y, style, ms=3, label=label)
    off = rounds == 0
    if rounds:
        ax.axhline(
            1 - 1 / rounds,
            color="red",
            ls="--",
            label=f"1 - 1/R = {1 - 1 / rounds:.2f} (R = {rounds} checked rounds)",
        )
    ax.set_ylim(-0.03, 1.03)
    ax.set_ylabel("fraction of groups collapsed")
    ax.set_title(
        "Advantage collapse, dynamic sampling off: every generated group is trained"
        if off
        else "Advantage collapse: raw vs what dynamic sampling lets through"
    )
    x, y = _series(rows, "dynamic/trained_groups")
    if x:
        ax_dyn.bar(
            x, y, color="tab:green", alpha=0.6, label="groups trained (dynamic/trained_groups)"
        )
    x, y = _series(rows, "dynamic/valid_groups")
    if x:
        ax_dyn.plot(x, y, "k_", ms=12, label="valid groups found (dynamic/valid_groups)")
    ax_dyn.set_ylabel("groups")
    ax_ok = ax_dyn.twinx()
    x, y = _series(rows, "dynamic/success")
    if x and not off:
        ax_ok.plot(x, y, "d", color="tab:purple", ms=5, label="batch filled (dynamic/success)")
    if off:
        ax_dyn.text(0.5, 0.9, "dynamic sampling off", transform=ax_dyn.transAxes, ha="center")
    ax_ok.set_ylim(-0.1, 1.1)
    ax_ok.set_yticks([0, 1], ["short", "filled"])
    return _finish(fig, ax_dyn, [ax, ax_dyn, ax_ok])


def learning_summary(rows: list[dict]) -> dict[str, Any]:
    """Did the run learn, or learn to guess? Mean raw reward (``reward/mean_raw``: the first
    generation of each step, before any filtering) over the first and the last fifth of the
    steps and their ratio; held-out accuracy at the first and the last evaluation (step 0
    when the run evaluated before training); what guessing scores on the same questions
    (``best_constant``, ``chance``), the answers given at the first and the last evaluation
    (``answers_first``/``answers_last``: share per answer), and the steps whose first round
    showed an answer-bias collapse (:func:`megagrpo.metrics.answers.answer_bias_warning`).

    ``learned`` (:func:`megagrpo.metrics.answers.learning_verdict`): the lower end of the
    95% Wilson interval of the last held-out accuracy lies above both the best constant
    answer and the first evaluation's accuracy. A raw reward that rises only because the
    policy found the answer form and one letter cannot pass. None when there is no
    evaluation, or its rows lack ``eval/best_constant`` (a run logged by an older megagrpo).
    """
    steps = [r for r in rows if r.get("step", 0) >= 1 and r.get("reward/mean_raw") is not None]
    evals = [r for r in rows if r.get("eval/accuracy") is not None]
    out: dict[str, Any] = {"steps": len(steps)}
    if steps:
        n = max(1, len(steps) // 5)
        first = sum(float(r["reward/mean_raw"]) for r in steps[:n]) / n
        last = sum(float(r["reward/mean_raw"]) for r in steps[-n:]) / n
        out.update(
            fifth=n,
            raw_first_fifth=first,
            raw_last_fifth=last,
            raw_delta=last - first,
            first_fifth_steps=[steps[0]["step"], steps[n - 1]["step"]],
            last_fifth_steps=[steps[-n]["step"], steps[-1]["step"]],
        )
        if first > 0 and last >= 0:  # a ratio of rewards means something only then
            out["raw_ratio"] = last / first
    if evals:
        out.update(
            eval_first_step=evals[0]["step"],
            eval_first=float(evals[0]["eval/accuracy"]),
            eval_last_step=evals[-1]["step"],
            eval_last=float(evals[-1]["eval/accuracy"]),
            eval_problems=evals[-1].get("eval/num_problems"),
        )
    out.update(_guess_summary(evals))
    out["answer_bias_steps"] = [r["step"] for r in steps if answer_bias_warning(r)]
    return out


def _guess_summary(evals: list[dict]) -> dict[str, Any]:
    """The constant-answer part of :func:`learning_summary` (``learned`` included)."""
    if not evals or evals[-1].get("eval/best_constant") is None:
        return {"learned": None}
    last = evals[-1]
    total = int(last.get("eval/num_problems") or 0)
    correct = last.get("eval/correct")
    correct = int(round(correct if correct is not None else last["eval/accuracy"] * total))
    start = float(evals[0]["eval/accuracy"]) if len(evals) >= 2 else None
    verdict = learning_verdict(correct, total, float(last["eval/best_constant"]), start)
    return {
        "best_constant": float(last["eval/best_constant"]),
        "chance": last.get("eval/chance"),
        "eval_correct": correct,
        "eval_interval": verdict["interval"],
        "margin": verdict["margin"],
        "answers_first": _shares(evals[0]),
        "answers_last": _shares(last),
        "learned": verdict["learned"],
    }


def _shares(row: dict) -> dict[str, float]:
    pre = "eval/answer_share/"
    return {k[len(pre) :]: float(v) for k, v in row.items() if k.startswith(pre) and v}


def format_learning(summary: dict[str, Any]) -> str:
    """One line for the end of ``megagrpo train`` (empty without raw rewards)."""
    if "raw_delta" not in summary:
        return ""
    text = (
        f"raw reward {summary['raw_first_fifth']:.3f} (steps {summary['first_fifth_steps'][0]}-"
        f"{summary['first_fifth_steps'][1]}) -> {summary['raw_last_fifth']:.3f} (steps "
        f"{summary['last_fifth_steps'][0]}-{summary['last_fifth_steps'][1]}): "
        + change_text(summary)
    )
    if "eval_last" in summary:
        num = summary.get("eval_problems")
        text += (
            f"; held-out accuracy {summary['eval_first']:.3f} (step {summary['eval_first_step']})"
            f" -> {summary['eval_last']:.3f} (step {summary['eval_last_step']})"
            + (f" on {int(num)} questions" if num else "")
        )
    if "best_constant" in summary:
        lo, hi = summary["eval_interval"]
        answers = ", ".join(f"{k} {v:.2f}" for k, v in list(summary["answers_last"].items())[:4])
        text += (
            f" (95% CI {lo:.3f}-{hi:.3f}); best constant answer {summary['best_constant']:.3f}"
            + (f", chance {summary['chance']:.3f}" if summary.get("chance") is not None else "")
            + f"; answers {answers}"
        )
    if summary.get("answer_bias_steps"):
        text += f"; answer-bias collapse at {len(summary['answer_bias_steps'])} steps"
    if summary.get("learned") is not None:
        text += (
            "; learned"
            if summary["learned"]
            else "; did not learn (criterion: the CI's lower end above the best constant "
            "answer and the first accuracy)"
        )
    return text


def change_text(summary: dict[str, Any]) -> str:
    """``x1.52`` when the raw rewards are non-negative with a positive start, else the signed
    difference (``+0.25``): a ratio of negative or zero rewards means nothing."""
    if "raw_ratio" in summary:
        return f"x{summary['raw_ratio']:.2f}"
    return f"{summary['raw_delta']:+.3f}"


def figure_reward(rows: list[dict]) -> Any:
    """reward.png: total and per-function means, eval accuracy, the first/last fifth means
    of the raw reward; errors/timeouts below."""
    import matplotlib.pyplot as plt

    fig, (ax, ax_err) = plt.subplots(
        2, 1, figsize=(7, 5.5), sharex=True, gridspec_kw={"height_ratios": [3, 1]}
    )
    per_fn = sorted(
        {
            k
            for r in rows
            for k in r
            if k.startswith("reward/") and k.endswith("/mean") and k != "reward/mean"
        }
    )
    styles = [("reward/mean", "-", 3.0), ("reward/mean_raw", ":", 1.5)]
    styles += [(k, "--", 1.2) for k in per_fn]  # dashed: visible on top of an equal total
    for key, ls, lw in styles:
        x, y = _series(rows, key)
        if x:
            ax.plot(x, y, ls=ls, lw=lw, label=key)
    _draw_eval_vs_guessing(ax, rows)
    summary = learning_summary(rows)
    if "raw_delta" in summary:
        for key, span in (
            ("raw_first_fifth", "first_fifth_steps"),
            ("raw_last_fifth", "last_fifth_steps"),
        ):
            lo, hi = summary[span]
            ax.hlines(summary[key], lo - 0.4, hi + 0.4, colors="tab:red", lw=2.5)
        ax.plot([], [], color="tab:red", lw=2.5, label="raw reward, first / last fifth")
    ax.set_ylabel("reward")
    ax.set_title("Reward" + (f": raw {change_text(summary)}" if "raw_delta" in summary else ""))
    width = 0.4
    for offset, key, color in (
        (-0.2, "reward/errors", "tab:red"),
        (0.2, "reward/timeouts", "tab:orange"),
    ):
        x, y = _series(rows, key)
        if x:
            ax_err.bar([s + offset for s in x], y, width=width, color=color, label=key)
    from matplotlib.ticker import MaxNLocator

    ax_err.set_ylabel("failed")
    ax_err.set_ylim(bottom=0, top=max(1.0, ax_err.get_ylim()[1]))
    ax_err.yaxis.set_major_locator(MaxNLocator(integer=True))
    return _finish(fig, ax_err, [ax, ax_err])


def _draw_eval_vs_guessing(ax: Any, rows: list[dict]) -> None:
    """Held-out accuracy with its 95% Wilson interval, and what guessing scores on the same
    questions: the best constant answer and chance (dashed, across the steps)."""
    x, y = _series(rows, "eval/accuracy")
    if not x:
        return
    evals = [r for r in rows if r.get("eval/accuracy") is not None]
    lows, highs = [], []
    for r, acc in zip(evals, y):
        total = int(r.get("eval/num_problems") or 0)
        k = r.get("eval/correct")
        lo, hi = wilson_interval(int(round(k if k is not None else acc * total)), total)
        lows.append(acc - lo)
        highs.append(hi - acc)
    ax.errorbar(x, y, yerr=[lows, highs], fmt="o", ms=6, color="black", capsize=3,
                label="eval/accuracy (held-out, 95% CI)")  # fmt: skip
    for key, color, ls, label in (
        ("eval/chance", "tab:gray", "--", "chance (held-out)"),
        ("eval/best_constant", "tab:purple", "-.", "best constant answer (held-out)"),
    ):
        value = evals[-1].get(key)
        if value is not None:
            ax.axhline(float(value), color=color, ls=ls, lw=1.5, label=label)
    verdict = learning_summary(rows).get("learned")
    if verdict is not None:
        text = "learned" if verdict else "not beyond the best constant answer / start"
        ax.annotate(text, (x[-1], y[-1]), xytext=(-6, 10), textcoords="offset points",
                    ha="right", fontsize=8)  # fmt: skip


def _running(values: list[float], weights: list[float], window: int) -> list[float]:
    out = []
    for i in range(len(values)):
        v, w = values[max(0, i - window + 1) : i + 1], weights[max(0, i - window + 1) : i + 1]
        total = sum(w)
        out.append(sum(a * b for a, b in zip(v, w)) / total if total > 0 else math.nan)
    return out


def calibration_levels(rows: list[dict]) -> list[int]:
    """Profile levels with a predicted raw ACR in some row (runs with a levels file)."""
    prefix = "collapse/acr_predicted_by_level/L"
    found = {
        int(k[len(prefix) :]) for r in rows for k, v in r.items() if k.startswith(prefix) and v
    }
    return sorted(found)


def figure_calibration(rows: list[dict], window: int = 5) -> Any:
    """calibration.png: predicted vs measured raw ACR per level over steps."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    colors = plt.get_cmap("tab10")
    for i, level in enumerate(calibration_levels(rows)):
        color = colors(i % 10)
        x, y = _series(rows, f"collapse/acr_predicted_by_level/L{level}")
        ax.plot(x, y, "--", color=color, lw=1.5, label=f"L{level} predicted")
        pts = [
            (r["step"], float(r[f"collapse/acr_by_level/L{level}"]),
             float(r.get(f"collapse/groups_by_level/L{level}") or 1.0))
            for r in rows
            if r.get(f"collapse/acr_by_level/L{level}") is not None
        ]  # fmt: skip
        if pts:
            xs, ys, ws = zip(*pts)
            ax.plot(xs, ys, "o", ms=3, color=color, alpha=0.35)
            ax.plot(xs, _running(list(ys), list(ws), window), "-", color=color, lw=2,
                    label=f"L{level} measured ({window}-step mean)")  # fmt: skip
    ax.set_ylim(-0.03, 1.03)
    ax.set_ylabel("raw ACR (first round)")
    ax.set_title("Planner calibration: predicted vs measured collapse per level")
    return _finish(fig, ax, [ax])


def figure_length(rows: list[dict]) -> Any:
    """length.png: mean completion length (min-max band when logged) and the clip ratio."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    x, y = _series(rows, "length/mean")
    ax.plot(x, y, label="length/mean (tokens)")
    lo = dict(zip(*_series(rows, "length/min")))
    hi = dict(zip(*_series(rows, "length/max")))
    band = [s for s in x if s in lo and s in hi]
    if band:
        ax.fill_between(
            band, [lo[s] for s in band], [hi[s] for s in band], alpha=0.2, label="min-max"
        )
    elif hi:
        xs, ys = _series(rows, "length/max")
        ax.plot(xs, ys, ":", label="length/max")
    ax.set_ylabel("tokens")
    ax2 = ax.twinx()
    x, y = _series(rows, "length/clip_ratio")
    ax2.plot(x, y, color="tab:red", ls="--", label="length/clip_ratio")
    ax2.set_ylabel("clip ratio")
    ax2.set_ylim(-0.03, 1.03)
    ax.set_title("Completion length")
    return _finish(fig, ax, [ax, ax2])


def figure_kl_entropy(rows: list[dict]) -> Any:
    """kl_entropy.png: KL to the reference (left axis) and policy entropy (right axis)."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    x, y = _series(rows, "loss/kl")
    ax.plot(x, y, "-o", ms=3, color="tab:blue", label="loss/kl (k3, to the reference)")
    ax.set_ylabel("KL")
    ax2 = ax.twinx()
    x, y = _series(rows, "loss/entropy")
    ax2.plot(x, y, "-s", ms=3, color="tab:orange", label="loss/entropy (nats/token)")
    ax2.set_ylabel("entropy")
    ax.set_title("KL and entropy")
    return _finish(fig, ax, [ax, ax2])


def figure_levels(rows: list[dict]) -> Any:
    """levels.png: stacked level histogram, only levels that occur."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    levels = sorted(
        {k for r in rows for k, v in r.items() if k.startswith("curriculum/level_hist/L") and v},
        key=lambda k: int(k.rsplit("L", 1)[1]),
    )
    steps = [r["step"] for r in rows]
    stacks = [[float(r.get(k) or 0.0) for r in rows] for k in levels]
    if steps and stacks:
        ax.stackplot(steps, stacks, labels=[k.rsplit("/", 1)[1] for k in levels])
    ax.set_ylabel("problems")
    ax.set_title("Online difficulty levels (L1 = always solved ... L6 = never)")
    return _finish(fig, ax, [ax])


def figure_time(rows: list[dict]) -> Any:
    """time.png: stacked step time (generation, training, sync) and tokens/s."""
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
    ax.set_ylabel("seconds")
    ax2 = ax.twinx()
    x, y = _series(rows, "perf/tokens_per_s")
    ax2.plot(x, y, color="black", label="tokens/s")
    ax2.set_ylabel("generated tokens / s")
    ax.set_title("Step time breakdown")
    return _finish(fig, ax, [ax, ax2])


REPORT_FILES = (
    "collapse.png",
    "reward.png",
    "length.png",
    "kl_entropy.png",
    "levels.png",
    "time.png",
    "calibration.png",
    "summary.json",
)
"""Every file :func:`make_report` writes (its own directory may hold only these)."""


def check_report_out(out: Path, default: bool) -> fileio.DirState | None:
    """What may be replaced at ``out``: an ``--out`` named by the user must be new or empty;
    the default ``RUN_DIR/report`` may hold an earlier report (only :data:`REPORT_FILES`).
    ConfigError naming what is in the way; returns the state to compare at the rename."""
    return fileio.check_rewrite_dir(out, default, REPORT_FILES, "the report")


def make_report(
    run_dir: str | os.PathLike,
    out: str | os.PathLike | None = None,
    checked_rounds: int | None = None,
) -> list[Path]:
    """Draw every plot; returns the PNG paths. ``checked_rounds``: generation rounds dynamic
    sampling checks (draws the ACR = 1 - 1/rounds line; 0: dynamic sampling off, said on the
    plot; None: unknown, no line). ``summary.json``'s ``last`` is the last generation's row
    (:func:`last_generation_row`). DataError when metrics.jsonl is missing or empty. Written
    to a temporary directory and renamed into place while ``out`` is still as checked
    (:func:`check_report_out`)."""
    import matplotlib

    matplotlib.use("Agg")
    run_dir = Path(run_dir)
    metrics = run_dir / "metrics.jsonl"
    if not metrics.is_file():
        raise DataError(f"{metrics}: not found (is {run_dir} a run directory?)")
    rows = read_metrics(metrics)
    if not rows:
        raise DataError(f"{metrics}: no rows")
    target = Path(out) if out else run_dir / "report"
    expected = check_report_out(target, default=not out)
    figures = {
        "collapse.png": lambda: figure_collapse(rows, checked_rounds),
        "reward.png": lambda: figure_reward(rows),
        "length.png": lambda: figure_length(rows),
        "kl_entropy.png": lambda: figure_kl_entropy(rows),
        "levels.png": lambda: figure_levels(rows),
        "time.png": lambda: figure_time(rows),
    }
    if calibration_levels(rows):
        figures["calibration.png"] = lambda: figure_calibration(rows)
    summary = {**summarize(rows), "plots": list(figures)}
    with fileio.atomic_dir(target, unique=True, expected=expected) as tmp:
        for name, draw in figures.items():
            _save(draw(), tmp / name)
        fileio.write_text(tmp / "summary.json", json.dumps(summary, indent=1))
    return [target / name for name in figures]


def summarize(rows: list[dict]) -> dict[str, Any]:
    """``summary.json`` without the plot list: step counts, the learning summary and the last
    generation's metrics (:func:`last_generation_row`)."""
    last = last_generation_row(rows)
    return {
        "steps": len(rows),
        "steps_trained_nothing": sum(1 for r in rows if r.get("train/skipped_empty_batch")),
        "steps_skipped_nonfinite": sum(1 for r in rows if r.get("train/skipped_nonfinite")),
        "learning": learning_summary(rows),
        "last_generation_step": last.get("step"),
        "last": {
            k: last.get(k)
            for k in (
                "reward/mean",
                "collapse/acr_raw",
                "collapse/frac_reward_zero_std",
                "dynamic/trained_groups",
                "reward/errors",
            )
        },
    }
