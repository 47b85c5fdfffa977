"""First-round oversampling of dynamic sampling (``dynamic.oversample``).

Without it a step's first round draws ``B`` problems; when fewer than ``B - carried`` of them
split, a resampling round draws ``B`` more, a whole round (its longest completion sets its
time) for the few groups still missing. With it the first round draws enough problems that
the batch fills with high probability: with ``q = 1 - ACR`` of fresh groups valid and ``need =
B - carried`` still missing, ``n`` problems give ``Bin(n, q)`` valid ones, and

    n = ceil((need + z sqrt(need ACR)) / (1 - ACR))

puts the batch ``z`` (:data:`MARGIN_Z`) standard deviations of that binomial inside it
(normal approximation: a resampling round in ~2 % of steps). The valid groups beyond the batch
go to the carry buffer (its staleness and size rules: ``dynamic.carry_max_staleness``,
``carry_max_groups``) and fill the next step first, so on average a step generates what it
trains, ``B / (1 - ACR)`` groups, in one round instead of ``1 + ACR / (1 - ACR)``.

``auto`` estimates ACR online: an exponential average (:data:`EMA_WEIGHT`) of each step's raw
first-round ACR, started from the levels' prediction when there is one (else the first step
draws ``need``); the factor is bounded by :data:`AUTO_MAX`. ``FACTOR``: ``n = ceil(need x
FACTOR)``. The batch keeps the first ``B`` valid groups in draw order (carried ones first, then
the round's in the order its problems were drawn), never in order of completion: no bias toward
short or fast groups (``tests/unit/test_oversample.py``).
"""

from __future__ import annotations

import math

AUTO_MAX = 4.0
"""Largest first round ``auto`` draws, as a multiple of the groups still needed: up to a raw ACR
of ~0.7 one round still fills the batch (the article's all-level ACR; the CPU demo starts at
0.5-0.9). In a simulation of the demo's sampling (B 8, G 4, R 1, raw ACR 0.54) a bound of 2
leaves 1.52 rounds a step, 3 gives 1.12, 4 gives 1.06 (off: 1.94)."""
MARGIN_Z = 2.0
"""Standard deviations of the valid count the first round keeps the batch inside."""
EMA_WEIGHT = 0.3
"""Weight of the newest step's raw ACR in the online estimate."""
FACTOR_MAX = 4.0
"""Largest ``dynamic.oversample`` factor the config accepts."""


def parse_oversample(text: str) -> str | float:
    """``dynamic.oversample`` parsed: ``"auto"``, ``"off"`` or the factor (ValueError when it
    is neither a word nor a number in [1, :data:`FACTOR_MAX`])."""
    word = str(text).strip().lower()
    if word in ("auto", "off"):
        return word
    bad = f"must be auto, off or a number in [1, {FACTOR_MAX:g}], got {text!r}"
    try:
        factor = float(word)
    except ValueError:
        raise ValueError(bad) from None
    if not math.isfinite(factor) or not 1.0 <= factor <= FACTOR_MAX:
        raise ValueError(bad)
    return factor


def first_round_size(
    batch_groups: int, carried: int, acr: float | None, setting: str | float
) -> int:
    """Problems a step's first round draws (module doc). ``off``: ``batch_groups``, whatever
    was carried (dynamic sampling without oversampling). Else from ``need = batch_groups -
    carried``: a factor gives ``ceil(need x factor)``; ``auto`` the binomial margin on the ACR
    estimate ``acr`` (``need`` while there is none), at most ``AUTO_MAX x need``. At least one
    problem: a step whose carried groups fill its batch still draws a fresh one."""
    if setting == "off":
        return batch_groups
    need = max(batch_groups - carried, 0)
    if not isinstance(setting, str):
        return max(1, math.ceil(need * setting - 1e-9))
    if acr is None or need == 0:
        return max(1, need)
    acr = min(max(float(acr), 0.0), 0.95)
    n = math.ceil((need + MARGIN_Z * math.sqrt(need * acr)) / (1.0 - acr) - 1e-9)
    return max(1, min(n, math.ceil(AUTO_MAX * need)))


def updated_estimate(estimate: float | None, observed: float) -> float:
    """The online ACR estimate after a step whose first round collapsed ``observed``."""
    if estimate is None:
        return float(observed)
    return (1 - EMA_WEIGHT) * estimate + EMA_WEIGHT * float(observed)
