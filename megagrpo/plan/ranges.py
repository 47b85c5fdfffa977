"""Low / central / high step times from the ranges of the assumptions (`plan-memory`).

Each ranged field of :class:`~megagrpo.plan.scenario.Assumptions` has the bounds its
docstring states and the end that makes a step faster. :func:`bounds` moves one assumption at
a time to each end of its range and combines the changes of the step time in quadrature (the
assumptions are independent; each range read as a plausible spread, not a hard limit): that
is ``low`` / ``high``. ``best`` / ``worst`` put every assumption at its fast / slow end at once
(the corners; a layout whose KV cache cannot hold the longer completions is infinite there).
Whatever ``--assume`` sets is a point, not a range: a field set away from its default is held
there.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass

from megagrpo.plan.scenario import Assumptions


@dataclass(frozen=True)
class Range:
    """Bounds of one assumption; ``fast``: the bound that makes a step faster (low | high)."""

    low: float
    high: float
    fast: str

    def end(self, faster: bool) -> float:
        """The bound at the fast end (``faster``) or at the slow end."""
        at_high = (self.fast == "high") == faster
        return self.high if at_high else self.low


RANGES: dict[str, Range] = {
    "moe_lora_decode_speed": Range(0.54, 0.65, "high"),
    "train_mfu": Range(0.20, 0.25, "high"),
    "mean_completion_tokens": Range(800.0, 1400.0, "low"),
    "mean_prompt_tokens": Range(200.0, 500.0, "low"),
    "completion_sigma": Range(0.4, 0.8, "low"),
    "decode_hbm_eff": Range(0.4, 0.6, "high"),
    "decode_mfu": Range(0.3, 0.6, "high"),
    "lora_hbm_eff": Range(0.35, 0.7, "high"),
    "comm_eff": Range(0.6, 0.8, "high"),
    "prefill_mfu": Range(0.3, 0.5, "high"),
    "partial_chunk_s": Range(0.05, 0.5, "low"),
    "loader_s_per_tensor": Range(1e-4, 5e-4, "low"),
    "loader_hbm_eff": Range(0.3, 0.7, "high"),
}
"""The ranged assumptions (each field's docstring names its source or says "assumption")."""


def corner(a: Assumptions, faster: bool) -> Assumptions:
    """``a`` with every ranged assumption still at its default moved to its fast
    (``faster``) or slow end; fields the user set (``--assume``) stay as set."""
    default = Assumptions()
    changes = {
        name: r.end(faster)
        for name, r in RANGES.items()
        if getattr(a, name) == getattr(default, name)
    }
    return dataclasses.replace(a, **changes)


def _moved(a: Assumptions, name: str, faster: bool) -> Assumptions:
    return dataclasses.replace(a, **{name: RANGES[name].end(faster)})


def bounds(step_s: Callable[[Assumptions], float], a: Assumptions) -> dict[str, float]:
    """``{"low", "central", "high", "best", "worst"}`` seconds per step of ``step_s`` (module
    doc)."""
    central = step_s(a)
    default = Assumptions()
    down = up = 0.0
    for name in RANGES:
        if getattr(a, name) != getattr(default, name):
            continue  # set by the user: a point
        for faster in (True, False):
            d = step_s(_moved(a, name, faster)) - central
            if d < 0:
                down += d * d
            else:
                up += d * d
    return {
        "low": central - math.sqrt(down),
        "central": central,
        "high": central + math.sqrt(up),
        "best": step_s(corner(a, True)),
        "worst": step_s(corner(a, False)),
    }
