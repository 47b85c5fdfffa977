"""AlphaMed difficulty levels, levels files, and the beta-binomial predicted ACR.

A problem answered correctly ``c`` times out of ``k`` samples has level ``k - c + 1``:
for k = 5, L1 = 5/5 correct ... L6 = 0/5. Levels alone say little about the per-sample
success probability p of an extreme problem (5/5 is compatible with p = 0.8, which still
splits 83% of G=8 groups). We therefore fit a population prior Beta(a, b) to the level
histogram by maximum marginal likelihood (beta-binomial empirical Bayes) and predict each
level's collapse probability under its posterior Beta(a + c, b + k - c):

    P(collapse | level) = E[p^G] + E[(1-p)^G],  E[p^G] = prod_{i<G} (A + i) / (A + B + i).

Both the fit and the moments use only products over integers, so no special functions.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from megagrpo.data.loader import read_jsonl
from megagrpo.errors import DataError

log = logging.getLogger(__name__)


def level_from_counts(correct: int, k: int) -> int:
    """AlphaMed level of ``correct`` out of ``k``: ``k - correct + 1`` (L1 = all correct)."""
    if not 0 <= correct <= k:
        raise ValueError(f"correct={correct} outside [0, k={k}]")
    return k - correct + 1


def correct_from_level(level: int, k: int) -> int:
    """Inverse of :func:`level_from_counts`."""
    if not 1 <= level <= k + 1:
        raise ValueError(f"level L{level} outside L1..L{k + 1} for k={k}")
    return k - level + 1


def parse_histogram(text: str) -> dict[int, int]:
    """``"L1=2164,L2=294,..."`` -> ``{1: 2164, 2: 294, ...}``."""
    hist: dict[int, int] = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        m = re.fullmatch(r"[Ll]?(\d+)\s*=\s*(\d+)", item)
        if not m:
            raise ValueError(f"level histogram entry '{item}' is not of the form L3=223")
        hist[int(m.group(1))] = int(m.group(2))
    if not hist or sum(hist.values()) == 0:
        raise ValueError(f"level histogram '{text}' is empty")
    return hist


def parse_level_set(text: str) -> list[int]:
    """``"L2-L5"``, ``"2-5"``, ``"L2,L3,L5"`` or ``"all"`` (-> []) to a list of levels."""
    text = text.strip()
    if text.lower() in ("all", ""):
        return []
    out: list[int] = []
    for part in text.split(","):
        m = re.fullmatch(r"\s*[Ll]?(\d+)\s*(?:-\s*[Ll]?(\d+))?\s*", part)
        if not m:
            raise ValueError(f"level set '{text}': cannot parse '{part}' (e.g. L2-L5)")
        lo = int(m.group(1))
        hi = int(m.group(2)) if m.group(2) else lo
        out.extend(range(lo, hi + 1))
    return sorted(set(out))


# ----------------------------------------------------------------------------- levels files


def read_levels_file(path: str | Path) -> list[dict]:
    """Records of a levels JSONL (``id, k, correct, level, mean_length``), checked.

    A truncated last line (an interrupted profile) is skipped with a warning.
    """
    path = Path(path)
    if not path.is_file():
        raise DataError(f"levels file not found: {path}")
    records: list[dict] = []
    for lineno, rec in read_jsonl(path, truncated_last_ok=True):
        for key in ("id", "k", "correct"):
            if key not in rec:
                raise DataError(f"{path}:{lineno}: missing key '{key}'")
        k, c = int(rec["k"]), int(rec["correct"])
        if not 0 <= c <= k:
            raise DataError(f"{path}:{lineno}: correct={c} outside [0, k={k}]")
        rec["level"] = level_from_counts(c, k)
        rec["id"] = str(rec["id"])
        records.append(rec)
    return records


def levels_by_id(records: Iterable[Mapping]) -> dict[str, int]:
    """``{problem id: level}`` of levels-file records."""
    return {str(r["id"]): int(r["level"]) for r in records}


def histogram(levels: Iterable[int], num_levels: int | None = None) -> dict[int, int]:
    """``{level: count}`` for L1..L{num_levels} (zeros included)."""
    counts: dict[int, int] = {}
    for level in levels:
        counts[int(level)] = counts.get(int(level), 0) + 1
    top = max([num_levels or 0, *counts.keys()]) if counts or num_levels else 0
    return {lv: counts.get(lv, 0) for lv in range(1, top + 1)}


# ----------------------------------------------------------------------------- beta-binomial


def _rising_log(x: np.ndarray, n: int) -> np.ndarray:
    """log(x (x+1) ... (x+n-1)) elementwise (0 for n = 0)."""
    out = np.zeros_like(x, dtype=np.float64)
    for i in range(n):
        out += np.log(x + i)
    return out


def _loglik(a: np.ndarray, b: np.ndarray, counts: Mapping[tuple[int, int], int]) -> np.ndarray:
    """Beta-binomial log-likelihood (without the binomial constant) of ``{(k, c): n}``."""
    total = np.zeros(np.broadcast(a, b).shape)
    for (k, c), n in counts.items():
        if n:
            total += n * (_rising_log(a, c) + _rising_log(b, k - c) - _rising_log(a + b, k))
    return total


@dataclass(frozen=True)
class BetaPrior:
    """Population prior Beta(a, b) of the per-sample success probability p."""

    a: float
    b: float

    @classmethod
    def fit(
        cls, counts: Mapping[tuple[int, int], int], lo: float = 1e-3, hi: float = 1e3
    ) -> BetaPrior:
        """Maximum marginal likelihood fit to ``{(k, correct): number of problems}``.

        Grid search over log a, log b in [lo, hi], then a shrinking pattern search.
        """
        if sum(counts.values()) == 0:
            return cls(1.0, 1.0)
        grid = np.exp(np.linspace(math.log(lo), math.log(hi), 97))
        ga, gb = np.meshgrid(grid, grid, indexing="ij")
        ll = _loglik(ga, gb, counts)
        i, j = np.unravel_index(int(np.argmax(ll)), ll.shape)
        la, lb = math.log(grid[i]), math.log(grid[j])
        best = float(ll[i, j])
        step = (math.log(hi) - math.log(lo)) / 96
        while step > 1e-7:
            moved = False
            for da, db in ((step, 0), (-step, 0), (0, step), (0, -step)):
                na = min(max(la + da, math.log(lo)), math.log(hi))
                nb = min(max(lb + db, math.log(lo)), math.log(hi))
                v = float(_loglik(np.array(math.exp(na)), np.array(math.exp(nb)), counts))
                if v > best + 1e-12:
                    best, la, lb, moved = v, na, nb, True
            if not moved:
                step /= 2
        return cls(math.exp(la), math.exp(lb))

    @classmethod
    def fit_histogram(cls, hist: Mapping[int, int], k: int) -> BetaPrior:
        """Fit to a level histogram ``{level: count}`` on the L1..L{k+1} scale."""
        return cls.fit({(k, correct_from_level(lv, k)): n for lv, n in hist.items()})

    def posterior(self, correct: int, k: int) -> tuple[float, float]:
        """Posterior Beta parameters after ``correct`` of ``k``."""
        return self.a + correct, self.b + k - correct

    def level_collapse_prob(self, level: int, k: int, group_size: int) -> float:
        """E[p^G + (1-p)^G] under the posterior of a level-``level`` problem."""
        a, b = self.posterior(correct_from_level(level, k), k)
        return beta_collapse_prob(a, b, group_size)


def beta_collapse_prob(a: float, b: float, group_size: int) -> float:
    """E[p^G] + E[(1-p)^G] for p ~ Beta(a, b)."""
    ea = math.exp(sum(math.log((a + i) / (a + b + i)) for i in range(group_size)))
    eb = math.exp(sum(math.log((b + i) / (a + b + i)) for i in range(group_size)))
    return ea + eb


@dataclass
class CollapsePrediction:
    """Predicted collapse for a level mix: overall ACR and per level."""

    acr: float
    by_level: dict[int, float]
    share: dict[int, float]
    prior: BetaPrior
    group_size: int


def predict_acr(
    hist: Mapping[int, int],
    k: int,
    group_size: int,
    keep_levels: Iterable[int] | None = None,
    level_weights: Mapping[int, float] | None = None,
    prior: BetaPrior | None = None,
) -> CollapsePrediction:
    """Predicted ACR of training on ``keep_levels`` of a population with histogram ``hist``.

    The prior is fitted on the *whole* histogram (all levels), then each kept level
    contributes its posterior collapse probability, weighted by its share of the kept
    problems (or by ``level_weights``, the sampler's mixing weights).
    """
    prior = prior or BetaPrior.fit_histogram(hist, k)
    keep = sorted(set(keep_levels)) if keep_levels else sorted(hist)
    by_level = {lv: prior.level_collapse_prob(lv, k, group_size) for lv in keep}
    if level_weights:
        raw = {lv: float(level_weights.get(lv, 0.0)) for lv in keep}
    else:
        raw = {lv: float(hist.get(lv, 0)) for lv in keep}
    total = sum(raw.values())
    if total <= 0:
        raise ValueError(f"no problems in the kept levels {keep}")
    share = {lv: w / total for lv, w in raw.items()}
    acr = sum(share[lv] * by_level[lv] for lv in keep)
    return CollapsePrediction(acr, by_level, share, prior, group_size)


def level_alternatives(hist: Mapping[int, int], k: int, group_size: int) -> dict[str, float]:
    """Predicted ACR of contiguous level filters that drop at least one extreme level
    (``{"L2-L5": acr, ...}``), for the pre-flight check's advice."""
    prior = BetaPrior.fit_histogram(hist, k)
    out = {}
    top = k + 1
    for lo in range(1, top + 1):
        for hi in range(lo, top + 1):
            if (lo, hi) == (1, top) or sum(hist.get(x, 0) for x in range(lo, hi + 1)) == 0:
                continue
            out[f"L{lo}-L{hi}"] = predict_acr(
                hist, k, group_size, range(lo, hi + 1), prior=prior
            ).acr
    # widest filters first: the advice prefers keeping more problems
    return dict(
        sorted(out.items(), key=lambda kv: -sum(hist.get(x, 0) for x in parse_level_set(kv[0])))
    )


def fill_success_prob(acr: float, batch_groups: int, num_checked_rounds: int) -> float:
    """P(at least ``batch_groups`` valid groups among ``rounds * batch_groups`` checked).

    Groups treated as independent with collapse probability ``acr``:
    P(Binomial(R * B, 1 - acr) >= B).
    """
    n, q = num_checked_rounds * batch_groups, 1.0 - acr
    if batch_groups <= 0:
        return 1.0
    if n < batch_groups or q <= 0.0:
        return 0.0
    if q >= 1.0:
        return 1.0
    logs = [
        math.lgamma(n + 1)
        - math.lgamma(x + 1)
        - math.lgamma(n - x + 1)
        + x * math.log(q)
        + (n - x) * math.log1p(-q)
        for x in range(batch_groups, n + 1)
    ]
    top = max(logs)
    return min(1.0, math.exp(top) * sum(math.exp(v - top) for v in logs))
