"""The completions log (ms-swift/TRL ``--log_completions``): what the model wrote, every step.

``RUN_DIR/completions.jsonl`` gets one JSON row per completion of the trained batch::

    {"step": 3, "problem_id": "112A5", "level": 4, "group": 0, "sample": 2,
     "prompt": "<the whole prompt>", "prompt_tail": "...e. 肝硬変", "completion": "...答え: c",
     "reward": 1.2, "reward_parts": {"mcq_accuracy": 1.0, "soft_overlong": 0.0},
     "advantage": 0.87, "length": 311, "finish_reason": "stop", "gold": ["c"]}

and, every ``table_every`` steps, the step's rows go to W&B as a ``wandb.Table`` named
``completions`` laid out as ms-swift's: ``step, prompt, completion``, one column per reward
function, ``advantages`` (then problem_id, level, reward, finish_reason), when a W&B run is
given. On resume, rows of steps after the checkpoint are
dropped (:meth:`CompletionsLog.truncate_after`), as metrics.jsonl does. Rank 0 only.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from megagrpo import fileio
from megagrpo.types import Group

COLUMNS = (
    "step",
    "problem_id",
    "level",
    "group",
    "sample",
    "prompt",
    "prompt_tail",
    "completion",
    "reward",
    "reward_parts",
    "advantage",
    "length",
    "finish_reason",
    "gold",
)


Levels = Mapping[str, "int | None"] | Callable[[str], "int | None"] | None


def _level(levels: Levels, pid: str, default: Any) -> Any:
    if levels is None:
        return default
    if callable(levels):
        found = levels(pid)
        return default if found is None else found
    return levels.get(pid, default)


def find_wandb_run(logger: Any) -> Any:
    """The wandb run inside a logger built by :func:`megagrpo.metrics.build_logger` (a
    MultiLogger holding a WandbLogger), or None (W&B disabled, rank != 0)."""
    if getattr(logger, "run", None) is not None and hasattr(logger, "_run"):
        return logger.run
    for inner in getattr(logger, "loggers", []):
        run = find_wandb_run(inner)
        if run is not None:
            return run
    return None


def prompt_text(group: Group, prompt_texts: Mapping[str, str] | None, variant: int = -1) -> str:
    """The group's prompt: the rendered text when given, else its messages' contents;
    ``variant >= 0`` (``data.variants``): that rendering's messages."""
    text = None if variant >= 0 else (prompt_texts or {}).get(group.problem.id)
    if text is None:
        msgs = group.problem.variant(variant).messages
        text = "\n".join(str(m.get("content", "")) for m in msgs)
    return text


def prompt_tail(
    group: Group, prompt_texts: Mapping[str, str] | None, chars: int, variant: int = -1
) -> str:
    """The last ``chars`` characters of the group's prompt (the rendered text when given,
    else its last message; ``variant >= 0``: that rendering's last message)."""
    text = None if variant >= 0 else (prompt_texts or {}).get(group.problem.id)
    if text is None:
        msgs = group.problem.variant(variant).messages
        text = str(msgs[-1].get("content", "")) if msgs else ""
    return text[-chars:] if chars > 0 else ""


def _step_of(row: dict) -> float:
    """The row's step (a row without a readable one sorts after every step: dropped)."""
    step = row.get("step", 0)
    return step if isinstance(step, int) and not isinstance(step, bool) else math.inf


class CompletionsLog:
    """Writes ``completions.jsonl`` (every call) and a W&B table (every ``table_every``)."""

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        table_every: int = 0,
        wandb_run: Any = None,
        prompt_chars: int = 200,
    ) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.table_every = int(table_every)
        self.wandb_run = wandb_run
        self.prompt_chars = int(prompt_chars)
        self._fh = fileio.open_append_text(self.path)

    def truncate_after(self, step: int) -> int:
        """Drop rows of steps after ``step`` (a resumed run rewrites them); rows kept."""
        self._fh.close()
        kept = []
        if self.path.exists():
            with open(self.path, encoding="utf-8", errors="replace") as fh:
                for line in fh:
                    try:
                        row = json.loads(line)
                    except (ValueError, RecursionError):
                        continue  # a torn last line from a kill mid-write
                    if isinstance(row, dict) and _step_of(row) <= step:
                        kept.append(line if line.endswith("\n") else line + "\n")
        fileio.write_text(self.path, "".join(kept))
        self._fh = fileio.open_append_text(self.path)
        return len(kept)

    def rows(
        self,
        step: int,
        groups: Sequence[Group],
        levels: Levels = None,
        prompt_texts: Mapping[str, str] | None = None,
        advantages: Sequence[Any] | None = None,
    ) -> list[dict[str, Any]]:
        """The rows of one step (see module docstring); ``prompt_texts``: problem id ->
        rendered prompt text (else its messages); the other arguments as :meth:`log`."""
        out = []
        for gi, g in enumerate(groups):
            pid = g.problem.id
            golds = g.member_golds()  # data.variants: each member's own rendering
            shown = {  # what each member was asked (data.variants: its own rendering)
                k: (
                    prompt_text(g, prompt_texts, k),
                    prompt_tail(g, prompt_texts, self.prompt_chars, k),
                )
                for k in set(g.member_variants) or {-1}
            }
            level = _level(levels, pid, g.problem.meta.get("level"))
            adv = None if advantages is None else [float(a) for a in advantages[gi]]
            for si, text in enumerate(g.completions):
                out.append(
                    {
                        "step": int(step),
                        "problem_id": pid,
                        "level": level,
                        "group": gi,
                        "sample": si,
                        "prompt": shown[g.variant_of(si)][0],
                        "prompt_tail": shown[g.variant_of(si)][1],
                        "completion": text,
                        "reward": float(g.rewards[si]) if si < len(g.rewards) else None,
                        "reward_parts": {
                            k: float(v[si]) for k, v in g.reward_parts.items() if si < len(v)
                        },
                        "advantage": adv[si] if adv is not None and si < len(adv) else None,
                        "length": int(g.lengths[si]) if si < len(g.lengths) else None,
                        "finish_reason": (
                            g.finish_reasons[si] if si < len(g.finish_reasons) else None
                        ),
                        "gold": golds[si],
                        **({"variant": g.variant_of(si)} if g.member_variants else {}),
                    }
                )
        return out

    def log(
        self,
        step: int,
        groups: Sequence[Group],
        levels: Levels = None,
        advantages: Sequence[Any] | None = None,
    ) -> int:
        """Append the step's rows (flushed); the W&B table when due. Returns rows written.

        Args:
            step: 1-based optimiser step. groups: the trained groups (rewards filled).
            levels: problem id -> curriculum level, a mapping or a function such as
                ``CurriculumSampler.level_of`` (else ``problem.meta['level']``).
            advantages: one row ``[G_n]`` per group (the trained advantages), or None.
        """
        rows = self.rows(step, groups, levels, advantages=advantages)
        self._fh.write("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
        self._fh.flush()
        os.fsync(self._fh.fileno())
        if self.wandb_run is not None and self.table_every > 0 and step % self.table_every == 0:
            self._log_table(step, rows)
        return len(rows)

    def _log_table(self, step: int, rows: list[dict[str, Any]]) -> None:
        import wandb

        columns, data = swift_table(rows)
        table: Any = wandb.Table(columns=list[Any](columns), data=list[Any](data))
        self.wandb_run.log({"completions": table}, step=step)

    def close(self) -> None:
        self._fh.close()


def swift_table(rows: list[dict[str, Any]]) -> tuple[list[str], list[list[Any]]]:
    """ms-swift's completions table (``_build_log_table``: gen_step, prompt, completion, one
    column per reward function, advantages) from the rows of one step, megagrpo's
    problem_id, level, total reward and finish reason after them."""
    names: list[str] = []
    for r in rows:
        names += [k for k in r["reward_parts"] if k not in names]
    columns = ["step", "prompt", "completion", *names, "advantages"]
    columns += ["problem_id", "level", "reward", "finish_reason"]
    data = [
        [r["step"], r["prompt"], r["completion"], *(r["reward_parts"].get(n) for n in names)]
        + [r["advantage"], r["problem_id"], r["level"], r["reward"], r["finish_reason"]]
        for r in rows
    ]
    return columns, data
