"""What ``megagrpo plan`` simulates: a level histogram (from a levels file or a text like
``L1=2164,L2=294``), k, the curriculum, and the problems of a levels file."""

from __future__ import annotations

import dataclasses
from typing import Any

from megagrpo.curriculum.config import CurriculumConfig
from megagrpo.curriculum.levels import histogram, parse_histogram, read_levels_file
from megagrpo.errors import ConfigError
from megagrpo.plan.simulate import population_from_records

ARTICLE_LEVELS = "L1=2164,L2=294,L3=223,L4=180,L5=216,L6=636"
"""The specialist exam's level histogram (the article's): the default of ``--levels``."""


@dataclasses.dataclass
class PlanInputs:
    """What a plan simulates: the level histogram, k, the curriculum of the run config (all
    of a bare histogram's levels unless keep_levels was given), and the problems of a levels
    file (``records``, ``population``) when there is one."""

    hist: dict[int, int]
    k: int
    curriculum: CurriculumConfig
    records: list[dict] | None = None
    population: Any = None


def plan_inputs(curriculum: CurriculumConfig, levels: str | None, all_levels: bool) -> PlanInputs:
    """The histogram of ``levels`` (``--levels`` text) when given, else of
    ``curriculum.levels_file``, else the article's. ``all_levels``: plan on every level of the
    histogram (a bare histogram without keep_levels)."""
    k, records, population = curriculum.level_k, None, None
    levels_file = None if levels else curriculum.levels_file
    if levels_file:
        records = read_levels_file(levels_file)
        ks = {int(r["k"]) for r in records}
        if len(ks) != 1:
            raise ConfigError(f"{levels_file}: mixed k values {sorted(ks)}")
        k = ks.pop()
        hist = histogram((int(r["level"]) for r in records), k + 1)
        population = population_from_records(records, k, curriculum.seed)
    else:
        try:
            hist = parse_histogram(levels or ARTICLE_LEVELS)
        except ValueError as exc:
            raise ConfigError(f"--levels: {exc}") from exc
        if max(hist) > k + 1:
            raise ConfigError(f"--levels has L{max(hist)} but k={k} allows L1..L{k + 1}")
    cur = dataclasses.replace(curriculum, level_k=k)
    if all_levels:
        cur.keep_levels = sorted(hist)
    return PlanInputs(hist, k, cur, records, population)
