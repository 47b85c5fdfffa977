"""Difficulty profiler: k answers per problem from the untrained model -> AlphaMed levels.

:func:`run_profile` works with any RolloutEngine (``generate(problems, n, sampling)``) and
any reward function ``(completions, problem) -> list[float]`` (the correctness reward: a
value >= 0.5 counts as correct). It appends one JSON line per finished problem to the
levels file (``id, k, correct, level, mean_length, mean_reward``), flushed after every
batch, so an interrupted profile resumes where it stopped and never re-samples a finished
problem (a truncated last line is dropped and that problem redone). One profile at a time
writes a levels file (``LEVELS.lock`` beside it; a second one is refused naming the first).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from megagrpo import fileio
from megagrpo.curriculum.levels import BetaPrior, histogram, level_from_counts, predict_acr
from megagrpo.curriculum.stats import SOLVED_THRESHOLD
from megagrpo.data.loader import read_jsonl
from megagrpo.errors import ConfigError, DataError
from megagrpo.types import Problem

log = logging.getLogger(__name__)

RewardFn = Callable[[list[str], Problem], list[float]]


def _finished(path: Path, k: int) -> dict[str, dict]:
    """Records already in ``path``; rewrites the file without a truncated last line."""
    if not path.exists():
        return {}
    done: dict[str, dict] = {}
    good: list[int] = []
    for lineno, rec in read_jsonl(path, truncated_last_ok=True):
        if int(rec.get("k", -1)) != k:
            raise DataError(
                f"{path}:{lineno}: profiled with k={rec.get('k')}, now k={k}; "
                "use another output file"
            )
        done[str(rec["id"])] = rec
        good.append(lineno)
    lines = path.read_text(encoding="utf-8").splitlines()
    if any(line.strip() for line in lines[good[-1] if good else 0 :]):  # truncated last line
        log.warning("%s: the truncated last record is dropped, will redo it", path)
        fileio.write_text(path, "".join(lines[n - 1] + "\n" for n in good))
    return done


def run_profile(
    problems: Sequence[Problem],
    engine: Any,
    reward_fn: RewardFn,
    k: int,
    out_path: str | os.PathLike,
    batch_size: int = 64,
    sampling: Any | None = None,
) -> list[dict]:
    """Profile ``problems`` (skipping those already in ``out_path``); returns all records.

    Args:
        problems: the problem set.
        engine: RolloutEngine; ``engine.generate(batch, k, sampling)`` -> groups ``[B]``.
        reward_fn: correctness reward ``(completions [k], problem) -> [k]``.
        k: answers per problem (AlphaMed: 5).
        out_path: the levels JSONL (appended to).
        batch_size: problems per generate call.
    """
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    path = Path(out_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    lock = _lock(path)
    try:
        return _profile(problems, engine, reward_fn, k, path, batch_size, sampling)
    finally:
        fileio.unlock_file(lock_path(path), lock)


def lock_path(path: Path) -> Path:
    """The lock of a levels file: ``LEVELS.lock`` beside it."""
    return path.with_name(path.name + ".lock")


def _lock(path: Path) -> int:
    """Hold ``LEVELS.lock`` for the whole profile: a second profile of the same file (a
    requeued job while the old one drains, a second terminal) would rewrite the file under
    the first one's appends (they went to the unlinked old file, lost). ConfigError naming
    the holder's pid."""
    lock = lock_path(path)
    fd = fileio.lock_file(lock, wait=False)
    if fd is None:
        try:
            holder = lock.read_text(encoding="utf-8").strip() or "?"
        except OSError:
            holder = "?"
        raise ConfigError(
            f"{path} is being written by another megagrpo profile (pid {holder}; lock {lock}): "
            "wait for it to finish, or choose another --out"
        )
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    return fd


def _profile(
    problems: Sequence[Problem],
    engine: Any,
    reward_fn: RewardFn,
    k: int,
    path: Path,
    batch_size: int,
    sampling: Any | None,
) -> list[dict]:
    """:func:`run_profile` under the levels file's lock."""
    done = _finished(path, k)
    todo = [p for p in problems if p.id not in done]
    log.info(
        "profile: %d problems, %d already done, %d to sample (k=%d)",
        len(problems),
        len(problems) - len(todo),
        len(todo),
        k,
    )
    with fileio.open_append_text(path) as fh:
        for start in range(0, len(todo), batch_size):
            batch = todo[start : start + batch_size]
            groups = engine.generate(batch, k, sampling)
            if len(groups) != len(batch):
                raise RuntimeError(f"engine returned {len(groups)} groups for {len(batch)}")
            for prob, group in zip(batch, groups):
                rec = _record(prob, group, reward_fn, k)
                done[prob.id] = rec
                fh.write(json.dumps(rec, ensure_ascii=False) + "\n")
            fh.flush()
            os.fsync(fh.fileno())
            log.info("profile: %d/%d", len(done), len(problems))
    order = {p.id: i for i, p in enumerate(problems)}
    return sorted(done.values(), key=lambda r: order.get(r["id"], len(order)))


def _record(problem: Problem, group: Any, reward_fn: RewardFn, k: int) -> dict:
    rewards = [float(x) for x in reward_fn(list(group.completions), problem)]
    if len(rewards) != k:
        raise RuntimeError(f"problem {problem.id}: {len(rewards)} rewards for k={k}")
    correct = sum(1 for r in rewards if r >= SOLVED_THRESHOLD)
    lengths = list(group.lengths) or [len(c) for c in group.completions]
    return {
        "id": problem.id,
        "k": k,
        "correct": correct,
        "level": level_from_counts(correct, k),
        "mean_length": sum(lengths) / max(len(lengths), 1),
        "mean_reward": sum(rewards) / k,
    }


def format_level_table(
    records: Sequence[dict], k: int, group_size: int = 8, keep_levels: Sequence[int] | None = None
) -> str:
    """Level histogram with shares and the predicted collapse probability at G."""
    hist = histogram((int(r["level"]) for r in records), k + 1)
    total = sum(hist.values())
    if total == 0:
        return "no problems profiled"
    prior = BetaPrior.fit_histogram(hist, k)
    all_pred = predict_acr(hist, k, group_size, prior=prior)
    lines = [
        f"{'level':<6}{'correct':>9}{'problems':>10}{'share':>8}"
        f"{'P(collapse) G=' + str(group_size):>18}"
    ]
    for lv, n in hist.items():
        lines.append(
            f"L{lv:<5}{f'{k - lv + 1}/{k}':>9}{n:>10}{n / total:>8.1%}"
            f"{all_pred.by_level[lv]:>18.3f}"
        )
    lines.append(f"{'total':<15}{total:>10}")
    lines.append(
        f"prior Beta(a={prior.a:.3f}, b={prior.b:.3f}); predicted ACR, all levels: "
        f"{all_pred.acr:.3f}"
    )
    if keep_levels:
        kept = {lv: n for lv, n in hist.items() if lv in set(keep_levels)}
        if sum(kept.values()):
            pred = predict_acr(hist, k, group_size, keep_levels, prior=prior)
            names = ",".join(f"L{x}" for x in sorted(set(keep_levels)))
            lines.append(
                f"predicted ACR, keep {names} ({sum(kept.values())} problems): {pred.acr:.3f}"
            )
    return "\n".join(lines)
